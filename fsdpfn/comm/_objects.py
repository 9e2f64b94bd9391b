"""Collectives over Python objects and whole DTensors, built on the tensor collectives so that
they are counted, recorded and bounded by the timeout like the rest."""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdpfn._plan import chunk_size
from fsdpfn.comm import _groups
from fsdpfn.comm._collectives import CollectiveError, all_gather, all_reduce, broadcast
from fsdpfn.comm._record import group_info, record

__all__ = ["all_gather_object", "all_gather_rows", "arrive", "broadcast_object", "full_tensor"]


def _device(group) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if _groups.backend(group) == "nccl" else None


def all_gather_rows(x: torch.Tensor, group=None, *, tag: str = "") -> torch.Tensor:
    """Every rank's ``x`` (same shape everywhere) stacked in rank order: ``(W, *x.shape)``.

    Example:
      >>> fsdpfn.comm.all_gather_rows(torch.tensor([1.0, 2.0]))
      tensor([[1., 2.]])
    """
    w = _groups.group_size(group)
    flat = x.detach().contiguous().reshape(-1)
    out = torch.empty(w * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather(out, flat, group, tag=tag)
    return out.view(w, *x.shape)


def all_gather_object(obj: Any, group=None, *, tag: str = "") -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order (two all-gathers: sizes, then bytes).

    Example:
      >>> fsdpfn.comm.all_gather_object({"step": 3})
      [{'step': 3}]
    """
    if _groups.group_size(group) == 1:
        return [obj]
    device = _device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = all_gather_rows(torch.tensor([payload.numel()], device=device), group, tag=tag)[:, 0].tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    rows = all_gather_rows(padded, group, tag=tag).cpu()
    return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


def broadcast_object(obj: Any, src: int = 0, group=None, *, tag: str = "") -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (two broadcasts: size, then bytes).

    Example:
      >>> fsdpfn.comm.broadcast_object("hello")
      'hello'
    """
    if _groups.group_size(group) == 1:
        return obj
    device = _device(group)
    mine = _groups.rank() == src
    payload = pickle.dumps(obj) if mine else b""
    size = broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=device), src, group, tag=tag)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if mine
           else torch.empty(int(size), dtype=torch.uint8, device=device))
    buf = broadcast(buf, src, group, tag=tag)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())


def full_tensor(x: DTensor, *, tag: str = "") -> torch.Tensor:
    """The whole tensor of a DTensor, on every rank: one all-gather per sharded mesh dim (uneven
    ``torch.chunk`` shards are padded to the chunk size on the wire), an all-reduce per
    ``Partial`` one. What ``DTensor.full_tensor()`` does, through the counted collectives.

    Example:
      >>> full = fsdpfn.comm.full_tensor(params["blocks.0.fc.weight"])
      >>> type(full).__name__, full.shape
      ('Tensor', torch.Size([128, 32]))
    """
    if not isinstance(x, DTensor):
        return x
    mesh, local = x.device_mesh, x._local_tensor.detach()
    sharded = [(i, p) for i, p in enumerate(x.placements) if p.is_shard()]
    if len({p.dim for _, p in sharded}) != len(sharded):
        raise NotImplementedError(f"full_tensor: a tensor dim sharded over two mesh dims ({x.placements})")
    for i, p in reversed(sharded):
        group, d = mesh.get_group(i), p.dim
        w, n = mesh.size(i), x.shape[d]
        chunk = chunk_size(n, w)
        moved = local.movedim(d, 0)
        padded = torch.zeros((chunk, *moved.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: moved.shape[0]] = moved
        rows = all_gather_rows(padded, group, tag=tag).reshape(w * chunk, *moved.shape[1:])
        local = rows[:n].movedim(0, d)
    for i, p in enumerate(x.placements):
        if p.is_partial():
            local = local.clone()
            all_reduce(local, mesh.get_group(i), tag=tag)
    return local.contiguous()


def arrive(what: str, timeout_s: float | None = None, group=None) -> None:
    """Every rank must enter ``what`` (a collective API call such as a checkpoint save).

    gloo can tell who did not (``monitored_barrier``), so a call gated on one rank (the deadlock
    of ``if rank == 0: save(...)``) fails with the missing ranks named, instead of hanging in the
    next collective or, worse, being matched with another collective of the same size. NCCL has
    no monitored barrier; there a plain barrier bounded by the timeout applies.
    """
    w = _groups.group_size(group)
    ranks, gid = group_info(group) if w > 1 else ((), None)
    record("barrier", w, 0, torch.int32, what, ranks, gid)
    if w == 1:
        return
    seconds = _groups.timeout() if timeout_s is None else timeout_s
    if _groups.backend(group) != "gloo":
        dist.barrier(group=group)
        return
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as e:
        raise CollectiveError(
            f"{what} is collective: every rank must call it, but not every rank did within {seconds:g} s ({e}). "
            f"Do not gate it on rank 0 (`if rank == 0: ...`); call it on every rank.", []
        ) from e
