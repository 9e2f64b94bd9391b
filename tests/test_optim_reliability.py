"""fsdpfn.optim reliability: bad settings fail when a transform is built (a named ValueError, no
collective, every rank alike), and apply_if_finite skips non-finite steps on every rank with one
collective, equal to optax's apply_if_finite on one process and to a run that never saw the NaN
on 2, 3 and 4 (HSDP) ranks."""

import collections
import doctest
import importlib
import math

import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.transforms import from_local

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------------------------------------
# Bad settings: ValueError naming the parameter, when built, with no process group at all
# ---------------------------------------------------------------------------------------------

sched = optim.warmup_cosine_schedule
# (family, factory, kwargs, the name the message must give, the value it must show or None)
BAD = [
    ("sgd", optim.sgd, dict(lr=-0.1), "lr", "-0.1"),
    ("sgd", optim.sgd, dict(lr=NAN), "lr", "nan"),
    ("sgd", optim.sgd, dict(lr=INF), "lr", "inf"),
    ("sgd", optim.sgd, dict(lr="0.1"), "lr", "'0.1'"),
    ("sgd", optim.sgd, dict(lr=0.1, momentum=-0.9), "momentum", "-0.9"),
    ("sgd", optim.sgd, dict(lr=0.1, momentum=True), "momentum", "True"),
    ("sgd", optim.sgd, dict(lr=0.1, weight_decay=-1e-4), "weight_decay", "-0.0001"),
    ("sgd", optim.sgd, dict(lr=0.1, nesterov=True), "nesterov", "momentum=0"),
    ("sgd", optim.sgd, dict(lr=0.1, momentum=0.9, nesterov="yes"), "nesterov", "'yes'"),
    ("adamw", optim.adamw, dict(lr=-1e-3), "lr", "-0.001"),
    ("adamw", optim.adamw, dict(b1=1.0), "b1", "1.0"),
    ("adamw", optim.adamw, dict(b1=-0.1), "b1", "-0.1"),
    ("adamw", optim.adamw, dict(b2=1.5), "b2", "1.5"),
    ("adamw", optim.adamw, dict(eps=-1e-8), "eps", "-1e-08"),
    ("adamw", optim.adamw, dict(weight_decay=-0.01), "weight_decay", "-0.01"),
    ("scale_by_muon", optim.scale_by_muon, dict(momentum=-0.1), "momentum", "-0.1"),
    ("scale_by_muon", optim.scale_by_muon, dict(momentum=1.0), "momentum", "1.0"),
    ("scale_by_muon", optim.scale_by_muon, dict(nesterov=None), "nesterov", "None"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_steps=-1), "ns_steps", "-1"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_steps=0), "ns_steps", "0"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_steps=2.5), "ns_steps", "2.5"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_steps=True), "ns_steps", "True"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_coeffs=(3.4, -4.7)), "ns_coeffs", "(3.4, -4.7)"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_coeffs=(3.4, NAN, 2.0)), "ns_coeffs[1]", "nan"),
    ("scale_by_muon", optim.scale_by_muon, dict(eps=0.0), "eps", "0.0"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_dtype=torch.int32), "ns_dtype", "torch.int32"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_dtype="bf16"), "ns_dtype", "'bf16'"),
    ("scale_by_muon", optim.scale_by_muon, dict(layout="scatter"), "layout", "'scatter'"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_method="polar"), "ns_method", "'polar'"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_method="gram", gram_restarts=(7,)), "gram_restarts", "[7]"),
    ("scale_by_muon", optim.scale_by_muon, dict(ns_method="gram", gram_restarts=("2",)), "gram_restarts", "('2',)"),
    ("scale_by_muon_lr", optim.scale_by_muon_lr, dict(lr=-0.02), "lr", "-0.02"),
    ("scale_by_muon_lr", optim.scale_by_muon_lr, dict(lr=0.02, weight_decay=-0.1), "weight_decay", "-0.1"),
    ("scale_by_muon_lr", optim.scale_by_muon_lr, dict(lr=0.02, adjust_lr_fn="bogus"), "adjust_lr_fn", "'bogus'"),
    ("muon", optim.muon, dict(lr=-0.02), "lr", "-0.02"),
    ("muon", optim.muon, dict(momentum=1.5), "momentum", "1.5"),
    ("muon", optim.muon, dict(weight_decay=-0.1), "weight_decay", "-0.1"),
    ("muon", optim.muon, dict(ns_steps=-1), "ns_steps", "-1"),
    ("muon", optim.muon, dict(eps=-1.0), "eps", "-1.0"),
    ("muon", optim.muon, dict(layout="rows"), "layout", "'rows'"),
    ("muon", optim.muon, dict(ns_method="svd"), "ns_method", "'svd'"),
    ("muon", optim.muon, dict(adjust_lr_fn="spectral"), "adjust_lr_fn", "'spectral'"),
    ("muon", optim.muon, dict(adamw_lr=-3e-3), "adamw_lr", "-0.003"),
    ("muon", optim.muon, dict(adamw_betas=(0.9,)), "adamw_betas", "(0.9,)"),
    ("muon", optim.muon, dict(adamw_betas=(0.9, 1.0)), "adamw_betas[1]", "1.0"),
    ("muon", optim.muon, dict(adamw_eps=-1e-8), "adamw_eps", "-1e-08"),
    ("muon", optim.muon, dict(adamw_weight_decay=-0.1), "adamw_weight_decay", "-0.1"),
    ("muon", optim.muon, dict(labels=42), "labels", "int"),
    ("clip_by_global_norm", optim.clip_by_global_norm, dict(max_norm=0.0), "max_norm", "0.0"),
    ("clip_by_global_norm", optim.clip_by_global_norm, dict(max_norm=-1.0), "max_norm", "-1.0"),
    ("clip_by_global_norm", optim.clip_by_global_norm, dict(max_norm=INF), "max_norm", "inf"),
    ("clip_by_global_norm", optim.clip_by_global_norm, dict(max_norm=NAN), "max_norm", "nan"),
    ("schedule", optim.constant_schedule, dict(value=NAN), "value", "nan"),
    ("schedule", sched, dict(peak_value=INF, warmup_steps=1, decay_steps=2), "peak_value", "inf"),
    ("schedule", sched, dict(peak_value=1.0, warmup_steps=1, decay_steps=2, end_value=NAN), "end_value", "nan"),
    ("schedule", sched, dict(peak_value=1.0, warmup_steps=-1, decay_steps=2), "warmup_steps", "-1"),
    ("schedule", sched, dict(peak_value=1.0, warmup_steps=2.5, decay_steps=5), "warmup_steps", "2.5"),
    ("schedule", sched, dict(peak_value=1.0, warmup_steps=5, decay_steps=3), "decay_steps", "3"),
    ("lr_schedule", optim.sgd, dict(lr=lambda count: -0.1), "lr(0)", "-0.1"),
    ("lr_schedule", optim.adamw, dict(lr=lambda count: 1 / count), "lr", "ZeroDivisionError"),
    ("lr_schedule", optim.muon, dict(lr=sched(-1.0, 0, 10)), "lr(0)", "-1.0"),
    ("lr_schedule", optim.muon, dict(adamw_lr=lambda count: None), "adamw_lr(0)", "None"),
    ("partition", optim.partition, dict(transforms={}, labels={}), "transforms", "{}"),
    ("partition", optim.partition, dict(transforms={"a": 42}, labels={}), "transforms['a']", "42"),
    ("partition", optim.partition, dict(transforms={"a": optim.sgd(0.1)}, labels=None), "labels", "None"),
    ("apply_if_finite", optim.apply_if_finite, dict(inner=0.1, max_consecutive_errors=1), "inner", "float"),
    (
        "apply_if_finite",
        optim.apply_if_finite,
        dict(inner=optim.sgd(0.1), max_consecutive_errors=-1),
        "max_consecutive_errors",
        "-1",
    ),
    (
        "apply_if_finite",
        optim.apply_if_finite,
        dict(inner=optim.sgd(0.1), max_consecutive_errors=2.0),
        "max_consecutive_errors",
        "2.0",
    ),
    ("newton_schulz", optim.newton_schulz, dict(x=torch.ones(2, 3), steps=-1), "steps", "-1"),
    ("newton_schulz", optim.newton_schulz, dict(x=torch.ones(2, 3), coeffs=(1.0, 2.0, INF)), "coeffs[2]", "inf"),
    ("newton_schulz", optim.orthogonalize, dict(leaves=[], names=[], layout="everywhere"), "layout", "'everywhere'"),
    ("newton_schulz", optim.newton_schulz_flops, dict(shape=(4, 8), steps=-2), "steps", "-2"),
    ("scale_by_muon", optim.scale_by_muon, dict(buckets=0), "buckets", "0"),
    ("scale_by_muon", optim.scale_by_muon, dict(buckets=2.0), "buckets", "2.0"),
    ("scale_by_muon", optim.scale_by_muon, dict(blocks={"*qkv.weight": (3, 0)}), "blocks['*qkv.weight']", "(3, 0)"),
    ("muon", optim.muon, dict(blocks={"*qkv.weight": True}), "blocks['*qkv.weight']", "True"),
    ("muon", optim.muon, dict(blocks="heads"), "blocks", "'heads'"),
    ("scale_by_muon_lr", optim.scale_by_muon_lr, dict(lr=0.02, blocks=[3]), "blocks", "[3]"),
    ("head_blocks", optim.head_blocks, dict(heads=0), "heads", "0"),
    ("newton_schulz", optim.orthogonalize, dict(leaves=[], names=[], buckets=-1), "buckets", "-1"),
    (
        "TorchOptimizer",
        optim.TorchOptimizer,
        dict(params={"w": torch.zeros(2, 2)}, transform=optim.muon, lr=-0.1),
        "lr",
        "-0.1",
    ),
    (
        "TorchOptimizer",
        optim.TorchOptimizer,
        dict(params={"w": torch.zeros(2, 2)}, transform=optim.muon, momentum=1.0),
        "momentum",
        "1.0",
    ),
]
# chain takes its transforms positionally.
CHAIN_BAD = [
    ((optim.sgd(0.1), 42), "argument 1", "int"),
    (([optim.sgd(0.1), optim.adamw()],), "chain(*transforms)", "list"),
]


@pytest.fixture
def no_process_group():
    """No default process group in this process: a collective would have no peer. Anything a
    factory started would still be recorded by count_collectives, which must stay empty."""
    assert not dist.is_initialized()
    with fsdpfn.comm.count_collectives() as counter:
        yield
    assert counter.calls == [], counter.counts()


@pytest.mark.parametrize(
    "family,factory,kwargs,name,shown", BAD, ids=[f"{b[0]}-{'-'.join(b[2])}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_setting_fails_when_built_naming_it(no_process_group, family, factory, kwargs, name, shown):
    with pytest.raises(ValueError) as info:
        factory(**kwargs)
    message = str(info.value)
    assert name in message, message
    assert shown in message, message


@pytest.mark.parametrize("args,name,shown", CHAIN_BAD, ids=["not-a-transform", "a-list"])
def test_chain_refuses_what_is_not_a_transform(no_process_group, args, name, shown):
    with pytest.raises(ValueError, match="chain") as info:
        optim.chain(*args)
    assert name in str(info.value) and shown in str(info.value)


GOOD_EDGES = [
    lambda: optim.sgd(0.0),
    lambda: optim.sgd(torch.tensor(0.1), momentum=0.0, weight_decay=0.0),
    lambda: optim.sgd(0.1, momentum=2, nesterov=True),  # torch.optim.SGD allows momentum >= 1 too
    lambda: optim.adamw(0.0, b1=0.0, b2=0.0, eps=0.0, weight_decay=0.0),
    lambda: optim.scale_by_muon(momentum=0.0, ns_steps=1, ns_dtype=None, ns_method="gram", gram_restarts=()),
    lambda: optim.muon(adjust_lr_fn=None, adamw_lr=lambda c: 1e-3, adamw_weight_decay=0.0),
    lambda: optim.clip_by_global_norm(1e-12),
    lambda: optim.warmup_cosine_schedule(1.0, 0, 0, end_value=-1.0),  # schedules may go negative; lr may not
    lambda: optim.apply_if_finite(optim.chain(), 0),
    lambda: optim.partition({"a": optim.identity()}, lambda params: "a"),
]


@pytest.mark.parametrize("make", GOOD_EDGES, ids=range(len(GOOD_EDGES)))
def test_settings_on_the_edge_of_the_range_build(no_process_group, make):
    make()


def test_schedule_out_of_range_later_fails_at_that_step_naming_it():
    # A schedule is only called at step 0 when built; a later bad value is caught at its step.
    opt = optim.sgd(lambda count: 1.0 - 0.5 * count)
    p = {"w": torch.ones(2)}
    state = opt.init(p)
    for _ in range(3):
        _, state = opt.update({"w": torch.ones(2)}, state, p)
    with pytest.raises(ValueError, match=r"sgd: lr\(3\)=-0.5 .*step 3"):
        opt.update({"w": torch.ones(2)}, state, p)


def _build_with_ns_steps(rank, world, ns_steps):
    with fsdpfn.comm.count_collectives() as counter:
        try:
            optim.muon(lr=0.02, ns_steps=ns_steps)
        except ValueError as e:
            return str(e), counter.calls
    return None, counter.calls


def test_ns_steps_minus_one_fails_when_built_on_every_rank(run_on_ranks):
    # It used to fail at the first update, on the ranks owning a matrix only, while the others
    # waited in the next all-to-all ("Connection closed by peer").
    results = run_on_ranks(_build_with_ns_steps, 2, -1)
    assert [calls for _, calls in results] == [[], []]
    messages = [m for m, _ in results]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "ns_steps=-1" in messages[0] and "int >= 1" in messages[0]


# ---------------------------------------------------------------------------------------------
# apply_if_finite on one process: optax's semantics
# ---------------------------------------------------------------------------------------------


def _optax_apply_if_finite(inner, max_consecutive_errors):
    """optax.apply_if_finite's update, transcribed to torch (optax/transforms/_conditionality.py):
    the state is (notfinite_count, last_finite, total_notfinite, inner_state); after more than
    max_consecutive_errors non-finite steps in a row optax applies the inner update anyway."""

    def init(params):
        return (0, True, 0, inner.init(params))

    def update(updates, state, params=None):
        isfinite = all(bool(torch.isfinite(x).all()) for x in optree.tree_leaves(updates))
        notfinite_count = 0 if isfinite else state[0] + 1
        if isfinite or notfinite_count > max_consecutive_errors:
            updates, inner_state = inner.update(updates, state[3], params)
        else:
            updates, inner_state = optree.tree_map(torch.zeros_like, updates), state[3]
        total = state[2] if isfinite else state[2] + 1
        return updates, (notfinite_count, isfinite, total, inner_state)

    return optim.GradientTransformation(init, update)


def _equal_trees(a, b):
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    if sa != sb:
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


SMALL = {"w": (3, 4), "b": (4,), "s": ()}


def _grads(step, bad, dtype=torch.float32):
    gen = torch.Generator().manual_seed(step)
    g = {n: torch.randn(s, generator=gen).to(dtype) for n, s in SMALL.items()}
    if bad:
        g["w"][step % 3, 1] = (NAN, INF, -INF)[step % 3]
    return g


@given(pattern=st.lists(st.booleans(), max_size=12), max_errors=st.integers(0, 3))
def test_apply_if_finite_is_optax_apply_if_finite_on_one_process(pattern, max_errors):
    ours = optim.apply_if_finite(optim.adamw(1e-2, weight_decay=0.1), max_errors)
    ref = _optax_apply_if_finite(optim.adamw(1e-2, weight_decay=0.1), max_errors)
    params = _grads(1000, False)
    state, ref_state = ours.init(params), ref.init(params)
    for step, bad in enumerate(pattern):
        grads = _grads(step, bad)
        if bad and ref_state[0] + 1 > max_errors:
            # Where optax gives up and applies the NaNs, we raise, naming the count.
            with pytest.raises(FloatingPointError, match=rf"{max_errors + 1} steps? in a row"):
                ours.update(grads, state, params)
            return
        updates, state = ours.update(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        assert _equal_trees(updates, ref_updates)
        assert _equal_trees(tuple(state), ref_state)
        params = optim.apply_updates(params, updates)


def test_apply_if_finite_skip_then_finite_step_equals_a_run_without_the_nan():
    guarded = optim.apply_if_finite(optim.muon(lr=0.02, ns_dtype=torch.float32), max_consecutive_errors=1)
    plain = optim.muon(lr=0.02, ns_dtype=torch.float32)
    params = _grads(99, False)
    state, ref_state = guarded.init(params), plain.init(params)
    for step, bad in enumerate([False, True, False, True, False]):
        grads = _grads(step, bad, torch.bfloat16 if step == 3 else torch.float32)
        before = state
        updates, state = guarded.update(grads, state, params)
        if bad:
            assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
            assert state.inner_state is before.inner_state
            assert (state.notfinite_count, state.last_finite) == (1, False)
            continue
        ref_updates, ref_state = plain.update(grads, ref_state, params)
        assert _equal_trees(updates, ref_updates) and _equal_trees(state.inner_state, ref_state)
        params = optim.apply_updates(params, updates)
    assert (state.notfinite_count, state.last_finite, state.total_notfinite) == (0, True, 2)


def test_apply_if_finite_gives_up_after_max_consecutive_errors():
    opt = optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=0)
    p = {"w": torch.ones(2), "masked": None}
    with pytest.raises(FloatingPointError, match=r"1 step in a row.*max_consecutive_errors=0.*'w'"):
        opt.update({"w": torch.tensor([INF, 0.0]), "masked": None}, opt.init(p), p)


# ---------------------------------------------------------------------------------------------
# clip_by_global_norm on non-finite norms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w", [[NAN, 1.0], [INF, 1.0], [3e30, 1.0]], ids=["nan", "inf", "finite-but-overflowing"])
def test_clip_makes_a_non_finite_norm_a_nan_step_on_every_leaf(w):
    # torch's clip_grad_norm_ would zero the finite leaves here (a factor max_norm / inf = 0),
    # and on the overflowing case return an all-zero step; we make the step NaN everywhere so it
    # cannot pass for a small one, and apply_if_finite after the clip skips it.
    grads = {"w": torch.tensor(w), "b": torch.ones(3)}
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    assert all(torch.isnan(u).all() for u in clipped.values())
    guarded = optim.chain(optim.clip_by_global_norm(1.0), optim.apply_if_finite(optim.sgd(0.1), 3))
    updates, state = guarded.update(grads, guarded.init(grads), grads)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    assert state[1].total_notfinite == 1


# ---------------------------------------------------------------------------------------------
# apply_if_finite on 2, 3 and 4 (HSDP) gloo ranks
# ---------------------------------------------------------------------------------------------


class _Net(nn.Module):
    # 5 and 3 rows: uneven shards on 2, 3 and 4 ranks; two Muon matrices and two AdamW biases.
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(7, 5), nn.Linear(5, 3)])


POISONED = "blocks.1.weight"


def _setup(world, mesh_shape):
    mesh = testing.mesh(mesh_shape, ("replicate", "shard") if len(mesh_shape) == 2 else None)
    torch.manual_seed(0)
    model = _Net()
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    return plan, fsdpfn.shard(model, plan)


def _sharded_grads(plan, seed, poison_rank=None):
    gen = torch.Generator().manual_seed(seed)
    full = {p.name: torch.randn(p.shape, generator=gen) for u in plan.units for p in u.params}
    grads = fsdpfn.shard(full, plan, check=False)
    if poison_rank == dist.get_rank():
        local = grads[POISONED].to_local().clone()
        local[0, 0] = NAN
        grads[POISONED] = from_local(plan, POISONED, local)
    return grads


def _make_inner():
    # Muon's owner layout communicates inside update: a skipped step must start none of it.
    return optim.muon(lr=0.05, adamw_lr=0.01, weight_decay=0.1, ns_dtype=torch.float32, layout="owner")


def _bitwise(a, b):
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert type(x) is type(y) and getattr(x, "placements", None) == getattr(y, "placements", None)
            assert torch.equal(
                x.to_local() if hasattr(x, "to_local") else x, y.to_local() if hasattr(y, "to_local") else y
            )
        else:
            assert x == y, (x, y)
    return True


def _counts(calls):
    return dict(collections.Counter(c.kind for c in calls))


def _skip_on_every_rank(rank, world, mesh_shape):
    plan, params = _setup(world, mesh_shape)
    poison_rank = world - 1  # holds rows of the poisoned matrix on every mesh used here
    g0, g2 = _sharded_grads(plan, 10), _sharded_grads(plan, 12)
    g1 = _sharded_grads(plan, 11, poison_rank)
    assert torch.isfinite(g1[POISONED].to_local()).all() == (rank != poison_rank)

    guarded, inner = optim.apply_if_finite(_make_inner(), max_consecutive_errors=3), _make_inner()
    p, s = params, guarded.init(params)
    ref_p, ref_s = params, inner.init(params)
    flags, totals, kinds = [], [], []
    for i, grads in enumerate((g0, g1, g2)):
        with fsdpfn.comm.count_collectives() as counter:
            u, s_next = guarded.update(grads, s, p)
        mine = [c for c in counter.calls if c.tag == "apply_if_finite"]
        # One 1-element all-reduce over every rank of the mesh, whatever the number of leaves.
        assert [(c.kind, c.group_size, c.nbytes) for c in mine] == [("all_reduce", world, 4)], mine
        if i == 1:
            assert counter.calls == mine  # the inner transform never ran: no collective of its own
            assert all(torch.equal(x.to_local(), torch.zeros_like(x.to_local())) for x in u.values())
            assert s_next.inner_state is s.inner_state and _bitwise(s_next.inner_state, s.inner_state)
            new_p = optim.apply_updates(p, u)
            assert _bitwise(new_p, p)
        else:
            with fsdpfn.comm.count_collectives() as ref_counter:
                ref_u, ref_s = inner.update(grads, ref_s, ref_p)
            ref_p = optim.apply_updates(ref_p, ref_u)
            want = collections.Counter(_counts(ref_counter.calls))
            want["all_reduce"] += 1
            assert _counts(counter.calls) == dict(want)
            new_p = optim.apply_updates(p, u)
            # The finite step after the skip is the step of a run that never saw the NaN.
            assert _bitwise(new_p, ref_p) and _bitwise(s_next.inner_state, ref_s)
        p, s = new_p, s_next
        flags.append(s.last_finite)
        totals.append((s.notfinite_count, s.total_notfinite))
        kinds.append(_counts(counter.calls))
    return flags, totals, kinds


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=["w2", "w3", "hsdp2x2"])
def test_apply_if_finite_skips_on_every_rank_when_one_shard_has_a_nan(run_on_ranks, mesh_shape):
    world = math.prod(mesh_shape)
    results = run_on_ranks(_skip_on_every_rank, world, mesh_shape)
    for flags, totals, kinds in results:
        assert flags == [True, False, True]
        assert totals == [(0, 0), (1, 1), (0, 1)]
        assert kinds[1] == {"all_reduce": 1}
    assert all(r == results[0] for r in results)


def _raise_on_every_rank(rank, world, max_errors):
    plan, params = _setup(world, (world,))
    opt = optim.apply_if_finite(_make_inner(), max_consecutive_errors=max_errors)
    state = opt.init(params)
    _, state = opt.update(_sharded_grads(plan, 20), state, params)
    bad = _sharded_grads(plan, 21, poison_rank=0)
    for i in range(max_errors):
        updates, state = opt.update(bad, state, params)
        assert (state.notfinite_count, state.total_notfinite, state.last_finite) == (i + 1, i + 1, False)
    try:
        opt.update(bad, state, params)
    except FloatingPointError as e:
        # Every rank is still in step: one more collective completes.
        fsdpfn.comm.barrier()
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_apply_if_finite_raises_on_every_rank_after_max_consecutive_errors(run_on_ranks, world):
    messages = run_on_ranks(_raise_on_every_rank, world, 2)
    assert all(m is not None and "3 steps in a row" in m and "max_consecutive_errors=2" in m for m in messages), (
        messages
    )
    assert repr(POISONED) in messages[0]
    assert all("another rank" in m for m in messages[1:])


# ---------------------------------------------------------------------------------------------
# The docstring examples run (one process, plain tensors)
# ---------------------------------------------------------------------------------------------

OPTIM_MODULES = [
    "_base",
    "_blocks",
    "_checks",
    "_clip",
    "_distributed_ns",
    "_finite",
    "_muon",
    "_newton_schulz",
    "_owner",
    "_schedules",
    "_sgd_adamw",
    "_torch_optim",
    "_tree",
]


@pytest.mark.parametrize("module", OPTIM_MODULES)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"fsdpfn.optim.{module}")
    result = doctest.testmod(mod, extraglobs={"torch": torch, "fsdpfn": fsdpfn}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
