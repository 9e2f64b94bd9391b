"""Pipeline-parallel activation transfer: a differentiable point-to-point hop.

``pp_send_recv(x, shape)`` is :func:`fsdpfn.comm.send_recv` over the pipeline group, as an
autograd Function that works under ``loss.backward()`` and ``torch.func.grad`` alike (the recipe
of [Note: TP collectives under torch.func] in ``fsdpfn/comm/_tp.py``)::

    forward : rank r sends x to rank r + shift, receives rank r - shift's into a new ``shape``
    backward: the same hop with -shift (its transpose): the gradient of what a rank received
              goes back to the rank that sent it, and arrives as the gradient of its x

A rank that sends nothing passes an empty ``x``, one that receives nothing ``shape=(0,)``:
a stage passing its activation to the next is then one hop in which only two ranks move data,
and its backward carries the activation's gradient the other way. Every rank of the group calls
it, in the same order, as with every collective.
"""

from __future__ import annotations

import torch

from fsdpfn.comm._collectives import send_recv

__all__ = ["pp_send_recv"]


def _hop(x: torch.Tensor, shape: tuple[int, ...], shift: int, group, tag: str) -> torch.Tensor:
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    send_recv(out.view(-1), x.contiguous().view(-1), group, shift=shift, tag=tag).wait()
    return out


class _Hop(torch.autograd.Function):
    @staticmethod
    def forward(x, shape, shift, group, tag):
        with torch._C._DisableFuncTorch():
            return _hop(x, shape, shift, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, ctx.shift, ctx.group, ctx.tag = inputs
        ctx.in_shape = tuple(x.shape)  # a plain tuple: a saved torch.Size comes back as one under torch.func

    @staticmethod
    def backward(ctx, g):
        with torch._C._DisableFuncTorch():
            return _hop(g, ctx.in_shape, -ctx.shift, ctx.group, ctx.tag + "_grad"), None, None, None, None


def pp_send_recv(x: torch.Tensor, shape, group=None, *, shift: int = 1, tag: str = "pp_act") -> torch.Tensor:
    """Sends ``x`` to rank ``r + shift`` of ``group`` and returns what rank ``r - shift`` sent,
    as a tensor of ``shape`` (``(0,)``: nothing); backward sends the gradient back (``-shift``).

    Args:
      x: what this rank sends (an empty tensor: nothing), with the dtype of what it receives.
      shape: the shape of what this rank receives.
      group: the pipeline group (``None``: the default group).
      shift: ranks ahead the data goes (``-1``: to the previous stage).
      tag: the flight recorder's name for the hop.

    Example:
      >>> x = torch.arange(3.0, requires_grad=True)
      >>> y = fsdpfn.comm.pp_send_recv(x, (3,))   # one process: to itself
      >>> (2 * y).sum().backward(); x.grad.tolist()
      [2.0, 2.0, 2.0]
    """
    shape = tuple(int(d) for d in shape)
    return _Hop.apply(x, shape, shift, group, tag)
