"""Process groups and the one collective timeout.

[Note: one timeout]
Every collective fsdpfn starts waits at most :func:`timeout` seconds (launch, runtime,
optimizers, checkpoints alike). gloo work accepts a timeout per ``wait``, so the value can change
at run time; process groups are created with the same value so NCCL, whose host-side wait
cannot be bounded that way, uses it too. The value comes from, in order: :func:`timeout_scope`
(of the calling thread), :func:`set_timeout`, the environment variable ``FSDPFN_TIMEOUT``
(seconds), the default of 600 s (what torch uses for NCCL). Scopes are per thread: a background
checkpoint commit keeps its own timeout, and its scope never leaks into, or is popped by, the
training thread's.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
from typing import Any, Iterator

import torch.distributed as dist

__all__ = [
    "mesh_subgroup",
    "DEFAULT_TIMEOUT",
    "backend",
    "group_rank",
    "group_ranks",
    "group_size",
    "init_process_group",
    "is_initialized",
    "rank",
    "set_timeout",
    "thread_group",
    "timeout",
    "timeout_scope",
    "world_size",
]

DEFAULT_TIMEOUT = 600.0
# Seconds the rendezvous of init_process_group waits for every rank to start, whatever the
# collective timeout.
RENDEZVOUS_TIMEOUT = 300.0
TIMEOUT_ENV = "FSDPFN_TIMEOUT"
# Process state: the one timeout of every collective of the process (set_timeout), and each
# thread's timeout_scope stack.
_timeout: list[float] = []  # set_timeout's value, for every thread
_scopes = threading.local()  # .stack: this thread's timeout_scope values


def _stack() -> list[float]:
    if not hasattr(_scopes, "stack"):
        _scopes.stack = []
    return _scopes.stack


def _check_timeout(seconds, where: str) -> float:
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{where} must be a positive number of seconds, got {seconds!r}")
    return value


def timeout() -> float:
    """Seconds any collective may wait before it fails naming the ranks that are behind.

    Example:
      >>> with fsdpfn.comm.timeout_scope(5):
      ...     fsdpfn.comm.timeout()
      5.0
    """
    stack = _stack()
    if stack:
        return stack[-1]
    if _timeout:
        return _timeout[-1]
    env = os.environ.get(TIMEOUT_ENV)
    return _check_timeout(env, f"the environment variable {TIMEOUT_ENV}") if env else DEFAULT_TIMEOUT


def set_timeout(seconds: float | None) -> None:
    """Sets the collective timeout of this process (``None``: back to ``FSDPFN_TIMEOUT`` or 600 s).

    Example:
      >>> fsdpfn.comm.set_timeout(30)
      >>> fsdpfn.comm.timeout()
      30.0
      >>> fsdpfn.comm.set_timeout(None)
    """
    _timeout.clear()
    if seconds is not None:
        _timeout.append(_check_timeout(seconds, "set_timeout(seconds)"))


@contextlib.contextmanager
def timeout_scope(seconds: float) -> Iterator[None]:
    """The collective timeout inside the block, in this thread (see :func:`timeout`)."""
    stack = _stack()
    stack.append(_check_timeout(seconds, "timeout_scope(seconds)"))
    try:
        yield
    finally:
        stack.pop()


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Processes in the default group (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def group_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's index in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def group_ranks(group=None) -> list[int]:
    """Global ranks of ``group`` (default: every rank), in group order."""
    if not is_initialized():
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def mesh_subgroup(mesh, dims: tuple[int, ...]):
    """The process group of this rank's ranks along mesh dims ``dims`` (several dims joined),
    made with ``new_group`` rather than ``DeviceMesh._flatten()``: a flattened dim changes how
    torch 2.13's ``DTensor.full_tensor()`` gathers nested ``Shard(0)`` placements on that mesh, and
    it gets uneven shards wrong afterwards. Every rank of the default group calls it, in the same
    order (as every rank runs the same optimizer), when the mesh spans them all.

    Example:
      >>> g = fsdpfn.comm.mesh_subgroup(mesh, (0,))
      >>> fsdpfn.comm.group_ranks(g)
      [0]
    """
    import torch

    grid = mesh.mesh
    if grid.numel() != dist.get_world_size():  # a sub-mesh: only its ranks call; torch's flattening is what they share
        names = mesh.mesh_dim_names
        return mesh[tuple(names[d] for d in dims)]._flatten().get_group(0)
    rest = [d for d in range(grid.dim()) if d not in dims]
    moved = grid.permute(*rest, *dims).reshape(-1, math.prod(grid.shape[d] for d in dims))
    mine = None
    for row in moved.tolist():  # every subgroup, in the same order on every rank
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    assert mine is not None and isinstance(grid, torch.Tensor)
    return mine


# Process state: process groups are the process's, created once (every rank creates them in
# the same order).
_RANK_GROUPS: dict[tuple, Any] = {}  # (world group, ranks) -> the group of those ranks


def ranks_group(ranks):
    """The process group of exactly ``ranks`` (global ranks), made once and kept. Every rank of
    the job calls it with the same ``ranks``, in the same order, as torch's ``new_group`` asks:
    groups made by their members alone (``use_local_synchronization``) hang in gloo's rendezvous
    once the ranks have made different groups before (rank 3 alone a group of ``[3]``, then ranks
    2 and 3 one of ``[2, 3]``). ``None`` (the default group) when ``ranks`` are every rank.

    Example:
      >>> fsdpfn.comm.ranks_group([0]) is None   # one process: the whole world
      True
    """
    ranks = tuple(sorted(int(r) for r in ranks))
    if not dist.is_initialized() or len(ranks) == dist.get_world_size():
        return None
    key = (id(dist.group.WORLD), ranks)
    if key not in _RANK_GROUPS:
        _RANK_GROUPS[key] = dist.new_group(list(ranks))
    return _RANK_GROUPS[key]


def thread_group():
    """A new gloo process group of every rank, for the collectives of one background thread
    (gloo pairs a group's collectives by their order on each rank, so two threads of a process
    must never share a group). Every rank calls it, in the same order; ``None`` without a process
    group. On NCCL jobs too it is gloo: its collectives move small host objects.

    Example:
      >>> g = fsdpfn.comm.thread_group()   # then, on one other thread only:
      >>> fsdpfn.comm.all_gather_object("ready", g)   # one rank here
      ['ready']
    """
    if not is_initialized():
        return None
    return dist.new_group(backend="gloo")


def backend(group=None) -> str:
    return dist.get_backend(group) if is_initialized() else "none"


def store():
    """The default group's key-value store, or ``None`` (used by the flight recorder)."""
    if not is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a group without a store still runs, unrecorded
        return None


def init_process_group(
    backend: str | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float | None = None,
) -> None:
    """Creates the default process group with the collective timeout (see [Note: one timeout]).

    ``backend`` defaults to NCCL when CUDA is available, else gloo; without ``init_method`` the
    rendezvous comes from the environment (``torchrun``). The rendezvous itself waits for every
    rank to start, at least :data:`RENDEZVOUS_TIMEOUT` seconds: ranks that start seconds apart on
    a busy machine are not a stuck collective.
    """
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    seconds = timeout() if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=max(seconds, RENDEZVOUS_TIMEOUT))}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)
    if seconds < RENDEZVOUS_TIMEOUT:
        set_backend_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_backend_timeout is not None:  # the backend's own operation timeout, as before
            set_backend_timeout(datetime.timedelta(seconds=seconds))
