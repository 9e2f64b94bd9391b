"""Tensor-parallel activation collectives: differentiable, each beside its transpose.

Megatron's two conjugate operators and the all-gather pair, as ``torch.autograd.Function`` s that
work under ``loss.backward()`` and under ``torch.func.grad``/``vjp`` alike (see [Note: TP
collectives under torch.func]):

==================  =============================  =============================
function            forward                        backward (its transpose)
==================  =============================  =============================
``tp_copy``         identity                       all-reduce (sum) over tp
``tp_reduce``       all-reduce (sum) over tp       identity
``tp_gather_last``  all-gather along the last dim  this rank's slice of the grad
``tp_split_last``   this rank's slice, last dim    all-gather along the last dim
==================  =============================  =============================

``tp_copy`` goes before a colwise layer (its input is used by every tp rank, so its gradient
is the sum of theirs), ``tp_reduce`` after a rowwise one (each tp rank holds a partial sum).

[Note: TP collectives under torch.func]
torch's own tensor-parallel hooks call ``DTensor.from_local``, an autograd Function without
``setup_context``, which ``torch.func`` transforms refuse. These Functions define
``setup_context``, take the group as plain data, and run their collectives inside
``torch._C._DisableFuncTorch()`` into freshly allocated outputs, the same recipe as
:func:`fsdpfn.unshard`.
"""

from __future__ import annotations

import contextlib

import torch

from fsdpfn.comm import _groups
from fsdpfn.comm import _traceable as _traced
from fsdpfn.comm._collectives import all_gather, all_reduce

__all__ = ["tp_copy", "tp_reduce", "tp_gather_last", "tp_split_last"]


class _Eager:
    """:mod:`fsdpfn.comm`'s counted collectives into fresh outputs, below functorch."""

    escape = torch._C._DisableFuncTorch

    @staticmethod
    def sum(x: torch.Tensor, group, tag: str) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out.view(-1), group, tag=tag).wait()
        return out

    @staticmethod
    def gather(x: torch.Tensor, group, tag: str) -> torch.Tensor:
        flat = torch.empty(_groups.group_size(group) * x.numel(), dtype=x.dtype, device=x.device)
        all_gather(flat, x.contiguous().view(-1), group, tag=tag).wait()
        return flat

    @staticmethod
    def size_rank(group) -> tuple[int, int]:
        return _groups.group_size(group), _groups.group_rank(group)


class _Traced:
    """[Note: TP collectives under torch.compile]
    While dynamo traces (a unit compiled by ``Runtime.compile_units``), ``_DisableFuncTorch`` and
    asynchronous work would break the graph, so the same Functions call torch's functional
    collectives, traced into the forward and backward graphs with the same sums and slices.
    There is no ``torch.func`` transform inside a compiled unit (the runtime runs it below
    functorch), so no functorch escape is needed. They are not counted or flight-recorded per
    call; the runtime's unit collectives around them still are."""

    escape = contextlib.nullcontext

    @staticmethod
    def sum(x: torch.Tensor, group, tag: str) -> torch.Tensor:
        return _traced.traced_all_reduce(x.contiguous(), group)

    @staticmethod
    def gather(x: torch.Tensor, group, tag: str) -> torch.Tensor:
        return _traced.traced_all_gather(x.contiguous().view(-1), group)

    @staticmethod
    def size_rank(group) -> tuple[int, int]:
        return group.size(), group.rank()


def _gather_last(x: torch.Tensor, group, tag: str, wire) -> torch.Tensor:
    w = wire.size_rank(group)[0]
    flat = wire.gather(x, group, tag)
    # (w, ..., n) -> (..., w, n) -> (..., w n): rank r's columns land at [r n, (r + 1) n).
    return flat.view(w, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], w * x.shape[-1])


def _split_last(x: torch.Tensor, group, wire) -> torch.Tensor:
    w, r = wire.size_rank(group)
    n = x.shape[-1]
    if n % w:
        raise ValueError(f"tp_split_last: the last dim ({n}) does not divide over the {w} tensor-parallel ranks")
    return x.narrow(-1, r * (n // w), n // w).contiguous()


# Each Function takes the wire (_Eager or _Traced) as plain data beside the group: one Function
# per operator, its forward and backward written once for both.


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(x, group, tag, wire):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.tag, ctx.wire = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        with ctx.wire.escape():
            return ctx.wire.sum(g, ctx.group, ctx.tag), None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group, tag, wire):
        with wire.escape():
            return wire.sum(x, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(x, group, tag, wire):
        with wire.escape():
            return _gather_last(x, group, tag, wire)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.wire = inputs[1], inputs[3]

    @staticmethod
    def backward(ctx, g):
        with ctx.wire.escape():
            return _split_last(g, ctx.group, ctx.wire), None, None, None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(x, group, tag, wire):
        with wire.escape():
            return _split_last(x, group, wire)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.tag, ctx.wire = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        with ctx.wire.escape():
            return _gather_last(g, ctx.group, ctx.tag, ctx.wire), None, None, None


def _apply(fn, x: torch.Tensor, group, tag: str) -> torch.Tensor:
    if group is not None and _traced.compiling():
        # No tag: traced collectives are not recorded per call, and a per-module string would
        # make dynamo compile each block's graph again.
        return fn.apply(x, group, "", _Traced)
    return fn.apply(x, group, tag, _Eager)


def tp_copy(x: torch.Tensor, group=None, *, tag: str = "") -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over ``group``. Transpose of
    :func:`tp_reduce`. Put it on the input of a colwise layer.

    Example:
      >>> fsdpfn.comm.tp_copy(torch.ones(2)).tolist()  # one process: tp = 1
      [1.0, 1.0]
    """
    return _apply(_Copy, x, group, tag)


def tp_reduce(x: torch.Tensor, group=None, *, tag: str = "") -> torch.Tensor:
    """All-reduces (sums) ``x`` over ``group``; backward is the identity. Transpose of
    :func:`tp_copy`. Put it on the output of a rowwise layer.

    Example:
      >>> fsdpfn.comm.tp_reduce(torch.ones(2)).tolist()
      [1.0, 1.0]
    """
    return _apply(_Reduce, x, group, tag)


def tp_gather_last(x: torch.Tensor, group=None, *, tag: str = "") -> torch.Tensor:
    """Concatenates every rank's ``x`` along the last dim, in rank order; backward keeps this
    rank's slice of the gradient. Transpose of :func:`tp_split_last`.

    Example:
      >>> fsdpfn.comm.tp_gather_last(torch.ones(2, 3)).shape
      torch.Size([2, 3])
    """
    return _apply(_GatherLast, x, group, tag)


def tp_split_last(x: torch.Tensor, group=None, *, tag: str = "") -> torch.Tensor:
    """This rank's equal slice of ``x`` along the last dim; backward all-gathers the gradient
    along it. Transpose of :func:`tp_gather_last`.

    Example:
      >>> fsdpfn.comm.tp_split_last(torch.arange(4.0)).tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    return _apply(_SplitLast, x, group, tag)
