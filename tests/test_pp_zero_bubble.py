"""The zero-bubble schedule (ZB-H1) and the split backward it runs, as plan data: the op lists
print and parse back, the validator's rules for the two halves name the op, and the bubble of
every rank's list run together equals the closed form of [Note: the zero-bubble schedule]."""

import dataclasses

import pytest

import fsdpfn
from fsdpfn._plan.pipeline import (
    PipeKind,
    PipelineSchedule,
    PipeOp,
    pipeline_schedule,
    validate_pipeline,
)
from fsdpfn.sim import pipeline_times
from fsdpfn._plan.schedule import Op, OpKind, ScheduleError
from fsdpfn._plan.stages import Stages
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=4, heads=2)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
BI, BW, B = PipeKind.STAGE_BACKWARD_INPUT, PipeKind.STAGE_BACKWARD_WEIGHT, PipeKind.STAGE_BACKWARD


@pytest.fixture(scope="module")
def model():
    return GPT(CFG)


def _stages(p: int, v: int = 1) -> Stages:
    return Stages(tuple((f"u{s}",) for s in range(p * v)), p)


def _edit(ps: PipelineSchedule, rank: int, ops) -> PipelineSchedule:
    ranks = list(ps.ranks)
    ranks[rank] = tuple(ops)
    return dataclasses.replace(ps, ranks=tuple(ranks))


def _zb(p=2, m=4):
    return pipeline_schedule(_stages(p), "zero_bubble", m)


# ---- the generated lists --------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_every_micro_batch_is_split_once_and_in_order(p, m):
    ps = _zb(p, m)
    validate_pipeline(ps)
    for r, ops in enumerate(ps.ranks):
        kinds = [op.kind for op in ops if isinstance(op, PipeOp)]
        assert B not in kinds and kinds.count(BI) == m and kinds.count(BW) == m
        # weight halves in micro-batch order (the accumulator sums as 1F1B's does), each after its input half
        ws = [op.micro for op in ops if isinstance(op, PipeOp) and op.kind is BW]
        assert ws == list(range(m))
        for mb in range(m):
            assert ops.index(PipeOp(BI, r, mb)) < ops.index(PipeOp(BW, r, mb))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 5)])
def test_one_f_b_w_is_a_third_of_1f1b_idle(p, m):
    ps = _zb(p, m)
    t = pipeline_times(ps, forward=1.0, backward=2.0)  # halves default to 1 each
    assert t.makespan == pytest.approx(3 * m + p - 1)
    assert t.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    idle = [t.makespan - busy for busy in t.busy]
    assert idle == pytest.approx([p - 1] * p)  # every rank: p - 1 units, where 1F1B idles 3 (p - 1)
    one = pipeline_times(pipeline_schedule(_stages(p), "1f1b", m), forward=1.0, backward=2.0)
    assert [one.makespan - busy for busy in one.busy] == pytest.approx([3 * (p - 1)] * p)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16), (3, 5), (4, 4)])
@pytest.mark.parametrize(
    "f, b, w",
    [
        (1.0, 1.0, 1.0),
        (1.0, 2.0, 1.0),
        (2.0, 1.0, 1.0),
        (1.0, 1.0, 0.5),
        (1.0, 1.5, 1.5),
        (1.0, 0.5, 1.5),
        (0.5, 1.0, 0.6),
        (1.0, 3.0, 2.0),
        (1.25, 0.75, 3.0),
    ],
)
def test_makespan_matches_its_formula(p, m, f, b, w):
    t = pipeline_times(_zb(p, m), forward=f, backward=b + w, backward_input=b, backward_weight=w)
    # [Note: the zero-bubble schedule]: m (f + b + w) + (p - 1) max(f + b - w, f, b), for m >= p
    assert t.makespan == pytest.approx(m * (f + b + w) + (p - 1) * max(f + b - w, f, b), abs=1e-9)


@pytest.mark.parametrize("p, m", [(4, 1), (4, 3), (8, 5)])
def test_fewer_micro_batches_than_stages(p, m):
    # the round trip of the last micro-batch bounds the step: 2m + 2p - 1 at f = b = w = 1
    assert pipeline_times(_zb(p, m), 1.0, 2.0).makespan == pytest.approx(2 * m + 2 * p - 1)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 2), (8, 16)])
def test_peak_activations_are_1f1b_rank_0s(p, m):
    acts = [100 * (s + 1) for s in range(p)]
    zb = pipeline_times(_zb(p, m), activations=acts)
    one = pipeline_times(pipeline_schedule(_stages(p), "1f1b", m), activations=acts)
    assert zb.in_flight == (min(p, m),) * p
    assert max(zb.in_flight) == max(one.in_flight)
    assert zb.peak_activations == tuple(min(p, m) * a for a in acts)


def test_halves_default_to_half_the_backward_and_whole_backwards_are_unchanged():
    ps = _zb(4, 8)
    assert (
        pipeline_times(ps, 1.0, 3.0).makespan
        == pipeline_times(ps, 1.0, 3.0, backward_input=1.5, backward_weight=1.5).makespan
    )
    one = pipeline_schedule(_stages(4), "1f1b", 8)
    assert (
        pipeline_times(one, 1.0, 2.0, backward_input=5.0, backward_weight=7.0).makespan
        == pipeline_times(one, 1.0, 2.0).makespan
    )
    with pytest.raises(ValueError, match=r"backward_weight needs one number >= 0 per stage \(4\)"):
        pipeline_times(ps, backward_weight=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"backward_input must be >= 0"):
        pipeline_times(ps, backward_input=-1.0)


def test_plan_schedule_reduces_after_the_last_weight_half_and_round_trips(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    ps = pipeline_schedule(plan, "zero_bubble", 4)
    validate_pipeline(ps, plan)
    assert PipelineSchedule.from_str(str(ps)) == ps
    text = str(ps)
    assert "stage_backward_input s1 m0\n" in text and "send_grad s1 m0  # to rank 1" not in text
    for r, ops in enumerate(ps.ranks):
        last_w = max(i for i, op in enumerate(ops) if isinstance(op, PipeOp) and op.kind is BW)
        for u in plan.stages.units[r]:
            assert ops.index(Op(OpKind.REDUCE, u)) > last_w


def test_print_parse_round_trip_without_numbers():
    ps = _zb(3, 4)
    bare = "\n".join(
        ln.split("#")[0].strip().split(maxsplit=1)[-1] if ln.strip()[:1].isdigit() else ln
        for ln in str(ps).splitlines()
    )
    back = PipelineSchedule.from_str(bare)
    assert back == ps and back.name == "zero_bubble"


def test_generator_refuses_virtual_stages():
    with pytest.raises(ValueError, match=r"zero_bubble runs one stage per pp rank.*stages=2"):
        pipeline_schedule(_stages(2, 2), "zero_bubble", 4)


# ---- the validator's rules for the halves ---------------------------------------------------------


def _swap(ops, a, b):
    ops = list(ops)
    i, j = ops.index(a), ops.index(b)
    ops[i], ops[j] = ops[j], ops[i]
    return ops


def test_weight_half_before_its_input_half_is_refused():
    ps = _zb(2, 4)
    ops = _swap(ps.ranks[1], PipeOp(BI, 1, 0), PipeOp(BW, 1, 0))
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 op #\d+ \(stage_backward_weight s1 m0\): runs before "
        r"'stage_backward_input s1 m0'; the weight half follows the input half",
    ):
        validate_pipeline(_edit(ps, 1, ops))


def test_input_half_before_its_forward_or_its_gradient_is_refused():
    ps = _zb(2, 4)
    r1 = list(ps.ranks[1])
    r1.remove(PipeOp(BI, 1, 0))
    r1.insert(0, PipeOp(BI, 1, 0))
    with pytest.raises(
        ScheduleError, match=r"rank 1 op #0 \(stage_backward_input s1 m0\): runs before 'stage_forward s1 m0'"
    ):
        validate_pipeline(_edit(ps, 1, r1))
    r0 = _swap(ps.ranks[0], PipeOp(PipeKind.RECV_GRAD, 0, 1), PipeOp(BI, 0, 1))
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 op #\d+ \(stage_backward_input s0 m1\): uses the gradient of micro-batch 1 "
        r"before it arrives; put 'recv_grad s0 m1' before it",
    ):
        validate_pipeline(_edit(ps, 0, r0))


def test_send_grad_before_the_input_half_is_refused():
    ps = _zb(2, 4)
    r1 = _swap(ps.ranks[1], PipeOp(BI, 1, 2), PipeOp(PipeKind.SEND_GRAD, 1, 2))
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 op #\d+ \(send_grad s1 m2\): sends what 'stage_backward_input s1 m2' "
        r"computes before it runs",
    ):
        validate_pipeline(_edit(ps, 1, r1))


def test_whole_and_split_backward_of_one_micro_batch_are_refused():
    ps = _zb(2, 4)
    r1 = list(ps.ranks[1])
    r1.insert(r1.index(PipeOp(BW, 1, 1)) + 1, PipeOp(B, 1, 1))
    with pytest.raises(
        ScheduleError,
        match=r"\(stage_backward s1 m1\): 'stage_backward_input s1 m1' already ran \(op #\d+\); a "
        r"micro-batch's backward is either one 'stage_backward s1 m1' or one",
    ):
        validate_pipeline(_edit(ps, 1, r1))
    # a 1F1B list with a stray weight half after a whole backward
    one = pipeline_schedule(_stages(2), "1f1b", 2)
    r0 = list(one.ranks[0]) + [PipeOp(BW, 0, 0)]
    with pytest.raises(ScheduleError, match=r"\(stage_backward_weight s0 m0\): 'stage_backward s0 m0' already ran"):
        validate_pipeline(_edit(one, 0, r0))


def test_a_missing_or_doubled_half_is_refused():
    ps = _zb(2, 4)
    with pytest.raises(
        ScheduleError, match=r"rank 1 never runs 'stage_backward_weight s1 m3'; each stage runs forward and backward"
    ):
        validate_pipeline(_edit(ps, 1, [op for op in ps.ranks[1] if op != PipeOp(BW, 1, 3)]))
    with pytest.raises(ScheduleError, match=r"\(stage_backward_weight s1 m3\): appears twice"):
        validate_pipeline(_edit(ps, 1, list(ps.ranks[1]) + [PipeOp(BW, 1, 3)]))


def test_mixing_whole_and_split_backwards_across_micro_batches_is_valid():
    # a hand edit: micro-batch 0 split, the rest whole; the rules are per (stage, micro-batch)
    one = pipeline_schedule(_stages(2), "1f1b", 3)
    ranks = []
    for r, ops in enumerate(one.ranks):
        ops = list(ops)
        i = ops.index(PipeOp(B, r, 0))
        ops[i : i + 1] = [PipeOp(BI, r, 0)]
        ops.append(PipeOp(BW, r, 0))
        ranks.append(tuple(ops))
    edited = dataclasses.replace(one, ranks=tuple(ranks))
    validate_pipeline(edited)
    assert PipelineSchedule.from_str(str(edited)) == edited


def test_reduce_before_the_last_weight_half_is_refused(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    ps = pipeline_schedule(plan, "zero_bubble", 4)
    r1 = [op for op in ps.ranks[1] if op != PipeOp(BW, 1, 3)]
    r1.append(PipeOp(BW, 1, 3))
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 op #\d+ \(reduce \w+\): .* after its stage's last backward \(3 of 4 "
        r"micro-batches done\)",
    ):
        validate_pipeline(_edit(ps, 1, r1), plan)
