"""The FP8 recipes of ``fsdpfn.fp8``, bit for bit: hand-computed cases, hypothesis against an
exact reference written here with ``fractions.Fraction`` (shapes and values with subnormals, ties,
saturation edges, zeros, NaN and infinities), and cross-checks against independent
implementations where installed (torchao's ``to_mx``, ml_dtypes' E4M3 cast, torch's E8M0 dtype).
Also: rows quantized apart give the whole tensor's bytes, the straight-through gradient, and the
policy's accepted forms and errors."""

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn
from fsdpfn.fp8 import (
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8GatherPolicy,
    MXFP8BlockScaling,
    Quantized,
    as_gather_policy,
    fake_quantize,
    recipe_from_dict,
)

# ---------------------------------------------------------------------------------------------
# An exact reference, independent of the library (Python integers and fractions only)
# ---------------------------------------------------------------------------------------------


def _e4m3_value(code: int) -> Fraction:
    e, m = (code >> 3) & 0xF, code & 7
    mag = Fraction(m, 2**9) if e == 0 else Fraction(8 + m, 2**10) * Fraction(2) ** e
    return -mag if code & 0x80 else mag


E4M3_POS = [_e4m3_value(c) for c in range(127)]  # codes 0..126: every finite non-negative E4M3 value
assert E4M3_POS[-1] == 448


def ref_e4m3(y: Fraction, negative: bool) -> int:
    """Round to nearest, ties to even (the even code), saturating at 448."""
    a = abs(y)
    if a >= 448:
        code = 126
    else:
        lo = max(c for c in range(127) if E4M3_POS[c] <= a)
        hi = min(lo + 1, 126)
        d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[hi] - a
        code = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi
    return code | (0x80 if negative else 0)


def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def ref_exponent(amax: Fraction, rule: str, zero: int) -> int:
    if amax == 0:
        return zero
    s = _floor_log2(amax) - 8
    if rule == "rceil":
        while amax > 448 * Fraction(2) ** s:
            s += 1
    return max(-127, min(127, s))


def ref_block_quantize(values: list[float], rule: str, zero: int) -> tuple[list[int], int | None]:
    """(E4M3 codes, exponent or None for a non-finite block) of one block."""
    if any(not math.isfinite(v) for v in values):
        return [0x7F] * len(values), None
    amax = max((abs(Fraction(v)) for v in values), default=Fraction(0))
    s = ref_exponent(amax, rule, zero)
    return [ref_e4m3(Fraction(v) / Fraction(2) ** s, math.copysign(1.0, v) < 0) for v in values], s


def ref_quantize(x: torch.Tensor, block: int, rule: str, zero: int):
    lines = x.float().reshape(-1, x.shape[-1]).tolist()
    codes, scales = [], []
    for line in lines:
        row_c, row_s = [], []
        for i in range(0, len(line), block):
            c, s = ref_block_quantize(line[i : i + block], rule, zero)
            row_c += c
            row_s.append(s)
        codes.append(row_c)
        scales.append(row_s)
    return codes, scales


def _codes(q: Quantized) -> list[list[int]]:
    return q.data.view(torch.uint8).reshape(-1, q.data.shape[-1]).tolist()


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def _mx(values, rule="rceil"):
    q = MXFP8BlockScaling(rule).quantize(torch.tensor([values], dtype=torch.float32))
    return q.data.view(torch.uint8)[0].tolist(), q.scale[0].tolist()


def test_mxfp8_hand_cases():
    # amax 448: scale 2**0 (code 127); 1 -> 0x38, -3 -> 0xC4, 448 -> 0x7E.
    assert _mx([448.0, 1.0, -3.0]) == ([0x7E, 0x38, 0xC4], [127])
    # amax 449: rceil moves to 2**1 (224.5 -> 224 = 0x76); floor keeps 2**0 and saturates to 448.
    assert _mx([449.0]) == ([0x76], [128])
    assert _mx([449.0], "floor") == ([0x7E], [127])
    # amax 1: rceil 2**-8 (1 -> 256 = 0x78); floor 2**-8 as well (amax a power of two).
    assert _mx([1.0, 0.5]) == ([0x78, 0x70], [119])
    assert _mx([1.0, 0.5], "floor") == ([0x78, 0x70], [119])
    # amax 1.875 (mantissa > 1.75): rceil 2**-7 (240 = 0x77), floor 2**-8 (480 -> saturates 448).
    assert _mx([1.875]) == ([0x77], [120])
    assert _mx([1.875], "floor") == ([0x7E], [119])


def test_mxfp8_round_to_nearest_even_and_subnormals():
    # 448 pins the scale at 2**0; ties go to the even code.
    codes, _ = _mx([448.0, 1 + 1 / 16, 1 + 3 / 16, 2**-10, 3 * 2**-10, 1.4 * 2**-9, 2**-6 * (1 - 1 / 16)])
    assert codes[1:] == [
        0x38,  # 1.0625: tie between 1.0 (0x38) and 1.125 (0x39) -> 0x38
        0x3A,  # 1.1875: tie between 1.125 (0x39) and 1.25 (0x3A) -> 0x3A
        0x00,  # 2**-10: half the smallest subnormal, tie -> +0
        0x02,  # 3 * 2**-10: tie between 2**-9 (0x01) and 2**-8 (0x02) -> 0x02
        0x01,  # 1.4 * 2**-9 -> 2**-9
        0x08,  # just below 2**-6 (smallest normal): rounds up to it
    ]


def test_mxfp8_special_blocks():
    x = torch.zeros(5, 33)
    x[0] = torch.linspace(-2, 2, 33)
    x[1, 3] = float("nan")
    x[2, 32] = float("inf")  # the short last block (one element, padded to 32)
    x[4, :] = -0.0
    q = MXFP8BlockScaling().quantize(x)
    assert q.scale.shape == (5, 2) and q.scale.dtype == torch.uint8
    assert q.scale.tolist() == [[120, 120], [255, 0], [0, 255], [0, 0], [0, 0]]
    data = q.data.view(torch.uint8)
    assert (data[1, :32] == 0x7F).all() and (data[2, 32] == 0x7F)
    assert (data[4] == 0x80).all()  # signed zeros keep their sign
    y = MXFP8BlockScaling().dequantize(q)
    assert torch.isnan(y[1, :32]).all() and not torch.isnan(y[1, 32]) and torch.isnan(y[2, 32])
    assert torch.equal(y[3], torch.zeros(33)) and torch.signbit(y[4]).all()


def test_mxfp8_extremes_of_the_scale_range():
    # bf16 subnormals: the scale clamps at 2**-127 (code 0) and the elements are exact.
    tiny = torch.tensor([[2.0**-130, -(2.0**-133)]], dtype=torch.bfloat16)
    q = MXFP8BlockScaling().quantize(tiny)
    assert q.scale.tolist() == [[0]] and q.data.float().tolist() == [[2.0**-3, -(2.0**-6)]]
    assert torch.equal(MXFP8BlockScaling().dequantize(q, torch.bfloat16), tiny)
    # fp32's largest finite value: 2**120 (code 247), element 255.99... -> 256.
    big = torch.tensor([[torch.finfo(torch.float32).max]])
    q = MXFP8BlockScaling().quantize(big)
    assert q.scale.tolist() == [[247]] and q.data.float().tolist() == [[256.0]]


def test_blockwise_and_tensorwise_hand_cases():
    q = Float8BlockScaling(block_size=4).quantize(torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 900.0]]))
    assert q.scale.dtype == torch.float32
    assert q.scale.tolist() == [[2.0**-6, 1.0, 4.0]]  # 4 / 2**-6 = 256; zero block: 1.0; 900 / 4 = 225
    assert q.data.float().tolist() == [[64.0, 128.0, 192.0, 256.0, 0, 0, 0, 0, 224.0]]
    q = Float8CurrentScaling(power_2_scale=True).quantize(torch.tensor([1.0, -3.0]))
    assert q.scale.item() == 2.0**-7 and q.data.float().tolist() == [128.0, -384.0]
    q = Float8CurrentScaling().quantize(torch.tensor([1.0, -3.0]))  # TE: scale = 1 / (448 / amax)
    mult = np.float32(448) / np.float32(3)
    assert q.scale.item() == float(np.float32(1) / mult)
    assert q.data.float().tolist() == [float(ref_e4m3_value(np.float32(1) * mult)), -448.0]
    q = Float8CurrentScaling().quantize(torch.tensor([1.0, 2.0]), amax=torch.tensor(float("inf")))
    assert math.isnan(q.scale.item()) and (q.data.view(torch.uint8) == 0x7F).all()


def ref_e4m3_value(y) -> Fraction:
    return _e4m3_value(ref_e4m3(Fraction(float(y)), float(y) < 0))


# ---------------------------------------------------------------------------------------------
# Hypothesis against the reference
# ---------------------------------------------------------------------------------------------

EDGES = [
    0.0,
    -0.0,
    448.0,
    449.0,
    464.0,
    465.0,
    480.0,
    -512.0,
    1 + 1 / 16,
    1 + 3 / 16,
    2.0**-10,
    3 * 2.0**-10,
    2.0**-9,
    2.0**-6,
    2.0**-126,
    2.0**-133,
    2.0**-149,
    1.75 * 2.0**-120,
    3.3895e38,
    float("nan"),
    float("inf"),
    -float("inf"),
]

ties = st.builds(
    lambda m, k, neg: (-1) ** neg * (16 + 2 * m + 1) / 16 * 2.0**k,
    st.integers(0, 7),
    st.integers(-40, 40),
    st.booleans(),
)  # E4M3 ties under any power-of-two scale
bf16_bits = st.integers(0, 0xFFFF).map(
    lambda b: torch.tensor([b], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()
)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
values = st.one_of(st.sampled_from(EDGES), ties, bf16_bits, finite_f32, st.floats(-4, 4, width=32))


@st.composite
def tensors(draw, dtype=None):
    dtype = dtype or draw(st.sampled_from([torch.float32, torch.bfloat16]))
    shape = draw(st.sampled_from([(1, 1), (3, 31), (2, 32), (2, 33), (4, 7), (1, 70), (0, 5), (2, 2, 9), (5,)]))
    n = math.prod(shape)
    scale = draw(st.sampled_from([1.0, 2.0**-30, 2.0**40]))
    vals = draw(st.lists(values, min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float32) * scale if n else torch.zeros(0)
    return x.reshape(shape).to(dtype)


RECIPES = [
    (MXFP8BlockScaling(), 32, "rceil", -127),
    (MXFP8BlockScaling("floor"), 32, "floor", -127),
    (Float8BlockScaling(), 128, "rceil", 0),
    (Float8BlockScaling(block_size=8), 8, "rceil", 0),
]


@settings(max_examples=150)
@given(x=tensors(), which=st.integers(0, len(RECIPES) - 1))
def test_block_recipes_match_the_exact_reference(x, which):
    recipe, block, rule, zero = RECIPES[which]
    q = recipe.quantize(x)
    codes, exps = ref_quantize(x, block, rule, zero)
    assert _codes(q) == codes
    scale = q.scale.reshape(-1, q.scale.shape[-1]) if q.scale.numel() else q.scale.reshape(len(exps), 0)
    if recipe.scale_dtype == torch.uint8:
        assert scale.tolist() == [[255 if s is None else s + 127 for s in row] for row in exps]
    else:
        got = scale.tolist()
        assert [[None if math.isnan(v) else v for v in row] for row in got] == [
            [None if s is None else 2.0**s for s in row] for row in exps
        ]
    # Dequantized: exactly code value * 2**s in float32, then one cast.
    y = recipe.dequantize(q, torch.float32).reshape(-1, x.shape[-1]).tolist()
    for row_y, row_c, row_s in zip(y, codes, exps):
        for i, (v, c) in enumerate(zip(row_y, row_c)):
            s = row_s[i // block]
            if s is None:
                assert math.isnan(v)
            else:
                with np.errstate(over="ignore"):  # 256 * 2**120 = 2**128 is past float32's range: inf
                    assert v == float(np.float32(float(_e4m3_value(c) * Fraction(2) ** s)))
    bf16 = recipe.dequantize(q, torch.bfloat16).view(torch.int16)
    assert torch.equal(bf16, recipe.dequantize(q, torch.float32).to(torch.bfloat16).view(torch.int16))


@settings(max_examples=80)
@given(x=tensors())
def test_tensorwise_matches_the_reference(x):
    finite = bool(torch.isfinite(x).all())
    amax = Fraction(float(x.float().abs().max())) if x.numel() and finite else Fraction(0)
    q = Float8CurrentScaling(power_2_scale=True).quantize(x)
    if not finite:
        assert math.isnan(q.scale.item()) and (q.data.view(torch.uint8) == 0x7F).all()
        return
    s = ref_exponent(amax, "rceil", 0)
    assert q.scale.item() == 2.0**s
    want = [ref_e4m3(Fraction(v) / Fraction(2) ** s, math.copysign(1.0, v) < 0) for v in x.float().reshape(-1).tolist()]
    assert q.data.view(torch.uint8).reshape(-1).tolist() == want
    # TE-style (not a power of two): the float32 arithmetic TE does, then exact RNE.
    q = Float8CurrentScaling().quantize(x)
    a = np.float32(float(amax))
    with np.errstate(over="ignore"):  # 448 / a tiny amax overflows float32 to inf, handled below
        mult = np.float32(448) / a if a > 0 else np.float32(1)
    if not np.isfinite(mult):
        mult = np.float32(np.finfo(np.float32).max)
    with np.errstate(over="ignore"):
        ys = (x.float().reshape(-1).numpy() * mult).astype(np.float32)
    want = [
        ref_e4m3(Fraction(float(v)) if np.isfinite(v) else Fraction(448), math.copysign(1.0, float(v)) < 0) for v in ys
    ]
    assert q.data.view(torch.uint8).reshape(-1).tolist() == want
    assert q.scale.item() == float(np.float32(1) / mult)


@settings(max_examples=60)
@given(x=tensors(), which=st.integers(0, len(RECIPES) - 1), cut=st.integers(0, 6))
def test_rows_quantized_apart_equal_the_whole(x, which, cut):
    """The layout's guarantee: quantize-then-concatenate == quantize the whole (block recipes)."""
    recipe = RECIPES[which][0]
    lines = x.reshape(-1, x.shape[-1])
    cut = min(cut, lines.shape[0])
    whole = recipe.quantize(lines)
    a, b = recipe.quantize(lines[:cut]), recipe.quantize(lines[cut:])
    assert torch.equal(torch.cat([a.data, b.data]).view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(torch.cat([a.scale, b.scale]).view(torch.uint8), whole.scale.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Independent implementations, where installed (cross-checks only)
# ---------------------------------------------------------------------------------------------


def test_e8m0_decode_matches_torch_float8_e8m0fnu():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = Quantized(torch.ones(256, 1).to(torch.float8_e4m3fn), codes.reshape(256, 1))
    ours = MXFP8BlockScaling().dequantize(q)[:, 0]
    theirs = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255]) and torch.isnan(ours[255]) and torch.isnan(theirs[255])


@settings(max_examples=100)
@given(st.lists(st.floats(-448, 448, width=32, allow_subnormal=True), min_size=1, max_size=64))
def test_e4m3_rounding_matches_ml_dtypes(vals):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = torch.tensor(vals, dtype=torch.float32)
    ours = fsdpfn.fp8._elements.to_e4m3(x).view(torch.uint8).numpy()
    theirs = np.asarray(vals, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert ours.tolist() == theirs.tolist()


def _torchao_to_mx():
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    return to_mx, ScaleCalculationMode


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mxfp8_matches_torchao(rule):
    """torchao's ``to_mx`` (bf16, finite, blocks whose amax is not below 448 * 2**-127, where its
    rceil fallback flushes like Transformer Engine)."""
    to_mx, mode = _torchao_to_mx()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-60, 60, (64, 1), generator=gen).float())
    x[0, :32] = 448.0 * 2.0**-5
    x[1, :32] = torch.linspace(-449, 449, 32)
    x[2, 5] = 0.0
    x = x.to(torch.bfloat16)
    ours = MXFP8BlockScaling(rule).quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, mode.FLOOR if rule == "floor" else mode.RCEIL)
    assert torch.equal(ours.scale, scale.view(torch.uint8).reshape(ours.scale.shape))
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Straight-through gradient, settings and policies
# ---------------------------------------------------------------------------------------------


def test_fake_quantize_is_straight_through_under_backward_and_func_grad():
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    w = torch.randn(3, 40, dtype=torch.bfloat16)
    y = fake_quantize(x)
    assert torch.equal(y, MXFP8BlockScaling().dequantize(MXFP8BlockScaling().quantize(x), torch.bfloat16))
    g = torch.func.grad(lambda t: (fake_quantize(t) * w).sum())(x)
    assert torch.equal(g, w)
    leaf = x.clone().requires_grad_(True)
    (fake_quantize(leaf, Float8CurrentScaling()) * w).sum().backward()
    assert torch.equal(leaf.grad, w)


def test_recipe_and_input_errors_name_the_fix():
    with pytest.raises(ValueError, match="scale_mode='round'"):
        MXFP8BlockScaling("round")
    with pytest.raises(ValueError, match="block_size=0"):
        Float8BlockScaling(block_size=0)
    with pytest.raises(ValueError, match="float64"):
        MXFP8BlockScaling().quantize(torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="0-d"):
        MXFP8BlockScaling().quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="amax= is for per-tensor"):
        MXFP8BlockScaling().quantize(torch.ones(2), amax=torch.tensor(1.0))
    with pytest.raises(ValueError, match="recipe must be"):
        fake_quantize(torch.ones(2), "mxfp8")


def test_policy_forms_and_round_trip():
    assert as_gather_policy(None) is None and as_gather_policy(False) is None
    assert as_gather_policy(True) == Float8GatherPolicy(MXFP8BlockScaling())
    assert as_gather_policy("tensorwise").recipe == Float8CurrentScaling()
    assert as_gather_policy(Float8BlockScaling(64)).recipe.block_size == 64
    p = Float8GatherPolicy("blockwise", units=["blocks.0"], exclude="head.weight", backend="torch")
    assert p.units == ("blocks.0",) and p.exclude == ("head.weight",)
    assert Float8GatherPolicy.from_dict(p.to_dict()) == p
    for r in (MXFP8BlockScaling("floor"), Float8BlockScaling(16), Float8CurrentScaling(True)):
        assert recipe_from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="backend='cuda'"):
        Float8GatherPolicy(backend="cuda")
    with pytest.raises(ValueError, match="fp8="):
        fsdpfn.MixedPrecision(fp8=8)
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        recipe_from_dict({"recipe": "NVFP4BlockScaling"})
    assert "fp8=" not in repr(fsdpfn.MixedPrecision(torch.bfloat16))
