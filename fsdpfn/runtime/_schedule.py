"""The schedule: the explicit, ordered operations of one training step.

A :class:`Schedule` is data, derived from a plan by :func:`schedule` and executed, op by op, by
:class:`fsdpfn.runtime.Runtime`. It prints readably, parses back from its printed form, and can be
edited (``dataclasses.replace(s, ops=...)``); :func:`validate` rejects an invalid one before
anything runs.

[Note: schedule ops and events]
Two kinds of ops. *Actions* the executor performs::

    gather u        start the all-gather of unit u (allocates its unsharded parameters)
    wait u          wait for that gather and unpack it: u's full parameters are usable
    free u          release u's unsharded parameters (their storage is resized to 0)
    reduce u        start the reduce-scatter (all-reduce for replicate units) of u's gradients
    wait_reduce u   wait for it: u's sharded gradients are final

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
"""

from __future__ import annotations

import dataclasses
import re
from fsdpfn._plan import Plan

__all__ = ["ACTIONS", "EVENTS", "Op", "Schedule", "ScheduleError", "schedule", "validate"]

ACTIONS = ("gather", "wait", "free", "reduce", "wait_reduce")
EVENTS = ("forward", "forward_done", "backward", "backward_done", "end")
ROOT = ""


class ScheduleError(ValueError):
    """An invalid schedule: the message names the op, its index and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a schedule: ``kind`` (an action or an event) on ``unit`` (``""``: the root)."""

    kind: str
    unit: str = ROOT

    def __post_init__(self):
        if self.kind not in ACTIONS + EVENTS:
            raise ScheduleError(f"unknown op kind {self.kind!r}; choose one of {', '.join(ACTIONS + EVENTS)}")

    @property
    def is_event(self) -> bool:
        return self.kind in EVENTS

    def __str__(self) -> str:
        return self.kind if self.kind == "end" else f"{self.kind} {_label(self.unit)}"


def _label(unit: str) -> str:
    return unit or "<root>"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The ordered ops of one step (see [Note: schedule ops and events]).

    Attributes:
      ops: forward then backward, ending after ``end``.
      plan_fingerprint: the plan it was made for (checked when it runs).
      prefetch: how many units ahead it gathers (informative; the ops are what runs).

    Example:
      >>> s = schedule(plan, prefetch=1)  # doctest: +SKIP
      >>> print(s)  # numbered ops  # doctest: +SKIP
      >>> ops = list(s.ops); ops.insert(...); s2 = dataclasses.replace(s, ops=tuple(ops))  # doctest: +SKIP
    """

    ops: tuple[Op, ...]
    plan_fingerprint: str
    prefetch: int = 1

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        for op in self.ops:
            if not isinstance(op, Op):
                raise ScheduleError(f"schedule ops must be Op values, got {op!r}")

    def reshard_after_forward(self, unit: str) -> bool:
        """Whether ``unit`` is freed between its forward and its backward."""
        done = self.ops.index(Op("forward_done", unit))
        back = self.ops.index(Op("backward", unit))
        return Op("free", unit) in self.ops[done:back]

    def __str__(self) -> str:
        lines = [f"Schedule for plan {self.plan_fingerprint} (prefetch={self.prefetch}):"]
        width = len(str(len(self.ops)))
        for i, op in enumerate(self.ops):
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
        ops = []
        for ln in lines[1:]:
            if not ln or ln.startswith("#"):
                continue
            parts = ln.split()
            if parts[0].isdigit():
                parts = parts[1:]
            if len(parts) == 1 and parts[0] == "end":
                ops.append(Op("end"))
            elif len(parts) == 2:
                ops.append(Op(parts[0], "" if parts[1] == "<root>" else parts[1]))
            else:
                raise ScheduleError(f"cannot parse schedule line {ln!r}; expected '<kind> <unit>' or 'end'")
        return cls(tuple(ops), head.group(1), int(head.group(2)))


def schedule(plan: Plan, prefetch: int = 1, reshard_after_forward: bool | None = None) -> Schedule:
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
        its backward starts, is kept (FSDP2 on torch 2.13 regathers it: one all-gather more). ``True``: every ``zero3`` unit, the root
        too. ``False``: none. ``replicate``/``zero1``/``zero2`` units are never freed between
        forward and backward.

    Returns:
      a :class:`Schedule`; :func:`validate` accepts it.
    """
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    units = [u.name for u in plan.units]
    root_present = ROOT in units
    blocks = [u for u in units if u != ROOT]

    def reshards(name: str) -> bool:
        if plan.unit(name).strategy != "zero3" or reshard_after_forward is False:
            return False
        return reshard_after_forward is True or name != ROOT

    ops: list[Op] = []

    def prefetch_from(order: list[str], start: int, gathered: set[str]) -> None:
        for name in order[start : start + prefetch]:
            if name not in gathered:
                ops.append(Op("gather", name))
                gathered.add(name)

    # Forward.
    gathered: set[str] = set()
    if root_present:
        ops += [Op("forward", ROOT), Op("gather", ROOT)]
        gathered.add(ROOT)
        prefetch_from(blocks, 0, gathered)
        ops.append(Op("wait", ROOT))
    for i, name in enumerate(blocks):
        ops.append(Op("forward", name))
        if name not in gathered:
            ops.append(Op("gather", name))
            gathered.add(name)
        prefetch_from(blocks, i + 1, gathered)
        ops.append(Op("wait", name))
        ops.append(Op("forward_done", name))
        if reshards(name):
            ops.append(Op("free", name))
            gathered.discard(name)
    if root_present:
        ops.append(Op("forward_done", ROOT))
        if reshards(ROOT):
            ops.append(Op("free", ROOT))
            gathered.discard(ROOT)

    # Backward.
    back = list(reversed(blocks))
    live = set(gathered)  # units still unsharded after forward
    gathered = set(live)
    if root_present:
        ops.append(Op("backward", ROOT))
        if ROOT not in gathered:
            ops.append(Op("gather", ROOT))
            gathered.add(ROOT)
        prefetch_from(back, 0, gathered)
        if ROOT not in live:
            ops.append(Op("wait", ROOT))
    for i, name in enumerate(back):
        ops.append(Op("backward", name))
        if name not in gathered:
            ops.append(Op("gather", name))
            gathered.add(name)
        prefetch_from(back, i + 1, gathered)
        if name not in live:
            ops.append(Op("wait", name))
        ops.append(Op("backward_done", name))
        ops.append(Op("free", name))
        ops.append(Op("reduce", name))
        if i > 0:  # one reduce in flight while a unit computes: its buffers are full-size
            ops.append(Op("wait_reduce", back[i - 1]))
    ops.append(Op("end"))
    if root_present:
        ops.append(Op("reduce", ROOT))
    ops += [Op("wait_reduce", name) for name in ([ROOT] if root_present else []) + back[-1:]]
    if root_present:
        ops.append(Op("free", ROOT))
    return Schedule(tuple(ops), plan.fingerprint, prefetch)


def validate(sched: Schedule, plan: Plan) -> None:
    """Checks that ``sched`` can run for ``plan``; raises :class:`ScheduleError` naming the first
    offending op and how to fix it. Nothing runs; no communication.

    Checked: the schedule was made for this plan; every unit has each of its events once, in a
    consistent order; a unit is gathered before it is waited for and waited for before it is
    used (see [Note: schedule ops and events]); nothing is gathered twice without a free or freed
    while in use; every unit's gradients are reduced after they are complete and waited for;
    every unit is freed by the end.
    """
    if sched.plan_fingerprint != plan.fingerprint:
        raise ScheduleError(
            f"schedule was made for plan {sched.plan_fingerprint}, not this plan ({plan.fingerprint}); "
            "derive it from this plan with fsdpfn.runtime.schedule(plan)"
        )
    names = [u.name for u in plan.units]
    known = set(names)
    state = {n: "sharded" for n in names}  # sharded -> gathering -> unsharded -> sharded
    in_use: dict[str, int] = {}
    seen: dict[tuple[str, str], int] = {}
    grads_ready: set[str] = set()
    reduced: dict[str, str] = {}
    ended = False

    def fail(i: int, msg: str) -> None:
        raise ScheduleError(f"invalid schedule at op #{i} ({sched.ops[i]}): {msg}")

    def check_in_use(i: int) -> None:
        for name, since in in_use.items():
            if state[name] != "unsharded":
                what = "gathered" if state[name] == "sharded" else "waited for"
                fail(i, f"unit {_label(name)!r} is used from op #{since} ({sched.ops[since]}) but is not {what} "
                     f"by then; add 'wait {_label(name)}' (after a 'gather') between op #{since} and op #{i}")

    for i, op in enumerate(sched.ops):
        if op.kind != "end" and op.unit not in known:
            fail(i, f"unit {_label(op.unit)!r} is not in the plan; units: {', '.join(map(_label, names))}")
        if ended and op.is_event:
            fail(i, "no event may follow 'end'")
        if op.is_event:
            check_in_use(i)
            key = (op.kind, op.unit)
            if key in seen:
                fail(i, f"'{op}' appears twice (first at op #{seen[key]}); each event happens once per step")
            seen[key] = i
        u = op.unit
        if op.kind == "forward":
            in_use[u] = i
        elif op.kind == "forward_done":
            if ("forward", u) not in seen:
                fail(i, f"'forward_done {_label(u)}' before 'forward {_label(u)}'")
            in_use.pop(u, None)
        elif op.kind == "backward":
            if ("forward_done", u) not in seen:
                fail(i, f"'backward {_label(u)}' before its forward finished")
            in_use[u] = i
        elif op.kind == "backward_done":
            if u == ROOT:
                fail(i, "the root has no 'backward_done' event: its gradients are complete at 'end'")
            if ("backward", u) not in seen:
                fail(i, f"'backward_done {_label(u)}' before 'backward {_label(u)}'")
            in_use.pop(u, None)
            grads_ready.add(u)
        elif op.kind == "end":
            if ended:
                fail(i, "'end' appears twice")
            ended = True
            in_use.pop(ROOT, None)
            grads_ready.add(ROOT)
        elif op.kind == "gather":
            if state[u] != "sharded":
                fail(i, f"unit {_label(u)!r} is gathered twice without a 'free' in between")
            state[u] = "gathering"
        elif op.kind == "wait":
            if state[u] != "gathering":
                fail(i, f"'wait {_label(u)}' without a 'gather {_label(u)}' before it")
            state[u] = "unsharded"
        elif op.kind == "free":
            if state[u] != "unsharded":
                fail(i, f"'free {_label(u)}' but the unit is not gathered and waited for")
            if u in in_use:
                fail(i, f"unit {_label(u)!r} is freed while in use (since op #{in_use[u]}); free it after its '*_done' event")
            state[u] = "sharded"
        elif op.kind == "reduce":
            if u not in grads_ready:
                fail(i, f"'reduce {_label(u)}' before its gradients are complete; move it after "
                     f"'{'end' if u == ROOT else 'backward_done ' + _label(u)}'")
            if u in reduced:
                fail(i, f"unit {_label(u)!r} is reduced twice")
            reduced[u] = "started"
        elif op.kind == "wait_reduce":
            if reduced.get(u) != "started":
                fail(i, f"'wait_reduce {_label(u)}' without a 'reduce {_label(u)}' before it")
            reduced[u] = "done"

    last = len(sched.ops) - 1
    for name in names:
        wanted = ["forward", "forward_done", "backward"] + ([] if name == ROOT else ["backward_done"])
        for kind in wanted:
            if (kind, name) not in seen:
                raise ScheduleError(f"invalid schedule: event '{kind} {_label(name)}' is missing; every unit needs "
                                    f"{', '.join(wanted)}")
    if not ended:
        raise ScheduleError("invalid schedule: the 'end' event is missing; put it after the last 'backward_done'")
    for name in names:
        if name not in reduced:
            raise ScheduleError(f"invalid schedule: the reduce of unit {_label(name)!r} is missing; add "
                                f"'reduce {_label(name)}' after its gradients are complete and 'wait_reduce {_label(name)}' after it")
        if reduced[name] != "done":
            raise ScheduleError(f"invalid schedule: 'wait_reduce {_label(name)}' is missing after op #{last}")
        if state[name] != "sharded":
            raise ScheduleError(f"invalid schedule: unit {_label(name)!r} is still unsharded at the end; add 'free {_label(name)}'")
