"""async_save: a checkpoint that stalls training only while its shards are copied to host memory.

[Note: asynchronous checkpoints]
``async_save`` runs a save in two parts. On the calling (training) thread: the entry check, the
choice of name (the same collectives as ``save``, on the training process group, in program
order like every other collective of that thread) and the staging, a copy of this rank's shards
to host memory with DCP's own stager (``torch.distributed.checkpoint.staging.DefaultStager``,
what ``torch.distributed.checkpoint.async_save`` stages with). Then it returns a future, and one
background thread per process does the rest: DCP writes the staged copy into
``.partial-<name>-<token>/rank_<r>/``, the thread hashes what it wrote, the ranks agree that every
rank wrote its part, and rank 0 writes the merged ``.metadata`` and the manifest and renames the
directory into place, exactly as ``save`` does (see [Note: atomic checkpoints] in
``_atomic.py``). A process killed at any point before that rename leaves the previous checkpoint
the latest; a write that fails on one rank fails the save on every rank.

Which thread runs which collective. gloo matches collectives on a process group by their order
on each rank; two threads issuing collectives on one group interleave differently on each rank
and deadlock (or silently pair the wrong buffers). So the background thread never touches the
training group: its two agreement collectives (an all-gather of every rank's write outcome, a
broadcast of rank 0's commit outcome, both through :mod:`fsdpfn.comm`) run on a gloo group of
their own, created once, collectively, by the first ``async_save`` on the training thread
(``torch.distributed.new_group(backend="gloo")``, the group torch's own asynchronous checkpoints
are told to use). DCP itself runs without any process group (see [Note: collective-free DCP] in
``_shards.py``). Collective counters are per thread, so a count of a training step never sees a
commit running beside it; the flight recorder numbers groups by their ranks, so its numbering of
the default group also counts the commit's four small collectives (a failure report during a
commit may name a rank as behind by those).

At most one save is in flight per process: ``async_save`` and ``save`` first wait for the
previous one, and a background error nobody has seen yet is raised there, on every rank (every
rank learned the same outcome from the agreement), before any new collective. :func:`wait`
does the same on demand; call it before the job ends. The staged copy holds one more copy of
this rank's shards in host memory until the write is done (and, for tensors updated in place,
is kept to be reused by the next save).
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from fsdpfn import comm
from fsdpfn.checkpoint import _atomic, _shards
from fsdpfn.checkpoint._agree import agree, decide, timeout_scope
from fsdpfn.checkpoint._dcp import _prepare, _publish, _tensor_info
from fsdpfn.checkpoint._inflight import AsyncCheckpoint, _pending, wait
from fsdpfn.checkpoint._manifest import describe_files
from fsdpfn.checkpoint._tree import flatten_state

__all__ = ["async_save"]


# Process state: process groups are the process's; one gloo group for the checkpoint commits
# per default process group, created once.
_groups: dict[int, Any] = {}  # id(default process group) -> the checkpoint commits' own gloo group


# Process state: one stager per process (it owns the staging buffers), made at the first save.
_stagers: list[DefaultStager] = []


def _stager() -> DefaultStager:
    """One stager per process, kept between saves: it copies a storage it has staged before into
    the same host buffer (a save never starts before the previous one is written, so that buffer
    is free), which spares allocating and faulting in a fresh copy of every shard per save when
    training updates its tensors in place. Its cache holds the host copies weakly, by the
    training tensors' storages: a loop that makes new tensors every step frees them."""
    if not _stagers:
        _stagers.append(DefaultStager(StagingOptions(False, False, False, False)))
    return _stagers[0]


def _commit_group():
    """The process group of background commits (collective on first use: see [Note: asynchronous
    checkpoints]); ``None`` with one process."""
    if comm.world_size() == 1:
        return None
    key = id(torch.distributed.group.WORLD)
    if key not in _groups:
        _groups.clear()  # a new default group: the old one's subgroups are gone with it
        _groups[key] = comm.thread_group()
    return _groups[key]


def _write_staged(partial: str, staged: dict[str, torch.Tensor], rank: int) -> tuple[Any, dict]:
    sub = _shards.rank_dir(rank)
    meta = _shards.write(staged, os.path.join(partial, sub), in_thread=True)
    if meta is None:
        return None, {}
    return meta, describe_files(partial, [f"{sub}/{n}" for n in os.listdir(os.path.join(partial, sub))])


def _background(
    pending: AsyncCheckpoint,
    staged: dict | BaseException,
    partial: str,
    rank: int,
    root: str,
    name: str,
    token: str,
    values: dict,
    info: dict,
    plan,
    keep: int | None,
    group,
    seconds: float,
) -> None:
    try:
        with comm.timeout_scope(seconds):
            report, error = None, staged if isinstance(staged, BaseException) else None
            if not isinstance(staged, BaseException):
                try:
                    report = _write_staged(partial, staged, rank)
                except Exception as e:  # noqa: BLE001 - sent to every rank by agree
                    error = e
                staged.clear()  # this save's references to the host copy: the write is done
            reports = agree(error, f"writing checkpoint {name!r} into {partial!r}", report, group)
            decide(
                lambda: _publish(root, partial, name, token, reports, values, info, plan, keep),
                f"committing checkpoint {name!r} in {root!r}",
                group,
            )
    except BaseException as e:  # noqa: BLE001 - handed to the future, raised where it is waited for
        pending.set_exception(e)
    else:
        pending.set_result(os.path.join(root, name))


def async_save(
    path: str | os.PathLike,
    state: Any,
    plan=None,
    *,
    name: str | None = None,
    keep: int | None = None,
    timeout: float | None = None,
) -> AsyncCheckpoint:
    """:func:`fsdpfn.checkpoint.save`, returning once this rank's shards are copied to host
    memory; the write, the checksums and the atomic commit run on a background thread (see
    [Note: asynchronous checkpoints]). Every rank calls it. The checkpoint is published (``latest``
    names it) only once every rank has written its part, so a process killed during the
    background write leaves the previous checkpoint the latest.

    One save is in flight at a time: a second ``async_save`` (or a ``save``) first waits for the
    previous one, and raises its error if it failed and its future did not already give it to the
    caller. Call :func:`fsdpfn.checkpoint.wait` before the job ends.

    Args:
      path, state, plan, name, keep: as for :func:`fsdpfn.checkpoint.save`.
      timeout: seconds each collective of the save may wait, the background ones included;
        default ``None``: :func:`fsdpfn.comm.timeout` at the call.

    Returns:
      An :class:`AsyncCheckpoint` (a ``concurrent.futures.Future``): ``result()`` gives the
      committed directory or raises the save's error, the same on every rank.

    Example:
      >>> pending = fsdpfn.checkpoint.async_save("runs/gpt/ckpt", {"params": params, "step": 10}, plan)
      >>> params = {n: p * 0.5 for n, p in params.items()}  # training goes on while it is written
      >>> pending.result()
      'runs/gpt/ckpt/step_00000010'
    """
    wait()
    root = os.fspath(path)
    entries, _ = flatten_state(state)
    tensors = {p: v.detach() for p, v in entries.items() if isinstance(v, torch.Tensor)}
    values = {p: v for p, v in entries.items() if not isinstance(v, torch.Tensor)}
    with timeout_scope(timeout):
        seconds = comm.timeout()
        comm.arrive("fsdpfn.checkpoint.async_save")
        group = _commit_group()
        # Fused colwise weights are written whole (see [Note: fused shards in checkpoints]).
        tensors = {p: _shards.whole(cast(DTensor, v)) if _shards.fused_split(v) else v for p, v in tensors.items()}
        name, token = decide(lambda: _prepare(root, name, values), f"preparing a checkpoint in {root!r}")
    rank = comm.rank()
    staged: dict | BaseException
    try:
        staged = cast(dict, _stager().stage({p: v for p, v in tensors.items() if _shards.owned(p, v, rank)}))
    except Exception as e:  # noqa: BLE001 - e.g. out of host memory: told to every rank by the commit's agreement
        staged = e
    info = {p: _tensor_info(v) for p, v in tensors.items()}
    pending = AsyncCheckpoint(os.path.join(root, name))
    partial = _atomic.partial_dir(root, name, token)
    # Not a daemon: an interpreter that exits waits for the commit instead of cutting it short.
    threading.Thread(
        target=_background,
        name="fsdpfn-checkpoint",
        args=(pending, staged, partial, rank, root, name, token, values, info, plan, keep, group, seconds),
    ).start()
    _pending.append(pending)
    return pending
