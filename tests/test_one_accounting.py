"""One description of a step: the op list a schedule holds is what the runtime runs, what
``plan.cost()`` sums and what the simulator times.

For a grid of plans (zero2, zero3, HSDP, data x tensor parallel, expert parallel, remat, offload,
FP8 gathers) and of schedules (prefetch 0, 1 and 2; a free moved later; a unit kept gathered from
forward to backward, edited by hand), on 4 gloo ranks:

- every collective a real runtime step issues, as :func:`fsdpfn.comm.count_collectives` records
  it, equals the op list's (:func:`fsdpfn.step_collectives` of that schedule) call for call, in
  order: kind, group size, bytes, bytes sent, dtype, tag, phase;
- ``plan.cost(schedule=...)`` and :func:`fsdpfn.sim.simulate` of the same schedule sum to the
  list's totals per kind (calls, buffer bytes, bytes sent), and the simulator times exactly the
  list's collectives.

The helpers (model, batches, the record's key) are those of ``tests/test_steps.py`` and
``tests/test_moe_plan.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fsdpfn
from fsdpfn import runtime, sim, testing
from fsdpfn._plan.steps import totals
from fsdpfn.models import GPT, GPT_TP_PLAN
from fsdpfn.runtime import Op, OpKind, Runtime
from test_moe_plan import TOKENS as MOE_TOKENS, _model as _moe_model, _tokens as _moe_tokens
from test_steps import BF16, CFG, HW, PER_RANK, _batch, _ce, _key, _slice


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: tuple = (4,)
    names: tuple | None = None
    strategy: str = "zero3"
    model: str = "gpt"  # or "moe": tests/test_moe_plan.py's Net, experts over ep
    tp: bool = False
    fp8: str | None = None
    remat: str | None = None
    offload: bool = False
    prefetch: int = 1
    raf: bool | None = None
    edit: str | None = None  # "late_free" | "keep_gathered": a hand-edited schedule

    def __str__(self):
        return "-".join(f"{f.name}={v}" for f in dataclasses.fields(self) if (v := getattr(self, f.name)) != f.default)


def _hand_edited(sched: runtime.Schedule, edit: str | None) -> runtime.Schedule:
    """``late_free``: blocks.0 is freed after blocks.1's forward instead of its own (same
    collectives, more memory). ``keep_gathered``: blocks.0 stays gathered from its forward to its
    backward (its free after forward and its backward gather and wait dropped: one gather fewer)."""
    if edit is None:
        return sched
    ops = list(sched.ops)
    free = Op(OpKind.FREE, "blocks.0")
    first_free = ops.index(free)
    del ops[first_free]
    if edit == "late_free":
        ops.insert(ops.index(Op(OpKind.FORWARD_DONE, "blocks.1")) + 1, free)
    else:
        backward = ops.index(Op(OpKind.BACKWARD, ""))
        ops = ops[:backward] + [
            op for op in ops[backward:] if op not in (Op(OpKind.GATHER, "blocks.0"), Op(OpKind.WAIT, "blocks.0"))
        ]
    return dataclasses.replace(sched, ops=tuple(ops))


def _build(case: Case, mesh):
    """The model, its plan over ``mesh`` (a live mesh or a shape) and the case's schedule."""
    torch.manual_seed(0)
    if case.model == "moe":
        model = _moe_model()
    else:
        model = GPT(CFG)
    mp = fsdpfn.MixedPrecision(**BF16, fp8=case.fp8) if case.fp8 else None
    plan = fsdpfn.plan(
        model,
        mesh,
        strategy=case.strategy,
        mp=mp,
        tp=GPT_TP_PLAN if case.tp else None,
        remat=case.remat,
        offload={"blocks.*": True} if case.offload else None,
    )
    sched = _hand_edited(runtime.schedule(plan, case.prefetch, case.raf), case.edit)
    runtime.validate(sched, plan)
    return model, plan, sched


def _tokens(case: Case) -> int:
    return MOE_TOKENS if case.model == "moe" else PER_RANK * CFG.seq_len


def _record_key(c, phase: str, moe: bool):
    """What a counted call and a listed one must share. An expert layer's row exchanges record
    what the routing sends (the larger of the in and out buffers), which the plan cannot know;
    their bytes are compared separately (the list's dispatch is what every rank sends)."""
    nbytes, wire = c.nbytes, round(c.wire_bytes, 6)
    if moe and c.tag.startswith("moe_"):
        nbytes = wire = None
    return (*_key(0, phase, c.kind, c.group_size, nbytes, c.dtype, c.tag), wire)


def _counted_steps(rank, world, cases):
    out = []
    for case in cases:
        model, plan, sched = _build(case, testing.mesh(case.mesh, case.names))
        params = fsdpfn.shard(model, plan, requires_grad=True)
        rt = Runtime(model, plan, sched)
        if case.model == "moe":
            x = _moe_tokens(fsdpfn.transforms.dp_rank(plan), 0)
            with fsdpfn.count_collectives() as fwd:
                loss = rt.apply(params, x)
        else:
            x, y = _batch(plan.dp_size, 1)
            s = _slice(fsdpfn.transforms.dp_rank(plan), plan.dp_size, 0)
            with fsdpfn.count_collectives() as fwd:
                logits = rt.apply(params, x[s])
            loss = _ce(logits, y[s])
        with fsdpfn.count_collectives() as bwd:
            loss.backward()
        moe = case.model == "moe"
        counted = [
            _record_key(c, phase, moe) for phase, ctr in (("forward", fwd), ("backward", bwd)) for c in ctr.calls
        ]
        listed_calls = fsdpfn.step_collectives(plan, schedule=sched, tokens=_tokens(case))
        listed = [_record_key(c, c.phase, moe) for c in listed_calls]
        dispatch_ok = all(
            min(c.nbytes for c in fwd.calls if c.tag == "moe_dispatch") >= c.nbytes
            for c in listed_calls
            if c.tag == "moe_dispatch" and c.phase == "forward"
        )
        first_diff = next(((i, a, b) for i, (a, b) in enumerate(zip(counted, listed)) if a != b), None)
        out.append(
            dict(
                case=case,
                equal=counted == listed,
                lengths=(len(counted), len(listed)),
                first_diff=first_diff,
                dispatch_ok=dispatch_ok,
                schedule=str(sched),
            )
        )
    return out


def _sums(calls) -> dict:
    return {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in totals(calls).items()}


def _check_cost_and_sim(case: Case) -> None:
    """``plan.cost()`` and the simulator of the case's schedule (on an abstract plan of the same
    shape) sum to its op list's totals; the simulator times exactly its collectives."""
    model, plan, sched = _build(case, case.mesh if case.names is None else dict(zip(case.names, case.mesh)))
    tokens = _tokens(case)
    listed = fsdpfn.step_collectives(plan, schedule=sched, tokens=tokens)
    cost = plan.cost(schedule=sched, tokens=tokens)
    assert {k: (c.calls, c.nbytes, round(c.wire_bytes, 6)) for k, c in cost.collectives.items()} == _sums(listed), str(
        case
    )
    assert list(cost.calls) == list(listed), str(case)
    if case.edit is None:  # a default schedule: plan.cost() without it says the same
        assert plan.cost(case.raf, case.prefetch, tokens=tokens).collectives == cost.collectives, str(case)
    if case.model == "moe":
        x = torch.zeros(MOE_TOKENS, model.inp.in_features)
    else:
        x = torch.zeros(PER_RANK, CFG.seq_len, dtype=torch.long)
    wl = sim.profile(model, plan, x)
    # The simulator sizes activation collectives with the workload's tokens: the counted step's
    # for the GPT (integer tokens); the MoE net takes float inputs, so its row exchanges get 0.
    assert wl.tokens == (tokens if case.model == "gpt" else 0), str(case)
    r = sim.simulate(plan, sched, wl, None, HW)
    with_wl_tokens = fsdpfn.step_collectives(plan, schedule=sched, tokens=wl.tokens)
    assert {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in r.traffic["step"].items()} == _sums(
        with_wl_tokens
    ), str(case)
    assert sorted(map(str, r.calls)) == sorted(map(str, with_wl_tokens)), str(case)


DENSE = [
    Case(prefetch=0),
    Case(prefetch=1),
    Case(prefetch=2, raf=True),
    Case(edit="late_free"),
    Case(edit="keep_gathered", prefetch=2),
    Case(strategy="zero2", prefetch=0),
    Case(remat="full"),
    Case(offload=True, prefetch=2),
    Case(fp8="tensorwise", edit="keep_gathered"),
]
AXES = [
    Case((2, 2), ("replicate", "shard"), edit="late_free"),
    Case((2, 2), ("replicate", "shard"), strategy="zero2", prefetch=2),
    Case((2, 2), ("dp", "tp"), tp=True),
    Case((2, 2), ("dp", "tp"), tp=True, prefetch=0, edit="keep_gathered"),
    Case((2, 2), ("dp", "tp"), tp=True, remat="full"),
    Case((2, 2), ("ep", "edp"), model="moe", prefetch=0),
    Case((2, 2), ("ep", "edp"), model="moe", prefetch=2),
]


@pytest.mark.parametrize("cases", [DENSE, AXES], ids=["dense", "axes"])
def test_the_runtime_runs_the_listed_collectives_and_cost_and_simulator_sum_them(run_on_ranks, cases):
    for rank, results in enumerate(run_on_ranks(_counted_steps, 4, cases)):
        for r in results:
            assert r["equal"], (rank, str(r["case"]), r["lengths"], r["first_diff"], r["schedule"])
            assert r["dispatch_ok"], (rank, str(r["case"]))
    for case in cases:
        _check_cost_and_sim(case)


def test_hand_edits_change_the_list_as_they_change_the_step():
    """The edits are real: keeping a unit gathered drops its backward gather from the list (and
    from the cost and the simulation), moving a free changes no collective."""
    plain, late, kept = (_build(Case(edit=e, prefetch=0), (4,)) for e in (None, "late_free", "keep_gathered"))
    calls = [fsdpfn.step_collectives(p, schedule=s) for _, p, s in (plain, late, kept)]
    assert [dataclasses.replace(c, op=-1) for c in calls[0]] == [dataclasses.replace(c, op=-1) for c in calls[1]]
    assert plain[2] != late[2]
    gathers = [sum(c.kind == "all_gather" for c in cs) for cs in calls]
    assert gathers[2] == gathers[0] - 1
    assert not kept[2].reshard_after_forward("blocks.0") and plain[2].reshard_after_forward("blocks.0")
    kept_cost = kept[1].cost(schedule=kept[2])
    assert kept_cost.collectives["all_gather"].calls == gathers[2]
    assert kept_cost.memory["unsharded_peak"] > plain[1].cost(schedule=plain[2]).memory["unsharded_peak"]
    with pytest.raises(runtime.ScheduleError, match="made for plan"):
        fsdpfn.plan(GPT(CFG), (2,)).cost(schedule=plain[2])


# ---- context parallelism: attention's exchange over cp is on the list too ------------------------

CP_CASES = [  # (mesh, names, strategy, remat, prefetch)
    ((2, 2), ("dp", "cp"), "allgather", None, 1),
    ((1, 4), ("dp", "cp"), "ring", None, 0),
    ((2, 2), ("dp", "cp"), "ring", "full", 2),
    ((1, 4), ("dp", "cp"), "ulysses", None, 1),
    ((2, 2), ("dp", "cp"), "ulysses", "full", 0),
]


def _cp_build(case, mesh):
    shape, names, strategy, remat, prefetch = case
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, mesh, remat=remat)
    return model, plan, runtime.schedule(plan, prefetch)


def _cp_profile(model, plan, strategy):
    """The workload of one cp rank's micro-batch (its attention calls are the op list's input)."""
    x = torch.zeros(PER_RANK, CFG.seq_len // plan.cp_size, dtype=torch.long)
    return sim.profile(model, plan, x, cp_strategy=strategy)


def _cp_counted(rank, world, cases):
    out = []
    for case in cases:
        shape, names, strategy, remat, prefetch = case
        model, plan, sched = _cp_build(case, testing.mesh(shape, names))
        params = fsdpfn.shard(model, plan, requires_grad=True)
        rt = Runtime(model, plan, sched)
        x, y = _batch(plan.dp_size, 1)
        s = _slice(fsdpfn.transforms.dp_rank(plan), plan.dp_size, 0)
        x, y = fsdpfn.context_parallel_shard((x[s], y[s]), plan)
        with fsdpfn.context_parallel(plan, strategy=strategy):
            with fsdpfn.count_collectives() as fwd:
                loss = _ce(rt.apply(params, x), y)
            with fsdpfn.count_collectives() as bwd:
                loss.backward()
        wl = _cp_profile(model, plan, strategy)
        counted = [
            _record_key(c, phase, False) for phase, ctr in (("forward", fwd), ("backward", bwd)) for c in ctr.calls
        ]
        listed = [
            _record_key(c, c.phase, False)
            for c in fsdpfn.step_collectives(plan, schedule=sched, tokens=x.numel(), attention=wl.attention)
        ]
        first_diff = next(((i, a, b) for i, (a, b) in enumerate(zip(counted, listed)) if a != b), None)
        out.append(
            dict(
                case=case,
                equal=counted == listed,
                lengths=(len(counted), len(listed)),
                first_diff=first_diff,
                cp_calls=sum(c.tag.startswith("cp_") for c in fwd.calls + bwd.calls),
            )
        )
    return out


def test_attention_over_cp_is_on_the_list_the_cost_and_the_simulation(run_on_ranks):
    """A real runtime step on 4 gloo ranks issues exactly the op list's collectives, in order,
    cp's key/value exchange included (all-gather and its reduce-scatter; ring hops both ways; a
    remat unit's recomputed hops in backward); the list is built from the attention calls the
    profile recorded, which are the GPT's blocks with keys as wide as the model; ``plan.cost()``
    and the simulator (on the abstract plan of the same shape) sum to it."""
    for rank, results in enumerate(run_on_ranks(_cp_counted, 4, CP_CASES)):
        for r in results:
            assert r["equal"], (rank, r["case"], r["lengths"], r["first_diff"])
            cp, strategy, remat = r["case"][0][1], r["case"][2], r["case"][3]
            # all-gather: gather, gather again in backward, reduce-scatter; ring: K/V hops forward,
            # K/V hops again and the dK/dV accumulator's in backward, a remat unit's recomputed hops;
            # ulysses: q/k/v and output all-to-alls each way, a remat unit's two again
            per_call = {
                "allgather": 3,
                "ring": 3 * (cp - 1) + (cp - 1 if remat == "full" else 0),
                "ulysses": 4 + (2 if remat == "full" else 0),
            }[strategy]
            assert r["cp_calls"] == CFG.depth * per_call, (rank, r["case"], r["cp_calls"])
    for case in CP_CASES:
        shape, names, strategy, remat, _ = case
        model, plan, sched = _cp_build(case, dict(zip(names, shape)))
        wl = _cp_profile(model, plan, strategy)
        assert wl.attention == tuple(
            fsdpfn.AttentionCall(f"blocks.{i}", CFG.width, True, strategy, torch.float32, q_width=CFG.width)
            for i in range(CFG.depth)
        )
        tokens = PER_RANK * CFG.seq_len // plan.cp_size
        assert wl.tokens == tokens
        listed = fsdpfn.step_collectives(plan, schedule=sched, tokens=tokens, attention=wl.attention)
        cost = plan.cost(schedule=sched, tokens=tokens, attention=wl.attention)
        assert list(cost.calls) == list(listed)
        # every call holds the whole sequence's keys and values while it runs: 2 (K, V) x seq x width x 4 bytes a
        # row; under ulysses those of its 1 / cp of the heads
        held = CFG.depth * PER_RANK * 2 * CFG.seq_len * CFG.width * 4
        assert cost.memory["attention_kv"] == (held // plan.cp_size if strategy == "ulysses" else held)
        r = sim.simulate(plan, sched, wl, None, HW)
        assert {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in r.traffic["step"].items()} == _sums(
            listed
        ), case
        assert sorted(map(str, r.calls)) == sorted(map(str, listed)), case


def _cp_hardware(link: float) -> sim.Hardware:
    """Slow compute (attention far longer than a hop at ``link`` bytes/s), one link level."""
    rates = {"float32": 1e7, "attention float32": 1e7}
    return sim.Hardware(
        "cp test", rates, 1e10, 2**34, 8, intra=sim.Link(1e-6, link), inter=sim.Link(1e-6, link), overlap=1.0
    )


def test_ring_hops_overlap_the_attention_in_the_simulation():
    """The simulator hides a ring hop behind the attention block it overlaps: with hops far
    shorter than a block, every hop lies inside a compute span; with links 10^7 times slower
    the hops outlast the compute and at least their excess is exposed."""
    model = GPT(CFG)
    plan = fsdpfn.plan(model, {"dp": 1, "cp": 4})
    fast = _cp_hardware(1e12)
    ring = sim.simulate(plan, None, _cp_profile(model, plan, "ring"), None, fast)
    hops = [sp for sp in ring.spans if sp.kind == "send_recv"]
    assert len(hops) == 3 * 3 * CFG.depth  # 3 K/V hops forward; 3 K/V and 3 dK/dV accumulator hops backward
    computing = [sp for sp in ring.spans if sp.stream == "compute" and sp.kind in ("forward", "backward")]
    assert all(any(c.start <= h.start and h.end <= c.end for c in computing) for h in hops)
    slow = sim.simulate(plan, None, _cp_profile(model, plan, "ring"), None, _cp_hardware(1e5))
    # A hop hides only behind compute: what the compute cannot cover is exposed.
    in_flight = sum(h.end - h.start for h in slow.spans if h.kind == "send_recv")
    compute = sum(c.end - c.start for c in slow.spans if c.stream == "compute")
    assert slow.exposed_comm >= in_flight - compute > ring.exposed_comm, (
        slow.exposed_comm,
        in_flight,
        compute,
        ring.exposed_comm,
    )
