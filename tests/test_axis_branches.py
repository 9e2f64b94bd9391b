"""The step machine does not branch on an axis: the op list's builder and expansion, every
runtime and simulator module but the pipeline's own ask the axis tables
(``fsdpfn/_plan/exchanges.py`` for the activation exchanges, ``fsdpfn/_plan/placements.py`` for
where parameters live, ``fsdpfn/_plan/tp_styles.py`` for tensor-parallel styles,
``fsdpfn/_plan/attention.py`` for attention over cp) or the axis's own modules, and never name
tensor, expert, context or pipeline parallelism themselves. A new axis is then a row of those
tables, not a branch in every reader.

An axis branch is counted in code, not in docstrings or comments: a ``Role.TP``/``EP``/``CP``/
``PP`` member, a per-axis size (``tp_size``, ``ep_size``, ``cp_size``, ``pp_size``), a plan's
``tp`` styles, an expert unit's ``experts``/``top_k``, or a string that names an axis's purpose
(``"tp_..."``, ``"ep_..."``, ``"cp_..."``, ``"pp_..."``).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The pipeline's own modules (its runtime, its walk's pricing): pp's, as _cp.py is cp's.
PIPELINE_OWN = ("fsdpfn/runtime/_pipeline.py", "fsdpfn/sim/_pipeline.py", "fsdpfn/sim/_pipeline_times.py")
AXIS_FREE = (
    "fsdpfn/_plan/steps.py",
    "fsdpfn/_plan/schedule.py",
    "fsdpfn/_plan/cost.py",
    "fsdpfn/transforms/_unit_comm.py",
    # every runtime and every simulator module but the pipeline's own
    *sorted(
        str(p.relative_to(ROOT))
        for d in ("fsdpfn/runtime", "fsdpfn/sim")
        for p in (ROOT / d).glob("*.py")
        if str(p.relative_to(ROOT)) not in PIPELINE_OWN
    ),
)
AXIS_ROLES = {"TP", "EP", "CP", "PP"}
AXIS_ATTRIBUTES = {"tp_size", "ep_size", "cp_size", "pp_size", "experts", "top_k"}
AXIS_PREFIXES = ("tp_", "ep_", "cp_", "pp_")


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def axis_branches(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each axis branch in ``source`` (see the module's docstring)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "Role" and node.attr in AXIS_ROLES:
                out.append((node.lineno, f"Role.{node.attr}"))
            elif node.attr in AXIS_ATTRIBUTES or (node.attr == "tp" and ast.unparse(node.value).endswith("plan")):
                out.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value.startswith(AXIS_PREFIXES) and " " not in node.value:
                out.append((node.lineno, repr(node.value)))
    return sorted(out)


def test_the_list_covers_the_runtimes_and_the_simulator():
    assert {"fsdpfn/runtime/_executor.py", "fsdpfn/sim/_workload.py", "fsdpfn/sim/_optimizer.py"} <= set(AXIS_FREE)
    assert not set(PIPELINE_OWN) & set(AXIS_FREE) and all((ROOT / p).exists() for p in PIPELINE_OWN)


def test_the_step_machine_asks_the_axis_tables_and_names_no_axis():
    found = {
        path: branches for path in AXIS_FREE if (branches := axis_branches((ROOT / path).read_text(encoding="utf-8")))
    }
    assert not found, found


def test_the_count_sees_each_spelling_of_a_branch():
    source = '''
def f(plan, unit, c):
    """tp_size and Role.TP in a docstring are not branches."""
    if plan.cp_size > 1:  # a per-axis size
        pass
    if c.role is Role.EP or unit.experts:
        pass
    if c.purpose in ("cp_ring", "cp_ring_grad"):
        pass
    return plan.tp, "tp and cp in a sentence"
'''
    got = [what for _, what in axis_branches(source)]
    assert got == [".cp_size", ".experts", "Role.EP", "'cp_ring'", "'cp_ring_grad'", ".tp"], got
