"""Fake quantization with a straight-through gradient: the numbers an FP8 gather hands the
model, computed from a full high-precision tensor."""

from __future__ import annotations

import torch

from fsdpfn.fp8._recipes import Float8Recipe, MXFP8BlockScaling

__all__ = ["fake_quantize"]


class _FakeQuantize(torch.autograd.Function):
    """Forward: ``dequantize(quantize(x))``. Backward: the identity (straight-through)."""

    @staticmethod
    def forward(x, recipe):
        return recipe.fake_quantize(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(x: torch.Tensor, recipe: Float8Recipe | None = None) -> torch.Tensor:
    """``recipe.dequantize(recipe.quantize(x), x.dtype)`` with a straight-through gradient.

    The FP8 gather of a parameter gives exactly ``fake_quantize(bf16 gather of it)`` (see
    [Note: rows are whole] in :mod:`fsdpfn.fp8`), and its gradient flows straight through to the
    masters, so this is the reference an FP8 run is compared with bit for bit. Works under
    ``loss.backward()`` and ``torch.func.grad``.

    Example:
      >>> x = torch.tensor([[1.0, 0.3, -2.5]], requires_grad=True)
      >>> y = fsdpfn.fp8.fake_quantize(x)                 # MXFP8 by default
      >>> y.detach().tolist()
      [[1.0, 0.3125, -2.5]]
      >>> y.sum().backward(); x.grad.tolist()             # straight through
      [[1.0, 1.0, 1.0]]
    """
    recipe = MXFP8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"fake_quantize: recipe must be an fsdpfn.fp8 recipe, got {type(recipe).__name__}")
    return _FakeQuantize.apply(x, recipe)
