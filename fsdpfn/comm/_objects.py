"""Collectives over Python objects and whole DTensors, built on the tensor collectives so that
they are counted, recorded and bounded by the timeout like the rest."""

from __future__ import annotations

import datetime
import math
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdpfn._rows import chunk_bounds, chunk_size
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
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if mine
        else torch.empty(int(size), dtype=torch.uint8, device=device)
    )
    buf = broadcast(buf, src, group, tag=tag)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())


def _shard_order(x: DTensor) -> dict[int, list[int]]:
    """``{tensor dim: [mesh dims that split it, outermost first]}`` (see [Note: nested shards])."""
    by_dim: dict[int, list] = {}
    for i, p in enumerate(x.placements):
        if isinstance(p, _StridedShard) or p.is_shard():
            by_dim.setdefault(p.dim, []).append((i, p))  # type: ignore[attr-defined]  # is_shard(): a Shard, which has .dim
    mesh = x.device_mesh
    order = {}
    for d, splits in by_dim.items():
        strided = [(k, i, p) for k, (i, p) in enumerate(splits) if isinstance(p, _StridedShard)]
        if not strided:
            order[d] = [i for i, _ in splits]
            continue
        k, i, p = strided[0]
        if len(splits) == 1:  # a fused colwise split: gathered by _unfuse, see [Note: nested shards]
            continue
        later = [j for j, _ in splits[k + 1 :]]
        sf = int(p.split_factor)
        if len(strided) > 1 or math.prod(mesh.size(j) for j in later) != sf or x.shape[d] % sf:
            raise NotImplementedError(
                f"full_tensor: tensor dim {d} of shape {tuple(x.shape)} is placed {tuple(x.placements)}; a strided "
                "shard is supported once per dim, with split_factor equal to the ranks of the mesh dims sharding the "
                "same dim after it (FSDP over tensor parallelism) and dividing the dim. Use DTensor.full_tensor() instead."
            )
        order[d] = [j for j, _ in splits[:k]] + later + [i]
    return order


def full_tensor(x: torch.Tensor, *, tag: str = "") -> torch.Tensor:
    """The whole tensor of a DTensor, on every rank: one all-gather per sharded mesh dim (uneven
    ``torch.chunk`` shards are padded to the chunk size on the wire), an all-reduce per
    ``Partial`` one. What ``DTensor.full_tensor()`` does, through the counted collectives.

    A tensor dim split over several mesh dims is gathered innermost split first (see
    [Note: nested shards]): ``(Shard(0), Shard(0))``, and ``(_StridedShard(0, split_factor=tp),
    Shard(0))``, the placement of a weight whose data-parallel rows are cut from its
    tensor-parallel slice.

    Example:
      >>> full = fsdpfn.comm.full_tensor(params["blocks.0.fc.weight"])
      >>> type(full).__name__, full.shape
      ('Tensor', torch.Size([128, 32]))
    """
    if not isinstance(x, DTensor):
        return x
    mesh, local = x.device_mesh, x._local_tensor.detach()
    coord = mesh.get_coordinate()
    assert coord is not None  # x has a local tensor: this rank is in its mesh
    for d, dims in _shard_order(x).items():
        # The length each split cuts on this rank, outermost first: every rank of the group of
        # dims[k] shares the outer coordinates, so it agrees on lengths[k] and the chunk size.
        lengths = [x.shape[d]]
        for i in dims[:-1]:
            start, stop = chunk_bounds(lengths[-1], mesh.size(i), coord[i])
            lengths.append(stop - start)
        for i, n in reversed(list(zip(dims, lengths))):
            w = mesh.size(i)
            chunk = chunk_size(n, w)
            moved = local.movedim(d, 0)
            padded = torch.zeros((chunk, *moved.shape[1:]), dtype=local.dtype, device=local.device)
            padded[: moved.shape[0]] = moved
            rows = all_gather_rows(padded, mesh.get_group(i), tag=tag).reshape(w * chunk, *moved.shape[1:])
            local = rows[:n].movedim(0, d)
    for i, p in enumerate(x.placements):
        if isinstance(p, _StridedShard) and [
            q
            for q in x.placements
            if (isinstance(q, _StridedShard) or q.is_shard()) and q.dim == p.dim  # type: ignore[attr-defined]  # a Shard: .dim
        ] == [p]:
            local = _unfuse(local, p.dim, int(p.split_factor), mesh.size(i), mesh.get_group(i), tag)
    for i, p in enumerate(x.placements):
        if p.is_partial():
            local = local.clone()
            all_reduce(local, mesh.get_group(i), tag=tag)
    return local.contiguous()


def _unfuse(local: torch.Tensor, d: int, parts: int, w: int, group, tag: str) -> torch.Tensor:
    """The whole of dim ``d`` placed ``_StridedShard(d, split_factor=parts)`` alone on a mesh dim
    of ``w`` ranks: rank ``r`` holds the ``r``-th slice of each of ``parts`` parts (a fused colwise
    weight, ``[q_r; k_r; v_r]``), so the gathered ``[w][parts][n]`` is reordered to ``[parts][w][n]``."""
    moved = local.movedim(d, 0).contiguous()
    rows = all_gather_rows(moved, group, tag=tag)
    n = moved.shape[0] // parts
    whole = rows.reshape(w, parts, n, *moved.shape[1:]).transpose(0, 1).reshape(w * moved.shape[0], *moved.shape[1:])
    return whole.movedim(0, d)


# [Note: nested shards]
# DTensor reads placements left to right: Shard(d) on mesh dim i splits what the earlier mesh
# dims left of tensor dim d into torch.chunk pieces, so earlier mesh dims are the outer splits.
# _StridedShard(d, split_factor=sf) on mesh dim i is the exception FSDP over tensor parallelism
# needs: it is the split that would have come *after* the later mesh dims sharding d (whose
# ranks multiply to sf), i.e. the innermost one: the data-parallel rows cut from each
# tensor-parallel slice. A tensor dim is rebuilt by undoing its splits innermost first, each
# all-gather over its mesh dim covering the length that split cut on this rank (the tp-local
# n / sf rows for the strided one), then the next one out. Rebuilding outermost first, as a
# plain right-to-left walk over the mesh would for a strided placement, interleaves the slices.
# A _StridedShard alone on its tensor dim (a fused colwise weight, ``colwise_fused:k``) holds the
# r-th slice of each of its k parts on rank r: it is gathered, then reordered part by part.


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
            f"Do not gate it on rank 0 (`if rank == 0: ...`); call it on every rank.",
            [],
        ) from e
