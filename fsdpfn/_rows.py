"""Row arithmetic: how a tensor's rows are split over the ranks of one mesh axis.

A leaf module (it imports nothing from fsdpfn), so the communication layer, the optimizers and
the simulator can share the one definition of the split without importing the plan.
"""

from __future__ import annotations

__all__ = ["chunk_bounds", "chunk_size", "unpack_rows"]


def chunk_size(rows: int, world: int) -> int:
    """Rows per rank when ``rows`` are split over ``world`` ranks like ``torch.chunk``: ``ceil(rows / world)``.

    Example:
      >>> chunk_size(5, 4), chunk_size(0, 4)
      (2, 0)
    """
    return -(-rows // world) if rows else 0


def chunk_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s rows under the ``torch.chunk`` split (the split of DTensor's
    ``Shard(0)`` and FSDP2): 5 rows over 4 ranks give 2, 2, 1, 0. The one definition of the split.

    Example:
      >>> [chunk_bounds(5, 4, r) for r in range(4)]
      [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    c = chunk_size(rows, world)
    start = min(rank * c, rows)
    return start, min(start + c, rows)


def unpack_rows(dst, stacked, offset: int, size: int) -> None:
    """Copies one parameter out of a gathered ``(W, segment)`` buffer into ``dst`` (flat): its
    ``size`` elements per rank start at ``offset`` of every rank's segment, and the first
    ``dst.numel()`` of the ``W * size`` stacked elements are the parameter in order (see
    [Note: flat-buffer layout] in ``fsdpfn/_plan/values.py``).

    With ``torch.chunk`` rows, the first ranks hold full chunks, at most one holds a shorter
    one and the rest none: two copies at most, whatever the world size.

    Example:
      >>> import torch
      >>> dst = torch.empty(5)
      >>> unpack_rows(dst, torch.arange(8.0).view(4, 2), 0, 2)  # 5 rows over 4 ranks: 2, 2, 1, 0
      >>> dst.tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    if not size or not dst.numel():
        return
    seg = stacked[:, offset : offset + size]
    full_ranks = dst.numel() // size
    if full_ranks:
        dst[: full_ranks * size].view(full_ranks, size).copy_(seg[:full_ranks])
    rest = dst.numel() - full_ranks * size
    if rest:
        dst[full_ranks * size :].copy_(seg[full_ranks, :rest])
