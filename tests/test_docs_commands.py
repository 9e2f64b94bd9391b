"""Every command the documentation shows is run, or its flags are checked, by a test.

The commands are collected from README.md and ``docs/**/*.md`` (lines of ```` ```bash ````
blocks, and inline code that starts ``python``/``torchrun``/``make``), the first line of each
``docs/sim/*.txt`` (the command that printed it) and the usage lines of the examples' and
benchmarks' docstrings. Each must match one entry of ``HOW`` below, which says how it is tested:

  ==============  ===============================================================================
  ``run``         run here as written, with the given flags appended (fewer steps): argparse
                  takes the last value of a flag, so the documented flags are all exercised
  ``validate``    the example's own ``parse_args(argv)`` (every check it makes before any rank
                  starts, e.g. ``--batch`` against the world size), in this process; the runs
                  themselves are the named test's (with a smaller model)
  ``gpu``         ``validate`` with ``--device cpu`` where there is no GPU (the named test
                  checks what the command says without one)
  ``flags``       the script's argparse parser reads the flags (a benchmark: the run takes
                  minutes to hours; its figures are marked as measured, see test_docs_figures.py)
  ``test``        run by the named test (``path::function``) or Makefile target (``Makefile:target``)
  ``make``        a target of the Makefile
  ``pip``         an install line: the extras it names exist in pyproject.toml
  ==============  ===============================================================================

A new command in the pages fails ``test_every_documented_command_is_covered`` until it is given
an entry, so no command reaches the pages untested (as ``--world-size 3`` of
examples/your_model.py once did: its default batch did not divide over 3 ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
_INLINE = re.compile(r"`((?:OMP_NUM_THREADS=\d+ )?(?:python3? |torchrun |make )[^`]+)`")

# (regex over the command, kind, detail); the first match decides. detail: the test that runs it
# (validate), or the flags appended (run).
HOW: list[tuple[str, str, str]] = [
    (r"^make (demo|test|docs|docs-refresh|bench|setup)\b", "make", ""),
    (r"^pip install", "pip", ""),
    (r"^python -m pytest$", "test", "Makefile:test"),
    (r"^python -c$", "prose", ""),  # "not a notebook cell or `python -c`": not a command
    (r"^python examples/quickstart\.py$", "test", "tests/test_readme.py::test_quickstart_runs_and_the_loss_falls"),
    (r"^torchrun --nproc-per-node 2 examples/quickstart\.py$", "run", ""),
    (r"^python examples/your_model\.py$", "test", "tests/test_docs_figures.py::test_your_model_first_losses"),
    (r"^(python|torchrun .*) examples/your_model\.py\b", "run", "--steps 2 --log-every 1"),
    (r"^python examples/train_gpt\.py --resume runs/",  # the checkpoint the page's earlier commands wrote
     "test", "tests/test_train_gpt.py::test_readme_demo_commands_run_in_order_on_a_fresh_directory"),
    (r"^torchrun .* examples/train_gpt\.py .*--device cuda",  # on a GPU machine; here: the flags, with --device cpu
     "gpu", "tests/test_train_gpt.py::test_readme_torchrun_line_without_cuda_fails_on_every_rank_with_the_reason"),
    (r"^(python|torchrun .*) examples/train_gpt\.py\b",
     "validate", "tests/test_train_gpt.py::test_readme_demo_commands_run_in_order_on_a_fresh_directory"),
    (r"^(python|torchrun .*) examples/functional_loop\.py\b", "flags", ""),
    (r"^(python|torchrun .*) examples/tensor_parallel\.py\b", "flags", ""),
    (r"^(python|torchrun .*) examples/expert_parallel\.py\b", "flags", ""),
    (r"^python examples/finetune_hf\.py\b", "flags", ""),
    (r"^python examples/plan_search\.py\b", "flags", ""),
    (r"^python benchmarks/\w+\.py\b", "flags", ""),
]


def _norm(line: str) -> list[str] | None:
    """A shell line as argv: env assignments and ``$ `` dropped, ``python3`` read as ``python``."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        argv = shlex.split(line, comments=True)
    except ValueError:
        return None
    while argv and _ENV.match(argv[0]):
        argv = argv[1:]
    if not argv or argv[0] not in ("python", "python3", "torchrun", "make", "pip"):
        return None
    return ["python" if argv[0] == "python3" else argv[0]] + argv[1:]


def _bash_commands(text: str) -> list[str]:
    out = []
    for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```$", text, re.S | re.M):
        block = block.replace("\\\n", " ")
        variables = dict(re.findall(r"^(\w+)=\"([^\"]*)\"$", block, re.M))
        for line in block.splitlines():
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            out.append(line)
    return out


def documented_commands() -> dict[str, list[str]]:
    """``{command: [where it appears, ...]}`` over the pages, docs/sim/*.txt and docstrings."""
    found: dict[str, list[str]] = {}

    def add(line: str, where: str) -> None:
        argv = _norm(line)
        if argv and "..." not in argv and not any(a.startswith("[") for a in argv):  # a usage line's [optional] flags
            found.setdefault(shlex.join(argv), []).append(where)

    pages = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                                  recursive=True))
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for line in _bash_commands(text):
            add(line, page)
        prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
        for span in _INLINE.findall(prose):
            add(span, page)
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "sim", "*.txt"))):
        with open(path, encoding="utf-8") as f:
            add(f.readline(), os.path.relpath(path, ROOT))
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))):
        with open(path, encoding="utf-8") as f:
            doc = re.match(r'\s*(?:#.*\n)*\s*"""(.*?)"""', f.read(), re.S)
        for line in (doc[1] if doc else "").replace("\\\\\n", " ").splitlines():
            if re.match(r"\s+(python|torchrun|OMP_NUM_THREADS)", line):
                add(line, os.path.relpath(path, ROOT))
    return found


COMMANDS = documented_commands()


def how(command: str) -> tuple[str, str]:
    for pattern, kind, detail in HOW:
        if re.search(pattern, command):
            return kind, detail
    raise LookupError(command)


def test_the_collector_finds_the_commands_the_pages_are_known_to_show():
    # Guards the collector: if it stopped finding commands, every check below would pass vacuously.
    for command in ["python examples/quickstart.py", "python examples/your_model.py --world-size 3 --strategy zero2 --steps 100",
                    "torchrun --nproc-per-node 2 examples/quickstart.py", "make test",
                    "python benchmarks/sim_validate.py --width 512 --vocab 4096 --seq 256 --steps 5 --world-sizes 4 --optimizers muon"]:
        assert command in COMMANDS, sorted(COMMANDS)
    assert len(COMMANDS) > 50, len(COMMANDS)


def test_every_documented_command_is_covered():
    missing = []
    for command, where in COMMANDS.items():
        try:
            how(command)
        except LookupError:
            missing.append(f"{command}  ({', '.join(sorted(set(where)))})")
    assert not missing, "commands the pages show that no test runs (add them to HOW):\n" + "\n".join(missing)


def test_the_named_tests_exist():
    for _, kind, detail in HOW:
        if kind in ("validate", "test", "gpu") and "::" in detail:
            path, name = detail.split("::")
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert re.search(rf"^def {name}\(", f.read(), re.M), detail
        elif kind == "test":
            path, target = detail.split(":")
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert re.search(rf"^{target}:", f.read(), re.M), detail


def _kind(command: str) -> str | None:
    try:
        return how(command)[0]
    except LookupError:
        return None  # test_every_documented_command_is_covered names it


def _of(kind: str) -> list[str]:
    return sorted(c for c in COMMANDS if _kind(c) == kind)


def test_make_targets_exist():
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    for command in _of("make"):
        target = command.split()[1]
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"`{command}`: the Makefile has no target {target}"


def test_pip_lines_name_extras_that_exist():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    for command in _of("pip"):
        for extras in re.findall(r"\.\[([\w,]+)\]", command):
            for extra in extras.split(","):
                assert re.search(rf"^{extra} = \[", pyproject, re.M), f"`{command}`: pyproject.toml has no extra {extra!r}"


def _script(argv: list[str]) -> tuple[str, list[str], int]:
    """(script path, its flags, world size) of a ``python``/``torchrun`` command."""
    world = 1
    if argv[0] == "torchrun":
        i = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        opts = argv[1:i]
        for flag in ("--nproc-per-node", "--nproc_per_node", "-n"):
            if flag in opts:
                world = int(opts[opts.index(flag) + 1])
        return os.path.join(ROOT, argv[i]), argv[i + 1 :], world
    return os.path.join(ROOT, argv[1]), argv[2:], world


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse parses, then the script stops: its flags are read, nothing runs."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


@pytest.mark.parametrize("command", _of("flags"))
def test_flags_parse(command, monkeypatch):
    path, flags, _ = _script(shlex.split(command))
    monkeypatch.setattr(sys, "argv", [path, *flags])
    with _stop_after_parsing(), pytest.raises(_Parsed):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:  # argparse's error exit: the message is on stderr
            pytest.fail(f"`{command}` (shown in {COMMANDS[command]}): its flags do not parse (exit {e.code})")


@functools.cache
def _module(path: str):
    name = f"_docs_{os.path.basename(path)[:-3]}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("command", _of("validate") + _of("gpu"))
def test_examples_accept_their_documented_flags(command, monkeypatch, tmp_path):
    path, flags, world = _script(shlex.split(command))
    if _kind(command) == "gpu" and not torch.cuda.is_available():
        flags = ["cpu" if f == "cuda" else f for f in flags]
    if world > 1:  # under torchrun the script reads the world size from the launcher
        monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.chdir(tmp_path)  # --resume paths resolve against a fresh directory, as in the tests that run them
    mod = _module(path)
    try:
        mod.parse_args(flags)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return
        pytest.fail(f"`{command}` (shown in {COMMANDS[command]}) is refused before it starts (exit {e.code})")


@pytest.mark.parametrize("command", _of("run"))
def test_commands_run(command, tmp_path):
    argv = shlex.split(command)
    extra = shlex.split(how(command)[1])
    path, flags, world = _script(argv)
    if "your_model" in path:
        extra += ["--out", str(tmp_path / "out")]
    if argv[0] == "torchrun":
        i = argv.index(next(a for a in argv if a.endswith(".py")))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:i], path, *flags, *extra]
    else:
        cmd = [sys.executable, path, *flags, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"`{command}` failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    if "quickstart" in path:  # one result line, from rank 0, however many ranks print
        assert len(re.findall(r"^loss \d+\.\d+ -> \d+\.\d+ in 20 steps$", proc.stdout, re.M)) == 1, proc.stdout
