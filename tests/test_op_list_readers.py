"""Every reader of a step reads its op list, and obeys it when it is edited by hand.

- the runtime reduces a unit in a micro-batch exactly where that micro-batch's ops have a
  ``reduce`` (a reduce moved later, or dropped for an ``accumulate`` in the micro-batches that
  do not end the step, ``Schedule.accumulating``), and ``plan.cost()`` and the simulator count
  the same collectives;
- the unsharded peak is one walk of the op list's gathers and frees: ``plan.cost()`` and the
  simulator report the runtime's measured ``rt.memory.high_water`` for prefetch 0/1/2 and for
  hand-edited schedules (a free moved, a unit kept gathered, the root resharded);
- the simulator issues the collectives in the op list's order (an expert layer's dispatch
  before the expert compute it feeds, as the runtime issues it);
- the compiled path's reshard-after-forward set is the schedule's: its default is the
  schedule's rule, and the compiled runtime gathers again exactly what a hand-edited schedule
  frees after forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fsdpfn
from fsdpfn import runtime, sim, testing
from fsdpfn._plan.schedule import reshards_after_forward
from fsdpfn._plan.steps import micro_batch_ops, totals, unsharded_peak
from fsdpfn.models import GPT, GPT_TP_PLAN
from fsdpfn.runtime import Op, OpKind, Runtime
from test_one_accounting import _hand_edited
from test_moe_plan import TOKENS as MOE_TOKENS, _model as _moe_model
from test_steps import CFG, HW, PER_RANK, _batch, _ce, _key, _null, _slice

TOKENS = PER_RANK * CFG.seq_len


def _edited_reduces(sched: runtime.Schedule) -> runtime.Schedule:
    """The micro-batch that ends the step: ``reduce blocks.1`` moved after blocks.0's backward.
    The micro-batches before it: that move too, and blocks.0 accumulates instead of reducing
    (its ``reduce`` becomes ``accumulate``, its ``wait_reduce`` goes)."""
    r1, r0 = Op(OpKind.REDUCE, "blocks.1"), Op(OpKind.REDUCE, "blocks.0")
    ops = [op for op in sched.ops if op != r1]
    ops.insert(ops.index(r0) + 1, r1)
    acc = [
        Op(OpKind.ACCUMULATE, "blocks.0") if op == r0 else op for op in ops if op != Op(OpKind.WAIT_REDUCE, "blocks.0")
    ]
    return dataclasses.replace(sched, ops=tuple(ops), accumulating=tuple(acc))


def _plan_and_schedule(mesh, edited: bool):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, mesh)
    sched = runtime.schedule(plan, prefetch=1)
    return model, plan, (_edited_reduces(sched) if edited else sched)


def _two_micro_batches(rank, world):
    """Two micro-batches (the first inside ``accumulating()``) under the edited schedule and the
    default one: the collectives counted, beside the list; the summed gradients of both."""
    out = {}
    for edited in (True, False):
        model, plan, sched = _plan_and_schedule(testing.mesh((world,)), edited)
        params = fsdpfn.shard(model, plan)
        rt = Runtime(model, plan, sched)
        x, y = _batch(world, 2)
        counted, summed = [], {}
        for m in range(2):
            s = _slice(rank, world, m)
            with rt.accumulating() if m == 0 else _null():
                with fsdpfn.count_collectives() as ctr:
                    grads, _ = rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x[s]), y[s]))(params)
            counted += [_key(m, "", c.kind, c.group_size, c.nbytes, c.dtype, c.tag) for c in ctr.calls]
            for n, g in grads.items():
                summed[n] = summed.get(n, 0) + g.to_local()
        listed = [
            _key(c.micro_batch, "", c.kind, c.group_size, c.nbytes, c.dtype, c.tag)
            for c in fsdpfn.step_collectives(plan, schedule=sched, micro_batches=2, tokens=TOKENS)
        ]
        out[edited] = dict(counted=counted, listed=listed, grads=summed, events=[e for _, e in rt.last_step.events])
    return out


def test_the_runtime_reduces_where_the_op_list_says_and_cost_and_simulator_count_it(run_on_ranks):
    for res in run_on_ranks(_two_micro_batches, 2):
        edited, plain = res[True], res[False]
        assert edited["counted"] == edited["listed"]
        assert plain["counted"] == plain["listed"]
        # blocks.0 sends nothing in the first micro-batch: one reduce-scatter fewer in the step
        rs = [sum(k[2] == "reduce_scatter" for k in r["counted"]) for r in (edited, plain)]
        assert rs[0] == rs[1] - 1
        assert not any(k[0] == 0 and k[2] == "reduce_scatter" and k[6] == "blocks.0" for k in edited["counted"])
        for n, g in plain["grads"].items():  # the step's gradient is the same, summed before or after reducing
            torch.testing.assert_close(edited["grads"][n], g, rtol=1e-5, atol=1e-6)
    # plan.cost() and the simulator of the same schedule count the same collectives, in the same order
    model, plan, sched = _plan_and_schedule((2,), True)
    listed = fsdpfn.step_collectives(plan, schedule=sched, micro_batches=2, tokens=TOKENS)
    sums = {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in totals(listed).items()}
    cost = plan.cost(schedule=sched, micro_batches=2, tokens=TOKENS)
    assert {k: (c.calls, c.nbytes, round(c.wire_bytes, 6)) for k, c in cost.collectives.items()} == sums
    wl = sim.profile(model, plan, torch.zeros(PER_RANK, CFG.seq_len, dtype=torch.long))
    r = sim.simulate(plan, sched, wl, None, HW, micro_batches=2)
    assert {k: (t.calls, t.nbytes, round(t.wire_bytes, 6)) for k, t in r.traffic["step"].items()} == sums
    assert list(r.calls) == list(listed)
    acc = [s for s in r.spans if s.micro_batch == 0 and s.unit == "blocks.0" and s.kind == "reduce_scatter"]
    assert not acc  # the simulator sends nothing for the accumulated unit either


def test_accumulating_ops_print_parse_and_validate():
    plan = fsdpfn.plan(GPT(CFG), (2,))
    sched = _edited_reduces(runtime.schedule(plan))
    runtime.validate(sched, plan)
    text = str(sched)
    assert "Micro-batches that do not end the step:" in text and "accumulate blocks.0" in text
    assert runtime.Schedule.from_str(text) == sched
    assert micro_batch_ops(plan, sched, last=False) == sched.accumulating
    assert micro_batch_ops(plan, sched, last=True) == sched.ops
    # the micro-batch that ends the step must reduce every unit
    with pytest.raises(runtime.ScheduleError, match="must reduce every unit"):
        runtime.validate(dataclasses.replace(sched, ops=sched.accumulating), plan)
    # an accumulated unit has nothing to wait for
    bad = list(sched.accumulating)
    bad.insert(bad.index(Op(OpKind.END)), Op(OpKind.WAIT_REDUCE, "blocks.0"))
    with pytest.raises(runtime.ScheduleError, match="do not end the step.*wait_reduce blocks.0"):
        runtime.validate(dataclasses.replace(sched, accumulating=tuple(bad)), plan)
    # derived: zero1 units, and every unit under accumulate="local", accumulate before the last micro-batch
    zero1 = fsdpfn.plan(GPT(CFG), (2,), strategy="zero1")
    for p, accumulate in ((zero1, "reduce"), (plan, "local")):
        kinds = [op.kind for op in micro_batch_ops(p, runtime.schedule(p), last=False, accumulate=accumulate)]
        assert OpKind.REDUCE not in kinds and OpKind.WAIT_REDUCE not in kinds
        assert kinds.count(OpKind.ACCUMULATE) == len(p.units)
    kinds = [op.kind for op in micro_batch_ops(plan, runtime.schedule(plan), last=False)]
    assert OpKind.ACCUMULATE not in kinds


# ---- the unsharded peak: one walk, the runtime's high-water mark ---------------------------


PEAK_CASES = [
    dict(prefetch=0),
    dict(prefetch=1),
    dict(prefetch=2),
    dict(prefetch=0, edit="late_free"),  # blocks.0 freed after blocks.1's forward: 2 blocks alive at prefetch 0
    dict(prefetch=1, raf=True),  # the root resharded: it is alive through the whole forward anyway
    dict(prefetch=2, edit="keep_gathered"),
    # blocks.1 kept from its forward to its backward (zero2), yet never alive with blocks.0 at prefetch 0
    dict(prefetch=0, strategy={"*": "zero3", "blocks.1": "zero2"}),
]


def _peak_schedule(plan, case):
    return _hand_edited(runtime.schedule(plan, case["prefetch"], case.get("raf")), case.get("edit"))


def _high_water(rank, world, cases):
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = GPT(CFG)
        plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=case.get("strategy", "zero3"))
        params = fsdpfn.shard(model, plan)
        rt = Runtime(model, plan, _peak_schedule(plan, case))
        x, y = _batch(world, 1)
        s = _slice(rank, world, 0)
        rt.memory.reset()
        rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x[s]), y[s]))(params)
        out.append(rt.memory.high_water)
    return out


def test_unsharded_peak_is_the_runtimes_high_water(run_on_ranks):
    measured = run_on_ranks(_high_water, 2, PEAK_CASES)
    torch.manual_seed(0)
    model = GPT(CFG)
    for i, case in enumerate(PEAK_CASES):
        plan = fsdpfn.plan(model, (2,), strategy=case.get("strategy", "zero3"))
        wl = sim.profile(model, plan, torch.zeros(PER_RANK, CFG.seq_len, dtype=torch.long))
        sched = _peak_schedule(plan, case)
        cost = plan.cost(schedule=sched).memory["unsharded_peak"]
        simulated = sim.simulate(plan, sched, wl, None, HW).memory["unsharded_peak"]
        assert all(m[i] == cost == simulated == unsharded_peak(plan, sched.ops) for m in measured), (
            case,
            [m[i] for m in measured],
            cost,
            simulated,
        )
    # a moved free is seen: with prefetch 0, blocks.0 and blocks.1 are alive at once
    plan = fsdpfn.plan(model, (2,))
    units = {u.name: u.numel * plan.gather_dtype(u).itemsize for u in plan.units}
    late = plan.cost(schedule=_peak_schedule(plan, PEAK_CASES[3])).memory["unsharded_peak"]
    assert late == units[""] + units["blocks.0"] + units["blocks.1"]


# ---- the simulator's order is the op list's -------------------------------------------------


def test_the_simulator_issues_collectives_in_the_op_lists_order():
    """An expert layer's counts and dispatch are issued at its expert unit's forward event,
    before the experts' gather and compute (as the runtime issues them); the simulator's calls
    are the op list's in order, and its dispatch span ends before the experts compute."""
    model = _moe_model()
    plan = fsdpfn.plan(model, {"ep": 2, "edp": 2})
    wl = sim.profile(model, plan, torch.zeros(MOE_TOKENS, model.inp.in_features))
    for prefetch in (0, 2):
        sched = runtime.schedule(plan, prefetch)
        r = sim.simulate(plan, sched, wl, None, HW)
        assert list(r.calls) == list(fsdpfn.step_collectives(plan, schedule=sched, tokens=wl.tokens))
        experts = [u.name for u in plan.units if u.experts]
        assert experts
        for name in experts:
            fwd = sched.ops.index(Op(OpKind.FORWARD, name))
            dispatch = [s for s in r.spans if s.kind == "all_to_all" and s.unit == "moe_dispatch" and s.op == fwd]
            compute = [
                s for s in r.spans if s.stream == "compute" and s.kind == "forward" and s.unit == name and s.op == fwd
            ]
            gather = [s for s in r.spans if s.kind == "all_gather" and s.unit == name and s.op < fwd + 4]
            assert dispatch and compute
            assert max(s.end for s in dispatch) <= min(s.start for s in compute)
            assert not gather or max(s.start for s in dispatch) <= min(s.start for s in gather)
    # dense tensor parallelism too: the simulator's calls are the list's, in order
    tp = fsdpfn.plan(GPT(CFG), {"dp": 2, "tp": 2}, tp=GPT_TP_PLAN)
    sched = runtime.schedule(tp)
    wl = sim.profile(GPT(CFG), tp, torch.zeros(PER_RANK, CFG.seq_len, dtype=torch.long))
    r = sim.simulate(tp, sched, wl, None, HW)
    assert list(r.calls) == list(fsdpfn.step_collectives(tp, schedule=sched, tokens=wl.tokens))


# ---- the compiled path reshards what the schedule reshards ----------------------------------


def test_the_compiled_default_is_the_schedules_rule():
    """The pure compiled path gathers again in backward what the schedule's rule frees with
    reshard_after_forward=True (every zero3 unit, the root too); one rule for both."""
    mixed = {"*": "zero3", "<root>": "zero2", "blocks.1": "replicate"}
    for strategy in ("zero3", "zero2", mixed):
        plan = fsdpfn.plan(GPT(CFG), (2,), strategy=strategy)
        for raf in (None, True, False):
            sched = runtime.schedule(plan, 0, raf)
            assert {u.name for u in plan.units if reshards_after_forward(plan, u.name, raf)} == {
                u.name for u in plan.units if sched.reshard_after_forward(u.name)
            }


def _compiled_runtime_gathers(rank, world):
    import warnings

    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    # the root resharded, blocks.0 kept gathered: neither the default (None) nor True nor False
    sched = _hand_edited(runtime.schedule(plan, 0, True), "keep_gathered")
    resharded = sorted(u.name for u in plan.units if sched.reshard_after_forward(u.name))
    rt = Runtime(model, plan, sched)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(world, 1)
    s = _slice(rank, world, 0)
    step = fsdpfn.compile(lambda p, x, y: _ce(rt.apply(p, x), y), backend="aot_eager")
    with fsdpfn.count_collectives() as ctr:
        step(params, x[s], y[s])
    listed = fsdpfn.step_collectives(plan, schedule=sched)
    return resharded, ctr.counts()["all_gather"], sum(c.kind == "all_gather" for c in listed), len(plan.units)


@pytest.mark.compile  # dynamo's trace in each rank: `make test-e2e` (tests/test_compile.py says why)
def test_the_compiled_runtime_regathers_what_a_hand_edited_schedule_frees(run_on_ranks):
    for resharded, counted, listed, n in run_on_ranks(_compiled_runtime_gathers, 2, timeout=900):
        assert resharded == ["", "blocks.1"]
        assert counted == listed == n + 2
