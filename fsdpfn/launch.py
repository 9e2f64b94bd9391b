"""Start a function on N ranks: under ``torchrun`` as it is, else by spawning N local gloo
processes. The one place that spawns ranks and sets up their process group; the examples, the
benchmarks and :func:`fsdpfn.testing.run_on_ranks` all start ranks through here.

[Note: ranks die with their launcher]
A rank must never outlive the process that started it: an orphaned rank keeps training and
writing the run directory, and holds its peers in collectives. On Linux each rank asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), which covers every way the
launcher can die, SIGKILL included; elsewhere a watchdog thread polls the parent pid.

[Note: a clean exit]
A rank that finished its work must exit 0. With gloo it may not: ``destroy_process_group()`` joins
gloo's worker threads only when the process group object is freed, and a group that a functional
collective used (a ``DTensor``'s ``full_tensor``, ``fsdpfn.compile``'s traced collectives) is still
referenced from C++ after it, so its threads live on into interpreter finalization. A worker
thread that then drops the last reference to a finished collective frees its tensors, which takes
the GIL; CPython ends such a thread inside the C++ destructor and the process aborts (SIGABRT,
"terminate called without an active exception"). The plain-torch reproduction is in
docs/tour/troubleshooting.md. :func:`shutdown` waits for every rank, destroys the groups, and if
gloo's threads still run, does what a normal exit does and then ``os._exit(0)``: it runs only
after success, so a failure keeps its exit code.
"""

from __future__ import annotations

import ast
import atexit
import ctypes
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import threading
import time
import traceback
from types import FrameType
from typing import Any, Callable, TypeGuard

import torch
import torch.multiprocessing as mp

from fsdpfn import comm

__all__ = [
    "RankError",
    "check_picklable",
    "cuda_problem",
    "launch",
    "load_task",
    "process_stopped",
    "raise_rank_errors",
    "shutdown",
    "start_rank",
    "under_torchrun",
]


class RankError(RuntimeError):
    """One or more ranks raised, died, or did not answer in time. The message holds every
    failing rank's traceback; ``errors`` maps rank -> that text."""

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = errors or {}

    def summary(self) -> str:
        """One block per failing rank: its final exception without the traceback (what a job
        prints for people; ``str(error)`` keeps the tracebacks)."""
        return "\n".join(f"rank {r}: {_final_exception(text)}" for r, text in sorted(self.errors.items()))


def _final_exception(text: str) -> str:
    lines = text.rstrip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    body = lines[last_frame + 1 :]
    while body and body[0].startswith(("    ", "  ")) and not body[0].startswith("  rank"):
        body = body[1:]  # the source line and carets of the last frame
    return "\n".join(body) if body else text.strip()


def under_torchrun() -> bool:
    """True if this process was started by ``torchrun`` (or another launcher setting ``RANK``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cuda_problem(local_rank: int = 0) -> str | None:
    """Why this process cannot use GPU ``local_rank`` (what is missing and how to fix it), or
    ``None`` if it can. Checks, in order: a CUDA build of torch, a usable GPU, and at least
    ``local_rank + 1`` visible GPUs. :func:`launch` calls it on every rank before NCCL starts;
    call it before any CUDA work to fail with a sentence instead of an error from deep in torch.

    Example:
      >>> problem = cuda_problem(0)
      >>> problem is None or problem.startswith("this torch")
      True
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hiding = f" (CUDA_VISIBLE_DEVICES={visible!r} limits which GPUs this process sees)" if visible is not None else ""
    if not torch.backends.cuda.is_built():
        return (
            f"this torch ({torch.__version__}) is a CPU-only build: it cannot use a GPU. Install a CUDA build of "
            "torch (https://pytorch.org/get-started/locally/)"
        )
    if not torch.cuda.is_available():
        return (
            f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) finds no usable GPU{hiding}: check that "
            "the machine has an NVIDIA GPU and a driver recent enough for this CUDA version (run nvidia-smi)"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        return (
            f"this process is local rank {local_rank}, which needs GPU {local_rank}, but it sees {count} GPU(s)"
            f"{hiding}: start at most {count} process(es) per node (torchrun --nproc_per_node {count})"
        )
    return None


def _require_cuda(local_rank: int, where: str) -> None:
    problem = cuda_problem(local_rank)
    if problem is not None:
        raise RuntimeError(f"{where}: {problem}")


def check_picklable(fn: Callable, *args: Any, what: str = "fn", **kwargs: Any) -> None:
    """Raises ``ValueError`` at once, saying why, if spawned ranks could not receive ``fn`` and its
    arguments (a lambda, a local function, a function defined in a ``__main__`` without a file).

    Example:
      >>> check_picklable(lambda r, w: r, what="run_on_ranks(fn)")
      Traceback (most recent call last):
      ...
      ValueError: run_on_ranks(fn) must be picklable to reach the spawned ranks: ...
    """
    main = sys.modules.get("__main__")
    target = getattr(fn, "func", fn)  # functools.partial
    if getattr(target, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{what} is {getattr(target, '__qualname__', target)!r}, defined in __main__ without a file (python -c, stdin "
            "or a notebook): spawned ranks import functions by module, so they cannot find it. Define it in a .py module."
        )
    problem = _main_problem(target, what)
    if problem:
        raise ValueError(problem)
    for label, value in [(what, fn), *((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - any pickling failure gets the same advice
            hint = (
                "use a module-level function (or functools.partial of one), not a lambda or a local function"
                if label == what
                else "pass only picklable values (tensors, numbers, strings, dataclasses)"
            )
            raise ValueError(
                f"{what if label == what else f'{what}: {label}'} must be picklable to reach the "
                f"spawned ranks: {type(e).__name__}: {e}. {hint.capitalize()}."
            ) from None


_GUARD = 'if __name__ == "__main__":'


def _is_guard(node: ast.stmt) -> TypeGuard[ast.If]:
    """``if __name__ == "__main__":`` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, *node.test.comparators]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return isinstance(node.test.ops[0], ast.Eq) and names == ["__name__"] and consts == ["__main__"]


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement that run when the module is imported."""
    out = [getattr(node, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(node, f, None), list)]
    out += [h.body for h in getattr(node, "handlers", [])]
    return out if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _where_bound(body: list[ast.stmt], name: str, guarded: bool = False) -> set[bool]:
    """For each module-level binding of ``name``: whether it sits under the ``__main__`` guard."""
    found = set()
    for node in body:
        if _binds(node, name):
            found.add(guarded)
        if _is_guard(node):
            found |= _where_bound(node.body, name, True) | _where_bound(node.orelse, name, guarded)
        else:
            for block in _blocks(node):
                found |= _where_bound(block, name, guarded)
    return found


def _guarded_line(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` of the module runs only under the ``__main__`` guard."""
    for node in body:
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if _is_guard(node) and node.body and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
            return True
        return any(_guarded_line(block, line) for block in _blocks(node))
    return False


def _main_problem(fn: Callable, what: str) -> str | None:
    """Why spawned ranks could not run ``fn`` because of how the main script is written, or
    ``None``. A spawned rank imports the main script again (as ``__mp_main__``, so its
    ``if __name__ == "__main__":`` block does not run) to find functions defined there: a function
    defined only inside that block is missing, and a launch outside it would run again in every
    rank (Python refuses that: the rank dies at start, with the reason only on its stderr)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    name = getattr(fn, "__qualname__", "")
    spec = getattr(getattr(main, "__spec__", None), "name", None)
    if spec is not None and (spec == "__main__" or spec.endswith(".__main__")):
        # python -m package: spawned ranks do not import the package's __main__ at all.
        if getattr(fn, "__module__", None) == "__main__":
            return (
                f"{what} is {name!r}, defined in {path}, which runs as `python -m {spec.rsplit('.', 1)[0]}`: spawned "
                "ranks do not import a package's __main__, so they cannot find it. Define it in an importable module "
                "of the package."
            )
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None  # nothing to read: the spawned ranks will say
    if getattr(fn, "__module__", None) == "__main__" and name:
        where = _where_bound(tree.body, name.split(".")[0])
        if where == {True}:
            return (
                f"{what} is {name!r}, defined under `{_GUARD}` in {path}: spawned ranks import {path} without "
                f"running that block, so they cannot find it. Define {name!r} at the top level of the file (outside "
                f"the `{_GUARD}` block), or in an importable module."
            )
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is not None and not _guarded_line(tree.body, frame.f_lineno):
        return (
            f"{what} is called at the top level of {path} (line {frame.f_lineno}), outside `{_GUARD}`: every spawned "
            f"rank imports {path} again to find its functions, and would run this call too (Python stops it, and the "
            f"rank dies at start). Put the call under `{_GUARD}` at the end of the file, with the functions it runs "
            "defined at the top level above it (or in an importable module)."
        )
    return None


def _die_with_parent() -> None:
    """See [Note: ranks die with their launcher]."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        else:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="fsdpfn-parent-watch").start()


def start_rank(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float | None = None,
    flight_dir: str | None = None,
) -> None:
    """The start of every spawned rank: its thread count, the tie to its launcher, the collective
    timeout, where its flight recorder keeps its file (the launcher's temporary folder, removed
    with it) and the default process group."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    _die_with_parent()
    if backend == "nccl":  # spawned ranks of one machine: rank r drives GPU r
        _require_cuda(rank, f"rank {rank} of {world_size} (backend 'nccl')")
        torch.cuda.set_device(rank)
    if timeout_s is not None:
        comm.set_timeout(timeout_s)
    if flight_dir is not None:
        comm.set_flight_dir(flight_dir)
    comm.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def load_task(payload: bytes, what: str):
    """Unpickles what a launcher sent a spawned rank, saying how to fix a function it cannot find."""
    try:
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise RuntimeError(
            f"this rank could not load {what} or its arguments ({type(e).__name__}: {e}). Spawned ranks import functions "
            f"by module: define the function at the top level of an importable module, or of the script, with the launch "
            f"itself under `{_GUARD}`."
        ) from e


def _entry(rank, world_size, init_method, backend, threads, timeout_s, payload, results, flight_dir=None) -> None:
    start_rank(
        rank, world_size, init_method, backend=backend, threads=threads, timeout_s=timeout_s, flight_dir=flight_dir
    )
    try:
        # Loaded here, not while the process starts, so that a function this rank cannot find
        # comes back with its reason instead of an exit code.
        main, args = load_task(payload, "launch(main)")
        out = ("ok", main(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher
        comm.announce_failure(e)
        out = ("error", traceback.format_exc())
    # Plain pickle, by value: torch.multiprocessing would share tensors through file descriptors
    # that vanish when this process exits, before the launcher has read them.
    try:
        payload = pickle.dumps(out)
    except Exception:  # noqa: BLE001 - the result did not pickle
        payload = pickle.dumps(("error", traceback.format_exc()))
    results.put((rank, payload))
    results.close()
    results.join_thread()  # the answer is in the pipe before this process can end
    if out[0] == "ok":
        shutdown()  # see [Note: a clean exit]
    comm.destroy_process_group()


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it finishes nothing, however long
    one waits for it. ``False`` where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stopped_after_error(r: int, pid: int) -> str:
    return f"rank {r} (pid {pid}) is stopped (SIGSTOP or a debugger): it did not finish after another rank failed"


def _collect(procs, results, world_size: int, grace: float) -> dict[int, tuple[str, Any]]:
    """Waits for every rank's answer. A rank that dies without answering counts as an error;
    after the first error the others get ``grace`` seconds (their collectives fail within the
    collective timeout and report where they were) before they are killed, except ranks whose
    process is stopped: they cannot answer, so they are not waited for."""
    answers: dict[int, tuple[str, Any]] = {}
    deadline = None
    while len(answers) < world_size and (deadline is None or time.monotonic() < deadline):
        if deadline is not None:
            for r, p in enumerate(procs):
                if r not in answers and process_stopped(p.pid):
                    answers[r] = ("error", stopped_after_error(r, p.pid))
            if len(answers) == world_size:
                break
        try:
            rank, payload = results.get(timeout=0.5)
            answers[rank] = pickle.loads(payload)
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in answers and not p.is_alive():
                    code = p.exitcode
                    how = (
                        f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                    )
                    answers[r] = ("error", f"rank {r} (pid {p.pid}) {how} without reporting")
        if deadline is None and any(a[0] == "error" for a in answers.values()):
            deadline = time.monotonic() + grace
    return answers


def raise_rank_errors(answers: dict[int, tuple[str, Any]], world_size: int, what: str, waited: str) -> None:
    """Raises :class:`RankError` if any rank's answer is ``("error", text)`` or missing."""
    errors = {r: a[1] for r, a in answers.items() if a[0] == "error"}
    missing = [r for r in range(world_size) if r not in answers]
    if not errors and not missing:
        return
    parts = [f"{what} failed on {world_size} rank(s):"]
    parts += [
        f"--- rank {r} raised:\n{errors[r]}" if errors[r].startswith("Traceback") else f"--- {errors[r]}"
        for r in sorted(errors)
    ]
    if missing:
        why = "after another rank failed" if errors else waited
        parts.append(f"--- rank(s) {missing} did not finish {why}; they were stopped")
        errors.update({r: f"did not finish {why}" for r in missing})
    raise RankError("\n".join(parts), errors)


_GLOO_THREAD = "pt_gloo_runloop"  # the name torch gives gloo's worker threads (Linux shows it)
_had_group = [False]  # Process state: whether this process ever joined a process group


def _gloo_threads() -> int | None:
    """How many of torch's gloo worker threads this process runs, or ``None`` where it cannot tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == _GLOO_THREAD
        except OSError:
            pass
    return count


def _exit_now() -> None:
    """Everything a normal exit does that a job can observe (joining its non-daemon threads, the
    ``atexit`` handlers: logging, multiprocessing queues, user handlers; flushing stdout and
    stderr), then the exit itself without interpreter finalization."""
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0)


def shutdown(*, exit: bool = True) -> None:
    """Ends this rank's distributed work so that a job that succeeded exits with code 0.

    Waits for every rank (a barrier), destroys the process groups and, with ``exit`` (the
    default) and while torch's gloo worker threads are still running, ends the process with code 0
    after doing what a normal exit does (joining non-daemon threads, running ``atexit`` handlers,
    flushing stdout and stderr), skipping only the interpreter's finalization. Call it last, after
    success: inside an ``except`` or a ``finally`` that an exception is passing through, or after a
    failed collective, it only destroys the groups and returns, so the failure keeps its exit code.
    In a process that never had a gloo group (the parent of spawned ranks) it does nothing.

    Why the exit (see [Note: a clean exit] in ``fsdpfn.launch``): torch's gloo worker threads can
    outlive ``destroy_process_group()`` (a process group a functional collective or ``DTensor``
    used is not freed by it), and a worker thread that frees a finished collective's tensors while
    Python finalizes is killed inside a C++ destructor: the process aborts (SIGABRT, "terminate
    called without an active exception") after its job is done, about 1 run in 10 on a busy
    machine, and a scheduler sees a failed job. No finalization, no abort.

    :func:`launch` calls it on the ranks it spawns and :mod:`fsdpfn.testing`'s workers call it when
    their pool stops; under ``torchrun``, :func:`launch` waits and destroys the group but returns to
    the script, which should end with ``shutdown()``.

    Args:
      exit: end the process (code 0) if torch's gloo threads still run. ``False``: only the barrier
        and the destruction of the groups, for code that continues.

    Example (the end of a script run as ``python train.py`` or ``torchrun ... train.py``):
      >>> results = launch(main, 2)  # spawned ranks end with shutdown() themselves  # doctest: +SKIP
      >>> print(results)  # doctest: +SKIP
      >>> shutdown()  # the last line: a torchrun rank exits 0 here, a spawning parent just returns  # doctest: +SKIP
    """
    failing = sys.exc_info()[0] is not None
    if comm.is_initialized():
        _had_group[0] = True
        if not failing and comm.healthy():
            comm.barrier(tag="shutdown")  # no rank leaves while a peer still needs it
        comm.destroy_process_group()
    if not exit or failing or not comm.healthy():
        return
    threads = _gloo_threads()
    if threads or (threads is None and _had_group[0]):
        _exit_now()


def launch(
    main: Callable[..., Any], world_size: int = 2, *args: Any, backend: str | None = None, timeout: float | None = None
) -> list[Any]:
    """Runs ``main(rank, world_size, *args)`` on every rank with the default process group set up,
    and returns every rank's return value in rank order.

    Under ``torchrun`` this process is one rank: the group is initialised from the environment
    (NCCL if CUDA is available, else gloo), ``world_size`` is ignored and the list holds this
    rank's value; with NCCL each rank first checks that it can use GPU ``LOCAL_RANK``
    (:func:`cuda_problem`) and raises ``RuntimeError`` saying what is missing if not; after success it
    waits for every rank and destroys the group, and the script should end with :func:`shutdown`.
    Otherwise ``world_size`` local processes are spawned (gloo, the cores split
    between them); they die with this process however it dies, and each ends with
    :func:`shutdown` after success. A failing rank raises
    :class:`RankError` here with its traceback; a rank stuck in a collective fails within the
    collective ``timeout`` (seconds; default :func:`fsdpfn.comm.timeout`) naming the rank that is
    behind.

    Example:
      >>> def main(rank, world_size):  # at module level in a script, so that it pickles
      ...     return rank * 10
      >>> launch(main, world_size=2)  # spawns 2 processes  # doctest: +SKIP
      [0, 10]
    """
    timeout_s = comm.timeout() if timeout is None else timeout
    if under_torchrun():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":  # before anything touches CUDA, which would fail without saying why
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            _require_cuda(
                local_rank,
                f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} (backend 'nccl', LOCAL_RANK {local_rank})",
            )
            torch.cuda.set_device(local_rank)
        comm.set_timeout(timeout_s)
        comm.init_process_group(backend)
        try:
            result = [main(comm.rank(), comm.world_size(), *args)]
        except BaseException as e:
            comm.announce_failure(e)
            comm.destroy_process_group()
            raise
        shutdown(exit=False)  # the script goes on: it should end with shutdown(), see [Note: a clean exit]
        return result
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_picklable(main, *args, what="launch(main)")
    if backend == "nccl":  # here, once, rather than as N identical rank failures
        _require_cuda(world_size - 1, f"launch(backend='nccl', world_size={world_size})")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    payload = pickle.dumps((main, args))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fsdpfn_launch_") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(
                target=_entry,
                name=f"fsdpfn-rank{r}-of-{world_size}",
                args=(r, world_size, init, backend or "gloo", threads, timeout_s, payload, results, tmp),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        answers: dict[int, tuple[str, Any]] = {}
        try:
            answers = _collect(procs, results, world_size, grace=timeout_s + 2.0)
        finally:
            failed = len(answers) < world_size or any(a[0] == "error" for a in answers.values())
            for p in procs:
                # After a failure nothing a rank still does matters, and a stopped one would hold
                # join() for its whole timeout: end them now.
                if failed and p.is_alive():
                    p.kill()
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
    raise_rank_errors(answers, world_size, getattr(main, "__qualname__", repr(main)), "")
    return [answers[r][1] for r in range(world_size)]
