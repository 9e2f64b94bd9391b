"""Transformer Engine on CUDA: checks made when a plan asks for it, and the hand-over of the
gathered FP8 bytes to TE's own quantized tensor types, so TE layers use them without a
dequantize.

Only imported names of ``transformer_engine`` are used, looked up when called: fsdpfn runs (and
is tested) without it. The hand-over ran on no GPU here (no CUDA on the project's machines yet):
``tests/test_fp8_gather.py::test_te_*`` run it where CUDA and Transformer Engine are present.
"""

from __future__ import annotations

import importlib
import math
from typing import Sequence

import torch

from fsdpfn.fp8._recipes import Float8BlockScaling, Float8CurrentScaling, Float8Recipe, MXFP8BlockScaling, Quantized

__all__ = ["check_te", "te_tensor"]

_MX_BLOCK = 32


def _te():
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        raise ValueError(
            f"Float8GatherPolicy(backend='te') needs Transformer Engine, which does not import here ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Install it with pip install 'fsdpfn[te]' (CUDA only), or use "
            "backend='torch'."
        ) from None


def _te_version() -> str:
    try:
        return importlib.import_module("transformer_engine").__version__
    except Exception:
        return "(unknown version)"


def _support(te, recipe: Float8Recipe) -> tuple[bool, str]:
    names = {MXFP8BlockScaling: "is_mxfp8_available", Float8CurrentScaling: "is_fp8_available"}
    fn = getattr(te, names[type(recipe)], None)
    if fn is not None:
        try:
            ok, reason = fn(return_reason=True)
        except TypeError:
            ok, reason = fn(), ""
        return bool(ok), reason
    legacy = {MXFP8BlockScaling: "check_mxfp8_support", Float8CurrentScaling: "check_fp8_support"}
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            fn = getattr(importlib.import_module(mod), legacy[type(recipe)])
        except (ImportError, AttributeError):
            continue
        ok, reason = fn()
        return bool(ok), reason
    return True, ""


def check_te(recipe: Float8Recipe, params: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """Raises ``ValueError`` unless Transformer Engine can take ``recipe``'s FP8 weights here:
    TE imports, has the recipe, CUDA is present and supports it, and every FP8 parameter has a
    shape TE's quantized tensor accepts. Called by :func:`fsdpfn.plan` for ``backend="te"``, on
    every rank, before any collective."""
    te = _te()
    recipes = importlib.import_module("transformer_engine.common.recipe")
    te_name = type(recipe).__name__
    if not hasattr(recipes, te_name):
        raise ValueError(
            f"the installed Transformer Engine {_te_version()} has no recipe {te_name} "
            f"(transformer_engine.common.recipe.{te_name}); upgrade it (pip install -U 'fsdpfn[te]') or use backend='torch'"
        )
    if isinstance(recipe, Float8BlockScaling):
        raise ValueError(
            "Float8GatherPolicy(backend='te') hands MXFP8BlockScaling and Float8CurrentScaling weights to Transformer "
            "Engine; 1 x 128 blocks (Float8BlockScaling) are not handed over yet: use backend='torch' for them"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            "Float8GatherPolicy(backend='te') needs a CUDA device (Transformer Engine runs on GPUs only); use backend='torch' on CPU"
        )
    ok, reason = _support(te, recipe)
    if not ok:
        raise ValueError(
            f"this GPU cannot run {te_name} in Transformer Engine {_te_version()}: {reason}; use another recipe or backend='torch'"
        )
    if isinstance(recipe, MXFP8BlockScaling):
        if recipe.scale_mode != "rceil":
            raise ValueError(
                "Transformer Engine computes MXFP8 scales with the 'rceil' rule; use MXFP8BlockScaling() (scale_mode='rceil') with backend='te'"
            )
        for name, shape in params:
            lines = math.prod(shape[:-1])
            if shape[-1] % _MX_BLOCK or lines % _MX_BLOCK:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(shape)}; Transformer Engine's MXFP8 tensors need the last dim and the "
                    f"product of the others to be multiples of 32. Keep it in param_dtype with "
                    f"Float8GatherPolicy(exclude=[{name!r}, ...]) or use backend='torch'"
                )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def te_tensor(
    recipe: Float8Recipe, q: Quantized, shape: tuple[int, ...], dtype: torch.dtype, dequantized: torch.Tensor
):
    """TE's quantized tensor for a gathered weight: ``q`` (our E4M3 bytes and scales, in the
    whole weight's row-major layout) becomes the rowwise data; the columnwise copy TE needs for
    the backward GEMMs is made by TE's own quantizer from ``dequantized``."""
    tex = importlib.import_module("transformer_engine_torch")
    data = q.data.view(torch.uint8).reshape(-1, shape[-1])
    if isinstance(recipe, MXFP8BlockScaling):
        mx = importlib.import_module("transformer_engine.pytorch.tensor.mxfp8_tensor")
        rows, cols = data.shape
        scale_inv = torch.zeros(
            _round_up(rows, 128), _round_up(cols // _MX_BLOCK, 4), dtype=torch.uint8, device=data.device
        )
        scale_inv[:rows, : cols // _MX_BLOCK].copy_(q.scale.reshape(rows, -1))
        quantizer = mx.MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
        out = quantizer.create_tensor_from_data(data, scale_inv, fake_dtype=dtype)
        colwise = mx.MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=False, columnwise=True)(
            dequantized.reshape(rows, cols)
        )
        out._columnwise_data = colwise._columnwise_data
        out._columnwise_scale_inv = colwise._columnwise_scale_inv
        out._quantizer = mx.MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
        return out.view(*shape) if len(shape) != 2 else out
    if isinstance(recipe, Float8CurrentScaling):
        f8 = importlib.import_module("transformer_engine.pytorch.tensor.float8_tensor")
        return f8.Float8Tensor(
            shape=tuple(shape),
            dtype=dtype,
            data=q.data.view(torch.uint8).reshape(shape),
            fp8_scale_inv=q.scale.reshape(1).to(torch.float32),
            fp8_dtype=tex.DType.kFloat8E4M3,
            requires_grad=False,
        )
    raise ValueError(f"{type(recipe).__name__} is not handed to Transformer Engine (checked at plan time)")
