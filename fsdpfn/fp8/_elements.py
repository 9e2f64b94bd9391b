"""The bit-level pieces every FP8 recipe shares: power-of-two scale exponents, exact powers of
two, E4M3 rounding with saturation, E8M0 codes.

All of it is exact integer or power-of-two arithmetic on float32 (no ``log2``, no division), so
a block's scale and codes depend only on the block's values: quantizing a rank's rows gives the
bytes that quantizing the whole tensor gives for those rows (see [Note: rows are whole] in
:mod:`fsdpfn.fp8._recipes`).
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E4M3_NAN",
    "E8M0_BIAS",
    "E8M0_NAN",
    "SCALE_RULES",
    "exp2_exact",
    "pow2_exponent",
    "to_e4m3",
    "e8m0_to_float",
]

E4M3_MAX = 448.0  # 1.75 * 2**8: the largest finite float8_e4m3fn
E4M3_EMAX = 8  # exponent of the largest normal E4M3 number (the spec's emax_elem)
E4M3_NAN = 0x7F  # S.1111.111 (E4M3 has no infinities)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
EXP_MIN, EXP_MAX = -127, 127  # the powers of two E8M0 encodes

SCALE_RULES = ("rceil", "floor")


def pow2_exponent(amax: torch.Tensor, rule: str, zero: int = EXP_MIN) -> torch.Tensor:
    """The shared exponent ``s`` (scale ``X = 2**s``) of blocks whose largest magnitude is
    ``amax`` (float32, finite, >= 0), clamped to E8M0's ``[-127, 127]``.

    ``"rceil"`` (NVIDIA's rule, cuBLAS / Transformer Engine MXFP8, torchao's
    ``ScaleCalculationMode.RCEIL``): the smallest ``s`` with ``amax / 2**s <= 448``, so no element
    saturates. ``"floor"`` (the OCP MX v1.0 spec, section 6.3): ``floor(log2(amax)) - 8``; then
    ``amax / X`` lies in ``[256, 512)`` and elements above 448 saturate. Both come from
    ``frexp(amax) = m * 2**e`` (``m`` in ``[0.5, 1)``): floor is ``e - 9``, rceil adds one when
    ``m > 0.875`` (``amax / 2**(e-9) > 448``). A zero block gets ``zero``.

    Example:
      >>> pow2_exponent(torch.tensor([448.0, 449.0, 1.0, 0.0]), "rceil").tolist()
      [0, 1, -8, -127]
      >>> pow2_exponent(torch.tensor([448.0, 449.0, 1.0, 0.0]), "floor").tolist()
      [0, 0, -8, -127]
    """
    m, e = torch.frexp(amax)
    s = e - (E4M3_EMAX + 1)
    if rule == "rceil":
        s = s + (m > 0.875).to(s.dtype)
    elif rule != "floor":
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    s = torch.where(amax == 0, torch.full_like(s, zero), s)
    return s.clamp(EXP_MIN, EXP_MAX)


def exp2_exact(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` in float32, exactly, for integer ``k`` in ``[-127, 127]`` (``2**-127`` is a
    float32 subnormal; built from its bits, not by a rounded ``exp2``)."""
    k = k.to(torch.int32)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22))
    return bits.view(torch.float32)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 -> ``float8_e4m3fn``: round to nearest, ties to even, saturating at +-448; NaN
    stays NaN and signed zeros keep their sign. (The clamp makes saturation explicit rather than
    relying on the cast's overflow behaviour, which has changed across torch versions.)"""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> the float32 scales ``2**(code - 127)``; code 255 is NaN."""
    k = codes.to(torch.int32) - E8M0_BIAS
    out = exp2_exact(k.clamp(EXP_MIN, EXP_MAX))
    return torch.where(codes == E8M0_NAN, torch.full_like(out, float("nan")), out)
