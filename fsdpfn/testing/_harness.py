"""Run a function on N gloo ranks, with process groups started once per world size.

[Note: persistent worker pools]
Starting a process and a gloo group costs seconds (mostly ``import torch``; see also [Note:
workers forked from a server that imported fsdpfn]). A test
suite that starts one per test spends its time there. So each world size gets one pool of worker
processes, started on first use and kept until the interpreter exits (or
:func:`shutdown_pools`). Every call sends the same picklable function to each worker of the
pool, which runs ``fn(rank, world_size, *args)`` inside the already-initialised default process
group and sends back the result or its traceback.

A pool is trusted again only if every rank answered: if a rank raised while the others sat in a
collective waiting for it, or a call timed out, the pool is killed and the next call starts a
fresh one, so one broken test never poisons the next.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, cast

import torch.multiprocessing as mp

from fsdpfn import comm
from fsdpfn.launch import (
    RankError,
    check_picklable,
    load_task,
    process_stopped,
    raise_rank_errors,
    shutdown,
    start_rank,
    stopped_after_error,
)

__all__ = ["RankError", "run_on_ranks", "shutdown_pools", "mesh", "take_started_processes"]

DEFAULT_TIMEOUT = float(os.environ.get("FSDPFN_TEST_TIMEOUT", "180"))
# After one rank fails, how long the others get to finish before we declare them stuck.
_GRACE_AFTER_ERROR = 5.0


@dataclasses.dataclass
class _Pool:
    world_size: int
    procs: list
    tasks: list
    results: Any
    folder: str
    next_id: int = 0


# Process state: the session's worker pools, one per world size, kept for the process's life.
_POOLS: dict[int, _Pool] = {}

# [Note: the processes a task starts]
# A test suite that keeps its process-starting tests apart (fsdpfn's own: tests/conftest.py) must
# also see the processes its ranks start: torch.compile's inductor runs a C++ compiler and starts
# compile workers inside the rank that compiles. Each worker records the commands (the
# ``subprocess.Popen`` audit event) its current task started and sends them back with its result;
# the caller's process keeps them until the suite takes them (:func:`take_started_processes`).
# Process state: one list per process, because a process runs one task at a time.
_STARTED: list[str] = []
_STARTED_BY_RANKS: list[tuple[int, str]] = []  # in the caller: (rank, command), until taken


def _record_started(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else str(args[1]).split()
        _STARTED.append(" ".join(map(str, argv))[:200])


def take_started_processes() -> list[tuple[int, str]]:
    """``(rank, command)`` of every process the ranks' tasks started since the last call (see
    [Note: the processes a task starts]), and forgets them.

    Example:
      >>> take_started_processes()  # no task ran in this process yet
      []
    """
    out = list(_STARTED_BY_RANKS)
    _STARTED_BY_RANKS.clear()
    return out


def _worker(rank: int, world_size: int, init_file: str, tasks, results, pg_timeout_s: float) -> None:
    # Suites that run with warnings as errors can ask the same of their ranks.
    action = os.environ.get("FSDPFN_WORKER_WARNINGS")
    if action:
        warnings.simplefilter(action)  # type: ignore[arg-type]  # a name from the environment; warnings checks it
    start_rank(rank, world_size, f"file://{init_file}", timeout_s=pg_timeout_s, flight_dir=os.path.dirname(init_file))
    # A call that times out asks each silent rank where it is (see _stacks_of).
    stacks = open(_stacks_path(os.path.dirname(init_file), rank), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    sys.addaudithook(_record_started)
    healthy = True
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, payload = task
        comm.set_job(f"task {task_id}")
        _STARTED.clear()
        try:
            # Loaded here, not by the queue, so that a function this process cannot find comes
            # back as an error with its reason instead of killing the worker.
            fn, args, kwargs = load_task(payload, "run_on_ranks(fn)")
            out = ("ok", fn(rank, world_size, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            comm.announce_failure(e)
            out = ("error", traceback.format_exc())
        # A failed collective leaves the groups out of step with the peers: the caller restarts
        # the pool rather than run the next test on them.
        healthy = comm.healthy()
        try:
            results.put((task_id, rank, out, healthy, list(_STARTED)))
        except Exception:  # the result did not pickle
            results.put((task_id, rank, ("error", traceback.format_exc()), healthy, list(_STARTED)))
        if not healthy:
            # Idle until the caller replaces the pool (it does after a failed collective): a
            # peer still diagnosing the same failure must find this rank failed, not exited.
            while tasks.get() is not None:
                pass
            break
    if healthy:  # the pool stopped after its last call: every rank is here, see [Note: a clean exit]
        shutdown()
    comm.destroy_process_group()


def _start_pool(world_size: int, pg_timeout_s: float) -> _Pool:
    ctx = mp.get_context("forkserver")
    # [Note: workers forked from a server that imported fsdpfn]
    # A spawned worker imports torch and fsdpfn itself (about 5 CPU-seconds each; 8 workers on 2
    # cores wait 20 s). Python's forkserver imports them once, in a process with no threads and no
    # process group, and forks every worker of every pool from it: a pool of any size, and each
    # replacement of a pool after a failed call, starts in a fraction of a second. A worker still
    # gets this process's sys.path, working directory and main module (multiprocessing sends
    # them), but the environment of the moment the server started (the first pool).
    ctx.set_forkserver_preload(["fsdpfn.testing._harness"])
    folder = tempfile.mkdtemp(prefix="fsdpfn_gloo_")
    init_file = os.path.join(folder, f"store_{world_size}")
    results = ctx.Queue()
    tasks = [ctx.Queue() for _ in range(world_size)]
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_worker,
            args=(rank, world_size, init_file, tasks[rank], results, pg_timeout_s),
            daemon=True,
            name=f"fsdpfn-rank{rank}-of-{world_size}",
        )
        p.start()
        procs.append(p)
    return _Pool(world_size, procs, tasks, results, folder)


def _stacks_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stacks_rank{rank}.txt")


def _stacks_of(pool: _Pool, ranks: list[int], wait_s: float = 2.0) -> dict[int, str]:
    """The Python stacks of the pool's ``ranks`` (every thread), asked for with SIGUSR1: where a
    rank that never answered was waiting. Ranks whose stack did not arrive are left out."""
    asked = []
    for r in ranks:
        p = pool.procs[r]
        if p.is_alive() and not process_stopped(p.pid):
            try:
                os.truncate(_stacks_path(pool.folder, r), 0)
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(r)
            except OSError:
                pass
    time.sleep(wait_s if asked else 0.0)
    out = {}
    for r in asked:
        try:
            with open(_stacks_path(pool.folder, r)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            out[r] = text
    return out


def _kill_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is None:
        return
    for p in pool.procs:
        if p.is_alive():
            p.kill()
    for p in pool.procs:
        p.join(timeout=5)
    shutil.rmtree(pool.folder, ignore_errors=True)  # the store, and the flight files of killed ranks


def shutdown_pools() -> None:
    """Stops every worker pool (the pytest plugin calls this at the end of the session)."""
    for world_size in list(_POOLS):
        pool = _POOLS[world_size]
        for q in pool.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in pool.procs:
            p.join(timeout=5)
        _kill_pool(world_size)


atexit.register(shutdown_pools)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    The default process group is already initialised in each worker (gloo, CPU, one thread per
    rank). ``fn`` must be picklable: a module-level function, or a ``functools.partial`` of one.
    Results come back in rank order.

    Args:
      fn: the function to run on every rank.
      world_size: number of ranks, >= 1.
      *args, **kwargs: passed to ``fn`` after ``rank`` and ``world_size``.
      timeout: seconds before a hang is declared (default 180, or ``$FSDPFN_TEST_TIMEOUT``).

    Returns:
      ``[fn(0, W, ...), fn(1, W, ...), ...]``.

    Raises:
      RankError: some rank raised (its traceback is in the message) or did not answer in time.

    Example:
      >>> def total(rank, world_size):  # at module level in a test file, so that it pickles
      ...     t = torch.tensor([float(rank)])
      ...     fsdpfn.comm.all_reduce(t)
      ...     return t.item()
      >>> run_on_ranks(total, world_size=3)  # spawns 3 processes  # doctest: +SKIP
      [3.0, 3.0, 3.0]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_picklable(fn, *args, what="run_on_ranks(fn)", **kwargs)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        _kill_pool(world_size)
        pool = _POOLS[world_size] = _start_pool(world_size, pg_timeout_s=max(timeout, 30.0))
    pool.next_id += 1
    task_id = pool.next_id
    payload = pickle.dumps((fn, args, kwargs))
    for q in pool.tasks:
        q.put((task_id, payload))

    answers: dict[int, tuple[str, Any]] = {}
    healthy = True
    deadline = time.monotonic() + timeout
    while len(answers) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            got_id, rank, out, ok, started = pool.results.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            if not all(p.is_alive() for p in pool.procs):
                dead = [r for r, p in enumerate(pool.procs) if not p.is_alive()]
                for r in dead:
                    answers.setdefault(
                        r,
                        (
                            "error",
                            f"rank {r} died (exit code {pool.procs[r].exitcode}); its error, if "
                            "any, is in its output (stderr) above",
                        ),
                    )
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR)
            if any(a[0] == "error" for a in answers.values()):
                # A stopped rank (SIGSTOP, a debugger) answers nothing, however long we wait.
                for r, p in enumerate(pool.procs):
                    if r not in answers and process_stopped(p.pid):
                        answers[r] = ("error", stopped_after_error(r, p.pid))
                        healthy = False  # the next call needs a fresh pool
            continue
        if got_id != task_id:  # a stale answer from a call that timed out
            continue
        _STARTED_BY_RANKS.extend((rank, cmd) for cmd in started)
        answers[rank] = out
        healthy = healthy and ok
        if out[0] == "error":
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR)

    missing = [r for r in range(world_size) if r not in answers]
    if missing and not any(a[0] == "error" for a in answers.values()):
        for r, stack in _stacks_of(pool, missing).items():
            answers[r] = (
                "error",
                f"rank {r} did not finish within {timeout:.0f} s (hang?); it was stopped. "
                f"Its threads were at:\n{stack}",
            )
    if missing or not healthy:
        _kill_pool(world_size)  # the next call starts a fresh pool
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", repr(fn))
    raise_rank_errors(answers, world_size, cast(str, name), f"within {timeout:.0f} s (hang?)")
    return [answers[r][1] for r in range(world_size)]


# Process state: meshes hold process groups, the process's; each is created once.
_MESHES: dict[tuple, Any] = {}


def mesh(shape: tuple[int, ...] | int | None = None, dim_names: tuple[str, ...] | None = None):
    """A CPU ``DeviceMesh`` over the current ranks, cached per (shape, names) in this process.

    Inside :func:`run_on_ranks` workers, creating a 2-D mesh creates process groups; caching it
    makes the second test that asks for the same mesh free.

    Example:
      >>> m = fsdpfn.testing.mesh()  # 1-D over every rank (in this example, one)
      >>> m.shape, m is fsdpfn.testing.mesh()
      ((1,), True)
      >>> hsdp = fsdpfn.testing.mesh((2, 2), ("replicate", "shard"))  # needs 4 ranks  # doctest: +SKIP
    """
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        shape = (comm.world_size(),)
    if isinstance(shape, int):
        shape = (shape,)
    key = (tuple(shape), tuple(dim_names) if dim_names else None)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=key[1])
    return _MESHES[key]
