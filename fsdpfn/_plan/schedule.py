"""The schedule: the explicit, ordered operations of one training step.

A :class:`Schedule` is data, derived from a plan by :func:`schedule` (the one builder of a
step's op list) and read by everything that describes a step: :class:`fsdpfn.runtime.Runtime`
executes it op by op, :func:`fsdpfn.step_collectives` expands it into the collectives it issues
(which ``plan.cost()`` sums and :func:`fsdpfn.sim.simulate` times). It prints readably, parses
back from its printed form, and can be edited (``dataclasses.replace(s, ops=...)``);
:func:`validate` rejects an invalid one before anything runs. It is plan-level data (no
transforms, no runtime), so the plan-level accounting reads the very list the runtime runs;
``fsdpfn.runtime`` re-exports it.

[Note: schedule ops and events]
Two kinds of ops. *Actions* the executor performs::

    gather u        start the all-gather of unit u (allocates its unsharded parameters)
    wait u          wait for that gather and unpack it: u's full parameters are usable
    free u          release u's unsharded parameters (their storage is resized to 0)
    reduce u        start the reduce-scatter (all-reduce for replicate units) of u's gradients
    wait_reduce u   wait for it: u's sharded gradients are final
    copy_in u       (offloaded units) copy u's sharded parameters from host memory to the
                    device, for the next 'gather u', which consumes the copy
    copy_out u      (offloaded units) copy u's reduced gradient shards to host memory
    accumulate u    add u's complete gradients to the full gradients it keeps; nothing is sent,
                    and the next micro-batch's 'reduce u' reduces the sum. It takes the place of
                    'reduce u' and 'wait_reduce u' (and 'copy_out u') in a micro-batch that does
                    not end its step (``Schedule.accumulating``)

and *events*, points where the executor waits for the model to get there::

    forward u       u's forward is about to run (root: the model's forward begins)
    forward_done u  u's forward returned
    backward u      gradients reached u's outputs; u's backward is about to run
    backward_done u u's parameter gradients are complete (not for the root, see below)
    end             the backward reached the parameters: every gradient is complete

The executor runs the actions between two events when the model reaches the first one, inside
that hook, before the unit computes. So ``forward u; wait u; gather v`` waits for u and starts
v's prefetch right before u runs. A unit is *in use* from its ``forward``/``backward`` event to
the matching ``*_done`` event (the root: from ``forward <root>`` to ``forward_done <root>``, and
from ``backward <root>`` to ``end``, since the root's own code wraps every other unit) and must
be unsharded at every event while in use.

The root has no ``backward_done`` event: its parameters typically feed the first and the last
layer, so its gradients are complete only at ``end``; reduce it there.

[Note: micro-batches that do not end the step]
``Schedule.ops`` is the micro-batch that ends a step: every unit reduces. A micro-batch inside
``Runtime.accumulating()`` runs ``Schedule.accumulating`` instead, where a unit whose gradients
are summed locally has an ``accumulate`` op in place of its reduce. Left ``None`` (the default)
it is derived from ``ops`` by :func:`fsdpfn._plan.steps.micro_batch_ops` (``zero1`` units, and
every unit under ``accumulate="local"``, accumulate); given by hand it is obeyed as written by the
runtime, ``plan.cost()`` and the simulator alike.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import cast

from fsdpfn._plan.values import ROOT, ROOT_LABEL, PlanValues, unit_label

__all__ = [
    "ROOT",
    "GradState",
    "Op",
    "OpKind",
    "Schedule",
    "ScheduleError",
    "UNIT_FINAL_RULES",
    "UNIT_RULES",
    "UnitState",
    "Walk",
    "reshards_after_forward",
    "schedule",
    "unit_ops",
    "validate",
]


class ScheduleError(ValueError):
    """An invalid schedule: the message names the op, its index and how to fix it."""


class OpKind(enum.Enum):
    """What an op does: an action the executor performs or an event the model reaches.

    Example:
      >>> OpKind("wait_reduce"), OpKind.END.is_event
      (<OpKind.WAIT_REDUCE: 'wait_reduce'>, True)
    """

    GATHER = "gather"
    WAIT = "wait"
    FREE = "free"
    REDUCE = "reduce"
    WAIT_REDUCE = "wait_reduce"
    COPY_IN = "copy_in"
    COPY_OUT = "copy_out"
    ACCUMULATE = "accumulate"
    FORWARD = "forward"
    FORWARD_DONE = "forward_done"
    BACKWARD = "backward"
    BACKWARD_DONE = "backward_done"
    END = "end"

    @property
    def is_event(self) -> bool:
        return self in _EVENTS


_EVENTS = frozenset({OpKind.FORWARD, OpKind.FORWARD_DONE, OpKind.BACKWARD, OpKind.BACKWARD_DONE, OpKind.END})


class UnitState(enum.Enum):
    """Where a unit's parameters are: ``gather`` -> GATHERING, ``wait`` -> GATHERED, ``free`` -> SHARDED."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GradState(enum.Enum):
    """Where a unit's gradients are in a step: PENDING until its backward completes, then
    COMPLETE, ``reduce`` -> REDUCING, ``wait_reduce`` -> REDUCED; or ``accumulate`` -> ACCUMULATED."""

    PENDING = "pending"
    COMPLETE = "complete"
    REDUCING = "reducing"
    REDUCED = "reduced"
    ACCUMULATED = "accumulated"


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a schedule: ``kind`` (an :class:`OpKind` or its name) on ``unit`` (``""``: the root).

    Example:
      >>> op = Op("gather", "blocks.0")
      >>> op.kind, str(op), op == Op(OpKind.GATHER, "blocks.0")
      (<OpKind.GATHER: 'gather'>, 'gather blocks.0', True)
    """

    kind: OpKind
    unit: str = ROOT

    def __post_init__(self):
        if not isinstance(self.kind, OpKind):
            try:
                object.__setattr__(self, "kind", OpKind(self.kind))
            except ValueError:
                choices = ", ".join(k.value for k in OpKind)
                raise ScheduleError(f"unknown op kind {self.kind!r}; choose one of {choices}") from None

    @property
    def is_event(self) -> bool:
        return self.kind.is_event

    def __str__(self) -> str:
        return self.kind.value if self.kind is OpKind.END else f"{self.kind.value} {unit_label(self.unit)}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The ordered ops of one step (see [Note: schedule ops and events]).

    Attributes:
      ops: forward then backward, ending after ``end``.
      plan_fingerprint: the plan it was made for (checked when it runs).
      prefetch: how many units ahead it gathers (informative; the ops are what runs).
      accumulating: the ops of a micro-batch that does not end its step (see [Note:
        micro-batches that do not end the step]); ``None``: derived from ``ops``.

    Example:
      >>> s = Schedule.from_str("Schedule for plan 0123 (prefetch=0):\\n forward <root>\\n gather <root>")
      >>> s.ops
      (Op(kind=<OpKind.FORWARD: 'forward'>, unit=''), Op(kind=<OpKind.GATHER: 'gather'>, unit=''))
      >>> print(s)
      Schedule for plan 0123 (prefetch=0):
        0  forward <root>
        1      gather <root>
      >>> s2 = dataclasses.replace(s, ops=s.ops + (Op("wait"),))  # an edited copy
    """

    ops: tuple[Op, ...]
    plan_fingerprint: str
    prefetch: int = 1
    accumulating: tuple[Op, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        if self.accumulating is not None:
            object.__setattr__(self, "accumulating", tuple(self.accumulating))
        for op in self.ops + (self.accumulating or ()):
            if not isinstance(op, Op):
                raise ScheduleError(f"schedule ops must be Op values, got {op!r}")

    def reshard_after_forward(self, unit: str) -> bool:
        """Whether ``unit`` is freed between its forward and its backward."""
        done = self.ops.index(Op(OpKind.FORWARD_DONE, unit))
        back = self.ops.index(Op(OpKind.BACKWARD, unit))
        return Op(OpKind.FREE, unit) in self.ops[done:back]

    def __str__(self) -> str:
        lines = [f"Schedule for plan {self.plan_fingerprint} (prefetch={self.prefetch}):"]
        for title, ops in (("", self.ops), (_ACCUMULATING, self.accumulating)):
            if ops is None:
                continue
            if title:
                lines.append(title)
            width = len(str(len(ops)))
            for i, op in enumerate(ops):
                indent = "  " if op.is_event else "      "
                lines.append(f"  {i:>{width}}{indent}{op}")
        return "\n".join(lines)

    @classmethod
    def from_str(cls, text: str) -> "Schedule":
        """Parses :meth:`__str__`'s output (numbers are optional and ignored), so a schedule can
        be saved, hand-edited as text and loaded back."""
        lines = [ln.strip() for ln in text.strip().splitlines()]
        head = re.match(r"Schedule for plan (\S+) \(prefetch=(\d+)\):", lines[0]) if lines else None
        if head is None:
            raise ScheduleError("schedule text must start with 'Schedule for plan <fingerprint> (prefetch=<n>):'")
        ops: list[Op] = []
        accumulating: list[Op] | None = None
        for ln in lines[1:]:
            if not ln or ln.startswith("#"):
                continue
            if ln == _ACCUMULATING:  # the rest is the accumulating micro-batch's ops
                ops, accumulating = [], ops
                continue
            parts = ln.split()
            if parts[0].isdigit():
                parts = parts[1:]
            if parts == [OpKind.END.value]:
                ops.append(Op(OpKind.END))
            elif len(parts) == 2:
                ops.append(
                    Op(cast(OpKind, parts[0]), ROOT if parts[1] == ROOT_LABEL else parts[1])
                )  # Op converts the name
            else:
                raise ScheduleError(f"cannot parse schedule line {ln!r}; expected '<kind> <unit>' or 'end'")
        if accumulating is not None:  # the main ops came first
            ops, accumulating = accumulating, ops
        return cls(tuple(ops), head.group(1), int(head.group(2)), None if accumulating is None else tuple(accumulating))


_ACCUMULATING = "Micro-batches that do not end the step:"


def reshards_after_forward(plan: PlanValues, name: str, reshard_after_forward: bool | None = None) -> bool:
    """Whether :func:`schedule` frees unit ``name`` between its forward and its backward (the
    one rule; the compiled path asks it too, for the units its backward graph gathers again).

    Example:
      >>> [reshards_after_forward(plan, u.name) for u in plan.units]  # zero3: the root is kept
      [False, True, True]
      >>> reshards_after_forward(plan, "", True), reshards_after_forward(plan, "blocks.0", False)
      (True, False)
    """
    if not plan.unit(name).strategy.reshards_after_forward or reshard_after_forward is False:
        return False
    return reshard_after_forward is True or name != ROOT


def schedule(plan: PlanValues, prefetch: int = 1, reshard_after_forward: bool | None = None) -> Schedule:
    """The default schedule of one training step for ``plan``.

    Units run in the plan's order (root first, wrapping the others) in forward and in reverse
    in backward. Each unit is waited for right before it computes, with the gathers of the next
    ``prefetch`` units started at that point; each unit's reduce starts as soon as its gradients
    are complete and is waited for when the next unit's gradients are (so one reduce is in flight
    while a unit computes, as in FSDP2: a reduce holds full-size buffers); the root and the
    last unit are waited for at ``end``.

    Args:
      plan: the plan.
      prefetch: units gathered ahead (0: none). Memory: about ``1 + prefetch`` units plus the
        root are unsharded at once under reshard-after-forward.
      reshard_after_forward: ``None`` (default): ``zero3`` units other than the root are freed
        after their forward and gathered again in backward; the root, whose forward ends where
        its backward starts, is kept (FSDP2 on torch 2.13 regathers it: one all-gather more).
        ``True``: every ``zero3`` unit, the root too. ``False``: none. ``replicate``/``zero1``/
        ``zero2`` units are never freed between forward and backward.

    Returns:
      a :class:`Schedule`; :func:`validate` accepts it.

    Example:
      >>> s = schedule(plan, prefetch=2)
      >>> print(s)  # one numbered op a line, events outdented
      Schedule for plan ... (prefetch=2):
         0  forward <root>
         1      gather <root>
         2      gather blocks.0
         3      gather blocks.1
         4      wait <root>
         5  forward blocks.0
         6      wait blocks.0
         7  forward_done blocks.0
         8      free blocks.0
      ...
        28  end
        29      reduce <root>
        30      wait_reduce <root>
        31      wait_reduce blocks.0
        32      free <root>
      >>> s.reshard_after_forward("blocks.0"), s.reshard_after_forward("")  # the root is kept
      (True, False)
    """
    if plan.stages is not None:
        # One list for every unit would run (and cost) every stage on every rank: no pipeline.
        raise ValueError(
            f"the plan is cut into {plan.stages.num_stages} pipeline stages; its step is a pipeline schedule, "
            "fsdpfn.pipeline_schedule(plan, '1f1b', micro_batches), which fsdpfn.runtime.PipelineRuntime runs; "
            "each stage's own step is that of plan.stage_plan(stage) (schedule(), cost() and the runtime take it "
            "as they are)"
        )
    return Schedule(tuple(unit_ops(plan, None, prefetch, reshard_after_forward)), plan.fingerprint, prefetch)


def unit_ops(
    plan: PlanValues,
    names: "set[str] | frozenset[str] | None" = None,
    prefetch: int = 1,
    reshard_after_forward: bool | None = None,
) -> list[Op]:
    """:func:`schedule`'s ops for the units ``names`` alone (``None``: every unit), in the
    plan's order: the one builder of a unit's gathers, frees and reduces, which a pipeline
    schedule asks once per stage (:func:`fsdpfn.pipeline_schedule`).

    Example:
      >>> [str(op) for op in unit_ops(plan, {"blocks.1"}, reshard_after_forward=False)]
      ['forward blocks.1', 'gather blocks.1', 'wait blocks.1', 'forward_done blocks.1', 'backward blocks.1', 'backward_done blocks.1', 'free blocks.1', 'reduce blocks.1', 'end', 'wait_reduce blocks.1']
    """
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    units = [u.name for u in plan.units if names is None or u.name in names]
    root_present = ROOT in units
    # A unit whose module lies inside another unit's (an expert unit in its block, a block's
    # MLP made a unit of its own, as FSDP2 users wrap both) runs inside that unit's forward and
    # backward: its ops nest between the enclosing unit's events, at any depth.
    inner: dict[str, list[str]] = {}
    for u in plan.units:
        host = max((h for h in units if h and h != u.name and u.name.startswith(h + ".")), key=len, default=None)
        if host is not None and u.name in units:
            inner.setdefault(host, []).append(u.name)
    nested = {c for cs in inner.values() for c in cs}
    blocks = [u for u in units if u != ROOT and u not in nested]

    ops: list[Op] = []

    gathered: set[str] = set()  # units gathered (or being gathered) and not freed since

    def gather(name: str) -> None:
        if name not in gathered:
            ops.append(Op(OpKind.GATHER, name))
            gathered.add(name)

    def free_after_forward(name: str) -> None:
        if reshards_after_forward(plan, name, reshard_after_forward):
            ops.append(Op(OpKind.FREE, name))
            gathered.discard(name)

    def prefetch_from(order: list[str], start: int) -> None:
        for name in order[start : start + prefetch]:
            gather(name)

    def forward_inside(name: str) -> None:
        for child in inner.get(name, ()):
            ops.append(Op(OpKind.FORWARD, child))
            gather(child)
            ops.append(Op(OpKind.WAIT, child))
            forward_inside(child)
            ops.append(Op(OpKind.FORWARD_DONE, child))
            free_after_forward(child)

    def backward_inside(name: str) -> None:
        for child in reversed(inner.get(name, ())):
            ops.append(Op(OpKind.BACKWARD, child))
            gather(child)
            if child not in live:
                ops.append(Op(OpKind.WAIT, child))
            backward_inside(child)
            ops.extend(
                Op(kind, child) for kind in (OpKind.BACKWARD_DONE, OpKind.FREE, OpKind.REDUCE, OpKind.WAIT_REDUCE)
            )

    # Forward.
    if root_present:
        ops.append(Op(OpKind.FORWARD, ROOT))
        gather(ROOT)
        prefetch_from(blocks, 0)
        ops.append(Op(OpKind.WAIT, ROOT))
    for i, name in enumerate(blocks):
        ops.append(Op(OpKind.FORWARD, name))
        gather(name)
        prefetch_from(blocks, i + 1)
        ops.append(Op(OpKind.WAIT, name))
        forward_inside(name)
        ops.append(Op(OpKind.FORWARD_DONE, name))
        free_after_forward(name)
    if root_present:
        ops.append(Op(OpKind.FORWARD_DONE, ROOT))
        free_after_forward(ROOT)

    # Backward.
    back = list(reversed(blocks))
    live = set(gathered)  # units still unsharded after forward
    if root_present:
        ops.append(Op(OpKind.BACKWARD, ROOT))
        gather(ROOT)
        prefetch_from(back, 0)
        if ROOT not in live:
            ops.append(Op(OpKind.WAIT, ROOT))
    for i, name in enumerate(back):
        ops.append(Op(OpKind.BACKWARD, name))
        gather(name)
        prefetch_from(back, i + 1)
        if name not in live:
            ops.append(Op(OpKind.WAIT, name))
        backward_inside(name)
        ops.append(Op(OpKind.BACKWARD_DONE, name))
        ops.append(Op(OpKind.FREE, name))
        ops.append(Op(OpKind.REDUCE, name))
        if i > 0:  # one reduce in flight while a unit computes: its buffers are full-size
            ops.append(Op(OpKind.WAIT_REDUCE, back[i - 1]))
    ops.append(Op(OpKind.END))
    if root_present:
        ops.append(Op(OpKind.REDUCE, ROOT))
    ops += [Op(OpKind.WAIT_REDUCE, name) for name in ([ROOT] if root_present else []) + back[-1:]]
    if root_present:
        ops.append(Op(OpKind.FREE, ROOT))
    return _with_copies(ops, plan)


def _with_copies(ops: list[Op], plan: PlanValues) -> list[Op]:
    """An offloaded unit's shards are copied in right before each gather (which is already
    prefetched) and its gradients out right after their reduce is waited for (see [Note: offload])."""
    offloaded = {u.name for u in plan.units if u.offload}
    out: list[Op] = []
    for op in ops:
        if op.kind is OpKind.GATHER and op.unit in offloaded:
            out.append(Op(OpKind.COPY_IN, op.unit))
        out.append(op)
        if op.kind is OpKind.WAIT_REDUCE and op.unit in offloaded:
            out.append(Op(OpKind.COPY_OUT, op.unit))
    return out


def validate(sched: Schedule, plan: PlanValues) -> None:
    """Checks that ``sched`` can run for ``plan``; nothing runs, nothing is communicated.

    Each rule is one function below (``_OP_RULES`` for every op in order, ``_FINAL_RULES`` once
    after the last): the schedule was made for this plan; every unit has each of its events once,
    in order; a unit is gathered and waited for before it is used (see [Note: schedule ops and
    events]); nothing is gathered twice without a free or freed while in use; every unit's
    gradients are reduced once complete and waited for; every unit is freed by the end.

    Args:
      sched: the schedule, e.g. :func:`schedule`'s, edited.
      plan: the plan it should run.

    Raises:
      ScheduleError: naming the first offending op and how to fix it.

    Example:
      >>> s = schedule(plan)
      >>> validate(s, plan)  # passes
      >>> no_wait = [op for op in s.ops if op != Op("wait", "blocks.1")]
      >>> validate(dataclasses.replace(s, ops=no_wait), plan)
      Traceback (most recent call last):
      fsdpfn._plan.schedule.ScheduleError: invalid schedule at op #...: unit 'blocks.1' is used from op #... but is not waited for ...
    """
    _made_for_plan(sched, plan)
    for ops, ending in ((sched.ops, True), (sched.accumulating, False)):
        if ops is None:
            continue
        walk = Walk(tuple(u.name for u in plan.units), ops, ending)
        walk.offloaded = frozenset(u.name for u in plan.units if u.offload)
        for i, op in enumerate(ops):
            walk.at = i
            for rule in _OP_RULES:
                rule(walk, op)
            walk.advance(op)
        for final_rule in _FINAL_RULES:
            final_rule(walk)


# The state each op leaves its unit in; the rules below check the state it needs.
_PARAMS_AFTER = {OpKind.GATHER: UnitState.GATHERING, OpKind.WAIT: UnitState.GATHERED, OpKind.FREE: UnitState.SHARDED}
_GRADS_AFTER = {
    OpKind.BACKWARD_DONE: GradState.COMPLETE,
    OpKind.END: GradState.COMPLETE,  # the root's gradients (see the module's Note)
    OpKind.REDUCE: GradState.REDUCING,
    OpKind.WAIT_REDUCE: GradState.REDUCED,
    OpKind.ACCUMULATE: GradState.ACCUMULATED,
}
# The event each event must follow, for the same unit.
_EVENT_AFTER = {
    OpKind.FORWARD_DONE: OpKind.FORWARD,
    OpKind.BACKWARD: OpKind.FORWARD_DONE,
    OpKind.BACKWARD_DONE: OpKind.BACKWARD,
}


class Walk:
    """A validator's view of a list of ops just before op number ``at``: each unit's parameter
    and gradient state, what is in use, staged and copied out. The rules read it and
    :meth:`advance` moves it past an op. The single-stage validator walks one micro-batch's
    ``ops`` (``ending``: the micro-batch that ends the step, ``Schedule.ops``; else
    ``Schedule.accumulating``); the pipelined one walks each rank's list with a subclass that
    names the rank in its errors (see [Note: one table of unit rules])."""

    def __init__(self, units: tuple[str, ...], ops: tuple, ending: bool = True):
        self.units, self.at = units, 0
        self.ops = ops
        self.ending = ending
        self.params = dict.fromkeys(units, UnitState.SHARDED)
        self.grads = dict.fromkeys(units, GradState.PENDING)
        self.in_use: dict[str, int] = {}  # unit -> the op its use began at
        self.offloaded: frozenset[str] = frozenset()
        self.staged: set[str] = set()  # offloaded units copied in, not yet gathered
        self.copied_out: set[str] = set()
        self.seen: dict[Op, int] = {}  # event -> its index

    def fail(self, msg: str) -> None:
        where = "" if self.ending else " of the micro-batches that do not end the step"
        raise ScheduleError(f"invalid schedule at op #{self.at}{where} ({self.ops[self.at]}): {msg}")

    def final(self, msg: str) -> ScheduleError:
        where = "" if self.ending else " (in the micro-batches that do not end the step)"
        return ScheduleError(f"invalid schedule{where}: {msg}")

    def complete_hint(self, unit: str) -> str:
        """Where ``unit``'s gradients become complete, for an error that reduces them early."""
        return f"move it after '{'end' if unit == ROOT else f'backward_done {unit_label(unit)}'}'"

    def advance(self, op: Op) -> None:
        kind, unit = op.kind, op.unit
        if kind.is_event:
            self.seen[op] = self.at
        if kind in (OpKind.FORWARD, OpKind.BACKWARD):
            self.in_use[unit] = self.at
        elif kind in (OpKind.FORWARD_DONE, OpKind.BACKWARD_DONE, OpKind.END):
            self.in_use.pop(unit, None)
        if kind is OpKind.COPY_IN:
            self.staged.add(unit)
        elif kind is OpKind.GATHER:
            self.staged.discard(unit)
        elif kind is OpKind.COPY_OUT:
            self.copied_out.add(unit)
        if unit not in self.params:  # 'end' in a plan without a root
            return
        if kind in _PARAMS_AFTER:
            self.params[unit] = _PARAMS_AFTER[kind]
        if kind in _GRADS_AFTER:
            self.grads[unit] = _GRADS_AFTER[kind]


def _quoted(unit: str) -> str:
    return repr(unit_label(unit))


def _made_for_plan(sched: Schedule, plan: PlanValues) -> None:
    """The schedule was made for this plan."""
    if sched.plan_fingerprint != plan.fingerprint:
        raise ScheduleError(
            f"schedule was made for plan {sched.plan_fingerprint}, not this plan ({plan.fingerprint}); "
            "derive it from this plan with fsdpfn.runtime.schedule(plan)"
        )


def _unit_in_plan(w: Walk, op: Op) -> None:
    """Every op names a unit of the plan."""
    if op.kind is not OpKind.END and op.unit not in w.units:
        w.fail(f"unit {_quoted(op.unit)} is not in the plan; units: {', '.join(map(unit_label, w.units))}")


def _no_event_after_end(w: Walk, op: Op) -> None:
    """No event follows 'end'."""
    if op.is_event and Op(OpKind.END) in w.seen:
        w.fail("no event may follow 'end'")


def _used_units_are_gathered(w: Walk, op: Op) -> None:
    """A unit is gathered and waited for at every event while it is in use."""
    if not op.is_event:
        return
    for unit, since in w.in_use.items():
        if w.params[unit] is not UnitState.GATHERED:
            what = "gathered" if w.params[unit] is UnitState.SHARDED else "waited for"
            w.fail(
                f"unit {_quoted(unit)} is used from op #{since} ({w.ops[since]}) but is not {what} by then; "
                f"add 'wait {unit_label(unit)}' (after a 'gather') between op #{since} and op #{w.at}"
            )


def _event_happens_once(w: Walk, op: Op) -> None:
    """Each event happens once per step."""
    if op in w.seen:
        w.fail(f"'{op}' appears twice (first at op #{w.seen[op]}); each event happens once per step")


def _events_in_order(w: Walk, op: Op) -> None:
    """A unit's events come in order: forward, forward_done, backward, backward_done."""
    before = _EVENT_AFTER.get(op.kind)
    if before is not None and Op(before, op.unit) not in w.seen:
        w.fail(f"'{op}' before '{Op(before, op.unit)}'")


def _root_has_no_backward_done(w: Walk, op: Op) -> None:
    """The root's gradients are complete at 'end', not at a 'backward_done'."""
    if op.kind is OpKind.BACKWARD_DONE and op.unit == ROOT:
        w.fail("the root has no 'backward_done' event: its gradients are complete at 'end'")


def _gathered_once(w: Walk, op: Op) -> None:
    """A unit is freed before it is gathered again."""
    if op.kind is OpKind.GATHER and w.params[op.unit] is not UnitState.SHARDED:
        w.fail(f"unit {_quoted(op.unit)} is gathered twice without a 'free' in between")


def _waited_after_gather(w: Walk, op: Op) -> None:
    """A 'wait' follows its unit's 'gather'."""
    if op.kind is OpKind.WAIT and w.params[op.unit] is not UnitState.GATHERING:
        w.fail(f"'{op}' without a 'gather {unit_label(op.unit)}' before it")


def _freed_when_gathered(w: Walk, op: Op) -> None:
    """Only a gathered and waited-for unit is freed."""
    if op.kind is OpKind.FREE and w.params[op.unit] is not UnitState.GATHERED:
        w.fail(f"'{op}' but the unit is not gathered and waited for")


def _not_freed_in_use(w: Walk, op: Op) -> None:
    """A unit is not freed while in use."""
    if op.kind is OpKind.FREE and op.unit in w.in_use:
        w.fail(
            f"unit {_quoted(op.unit)} is freed while in use (since op #{w.in_use[op.unit]}); free it after its '*_done' event"
        )


def _reduced_once_complete(w: Walk, op: Op) -> None:
    """A unit is reduced (or accumulated) once, after its gradients are complete."""
    if op.kind not in (OpKind.REDUCE, OpKind.ACCUMULATE):
        return
    state = w.grads[op.unit]
    if state is GradState.PENDING:
        w.fail(f"'{op}' before its gradients are complete; {w.complete_hint(op.unit)}")
    if state is not GradState.COMPLETE:
        w.fail(f"unit {_quoted(op.unit)} is reduced or accumulated twice")


def _accumulated_only_before_the_end(w: Walk, op: Op) -> None:
    """The micro-batch that ends the step reduces every unit: 'accumulate' only in the others."""
    if op.kind is OpKind.ACCUMULATE and w.ending:
        w.fail(
            f"the micro-batch that ends the step must reduce every unit; replace '{op}' by 'reduce {unit_label(op.unit)}' "
            "and a 'wait_reduce', or put it in Schedule.accumulating (the micro-batches that do not end the step)"
        )


def _reduce_waited_after_reduce(w: Walk, op: Op) -> None:
    """A 'wait_reduce' follows its unit's 'reduce'."""
    if op.kind is OpKind.WAIT_REDUCE and w.grads[op.unit] is not GradState.REDUCING:
        w.fail(f"'{op}' without a 'reduce {unit_label(op.unit)}' before it")


def _copies_only_offloaded(w: Walk, op: Op) -> None:
    """Only offloaded units are copied in and out."""
    if op.kind in (OpKind.COPY_IN, OpKind.COPY_OUT) and op.unit not in w.offloaded:
        w.fail(
            f"unit {_quoted(op.unit)} is not offloaded (its shards stay on the device); remove '{op}' or build the plan "
            f"with offload={{{unit_label(op.unit)!r}: True}}"
        )


def _offloaded_copied_in_before_gather(w: Walk, op: Op) -> None:
    """An offloaded unit's shards are copied in before each of its gathers, once."""
    if op.kind is OpKind.GATHER and op.unit in w.offloaded and op.unit not in w.staged:
        w.fail(
            f"unit {_quoted(op.unit)} is offloaded: its shards are in host memory; add 'copy_in {unit_label(op.unit)}' before this gather"
        )
    if op.kind is OpKind.COPY_IN and op.unit in w.staged:
        w.fail(f"'{op}' twice before its gather; each gather consumes one copy")


def _copied_out_after_reduce(w: Walk, op: Op) -> None:
    """An offloaded unit's gradients are copied out once their reduce is waited for."""
    if op.kind is OpKind.COPY_OUT and (w.grads[op.unit] is not GradState.REDUCED or op.unit in w.copied_out):
        w.fail(
            f"'{op}' before 'wait_reduce {unit_label(op.unit)}' (or twice); the gradient shards are final only after it"
        )


def _every_offloaded_unit_copied_out(w: Walk) -> None:
    """Every offloaded unit's gradients reach host memory, and no copy is left unused."""
    accumulated = {u for u, state in w.grads.items() if state is GradState.ACCUMULATED}  # nothing reduced to copy out
    for unit in sorted(w.offloaded - w.copied_out - accumulated):
        raise w.final(
            f"'copy_out {unit_label(unit)}' is missing after 'wait_reduce {unit_label(unit)}'; "
            "an offloaded unit's gradients must reach host memory"
        )
    for unit in sorted(w.staged):
        raise w.final(f"'copy_in {unit_label(unit)}' is never consumed by a gather; remove it")


def _every_event_present(w: Walk) -> None:
    """Every unit has all its events, and the step has 'end'."""
    for unit in w.units:
        wanted = [OpKind.FORWARD, OpKind.FORWARD_DONE, OpKind.BACKWARD] + (
            [] if unit == ROOT else [OpKind.BACKWARD_DONE]
        )
        for kind in wanted:
            if Op(kind, unit) not in w.seen:
                raise w.final(
                    f"event '{Op(kind, unit)}' is missing; every unit needs {', '.join(k.value for k in wanted)}"
                )
    if Op(OpKind.END) not in w.seen:
        raise w.final("the 'end' event is missing; put it after the last 'backward_done'")


def _every_reduce_waited(w: Walk) -> None:
    """Every unit's gradients are reduced and waited for (or, before the end, accumulated)."""
    for unit, state in w.grads.items():
        label = unit_label(unit)
        if state is GradState.COMPLETE:
            raise w.final(
                f"the reduce of unit {_quoted(unit)} is missing; add 'reduce {label}' "
                f"after its gradients are complete and 'wait_reduce {label}' after it"
            )
        if state is GradState.REDUCING:
            raise w.final(f"'wait_reduce {label}' is missing after op #{len(w.ops) - 1}")


def _every_unit_freed(w: Walk) -> None:
    """Every unit is freed by the end."""
    for unit, state in w.params.items():
        if state is not UnitState.SHARDED:
            raise w.final(f"unit {_quoted(unit)} is still unsharded at the end; add 'free {unit_label(unit)}'")


# [Note: one table of unit rules]
# What a unit's own actions need (gathered once, waited after its gather, freed when gathered,
# reduced once complete and waited for, an offloaded unit's copies in and out) does not depend on
# what runs the unit: UNIT_RULES (each op) and UNIT_FINAL_RULES (after the last) are read by
# this module's validator and by the pipelined one (fsdpfn/_plan/pipeline.py), which walks each
# rank's list with the same Walk. The other rules here are about per-unit events, which a
# pipeline's stage ops replace (it checks those itself).
UNIT_RULES = (
    _gathered_once,
    _waited_after_gather,
    _freed_when_gathered,
    _reduced_once_complete,
    _reduce_waited_after_reduce,
    _copies_only_offloaded,
    _offloaded_copied_in_before_gather,
    _copied_out_after_reduce,
)
UNIT_FINAL_RULES = (_every_reduce_waited, _every_unit_freed, _every_offloaded_unit_copied_out)
_OP_RULES = (
    _unit_in_plan,
    _no_event_after_end,
    _used_units_are_gathered,
    _event_happens_once,
    _root_has_no_backward_done,
    _events_in_order,
    *UNIT_RULES,
    _not_freed_in_use,
    _accumulated_only_before_the_end,
)
_FINAL_RULES = (_every_event_present, *UNIT_FINAL_RULES)
