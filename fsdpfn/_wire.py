"""Bytes on the wire: what one rank sends for a collective, from its kind, its full buffer's bytes
and its group's size. The one formula behind every ``wire_bytes`` of the package: the counter
(:class:`fsdpfn.comm.CollectiveCall`), the step's list (:class:`fsdpfn.Collective`, so
``plan.cost()``), the simulator's links and its optimizer costs all call it, so a figure
predicted from a plan and one counted in a real step cannot drift apart. It imports nothing, so
every layer may use it.

[Note: bytes on the wire]
Under a bandwidth-optimal (ring) algorithm a rank of a group of ``g`` sends ``(g-1)/g`` of the
full buffer of ``n`` bytes for an all-gather, a reduce-scatter, an all-to-all or a broadcast: a
pass over the ring. An all-reduce is a reduce-scatter then an all-gather, two passes:
``2 (g-1)/g * n``; a barrier is a one-element all-reduce. The ring's sequential hops follow
the same passes: ``g - 1`` per pass. A ``send_recv`` (one hop of a ring: every rank sends its
whole buffer to the next rank and receives the previous rank's) sends all ``n`` bytes in one step,
whatever ``g``; context-parallel ring attention makes ``cp - 1`` of them per layer.
"""

from __future__ import annotations

__all__ = ["passes", "ring_steps", "wire_bytes"]

_TWO_PASSES = frozenset({"all_reduce", "barrier"})


def passes(kind: str) -> int:
    """Passes over the ring a collective of ``kind`` makes (see [Note: bytes on the wire]).

    Example:
      >>> passes("all_gather"), passes("all_reduce")
      (1, 2)
    """
    return 2 if kind in _TWO_PASSES else 1


def wire_bytes(kind: str, group_size: int, nbytes: float) -> float:
    """Bytes one rank sends for a collective of ``kind`` over ``group_size`` ranks whose full
    buffer has ``nbytes`` (see [Note: bytes on the wire]). A group of unknown size (0: a traced
    graph without a live group) is counted as sending nothing.

    Example:
      >>> wire_bytes("all_gather", 4, 1024), wire_bytes("all_reduce", 4, 1024), wire_bytes("send_recv", 4, 1024)
      (768.0, 1536.0, 1024.0)
    """
    if group_size < 1:
        return 0.0
    if kind == "send_recv":
        return float(nbytes) if group_size > 1 else 0.0
    return passes(kind) * (group_size - 1) / group_size * nbytes


def ring_steps(kind: str, group_size: int) -> int:
    """Sequential hops of a ring collective over ``group_size`` ranks: ``g - 1`` per pass.

    Example:
      >>> ring_steps("all_gather", 8), ring_steps("all_reduce", 8), ring_steps("send_recv", 8)
      (7, 14, 1)
    """
    if kind == "send_recv":
        return 1 if group_size > 1 else 0
    return passes(kind) * (group_size - 1)
