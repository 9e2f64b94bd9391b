"""shard / unshard / reduce and the collectives on real gloo ranks, against one-process truth."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpfn
from fsdpfn import testing
from fsdpfn import comm as C

# ---- helpers run on every rank --------------------------------------------------------------


def _module_with(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = nn.Module()
    for i, shape in enumerate(shapes):
        setattr(model, f"p{i}", nn.Parameter(torch.randn(shape, generator=gen).to(dtype)))
    return model


def _roundtrip(rank, world, shapes, dtype, strategy, param_dtype):
    model = _module_with(shapes, dtype)
    mp = fsdpfn.MixedPrecision(param_dtype=param_dtype)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy, mp=mp)
    params = fsdpfn.shard(model, plan)
    full = fsdpfn.unshard(params, plan)
    for name, p in model.named_parameters():
        local = params[name].to_local()
        expected_local = (
            p.detach().chunk(world)[rank]
            if p.dim() and strategy != "replicate" and rank < len(p.chunk(world))
            else None
        )
        if p.dim() and strategy != "replicate":
            start, stop = plan.unit_of(name).local_rows(name, rank)
            assert torch.equal(local, p.detach()[start:stop]), name
            if expected_local is not None:
                assert torch.equal(local, expected_local), name
            else:
                assert local.shape[0] == 0
        else:
            assert torch.equal(local, p.detach())
        want = p.detach().to(param_dtype or dtype)
        assert full[name].dtype == want.dtype and full[name].shape == want.shape, name
        assert torch.equal(full[name], want), name
    return True


_shape = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@given(
    shapes=st.lists(_shape, min_size=1, max_size=4),
    world=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    strategy=st.sampled_from(["zero3", "zero3", "zero2", "replicate"]),
    cast=st.booleans(),
)
def test_unshard_of_shard_is_identity(run_on_ranks, shapes, world, dtype, strategy, cast):
    """0-d, 1-D, 3-D, size-0 dims and dims smaller than the world size; fp32 and bf16."""
    param_dtype = torch.bfloat16 if cast else None
    assert run_on_ranks(_roundtrip, world, shapes, dtype, strategy, param_dtype) == [True] * world


# ---- the adjoint identity of the raw collectives ---------------------------------------------


def _adjoint(rank, world, n, impl):
    with C.reduce_scatter_impl(impl):
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        y = torch.randn(world * n, generator=gen, dtype=torch.float64)
        ag = torch.empty(world * n, dtype=torch.float64)
        C.all_gather(ag, x)
        rs = torch.empty(n, dtype=torch.float64)
        C.reduce_scatter(rs, y)
        lhs = torch.dot(ag, y).reshape(1)
        rhs = torch.dot(x, rs).reshape(1)
        dist.all_reduce(lhs)
        dist.all_reduce(rhs)
        # Both sides sum the same world^2 * n products x_i * y_r,i, in another order; their size:
        size = torch.dot(ag.abs(), y.abs()).reshape(1)
        dist.all_reduce(size)
        # all_to_all with uneven splits: <a2a(u), v> == <u, a2a^T(v)> (splits swapped).
        in_splits = [(rank + s) % 3 for s in range(world)]
        all_in = torch.tensor(in_splits)
        gathered = [torch.zeros_like(all_in) for _ in range(world)]
        dist.all_gather(gathered, all_in)
        out_splits = [int(gathered[s][rank]) for s in range(world)]
        u = torch.randn(sum(in_splits), generator=gen, dtype=torch.float64)
        v = torch.randn(sum(out_splits), generator=gen, dtype=torch.float64)
        fwd = torch.empty(sum(out_splits), dtype=torch.float64)
        C.all_to_all(fwd, u, output_splits=out_splits, input_splits=in_splits)
        back = torch.empty(sum(in_splits), dtype=torch.float64)
        C.all_to_all(back, v, output_splits=in_splits, input_splits=out_splits)
        a2a = torch.stack([torch.dot(fwd, v), torch.dot(u, back), torch.dot(fwd.abs(), v.abs())])
        dist.all_reduce(a2a)
        terms = torch.tensor([float(len(v))])
        dist.all_reduce(terms)
        return lhs.item(), rhs.item(), size.item(), a2a[0].item(), a2a[1].item(), a2a[2].item(), int(terms.item())


# float64's unit roundoff: each float64 operation is exact up to a relative 2^-53.
U64 = 2.0**-53


@pytest.mark.parametrize("impl", ["native", "all_to_all"])
@pytest.mark.parametrize("world", [2, 3])
def test_adjoint_identity(run_on_ranks, world, impl):
    # Each side is a float64 sum of the same N products in its own order (the collectives move
    # values exactly and add world of them). A product and each addition on its way round by
    # at most U64, so each side is within (N + world) * U64 * sum|products| of the exact value
    # (to first order), and the two within twice that. Measured: at most 1.8e-15, against bounds
    # of 1.6e-13 (2 ranks) and 6.9e-13 (3 ranks).
    n = 7
    for lhs, rhs, size, a, b, a2a_size, a2a_terms in run_on_ranks(_adjoint, world, n, impl):
        assert abs(lhs - rhs) <= 2 * (world * world * n + world) * U64 * size, (lhs, rhs)
        assert abs(a - b) <= 2 * (a2a_terms + world) * U64 * a2a_size, (a, b)


# ---- gradcheck in float64 ---------------------------------------------------------------------


def _global_gradcheck(rank, world):
    """Central differences of the global objective sum_r <unshard(x), y_r> against the
    analytic gradient, perturbing one *global* element at a time on its owner rank so every
    rank's collectives stay in lockstep."""
    shapes = [(5, 3), (2,), (), (3, 2, 2)]
    model = _module_with(shapes, torch.float64)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan)
    gen = torch.Generator().manual_seed(7 + rank)
    weights = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()}

    def local_objective(ps):
        full = fsdpfn.unshard(ps, plan, grad_op="sum")
        return sum((full[n] * weights[n]).sum() for n in full)

    def global_objective(ps):
        value = local_objective(ps).detach().reshape(1)
        dist.all_reduce(value)
        return value.item()

    grads = torch.func.grad(local_objective)(params)
    worst, h = 0.0, 1e-6
    # The objective is linear in every parameter: central differences have no truncation error,
    # only float64 rounding, of two kinds. (1) Each evaluation sums N = world * numel products
    # (then the all-reduce adds world partial sums): off by (N + world) * U64 * sum|products| at
    # most, twice per difference, divided by 2h. (2) The bumped value p + h is rounded, by
    # U64 * |p + h|, which the objective scales by the global weight sum_r w_r: twice, over 2h.
    # (3) The analytic side sums world weights and the quotient rounds: a few U64 * max|sum_r w_r|.
    full = {n: p.full_tensor() for n, p in params.items()}
    size = torch.tensor(
        [
            float(sum((full[n] * weights[n]).abs().sum() for n in full)),
            max(float(w.abs().max()) if w.numel() else 0.0 for w in weights.values()),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(size)  # sum|products| over ranks; world * max|w| >= max|sum_r w_r|
    numel = sum(p.numel() for p in model.parameters())
    pmax = max(float(t.abs().max()) for t in full.values())
    bound = ((world * numel + world) * U64 * size[0] + size[1] * U64 * (pmax + h)) / h + 2 * world * U64 * size[1]
    for name, p in model.named_parameters():
        unit = plan.unit_of(name)
        for flat in range(p.numel()):
            idx = torch.unravel_index(torch.tensor(flat), p.shape) if p.dim() else ()
            row = int(idx[0]) if p.dim() else 0
            owner = (
                next(r for r in range(world) if unit.local_rows(name, r)[0] <= row < unit.local_rows(name, r)[1])
                if p.dim()
                else None
            )
            values = []
            for sign in (1, -1):
                local = params[name].to_local().clone()
                if owner is None:
                    local[()] += sign * h
                elif owner == rank:
                    local[(row - unit.local_rows(name, rank)[0], *[int(i) for i in idx[1:]])] += sign * h
                bumped = dict(params)
                bumped[name] = fsdpfn.transforms.from_local(plan, name, local)
                values.append(global_objective(bumped))
            # A replicated 0-d parameter is bumped on every rank at once: one global variable.
            numeric = (values[0] - values[1]) / (2 * h)
            full_grad = grads[name].full_tensor()
            analytic = full_grad[tuple(int(i) for i in idx)] if p.dim() else full_grad
            worst = max(worst, abs(numeric - float(analytic)))
    return worst, float(bound)


def test_gradcheck_float64_global(run_on_ranks):
    # The bound is derived in _global_gradcheck (6.2e-7 here; measured 3.2e-9 with default,
    # AVX2 and AVX512 kernels).
    for worst, bound in run_on_ranks(_global_gradcheck, 3):
        assert worst <= bound, (worst, bound)


def _autograd_gradcheck(rank, world):
    model = _module_with([(5, 3), (4,)], torch.float64)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan)
    mesh = plan.mesh

    def f(a, b):
        # gradcheck perturbs plain tensors; DTensor.from_local is differentiable in eager mode.
        shards = {
            "p0": DTensor.from_local(a, mesh, params["p0"].placements),
            "p1": DTensor.from_local(b, mesh, params["p1"].placements),
        }
        full = fsdpfn.unshard(shards, plan)
        return full["p0"].sin(), full["p1"] * 3

    inputs = tuple(params[n].to_local().clone().requires_grad_() for n in ("p0", "p1"))
    return torch.autograd.gradcheck(f, inputs)


def test_torch_gradcheck_one_rank(run_on_ranks):
    assert run_on_ranks(_autograd_gradcheck, 1) == [True]


# ---- eager backward == torch.func.grad; reduce == unshard's VJP --------------------------------


def _loss_of(full, x):
    return ((x @ full["p0"]).tanh().sum(-1) * full["p1"].sum() + full["p2"]).pow(2).mean()


def _styles(rank, world, strategy):
    model = _module_with([(5, 3), (7,), ()], torch.float32)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    params = fsdpfn.shard(model, plan)
    g_func = torch.func.grad(lambda ps: _loss_of(fsdpfn.unshard(ps, plan), x))(params)
    leaves = fsdpfn.shard(model, plan, requires_grad=True)
    _loss_of(fsdpfn.unshard(leaves, plan), x).backward()
    full = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    _loss_of(full, x).backward()
    g_reduce = fsdpfn.reduce({n: t.grad for n, t in full.items()}, plan)
    same = all(torch.equal(g_func[n].to_local(), leaves[n].grad.to_local()) for n in plan.param_names)
    same_reduce = all(torch.equal(g_func[n].to_local(), g_reduce[n].to_local()) for n in plan.param_names)
    placed = all(g_func[n].placements == params[n].placements for n in plan.param_names)
    return same, same_reduce, placed


@pytest.mark.parametrize("strategy", ["zero3", "replicate"])
def test_backward_and_func_grad_agree_and_equal_reduce(run_on_ranks, strategy):
    assert run_on_ranks(_styles, 3, strategy) == [(True, True, True)] * 3


def _vjp_is_reduce_sum(rank, world):
    model = _module_with([(6, 2), ()], torch.float32)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan)
    gen = torch.Generator().manual_seed(rank)
    cot = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    _, vjp = torch.func.vjp(lambda ps: fsdpfn.unshard(ps, plan, grad_op="sum", grad_scale=0.5), params)
    (got,) = vjp(cot)
    want = fsdpfn.reduce(cot, plan, op="sum", scale=0.5)
    total = {n: c.clone() for n, c in cot.items()}
    for c in total.values():
        dist.all_reduce(c)
    # Two ranks: each entry is a + b in either order (addition commutes exactly) times 0.5 (exact),
    # so the VJP equals the all-reduced cotangents bit for bit on any CPU.
    return all(
        torch.equal(got[n].full_tensor(), 0.5 * total[n]) and torch.equal(got[n].to_local(), want[n].to_local())
        for n in cot
    )


def test_vjp_with_sum_and_scale(run_on_ranks):
    assert run_on_ranks(_vjp_is_reduce_sum, 2) == [True, True]


# ---- mixed precision -----------------------------------------------------------------------------


def _mixed(rank, world):
    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=31, seq_len=8, width=16, depth=2, heads=2)
    model = GPT(cfg)
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = fsdpfn.plan(model, testing.mesh((world,)), mp=mp)
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, 31, (2 * world, 8), generator=torch.Generator().manual_seed(3))
    mine = tokens[2 * rank : 2 * rank + 2]

    def loss_fn(ps):
        full = fsdpfn.unshard(ps, plan)
        assert all(t.dtype == torch.bfloat16 for t in full.values())
        logits = torch.func.functional_call(model, full, (mine[:, :-1],))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mine[:, 1:].flatten())

    with fsdpfn.count_collectives() as counter:
        grads = torch.func.grad(loss_fn)(params)
    kinds = {(c.kind, c.dtype) for c in counter.calls}
    ref = GPT(cfg)
    ref.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    errs = [
        ((grads[n].full_tensor() - p.grad).norm() / p.grad.norm()).item()
        for n, p in ref.named_parameters()
        if p.grad.norm() > 0
    ]
    dtypes = {grads[n].dtype for n in grads}
    return kinds, dtypes, max(errs)


def test_mixed_precision_gathers_bf16_reduces_fp32_returns_fp32(run_on_ranks):
    for kinds, dtypes, err in run_on_ranks(_mixed, 2):
        assert kinds == {("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)}
        assert dtypes == {torch.float32}
        # bf16 compute against an fp32 reference. bf16 keeps 8 bits: every bf16 operation rounds
        # by up to 2^-8, and a gradient passes about k = 5 + 20 * depth = 45 of them in series
        # (10 per block each way, the embeddings, norm and head). Independent roundings grow like
        # a random walk, sqrt(k) * 2^-8 = 2.6e-2; twice that is the bound. Measured 1.07e-2, the
        # same with default, AVX2 and AVX512 kernels (bf16's own rounding sets it).
        assert err < 2 * (5 + 20 * 2) ** 0.5 * 2.0**-8


# ---- collective counts and the cost model -------------------------------------------------------


def _counts(rank, world, strategy, hsdp):
    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=31, seq_len=8, width=16, depth=3, heads=2))
    mesh = testing.mesh((2, world // 2), ("replicate", "shard")) if hsdp else testing.mesh((world,))
    plan = fsdpfn.plan(model, mesh, strategy=strategy)
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(rank))

    def loss_fn(ps):
        logits = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (tokens,))
        return logits.square().mean()

    with fsdpfn.count_collectives() as counter:
        torch.func.grad(loss_fn)(params)
    per_unit = {}
    for c in counter.calls:
        per_unit.setdefault((c.tag, c.kind), 0)
        per_unit[(c.tag, c.kind)] += 1
    cost = plan.cost(reshard_after_forward=False)
    predicted = {k: (v.calls, v.wire_bytes) for k, v in cost.collectives.items()}
    counted = {k: (counter.counts()[k], counter.wire_bytes()[k]) for k in counter.counts()}
    return per_unit, predicted, counted, [u.name for u in plan.units]


@pytest.mark.parametrize(
    "strategy,world,hsdp", [("zero3", 2, False), ("zero2", 3, False), ("replicate", 2, False), ("zero3", 4, True)]
)
def test_one_gather_and_one_reduce_per_unit_and_cost_matches(run_on_ranks, strategy, world, hsdp):
    for per_unit, predicted, counted, units in run_on_ranks(_counts, world, strategy, hsdp):
        assert predicted == counted
        for unit in units:
            if strategy == "replicate":
                assert per_unit[(unit, "all_reduce")] == 1
            else:
                assert per_unit[(unit, "all_gather")] == 1 and per_unit[(unit, "reduce_scatter")] == 1
                assert per_unit.get((unit, "all_reduce"), 0) == (1 if hsdp else 0)


# ---- bad input -------------------------------------------------------------------------------------


def _bad_inputs(rank, world):
    model = _module_with([(4, 2), (3,)], torch.float32)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan)
    messages = {}

    def catch(key, fn):
        try:
            fn()
        except ValueError as e:
            messages[key] = str(e)

    catch("missing", lambda: fsdpfn.unshard({"p0": params["p0"]}, plan))
    catch("extra", lambda: fsdpfn.unshard({**params, "p9": params["p1"]}, plan))
    catch("shape", lambda: fsdpfn.shard({"p0": torch.zeros(4, 3), "p1": torch.zeros(3)}, plan))
    catch("plain", lambda: fsdpfn.unshard({"p0": torch.zeros(4, 2), "p1": torch.zeros(3)}, plan))
    catch("reduce_shape", lambda: fsdpfn.reduce({"p0": torch.zeros(2, 2), "p1": torch.zeros(3)}, plan))
    catch("op", lambda: fsdpfn.reduce({"p0": torch.zeros(4, 2), "p1": torch.zeros(3)}, plan, op="max"))
    catch("wrong_mesh", lambda: fsdpfn.plan(model, testing.mesh((2, 2), ("data", "model"))) if world == 4 else None)
    return messages


def test_bad_input_is_a_clear_value_error(run_on_ranks):
    for messages in run_on_ranks(_bad_inputs, 4):
        assert "missing ['p1']" in messages["missing"] and "fsdpfn.shard(model, plan)" in messages["missing"]
        assert "not in the plan ['p9']" in messages["extra"]
        assert "['p0'] has shape (4, 3), but the plan says (4, 2)" in messages["shape"]
        assert "plain Tensor" in messages["plain"] and "DTensor shards" in messages["plain"]
        assert "['p0'] has shape (2, 2)" in messages["reduce_shape"]
        assert "'mean' or 'sum'" in messages["op"]
        assert "mesh axis 'data' has no role" in messages["wrong_mesh"] and "axes=" in messages["wrong_mesh"]


# ---- ranks must agree before the first collective ----------------------------------------------


def _disagree(rank, world, what):
    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0 if (what != "seed" or rank != 2) else 1)
    model = GPT(GPTConfig(vocab_size=31, seq_len=8, width=16, depth=2, heads=2))
    strategy = "zero2" if (what == "plan" and rank == 1) else "zero3"
    mesh = testing.mesh((2, 2), ("replicate", "shard")) if what == "hsdp-seed" else testing.mesh((world,))
    if what == "hsdp-seed":
        torch.manual_seed(rank // 2)  # the two replicate groups start from different models
        model = GPT(GPTConfig(vocab_size=31, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, mesh, strategy=strategy)
    try:
        fsdpfn.shard(model, plan)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["plan", "seed", "hsdp-seed"])
def test_shard_checks_that_ranks_agree(run_on_ranks, what):
    messages = run_on_ranks(_disagree, 4, what)
    assert all(m is not None for m in messages), messages  # every rank raises, none hangs
    if what == "plan":
        assert "built a different plan" in messages[0] and "[1]" in messages[0]
    elif what == "seed":
        assert "parameter 'embed.weight' differs between rank 0 and ranks [2]" in messages[0]
        assert "torch.manual_seed" in messages[0]
    else:
        assert "differs between rank" in messages[0]


def _agree(rank, world):
    torch.manual_seed(0)
    model = _module_with([(5, 3), ()], torch.float32, seed=3)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    return sorted(fsdpfn.shard(model, plan))


def test_shard_check_passes_when_ranks_agree(run_on_ranks):
    assert run_on_ranks(_agree, 3) == [["p0", "p1"]] * 3
