"""sim.search over context-parallel degrees for long sequences: ``cp=(1, 2, 4)`` searches the
data-parallel candidates of every degree (mesh ``(dp, cp)`` and its HSDP shapes) at ``cp``
times the micro-batches of ``S/cp`` tokens a sequence, so every candidate trains the same global
batch; a budget that one rank's whole sequences exceed picks a cp plan, whose prediction is the
simulator's for that plan built by hand. Bad degrees are named before anything is profiled."""

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import sim
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import schedule

SEQ = 8192
CFG = GPTConfig(vocab_size=256, seq_len=SEQ, width=256, depth=2, heads=4, bias=False)
KW = dict(hardware=sim.H100_SXM, prefetch=(1,), units=[None], strategies=("zero3",))


def _model():
    with torch.device("meta"):
        return GPT(CFG)


def _x(seq=SEQ):
    return torch.zeros(1, seq, dtype=torch.long, device="meta")


def _loss(out):
    return F.cross_entropy(
        out.flatten(0, 1).float(), torch.zeros(out.shape[0] * out.shape[1], dtype=torch.long, device="meta")
    )


def test_a_budget_one_ranks_sequences_exceed_picks_a_cp_plan_and_predicts_it():
    model = _model()
    whole = sim.search(model, 4, 2**40, _x(), loss_fn=_loss, **KW)  # cp = 1 only: the default search
    assert whole.cp == 1 and {c.cp for c in whole.candidates} == {1}
    smallest = min(c.peak for c in whole.candidates)
    res = sim.search(model, 4, 0.9 * smallest, _x(), loss_fn=_loss, cp=(1, 2, 4), **KW)
    assert {c.cp for c in res.candidates} == {1, 2, 4}
    assert {c.mesh_shape for c in res.candidates if c.cp == 2} == {(2, 2), (2, 1, 2)}
    assert {c.mesh_shape for c in res.candidates if c.cp == 4} == {(1, 4)}
    # Memory falls with cp (a micro-batch holds 1/cp of each sequence); no cp = 1 plan fits.
    peak = {c.cp: min(x.peak for x in res.candidates if x.cp == c.cp) for c in res.candidates}
    assert peak[4] < peak[2] < peak[1] == smallest
    assert res.cp > 1 and res.candidate.fits and res.plan.cp_size == res.cp
    assert f"(cp {res.cp}, {res.cp}x the micro-batches)" in str(res)
    fastest = min(c.step_time for c in res.candidates if c.fits)
    assert res.result.step_time <= fastest * (1 + 1e-3)

    # The same plan built by hand, profiled on one cp rank's part and simulated at cp x the
    # micro-batches, predicts the same step, attention's exchange over cp included.
    c = res.candidate
    mesh = (
        {"dp": c.mesh_shape[0], "cp": c.cp}
        if len(c.mesh_shape) == 2
        else {"replicate": c.mesh_shape[0], "shard": c.mesh_shape[1], "cp": c.cp}
    )
    plan = fsdpfn.plan(model, mesh, strategy={(u or "<root>"): s for u, s in c.strategy})
    assert plan == res.plan
    work = sim.profile(model, plan, _x(SEQ // c.cp), loss_fn=_loss)
    by_hand = sim.simulate(plan, schedule(plan, prefetch=c.prefetch), work, None, sim.H100_SXM, micro_batches=c.cp)
    assert by_hand.step_time == c.step_time and by_hand.memory["peak"] == c.peak
    gathers = [x for x in by_hand.calls if x.purpose == "cp_gather"]
    # two per block per micro-batch: forward, and again in backward (attention keeps only its own keys)
    assert len(gathers) == 2 * CFG.depth * c.cp
    # each: cp ranks' keys and values, 2 x (SEQ / cp) tokens x width x 4 B
    assert {x.nbytes for x in gathers} == {c.cp * 2 * (SEQ // c.cp) * CFG.width * 4}


def test_search_names_bad_cp_degrees_before_profiling():
    model, x = _model(), _x()
    kw = dict(hardware=sim.H100_SXM, loss_fn=_loss)
    with pytest.raises(ValueError, match="cp=3 does not divide world=4"):
        sim.search(model, 4, 2**30, x, cp=(1, 3), **kw)
    with pytest.raises(ValueError, match="divisible by 2 x cp = 8, got 12"):
        sim.search(model, 4, 2**30, _x(12), cp=(1, 4), **kw)
    with pytest.raises(ValueError, match="does not combine a cp axis with a tp or ep axis"):
        sim.search(model, 4, 2**30, x, cp=(2,), tp=(1, 2), tp_plan=GPT_TP_PLAN, **kw)
    with pytest.raises(ValueError, match="cp must be context-parallel degrees >= 1"):
        sim.search(model, 4, 2**30, x, cp=(0, 2), **kw)
    with pytest.raises(ValueError, match="cp_strategy must be"):
        sim.search(model, 4, 2**30, x, cp=(2,), cp_strategy="zigzag", **kw)
    with pytest.raises(ValueError, match="needs world as a number of ranks"):
        sim.search(model, (2, 2), 2**30, x, cp=(2,), **kw)
    with pytest.raises(ValueError, match=r"selective remat policies \('save_dots',\)"):
        sim.search(model, 4, 2**30, x, cp=(1, 2), remat=("none", "save_dots"), **kw)
    # On the op list itself, a selective policy beside cp is "not yet", named with the unit.
    plan = fsdpfn.plan(model, {"dp": 2, "cp": 2}, remat="save_dots")
    with pytest.raises(NotImplementedError, match="unit 'blocks.0' recomputes with the selective policy 'save_dots'"):
        plan.cost(tokens=SEQ // 2, attention=[fsdpfn.AttentionCall("blocks.0", CFG.width)])
    plain = fsdpfn.plan(model, {"dp": 2, "cp": 2})
    with pytest.raises(ValueError, match="attention call of unit 'blocks.9': the plan has no such unit"):
        plain.cost(tokens=SEQ // 2, attention=[fsdpfn.AttentionCall("blocks.9", CFG.width)])
    with pytest.raises(ValueError, match="strategy 'zigzag' is not one of"):
        fsdpfn.AttentionCall("blocks.0", CFG.width, strategy="zigzag")
