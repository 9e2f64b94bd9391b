"""Expert-parallel token exchange: rows of a tensor sent to the ranks that hold their experts,
differentiable.

:func:`ep_all_to_all` sends ``send_counts[r]`` consecutive rows of ``x`` to rank ``r`` of the
group and returns the rows every rank sent here, by source rank; its transpose is the same
exchange with the counts swapped, which is its backward. It is a ``torch.autograd.Function``
with ``setup_context`` whose collective runs inside ``torch._C._DisableFuncTorch()``, the recipe
of the tensor-parallel collectives ([Note: TP collectives under torch.func] in
``fsdpfn/comm/_tp.py``), so it works under ``loss.backward()`` and ``torch.func.grad`` alike.
The counts are host-side integers that every rank must agree on pairwise: :func:`ep_counts`
exchanges them (one small all-to-all) before the rows move.
"""

from __future__ import annotations

import contextlib

import torch

from fsdpfn.comm import _groups
from fsdpfn.comm._collectives import all_to_all
from fsdpfn.comm._traceable import compiling, traced_all_to_all

__all__ = ["ep_all_to_all", "ep_counts"]


def ep_counts(send_counts: list[int] | torch.Tensor, group=None, *, tag: str = "ep_counts") -> list[int]:
    """How many rows each rank of ``group`` will send here, given how many this rank sends each:
    the counts' all-to-all (``send_counts`` has one entry per rank of the group).

    Example:
      >>> fsdpfn.comm.ep_counts([3])  # one process: what it sends itself
      [3]
    """
    w = _groups.group_size(group)
    counts = torch.as_tensor(send_counts, dtype=torch.int64).reshape(-1)
    if counts.numel() % w:
        raise ValueError(
            f"ep_counts: {counts.numel()} counts for a group of {w} ranks; give a whole number of counts per rank"
        )
    out = torch.empty_like(counts)
    all_to_all(out, counts, group, tag=tag).wait()
    return out.tolist()


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, tag: str) -> torch.Tensor:
    row = x.shape[1:]
    n = int(torch.Size(row).numel())
    flat = x.contiguous().view(-1)
    if compiling():  # the counts are the caller's ints: constants of the graph (a padded dispatch's)
        out = traced_all_to_all(flat, group, [c * n for c in recv], [c * n for c in send])
        return out.view(sum(recv), *row)
    out = torch.empty(sum(recv) * n, dtype=x.dtype, device=x.device)
    all_to_all(
        out, flat, group, output_splits=[c * n for c in recv], input_splits=[c * n for c in send], tag=tag
    ).wait()
    return out.view(sum(recv), *row)


def _escape():
    return contextlib.nullcontext() if compiling() else torch._C._DisableFuncTorch()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, send, recv, group, tag):
        with _escape():
            return _exchange(x, send, recv, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.send, ctx.recv, ctx.group, ctx.tag = inputs

    @staticmethod
    def backward(ctx, g):
        with _escape():
            return _exchange(g, ctx.recv, ctx.send, ctx.group, ctx.tag), None, None, None, None


def ep_all_to_all(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None, *, tag: str = "ep"
) -> torch.Tensor:
    """Sends rows ``[sum(send_counts[:r]), sum(send_counts[:r+1]))`` of ``x`` to rank ``r`` of
    ``group`` and returns the ``sum(recv_counts)`` rows received, by source rank. Backward: the
    same exchange of the gradient with the counts swapped (its transpose).

    Args:
      x: ``[rows, ...]``, rows grouped by destination rank.
      send_counts: rows for each rank of the group (``sum == x.shape[0]``).
      recv_counts: rows each rank sends here (:func:`ep_counts` of ``send_counts``).
      group: the expert-parallel process group.
      tag: label for the counter and the flight recorder.

    Raises:
      ValueError: the counts do not fit ``x`` or the group, named, before any collective.

    Example:
      >>> x = torch.arange(6.0).view(3, 2).requires_grad_()
      >>> y = fsdpfn.comm.ep_all_to_all(x, [3], [3])
      >>> y.sum().backward(); x.grad.tolist()
      [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    w = _groups.group_size(group)
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != w or len(recv) != w or min(send + recv, default=0) < 0:
        raise ValueError(
            f"ep_all_to_all: send_counts {send} and recv_counts {recv} need one count >= 0 per rank of the group ({w})"
        )
    if x.dim() < 1 or sum(send) != x.shape[0]:
        raise ValueError(
            f"ep_all_to_all: send_counts {send} add up to {sum(send)} rows, but x has shape {tuple(x.shape)}"
        )
    return _AllToAll.apply(x, send, recv, group, tag)
