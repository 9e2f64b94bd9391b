"""FP8 recipes: how a tensor becomes E4M3 elements plus scales, and back.

A recipe is a small frozen value with ``quantize(x) -> Quantized(data, scale)`` and
``dequantize(q, dtype)``. Three are provided, named as in Transformer Engine's
``transformer_engine.common.recipe``:

==========================  ==================================  ======================
recipe                      one scale per                       scale format
==========================  ==================================  ======================
``MXFP8BlockScaling``       32 consecutive elements (last dim)  E8M0 (uint8 codes)
``Float8BlockScaling``      128 consecutive elements (last dim) float32, a power of two
``Float8CurrentScaling``    whole tensor (from its amax)        float32
==========================  ==================================  ======================

[Note: rows are whole]
Block scales run along the last dimension, and fsdpfn splits parameters along dim 0, so every
block lies inside one rank's rows. A block's scale and codes depend only on the block (exact
power-of-two arithmetic, see :mod:`fsdpfn.fp8._elements`), hence quantizing each rank's rows and
concatenating the bytes gives exactly the bytes of quantizing the whole tensor: quantize-then-
gather == gather-then-quantize, bit for bit, for uneven rows, empty shards and last dims that are
not multiples of the block (the short last block is padded with zeros, which never change a
block's amax). The per-tensor recipe needs the whole tensor's amax: the gather computes it with
one small all-reduce (max) first and passes it as ``amax=``.

[Note: special values]
Following the OCP MX v1.0 spec and its reference implementation (microsoft/microxcaling): a
block holding a NaN or an infinity gets scale NaN (E8M0 code 0xFF; a NaN float32 scale for the
other recipes) and NaN elements, so the whole block dequantizes to NaN; a block of zeros gets the
smallest scale (E8M0 code 0, 2**-127; 1.0 for float32 scales, as Transformer Engine does) and
zero elements; signed zeros keep their sign. Dequantizing computes ``element * scale`` exactly and
rounds once to the target dtype, so an element rounded up next to the dtype's largest value
(``256 * 2**120`` from a float32 amax near ``2**128``) becomes inf there. Transformer Engine's kernels differ on infinities
(scale 0xFE, saturated elements) and flush blocks whose amax is below 448 * 2**-127 to zero; a
model whose weights hold an infinity has diverged anyway (``optim.apply_if_finite``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import torch

from fsdpfn.fp8._elements import (
    E4M3_MAX,
    E4M3_NAN,
    E8M0_BIAS,
    E8M0_NAN,
    SCALE_RULES,
    e8m0_to_float,
    exp2_exact,
    pow2_exponent,
    to_e4m3,
)

__all__ = [
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8Recipe",
    "MXFP8BlockScaling",
    "Quantized",
    "recipe_from_dict",
]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Quantized(NamedTuple):
    """An FP8 tensor: ``data`` (``float8_e4m3fn``, the input's shape) and ``scale`` (for block
    recipes shaped ``(*shape[:-1], ceil(shape[-1] / block_size))``, uint8 E8M0 codes or float32
    powers of two; for the per-tensor recipe a 0-d float32). ``x ~= data * scale`` blockwise."""

    data: torch.Tensor
    scale: torch.Tensor


class Float8Recipe:
    """Base class of FP8 recipes (see the table in :mod:`fsdpfn.fp8`).

    Attributes:
      block_size: elements per scale along the last dim, or ``None`` for one scale per tensor.
      scale_dtype: ``torch.uint8`` (E8M0 codes) or ``torch.float32``.
    """

    name: ClassVar[str]
    block_size: ClassVar[int | None]
    scale_dtype: ClassVar[torch.dtype]

    @property
    def tensorwise(self) -> bool:
        """One scale for the whole tensor: the gather all-reduces each tensor's amax first."""
        return self.block_size is None

    def scales_per_line(self, n: int) -> int:
        """Scales of one line of ``n`` elements along the last dim (0 for the per-tensor recipe,
        whose scale is not shipped: every rank derives it from the all-reduced amax)."""
        return 0 if self.block_size is None else -(-n // self.block_size)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.block_size is None:
            return ()
        return (*shape[:-1], self.scales_per_line(shape[-1]))

    def quantize(self, x: torch.Tensor, *, amax: torch.Tensor | None = None) -> Quantized:
        """Quantizes ``x`` (float32, bfloat16 or float16, at least 1-D).

        Args:
          x: the tensor. Block recipes scale blocks along its last dim.
          amax: per-tensor recipe only: the amax to scale by (the whole tensor's, when ``x`` is
            one rank's rows); default ``x.abs().amax()``.
        """
        _check_input(x)
        if self.block_size is None:
            return self._quantize_tensor(x, amax)
        if amax is not None:
            raise ValueError(f"{self.name} scales each block by its own amax; amax= is for per-tensor recipes")
        return self._quantize_blocks(x)

    def dequantize(self, q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` in ``dtype`` (computed exactly in float32, then cast once)."""
        data = q.data.view(torch.float8_e4m3fn).to(torch.float32)
        scale = e8m0_to_float(q.scale) if self.scale_dtype == torch.uint8 else q.scale.to(torch.float32)
        if self.block_size is None or not data.numel():
            return (data * scale).to(dtype)
        n, b = data.shape[-1], self.block_size
        nb = scale.shape[-1]
        if nb * b != n:  # the short last block: pad, scale, cut
            data = torch.nn.functional.pad(data, (0, nb * b - n))
        out = data.view(*data.shape[:-1], nb, b) * scale.unsqueeze(-1)
        return out.view(*data.shape[:-1], nb * b)[..., :n].to(dtype)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x), x.dtype)`` (no gradient; see :func:`fsdpfn.fp8.fake_quantize`)."""
        return self.dequantize(self.quantize(x), x.dtype)

    # ---- blocks --------------------------------------------------------------------------

    def _block_exponents(self, amax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _encode_scale(self, s: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        if self.scale_dtype == torch.uint8:
            codes = (s + E8M0_BIAS).to(torch.uint8)
            return torch.where(finite, codes, torch.full_like(codes, E8M0_NAN))
        out = exp2_exact(s)
        return torch.where(finite, out, torch.full_like(out, float("nan")))

    def _quantize_blocks(self, x: torch.Tensor) -> Quantized:
        b = self.block_size
        assert b is not None  # only block recipes quantize by blocks
        n = x.shape[-1]
        nb = self.scales_per_line(n)
        xf = x.to(torch.float32)
        if nb * b != n:  # the short last block is padded with zeros (never changes its amax)
            xf = torch.nn.functional.pad(xf, (0, nb * b - n))
        blocks = xf.reshape(*x.shape[:-1], nb, b)
        amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
        finite = torch.isfinite(amax)
        s = self._block_exponents(torch.where(finite, amax, torch.zeros_like(amax)))
        y = blocks * exp2_exact(-s).unsqueeze(-1)  # exact: division by a power of two
        codes = to_e4m3(y).view(torch.uint8)
        # unconditional (no data-dependent branch, so the quantizer traces under torch.compile):
        # where every block is finite this is the identity.
        codes = torch.where(finite.unsqueeze(-1), codes, torch.full_like(codes, E4M3_NAN))
        codes = codes.view(*x.shape[:-1], nb * b)
        data = (codes if nb * b == n else codes[..., :n].contiguous()).view(torch.float8_e4m3fn)
        return Quantized(data, self._encode_scale(s, finite))

    def _quantize_tensor(self, x: torch.Tensor, amax: torch.Tensor | None) -> Quantized:
        raise NotImplementedError

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": type(self).__name__, **dataclasses.asdict(self)}  # type: ignore[call-overload]  # every concrete recipe is a dataclass


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize takes a tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"FP8 recipes quantize float32, bfloat16 or float16 tensors, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(
            "FP8 recipes quantize tensors of at least 1 dim (blocks run along the last dim); got a 0-d tensor"
        )


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Float8Recipe):
    """MXFP8 (OCP Microscaling v1.0): E4M3 elements, one E8M0 scale per 32 consecutive elements
    along the last dim; round to nearest even; a short last block padded.

    Args:
      scale_mode: ``"rceil"`` (default; NVIDIA's rule: the smallest power of two with
        ``amax / scale <= 448``, so no element saturates) or ``"floor"`` (the spec's
        ``2**(floor(log2(amax)) - 8)``; elements above 448 saturate). Names as torchao's
        ``ScaleCalculationMode``.

    Example:
      >>> q = MXFP8BlockScaling().quantize(torch.tensor([[1.0, -3.0, 0.1, 448.0]]))
      >>> q.data.float().tolist(), q.scale.tolist()   # scale code 127: 2**0
      ([[1.0, -3.0, 0.1015625, 448.0]], [[127]])
      >>> MXFP8BlockScaling().dequantize(q).tolist()
      [[1.0, -3.0, 0.1015625, 448.0]]
    """

    scale_mode: str = "rceil"

    name: ClassVar[str] = "mxfp8"
    block_size: ClassVar[int] = 32
    scale_dtype: ClassVar[torch.dtype] = torch.uint8

    def __post_init__(self):
        if self.scale_mode not in SCALE_RULES:
            raise ValueError(f"MXFP8BlockScaling(scale_mode={self.scale_mode!r}): choose one of {SCALE_RULES}")

    def _block_exponents(self, amax):
        return pow2_exponent(amax, self.scale_mode)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Float8Recipe):
    """1 x ``block_size`` block scaling (DeepSeek-V3 style; what Transformer Engine runs on
    Hopper): E4M3 elements, one float32 power-of-two scale per ``block_size`` consecutive
    elements along the last dim (the smallest power of two with ``amax / scale <= 448``).

    Transformer Engine's weight default is 128 x 128 blocks; those would cross the row split
    between ranks, so fsdpfn gathers 1 x 128 (TE: ``Float8BlockScaling(w_block_scaling_dim=1)``).

    Example:
      >>> q = Float8BlockScaling().quantize(torch.full((2, 130), 3.0))
      >>> q.scale.shape, q.scale[0].tolist()
      (torch.Size([2, 2]), [0.0078125, 0.0078125])
    """

    block_size: int = 128  # type: ignore[misc]  # a field here, a class constant in the other recipes

    name: ClassVar[str] = "blockwise"
    scale_dtype: ClassVar[torch.dtype] = torch.float32

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"Float8BlockScaling(block_size={self.block_size!r}): a positive int, e.g. 128")

    def _block_exponents(self, amax):
        return pow2_exponent(amax, "rceil", zero=0)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Float8Recipe):
    """Per-tensor ("current") scaling: one float32 scale per tensor from its amax, E4M3 elements.

    Args:
      power_2_scale: round the scale to the smallest power of two with ``amax / scale <= 448``
        (exact); ``False`` (default, as Transformer Engine): ``scale = amax / 448`` computed as
        TE does (``q = e4m3(x * (448 / amax))``, ``scale = 1 / (448 / amax)`` in float32).

    Sharded, a tensor's amax spans ranks: the FP8 gather all-reduces (max) one float32 per
    parameter first, so every rank uses the whole tensor's scale.

    Example:
      >>> q = Float8CurrentScaling(power_2_scale=True).quantize(torch.tensor([1.0, 2.0, 3.0]))
      >>> q.scale.item(), q.data.float().tolist()
      (0.0078125, [128.0, 256.0, 384.0])
    """

    power_2_scale: bool = False

    name: ClassVar[str] = "tensorwise"
    block_size: ClassVar[None] = None
    scale_dtype: ClassVar[torch.dtype] = torch.float32

    def _quantize_tensor(self, x, amax):
        xf = x.to(torch.float32)
        if amax is None:
            amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
        finite = torch.isfinite(amax)
        safe = torch.where(finite, amax, torch.zeros_like(amax))
        if self.power_2_scale:
            s = pow2_exponent(safe, "rceil", zero=0)
            y = xf * exp2_exact(-s)
            scale = exp2_exact(s)
        else:
            # torch.div of two tensors is IEEE division; ``448 / tensor`` is a reciprocal times
            # 448 (two roundings), which is not what Transformer Engine computes.
            mult = torch.where(safe > 0, torch.div(torch.full_like(safe, E4M3_MAX), safe), torch.ones_like(safe))
            mult = torch.where(torch.isfinite(mult), mult, torch.full_like(mult, torch.finfo(torch.float32).max))
            y = xf * mult
            scale = torch.div(torch.ones_like(mult), mult)
        codes = to_e4m3(y).view(torch.uint8)
        codes = torch.where(finite, codes, torch.full_like(codes, E4M3_NAN))
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        return Quantized(codes.view(torch.float8_e4m3fn), scale)


RECIPES = {cls.__name__: cls for cls in (MXFP8BlockScaling, Float8BlockScaling, Float8CurrentScaling)}
BY_NAME = {cls.name: cls for cls in (MXFP8BlockScaling, Float8BlockScaling, Float8CurrentScaling)}


def recipe_from_dict(d: dict[str, Any]) -> Float8Recipe:
    """Inverse of ``recipe.to_dict()`` (plan JSON)."""
    d = dict(d)
    kind = d.pop("recipe", None)
    if kind not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {kind!r} in plan JSON; this fsdpfn knows {sorted(RECIPES)}")
    return RECIPES[kind](**d)
