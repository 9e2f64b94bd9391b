"""Traceable collectives: what :mod:`fsdpfn.comm` runs inside ``torch.compile``.

[Note: collectives under torch.compile]
The eager collectives (:mod:`fsdpfn.comm._collectives`) launch gloo/NCCL work asynchronously and
wait in slices so that a peer's announced failure ends the wait; each call is counted and gets a
flight record. None of that can be traced: dynamo breaks the graph at the wait loop's clock, at the
flight recorder's process id and store write, at the async work handle. Inside a compiled region
the same collectives are therefore the functional ones of ``torch.distributed`` (``_c10d_functional``
ops: a value in, a value out), which dynamo records as graph nodes and inductor emits between its
fused kernels, where its bucketing and reordering passes may move them. What changes:

- counting: a compiled graph's collectives are listed once, when it is compiled, and counted on
  every call of the graph (:func:`fsdpfn.compile` does both); plain ``torch.compile`` counts
  nothing;
- the flight recorder: no record per collective of a compiled graph (its sequence numbers stay
  those of the eager collectives);
- the timeout: the process group's own operation timeout (set from :func:`fsdpfn.comm.timeout`
  when the group was created by fsdpfn), not the sliced wait; a stuck peer fails the collective
  without naming the rank that is behind.

Every function here takes a group as ``(DeviceMesh, dim)`` (or a process group) and returns the
waited result, so eager calls outside ``torch.compile`` give the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["compiling", "traced_all_gather", "traced_all_reduce", "traced_reduce_scatter"]


def compiling() -> bool:
    """Whether dynamo is tracing the caller (``torch.compile``, ``torch._dynamo.explain``).

    Example:
      >>> fsdpfn.comm.compiling()
      False
    """
    return torch.compiler.is_compiling()


def traced_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's flat ``x`` concatenated in rank order (functional all-gather).

    Example:
      >>> fsdpfn.comm.traced_all_gather(torch.arange(3.0), None)   # no group: one rank
      tensor([0., 1., 2.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))


def traced_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of flat ``x``, rank r keeping its r-th contiguous part.

    Example:
      >>> fsdpfn.comm.traced_reduce_scatter(torch.arange(3.0), None)
      tensor([0., 1., 2.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))


def traced_all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over ranks (``op``: ``"sum"``, ``"max"`` or ``"min"``), out of place.

    Example:
      >>> fsdpfn.comm.traced_all_reduce(torch.ones(2), None)
      tensor([1., 1.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.all_reduce(x, op, group))
