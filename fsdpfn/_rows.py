"""Row arithmetic: how a tensor's rows are split over the ranks of one mesh axis.

A leaf module (it imports nothing from fsdpfn), so the communication layer, the optimizers and
the simulator can share the one definition of the split without importing the plan.
"""

from __future__ import annotations

__all__ = ["chunk_bounds", "chunk_size"]


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
