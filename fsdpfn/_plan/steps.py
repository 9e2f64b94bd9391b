"""The collectives of a training step, listed from a plan: the one source of every derived figure.

:func:`step_ops` expands the step's op list (the :class:`fsdpfn.runtime.Schedule` that
:func:`fsdpfn.runtime.schedule` builds and the runtime executes, or a hand-edited one) over the
micro-batches, how gradients accumulate and the tokens an activation holds, and gives each op
the collectives it issues; :func:`step_collectives` lists them, call by call, as
:mod:`fsdpfn.comm` records them: kind, the unit (and tag), the mesh axis and its role, the group
size, the full buffer's bytes, its dtype, and the phase (forward or backward) and micro-batch it
runs in. Bytes sent follow :func:`fsdpfn._wire.wire_bytes`, the counter's own formula.
Everything else derives from that list:

- :meth:`fsdpfn.Plan.cost` sums it per kind;
- :func:`fsdpfn.sim.simulate` times it, walking :func:`step_ops` op by op;
- tests compare it, call for call, with a :func:`fsdpfn.comm.count_collectives` record of a
  real step (every strategy, HSDP, FP8 gathers, tensor parallelism, accumulation).

It is pure plan arithmetic: it imports neither the transforms nor the runtime, which implement
what it lists (see [Note: what a step issues]); :func:`static_memory` is the same for the bytes
a rank holds between steps.

[Note: what a step issues]
Per unit, in :mod:`fsdpfn.transforms` (``gather_unit``, ``reduce_unit``):

=====================  ============================================  ================  ==========
when                   collective                                    axis              bytes
=====================  ============================================  ================  ==========
each gather            all-reduce (max) of the FP8 per-tensor amax   shard             4 / weight
                       (tensorwise recipe only); again over tp if
                       a weight is split over tp
each gather            all-gather of the unit's segment              shard             W x segment
each reduce            reduce-scatter (sharded) / all-reduce         shard             W x reduce
                       (``replicate`` units)                                           segment
each reduce, HSDP      all-reduce of the reduced shard               replicate         reduce
                                                                                       segment
=====================  ============================================  ================  ==========

A unit is gathered once per micro-batch, twice if it is freed between its forward and backward
(``reshard_after_forward``). It is reduced in every micro-batch that has a ``reduce`` op for it
(:func:`micro_batch_ops`): by default every micro-batch, except where gradients accumulate locally
(:func:`reduces_now`): ``accumulate="local"``, and ``zero1`` units always, sum full gradients over
the micro-batches (an ``accumulate`` op) and reduce once, in the last.

Per tensor-parallel module (:mod:`fsdpfn.transforms._tp`, over the ``tp`` axis), with ``N``
tokens per rank per micro-batch and the activations in the gather dtype:

=================  ==========================================  ==============================
style              forward                                     backward
=================  ==========================================  ==============================
``colwise``        nothing                                     all-reduce of the input's
                                                               gradient: N x in_features
``colwise_gather`` all-gather of the output: N x out_features  the same all-reduce as colwise
``rowwise``        all-reduce of the output: N x out_features  nothing
=================  ==========================================  ==============================

(``in_features``/``out_features`` are the Linear's global sizes.) Without ``tokens`` these are
listed with their calls and 0 bytes.

Beside an ``ep`` axis, a dense unit's gather and reduce run over ``ep`` x ``shard`` flattened
(one group of ``ep * shard`` ranks, named ``"ep_shard"`` after the axes), an expert unit's over
``shard``; and each mixture-of-experts layer (an expert unit, its router's ``top_k`` = ``k``,
token width ``d`` = the last dim of its first weight) exchanges tokens over ``ep``:

==========  ===============================================  =================================
phase       collective                                       bytes
==========  ===============================================  =================================
forward     all-to-all of the per-expert counts (int64)      8 x experts
forward     all-to-all dispatch, then combine                N x k x d each, balanced routing
backward    the two transposed all-to-alls                   N x k x d each
==========  ===============================================  =================================

(the dispatch sends exactly ``N k`` rows whatever the routing; what comes back depends on it).

Over a ``cp`` axis each attention call (an :class:`fsdpfn.AttentionCall` given as
``attention=``: the op list cannot see inside a unit's forward) adds its key/value exchange to its
unit's ``forward`` and ``backward`` events (all-gather and reduce-scatter, or ``cp - 1`` ring
hops each way, ``2 N kv_width`` elements a hop; [Note: what attention over cp issues] in
``fsdpfn/_plan/attention.py``), after the unit's tensor-parallel ones in forward and before them
in backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, cast

import torch

from fsdpfn._plan.attention import AttentionCall
from fsdpfn._plan.axes import Role
from fsdpfn._plan.exchanges import step_exchanges
from fsdpfn._plan.placements import unit_row_roles
from fsdpfn._plan.values import PlanValues, Unit, unit_label
from fsdpfn._plan.schedule import Op, OpKind
from fsdpfn._plan.schedule import schedule as default_schedule  # ``schedule`` is an argument below
from fsdpfn._wire import wire_bytes

__all__ = [
    "Collective",
    "CollectiveCost",
    "PHASES",
    "StepOp",
    "micro_batch_ops",
    "reduces_now",
    "static_memory",
    "step_collectives",
    "step_ops",
    "totals",
    "unsharded_bytes",
    "unsharded_peak",
]

PHASES = ("forward", "backward", "optimizer")
ACCUMULATE = ("reduce", "local")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a rank issues in a step.

    Attributes:
      kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` (or ``"all_to_all"`` for
        an optimizer's).
      unit: the unit it serves (``""``: the root).
      tag: what :mod:`fsdpfn.comm` records as its tag: the unit, or the tensor-parallel module.
      role: the :class:`fsdpfn.Role` of the mesh axis it runs over.
      axis: that axis's name (``None`` when the mesh has no such axis: a group of one).
      group_size: ranks taking part.
      nbytes: the full buffer's bytes, as :class:`fsdpfn.comm.CollectiveCall` counts them.
      dtype: the element type sent.
      phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
      purpose: ``"gather"``, ``"amax"``, ``"reduce"``, ``"replicate_reduce"``, ``"tp_copy"``
        (a colwise input's gradient), ``"tp_reduce"`` (a rowwise output), ``"tp_gather"`` (a
        colwise_gather output), ``"cp_gather"``/``"cp_scatter"`` (attention's keys and values
        over cp, and their gradients), ``"cp_ring"``/``"cp_ring_grad"`` (a ring hop of them),
        or an optimizer's label.
      micro_batch: which micro-batch of the step issues it.
      op: the index of the schedule op that issues it (the gather, reduce or wait_reduce op, or
        the unit's forward/backward event for tensor-parallel ones); ``-1`` when listed without
        a schedule.
      activation: an axis's activation exchange (its bytes need ``tokens``), not a gather or
        reduce of parameters.
      overlap: how an activation exchange runs against its unit's compute: ``""`` blocking,
        ``"blocks"`` a hop the attention's next block waits for, ``"beside"`` a hop nothing
        waits for (see [Note: activation exchanges] in ``fsdpfn/_plan/exchanges.py``).

    Example:
      >>> c = Collective("all_gather", "blocks.0", "blocks.0", Role.SHARD, "shard", 4, 4096, torch.float32, "forward", "gather")
      >>> c.wire_bytes, c.activation
      (3072.0, False)
    """

    kind: str
    unit: str
    tag: str
    role: Role
    axis: str | None
    group_size: int
    nbytes: int
    dtype: torch.dtype
    phase: str
    purpose: str
    micro_batch: int = 0
    op: int = -1
    activation: bool = False
    overlap: str = ""

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends: ``(g-1)/g`` of the buffer, twice that for an all-reduce
        (:func:`fsdpfn._wire.wire_bytes`, as the counter records it)."""
        return wire_bytes(self.kind, self.group_size, self.nbytes)

    def describe(self) -> str:
        """One line: phase, kind, tag, axis, size, bytes, dtype."""
        axis = f"{self.axis}" if self.axis else self.role.value
        return f"{self.phase} {self.kind} {self.tag or unit_label(self.unit)} over {axis} ({self.group_size}), {self.nbytes} B {str(self.dtype).removeprefix('torch.')}"


def reduces_now(unit: Unit, last: bool, accumulate: str = "reduce") -> bool:
    """Whether ``unit``'s gradients are reduced in this micro-batch (``last``: the micro-batch
    that ends the step), or summed into kept full gradients instead.

    ``accumulate="reduce"`` reduces every micro-batch, except ``zero1`` units, which keep full
    gradients and reduce once per step (ZeRO-1); ``"local"`` reduces every unit only in the last.
    Only :func:`micro_batch_ops` asks it, to derive the ops of a micro-batch that does not end
    its step; the runtime, :func:`step_collectives` and the simulator read those ops.

    Example:
      >>> [reduces_now(u, last=False) for u in fsdpfn.plan(model, (2,), strategy="zero1").units][:1]
      [False]
      >>> reduces_now(plan.units[0], last=False), reduces_now(plan.units[0], last=True, accumulate="local")
      (True, True)
    """
    return last or (accumulate == "reduce" and not unit.strategy.keeps_full_grads)


def micro_batch_ops(plan: PlanValues, sched: Any, last: bool, accumulate: str = "reduce") -> tuple[Op, ...]:
    """The ops one micro-batch of a step runs: ``sched.ops`` for the micro-batch that ends the
    step (``last``), else ``sched.accumulating`` if the schedule gives it, else ``sched.ops`` with
    each unit that does not reduce now (:func:`reduces_now`) accumulating instead: its ``reduce``
    becomes ``accumulate`` and its ``wait_reduce`` and ``copy_out`` go (see [Note: micro-batches
    that do not end the step]). The runtime executes these ops; :func:`step_ops` expands them.

    Example:
      >>> zero1 = fsdpfn.plan(model, (2,), strategy="zero1")
      >>> ops = micro_batch_ops(zero1, runtime.schedule(zero1), last=False)
      >>> sorted({op.kind.value for op in ops} & {"reduce", "wait_reduce", "accumulate"})
      ['accumulate']
    """
    ops = tuple(
        op if isinstance(op, Op) else Op(op.kind, op.unit) for op in (sched.ops if hasattr(sched, "ops") else sched)
    )
    if last:
        return ops
    given = getattr(sched, "accumulating", None)
    if given is not None:
        return tuple(given)
    keep = {u.name for u in plan.units if not reduces_now(u, False, accumulate)}
    out = []
    for op in ops:
        if op.unit in keep and op.kind is OpKind.REDUCE:
            out.append(Op(OpKind.ACCUMULATE, op.unit))
        elif not (op.unit in keep and op.kind in (OpKind.WAIT_REDUCE, OpKind.COPY_OUT)):
            out.append(op)
    return tuple(out)


def _group(plan: PlanValues, unit: Unit, role: Role) -> tuple[str | None, int]:
    """``(axis name, ranks)`` a collective of ``unit`` over ``role`` runs on. A unit's own
    gathers and reduces (``role`` shard) run over the axes its rows are cut over
    (:func:`unit_row_roles`), flattened into one group named after them, in mesh order, when
    there are several (dense units beside ep or cp); every other role is its axis."""
    rows = unit_row_roles(unit, plan.axes) if role is Role.SHARD else ()
    if len(rows) > 1:
        return "_".join(plan.axes.names[cast(int, plan.axes.dim(r))] for r in rows), math.prod(
            plan.axes.size(r) for r in rows
        )
    d = plan.axes.dim(role)
    return (None, 1) if d is None else (plan.axes.names[d], plan.axes.shape[d])


def _unit_gather(plan: PlanValues, unit: Unit) -> list[tuple]:
    """``(kind, role, nbytes, dtype, purpose)`` of one gather of ``unit``, sized by its codec."""
    codec = plan.gather_codec(unit)
    out = []
    for role in codec.amax_roles:
        out.append(("all_reduce", role, 4 * len(codec.amax_params), torch.float32, "amax"))
    if codec.numel:
        out.append(("all_gather", Role.SHARD, unit.shard_size * codec.nbytes, codec.wire_dtype, "gather"))
    return out


def _unit_reduce(plan: PlanValues, unit: Unit) -> tuple[list[tuple], list[tuple]]:
    """``(at reduce, at wait_reduce)``: the collectives of one reduce of ``unit``, sized by its
    codec (the wire dtype crosses the reduce; HSDP's replicate all-reduce runs on the sum, in the
    accumulation dtype)."""
    codec = plan.reduce_codec(unit)
    n, wire, accum = codec.numel, codec.wire_dtype, codec.accum_dtype
    if not n:
        return [], []
    first = (
        ("reduce_scatter", Role.SHARD, unit.shard_size * n * wire.itemsize, wire, "reduce")
        if unit.sharded
        else ("all_reduce", Role.SHARD, n * wire.itemsize, wire, "reduce")
    )
    second = [("all_reduce", Role.REPLICATE, n * accum.itemsize, accum, "replicate_reduce")] if plan.hsdp else []
    return [first], second


@dataclasses.dataclass(frozen=True)
class StepOp:
    """One op of a schedule as one micro-batch of a step runs it, with what it issues.

    Attributes:
      micro_batch: which micro-batch of the step runs it.
      index: its index in its micro-batch's ops (:func:`micro_batch_ops`: the schedule's ops in
        the micro-batch that ends the step).
      op: the :class:`fsdpfn.runtime.Op`.
      phase: ``"forward"`` until the first backward event of the micro-batch, then ``"backward"``.
      reduces: ``True`` for a ``reduce``/``wait_reduce``/``copy_out`` (they are in the
        micro-batch's ops only where it reduces, :func:`micro_batch_ops`); ``False`` for other ops.
      collectives: what the op issues when it is reached (an event: before the actions after it).
      with_compute: an event's activation collectives, issued while its unit computes, after the
        actions that follow the event (tensor-parallel modules, an expert layer's combine).
    """

    micro_batch: int
    index: int
    op: Op
    phase: str
    reduces: bool = False
    collectives: tuple[Collective, ...] = ()
    with_compute: tuple[Collective, ...] = ()


def _check_step_args(micro_batches: int, accumulate: str, tokens: int | None) -> None:
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise ValueError(
            f"tokens must be None or an int >= 0 (tokens per rank per micro-batch: batch x sequence), got {tokens!r}"
        )


def step_ops(
    plan: PlanValues,
    sched: Any,
    *,
    micro_batches: int = 1,
    accumulate: str = "reduce",
    tokens: int | None = None,
    indexed: bool = True,
    attention: Iterable[AttentionCall] = (),
) -> tuple[StepOp, ...]:
    """The ops of ``sched`` (a :class:`fsdpfn.runtime.Schedule`, or anything with ``ops`` of
    ``kind`` and ``unit``) as each micro-batch of a step runs them, each with the collectives it
    issues (see [Note: what a step issues]). :func:`step_collectives` is their collectives in
    order; the simulator times them op by op. Each micro-batch runs :func:`micro_batch_ops` (a
    micro-batch that does not end the step has ``accumulate`` ops where gradients are summed
    locally) and ``index`` points into those. ``indexed=False`` lists each collective with ``op=-1``.
    ``attention``: the step's attention calls (:class:`fsdpfn.AttentionCall`), whose key/value
    exchange over a cp axis their units' events issue.

    Example:
      >>> ops = step_ops(plan, fsdpfn.runtime.schedule(plan))
      >>> [(str(s.op), s.phase, [c.kind for c in s.collectives]) for s in ops][:2]
      [('forward <root>', 'forward', []), ('gather <root>', 'forward', ['all_gather'])]
    """
    _check_step_args(micro_batches, accumulate, tokens)
    units = {u.name: u for u in plan.units}
    exchanges = step_exchanges(plan, attention)
    ntok = 0 if tokens is None else tokens
    backward_events = (OpKind.BACKWARD, OpKind.BACKWARD_DONE, OpKind.END)

    def listed(entries, unit: str, phase: str, m: int, i: int) -> tuple[Collective, ...]:
        out = []
        for kind, role, nbytes, dtype, purpose, *rest in entries:
            name, size = _group(plan, units[unit], role)
            tag, activation, overlap = rest if rest else (unit, False, "")
            out.append(
                Collective(
                    kind,
                    unit,
                    tag,
                    role,
                    name,
                    size,
                    int(nbytes),
                    dtype,
                    phase,
                    purpose,
                    m,
                    i if indexed else -1,
                    activation,
                    overlap,
                )
            )
        return tuple(out)

    def exchanged(unit: Unit, event: OpKind, phase: str, m: int, i: int) -> tuple[tuple, tuple]:
        """``(at the event, while the unit computes)``: the event's activation exchanges."""
        entries = exchanges(unit, event, ntok)
        rows = [(e.kind, e.role, e.nbytes, e.dtype, e.purpose, e.tag, True, e.overlap) for e in entries]
        now = [r for r, e in zip(rows, entries) if e.at_event]
        later = [r for r, e in zip(rows, entries) if not e.at_event]
        return listed(now, unit.name, phase, m, i), listed(later, unit.name, phase, m, i)

    out: list[StepOp] = []
    for m in range(micro_batches):
        phase = "forward"
        for i, op in enumerate(micro_batch_ops(plan, sched, m == micro_batches - 1, accumulate)):
            kind, name = op.kind, op.unit
            unit = units.get(name)
            if kind in backward_events:
                phase = "backward"
            now: tuple[Collective, ...] = ()
            later: tuple[Collective, ...] = ()
            reduces = False
            if unit is not None and op.is_event:
                now, later = exchanged(unit, kind, phase, m, i)
            elif unit is not None and kind is OpKind.GATHER:
                now = listed(_unit_gather(plan, unit), name, phase, m, i)
            elif unit is not None and kind in (OpKind.REDUCE, OpKind.WAIT_REDUCE, OpKind.COPY_OUT):
                reduces = True  # the op is there: this micro-batch reduces the unit
                if kind is not OpKind.COPY_OUT:
                    now = listed(_unit_reduce(plan, unit)[kind is OpKind.WAIT_REDUCE], name, phase, m, i)
            out.append(StepOp(m, i, op, phase, reduces, now, later))
    return tuple(out)


def _in_issue_order(ops: Iterable[StepOp]) -> Iterable[Collective]:
    """The collectives of ``ops`` as a rank issues them: an event's ``with_compute`` ones after
    the actions that follow it, before the next event's."""
    pending: tuple[Collective, ...] = ()
    micro_batch = 0
    for s in ops:
        if s.op.is_event or s.micro_batch != micro_batch:
            yield from pending
            pending = ()
        micro_batch = s.micro_batch
        yield from s.collectives
        if s.op.is_event:
            pending = s.with_compute
    yield from pending


def step_collectives(
    plan: PlanValues,
    *,
    schedule: Any = None,
    reshard_after_forward: bool | None = None,
    micro_batches: int = 1,
    accumulate: str = "reduce",
    tokens: int | None = None,
    attention: Iterable[AttentionCall] = (),
) -> tuple[Collective, ...]:
    """Every collective one rank issues in a training step of ``plan``, in issue order (see
    [Note: what a step issues]): the collectives of the schedule's ops (:func:`step_ops`).

    Args:
      plan: the plan (bound or abstract).
      schedule: a :class:`fsdpfn.runtime.Schedule` (or anything with ``ops`` of ``kind`` and
        ``unit``), default or hand-edited; each entry then names the op that issues it.
        Default: :func:`fsdpfn.runtime.schedule` of ``plan`` with ``prefetch=0`` and
        ``reshard_after_forward`` (prefetch moves gathers earlier but never adds or removes
        one), each entry listed with ``op=-1``.
      reshard_after_forward: as :func:`fsdpfn.runtime.schedule` (``None``: every ``zero3`` unit
        but the root is gathered again in backward); ignored with a ``schedule``.
      micro_batches: micro-batches per step, each running the whole schedule.
      accumulate: ``"reduce"`` or ``"local"``, as :class:`fsdpfn.runtime.Runtime`'s: which units
        accumulate in the micro-batches that do not end the step, unless the schedule lists them
        (:func:`micro_batch_ops`; ``zero1`` units accumulate locally either way).
      tokens: tokens per rank per micro-batch (batch x sequence on one rank), for the bytes of
        tensor-parallel activation collectives; ``None``: they are listed with 0 bytes.
      attention: the step's attention calls (:class:`fsdpfn.AttentionCall`, e.g.
        ``fsdpfn.sim.profile(...).attention``): on a plan with a cp axis, their key/value
        exchange (sized by ``tokens``).

    Returns:
      a tuple of :class:`Collective`.

    Example:
      >>> calls = step_collectives(fsdpfn.plan(model, (4,)))
      >>> [(c.phase, c.kind, unit_label(c.unit)) for c in calls][:4]
      [('forward', 'all_gather', '<root>'), ('forward', 'all_gather', 'blocks.0'), ('forward', 'all_gather', 'blocks.1'), ('backward', 'all_gather', 'blocks.1')]
      >>> totals(calls)["reduce_scatter"].calls
      3
    """
    _check_step_args(micro_batches, accumulate, tokens)
    indexed = schedule is not None
    if schedule is None:
        schedule = default_schedule(plan, 0, reshard_after_forward)
    ops = step_ops(
        plan,
        schedule,
        micro_batches=micro_batches,
        accumulate=accumulate,
        tokens=tokens,
        indexed=indexed,
        attention=attention,
    )
    return tuple(_in_issue_order(ops))


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """Calls, full-buffer bytes and bytes sent per rank of some collectives."""

    calls: int = 0
    nbytes: int = 0
    wire_bytes: float = 0.0

    def __add__(self, other: "CollectiveCost") -> "CollectiveCost":
        return CollectiveCost(self.calls + other.calls, self.nbytes + other.nbytes, self.wire_bytes + other.wire_bytes)


def totals(calls: Iterable[Collective], key=lambda c: c.kind) -> dict:
    """``{key(c): CollectiveCost}`` over ``calls`` (default: per kind), keys in first-seen order.

    Example:
      >>> t = totals(step_collectives(fsdpfn.plan(model, (4,))), key=lambda c: (c.phase, c.kind))
      >>> sorted(t)
      [('backward', 'all_gather'), ('backward', 'reduce_scatter'), ('forward', 'all_gather')]
    """
    out: dict = {}
    for c in calls:
        k = key(c)
        out[k] = out.get(k, CollectiveCost()) + CollectiveCost(1, c.nbytes, c.wire_bytes)
    return out


def static_memory(plan: PlanValues) -> dict[str, int]:
    """Bytes one rank holds between steps, per unit summed: ``params`` (its master shards, the
    largest rank's), ``grads`` (sharded for ``zero2``/``zero3``; full for ``zero1``, whose full
    gradients are kept across micro-batches, and ``replicate``), ``optimizer_state_per_slot``
    (one slot shaped like the master shards). Tensor-parallel parameters count their tp-local part.

    Example:
      >>> zero1, zero3 = (static_memory(fsdpfn.plan(model, (2,), strategy=s)) for s in ("zero1", "zero3"))
      >>> zero1["params"] == zero3["params"] == zero3["grads"], zero1["grads"] > zero3["grads"]
      (True, True)
    """
    params = grads = 0
    for unit in plan.units:
        master = sum(p.numel * p.dtype.itemsize for p in unit.params)
        local = unit.local_numel * unit.params[0].dtype.itemsize
        params += local
        grads += master if not unit.sharded or unit.strategy.keeps_full_grads else local
    return {"params": params, "grads": grads, "optimizer_state_per_slot": params}


def unsharded_bytes(plan: PlanValues, ops: Iterable[Any]) -> tuple[int, ...]:
    """Bytes of unsharded parameters alive after each of ``ops`` (schedule ops or
    :class:`StepOp` s): a unit counts, in its gather dtype, from its ``gather`` to its ``free``,
    as the runtime's :class:`fsdpfn.runtime.MemoryTracker` counts it. The one walk of a step's
    unsharded memory: ``plan.cost()`` and the simulator read it.

    Example:
      >>> ops = runtime.schedule(plan, prefetch=0).ops
      >>> live = unsharded_bytes(plan, ops)
      >>> live[-1], max(live) == unsharded_peak(plan, ops)
      (0, True)
    """
    size = {u.name: u.numel * plan.gather_dtype(u).itemsize for u in plan.units}
    live: dict[str, int] = {}
    out = []
    for s in ops:
        op = s.op if isinstance(s, StepOp) else s
        if op.kind is OpKind.GATHER:
            live[op.unit] = size[op.unit]
        elif op.kind is OpKind.FREE:
            live.pop(op.unit, None)
        out.append(sum(live.values()))
    return tuple(out)


def unsharded_peak(plan: PlanValues, ops: Iterable[Any]) -> int:
    """The most bytes of unsharded parameters alive at once over ``ops`` (:func:`unsharded_bytes`):
    the runtime's ``rt.memory.high_water`` for a step that runs them."""
    return max(unsharded_bytes(plan, ops), default=0)
