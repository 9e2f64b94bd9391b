"""fsdpfn.sim: the simulator's bytes and memory equal plan.cost() and a real step's counters, its
timeline obeys the schedule's dependencies (random valid schedules), the search never returns a
plan over its budget, and abstract plans for 1,024 ranks build in seconds."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, runtime, sim, testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import OpKind

# Uneven on purpose: 37 vocabulary rows and width 20 split unevenly over 3 and 4 ranks.
CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=3, heads=2)
HW = sim.Hardware(
    "test",
    {"float32": 1e11, "bfloat16": 1e11, "attention float32": 2e10, "attention bfloat16": 2e10},
    1e10,
    2**34,
    2,
    intra=sim.Link(2e-5, 1e9),
    inter=sim.Link(5e-5, 1e8),
    overlap=0.5,
    op_overhead=1e-6,
)
STRATEGIES = ["zero3", "zero2", "zero1", "replicate", {"*": "zero3", "<root>": "zero2", "blocks.1": "replicate"}]


def _model(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(CFG)


def _batch(rank=0, device="cpu"):
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(y):
    return lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


_WORKLOADS: dict = {}


def _workload(plan):
    key = tuple(u.name for u in plan.units)
    if key not in _WORKLOADS:
        x, y = _batch(device="meta")
        _WORKLOADS[key] = sim.profile(_model("meta"), plan, x, loss_fn=_loss(y))
    return _WORKLOADS[key]


# ---------------------------------------------------------------------------------------------
# Bytes and memory: plan.cost() and the runtime's own counters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (3,), (4,), (2, 2), (2, 3)])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=["zero3", "zero2", "zero1", "replicate", "mixed"])
def test_bytes_and_static_memory_equal_plan_cost(shape, strategy):
    plan = fsdpfn.plan(_model("meta"), shape, strategy=strategy)
    wl = _workload(plan)
    for prefetch in (0, 1, 2):
        for raf in (None, True, False):
            r = sim.simulate(plan, runtime.schedule(plan, prefetch, raf), wl, sim.AdamW(), HW)
            cost = plan.cost(raf, prefetch)
            assert set(r.traffic["step"]) == set(cost.collectives)
            for kind, c in cost.collectives.items():
                t = r.traffic["step"][kind]
                assert (t.calls, t.nbytes) == (c.calls, c.nbytes), (kind, prefetch, raf)
                # Python floats (float64, the same on every CPU): a few products and sums each side,
                # a few 2^-53 apart; 1e-12 is far above that and far below a wrong byte count.
                assert t.wire_bytes == pytest.approx(c.wire_bytes, rel=1e-12)
            assert r.memory["params"] == cost.memory["params"]
            assert r.memory["grads"] == cost.memory["grads"]
            assert r.memory["optimizer_state"] == 2 * cost.memory["optimizer_state_per_slot"]
            if raf is not True:  # see test_unsharded_bound_with_the_root_resharded
                assert r.memory["unsharded_peak"] <= cost.memory["unsharded_peak"]


def _unsharded_walk(plan, sched) -> int:
    """The runtime's MemoryTracker rule, restated: a unit counts from its gather to its free."""
    live, peak = {}, 0
    for op in sched.ops:
        if op.kind is OpKind.GATHER:
            u = plan.unit(op.unit)
            live[op.unit] = u.numel * plan.gather_dtype(u).itemsize
            peak = max(peak, sum(live.values()))
        elif op.kind is OpKind.FREE:
            live.pop(op.unit, None)
    return peak


def _real_step(rank, world, shape, strategy, prefetch, opt_name, extra=""):
    """One runtime step and one optimizer update, counted, beside the simulator's prediction.
    ``extra``: ``"tp"`` (a ("dp", "tp") mesh with GPT_TP_PLAN) or ``"fp8"`` (tensorwise FP8 gathers)."""
    model = _model()
    names = ("dp", "tp") if extra == "tp" else ("replicate", "shard") if len(shape) == 2 else None
    mesh = testing.mesh(shape, names) if names else testing.mesh(shape)
    mp = fsdpfn.MixedPrecision(torch.bfloat16, torch.float32, fp8="tensorwise") if extra == "fp8" else None
    plan = fsdpfn.plan(model, mesh, strategy=strategy, mp=mp, tp=GPT_TP_PLAN if extra == "tp" else None)
    rt = runtime.Runtime(model, plan, prefetch=prefetch)
    params = fsdpfn.shard(model, plan)
    if opt_name == "adamw":
        opt, opt_model = optim.adamw(1e-3), sim.AdamW()
    else:
        layout, *buckets = opt_name.split(":")[1:]
        buckets = int(buckets[0]) if buckets else None
        opt = optim.muon(0.02, layout=layout, ns_dtype=torch.float32, buckets=buckets)
        opt_model = sim.Muon(layout=layout, ns_dtype=torch.float32, buckets=buckets)
    state = opt.init(params)
    x, y = _batch(fsdpfn.transforms.dp_rank(plan))

    def loss_fn(ps, x, y):
        return F.cross_entropy(rt.apply(ps, x).flatten(0, 1), y.flatten())

    rt.memory.reset()
    with fsdpfn.comm.count_collectives() as c1:
        grads, _ = rt.value_and_grad(loss_fn)(params, x, y)
    with fsdpfn.comm.count_collectives() as c2, FlopCounterMode(display=False) as flops:
        opt.update(grads, state, params)
    r = sim.simulate(plan, rt.schedule, _workload(plan), opt_model, HW, rank=rank)

    def counted(c):
        return {k: (c.counts()[k], c.nbytes()[k], round(c.wire_bytes()[k], 3)) for k in c.counts()}

    def predicted(part):
        return {k: (t.calls, t.nbytes, round(t.wire_bytes, 3)) for k, t in r.traffic[part].items()}

    ns = opt_model.cost(plan, rank).ns_flops
    if extra == "tp":  # every tp rank reads its data-parallel rank's batch: the same tokens as profiled
        assert _workload(plan).tokens == x.numel()
    return dict(
        step=(counted(c1), predicted("step")),
        optimizer=(counted(c2), predicted("optimizer")),
        high_water=(rt.memory.high_water, r.memory["unsharded_peak"], _unsharded_walk(plan, rt.schedule)),
        ns_flops=(flops.get_total_flops(), ns[rank] if ns else 0),
    )


@pytest.mark.parametrize(
    "world, shape, strategy, prefetch, opt, extra",
    [
        (2, (2,), "zero3", 1, "muon:owner", ""),
        (3, (3,), "zero2", 0, "muon:gather", ""),
        (3, (3,), STRATEGIES[4], 2, "muon:owner", ""),
        (4, (2, 2), "zero3", 2, "muon:owner", ""),
        (4, (4,), "replicate", 1, "adamw", ""),
        (3, (3,), "zero3", 1, "muon:owner:3", ""),
        (4, (4,), "zero2", 1, "muon:owner:4", ""),
        (4, (2, 2), "zero3", 1, "adamw", "tp"),
        (2, (2,), "zero3", 1, "adamw", "fp8"),
    ],
    ids=[
        "w2-zero3-owner",
        "w3-zero2-gather",
        "w3-mixed-owner",
        "w4-hsdp-owner",
        "w4-replicate-adamw",
        "w3-zero3-owner-3-buckets",
        "w4-zero2-owner-4-buckets",
        "w4-dp2-tp2-adamw",
        "w2-fp8-tensorwise-adamw",
    ],
)
def test_bytes_flops_and_high_water_equal_the_runtime(run_on_ranks, world, shape, strategy, prefetch, opt, extra):
    for rank, res in enumerate(run_on_ranks(_real_step, world, shape, strategy, prefetch, opt, extra)):
        for part in ("step", "optimizer"):
            counted, predicted = res[part]
            assert counted == predicted, (rank, part)
        measured, predicted, walked = res["high_water"]
        assert measured == predicted == walked, rank
        counted_flops, predicted_flops = res["ns_flops"]
        assert counted_flops == predicted_flops, rank


def test_unsharded_bound_with_the_root_resharded():
    """Documents a gap in plan.cost(): with reshard_after_forward=True the root is one of the
    freed units, but it stays gathered for the whole forward, so 1 + prefetch freed units plus
    the root can be live; the simulator walks the schedule and sees it."""
    plan = fsdpfn.plan(_model("meta"), (3,))
    for prefetch in (0, 1, 2):
        sched = runtime.schedule(plan, prefetch, True)
        r = sim.simulate(plan, sched, _workload(plan), None, HW)
        assert r.memory["unsharded_peak"] == _unsharded_walk(plan, sched)


# ---------------------------------------------------------------------------------------------
# The timeline obeys the schedule
# ---------------------------------------------------------------------------------------------


@st.composite
def schedules(draw):
    """A plan and a valid schedule for it: the runtime's, then actions moved at random, each move
    kept only if fsdpfn.runtime.validate accepts the result."""
    shape = draw(st.sampled_from([(2,), (3,), (2, 2)]))
    strategy = draw(st.sampled_from(STRATEGIES))
    plan = fsdpfn.plan(_model("meta"), shape, strategy=strategy)
    sched = runtime.schedule(plan, draw(st.integers(0, 3)), draw(st.sampled_from([None, True, False])))
    ops = list(sched.ops)
    for _ in range(draw(st.integers(0, 25))):
        actions = [i for i, op in enumerate(ops) if not op.is_event]
        i = draw(st.sampled_from(actions))
        j = draw(st.integers(0, len(ops) - 1))
        moved = ops[:i] + ops[i + 1 :]
        moved.insert(j, ops[i])
        candidate = dataclasses.replace(sched, ops=tuple(moved))
        try:
            runtime.validate(candidate, plan)
        except runtime.ScheduleError:
            continue
        ops = moved
    return plan, dataclasses.replace(sched, ops=tuple(ops))


@given(schedules(), st.floats(0.0, 1.0), st.sampled_from([1e7, 1e9, 1e11]))
def test_timeline_obeys_the_schedule(case, overlap, bandwidth):
    plan, sched = case
    hw = dataclasses.replace(HW, overlap=overlap, intra=sim.Link(1e-5, bandwidth), inter=sim.Link(1e-5, bandwidth / 10))
    r = sim.simulate(plan, sched, _workload(plan), sim.Muon(), hw)
    # Times are float64 sums of at most a few thousand span durations: off by well under
    # 1e-12 of the step time; 1e-9 of it separates "at the same time" from "before".
    eps = 1e-9 * max(1.0, r.step_time)
    ops = sched.ops
    events = [i for i, op in enumerate(ops) if op.is_event]
    next_event = {e: (events[k + 1] if k + 1 < len(events) else len(ops)) for k, e in enumerate(events)}
    work = {s.op: s for s in r.spans if s.stream == "compute" and s.kind in ("forward", "backward")}
    comm = {s.op: s for s in r.spans if s.stream in ("all_gather", "reduce_scatter", "all_reduce") and s.op >= 0}

    # Units in use at each event, and the gather in effect for each unit, as the validator sees them.
    in_use: set[str] = set()
    last_gather: dict[str, int] = {}
    used_at: dict[int, set[str]] = {}
    gather_at: dict[int, dict[str, int]] = {}
    for i, op in enumerate(ops):
        if op.kind is OpKind.GATHER:
            last_gather[op.unit] = i
        if op.is_event:
            used_at[i] = set(in_use)
            gather_at[i] = dict(last_gather)
            if op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
                in_use.add(op.unit)
            elif op.kind in (OpKind.FORWARD_DONE, OpKind.BACKWARD_DONE, OpKind.END):
                in_use.discard(op.unit)
    for e in events:  # make used_at[e] the units in use while e's work runs: those at the next event
        nxt = next_event[e]
        if nxt < len(ops):
            used_at[e] = used_at[nxt]
            gather_at[e] = gather_at[nxt]

    # 1. A unit computes only after the gather in effect for it has landed.
    for e, span in work.items():
        for unit in used_at[e]:
            g = gather_at[e].get(unit)
            if g is not None and g in comm:
                assert span.start >= comm[g].end - eps, (str(ops[e]), unit)
    # 2. A collective starts after the work of every event whose actions came before it.
    for i, c in comm.items():
        if ops[i].kind not in (OpKind.GATHER, OpKind.REDUCE):
            continue
        for e, span in work.items():
            if next_event[e] <= i:
                assert c.start >= span.end - eps, (str(ops[i]), str(ops[e]))
    # 3. Events' work runs in the schedule's order, one at a time; 4. each stream is FIFO.
    order = sorted(work)
    for a, b in zip(order, order[1:]):
        assert work[b].start >= work[a].end - eps
    for stream in {s.stream for s in r.spans}:
        spans = sorted((s for s in r.spans if s.stream == stream), key=lambda s: s.start)
        for a, b in zip(spans, spans[1:]):
            assert b.start >= a.end - eps, stream
    # 5. Memory follows the ops; the step ends after everything.
    assert r.memory["unsharded_peak"] == _unsharded_walk(plan, sched)
    assert r.step_time >= max(s.end for s in r.spans) - eps
    assert r.exposed_comm <= r.step_time + eps


def test_muon_owner_pipeline_overlaps_buckets_as_the_layout_runs_them():
    """With B buckets the owner layout launches 2B all-to-alls; 'out k+1' and 'back k-1' are in
    flight during bucket k's Newton-Schulz, 'back k' starts after it, so the optimizer step is
    shorter than with one bucket when links are slow and compute overlaps (and the bytes sent
    are the same)."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, width=64, depth=8, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = fsdpfn.plan(model, (4,))
    x = torch.zeros(1, 8, dtype=torch.long, device="meta")
    wl = sim.profile(model, plan, x)
    hw = dataclasses.replace(HW, overlap=1.0, intra=sim.Link(1e-6, 2e7))
    one, four = (sim.simulate(plan, None, wl, sim.Muon(buckets=b, ns_dtype=torch.float32), hw) for b in (1, 4))
    a2a = {b: r.traffic["optimizer"]["all_to_all"] for b, r in ((1, one), (4, four))}
    assert (a2a[1].calls, a2a[4].calls) == (2, 8)
    assert four.optimizer_time < 0.9 * one.optimizer_time
    spans = {s.label: s for s in four.spans if s.op == -1 and s.stream == "optimizer"}
    assert set(spans) == {f"all_to_all {way} {k}" for way in ("out", "back") for k in range(4)}
    for k in range(4):  # back k leaves after bucket k computed, which waited for out k
        assert spans[f"all_to_all back {k}"].start >= spans[f"all_to_all out {k}"].end

    def overlapped(r):  # seconds of optimizer compute with an all-to-all in flight
        work = [s for s in r.spans if s.op == -1 and s.kind == "optimizer"]
        a2a = [s for s in r.spans if s.op == -1 and s.kind == "all_to_all"]
        return sum(max(0.0, min(w.end, a.end) - max(w.start, a.start)) for w in work for a in a2a)

    assert overlapped(one) == 0.0 and overlapped(four) > 0.0
    with pytest.raises(ValueError, match="Muon.buckets"):
        sim.Muon(buckets=0)


def test_search_beats_the_default_where_it_should():
    """On slow links with room to spare, holding more (zero2 / replicate) or prefetching deeper
    is faster than zero3 with prefetch 1: the search finds it, within the budget."""
    model = _model("meta")
    x, y = _batch(device="meta")
    hw = dataclasses.replace(HW, intra=sim.Link(1e-4, 1e6), inter=sim.Link(1e-4, 1e5))
    res = sim.search(
        model, 4, 2**30, x, hardware=hw, optimizer=sim.AdamW(), loss_fn=_loss(y), units=[None], workloads=_WORKLOADS
    )
    assert res.speedup > 1.05, str(res)
    assert res.result.memory["peak"] <= 2**30
    assert res.plan != fsdpfn.plan(model, (4,)) or res.schedule.prefetch != 1


def test_search_lists_as_fitting_no_plan_whose_reserved_memory_is_over_the_part():
    """One memory verdict: a candidate whose peak is within the budget but whose reserved bytes
    (the caching allocator's allowance on top) exceed the part's memory is "over", as the note of
    its own prediction says, and the pick is never such a plan."""
    model = _model("meta")
    x, y = _batch(device="meta")
    kw = dict(hardware=HW, optimizer=sim.AdamW(), loss_fn=_loss(y), prefetch=(0, 1), units=[None], workloads=_WORKLOADS)
    loose = sim.search(model, 4, 2**40, x, **kw)
    peaks = sorted(c.peak for c in loose.candidates)
    # A part just below the largest candidate's reserved bytes, with a 10% allowance; the budget
    # (peak) above every peak, so only the reserve can rule a candidate out.
    hw = dataclasses.replace(HW, memory_reserve=0.1, memory=int(peaks[-1] * 1.1) - 1)
    res = sim.search(model, 4, 2**40, x, **{**kw, "hardware": hw})
    over = [c for c in res.candidates if not c.fits]
    assert over and all(c.peak <= res.budget and c.reserved > hw.memory for c in over), str(res)
    assert all(c.reserved == int(c.peak * 1.1) <= hw.memory for c in res.candidates if c.fits), str(res)
    assert res.candidate.fits and not [n for n in res.result.notes if n.startswith("memory")], res.result.notes
    # The listing says which verdict, and each listed line shows the reserved bytes it rests on.
    listed = str(res).splitlines()
    assert "(peak, reserved within the part's " in listed[0], listed[0]
    for c, line in zip(res.candidates, listed[listed.index("fastest candidates:          peak     reserved") + 1 :]):
        assert line.split()[6] == ("fits" if c.fits else "over") and f"{c.reserved / 2**30:,.2f} GiB" in line, line


def test_engine_overlap_and_sharing():
    T = sim.Task
    tasks = [T("compute", "compute", 2.0), T("ag", "intra", 1.0), T("compute", "compute", 1.0, deps=(1,))]
    assert sim.run_tasks([dataclasses.replace(t) for t in tasks], overlap=1.0) == 3.0
    assert sim.run_tasks([dataclasses.replace(t) for t in tasks], overlap=0.0) == 4.0
    two = [T("a", "intra", 1.0), T("b", "intra", 1.0), T("c", "inter", 1.0)]
    assert sim.run_tasks(two) == 2.0  # a and b share one link; c has its own


# ---------------------------------------------------------------------------------------------
# Search and scale
# ---------------------------------------------------------------------------------------------


@settings(max_examples=8)
@given(st.floats(0.02, 0.5), st.sampled_from([sim.AdamW(), sim.Muon()]), st.sampled_from([1e8, 1e11]))
def test_search_never_returns_a_plan_over_budget(budget_mib, opt, bandwidth):
    model = _model("meta")
    x, y = _batch(device="meta")
    hw = dataclasses.replace(HW, intra=sim.Link(1e-5, bandwidth), inter=sim.Link(1e-5, bandwidth / 10))
    budget = budget_mib * 2**20
    try:
        res = sim.search(
            model,
            4,
            budget,
            x,
            hardware=hw,
            optimizer=opt,
            loss_fn=_loss(y),
            prefetch=(0, 1),
            units=[None],
            workloads=_WORKLOADS,
        )
    except ValueError as e:
        assert "no plan fits" in str(e)
        return
    assert res.result.memory["peak"] <= budget
    assert res.result.step_time <= res.default.step_time or not res.default_fits
    c = res.candidate  # the pick, described as it is
    assert c.fits and c.step_time == res.result.step_time and c.peak == res.result.memory["peak"]
    assert c.prefetch == res.schedule.prefetch and c.mesh_shape == res.plan.mesh_shape
    assert dict(c.strategy) == {u.name: u.strategy for u in res.plan.units}
    again = sim.simulate(res.plan, res.schedule, _workload(res.plan), opt, hw)
    assert again.memory["peak"] == res.result.memory["peak"]


def test_search_equals_the_default_where_nothing_is_faster():
    """With free links and free copies only compute is left, the same for every plan: the search
    returns the default (and on slow links it beats it, see benchmarks/sim_project.py)."""
    model = _model("meta")
    x, y = _batch(device="meta")
    free = sim.Link(0.0, float("inf"))
    hw = dataclasses.replace(HW, intra=free, inter=free, op_overhead=0.0, memory_bandwidth=float("inf"))
    res = sim.search(model, 2, 2**30, x, hardware=hw, loss_fn=_loss(y), prefetch=(0, 1, 2), workloads=_WORKLOADS)
    assert res.plan == fsdpfn.plan(model, (2,)) and res.schedule.prefetch == 1 and res.speedup == 1.0


def test_search_over_accumulation_and_its_bad_arguments():
    """With 6 micro-batches on slow links, reducing only the last one is faster where the full
    gradients fit; under a budget too small for them the search keeps reducing each one. Bad
    arguments are named before anything is profiled."""
    model = _model("meta")
    x, y = _batch(device="meta")
    hw = dataclasses.replace(HW, intra=sim.Link(1e-4, 1e6), inter=sim.Link(1e-4, 1e5))
    kw = dict(
        hardware=hw,
        optimizer=sim.AdamW(),
        loss_fn=_loss(y),
        units=[None],
        workloads=_WORKLOADS,
        micro_batches=6,
        strategies=("zero3",),
        prefetch=(1,),
        mesh_shapes=[(4,)],
    )
    roomy = sim.search(model, 4, 2**30, x, accumulate=("reduce", "local"), **kw)
    assert roomy.accumulate == "local" and roomy.speedup > 1.2, str(
        roomy
    )  # the reduce-scatters of 5 micro-batches saved
    local = sim.simulate(
        roomy.plan, roomy.schedule, _workload(roomy.plan), sim.AdamW(), hw, micro_batches=6, accumulate="local"
    )
    assert local.step_time == roomy.result.step_time
    tight = sim.search(model, 4, roomy.default.memory["peak"], x, accumulate=("reduce", "local"), **kw)
    assert tight.accumulate == "reduce" and tight.speedup == 1.0
    for bad, match in [
        (dict(accumulate="sum"), "accumulate"),
        (dict(prefetch=(-1,)), "prefetch"),
        (dict(strategies=("zero4",)), "strategies"),
        (dict(micro_batches=0), "micro_batches"),
    ]:
        with pytest.raises(ValueError, match=match):
            sim.search(model, 4, 2**30, x, **{**kw, **bad})
    with pytest.raises(ValueError, match="budget"):
        sim.search(model, 4, 0, x, **kw)


def test_abstract_plans_for_1024_ranks_build_in_seconds():
    # Tests never assert on time; this bound (10x what it takes here) guards against a quadratic
    # blow-up in plan building or simulation, not a benchmark.
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128256, seq_len=4096, width=4096, depth=32, heads=32, bias=False))
    mp = fsdpfn.MixedPrecision(torch.bfloat16, torch.float32)
    flat, hsdp = fsdpfn.plan(model, (1024,), mp=mp), fsdpfn.plan(model, (16, 64), mp=mp)
    assert "mesh 1024" in str(flat) and "mesh 16x64" in str(hsdp)
    wl = sim.profile(model, hsdp, torch.zeros(1, 4096, dtype=torch.long, device="meta"))
    for plan in (flat, hsdp):
        r = sim.simulate(plan, runtime.schedule(plan), wl, sim.Muon(), sim.H100_SXM)
        assert r.traffic["step"]["all_gather"].calls == plan.cost().collectives["all_gather"].calls
        assert r.level_bytes["inter"] > 0
    assert time.perf_counter() - t0 < 120


def test_long_accumulations_extend_exactly():
    """micro_batches > 3 is extended from 2 and 3 simulated micro-batches; it equals simulating
    every one (exact=True), bytes exactly and times to rounding."""
    plan = fsdpfn.plan(_model("meta"), (3,))
    wl = _workload(plan)
    for accumulate in ("reduce", "local"):
        fast = sim.simulate(plan, None, wl, sim.Muon(), HW, micro_batches=7, accumulate=accumulate)
        slow = sim.simulate(plan, None, wl, sim.Muon(), HW, micro_batches=7, accumulate=accumulate, exact=True)
        assert fast.traffic == slow.traffic and fast.memory == slow.memory
        # Extended linearly from 2 and 3 micro-batches (t2 + (k - 2) * (t3 - t2)) in float64: the
        # difference t3 - t2 and its k - 2 = 5 multiples carry a few 2^-53 of t3 each.
        assert fast.step_time == pytest.approx(slow.step_time, rel=1e-9)
        assert fast.comm_time == pytest.approx(slow.comm_time, rel=1e-9)
        assert fast.exposed_comm == pytest.approx(slow.exposed_comm, rel=1e-9, abs=1e-12)


def test_a_step_above_the_parts_memory_says_so():
    """The prediction of a step whose reserved bytes exceed the part's memory carries a note that
    names both figures; the time is the same (the note says what it leaves out)."""
    plan = fsdpfn.plan(_model("meta"), (3,))
    wl = _workload(plan)
    fits = sim.simulate(plan, None, wl, sim.AdamW(), HW)
    assert not [n for n in fits.notes if n.startswith("memory")]
    at = dataclasses.replace(HW, memory=fits.memory["reserved"])
    assert not [n for n in sim.simulate(plan, None, wl, sim.AdamW(), at).notes if n.startswith("memory")]
    small = dataclasses.replace(HW, memory=fits.memory["reserved"] - 1)
    over = sim.simulate(plan, None, wl, sim.AdamW(), small)
    said = [n for n in over.notes if n.startswith("memory")]
    gib = 2**30
    assert said == [
        f"memory: {fits.memory['reserved'] / gib:,.1f} GiB reserved is above the {small.memory / gib:,.1f} GiB of test: "
        "the step does not fit as planned (at the limit the caching allocator frees and retries, which this "
        "time leaves out)"
    ]
    assert over.step_time == fits.step_time and "note: memory: " in over.summary()


def _profiles_cold_then_warm(model, plan, x, **kw):
    from fsdpfn.sim import _workload

    _workload._META_CACHE.clear()
    cold = sim.profile(model, plan, x, **kw)
    return cold, sim.profile(model, plan, x, **kw), len(_workload._META_CACHE)


@pytest.mark.parametrize("moe", [False, True], ids=["dense-remat", "moe"])
def test_a_profile_is_the_same_whether_meta_results_are_remembered_or_not(moe):
    # [Note: meta results by signature]: the second profile takes every cacheable operator's
    # outputs from the first; an entry that changed any figure (a wrong shape, device, storage or
    # cost, a view of an input or a freed storage counted again) shows here. Selective remat adds
    # a dispatch mode above the counter; an MoE model runs on CPU (its routing needs the tokens)
    # and its factory operators' outputs, keyed like a meta one's, must not come back on meta.
    from fsdpfn.models import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=64, seq_len=16, width=32, depth=3, heads=4, bias=False, **(dict(experts=4) if moe else {})
    )
    torch.manual_seed(0)
    with torch.device("cpu" if moe else "meta"):
        model = GPT(cfg)
    plan = fsdpfn.plan(model, {"dp": 2}, strategy="zero3")
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to("cpu" if moe else "meta")
    kw = dict(loss_fn=lambda out: out[0].float().mean() + out[1]) if moe else dict(remat_policies=("save_dots",))
    cold, warm, remembered = _profiles_cold_then_warm(model, plan, x, **kw)
    assert warm == cold
    assert remembered == 0 if moe else remembered > 10, remembered  # on CPU nothing is cacheable
