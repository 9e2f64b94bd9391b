"""The simulator on pipelined plans: pipeline_times with priced stages, hops and FSDP time, and
sim.simulate_pipeline's accounting against the profile it prices (no process group: meta models)."""

import dataclasses

import pytest
import torch

import fsdpfn
from fsdpfn import sim
from fsdpfn._plan.schedule import OpKind, ScheduleError
from fsdpfn._plan.steps import step_ops
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig

CFG = GPTConfig(vocab_size=512, seq_len=128, width=128, depth=4, heads=4)
UNITS = ["embed", "pos"] + [f"blocks.{i}" for i in range(CFG.depth)] + ["norm", "head"]
BATCH = 2


def _stages(p, v=1):
    return fsdpfn.Stages(tuple((f"u{s}",) for s in range(p * v)), p)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_hops_lie_on_the_critical_path_as_the_closed_form_says(name):
    p, m, f, b, t = 4, 8, 1.0, 2.0, 0.25
    ps = fsdpfn.pipeline_schedule(_stages(p), name, m)
    got = fsdpfn.pipeline_times(ps, f, b, transfer=t).makespan
    if name == "gpipe":
        # forwards reach the last stage after p - 1 hops, gradients come back over p - 1
        assert got == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * t, rel=1e-12)
    else:  # 1F1B: each steady-state round trip also waits on a hop each way
        assert got > (m + p - 1) * (f + b) + 2 * (p - 1) * t - 1e-12
    assert fsdpfn.pipeline_times(ps, f, b).makespan == (m + p - 1) * (f + b)


def test_per_stage_costs_start_and_after():
    p, m = 4, 8
    ps = fsdpfn.pipeline_schedule(_stages(p), "gpipe", m)
    f = [1.0, 1.0, 3.0, 1.0]  # one slow stage sets the pace: (m - 1) of its forwards on the path
    t = fsdpfn.pipeline_times(ps, f, [2 * x for x in f])
    assert t.makespan == pytest.approx(sum(f) + (m - 1) * 3.0 + 2 * sum(f) + (m - 1) * 6.0, rel=1e-12)
    assert t.busy == tuple(3.0 * m * x for x in f)
    base = fsdpfn.pipeline_times(ps)
    late = fsdpfn.pipeline_times(ps, start=[0.5, 0, 0, 0], after=[0, 0, 0, 0.25])
    assert late.makespan == pytest.approx(base.makespan + 0.5, rel=1e-12)  # rank 0 starts the chain, rank 0 ends it
    assert late.finish[3] == pytest.approx(base.finish[3] + 0.5 + 0.25, rel=1e-12)


def test_peak_activation_bytes_follow_the_micro_batches_in_flight():
    p, m = 4, 8
    acts = [10, 20, 30, 40]
    t = fsdpfn.pipeline_times(fsdpfn.pipeline_schedule(_stages(p), "1f1b", m), activations=acts)
    assert t.peak_activations == tuple((p - r) * acts[r] for r in range(p))
    g = fsdpfn.pipeline_times(fsdpfn.pipeline_schedule(_stages(p), "gpipe", m), activations=acts)
    assert g.peak_activations == tuple(m * a for a in acts)


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"forward": [1.0, 2.0]}, "forward needs one number >= 0 per stage (4)"),
        ({"transfer": [0.1] * 4}, "per boundary between stages (3)"),
        ({"start": -1.0}, "start must be >= 0"),
        ({"after": [0, 0, 0]}, "per pp rank (4)"),
    ],
)
def test_bad_costs_are_named(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        fsdpfn.pipeline_times(fsdpfn.pipeline_schedule(_stages(4), "1f1b", 8), **kw)


@pytest.fixture(scope="module")
def meta_gpt():
    with torch.device("meta"):
        model = GPT(CFG)
    x = torch.zeros(BATCH, CFG.seq_len, dtype=torch.long, device="meta")
    return model, x


def _run(model, x, mesh, name="1f1b", m=8, stages=None, tp=None):
    plan = fsdpfn.pipeline_plan(model, mesh, units=UNITS, stages=stages, tp=tp)
    wl = sim.profile(model, plan, x)
    ps = fsdpfn.pipeline_schedule(plan, name, m)
    return plan, wl, ps, sim.simulate_pipeline(plan, ps, wl, sim.AdamW(), sim.H100_SXM)


@pytest.mark.parametrize("stages", [None, 4])
def test_stages_price_the_whole_profile_once(meta_gpt, stages):
    """Every event's work is priced in exactly one stage: the stages' forward and backward sum to
    the profile's total (no tp or cp: no activation collectives). Each term is the same float
    sum in another order: 1e-12 relative."""
    model, x = meta_gpt
    plan, wl, ps, r = _run(
        model, x, {"pp": 2, "dp": 4}, "1f1b" if stages is None else "interleaved_1f1b", stages=stages
    )
    hw = sim.H100_SXM
    total = sum(w.seconds(hw) for _, w in wl.work)
    assert sum(r.forward) + sum(r.backward) == pytest.approx(total, rel=1e-12)
    fwd = sum(w.seconds(hw) for e, w in wl.work if e.kind in (OpKind.FORWARD, OpKind.FORWARD_DONE))
    assert sum(r.forward) == pytest.approx(fwd, rel=1e-12)
    # the hop carries the next stage's first unit's input: one hidden state per micro-batch, float32
    first = [plan.stages.units[s + 1][0] for s in range(plan.stages.num_stages - 1)]
    assert r.p2p_bytes == tuple(BATCH * CFG.seq_len * CFG.width * 4 for _ in first)
    assert all(h > 0 for h in r.transfer)  # pp ranks 0 and 1 sit 4 ranks apart: a real hop
    # the result is pipeline_times of its own prices, and the optimizer after the last reduce
    t = fsdpfn.pipeline_times(
        ps,
        r.forward,
        r.backward,
        transfer=r.transfer,
        start=r.gather,
        after=r.reduce,
        accumulate=r.accumulate,
        activations=[sum(b for u, b in wl.activations if u in names) for names in plan.stages.units],
        plan=plan,
    )
    assert t == r.times
    assert r.step_time == max(f + o for f, o in zip(t.finish, r.optimizer))
    assert r.tokens == BATCH * CFG.seq_len * 8 * plan.dp_size
    assert r.tokens_per_second == pytest.approx(r.tokens / r.step_time / plan.world_size, rel=1e-12)


def test_memory_per_rank_is_its_stages(meta_gpt):
    model, x = meta_gpt
    plan, wl, ps, r = _run(model, x, {"pp": 2, "dp": 4})
    acts = dict(wl.activations)
    for rank in range(2):
        units = plan.stages.units[rank]
        m = r.memory[rank]
        assert m["activations"] == (2 - rank) * sum(acts.get(u, 0) for u in units)  # 1F1B: p - r in flight
        sp = plan.stage_plan(rank)
        assert (m["params"], m["grads"]) == (sp.cost().memory["params"], sp.cost().memory["grads"])
        assert (
            m["peak"]
            == m["params"] + m["grads"] + m["optimizer_state"] + m["unsharded"] + m["accumulated"] + m["activations"]
        )


def test_tp_collectives_add_to_the_stages_compute(meta_gpt):
    """A stage's forward is its units' compute plus its tp all-reduces from the stage plan's op
    list, over the tp group of global rank 0 (ranks 0 and 1: tp is the mesh's last axis)."""
    model, x = meta_gpt
    hw = sim.H100_SXM
    plan, wl, _, r = _run(model, x, {"pp": 2, "dp": 2, "tp": 2}, tp=GPT_TP_PLAN)
    stage0 = set(plan.stages.units[0])
    compute = sum(
        w.seconds(hw)
        for e, w in wl.work
        if e.kind in (OpKind.FORWARD, OpKind.FORWARD_DONE)
        and (e.unit in stage0 or e.unit == "" and e.kind is OpKind.FORWARD)
    )
    calls = [
        c
        for c in fsdpfn.step_collectives(plan.stage_plan(0), tokens=wl.tokens)
        if c.activation and c.phase == "forward"
    ]
    assert calls and {c.purpose for c in calls} <= {"tp_reduce", "tp_copy", "tp_gather"}
    comm = sum(hw.collective_seconds(c.kind, [0, 1], c.nbytes) for c in calls)
    assert r.forward[0] == pytest.approx(compute + comm, rel=1e-12)


def test_bad_arguments_are_named(meta_gpt):
    model, x = meta_gpt
    flat = fsdpfn.plan(model, {"dp": 8}, units=UNITS)
    plan, wl, ps, _ = _run(model, x, {"pp": 2, "dp": 4})
    with pytest.raises(ValueError, match="needs a pipelined plan"):
        sim.simulate_pipeline(flat, ps, wl, None, sim.H100_SXM)
    with pytest.raises(TypeError, match="needs a fsdpfn.PipelineSchedule"):
        sim.simulate_pipeline(plan, fsdpfn.runtime.schedule(flat), wl, None, sim.H100_SXM)
    other = fsdpfn.pipeline_plan(
        model,
        {"pp": 2, "dp": 4},
        units=UNITS,
        stages=[["embed", "pos", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "norm", "head"]],
    )
    with pytest.raises(ScheduleError, match="was made for plan"):
        sim.simulate_pipeline(other, ps, wl, None, sim.H100_SXM)
    coarse = sim.profile(
        model, fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 4}, units=["embed", "pos", "blocks", "norm", "head"]), x
    )
    with pytest.raises(
        ValueError, match=r"no work for units \['blocks.0'"
    ):  # another plan's profile: named, not priced low
        sim.simulate_pipeline(plan, ps, coarse, None, sim.H100_SXM)
    with pytest.raises(ValueError, match="global rank"):
        sim.simulate_pipeline(plan, ps, wl, None, sim.H100_SXM, rank=8)


def test_pipeline_units_are_the_top_modules_and_each_block(meta_gpt):
    model, _ = meta_gpt
    assert sim.pipeline_units(model) == UNITS


def test_search_considers_pp_degrees_and_schedules(meta_gpt):
    model, x = meta_gpt
    res = sim.search(
        model,
        8,
        2**34,
        x,
        hardware=sim.H100_SXM,
        optimizer=sim.AdamW(),
        prefetch=(1,),
        units=[None],
        strategies=("zero3", "zero2"),
        pp=(1, 2, 4),
        pp_schedules=("1f1b", "interleaved_1f1b"),
        micro_batches=2,
    )
    tried = {(c.pp, c.pipeline) for c in res.candidates}
    assert tried == {(1, ""), (2, "1f1b"), (2, "interleaved_1f1b"), (4, "1f1b"), (4, "interleaved_1f1b")}
    for c in res.candidates:
        if c.pp > 1:  # P times the micro-batches of a pipeline: the same global batch on W / (P dp) pipelines
            assert c.mesh_shape[0] == c.pp and c.pipeline in c.describe()
    # the best pipelined candidate, simulated by hand from its own plan and schedule, predicts the same
    best = min((c for c in res.candidates if c.pp == 2), key=lambda c: c.step_time)
    stages = 4 if best.pipeline == "interleaved_1f1b" else 2
    dp = {"dp": 4} if len(best.mesh_shape) == 2 else dict(zip(("replicate", "shard"), best.mesh_shape[1:]))
    plan = fsdpfn.pipeline_plan(
        model, {"pp": 2, **dp}, units=UNITS, stages=stages, strategy={"*": "zero3", **dict(best.strategy)}
    )
    wl = sim.profile(model, plan, x)
    r = sim.simulate_pipeline(plan, fsdpfn.pipeline_schedule(plan, best.pipeline, 2 * 2), wl, sim.AdamW(), sim.H100_SXM)
    assert r.step_time == pytest.approx(best.step_time, rel=1e-12)
    assert res.pp == res.candidate.pp


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"pp": (3,)}, "pp=3 does not divide world=8"),
        ({"pp": (2,), "pp_schedules": ("zb",)}, "pp_schedules must be some of"),
        ({"pp": (8,), "pp_schedules": ("interleaved_1f1b",)}, "needs 16 stages, but GPT has 8 pipeline units"),
        ({"pp": (2,), "cp": (2,)}, "does not combine a pp axis with an ep or cp axis"),
    ],
)
def test_search_names_bad_pp_arguments_before_profiling(meta_gpt, kw, says):
    model, x = meta_gpt
    with pytest.raises(ValueError, match=says):
        sim.search(model, 8, 2**34, x, hardware=sim.H100_SXM, **kw)


def test_zero_bubble_prices_the_backward_halves(meta_gpt):
    """A split backward: half the stage's backward compute each, its activation collectives
    (tp) with the input half; the schedule priced from those halves idles less than 1F1B and
    keeps 1F1B's rank 0 activations on every rank."""
    model, x = meta_gpt
    plan, wl, ps, r = _run(model, x, {"pp": 2, "dp": 2, "tp": 2}, "zero_bubble", tp=GPT_TP_PLAN)
    _, _, _, one = _run(model, x, {"pp": 2, "dp": 2, "tp": 2}, "1f1b", tp=GPT_TP_PLAN)
    for s in range(2):
        assert r.backward_input[s] + r.backward_weight[s] == pytest.approx(r.backward[s], rel=1e-12)
        assert r.backward_input[s] > r.backward_weight[s]  # the tp collectives carry activation gradients
    t = fsdpfn.pipeline_times(
        ps,
        r.forward,
        r.backward,
        transfer=r.transfer,
        start=r.gather,
        after=r.reduce,
        plan=plan,
        backward_input=r.backward_input,
        backward_weight=r.backward_weight,
        accumulate=r.accumulate,
        activations=[sum(b for u, b in wl.activations if u in names) for names in plan.stages.units],
    )
    assert t == r.times
    assert r.times.bubble < one.times.bubble and r.step_time < one.step_time
    acts = [sum(b for u, b in wl.activations if u in names) for names in plan.stages.units]
    assert [m["activations"] for m in r.memory] == [2 * a for a in acts]  # p = 2 in flight on every rank
    assert [m["activations"] for m in one.memory] == [2 * acts[0], acts[1]]  # 1F1B: p - r


def test_search_accepts_zero_bubble(meta_gpt):
    model, x = meta_gpt
    res = sim.search(
        model,
        8,
        2**34,
        x,
        hardware=sim.H100_SXM,
        optimizer=sim.AdamW(),
        prefetch=(1,),
        units=[None],
        strategies=("zero3",),
        pp=(2,),
        pp_schedules=("1f1b", "zero_bubble"),
        micro_batches=2,
    )
    by = {c.pipeline: c for c in res.candidates if c.pp == 2}
    assert set(by) == {"1f1b", "zero_bubble"}
    assert by["zero_bubble"].step_time < by["1f1b"].step_time


def test_a_pp_rank_above_the_parts_memory_says_so(meta_gpt):
    """Each pp rank's reserved bytes (its peak with the allocator's reserve) against the part: the
    ranks above it, and only those, get a note naming the rank."""
    import dataclasses

    model, x = meta_gpt
    plan, wl, ps, r = _run(model, x, {"pp": 2, "dp": 4})
    assert not [n for n in r.notes if n.startswith("memory")]
    reserved = [int(m["peak"] * (1.0 + sim.H100_SXM.memory_reserve)) for m in r.memory]
    assert reserved[0] != reserved[1]
    small = dataclasses.replace(sim.H100_SXM, memory=min(reserved))
    over = sim.simulate_pipeline(plan, ps, wl, sim.AdamW(), small)
    said = [n for n in over.notes if n.startswith("memory")]
    high = reserved.index(max(reserved))
    assert len(said) == 1 and said[0].startswith(f"memory on pp rank {high}: "), said
    assert over.step_time == r.step_time


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_each_micro_batch_after_the_first_adds_its_gradients_as_the_one_stage_simulator_does(meta_gpt, name):
    """The pipeline runtime keeps a stage's full gradients over the step's micro-batches and adds
    each later micro-batch's to them (in the reduce dtype) before the one reduce: m - 1 additions
    per stage, each priced as the one-stage simulator prices an ``accumulate`` of the same units
    (read from its timeline), and the kept sum's bytes in each rank's memory. Sums of the same
    float terms in another order: 1e-12 relative."""
    model, x = meta_gpt
    # Overlap 1: the one-stage timeline's compute spans are their own seconds, with no slow-down
    # beside a collective (which the pipelined model leaves out).
    m, hw = 8, dataclasses.replace(sim.H100_SXM, overlap=1.0)
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 4}, units=UNITS)
    ps = fsdpfn.pipeline_schedule(plan, name, m)
    r = sim.simulate_pipeline(plan, ps, sim.profile(model, plan, x), sim.AdamW(), hw)
    flat = fsdpfn.plan(model, {"dp": 4}, units=UNITS)  # the same units, sharded over the same 4 ranks
    flat_wl = sim.profile(model, flat, x)
    sched = fsdpfn.runtime.schedule(flat)
    ops = step_ops(flat, sched, micro_batches=2, accumulate="local", tokens=flat_wl.tokens, attention=flat_wl.attention)
    one = sim.simulate(flat, sched, flat_wl, None, hw, micro_batches=2, accumulate="local")
    added = {}
    for span in one.spans:
        # The first of 2 micro-batches accumulates (the second reduces): its ops are the list's head.
        if (
            span.micro_batch == 0
            and span.op >= 0
            and ops[span.op].op.kind is OpKind.ACCUMULATE
            and span.stream == "compute"
        ):
            added[span.unit] = added.get(span.unit, 0.0) + span.end - span.start
    assert set(UNITS) <= set(added)
    params = dict(model.named_parameters())
    for rank, units in enumerate(plan.stages.units):
        stage = sum(added[u] for u in units)
        assert r.accumulate[rank] == pytest.approx(stage, rel=1e-12)
        halves = r.backward[rank] if name == "1f1b" else r.backward_input[rank] + r.backward_weight[rank]
        assert r.times.busy[rank] == pytest.approx(m * (r.forward[rank] + halves) + (m - 1) * stage, rel=1e-12)
        kept = sum(
            p.numel() * 4 for n, p in params.items() if any(n.startswith(u + ".") for u in units)
        )  # float32, whole
        assert r.memory[rank]["accumulated"] == kept > 0
    single = sim.simulate_pipeline(
        plan, fsdpfn.pipeline_schedule(plan, name, 1), sim.profile(model, plan, x), sim.AdamW(), hw
    )
    assert all(mem["accumulated"] == 0 for mem in single.memory)
    assert single.times.busy == tuple(f + b for f, b in zip(single.forward, single.backward))
