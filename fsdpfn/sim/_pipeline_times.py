"""The pipeline's timing engine: a valid pipeline schedule's ops priced in the order every
rank's lists run together (:func:`fsdpfn._plan.pipeline.run_order`, which the validator walks
too): a recv waits for its send, a send does not wait, a stage's compute takes its time.
:class:`fsdpfn.sim.PipelineSimResult` prices a plan's stages with it; on its own it answers what
a schedule's bubble is for given stage times.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, cast

from fsdpfn._plan.interpret import PIPELINE_ACTIONS, bind_handlers
from fsdpfn._plan.pipeline import AnyOp, PipeKind, PipelineSchedule, PipeOp, run_order
from fsdpfn._plan.values import PlanValues

__all__ = ["PipelineTimes", "pipeline_times"]


@dataclasses.dataclass(frozen=True)
class PipelineTimes:
    """When each rank finishes and how long it computes, with every rank's ops run together.

    Attributes:
      finish: each rank's last op's end.
      busy: each rank's compute time.
      makespan: the step's length (the latest finish).
      bubble: the fraction of ``pp x makespan`` no rank computes.
      in_flight: each rank's peak count of (stage, micro-batch) forwards whose backward (a split
        one's weight half) has not run: the activations it keeps at once (GPipe: ``v m``;
        1F1B: ``p - r`` on rank r; zero bubble: ``p`` on every rank).
      peak_activations: with ``activations`` given, each rank's most activation bytes kept at
        once (stages may keep different amounts: the count alone does not give it).
    """

    finish: tuple[float, ...]
    busy: tuple[float, ...]
    makespan: float
    bubble: float
    in_flight: tuple[int, ...] = ()
    peak_activations: tuple[int, ...] = ()


def pipeline_times(
    ps: PipelineSchedule,
    forward: "float | Sequence[float]" = 1.0,
    backward: "float | Sequence[float]" = 2.0,
    *,
    transfer: "float | Sequence[float]" = 0.0,
    start: "float | Sequence[float]" = 0.0,
    after: "float | Sequence[float]" = 0.0,
    activations: "Sequence[int] | None" = None,
    plan: PlanValues | None = None,
    backward_input: "float | Sequence[float] | None" = None,
    backward_weight: "float | Sequence[float] | None" = None,
    accumulate: "float | Sequence[float]" = 0.0,
) -> PipelineTimes:
    """Validates ``ps`` (see :func:`validate_pipeline`) and runs every rank's list together:
    a recv waits for its send, a send does not wait, FSDP's ops take no time of their own.

    Args:
      ps: the schedule.
      forward, backward: seconds of one micro-batch's stage forward and backward: one number
        for every stage, or one per stage.
      backward_input, backward_weight: seconds of a split backward's halves
        (``stage_backward_input``, ``stage_backward_weight``), alike; ``None``: half of
        ``backward`` each (then a split backward costs what a whole one does).
      transfer: seconds from a send to its data's arrival across the boundary after stage ``s``
        (an activation forward, its gradient back): one number, or one per boundary
        (``num_stages - 1``).
      start: seconds each rank spends before its first op (its stages' gathers), one number or
        one per rank; ``after``: after its last op (its stages' reduces).
      activations: bytes one micro-batch's forward of each stage keeps until its backward;
        gives ``PipelineTimes.peak_activations``.
      plan: the plan it was made for (its fingerprint and stages are checked).
      accumulate: seconds to add one micro-batch's parameter gradients of a stage to those kept
        from its earlier micro-batches (one number, or one per stage), after each backward (or
        weight half) of the stage but its first: the step's gradients are reduced once, after
        the last micro-batch, so ``m`` micro-batches add ``m - 1`` times.

    Example:
      >>> ps = fsdpfn.pipeline_schedule(fsdpfn.Stages((("a",), ("b",)), 2), "1f1b", 4)
      >>> t = fsdpfn.pipeline_times(ps)  # f = 1, b = 2: (m + p - 1)(f + b) = 15
      >>> t.makespan, round(t.bubble, 4)  # (p - 1) / (m + p - 1) = 1 / 5
      (15.0, 0.2)
      >>> fsdpfn.pipeline_times(ps, transfer=0.5).makespan  # 4 hops lie on the critical path
      17.0
      >>> zb = fsdpfn.pipeline_schedule(fsdpfn.Stages((("a",), ("b",)), 2), "zero_bubble", 4)
      >>> fsdpfn.pipeline_times(zb, 1.0, 2.0).makespan  # halves b = w = 1: 3m + p - 1 = 13
      13.0
      >>> fsdpfn.pipeline_times(ps, accumulate=0.25).busy  # each rank: m (f + b) + (m - 1) * 0.25
      (12.75, 12.75)
    """
    order = run_order(ps, plan)
    S, p = ps.num_stages, ps.pp_size
    whole = _per("backward", backward, S, "stage")
    cost = {
        PipeKind.STAGE_FORWARD: _per("forward", forward, S, "stage"),
        PipeKind.STAGE_BACKWARD: whole,
        PipeKind.STAGE_BACKWARD_INPUT: (
            tuple(b / 2 for b in whole)
            if backward_input is None
            else _per("backward_input", backward_input, S, "stage")
        ),
        PipeKind.STAGE_BACKWARD_WEIGHT: (
            tuple(b / 2 for b in whole)
            if backward_weight is None
            else _per("backward_weight", backward_weight, S, "stage")
        ),
    }
    clocks = _Clocks(
        ps,
        cost,
        hop=_per("transfer", transfer, max(S - 1, 0), "boundary between stages"),
        accumulate=_per("accumulate", accumulate, S, "stage"),
        start=_per("start", start, p, "pp rank"),
    )
    for r, i, takes in order:
        clocks.at = (r, i, takes)
        clocks.run(ps.ranks[r][i])
    clock, busy = clocks.clock, clocks.busy
    finish = [c + a for c, a in zip(clock, _per("after", after, p, "pp rank"))]
    makespan = max(finish)
    acts = _per("activations", activations, S, "stage") if activations is not None else None
    return PipelineTimes(
        tuple(finish),
        tuple(busy),
        makespan,
        1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0,
        tuple(_peak_in_flight(ops) for ops in ps.ranks),
        tuple(_peak_bytes(ops, acts) for ops in ps.ranks) if acts is not None else (),
    )


class _Clocks:
    """The timing engine as an interpreter of the pipeline's ops (see [Note: one interpreter
    protocol] in ``fsdpfn/_plan/interpret.py``): a clock per pp rank, moved by the op that
    rank runs (``at``: its rank, its index in the rank's list, and for a recv the index of the
    send it takes). FSDP's ops take no time of their own."""

    def __init__(self, ps: PipelineSchedule, cost: dict, *, hop: tuple, accumulate: tuple, start: tuple):
        self.ps, self.cost, self.hop, self.add, self.start = ps, cost, hop, accumulate, start
        self.handlers = bind_handlers(self, PIPELINE_ACTIONS)
        self.reset_step()

    def reset_step(self) -> None:
        self.clock = list(self.start)
        self.busy = [0.0] * self.ps.pp_size
        self.sent_at: dict[tuple[int, int], float] = {}  # (rank, op index) of a send -> when it was sent
        self.grads_kept: set[int] = set()  # stages whose parameter gradients of an earlier micro-batch are kept
        self.at: tuple[int, int, int | None] = (0, 0, None)

    def run(self, op: AnyOp) -> None:
        if isinstance(op, PipeOp):
            self.handlers[op.kind](op)

    def _compute(self, op: PipeOp) -> None:
        r = self.at[0]
        took = self.cost[op.kind][op.stage]
        if op.kind.computes_weight_grad:  # adds to the gradients an earlier micro-batch left
            took += self.add[op.stage] if op.stage in self.grads_kept else 0.0
            self.grads_kept.add(op.stage)
        self.clock[r] += took
        self.busy[r] += took

    _stage_forward = _stage_backward = _stage_backward_input = _stage_backward_weight = _compute

    def _send(self, op: PipeOp) -> None:
        r, i, _ = self.at
        self.sent_at[(r, i)] = self.clock[r]

    def _recv(self, op: PipeOp) -> None:
        r, _, takes = self.at
        boundary = min(op.stage, op.peer_stage)  # the activation of s -> s + 1, or its gradient back
        self.clock[r] = max(self.clock[r], self.sent_at[(self.ps.peer(op), cast(int, takes))] + self.hop[boundary])

    _recv_act = _recv_grad = _recv


def _per(name: str, value, n: int, what: str) -> tuple[float, ...]:
    """``value`` for each of ``n`` (stages, boundaries or ranks): one number for all, or one each."""
    if isinstance(value, (int, float)):
        if not value >= 0:
            raise ValueError(f"pipeline_times: {name} must be >= 0, got {value!r}")
        return (float(value),) * n
    values = tuple(float(v) for v in value)
    if len(values) != n or not all(v >= 0 for v in values):
        raise ValueError(f"pipeline_times: {name} needs one number >= 0 per {what} ({n}), got {list(values)}")
    return values


def _peak_bytes(ops: tuple[AnyOp, ...], acts: tuple[float, ...]) -> int:
    """The most activation bytes one rank keeps at once: each stage forward's until its backward
    (a split one's weight half: it needs the stage's inputs, so they live until then)."""
    live = peak = 0.0
    for op in ops:
        if isinstance(op, PipeOp) and op.kind is PipeKind.STAGE_FORWARD:
            live += acts[op.stage]
        elif isinstance(op, PipeOp) and op.kind.computes_weight_grad:
            live -= acts[op.stage]
        peak = max(peak, live)
    return int(peak)


def _peak_in_flight(ops: tuple[AnyOp, ...]) -> int:
    live = peak = 0
    for op in ops:
        if isinstance(op, PipeOp) and op.kind is PipeKind.STAGE_FORWARD:
            live += 1
        elif isinstance(op, PipeOp) and op.kind.computes_weight_grad:
            live -= 1
        peak = max(peak, live)
    return peak
