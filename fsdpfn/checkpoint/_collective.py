"""The few collectives checkpoint calls make besides DCP's own, and the entry check that turns a
call gated on one rank into an error naming the missing ranks."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

__all__ = ["arrive", "broadcast", "dist_on", "rank"]


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def broadcast(obj: Any) -> Any:
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def arrive(what: str, timeout: float) -> None:
    """Every rank must enter a checkpoint call. gloo can tell who did not (``monitored_barrier``),
    so a call gated on one rank (the deadlock of ``if rank == 0: save(...)``) fails there with
    the missing ranks named, instead of hanging in the first collective. NCCL has no monitored
    barrier; there the process group's own timeout applies."""
    if not dist_on() or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(
            f"fsdpfn.checkpoint.{what} is collective: every rank must call it, but not every rank did within "
            f"{timeout:g} s ({e}). Do not gate it on rank 0 (`if rank == 0: save(...)`); call it on every rank."
        ) from e
