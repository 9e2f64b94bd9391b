"""sim.search over expert-parallel degrees: for a model with experts, ``ep=(1, 2, 4)`` searches
the data-parallel candidates of every degree (mesh ``(ep, edp)`` and its HSDP shapes), says
which degree won, and its prediction is the simulator's for that plan built by hand. Bad
degrees are named before anything is profiled."""

import pytest
import torch

import fsdpfn
from fsdpfn import sim
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import schedule

# A CPU-like machine (gloo-speed links), as the other search tests use: slow enough links that
# the expert weights' gathers and reductions cost more than the tokens' all-to-alls.
HW = sim.Hardware(
    "cpu-like",
    {"float32": 1e11, "bfloat16": 1e11, "attention float32": 2e10, "attention bfloat16": 2e10},
    1e10,
    2**34,
    2,
    intra=sim.Link(2e-5, 1e9),
    inter=sim.Link(5e-5, 1e8),
    overlap=0.5,
    op_overhead=1e-6,
)
CFG = GPTConfig(vocab_size=64, seq_len=16, width=32, depth=2, heads=4, experts=4, top_k=2)
_WORKLOADS: dict = {}


def _model(device="cpu", **kw):
    # A real model: MoE routing needs the tokens (bincount has no meta kernel), so profiling
    # runs one forward and backward of this small one.
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(**{**CFG.__dict__, **kw}))


def _loss(out):
    logits, aux = out
    return logits.float().mean() + aux


def _x(device="cpu"):
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1)).to(device)


def _search(model, ep, **kw):
    return sim.search(
        model,
        4,
        2**30,
        _x(),
        hardware=HW,
        optimizer=sim.AdamW(),
        loss_fn=_loss,
        units=[None],
        prefetch=(1,),
        workloads=_WORKLOADS,
        ep=ep,
        **kw,
    )


def test_search_over_ep_degrees_picks_one_and_predicts_its_plan():
    model = _model()
    res = _search(model, (1, 2, 4))
    assert {c.ep for c in res.candidates} == {1, 2, 4}
    assert res.ep in (1, 2, 4) and res.ep == res.candidate.ep
    # Each degree's meshes: (ep, edp) and the HSDP (replicate, ep, edp) of the W/E others.
    assert {c.mesh_shape for c in res.candidates if c.ep == 2} == {(2, 2), (2, 2, 1)}
    assert {c.mesh_shape for c in res.candidates if c.ep == 4} == {(4, 1)}
    # The pick is the fastest fitting candidate (up to rel_tol, the default winning ties).
    fastest = min(c.step_time for c in res.candidates if c.fits)
    assert res.result.step_time <= fastest * (1 + 1e-3)
    # On these slow links an ep plan wins: the expert weights move over edp only (1/E of them).
    assert res.ep > 1, str(res)
    assert f"(ep {res.ep})" in res.candidate.describe() and f"(ep {res.ep})" in str(res)

    # The same plan built by hand, profiled and simulated, predicts the same step: the search
    # adds nothing of its own to the prediction.
    c = res.candidate
    shape = c.mesh_shape
    mesh = (
        {"ep": shape[0], "edp": shape[1]}
        if len(shape) == 2
        else {"replicate": shape[0], "ep": shape[1], "edp": shape[2]}
    )
    plan = fsdpfn.plan(model, mesh, strategy={(u or "<root>"): s for u, s in c.strategy})
    assert plan == res.plan and plan.axes.dim(fsdpfn.Role.EP) is not None
    sched = schedule(plan, prefetch=c.prefetch)
    work = sim.profile(model, plan, _x(), loss_fn=_loss)
    by_hand = sim.simulate(plan, sched, work, sim.AdamW(), HW)
    assert by_hand.step_time == c.step_time == res.result.step_time
    assert by_hand.memory["peak"] == c.peak
    assert by_hand.traffic["step"]["all_to_all"].calls > 0


def test_search_with_one_ep_degree_stays_on_it():
    res = _search(_model(), (2,))
    assert res.ep == 2 and {c.ep for c in res.candidates} == {2}
    assert (
        res.plan.axes.dim(fsdpfn.Role.EP) is not None
        and res.plan.mesh_shape[-2 if len(res.plan.mesh_shape) == 3 else 0] == 2
    )
    # mesh_shapes beside an ep degree: the (edp,) or (replicate, edp) shapes of the W/E others.
    narrowed = _search(_model(), (2,), mesh_shapes=[(2,)])
    assert {c.mesh_shape for c in narrowed.candidates} == {(2, 2)}
    # Without ep=..., no ep axis is tried: the default search is unchanged for models with experts.
    plain = _search(_model(), (1,))
    assert plain.ep == 1 and {c.ep for c in plain.candidates} == {1}
    assert all(not u.experts for u in plain.plan.units)


def test_search_names_bad_ep_degrees_before_profiling():
    # A meta model: MoE routing cannot run on meta tensors, so each error below comes before
    # anything is profiled.
    model = _model("meta")
    x = _x("meta")
    kw = dict(hardware=HW, loss_fn=_loss)
    with pytest.raises(ValueError, match="ep=3 does not divide world=4"):
        sim.search(model, 4, 2**30, x, ep=(1, 3), **kw)
    with pytest.raises(ValueError, match=r"ep=8 does not divide blocks\.0\.moe\.experts\.num_experts = 4"):
        sim.search(model, 8, 2**30, x, ep=(1, 8), **kw)
    with pytest.raises(ValueError, match=r"ep=\(1, 2\), but GPT has no expert layers"):
        sim.search(_model("meta", experts=0), 4, 2**30, x, ep=(1, 2), **kw)
    with pytest.raises(ValueError, match=r"ep=\(2,\) with tp=\(1, 2\).*not both"):
        sim.search(model, 4, 2**30, x, ep=(2,), tp=(1, 2), tp_plan=GPT_TP_PLAN, **kw)
    with pytest.raises(ValueError, match="ep must be expert-parallel degrees >= 1"):
        sim.search(model, 4, 2**30, x, ep=(0, 2), **kw)
    with pytest.raises(ValueError, match="needs world as a number of ranks"):
        sim.search(model, (2, 2), 2**30, x, ep=(2,), **kw)
