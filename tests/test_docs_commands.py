"""Every command the documentation shows is run by a test (an install line or a make target: checked).

The commands are collected from README.md and ``docs/**/*.md`` (lines of ```` ```bash ````
blocks, and inline code that starts ``python``/``torchrun``/``make``), the first line of each
``docs/sim/*.txt`` (the command that printed it) and the usage lines of the examples' and
benchmarks' docstrings. Each must match one entry of ``HOW`` below, which says how it is tested:

  ==============  ===============================================================================
  ``run``         run as written, in a fresh process, with the given flags appended (fewer
                  steps, a smaller model): argparse takes the last value of a flag. Commands that
                  parse to the same arguments once shortened are one run (see ``RUNS``)
  ``here``        ``run``, in this process (``runpy``, the script's ``sys.argv`` as given): a
                  command that starts no rank, so a fresh interpreter would cost more than it
  ``validate``    the example's own ``parse_args(argv)`` (every check it makes before any rank
                  starts, e.g. ``--batch`` against the world size), in this process; the runs
                  themselves are the named test's (with a smaller model)
  ``gpu``         ``validate`` with ``--device cpu`` where there is no GPU (the named test
                  checks what the command says without one)
  ``test``        run by the named test (``path::function``) or Makefile target (``Makefile:target``)
  ``make``        a target of the Makefile
  ``pip``         an install line: the extras it names exist in pyproject.toml
  ==============  ===============================================================================

A session runs one command of each script (``EVERY_SESSION``) and skips the others with the
reason; ``FSDPFN_DOCS_COMMANDS=all python -m pytest tests/test_docs_commands.py`` runs every one.

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
import io
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
# (validate, test, gpu), or the flags appended (run, here), where {tmp} and {shared} are directories
# (see _PLACES).
HOW: list[tuple[str, str, str]] = [
    (r"^make (demo|test|docs|docs-refresh|bench|setup|gpu-check)\b", "make", ""),
    (r"^pip install", "pip", ""),
    (r"^python -m pytest$", "test", "Makefile:test"),
    (r"^python -c$", "prose", ""),  # "not a notebook cell or `python -c`": not a command
    (r"^python examples/quickstart\.py$", "test", "tests/test_readme.py::test_quickstart_runs_and_the_loss_falls"),
    (r"^torchrun --nproc-per-node 2 examples/quickstart\.py$", "run", ""),
    (r"^python examples/your_model\.py$", "test", "tests/test_docs_figures.py::test_your_model_first_losses"),
    (r"^(python|torchrun .*) examples/your_model\.py\b", "run", "--steps 2 --log-every 1 --out {tmp}/out"),
    (
        r"^python examples/train_gpt\.py --resume runs/",  # the checkpoint the page's earlier commands wrote
        "test",
        "tests/test_train_gpt.py::test_readme_demo_commands_run_in_order_on_a_fresh_directory",
    ),
    (
        r"^torchrun .* examples/train_gpt\.py .*--device cuda",  # on a GPU machine; here: the flags, with --device cpu
        "gpu",
        "tests/test_train_gpt.py::test_readme_torchrun_line_without_cuda_fails_on_every_rank_with_the_reason",
    ),
    # The fault-tolerant demo, run for real: a lighthouse, two replica groups of 2 ranks, a tiny
    # model; the fault (a rank of group 1 killed in step 3) leaves the survivors finishing before
    # the restarted group is up, which then has nothing to rejoin (tests/test_ft_faults.py runs
    # the rejoins).
    (
        r"^python examples/train_gpt\.py .*--ft\b.*--resume\b",
        "test",
        "tests/test_ft_faults.py::test_demo_ft_resume_continues_every_group_from_its_checkpoint",
    ),
    (
        r"^python examples/train_gpt\.py .*--ft\b.*--fault",
        "run",
        "--steps 6 --fault 1:1:3:kill --step-delay 0 --width 16 --depth 1 --heads 2 --seq-len 16 --batch-size 2 "
        "--log-every 1 --eval-every 0 --sample-chars 0 --no-progress --ckpt-every 3 --ft-timeout 10 --out {tmp}/ft",
    ),
    (
        r"^python examples/train_gpt\.py .*--ft\b",
        "run",
        "--steps 4 --width 16 --depth 1 --heads 2 --seq-len 16 --batch-size 2 --log-every 1 --eval-every 0 "
        "--sample-chars 0 --no-progress --ckpt-every 2 --ft-timeout 10 --out {tmp}/ft",
    ),
    (
        r"^(python|torchrun .*) examples/train_gpt\.py\b",
        "validate",
        "tests/test_train_gpt.py::test_readme_demo_commands_run_in_order_on_a_fresh_directory",
    ),
    (
        r"^python examples/tensor_parallel\.py$",
        "test",
        "tests/test_tp.py::test_the_tensor_parallel_example_resumes_at_another_tp_degree",
    ),
    (r"^(python|torchrun .*) examples/functional_loop\.py\b", "run", "--steps 2"),
    (r"^(python|torchrun .*) examples/(tensor|expert)_parallel\.py\b", "run", "--steps 2 --dir {tmp}/ckpt"),
    (
        r"^python examples/finetune_hf\.py --model ",  # a local directory; the test builds one in the hub's layout
        "test",
        "tests/test_finetune_hf.py::test_finetune_hf_runs_on_a_hub_layout_directory",
    ),
    (
        r"^python examples/finetune_hf\.py$",
        "run",
        "--steps 2 --log-every 1 --batch-size 2 --seq-len 16 --sample-tokens 5 --no-progress --out {tmp}/hf",
    ),
    # One micro-batch per rank and one prefetch depth: the search, not its breadth (4M tokens of
    # Llama 8B on 64 ranks are 16 micro-batches, each simulated).
    (
        r"^python examples/plan_search\.py .*--hardware measure",
        "run",
        "--global-tokens 4096 --prefetch 1",
    ),  # starts ranks
    # The page's plain search (and its plot) on 8 ranks, not 64: the same search over fewer mesh shapes.
    (
        r"^python examples/plan_search\.py( --plot \S+)?$",
        "here",
        "--gpus 8 --global-tokens 4096 --prefetch 1 --plot {tmp}/pick.png",
    ),
    (r"^python examples/plan_search\.py\b", "here", "--global-tokens 4096 --prefetch 1 --plot {tmp}/pick.png"),
    (r"^python benchmarks/compile_bucket\.py\b", "run", "--steps 1"),
    # On a GPU the check runs for minutes and installs what is missing: its dry run (CUDA hidden),
    # its flags and its steps' code are tests/test_gpu_check.py's.
    (
        r"^python benchmarks/gpu_check\.py\b",
        "test",
        "tests/test_gpu_check.py::test_the_dry_run_says_skipped_no_cuda_for_every_step",
    ),
    # Two short sequences at every cp degree, and the projection of its first row (cp 1, 32k tokens).
    (r"^python benchmarks/cp\.py\b", "run", "--seqs 256,512 --project-cps 1"),
    # The census of one block: the breaks are the runtime's, the same at any depth (a third less tracing).
    (r"^python benchmarks/compile_probe\.py\b", "run", "--depth 1"),
    # One small vocabulary, whole and split: the same code as the page's three.
    (r"^python benchmarks/vocab\.py\b", "run", "--vocabs 512 --seq 32"),
    # The bubbles (instant), the schedules measured on 2 gloo ranks (fewer steps, a smaller GPT)
    # and the 405B projection (a profile on meta, seconds); in a process of its own, as it starts ranks.
    (r"^python benchmarks/pp\.py\b", "run", "--measure-steps 2 --measure-width 32 --measure-seq 16"),
    (r"^python benchmarks/exit_stress\.py\b", "run", "-n 1"),
    (r"^python benchmarks/flight_recorder\.py\b", "run", "--calls 5 --rounds 3"),
    (r"^python benchmarks/checkpoint\.py\b", "run", "--quick"),
    (r"^python benchmarks/bad_inputs\.py\b", "run", ""),  # the whole catalogue: under a minute
    (r"^python benchmarks/fuzz\.py\b", "run", "--examples 2 --timeout 60"),  # the last --examples given wins
    (r"^python benchmarks/verify\.py\b", "run", "--width 32 --depth 1 --heads 2 --vocab 64 --seq 16 --repeats 1"),
    (r"^python benchmarks/replicas\.py\b", "run", "--steps 9 --fault 4"),
    # The whole pipeline (a lighthouse of its own, the demo, the checks and the replay) on a
    # run without a fault: the faults are tests/test_ft_faults.py's.
    (r"^python benchmarks/chaos\.py\b", "run", "--faults 0 --steps 4 --ckpt-every 2 --step-delay 0 --no-baseline"),
    # A replica group of a fault-tolerant job needs a lighthouse and peers: the test starts both.
    (
        r"^python examples/ft_replicas\.py\b",
        "test",
        "tests/test_ft.py::test_a_lost_replica_does_not_stop_the_job_and_a_restarted_one_rejoins",
    ),
    (
        r"^python benchmarks/fp8_gather\.py\b",
        "run",
        "--width 64 --vocab 256 --seq 32 --small-width 64 --small-vocab 256 --small-seq 32 --batch 1 --steps 1 --warmup 0 "
        "--demo-steps 10 --runs {shared}/fp8_off {shared}/fp8_on --plot {tmp}/fp8_loss.png",
    ),
    (
        r"^python benchmarks/init_memory\.py\b",
        "run",
        "--world-size 2 --width 64 --depth 1 --heads 2 --vocab 64 --seq-len 16",
    ),
    (
        r"^python benchmarks/memory_levers\.py\b",
        "run",
        "--steps 1 --width 64 --depth 2 --heads 2 --vocab 128 --seq 32 --batch 1",
    ),
    (r"^python benchmarks/moe\.py\b", "run", "--width 32 --tokens 32 --steps 1 --warmup 0"),
    (r"^python benchmarks/muon\.py --project$", "here", ""),
    # With --mesh (a tp axis of up to 4), heads that every tp degree divides.
    (
        r"^python benchmarks/muon\.py .*--mesh\b",
        "run",
        "--width 64 --depth 1 --vocab 128 --seq 16 --heads 4 --batch 1 --steps 1 --warmup 0 --batches 1,2",
    ),
    (
        r"^python benchmarks/muon\.py\b",
        "run",
        "--width 64 --depth 1 --vocab 128 --seq 16 --heads 2 --batch 1 --steps 1 --warmup 0 --batches 1,2",
    ),
    (
        r"^python benchmarks/sim_project\.py\b",
        "here",
        "--models 8b --gpus 8 --global-tokens 32768",
    ),  # one search, not eight
    (r"^python benchmarks/sim_published\.py\b", "here", "--max-rows 2"),
    # Every grid command runs as the whole grid (each strategy, prefetch depth and optimizer: a
    # superset of what each command picks) on a tiny model at one world size; each search check
    # at one world size and one budget.
    (
        r"^python benchmarks/sim_validate\.py\b",
        "run",
        "--world-sizes 4 --strategies local,replicate,zero1,zero2,zero3,hsdp --optimizers adamw,muon --search-budget-mib 128 "
        "--width 32 --depth 2 --heads 2 --vocab 64 --seq 16 --batch 1 --steps 1 --warmup 0 --probe-repeats 1",
    ),
    (
        r"^python benchmarks/tp\.py\b",
        "run",
        "--width 32 --depth 1 --heads 4 --vocab 64 --seq 16 --batch 1 --steps 1 --warmup 0",
    ),
    # Two configurations, between them each strategy and each precision the commands name; the
    # peak memory (a fresh 2-rank launch per side) of one of them: the same code for each.
    (
        r"^python benchmarks/vs_fsdp2\.py\b(?!.*--compile)",
        "run",
        "--width 64 --depth 1 --heads 2 --vocab 128 --seq 16 --batch 1 --steps 1 --warmup 0 --memory-steps 1 --configs zero2:fp32,zero3:bf16 "
        "--memory-configs zero3:bf16",
    ),
    (
        r"^python benchmarks/vs_fsdp2\.py\b",
        "run",
        "--width 64 --depth 1 --heads 2 --vocab 128 --seq 16 --batch 1 --steps 1 --warmup 0",
    ),
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

    pages = ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    )
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
    for path in sorted(
        glob.glob(os.path.join(ROOT, "examples", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    ):
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
    for command in [
        "python examples/quickstart.py",
        "python examples/your_model.py --world-size 3 --strategy zero2 --steps 100",
        "torchrun --nproc-per-node 2 examples/quickstart.py",
        "make test",
        "python benchmarks/sim_validate.py --width 512 --vocab 4096 --seq 256 --steps 5 --world-sizes 4 --optimizers muon",
    ]:
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
                assert re.search(rf"^{extra} = \[", pyproject, re.M), (
                    f"`{command}`: pyproject.toml has no extra {extra!r}"
                )


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
    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse parses, then the script stops with what it parsed: nothing runs."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


# The places a run writes to, in the flags HOW appends: this run's directory, and one that the
# runs of this module share (a later command reuses what an earlier one wrote, as the pages say).
_PLACES = ("{tmp}", "{shared}")


def _with_places(flags: str, tmp: str, shared: str) -> list[str]:
    return shlex.split(flags.replace("{tmp}", tmp).replace("{shared}", shared))


def _what_it_parses(command: str) -> str:
    """What the script's argparse makes of the command and the flags HOW appends (the argv itself
    if they do not parse, so that the run shows the error)."""
    argv = shlex.split(command)
    path, flags, _ = _script(argv)
    with open(path, encoding="utf-8") as f:
        if "parse_args" not in f.read():  # no flags to parse (examples/quickstart.py): running it would train
            return repr(argv)
    flags += _with_places(how(command)[1], "/TMP", "/SHARED")
    saved = dict(os.environ), list(sys.path), sys.argv
    sys.argv = [path, *flags]
    try:
        with (
            _stop_after_parsing(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            runpy.run_path(path, run_name="__main__")
    except _Parsed as parsed:
        return repr(sorted(vars(parsed.namespace).items()))
    except BaseException:  # noqa: BLE001 - SystemExit of a flag that does not parse, or an import error: the run says which
        pass
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.path[:], sys.argv = saved[1], saved[2]
    return repr(argv)


def _runs() -> dict[str, list[str]]:
    """``{command run: [the documented commands it stands for]}``: commands that, with the flags HOW
    appends, parse to the same arguments under the same launcher are one run (``--steps 12`` and
    ``--steps 20`` are both ``--steps 1`` once shortened)."""
    groups: dict[tuple, list[str]] = {}
    for command in _of("run") + _of("here"):
        argv = shlex.split(command)
        launcher = tuple(argv[: next(i for i, a in enumerate(argv) if a.endswith(".py"))])
        groups.setdefault((launcher, _script(argv)[0], _what_it_parses(command)), []).append(command)
    return {same[0]: same for same in groups.values()}


RUNS = _runs()


def test_runs_stand_for_the_commands_that_parse_alike():
    # Guards the grouping: shortened step counts merge, a different mode or launcher does not.
    def run_of(command):
        return next(c for c, same in RUNS.items() if command in same)

    assert run_of("python benchmarks/moe.py --steps 20") == run_of("python benchmarks/moe.py")
    assert run_of("python benchmarks/muon.py --project") != run_of("python benchmarks/muon.py")
    assert run_of("torchrun --nproc-per-node 2 examples/functional_loop.py") != run_of(
        "python examples/functional_loop.py"
    )
    assert sorted(c for same in RUNS.values() for c in same) == sorted(_of("run") + _of("here"))
    assert len(RUNS) > 30, len(RUNS)


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


@pytest.mark.parametrize("command", sorted(c for c in _of("run") if c.startswith("torchrun ")))
def test_torchrun_commands_accept_their_flags_at_the_launchers_world_size(command, monkeypatch, tmp_path):
    # Every session, each torchrun command as written: every check its script makes before a rank
    # starts, with the environment torchrun gives rank 0 (WORLD_SIZE the --nproc-per-node), in this
    # process. A session launches one of them (TORCHRUN_EVERY_SESSION); FSDPFN_DOCS_COMMANDS=all, each.
    path, flags, world = _script(shlex.split(command))
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if "parse_args" not in source:  # no flags (examples/quickstart.py): nothing to check but the launch
        assert command == TORCHRUN_EVERY_SESSION, f"`{command}` has no flags to check: make it the launch of a session"
        return
    for name, value in (("WORLD_SIZE", str(world)), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ), list(sys.path), sys.argv
    sys.argv = [path, *flags]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if re.search(
                r"^def parse_args\(", source, re.M
            ):  # and its own checks after argparse's (examples/your_model.py)
                _module(path).parse_args(flags)
            else:
                with _stop_after_parsing():
                    runpy.run_path(path, run_name="__main__")
                pytest.fail(f"`{command}`: {os.path.relpath(path, ROOT)} parsed no arguments")
    except _Parsed:
        pass
    except SystemExit as e:
        if e.code not in (0, None):
            pytest.fail(
                f"`{command}` (shown in {COMMANDS[command]}) is refused before a rank starts (exit {e.code}):\n"
                f"{err.getvalue()[-2000:]}"
            )
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.path[:], sys.argv = saved[1], saved[2]


# What a run prints when it gets to its end: (commands, the result lines each prints once). The
# figures in them are measured (test_docs_figures.py), not checked here; what the lines say that is
# not measured is (an example's sharded run agrees with one process, the counted bytes with the
# formula, no non-zero exit).
RESULTS: list[tuple[str, list[str]]] = [
    (r"examples/quickstart\.py", [r"^loss \d+\.\d+ -> \d+\.\d+ in 20 steps$"]),
    (r"examples/functional_loop\.py", [r"^max relative difference to the one-process run: "]),
    (
        r"examples/tensor_parallel\.py",
        [r"^saved step_\d+ on dp=\d x tp=\d, resumed on dp=\d x tp=\d; final loss \d\.\d+$"],
    ),
    (
        r"examples/expert_parallel\.py",
        [r"^saved step_\d+ on ep=\d x edp=\d, resumed on ep=\d x edp=\d; final loss \d\.\d+$"],
    ),
    (r"examples/(tensor|expert)_parallel\.py", [r"^largest relative difference from one process: "]),
    (r"examples/plan_search\.py", [r"^pick: ", r"^  plan = fsdpfn\.plan\(model, mesh, "]),
    (r"compile_bucket\.py", [r"^step time, bucket=True / bucket=False: "]),
    (
        r"benchmarks/cp\.py(?!.*--no-gloo)",
        [r"^cp exchange counted == listed \(calls, bytes\) in (\d+)/\1 rows; every rank sends the same: True$"],
    ),
    (r"benchmarks/cp\.py(?!.*--no-project)", [r"^\(\d+ s\) projected / torchtitan tokens/s/GPU: "]),
    (r"benchmarks/pp\.py", [r"^largest \|op lists - closed form\|: .*; equal to rounding: True$"]),
    (r"compile_probe\.py", [r"^runtime: forward \+ loss\.backward\(\): \d+ graph"]),
    (r"benchmarks/checkpoint\.py", [r"^async/sync stall ratio: \d+\.\d+$"]),
    (r"bad_inputs\.py", [r"^\d+ cases in \d+ s: \d+ named, 0 unnamed, \d+ correct, 0 silent$"]),
    (r"benchmarks/replicas\.py", [r"^steps lost, fsdpfn\.ft / stop-and-restart: \d+\.\d+x$"]),
    (r"exit_stress\.py", [r"^non-zero exits: 0$"]),
    (r"flight_recorder\.py", [r"^after +\d"]),
    (
        r"fp8_gather\.py(?!.*--parts)|--parts bytes",
        [r"^counted == plan\.cost\(\) for all-gather and reduce-scatter: True;"],
    ),
    (r"fp8_gather\.py(?!.*--parts)|--parts \S*time", [r"^\| training step, params fp32, "]),
    (r"fp8_gather\.py(?!.*--parts)|--parts \S*loss", [r"^plot: "]),
    (r"init_memory\.py", [r"^\| way to get the shards \|"]),
    (r"memory_levers\.py", [r"^Projected with fsdpfn\.sim: "]),
    (r"moe\.py", [r"^dp=4: step "]),
    (r"muon\.py$", [r"^\| training step: muon owner \(A\) vs adamw \(B\) \|"]),
    (r"muon\.py .*--tokens-sweep", [r"^\| batch/rank \|"]),
    (r"sim_project\.py", [r"^\(\d+ s to simulate \d+ rows\)$"]),
    (r"sim_published\.py", [r"^sources: "]),
    (r"sim_validate\.py(?!.*--search-check)", [r"^memory: \d+/\d+ rows within 5%"]),
    (r"sim_validate\.py .*--search-check", [r"^\| 4 \| "]),
    (r"benchmarks/tp\.py", [r"^every call equal to the list .*: True; the same counts on every rank: True"]),
    (
        r"vs_fsdp2\.py(?!.*--compile)",
        [
            r"^collective calls per step \(rank 0\):$",
            r"^  zero3 bf16 \| .* \| \d+\.\d\d \(\d+/\d+ MiB\) \| [\d.]+ MiB$",
        ],
    ),  # its peak memory measured
    (r"vs_fsdp2\.py .*--compile", [r"^whole-step compile "]),
]
AGREES = r"^(?:max|largest) relative difference (?:to|from) (?:the )?one[- ]process(?: run)?: (\S+)$"

# Every session runs one command per script and launcher (the first of them); FSDPFN_DOCS_COMMANDS=all
# runs the others too. All of them cost ~4x the CI budget: most of a run is starting processes
# (~2.5 s of CPU each: import torch), and the pages show ~60 different runs.
ALL = os.environ.get("FSDPFN_DOCS_COMMANDS") == "all"


# The script's cheapest run where its first command is not (fewer launches).
CHEAPEST = {
    "python benchmarks/exit_stress.py -n 5 --ways spawn torchrun",
    "python benchmarks/sim_project.py --models 8b --gpus 8,64 --no-search",
    "python benchmarks/fp8_gather.py --parts bytes,time --steps 3 --warmup 1",
}


# Scripts none of whose commands fits a session: inductor compiles the model twice, whatever the
# steps (over 90 s of CPU per rank, measured on 2 cores).
TOO_SLOW = {"compile_bucket.py"}


# The one torchrun launch of a session (the agent starting the ranks, each reading its rank and
# the world size from it, the result printed once): the same launcher path for every example, so
# one suffices; the other examples' code runs under their `python` commands (spawned ranks), and
# what each torchrun command is checked against before a rank starts (the launcher's world size
# against --batch, say) is test_torchrun_commands_accept_their_flags_at_the_launchers_world_size's,
# every session. benchmarks/exit_stress.py launches torchrun too (its torchrun way).
TORCHRUN_EVERY_SESSION = "torchrun --nproc-per-node 2 examples/quickstart.py"


def _first_of_its_script() -> set[str]:
    first: dict[tuple, str] = {}
    for command in sorted(RUNS, key=lambda c: (c not in CHEAPEST, c)):
        argv = shlex.split(command)
        if os.path.basename(_script(argv)[0]) not in TOO_SLOW and argv[0] != "torchrun":
            first.setdefault((argv[0], _script(argv)[0]), command)
    return set(first.values()) | {TORCHRUN_EVERY_SESSION}


EVERY_SESSION = _first_of_its_script()


# Commands that kill a rank of a replica group and wait for the others to give up on it: real
# fault scenarios (pytest's `faults` marker: `make test-e2e`, not `make test`).
FAULTS = re.compile(r"--fault\b|benchmarks/replicas\.py")


def _runs_param(command: str):
    if not (ALL or command in EVERY_SESSION):
        if os.path.basename(_script(shlex.split(command))[0]) in TOO_SLOW:
            why = "minutes of compiling"
        elif command.startswith("torchrun "):
            why = f"one torchrun launch per session (`{TORCHRUN_EVERY_SESSION}`); its flags are checked every session"
        else:
            why = "another command of this script runs"
        return pytest.param(command, marks=pytest.mark.skip(reason=f"{why}; FSDPFN_DOCS_COMMANDS=all runs this one"))
    if FAULTS.search(command):
        return pytest.param(command, marks=pytest.mark.faults)
    if how(command)[0] == "run":  # a fresh process, as the page runs it (see conftest.py)
        return pytest.param(command, marks=pytest.mark.e2e)
    return command


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


def _run_here(path: str, flags: list[str], cwd, capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [path, *flags])
    capsys.readouterr()
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", [_runs_param(c) for c in sorted(RUNS)])
def test_commands_run(command, tmp_path, shared, capsys, monkeypatch):
    argv = shlex.split(command)
    path, flags, _ = _script(argv)
    kind, more = how(command)
    extra = _with_places(more, str(tmp_path), str(shared))
    if kind == "here":
        code, out, err = _run_here(path, flags + extra, tmp_path, capsys, monkeypatch)
    else:
        if argv[0] == "torchrun":
            i = argv.index(next(a for a in argv if a.endswith(".py")))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:i], path, *flags, *extra]
        else:
            cmd = [sys.executable, path, *flags, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error", "PYTHONPATH": ROOT}
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800 if ALL else 600)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    also = [c for c in RUNS[command] if c != command]
    said = f"`{command}`" + (f" (run for {also} too: the same arguments once shortened)" if also else "")
    assert code == 0, f"{said} failed:\n{out[-3000:]}{err[-3000:]}"
    for result in (r for pattern, results in RESULTS if re.search(pattern, command) for r in results):
        # one result line, from rank 0, however many ranks print
        assert len(re.findall(result, out, re.M)) == 1, f"{said} did not print /{result}/ once:\n{out[-3000:]}"
    for worst in re.findall(AGREES, out, re.M):
        assert float(worst) < 1e-4, f"{said}: the sharded run and one process differ by {worst}"
