"""The layer diagram of docs/design.md is true to the imports: every module of a layer imports,
at module level, only from its own line of the diagram or the lines below it.

Read from the diagram itself, so the picture users read and the code cannot drift apart. Imports
inside functions (deferred, to reach an upper layer at call time) and under ``TYPE_CHECKING``
are not dependencies of loading a module, and are not checked."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _layers() -> dict[str, int]:
    """``{package or module: line}`` of the diagram, top line 0."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    levels: dict[str, int] = {}
    for i, line in enumerate(ln for ln in block.splitlines() if ln.strip()):
        for name in re.findall(r"\bfsdpfn(?:\.\w+)?\b", line.split("  ", 1)[0] if not line.startswith(" ") else ""):
            levels.setdefault(name, i)
    return levels


def _layer_of(module: str, levels: dict[str, int]) -> str | None:
    parts = module.split(".")
    name = ".".join(parts[:2])
    return name if name in levels else None


def _module_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """``(module imported, line)`` of each module-level fsdpfn import of ``path``."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "fsdpfn":
                if n.module == "fsdpfn":  # from fsdpfn import comm
                    out += [(f"fsdpfn.{a.name}", n.lineno) for a in n.names]
                else:
                    out.append((n.module, n.lineno))
            elif isinstance(n, ast.Import):
                out += [(a.name, n.lineno) for a in n.names if a.name.split(".")[0] == "fsdpfn"]
    return out


def test_the_diagram_names_every_layer():
    levels = _layers()
    for name in ("fsdpfn.sim", "fsdpfn.runtime", "fsdpfn._plan", "fsdpfn.comm", "fsdpfn.fp8", "fsdpfn._wire"):
        assert name in levels, name
    assert levels["fsdpfn.sim"] < levels["fsdpfn._plan"] < levels["fsdpfn.comm"] < levels["fsdpfn._wire"]


def _upward_imports(package: pathlib.Path, levels: dict[str, int]) -> list[str]:
    """Each module-level import in ``package`` (a checkout's ``fsdpfn/``) of a layer drawn above
    the importing module's."""
    wrong = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        src = _layer_of(module, levels)
        if src is None:  # not drawn (the package's own __init__, models, ft): not a layer
            continue
        for target, line in _module_imports(path):
            dst = _layer_of(target, levels)
            if dst is not None and levels[dst] < levels[src]:
                wrong.append(f"{path.relative_to(package.parent)}:{line} imports {target} ({dst} is drawn above {src})")
    return wrong


def test_every_import_points_to_the_same_line_or_below():
    wrong = _upward_imports(ROOT / "fsdpfn", _layers())
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check can fail: comm importing the plan layer (as it once did, for the wire formula)."""
    (tmp_path / "fsdpfn" / "comm").mkdir(parents=True)
    (tmp_path / "fsdpfn" / "comm" / "_record.py").write_text("import torch\nfrom fsdpfn._plan.wire import wire_bytes\n")
    (tmp_path / "fsdpfn" / "_plan").mkdir()
    (tmp_path / "fsdpfn" / "_plan" / "steps.py").write_text("from fsdpfn._wire import wire_bytes\n")
    assert _upward_imports(tmp_path / "fsdpfn", _layers()) == [
        "fsdpfn/comm/_record.py:2 imports fsdpfn._plan.wire (fsdpfn._plan is drawn above fsdpfn.comm)"
    ]
