"""Plans over an expert-parallel axis: experts split over ``ep`` and sharded over the expert
data-parallel axis, dense parameters sharded over ``ep`` x ``edp``, on 4 gloo ranks
((ep, edp) = (2, 2) and (4, 1)), against the same model trained in one process.

Reference: one process holds the whole model and every rank's batch; its loss is the mean of
the per-rank losses, which is what averaging the ranks' gradients computes.

Tolerance: PARITY_STEPS steps of training (see [Note: how many steps a parity test runs] in
tests/_parity.py) within 1e-6 (relative, per parameter) of one process. Each step
computes the same products; what differs is which rows share a GEMM call and the order in which
sums are taken (an expert's gradient sums its rows by source rank, then over edp; a dense
gradient is reduce-scattered over 4 ranks instead of summed in one). Each is a reassociation of
fp32 sums of at most a few hundred terms of size ~1: ~1e-7 relative per step; AdamW divides by
sqrt(v) ~ |g|, so an update's relative error is the gradient's, and after n steps of lr 1e-2
the parameters differ by ~n x 1e-9 relative. Muon (fp32 Newton-Schulz) maps equal inputs to equal
bits and near inputs to near outputs for well-conditioned matrices; the router, whose gradient
has an exact null direction, trains with AdamW (see _opt). Clipping scales every gradient by the
global norm, which is a sum of squares over ranks: ~1e-7 relative as well. The router sees the same inputs to ~1e-7, so no token
changes experts (the router logits are far from ties at this size: checked by the reference
and the run choosing the same experts, which the 1e-6 agreement of the outputs implies).
"""

import dataclasses

import pytest
import torch
from torch import nn

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import MoE, MoEConfig
from _parity import PARITY_STEPS
from _refusals import refusals

CFG = MoEConfig(width=8, hidden=12, experts=4, top_k=2, aux_weight=0.1)
TOKENS = 16
STEPS = PARITY_STEPS


class Block(nn.Module):
    def __init__(self, cfg=CFG):
        super().__init__()
        self.norm = nn.LayerNorm(CFG.width)
        self.moe = MoE(cfg)
        self.fc = nn.Linear(CFG.width, CFG.width)

    def forward(self, h):
        y, aux = self.moe(self.norm(h))
        return h + y + 0.5 * torch.tanh(self.fc(h)), aux


class Net(nn.Module):
    def __init__(self, depth=2, cfg=CFG):
        super().__init__()
        self.inp = nn.Linear(CFG.width, CFG.width)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(depth)])

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for b in self.blocks:
            h, a = b(h)
            aux = aux + a
        return (h**2).mean() + aux


def _model(capacity_factor=None, pad=False):
    torch.manual_seed(0)
    return Net(cfg=dataclasses.replace(CFG, capacity_factor=capacity_factor, pad_to_capacity=pad))


def _tokens(rank, step):
    return torch.randn(TOKENS, CFG.width, generator=torch.Generator().manual_seed(1000 * step + rank))


def _opt(kind):
    if kind == "adamw":
        return optim.adamw(lr=1e-2, weight_decay=0.1)
    if kind == "clip":  # clipping by the global norm: below the gradients' norm, so every step clips
        return optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(lr=1e-2, weight_decay=0.1))
    # Muon on the >= 2-D weights (the packed experts are batches of matrices), AdamW on the rest
    # and on the router: a router's gradient has an exact null direction (a softmax's gradient
    # over the experts sums to zero per token), which holds only rounding noise, and
    # Newton-Schulz blows a direction with a tiny singular value up by its slope at 0 (3.4445
    # per iteration, ~490x over 5): its update is noise-dominated in one process too.
    return optim.muon(
        lr=2e-2,
        adamw_lr=1e-2,
        ns_dtype=torch.float32,
        labels=lambda n, p: "muon" if p.dim() >= 2 and "router" not in n else "adamw",
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _train(rank, world, mesh_shape, names, kind, style, strategy="zero3", capacity_factor=None, pad=False):
    mesh = testing.mesh(mesh_shape, names)
    model = _model(capacity_factor, pad)
    plan = fsdpfn.plan(model, mesh, strategy=strategy)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, plan, requires_grad=style == "backward")
    opt, ref_opt = _opt(kind), _opt(kind)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    me = fsdpfn.transforms.dp_rank(plan)
    rt = fsdpfn.runtime.Runtime(model, plan) if style == "backward" else None
    ref_model = _model(capacity_factor, pad)  # a second copy, never pointed at the ep group
    norms, dropped = [], 0
    for step in range(STEPS):
        x = _tokens(me, step)
        if style == "func":
            grads = torch.func.grad(lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)))(
                params
            )
        else:
            rt.apply(params, x).backward()
            grads = {n: p.grad for n, p in params.items()}
        dropped += sum(b.moe.dropped for b in model.blocks)  # this rank's, in its last forward
        norm = optim.global_norm(grads)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        if style == "backward":
            params = {n: p.detach().requires_grad_() for n, p in params.items()}
        chunks = [_tokens(r, step) for r in range(world)]
        ref_grads = torch.func.grad(
            lambda ps: sum(torch.func.functional_call(ref_model, ps, (c,)) for c in chunks) / world
        )(ref)
        ref_updates, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = optim.apply_updates(ref, ref_updates)
        want = torch.cat([g.reshape(-1) for g in ref_grads.values()]).norm()
        norms.append((norm / want - 1).abs().item())
        assert want > 0.05  # the clip is active
    # Dense and expert shards each counted once: the norm of the one-process gradients.
    errors = {"grad norm": max(norms), **{n: _rel(params[n].full_tensor(), ref[n]) for n in ref}}
    return (errors, dropped) if capacity_factor is not None else errors


MESHES = [
    pytest.param((2, 2), ("ep", "edp"), id="ep2xedp2"),
    pytest.param((2, 2), ("edp", "ep"), id="edp2xep2"),
    pytest.param((4, 1), ("ep", "edp"), id="ep4"),
]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("kind", ["adamw", "muon", "clip"])
def test_moe_trains_like_one_process(run_on_ranks, mesh_shape, names, kind):
    for r in run_on_ranks(_train, 4, mesh_shape, names, kind, "func"):
        assert max(r.values()) < 1e-6, r


# HSDP over experts: a replicate axis first; dense units HSDP over (replicate, ep x edp), expert
# units sharded over edp, reduced over edp then all-reduced over replicate, tokens dispatched over
# ep within each replica. 8 ranks, the same model and tolerance: the replicate all-reduce adds one
# more fp32 sum of 2 terms per gradient element (~1e-7 relative).
# AdamW behind clipping (its global norm sums dense and expert shards once each across replicas)
# on both orders; Muon on one.
HSDP_MESHES = [
    pytest.param((2, 2, 2), ("replicate", "ep", "edp"), "clip", id="rep2xep2xedp2-clip"),
    pytest.param((2, 2, 2), ("replicate", "edp", "ep"), "clip", id="rep2xedp2xep2-clip"),
    pytest.param((2, 2, 2), ("replicate", "ep", "edp"), "muon", id="rep2xep2xedp2-muon"),
]


@pytest.mark.parametrize("mesh_shape,names,kind", HSDP_MESHES)
def test_moe_with_a_replicate_axis_trains_like_one_process(run_on_ranks, mesh_shape, names, kind):
    for r in run_on_ranks(_train, 8, mesh_shape, names, kind, "func"):
        assert max(r.values()) < 1e-6, r


def test_moe_with_a_replicate_axis_runtime_backward(run_on_ranks):
    for r in run_on_ranks(_train, 4, (2, 2, 1), ("replicate", "ep", "edp"), "adamw", "backward", MIXED):
        assert max(r.values()) < 1e-6, r


MIXED = {"*": "zero2", "<root>": "zero3", "blocks.0.moe.experts": "replicate", "blocks.1.moe.experts": "zero1"}


@pytest.mark.parametrize(
    "kind,strategy", [("adamw", "zero3"), ("muon", "zero3"), ("adamw", MIXED)], ids=["adamw", "muon", "mixed"]
)
def test_moe_runtime_backward_trains_like_one_process(run_on_ranks, kind, strategy):
    for r in run_on_ranks(_train, 4, (2, 2), ("ep", "edp"), kind, "backward", strategy):
        assert max(r.values()) < 1e-6, r


def test_plan_puts_each_layers_experts_in_a_unit_of_their_own():
    plan = fsdpfn.plan(_model(), {"ep": 2, "edp": 2})
    assert [(u.label, u.experts, u.shard_size) for u in plan.units] == [
        ("<root>", False, 4),
        ("blocks.0", False, 4),
        ("blocks.0.moe.experts", True, 2),
        ("blocks.1", False, 4),
        ("blocks.1.moe.experts", True, 2),
    ]
    w1 = plan.param("blocks.0.moe.experts.w1")
    assert (w1.expert, w1.shape, w1.local_shape) == (True, (4, 12, 8), (2, 12, 8))
    assert plan.unit_of("blocks.0.moe.router.weight").name == "blocks.0"
    assert plan.dp_size == 4 and plan.ep_size == 2
    # The same model on a mesh without ep: experts are ordinary parameters of their block.
    flat = fsdpfn.plan(_model(), (4,))
    assert [u.label for u in flat.units] == ["<root>", "blocks.0", "blocks.1"] and not flat.param(
        "blocks.0.moe.experts.w1"
    ).expert


def test_plan_json_round_trips_experts():
    plan = fsdpfn.plan(_model(), {"ep": 2, "edp": 2}, strategy={"*": "zero3", "blocks.1.moe.experts": "zero2"})
    d = plan.to_dict()
    assert d["format"] == 3 and d["mesh"]["roles"] == ["ep", "shard"]
    unit = next(u for u in d["units"] if u["name"] == "blocks.0.moe.experts")
    assert unit["experts"] is True and all(p["expert"] for p in unit["params"])
    same = fsdpfn.Plan.from_json(plan.to_json())
    assert same == plan and same.fingerprint == plan.fingerprint
    assert same.unit("blocks.1.moe.experts").strategy == "zero2"
    padded = fsdpfn.plan(_model(1.25, True), {"ep": 2, "edp": 2})
    again = fsdpfn.Plan.from_json(padded.to_json())
    assert again == padded and again.unit("blocks.0.moe.experts").padded_capacity == 1.25
    assert padded.fingerprint != fsdpfn.plan(_model(1.25), {"ep": 2, "edp": 2}).fingerprint


def _bad_ep(rank, world):
    from fsdpfn.models import GPT, GPTConfig

    mesh = testing.mesh((4, 1), ("ep", "edp"))

    class Six(Net):
        def __init__(self):
            super().__init__(depth=1)
            self.blocks[0].moe = MoE(MoEConfig(width=8, hidden=12, experts=6))

    class Split(Net):
        def __init__(self):
            super().__init__(depth=1)
            self.blocks[0].moe = MoE(CFG, ep_group=mesh.get_group(0))

    cases = {
        "divisible": lambda: fsdpfn.plan(Six(), mesh),
        "no_experts": lambda: fsdpfn.plan(GPT(GPTConfig(vocab_size=32, width=16, depth=1, heads=2)), mesh),
        "split": lambda: fsdpfn.plan(Split(), mesh),
        "pattern": lambda: fsdpfn.plan(_model(), mesh, experts=["blocks.*.moe.w9"]),
        "tp": lambda: fsdpfn.plan(_model(), {"ep": 2, "edp": 1, "tp": 2}),
    }
    return refusals(cases)


def test_bad_expert_plans_are_named_on_every_rank_before_any_collective(run_on_ranks):
    for out in run_on_ranks(_bad_ep, 4):
        assert out["collectives"] == 0, out
        assert (
            "'blocks.0.moe.experts.w1' packs 6 experts (dim 0 of (6, 12, 8)), which do not divide over ep=4"
            in out["divisible"]
        ), out
        assert "has an expert-parallel axis, but GPT has no expert weights" in out["no_experts"], out
        assert "built with its experts already split" in out["split"], out
        assert "experts pattern 'blocks.*.moe.w9' matches no parameter" in out["pattern"], out
        assert out["tp"].startswith("NotImplementedError") and "cannot be combined" in out["tp"], out


# ---- checkpoints across ep degrees ----------------------------------------------------------


def _state(mesh_shape, names, seed, steps):
    """Params and AdamW state of a plan on ``mesh_shape`` after ``steps`` steps of the pure loop."""
    model = _model()
    if seed:  # different values: a load must overwrite every one
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names) if len(mesh_shape) > 1 else testing.mesh(mesh_shape))
    params = fsdpfn.shard(model, plan)
    opt = _opt("adamw")
    state = opt.init(params)
    me = fsdpfn.transforms.dp_rank(plan)
    for step in range(steps):
        x = _tokens(me, step)
        grads = torch.func.grad(lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)))(params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return plan, {"params": params, "opt": state, "step": steps}


def _full_state(state):
    entries, _ = fsdpfn.checkpoint.flatten_state(state)
    return {k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v) for k, v in entries.items()}


def _save_ep(rank, world, root):
    plan, state = _state((2, 2), ("ep", "edp"), 0, 2)
    fsdpfn.checkpoint.save(root, state, plan)
    return _full_state(state)


def _load_ep(rank, world, root, mesh_shape, names):
    plan, template = _state(mesh_shape, names, 3.0, 0)
    loaded = fsdpfn.checkpoint.load(root, template, plan)
    w1 = loaded["params"]["blocks.0.moe.experts.w1"]
    return _full_state(loaded), (tuple(w1.placements), tuple(w1.to_local().shape))


def test_checkpoints_reshard_across_ep_degrees_bitwise(run_on_ranks, tmp_path):
    """Saved on (ep, edp) = (2, 2); loaded on ep = 4, on (edp, ep) = (2, 2), on
    (replicate, ep, edp) = (2, 2, 1) and on one rank: every parameter and AdamW moment identical."""
    root = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_ep, 4, root)[0]
    ep4 = run_on_ranks(_load_ep, 4, root, (4, 1), ("ep", "edp"))
    swapped = run_on_ranks(_load_ep, 4, root, (2, 2), ("edp", "ep"))
    one = run_on_ranks(_load_ep, 1, root, (1,), None)
    replicated = run_on_ranks(_load_ep, 4, root, (2, 2, 1), ("replicate", "ep", "edp"))
    assert ep4[0][1][1] == (1, 12, 8) and one[0][1][1] == (4, 12, 8) and replicated[0][1][1] == (2, 12, 8)
    for loaded, _ in [*ep4, *swapped, *one, *replicated]:
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]) if isinstance(saved[k], torch.Tensor) else loaded[k] == saved[k], k


# ---- the step's collectives ------------------------------------------------------------------


def _counted_step(rank, world, mesh_shape=(2, 2), names=("ep", "edp"), capacity_factor=None, pad=False):
    """One Runtime step on (ep, edp) = (2, 2) or another ep mesh, every collective counted,
    beside the list."""
    from fsdpfn import step_collectives

    model = _model(capacity_factor, pad)
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names))
    params = fsdpfn.shard(model, plan, requires_grad=True)
    rt = fsdpfn.runtime.Runtime(model, plan, prefetch=0)
    x = _tokens(fsdpfn.transforms.dp_rank(plan), 0)
    with fsdpfn.count_collectives() as fwd:
        loss = rt.apply(params, x)
    with fsdpfn.count_collectives() as bwd:
        loss.backward()

    def key(phase, kind, size, nbytes, dtype, tag):
        # The row exchanges move what the routing sends (max of in and out): compared by call
        # only, unless padded (every expert's capacity, whatever the routing): byte for byte.
        return (phase, kind, size, None if tag.startswith("moe_") and not pad else nbytes, str(dtype), tag)

    counted = [
        key(p, c.kind, c.group_size, c.nbytes, c.dtype, c.tag)
        for p, ctr in (("forward", fwd), ("backward", bwd))
        for c in ctr.calls
    ]
    listed_calls = step_collectives(plan, schedule=rt.schedule, tokens=TOKENS)
    listed = [key(c.phase, c.kind, c.group_size, c.nbytes, c.dtype, c.tag) for c in listed_calls]
    dispatch = [c.nbytes for c in fwd.calls if c.tag == "moe_dispatch"]
    listed_dispatch = [c.nbytes for c in listed_calls if c.tag == "moe_dispatch" and c.phase == "forward"]
    default = step_collectives(plan, tokens=TOKENS)
    return counted == listed, (counted, listed), min(dispatch) >= listed_dispatch[0], len(default) == len(listed_calls)


def test_step_collectives_list_the_expert_all_to_alls(run_on_ranks):
    for same, lists, dispatch_ok, default_ok in run_on_ranks(_counted_step, 4):
        assert same, lists
        assert dispatch_ok and default_ok
    plan = fsdpfn.plan(_model(), {"ep": 2, "edp": 2})
    cost = plan.cost(tokens=TOKENS)
    # Per MoE layer: counts, dispatch and combine forward, both transposed backward.
    assert cost.collectives["all_to_all"].calls == 2 * 5
    assert cost.by(lambda c: c.tag)["moe_dispatch"].nbytes == 2 * 2 * TOKENS * CFG.top_k * CFG.width * 4


def test_step_collectives_list_the_padded_expert_all_to_alls_byte_for_byte(run_on_ranks):
    """Padded to capacity, a layer's dispatch and combine carry every expert's capacity of rows
    whatever the router chose, and no counts: the op list says so, bytes and all."""
    for same, lists, _, _ in run_on_ranks(_counted_step, 4, (2, 2), ("ep", "edp"), 1.25, True):
        assert same, lists
    plan = fsdpfn.plan(_model(1.25, True), {"ep": 2, "edp": 2})
    assert plan.unit("blocks.0.moe.experts").padded_capacity == 1.25
    cost = plan.cost(tokens=TOKENS)
    assert cost.collectives["all_to_all"].calls == 2 * 4  # dispatch and combine, both ways; no counts
    capacity = CFG.experts * -(-5 * TOKENS * CFG.top_k // (4 * CFG.experts))  # 1.25 = 5/4
    assert cost.by(lambda c: c.tag)["moe_dispatch"].nbytes == 2 * 2 * capacity * CFG.width * 4


def test_step_collectives_list_the_replicate_all_reduces_beside_experts(run_on_ranks):
    """(replicate, ep, edp) = (2, 2, 1): every unit's gradient is also all-reduced over the
    replicate axis, as counted on the ranks."""
    for same, lists, dispatch_ok, default_ok in run_on_ranks(_counted_step, 4, (2, 2, 1), ("replicate", "ep", "edp")):
        assert same, lists
        assert dispatch_ok and default_ok
        # zero3 everywhere: a unit's only all-reduce is over the replicate axis, once per unit
        units = len(fsdpfn.plan(_model(), {"replicate": 2, "ep": 2, "edp": 1}).units)
        assert sum(c[:2] == ("backward", "all_reduce") for c in lists[0]) == units, lists[0]


def _muon_experts_local(rank, world, mesh_shape, names):
    """Muon on an ep plan's expert weights: dim 0 (the expert index) is never cut, so every rank
    holds whole experts and orthogonalises them where they lie, with no collective; bitwise the
    one-process update (fp32 and bf16)."""
    model = _model()
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names))
    gen = torch.Generator().manual_seed(5)
    full = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if plan.param(n).expert}
    sharded = {
        n: v
        for n, v in fsdpfn.shard(
            {**{n: p.detach() for n, p in model.named_parameters()}, **full}, plan, check=False
        ).items()
        if n in full
    }
    ok = []
    for dtype in (torch.float32, torch.bfloat16):
        opt = optim.scale_by_muon(ns_dtype=dtype)
        want, _ = opt.update(full, opt.init(full))
        with fsdpfn.count_collectives() as counter:
            got, _ = opt.update(sharded, opt.init(sharded))
        ok.append((counter.counts(), all(torch.equal(got[n].full_tensor(), want[n]) for n in full)))
    return ok


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_muon_orthogonalises_experts_where_they_lie(run_on_ranks, mesh_shape, names):
    for r in run_on_ranks(_muon_experts_local, 4, mesh_shape, names):
        assert r == [({}, True), ({}, True)], r


def _init_ep(rank, world):
    """fsdpfn.init_shards on an ep plan makes the shards of the values it makes on a plain plan."""
    with torch.device("meta"):
        model = _model()
    ep = fsdpfn.init_shards(model, fsdpfn.plan(model, testing.mesh((2, 2), ("ep", "edp"))), seed=4)
    flat = fsdpfn.init_shards(model, fsdpfn.plan(model, testing.mesh((4,))), seed=4)
    return {n: torch.equal(ep[n].full_tensor(), flat[n].full_tensor()) for n in flat}


def test_init_shards_on_an_ep_plan(run_on_ranks):
    for r in run_on_ranks(_init_ep, 4):
        assert all(r.values()), r


def test_the_simulator_times_the_expert_all_to_alls():
    """fsdpfn.sim.profile follows nested expert units as the runtime's schedule nests them (its
    events are the schedule's, in order) and simulate walks the same collective list as
    plan.cost(), all-to-alls included."""
    model = _model()
    plan = fsdpfn.plan(model, {"ep": 2, "edp": 2})
    work = fsdpfn.sim.profile(model, plan, _tokens(0, 0), loss_fn=lambda out: out)
    events = [op for op in fsdpfn.runtime.schedule(plan).ops if op.is_event]
    assert [e for e, _ in work.work] == events
    assert work.at(fsdpfn.runtime.Op("forward", "blocks.0.moe.experts")).flops > 0
    r = fsdpfn.sim.simulate(plan, workload=work, hardware=fsdpfn.sim.H100_SXM)
    cost = plan.cost()
    assert {k: (t.calls, t.nbytes) for k, t in r.traffic["step"].items()} == {
        k: (c.calls, c.nbytes) for k, c in cost.collectives.items()
    }
    assert r.traffic["step"]["all_to_all"].calls == 10


# ---- token capacity ---------------------------------------------------------------------------
# Capacity is counted per call of the layer, on the rank that routes the tokens (Megatron's
# "position" drop policy, no padding): the one-process reference above already calls the model
# once per rank's batch, so it drops the same (token, choice) pairs the ranks drop. Dropping
# depends only on the routing (which experts each token chose, and token order), which is the
# same in both runs as long as no router logit is within ~1e-7 of a tie; so the bound and its
# reasoning are those of the dropless tests: 1e-6.

CAPACITY = [
    pytest.param(2, (2, 1), ("ep", "edp"), "adamw", False, id="ep2-2ranks-adamw"),
    pytest.param(4, (2, 2), ("ep", "edp"), "adamw", False, id="ep2xedp2-adamw"),
    pytest.param(4, (2, 2), ("ep", "edp"), "muon", False, id="ep2xedp2-muon"),
    pytest.param(4, (4, 1), ("ep", "edp"), "adamw", False, id="ep4-adamw"),
    pytest.param(4, (2, 2), ("ep", "edp"), "adamw", True, id="ep2xedp2-adamw-padded"),
    pytest.param(4, (4, 1), ("ep", "edp"), "adamw", True, id="ep4-adamw-padded"),
]


@pytest.mark.parametrize("world,mesh_shape,names,kind,pad", CAPACITY)
def test_moe_with_capacity_trains_like_one_process_calling_it_per_rank(
    run_on_ranks, world, mesh_shape, names, kind, pad
):
    # Factor 1.0: capacity ceil(16 * 2 / 4) = 8 pairs per expert and call, the mean load, so any
    # imbalance drops pairs (checked: the ranks drop some; an unused capacity would test nothing).
    # pad: each expert's rows padded to capacity (the reference pads too, over its one rank).
    results = run_on_ranks(_train, world, mesh_shape, names, kind, "func", "zero3", 1.0, pad)
    assert sum(dropped for _, dropped in results) > 0, results
    for errors, _ in results:
        assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("pad", [False, True], ids=["routed", "padded"])
def test_moe_with_capacity_under_the_runtimes_backward(run_on_ranks, pad):
    results = run_on_ranks(_train, 4, (2, 2), ("ep", "edp"), "adamw", "backward", "zero3", 1.0, pad)
    assert sum(dropped for _, dropped in results) > 0, results
    for errors, _ in results:
        assert max(errors.values()) < 1e-6, errors


def _remat_around_a_unit(rank, world):
    """Runtimes over plans that rematerialise a block holding its experts' unit."""
    ep = testing.mesh((2, 1), ("ep", "edp"))
    cases = {
        "all": lambda: fsdpfn.runtime.Runtime(_model(), fsdpfn.plan(_model(), ep, remat="full")),
        "one": lambda: fsdpfn.runtime.Runtime(_model(), fsdpfn.plan(_model(), ep, remat={"blocks.1": "save_dots"})),
    }
    return refusals(cases)


def test_the_runtime_names_a_rematerialised_unit_that_holds_another_before_any_collective(run_on_ranks):
    """The runtime recomputes a unit's forward in its backward, outside the forward that routes
    an expert unit through the schedule, so a block holding its experts' unit would call the
    experts on weights it does not hold (it raised in ``loss.backward()``). Refused at build on
    every rank, naming both units and the ways out; the pure loop rematerialises such a block."""
    for out in run_on_ranks(_remat_around_a_unit, 2):
        assert out["collectives"] == 0, out
        for case, block in (("all", "blocks.0"), ("one", "blocks.1")):
            assert out[case].startswith("ValueError:"), out
            assert f"'{block}'" in out[case] and f"'{block}.moe.experts'" in out[case], out
            assert "remat" in out[case], out
