"""Shared test settings. The gloo worker pools come from fsdpfn's pytest plugin
(fsdpfn.testing.pytest_plugin, registered as a pytest11 entry point)."""

import multiprocessing.process
import os
import re
import sys

import pytest
from hypothesis import HealthCheck, settings

from fsdpfn.testing import take_started_processes

# Each example may cross process boundaries (a gloo round trip): no per-example deadline.
settings.register_profile(
    "fsdpfn",
    deadline=None,
    max_examples=int(os.environ.get("FSDPFN_HYPOTHESIS_EXAMPLES", "30")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("fsdpfn")

# pytest turns warnings into errors here (pyproject); the gloo worker ranks do the same.
os.environ.setdefault("FSDPFN_WORKER_WARNINGS", "error")


# [Note: the two tiers of the suite]
# `make test` runs what runs in this process and in the session's gloo worker pools; a test that
# starts a fresh process (a documented command as written, an example script, a launch of ranks,
# a fault scenario, inductor's code generation with its C++ compiler and compile workers) pays
# seconds of start-up per process, so it is marked `e2e` (or `faults`) and `make test-e2e` runs
# it. The split is checked, not kept by hand: a test outside those markers that starts a process,
# here or in one of the pools' ranks (fsdpfn.testing's [Note: the processes a task starts]),
# fails, naming what it started. To find the
# tests a change of this rule moves, FSDPFN_FRESH_PROCESS_REPORT=FILE writes each offender's id
# to FILE instead of failing it (a survey, never CI's setting).
_FRESH: dict = {"item": None, "started": []}
_REPORT = os.environ.get("FSDPFN_FRESH_PROCESS_REPORT")


def _fresh_process(what: str) -> None:
    item = _FRESH["item"]
    if item is not None and not (item.get_closest_marker("e2e") or item.get_closest_marker("faults")):
        _FRESH["started"].append(what)


def _is_fresh(argv: list[str]) -> bool:
    """Interpreters, compilers (inductor's generated C++), and make without -n (its recipes run
    them); git or `make -n` cost milliseconds."""
    name = os.path.basename(argv[0]) if argv else ""
    return bool(
        re.search(r"python|torchrun|mkdocs|mypy|pytest|g\+\+|gcc|clang|^c\+\+$|^cc$", name)
        or (name == "make" and "-n" not in argv)
    )


def _audit(event, args):
    if event == "subprocess.Popen":
        argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else str(args[1]).split())]
        if _is_fresh(argv):
            _fresh_process(" ".join(argv)[:200])
    elif event in ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn"):
        _fresh_process(event)


sys.addaudithook(_audit)
_start = multiprocessing.process.BaseProcess.start


def _start_checked(self):
    if not sys._getframe(1).f_code.co_filename.endswith(os.path.join("fsdpfn", "testing", "_harness.py")):  # the pools
        _fresh_process(f"multiprocessing.Process(name={self.name!r})")
    return _start(self)


multiprocessing.process.BaseProcess.start = _start_checked


def _check_fresh(item, phase):
    # and what the ranks of the pools started (inductor compiles inside a rank)
    for rank, command in take_started_processes():
        if _is_fresh(command.split()):
            _fresh_process(f"rank {rank}: {command}")
    started, _FRESH["started"] = _FRESH["started"], []
    if not started:
        return
    if _REPORT:
        with open(_REPORT, "a") as f:
            f.write(f"{item.nodeid}\t{phase}\t{started[0]}\t{len(started)}\n")
        return
    pytest.fail(
        f"{item.nodeid} started {len(started)} fresh process(es) in its {phase}, first: {started[0]}. A test "
        "that starts processes belongs to `make test-e2e`: mark it `@pytest.mark.e2e` (see conftest.py).",
        pytrace=False,
    )


def _phase(item, phase):
    try:
        result = yield
    except BaseException:
        _FRESH["started"] = []  # the phase failed already: its own error is the one to read
        raise
    _check_fresh(item, phase)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _FRESH["item"], _FRESH["started"] = item, []
    return (yield from _phase(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _phase(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    try:
        return (yield from _phase(item, "teardown"))
    finally:
        _FRESH["item"] = None
