"""fsdpfn.optim on one process: the conformance table every transform passes (plain tensors and
world-size-1 DTensors), and parity with torch.optim.AdamW, torch.optim.SGD, torch.optim.Muon,
torch.nn.utils.clip_grad_norm_ and an fp32 Newton–Schulz reference."""

import optree
import pytest
import torch
import torch.optim._muon as torch_muon
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

from fsdpfn import optim, testing
from fsdpfn.optim._distributed_ns import assign_owners, owner_plan

# ---------------------------------------------------------------------------------------------
# Conformance table
# ---------------------------------------------------------------------------------------------

MIXED = {
    "blocks.0.fc.weight": (6, 4),
    "blocks.0.fc.bias": (6,),
    "embed.weight": (5, 4),
    "experts": (2, 3, 5),
    "gain": (),
}
MATRICES = {"a": (6, 4), "b": (3, 8), "c": (2, 3, 5)}

TRANSFORMS = {
    "sgd": (lambda: optim.sgd(0.1), MIXED),
    "sgd_nesterov_wd": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01), MIXED),
    "adamw": (lambda: optim.adamw(1e-2), MIXED),
    "adamw_schedule": (lambda: optim.adamw(optim.warmup_cosine_schedule(1e-2, 2, 10)), MIXED),
    "clip": (lambda: optim.clip_by_global_norm(0.5), MIXED),
    "chain_clip_adamw": (lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)), MIXED),
    "scale_by_muon": (lambda: optim.scale_by_muon(), MATRICES),
    "muon": (lambda: optim.muon(lr=0.02), MIXED),
    "muon_fp32_gather": (
        lambda: optim.muon(lr=0.02, ns_dtype=torch.float32, layout="gather", adjust_lr_fn="match_rms_adamw"),
        MIXED,
    ),
    "muon_gram": (lambda: optim.muon(lr=0.02, ns_method="gram"), MIXED),
    "partition": (
        lambda: optim.partition(
            {"x": optim.sgd(0.1), "y": optim.adamw(1e-3)}, lambda ps: {n: "x" if "weight" in n else "y" for n in ps}
        ),
        MIXED,
    ),
}


def _tree(shapes, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def _as_dtensors(tree):
    mesh = testing.mesh((1,))
    return {
        n: DTensor.from_local(t, mesh, (Shard(0) if t.dim() else Replicate(),), run_check=False)
        for n, t in tree.items()
    }


def _signature(tree):
    """Structure plus, per tensor leaf: type, dtype, shape, placements."""
    leaves, spec = optree.tree_flatten(tree)
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((type(x).__name__, x.dtype, tuple(x.shape), tuple(getattr(x, "placements", ()))))
        else:
            sig.append(type(x).__name__)
    return spec, sig


def _conformance(name, dtype, use_dtensor):
    make, shapes = TRANSFORMS[name]
    opt = make()
    params = _tree(shapes, 0, dtype)
    if use_dtensor:
        params = _as_dtensors(params)
    state = opt.init(params)
    first = _signature(state)
    for step in range(3):
        grads = _tree(shapes, 10 + step, dtype)
        if use_dtensor:
            grads = _as_dtensors(grads)
        before = {n: (g.clone(), params[n].clone()) for n, g in grads.items()}
        updates, state = opt.update(grads, state, params)
        for n in grads:  # pure: inputs untouched
            assert torch.equal(grads[n], before[n][0]) and torch.equal(params[n], before[n][1]), n
        assert optree.tree_structure(updates) == optree.tree_structure(params)
        for n, u in updates.items():
            assert type(u) is type(params[n]), n
            assert u.dtype == grads[n].dtype and u.shape == params[n].shape, n
            assert getattr(u, "placements", None) == getattr(params[n], "placements", None), n
            assert torch.isfinite(u.to_local() if use_dtensor else u).all(), n
        assert _signature(state) == first, f"state of {name} changed structure, dtype or placement at step {step}"
        new = optim.apply_updates(params, updates)
        assert all(new[n].dtype == params[n].dtype and type(new[n]) is type(params[n]) for n in params)
        params = new
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_conformance_plain_tensors(name, dtype):
    assert _conformance(name, dtype, use_dtensor=False)


def _conformance_all(rank, world):
    return [_conformance(name, torch.float32, use_dtensor=True) for name in sorted(TRANSFORMS)]


def test_conformance_dtensors_world_size_1(run_on_ranks):
    assert run_on_ranks(_conformance_all, 1) == [[True] * len(TRANSFORMS)]


# ---------------------------------------------------------------------------------------------
# Parity with torch.optim
# ---------------------------------------------------------------------------------------------

SHAPES = {"w": (8, 5), "v": (3, 7), "b": (7,), "s": ()}


# float32's unit roundoff: each float32 operation is exact up to a relative 2^-24.
U32 = 2.0**-24


def _torch_run(make_opt, shapes, steps, seed=0):
    """torch.optim's parameters after ``steps`` steps, the optimizer, and each entry's size along
    the way for :func:`_assert_within_step_rounding`: sum over steps of |p_t| + |p_t+1| + |p_t+1 - p_t|."""
    params = {n: torch.nn.Parameter(t) for n, t in _tree(shapes, seed, torch.float32).items()}
    opt = make_opt(list(params.values()))
    sizes = {n: torch.zeros_like(p) for n, p in params.items()}
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.grad = _tree(shapes, 100 + step, torch.float32)[n]
        opt.step()
        for n, p in params.items():
            sizes[n] += before[n].abs() + p.detach().abs() + (p.detach() - before[n]).abs()
    return {n: p.detach() for n, p in params.items()}, opt, sizes


def _assert_within_step_rounding(got, want, sizes, roundings, growth=1.0):
    """``got`` and ``want`` took the same steps from the same parameters, rounding each step
    differently: per step, ``roundings`` roundings (both sides together) of values no larger than
    |p_t|, |p_t+1| or the step, each off by at most U32 of its value. To first order they differ
    by at most roundings * U32 * sizes (see _torch_run), times ``growth``: how much an early
    difference in p can grow through the later steps (1 when the steps do not depend on p)."""
    for n in want:
        bound = roundings * growth * U32 * sizes[n]
        err = (got[n] - want[n]).abs()
        assert (err <= bound).all(), f"{n}: {(err / bound).max():.3g}x the rounding bound"


def _our_run(opt, shapes, steps, seed=0):
    params = _tree(shapes, seed, torch.float32)
    state = opt.init(params)
    for step in range(steps):
        updates, state = opt.update(_tree(shapes, 100 + step, torch.float32), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_equals_torch_adamw(weight_decay):
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    want, topt, sizes = _torch_run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), SHAPES, 6)
    got, state = _our_run(optim.adamw(1e-2, 0.9, 0.99, 1e-8, weight_decay), SHAPES, 6)
    for i, n in enumerate(SHAPES):
        tstate = topt.state[topt.param_groups[0]["params"][i]]
        # Moments use torch's operations in torch's order: bitwise.
        assert torch.equal(state.mu[n], tstate["exp_avg"]) and torch.equal(state.nu[n], tstate["exp_avg_sq"]), n
    # So does m / denom (q); the parameter step is rounded differently. torch rounds 1 - lr * wd
    # and p * (1 - lr * wd) (|p_t| each), then p + s * q, fused on vectorised CPUs (|p_t+1|, plus
    # |s * q| unfused); we round s * q, lr * wd and its product with p (lr * wd * |p_t|), the
    # update (|s * q| + lr * wd * |p_t|) and p + update (|p_t+1|). With |s * q| <= |step| +
    # lr * wd * |p_t| that is at most 3 * (|p_t| + |p_t+1| + |step|) per step. The gradients are
    # given, so the steps do not depend on p but through the decay, which shrinks a difference.
    _assert_within_step_rounding(got, want, sizes, roundings=3)
    assert state.count == 6


@pytest.mark.parametrize("nesterov,weight_decay", [(False, 0.0), (True, 0.01)])
def test_sgd_equals_torch_sgd(nesterov, weight_decay):
    kw = dict(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    steps = 5
    want, topt, sizes = _torch_run(lambda ps: torch.optim.SGD(ps, foreach=False, **kw), SHAPES, steps)
    got, state = _our_run(optim.sgd(**kw), SHAPES, steps)
    for i, n in enumerate(SHAPES):
        assert torch.equal(
            state.momentum_buffer[n], topt.state[topt.param_groups[0]["params"][i]]["momentum_buffer"]
        ), n
    # The step d is computed alike; torch adds p - lr * d fused on vectorised CPUs (|p_t+1|, plus
    # |step| unfused), we round -lr * d (|step|) and p + update (|p_t+1|): 2 roundings of at most
    # |p_t| + |p_t+1| + |step| per step. Weight decay feeds p back into d: a difference in p grows
    # by at most 1 + lr * wd * (1 + momentum) / (1 - momentum) per step.
    m, lr, wd = kw["momentum"], kw["lr"], kw["weight_decay"]
    _assert_within_step_rounding(got, want, sizes, roundings=2, growth=(1 + lr * wd * (1 + m) / (1 - m)) ** steps)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (7, 5), (32, 32), (1, 9)])
def test_newton_schulz_bf16_is_bitwise_torch(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    want = torch_muon._zeropower_via_newtonschulz(x, optim._newton_schulz.DEFAULT_NS_COEFFS, 5, 1e-7)
    assert torch.equal(optim.newton_schulz(x), want)
    # Batched over a leading dimension, each matrix alone: same bits in bf16.
    xs = torch.stack([x, 2 * x, -x])
    assert torch.equal(optim.newton_schulz(xs), torch.stack([optim.newton_schulz(m) for m in xs]))


def _fp32_reference_ns(grad, steps=5, eps=1e-7):
    """torch.optim.Muon's Newton–Schulz with bfloat16() replaced by float32, written out."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.float().clone()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if tall else x


# The quintic X <- a X + b A X + c A^2 X (A = X X^T) sums terms up to |a| + |b| + |c| times its
# result (they cancel to a result of norm ~1): an iteration's rounding is relative to that.
NS_TERMS = sum(abs(c) for c in optim._newton_schulz.DEFAULT_NS_COEFFS)


def _ns_tol(shape, unit, roundings_per_iteration, steps=5):
    """Normwise relative distance allowed between two Newton–Schulz runs of ``steps`` iterations
    on one matrix that compute the same products in different orders. Each iteration rounds
    each entry ``roundings_per_iteration(m, n)`` times (both runs together: the products' m- or
    n-term sums, the scalings and additions), each by at most ``unit`` of the iteration's terms,
    which are up to NS_TERMS times its result; the iterations add up (to first order)."""
    m, n = sorted(shape[-2:])
    return steps * roundings_per_iteration(m, n) * NS_TERMS * unit


def _standard_vs_standard(m, n):
    # X X^T sums n terms, A A and B X sum m, then the addmm scalings and additions: per run.
    return 2 * (n + 2 * m + 6)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (7, 5), (2, 16, 24)])
def test_newton_schulz_fp32_matches_fp32_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    got = optim.newton_schulz(x, dtype=torch.float32)
    want = torch.stack([_fp32_reference_ns(m) for m in x.reshape(-1, *shape[-2:])]).reshape(shape)
    assert got.dtype == torch.float32
    # Same products, in addmm's order against the reference's (1.4e-4 to 5.3e-4 here; measured at
    # most 8.9e-7 with default, AVX2 and AVX512 kernels: the worst case does not happen).
    assert ((got - want).norm() / want.norm()).item() < _ns_tol(shape, U32, _standard_vs_standard)


def test_newton_schulz_is_pure_and_orthogonalises():
    x = torch.randn(3, 16, 32, dtype=torch.bfloat16)
    copy = x.clone()
    o = optim.newton_schulz(x, dtype=None)
    assert torch.equal(x, copy) and o.dtype == torch.bfloat16
    s = torch.linalg.svdvals(o.float())
    assert ((s > 0.5) & (s < 1.5)).all()
    with pytest.raises(ValueError, match="matrix"):
        optim.newton_schulz(torch.ones(3))


# ---------------------------------------------------------------------------------------------
# Gram Newton–Schulz
# ---------------------------------------------------------------------------------------------

GRAM_SHAPES = [(16, 64), (64, 16), (3, 12, 40), (12, 20), (1, 9), (20, 20), (16, 24)]
RESTARTS = [(2,), (), (1, 3)]


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("restarts", RESTARTS, ids=str)
@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
def test_gram_newton_schulz_is_the_standard_polynomial(shape, restarts):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = optim.newton_schulz(x, dtype=torch.float64)
    got = optim.newton_schulz(x, dtype=torch.float64, method="gram", gram_restarts=restarts)
    m, n = sorted(shape[-2:])
    if n > 1.5 * m:
        # The same polynomial of x, computed on the Gram matrix: equal up to float64 rounding.
        # Per iteration the standard run rounds n + 2m + 6 times an entry; the Gram run's four
        # m x m products and additions 4m + 4, its restart and final Q X (n + m) at most once:
        # 2n + 8m + 12 between them, in float64 (U64 = 2^-53). Measured at most 4e-15.
        assert not torch.equal(got, want)
        assert _rel(got, want) < _ns_tol(shape, 2.0**-53, lambda m, n: 2 * n + 8 * m + 12)
    else:
        # Not cheaper on near-square matrices: the standard iteration runs, same bits.
        assert torch.equal(got, want)


def _low_rank(m, n, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    lr = torch.randn(m, rank, generator=gen, dtype=torch.float64) @ torch.randn(
        rank, n, generator=gen, dtype=torch.float64
    )
    return lr + 1e-4 * torch.randn(m, n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(
            torch.randn(48, 192, generator=torch.Generator().manual_seed(6), dtype=torch.float64), id="gaussian"
        ),
        pytest.param(_low_rank(48, 192, 3, 7), id="rank3"),
        pytest.param(_low_rank(96, 24, 2, 8), id="rank2-tall"),
    ],
)
def test_gram_newton_schulz_error_matches_standard_in_fp32_and_bf16(x):
    want = optim.newton_schulz(x, dtype=torch.float64)
    # Measured gram / standard error: fp32 1.1-1.4x, bf16 0.9-2.3x (Gaussian worst).
    for dtype, factor in ((torch.float32, 2), (torch.bfloat16, 3)):
        standard = _rel(optim.newton_schulz(x.float(), dtype=dtype), want)
        gram = _rel(optim.newton_schulz(x.float(), dtype=dtype, method="gram"), want)
        assert gram <= factor * standard, (dtype, gram, standard)


def test_gram_restart_is_what_keeps_low_rank_bf16_stable():
    # Why restarts default to (2,): without one, bf16 rounding breaks the commutation the Gram
    # form relies on, and on a nearly low-rank matrix the error compounds past the result's size.
    x = _low_rank(48, 192, 3, 7)
    want = optim.newton_schulz(x, dtype=torch.float64)
    standard = _rel(optim.newton_schulz(x.float()), want)
    no_restart = _rel(optim.newton_schulz(x.float(), method="gram", gram_restarts=()), want)
    restarted = _rel(optim.newton_schulz(x.float(), method="gram"), want)
    assert no_restart > 10 * standard
    assert restarted <= 2 * standard


@pytest.mark.parametrize("restarts", RESTARTS, ids=str)
@pytest.mark.parametrize("shape", GRAM_SHAPES + [(512, 2048)], ids=str)
def test_gram_newton_schulz_flops_are_counted_and_fewer(shape, restarts):
    x = torch.randn(shape)
    with FlopCounterMode(display=False) as fc:
        optim.newton_schulz(x, dtype=torch.float32, method="gram", gram_restarts=restarts)
    counted = optim.newton_schulz_flops(shape, method="gram", gram_restarts=restarts)
    assert fc.get_total_flops() == counted
    assert counted <= optim.newton_schulz_flops(shape)
    m, n = sorted(shape[-2:])
    if restarts == (2,):
        assert (
            counted == optim.newton_schulz_flops(shape) if n <= 1.5 * m else counted < optim.newton_schulz_flops(shape)
        )
    if shape == (512, 2048) and restarts == (2,):
        # 8 m^2 n + 28 m^3 against 20 m^2 n + 10 m^3: a third fewer on a 1:4 MLP matrix.
        assert optim.newton_schulz_flops(shape) / counted == 1.5


def test_gram_newton_schulz_bad_settings_name_the_setting():
    x = torch.randn(8, 32)
    with pytest.raises(ValueError, match="method must be one of"):
        optim.newton_schulz(x, method="fast")
    with pytest.raises(ValueError, match=r"gram_restarts \[5\] are not iterations 1 .. 4"):
        optim.newton_schulz(x, method="gram", gram_restarts=(5,))
    with pytest.raises(ValueError, match="gram_restarts"):
        optim.scale_by_muon(ns_method="gram", ns_steps=2, gram_restarts=(2,))
    with pytest.raises(ValueError, match="ns_method must be one of"):
        optim.muon(ns_method="polar")
    with pytest.raises(ValueError, match=r"gram_restarts \[0\]"):
        optim.muon(ns_method="gram", gram_restarts=(0,))


def test_muon_gram_equals_muon_standard_up_to_rounding():
    # The whole optimizer, 5 steps in fp32: the same trajectory as the standard iteration.
    shapes = {"blocks.0.fc.weight": (24, 96), "blocks.0.proj.weight": (96, 24), "blocks.0.sq.weight": (20, 20)}
    outs, steps = {}, 5
    for method in ("standard", "gram"):
        opt = optim.muon(lr=0.02, ns_dtype=torch.float32, ns_method=method)
        params = _tree(shapes, 0, torch.float32)
        state = opt.init(params)
        moved = {n: 0.0 for n in shapes}  # sum over steps of the update's norm
        for step in range(steps):
            updates, state = opt.update(_tree(shapes, 10 + step, torch.float32), state, params)
            params = optim.apply_updates(params, updates)
            moved = {n: moved[n] + updates[n].norm().item() for n in shapes}
        outs[method] = params
    for n, shape in shapes.items():
        # Each step's O differs by the two Newton–Schulz forms' rounding (as in the float64 test
        # above, in fp32), scaled into the parameters by the update's size; the steps' own
        # rounding (decay, update, p + update: at most 6 a step, as in the torch comparisons)
        # adds. On the near-square matrix both run the standard form: only the latter.
        ns = _ns_tol(shape, U32, lambda m, n: 2 * n + 8 * m + 12) if max(shape) > 1.5 * min(shape) else 0.0
        bound = (ns * moved[n] + steps * 6 * U32 * outs["standard"][n].norm().item()) / outs["standard"][
            n
        ].norm().item()
        assert _rel(outs["gram"][n], outs["standard"][n].double()) < bound, n


MUON_SHAPES = {"a": (16, 24), "b": (24, 16), "c": (20, 20)}


def _muon_both(lr, weight_decay, adjust_lr_fn, nesterov, steps=4):
    kw = dict(lr=lr, weight_decay=weight_decay, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    want, topt, sizes = _torch_run(lambda ps: torch.optim.Muon(ps, **kw), MUON_SHAPES, steps)
    opt = optim.muon(**kw, labels=lambda name, p: "muon")
    got, state = _our_run(opt, MUON_SHAPES, steps)
    bufs = {n: topt.state[topt.param_groups[0]["params"][i]]["momentum_buffer"] for i, n in enumerate(MUON_SHAPES)}
    return got, want, state.inner_states["muon"][0].momentum_buffer, bufs, sizes


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch_muon(adjust_lr_fn, nesterov):
    got, want, buf, torch_buf, sizes = _muon_both(0.02, 0.1, adjust_lr_fn, nesterov)
    for n in MUON_SHAPES:
        assert torch.equal(buf[n], torch_buf[n]), n  # momentum: same ops, bitwise
    # Newton–Schulz output O is bitwise torch's (test above); the step is rounded differently.
    # torch rounds 1 - lr * wd and p * (1 - lr * wd) (|p_t| each), then p - alr * O, fused on
    # vectorised CPUs (|p_t+1|, plus |alr * O| unfused); we round alr * O, lr * wd and its product
    # with p, the update and p + update: as AdamW's step, at most 3 roundings of
    # |p_t| + |p_t+1| + |step| per step. O depends on the gradients only: no growth.
    _assert_within_step_rounding(got, want, sizes, roundings=3)


def test_muon_is_bitwise_torch_muon_when_the_step_is_exact():
    # lr a power of two, no weight decay, lr ratio 1 (wide and square matrices): -lr * O is exact
    # in fp32, so our add equals torch's fused multiply-add bit for bit.
    shapes = {"a": (16, 24), "c": (20, 20)}
    kw = dict(lr=2.0**-6, weight_decay=0.0, momentum=0.95, nesterov=True)
    want, _, _ = _torch_run(lambda ps: torch.optim.Muon(ps, **kw), shapes, 4)
    got, _ = _our_run(optim.muon(**kw, labels=lambda name, p: "muon"), shapes, 4)
    for n in shapes:
        assert torch.equal(got[n], want[n]), n


def test_muon_fp32_newton_schulz_matches_fp32_reference():
    g = _tree(MUON_SHAPES, 9, torch.float32)
    opt = optim.scale_by_muon(momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    o, _ = opt.update(g, opt.init(g))
    for n, x in g.items():
        want = _fp32_reference_ns(x)
        # As test_newton_schulz_fp32_matches_fp32_reference.
        assert ((o[n] - want).norm() / want.norm()).item() < _ns_tol(x.shape, U32, _standard_vs_standard), n


def test_muon_lr_adjustments():
    o = {"tall": torch.ones(9, 4), "wide": torch.ones(4, 9)}
    for fn, ratio in [("original", {"tall": 1.5, "wide": 1.0}), ("match_rms_adamw", {"tall": 0.6, "wide": 0.6})]:
        opt = optim.scale_by_muon_lr(0.1, adjust_lr_fn=fn)
        u, _ = opt.update(o, opt.init(o))
        for n in o:
            torch.testing.assert_close(u[n], torch.full_like(o[n], -0.1 * ratio[n]))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        optim.scale_by_muon_lr(0.1, adjust_lr_fn="bogus")


def test_muon_on_3d_leaf_orthogonalises_each_leading_index():
    g = {"experts": torch.randn(3, 8, 12)}
    opt = optim.scale_by_muon(momentum=0.0, nesterov=False)
    o, _ = opt.update(g, opt.init(g))
    for e in range(3):
        assert torch.equal(o["experts"][e], optim.newton_schulz(g["experts"][e]).float())


# ---------------------------------------------------------------------------------------------
# Labels, partition, errors
# ---------------------------------------------------------------------------------------------


def test_default_muon_labels_on_gpt():
    from fsdpfn.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=32, width=16, depth=1, heads=2))
    labels = {n: optim.muon_labels(n, p) for n, p in model.named_parameters()}
    assert {n for n, lab in labels.items() if lab == "muon"} == {
        "blocks.0.qkv.weight",
        "blocks.0.proj.weight",
        "blocks.0.fc.weight",
        "blocks.0.out.weight",
    }
    for n in ["embed.weight", "pos.weight", "head.weight", "norm.weight", "blocks.0.fc.bias", "blocks.0.norm1.weight"]:
        assert labels[n] == "adamw", n
    assert optim.muon_labels("lm_head.weight", torch.zeros(3, 3)) == "adamw"
    assert optim.muon_labels("model.wte.weight", torch.zeros(3, 3)) == "adamw"


def test_muon_user_labels():
    params = {"x": torch.randn(4, 4), "y": torch.randn(4, 4)}
    opt = optim.muon(labels={"x": "muon", "y": "adamw"})
    state = opt.init(params)
    assert state.inner_states["muon"][0].momentum_buffer["y"] is None
    assert state.inner_states["adamw"].mu["x"] is None
    with pytest.raises(ValueError, match="'y' has no entry"):
        optim.muon(labels={"x": "muon"}).init(params)
    with pytest.raises(ValueError, match="'y' has label 'sgd'"):
        optim.muon(labels={"x": "muon", "y": "sgd"}).init(params)


def test_partition_routes_and_names_errors():
    opt = optim.partition({"a": optim.sgd(1.0), "b": optim.sgd(0.5)}, {"p": "a", "q": "b"})
    params = {"p": torch.ones(2), "q": torch.ones(2)}
    u, _ = opt.update({"p": torch.ones(2), "q": torch.ones(2)}, opt.init(params), params)
    assert torch.equal(u["p"], torch.full((2,), -1.0)) and torch.equal(u["q"], torch.full((2,), -0.5))
    with pytest.raises(ValueError, match="structure of the parameters"):
        optim.partition({"a": optim.sgd(1.0)}, {"p": "a"}).init(params)


def test_scale_by_muon_rejects_vectors_by_name():
    opt = optim.scale_by_muon()
    g = {"norm.weight": torch.ones(4)}
    with pytest.raises(ValueError, match="'norm.weight'.*AdamW"):
        opt.update(g, opt.init(g))


def test_weight_decay_needs_params():
    opt = optim.adamw(weight_decay=0.1)
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update(g, opt.init(g))


def test_chain_and_identity_and_apply_updates_keep_dtype():
    opt = optim.chain(optim.identity(), optim.sgd(0.5))
    p = {"w": torch.ones(3, dtype=torch.bfloat16)}
    u, s = opt.update({"w": torch.ones(3, dtype=torch.bfloat16)}, opt.init(p), p)
    assert len(s) == 2 and u["w"].dtype == torch.bfloat16
    assert optim.apply_updates(p, {"w": None})["w"] is p["w"]
    assert torch.equal(optim.apply_updates(p, u)["w"], torch.full((3,), 0.5, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# Clipping, schedules, owner balance
# ---------------------------------------------------------------------------------------------


def test_clip_by_global_norm_equals_torch():
    grads = _tree(SHAPES, 5, torch.float32)
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for h, g in zip(holders, grads.values()):
        h.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(holders, 1.0)
    tensors = [h.grad for h in holders]
    # Both take the square root of a sum of N squares in their own order (torch: per tensor, then
    # the norm of the norms). Positive terms do not cancel: each sum is within (N + 3) * U32 of
    # the exact one, relatively, counting the squares and torch's square roots squared again; the
    # square root halves that and rounds once: (N + 5) * U32 between the two. The clipped values
    # add the coefficient's max_norm / (norm + 1e-6) (two roundings a side) and the product (one).
    n = sum(g.numel() for g in grads.values())
    assert optim.global_norm(grads).item() == pytest.approx(norm.item(), rel=(n + 5) * U32, abs=0)
    opt = optim.clip_by_global_norm(1.0)
    clipped, _ = opt.update(grads, opt.init(grads))
    for g, t in zip(clipped.values(), tensors):
        torch.testing.assert_close(g, t, rtol=(n + 11) * U32, atol=0)
    small = {"w": torch.tensor([0.3, 0.4])}
    assert torch.equal(opt.update(small, opt.init(small))[0]["w"], small["w"])


def test_schedules():
    assert optim.constant_schedule(0.3)(12345) == 0.3
    s = optim.warmup_cosine_schedule(1.0, warmup_steps=4, decay_steps=14, end_value=0.1, init_value=0.0)
    assert [s(i) for i in range(5)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert s(9) == pytest.approx(0.55)
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    assert all(s(i) >= s(i + 1) for i in range(4, 20))
    # A schedule drives the step: sgd's update at count t is -schedule(t) * g.
    opt = optim.sgd(s)
    p = {"w": torch.ones(1)}
    state = opt.init(p)
    for t in range(6):
        u, state = opt.update({"w": torch.ones(1)}, state, p)
        assert u["w"].item() == pytest.approx(-s(t))
    with pytest.raises(ValueError):
        optim.warmup_cosine_schedule(1.0, warmup_steps=5, decay_steps=3)


@given(st.lists(st.integers(1, 10**6), max_size=30), st.integers(1, 8))
def test_owner_assignment_is_balanced(flops, world):
    owners = assign_owners(flops, world)
    loads = [sum(f for f, o in zip(flops, owners) if o == r) for r in range(world)]
    assert sum(loads) == sum(flops)
    # Greedy largest-first: no rank exceeds the mean by more than the largest matrix.
    assert max(loads) <= sum(flops) / world + max(flops, default=0)
    assert owners == assign_owners(flops, world)


def test_owner_plan_counts_local_experts_first():
    owners, loads = owner_plan([(4, 8, 8), (8, 8)], world=2)
    # Experts stay with the rank holding them (2 each), then the matrix goes to the least
    # loaded rank, the lowest on a tie.
    assert owners == [None, 0]
    half, mat = optim.newton_schulz_flops((2, 8, 8)), optim.newton_schulz_flops((8, 8))
    assert loads == [half + mat, half]
    owners, loads = owner_plan([(5, 8, 8), (8, 8)], world=4)  # experts 2, 2, 1, 0
    assert owners == [None, 3] and loads == [2 * mat, 2 * mat, mat, mat]
