"""Context-parallel activation collectives: differentiable, each beside its transpose.

The sequence of every example is split over the ranks of a context-parallel group; attention
needs every rank's keys and values. Two ways to get them, as ``torch.autograd.Function`` s that
work under ``loss.backward()`` and ``torch.func.grad`` alike (the recipe of [Note: TP
collectives under torch.func] in ``fsdpfn/comm/_tp.py``):

===================  ======================================  ===================================
function             forward                                 backward (its transpose)
===================  ======================================  ===================================
``cp_all_gather``    every rank's ``x`` along ``dim``,        the sum over ranks of the gradient,
                     concatenated in rank order              this rank's block (reduce-scatter)
``cp_ring_shift``    the previous rank's ``x`` (``shift``)    the gradient sent back (``-shift``)
===================  ======================================  ===================================

so that ``<cp_all_gather(x), y> == <x, reduce_scatter(y)>`` and ``<shift(x), y> == <x,
shift^-1(y)>`` summed over ranks: the gradient of a key block that travelled around the ring
travels back the same way.
"""

from __future__ import annotations

import contextlib

import torch

from fsdpfn.comm import _groups, _traceable
from fsdpfn.comm._collectives import all_gather, reduce_scatter, send_recv

__all__ = ["cp_all_gather", "cp_ring_shift"]


# While dynamo traces, the same Functions run the functional collectives ([Note: collectives
# under torch.compile]) and need no functorch escape: one body for eager and compiled steps.


def _escape():
    return contextlib.nullcontext() if _traceable.compiling() else torch._C._DisableFuncTorch()


def _gather(x: torch.Tensor, dim: int, group, tag: str) -> torch.Tensor:
    w = _groups.group_size(group)
    front = x.movedim(dim, 0).contiguous()
    if _traceable.compiling():
        out = _traceable.traced_all_gather(front.view(-1), group)
    else:
        out = torch.empty(w * front.numel(), dtype=x.dtype, device=x.device)
        all_gather(out, front.view(-1), group, tag=tag).wait()
    return out.view(w * front.shape[0], *front.shape[1:]).movedim(0, dim)


def _scatter(g: torch.Tensor, dim: int, group, tag: str) -> torch.Tensor:
    w = _groups.group_size(group)
    front = g.movedim(dim, 0).contiguous()
    if _traceable.compiling():
        out = _traceable.traced_reduce_scatter(front.view(-1), group)
    else:
        out = torch.empty(front.numel() // w, dtype=g.dtype, device=g.device)
        reduce_scatter(out, front.view(-1), group, tag=tag).wait()
    return out.view(front.shape[0] // w, *front.shape[1:]).movedim(0, dim)


def _shift(x: torch.Tensor, shift: int, group, tag: str) -> torch.Tensor:
    flat = x.contiguous().view(-1)
    if _traceable.compiling():
        return _traceable.traced_shift(flat, group, shift).view(x.shape)
    out = torch.empty_like(flat)
    send_recv(out, flat, group, shift=shift, tag=tag).wait()
    return out.view(x.shape)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, group, tag):
        with _escape():
            return _gather(x, dim, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.group, ctx.tag = inputs

    @staticmethod
    def backward(ctx, g):
        with _escape():
            return _scatter(g, ctx.dim, ctx.group, ctx.tag), None, None, None


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(x, shift, group, tag):
        with _escape():
            return _shift(x, shift, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.shift, ctx.group, ctx.tag = inputs

    @staticmethod
    def backward(ctx, g):
        with _escape():
            return _shift(g, -ctx.shift, ctx.group, ctx.tag), None, None, None


def cp_all_gather(x: torch.Tensor, group=None, *, dim: int = 0, tag: str = "cp_gather") -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim``, in rank order (shapes must agree);
    backward sums the gradient over ranks and keeps this rank's block (a reduce-scatter, the
    all-gather's transpose).

    Example:
      >>> fsdpfn.comm.cp_all_gather(torch.ones(2, 3), dim=1).shape   # one process
      torch.Size([2, 3])
    """
    d = dim % max(x.dim(), 1)
    return _AllGather.apply(x, d, group, tag)


def cp_ring_shift(x: torch.Tensor, group=None, *, shift: int = 1, tag: str = "cp_ring") -> torch.Tensor:
    """Rank ``r``'s result is rank ``(r - shift) % W``'s ``x`` (each rank passes its ``x`` on
    to the next); backward sends the gradient back, ``-shift`` (its transpose).

    Example:
      >>> x = torch.arange(3.0, requires_grad=True)
      >>> y = fsdpfn.comm.cp_ring_shift(x)   # one process: its own
      >>> (2 * y).sum().backward(); x.grad.tolist()
      [2.0, 2.0, 2.0]
    """
    return _Shift.apply(x, shift, group, tag)
