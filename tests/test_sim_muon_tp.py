"""fsdpfn.sim.Muon on tensor- and expert-parallel plans: its collectives (calls, bytes, bytes on
the wire) and Newton–Schulz FLOPs equal what a real ``fsdpfn.optim.muon`` step counts, on every
rank, for the owner, duplicated and blockwise layouts.

The simulator reads each rank's box of every Muon leaf with the optimizer's own functions
(``fsdpfn.optim.leaf_holdings`` on ``fsdpfn.transforms.placements``), runs the same
``owner_schedule`` and takes the all-to-all splits from the same packing (``bucket_splits``), so
these are equalities of integers: collectives counted by ``fsdpfn.count_collectives`` and FLOPs
by ``FlopCounterMode`` (exact integer counts of the matmuls the step dispatched).
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, sim, testing


TP = {
    "col": "colwise",
    "row": "rowwise",
    "qkv": "colwise",
    "whole": "replicate",
}  # every Linear of the root split or marked
BLOCKS = {"qkv.weight": 4}  # 4 heads of 3 rows: tp = 2 gives each tp rank 2 whole heads, dp cuts them
LAYOUTS = [
    ("owner", None, None),
    ("owner", 2, None),
    ("duplicated", None, None),
    ("blockwise", None, None),
    ("owner", None, BLOCKS),
    ("duplicated", None, BLOCKS),
    ("blockwise", None, BLOCKS),
]


class Net(nn.Module):
    """Uneven on purpose: rows that split unevenly over dp, a weight tp leaves whole, a batch of
    expert matrices (dp over the batch), an AdamW norm."""

    def __init__(self):
        super().__init__()
        self.col = nn.Linear(6, 10, bias=False)  # (10, 6): tp rows 5 each, over dp 3 + 2
        self.row = nn.Linear(10, 7, bias=False)  # (7, 10): tp columns 5 each, rows over dp 4 + 3
        self.whole = nn.Linear(7, 5, bias=False)  # (5, 7): replicated over tp, rows 3 + 2
        self.qkv = nn.Linear(4, 12, bias=False)  # (12, 4)
        self.experts = nn.Parameter(torch.randn(5, 4, 6))  # 3 + 2 matrices over dp, whole over tp
        self.norm = nn.LayerNorm(6)


def _label(name, p):
    return "muon" if p.dim() >= 2 else "adamw"


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _counted(counter):
    return {k: (counter.counts()[k], counter.nbytes()[k], round(counter.wire_bytes()[k], 6)) for k in counter.counts()}


def _predicted(plan, model_cost, rank, workload):
    r = sim.simulate(plan, None, workload, model_cost, _HW, rank=rank)
    return {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in r.traffic["optimizer"].items()}


_HW = sim.Hardware(
    "test", {"float32": 1e11, "bfloat16": 1e11}, 1e10, 2**34, 2, intra=sim.Link(2e-5, 1e9), inter=sim.Link(5e-5, 1e8)
)


def _step(rank, world, model, plan, labels, layouts, dtype=torch.bfloat16):
    """One real Muon update per layout, counted, beside the simulator's cost of it on this rank."""
    params = fsdpfn.shard(model, plan)
    grads = fsdpfn.shard(_grads(model, 3), plan, check=False)
    wl = sim.Workload(())  # no compute: only the optimizer's collectives are compared
    out = {}
    for layout, buckets, blocks in layouts:
        opt = optim.muon(0.02, ns_dtype=dtype, layout=layout, buckets=buckets, labels=labels, blocks=blocks)
        state = opt.init(params)
        with fsdpfn.count_collectives() as counter, FlopCounterMode(display=False) as flops:
            opt.update(grads, state, params)
        cost_model = sim.Muon(layout=layout, ns_dtype=dtype, buckets=buckets, labels_fn=labels, blocks=blocks)
        predicted = _predicted(plan, cost_model, rank, wl)
        out[(layout, buckets, blocks is not None)] = dict(
            counted=_counted(counter),
            predicted=predicted,
            flops=(flops.get_total_flops(), cost_model.cost(plan, rank).ns_flops[rank]),
        )
    return out


def _tp_case(rank, world, mesh_shape, names):
    torch.manual_seed(0)
    model = Net()
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names), tp=TP)
    return _step(rank, world, model, plan, _label, LAYOUTS)


MESHES = [
    pytest.param((2, 2), ("dp", "tp"), id="dp2xtp2"),
    pytest.param((2, 2, 2), ("replicate", "shard", "tp"), id="rep2xshard2xtp2"),
]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_sim_muon_equals_a_real_step_on_tp_meshes(run_on_ranks, mesh_shape, names):
    results = run_on_ranks(_tp_case, math.prod(mesh_shape), mesh_shape, names)
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert r["counted"] == r["predicted"], (rank, key, r)
            counted_flops, predicted_flops = r["flops"]
            assert counted_flops == predicted_flops, (rank, key)
    # The cases are not vacuous: every layout communicates on these meshes (dp > 1).
    r0 = results[0]
    assert (
        r0[("owner", None, False)]["counted"]["all_to_all"][0] == 2
        and r0[("owner", 2, False)]["counted"]["all_to_all"][0] == 4
    )
    assert r0[("duplicated", None, False)]["counted"]["all_gather"][0] == 1
    assert r0[("blockwise", None, True)]["counted"]["all_to_all"][0] == 2
    assert r0[("owner", None, False)]["flops"][0] > 0


# ---------------------------------------------------------------------------------------------
# Expert parallelism: expert leaves are whole matrices on the rank holding them
# ---------------------------------------------------------------------------------------------

from test_moe_plan import Net as MoENet  # noqa: E402 - the two-block MoE net the plan tests train


def _moe_label(name, p):
    return "muon" if p.dim() >= 2 and "router" not in name else "adamw"


def _ep_case(rank, world, mesh_shape, names):
    torch.manual_seed(0)
    model = MoENet()
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names))
    experts = {n for n in plan.param_names if plan.param(n).expert}

    def experts_only(name, p):
        return "muon" if name in experts else "adamw"

    both = _step(
        rank, world, model, plan, _moe_label, [("owner", None, None), ("duplicated", None, None)], torch.float32
    )
    alone = _step(rank, world, model, plan, experts_only, [("owner", None, None)], torch.float32)
    return both, alone, sorted(experts)


@pytest.mark.parametrize(
    "mesh_shape,names",
    [((2, 2), ("ep", "edp")), ((2, 2), ("edp", "ep")), ((2, 2, 1), ("replicate", "ep", "edp"))],
    ids=["ep2xedp2", "edp2xep2", "hsdp2xep2"],
)
def test_sim_muon_equals_a_real_step_on_an_ep_plan(run_on_ranks, mesh_shape, names):
    for rank, (both, alone, experts) in enumerate(run_on_ranks(_ep_case, 4, mesh_shape, names)):
        assert experts, "the plan has expert leaves"
        for key, r in {**both, **{("experts", *k[1:]): v for k, v in alone.items()}}.items():
            assert r["counted"] == r["predicted"], (rank, key, r)
            assert r["flops"][0] == r["flops"][1], (rank, key)
        # Expert matrices are orthogonalised where they lie: Muon on them alone issues nothing.
        assert alone[("owner", None, False)]["counted"] == {} and alone[("owner", None, False)]["flops"][0] > 0, alone
        # The dense leaves (on the ep x edp ranks flattened) do travel.
        assert both[("owner", None, False)]["counted"]["all_to_all"][0] == 2


def test_sim_muon_costs_expert_leaves_with_no_collective():
    model = MoENet()
    plan = fsdpfn.plan(model, {"ep": 2, "edp": 2})
    experts = {n for n in plan.param_names if plan.param(n).expert}
    cost = sim.Muon(labels_fn=lambda n, p: "muon" if n in experts else "adamw").cost(plan, 1)
    assert not [p for p in cost.phases if isinstance(p, sim.CommCost)]
    # 4 experts over ep = 2, then edp = 2: every expert matrix lies whole on one rank, which
    # orthogonalises it, so the ranks together run one process's FLOPs.
    one = sum(optim.newton_schulz_flops(tuple(plan.param(n).shape)) for n in experts)
    assert sum(cost.ns_flops) == one and len(set(cost.ns_flops)) == 1


# ---------------------------------------------------------------------------------------------
# Tensor-parallel compute per rank, and the search over tp degrees
# ---------------------------------------------------------------------------------------------


def _gpt(heads=4, vocab=64):
    from fsdpfn.models import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=vocab, seq_len=16, width=32, depth=2, heads=heads))


def test_profile_under_tp_counts_each_ranks_share_of_the_split_layers():
    """A block's Linear layers (qkv 3C x C, proj C x C, fc 4C x C, out C x 4C) all split over
    tp: forward 2 N (3 + 1 + 4 + 4) C^2 FLOPs on one process, half of it on each of tp = 2
    ranks, attention (heads / tp per rank) halved too; backward twice the forward; the root
    (embedding, head, loss) is not split."""
    from fsdpfn.models import GPT_TP_PLAN
    from fsdpfn.runtime import Op

    model = _gpt()
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    n, c = x.numel(), 32
    one = sim.profile(model, fsdpfn.plan(model, (4,)), x)
    two = sim.profile(model, fsdpfn.plan(model, {"dp": 2, "tp": 2}, tp=GPT_TP_PLAN), x)
    linear = 2 * n * 12 * c * c
    fwd = Op("forward", "blocks.0")
    attention = one.at(fwd).flops - linear  # the fused attention kernel's count, whatever its formula
    assert attention > 0
    assert two.at(fwd).flops == linear / 2 + attention / 2
    assert (
        two.at(Op("backward", "blocks.0")).flops
        == 2 * two.at(fwd).flops
        == one.at(Op("backward", "blocks.0")).flops / 2
    )
    for root in (Op("forward", ""), Op("backward", "")):
        assert two.at(root).flops == one.at(root).flops
    # Activations between the colwise and rowwise layers are 1/tp wide on each rank.
    assert two.activation("blocks.0") < one.activation("blocks.0")


def test_search_over_tp_degrees_says_which_it_picked():
    from fsdpfn.models import GPT_TP_PLAN

    model = _gpt()
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    cache: dict = {}
    kw = dict(
        hardware=sim.H100_SXM, prefetch=(1,), units=[None], tp_plan=GPT_TP_PLAN, workloads=cache, optimizer=sim.Muon()
    )
    forced = sim.search(model, 4, 2**30, x, tp=(2,), **kw)
    assert forced.tp == 2 and forced.plan.tp_size == 2 and "(tp 2)" in forced.candidate.describe()
    assert {c.tp for c in forced.candidates} == {2} and {c.mesh_shape for c in forced.candidates} == {(2, 2), (2, 1, 2)}
    both = sim.search(model, 4, 2**30, x, tp=(1, 2, 4), **kw)
    assert {c.tp for c in both.candidates} == {1, 2, 4}
    assert both.tp == both.candidate.tp == both.plan.tp_size
    # A tp group reads its ranks' batches together: the same global batch as without tp.
    tp4 = [wl for key, wl in cache.items() if key[-1] == ("tp", 4)]
    assert tp4 and tp4[0].tokens == 4 * x.numel()


def test_search_names_a_tp_that_does_not_fit():
    from fsdpfn.models import GPT_TP_PLAN

    model = _gpt(heads=4)
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    kw = dict(hardware=sim.H100_SXM, tp_plan=GPT_TP_PLAN)
    with pytest.raises(ValueError, match=r"tp=8 does not divide blocks\.0\.heads = 4"):
        sim.search(model, 8, 2**30, x, tp=(1, 8), **kw)
    with pytest.raises(ValueError, match="tp=3 does not divide world=4"):
        sim.search(model, 4, 2**30, x, tp=(3,), **kw)
    with pytest.raises(ValueError, match="needs tp_plan"):
        sim.search(model, 4, 2**30, x, tp=(2,), hardware=sim.H100_SXM)
    with pytest.raises(ValueError, match="does not divide over tp"):  # a width tp does not divide, named by the plan
        sim.search(
            _gpt(vocab=66), 4, 2**30, x, tp=(1, 4), hardware=sim.H100_SXM, tp_plan={**GPT_TP_PLAN, "head": "colwise"}
        )


def test_sim_muon_names_blocks_that_do_not_divide_a_leaf():
    plan = fsdpfn.plan(Net(), {"dp": 2, "tp": 2}, tp=TP)
    with pytest.raises(ValueError, match=r"'qkv.weight' of shape \(12, 4\) cannot be cut into 5 x 1 blocks"):
        sim.Muon(blocks={"qkv.weight": 5}, labels_fn=_label).cost(plan)
    with pytest.raises(
        ValueError, match="cut across its 2 tensor-parallel pieces"
    ):  # blockwise: 3 row blocks over tp = 2
        sim.Muon(layout="blockwise", blocks={"qkv.weight": 3}, labels_fn=_label).cost(plan)
