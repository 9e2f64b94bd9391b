"""Module-level state only where a process really has one, and each says why.

A module-level container that starts empty (or a one-element list used as a cell) is state that
every caller in the process shares: a registry, a cache, a stack of active modes, the flight
recorder, the pools of a test session. Each one in fsdpfn carries a ``Process state:`` comment,
on its line or in the comment block right above it (one block may cover a run of them), saying
why the process is the right owner. A new one without it fails here, naming where it is."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAG = "Process state:"
_FACTORIES = {
    "dict",
    "list",
    "set",
    "deque",
    "local",
    "defaultdict",
    "OrderedDict",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}


def _is_state(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.Set)):
        return not (value.keys if isinstance(value, ast.Dict) else value.elts)
    if isinstance(value, ast.List):  # [] or a one-element cell such as [0]
        return len(value.elts) == 0 or (len(value.elts) == 1 and isinstance(value.elts[0], ast.Constant))
    if isinstance(value, ast.Call):
        name = ast.unparse(value.func).rsplit(".", 1)[-1]
        return (
            name in _FACTORIES
            and not value.args[1:]
            and not (value.args and not isinstance(value.args[0], ast.Constant) and name in ("dict", "list", "set"))
        )
    return False


def _states(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each module-level state container of ``source``."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and node.value is not None and _is_state(node.value):
            out += [(node.lineno, ast.unparse(t)) for t in node.targets if not ast.unparse(t).startswith("__")]
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_state(node.value):
            out.append((node.lineno, ast.unparse(node.target)))
    return out


def _unexplained(source: str) -> list[tuple[int, str]]:
    lines = source.splitlines()
    state_lines = {line for line, _ in _states(source)}
    missing = []
    for line, name in _states(source):
        i, said = line - 1, TAG in lines[line - 1]
        # up through the comments and the other state lines right above (a blank line ends it)
        while not said and i > 0 and (lines[i - 1].lstrip().startswith("#") or i in state_lines):
            i -= 1
            said = TAG in lines[i]
        if not said:
            missing.append((line, name))
    return missing


def test_every_module_level_state_says_why_the_process_owns_it():
    missing = []
    for path in sorted((ROOT / "fsdpfn").rglob("*.py")):
        missing += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in _unexplained(path.read_text())]
    assert not missing, (
        f"module-level state without a '# {TAG} ...' comment saying why the process owns it "
        "(or move it into the value it belongs to):\n" + "\n".join(missing)
    )


def test_the_check_finds_state_and_reads_its_comment():
    source = (
        "_CACHE: dict = {}\n"
        "TABLE = {'a': 1}\n"
        "\n"
        "# Process state: the registry, looked up by name.\n"
        "_REGISTRY: dict = {}\n"
        "_ALSO = []\n"
        "\n"
        "_CELL = [0]  # Process state: a counter\n"
        "\n"
        "_LOCAL = threading.local()\n"
    )
    assert [n for _, n in _states(source)] == ["_CACHE", "_REGISTRY", "_ALSO", "_CELL", "_LOCAL"]
    assert _unexplained(source) == [(1, "_CACHE"), (10, "_LOCAL")]
