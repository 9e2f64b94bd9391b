"""Pipeline schedules as data: one op list per pp rank, FSDP's gathers and reduces inside it.

A :class:`PipelineSchedule` holds, for every pp rank, the ordered ops that rank runs in one
training step of ``micro_batches`` micro-batches. It is generated (:func:`pipeline_schedule`:
GPipe, 1F1B, interleaved 1F1B, zero bubble), prints, parses back from its printed form, can be
edited by hand and is checked by :func:`validate_pipeline`, which runs every rank's list together.

[Note: pipeline ops]
Stage ops, ``<kind> s<stage> m<micro-batch>``::

    stage_forward s m   run stage s's forward on micro-batch m
    stage_backward s m  run its backward (gradients reach the stage's input and parameters)
    stage_backward_input s m   the first half of a split backward: the gradient of the stage's
                        input only (what stage s - 1 waits for)
    stage_backward_weight s m  the second half: the gradients of the stage's parameters (which
                        nothing downstream waits for; the zero-bubble schedule defers them)
    send_act s m        send stage s's output activation of m to the rank of stage s + 1
    recv_act s m        receive stage s's input activation of m from the rank of stage s - 1
    send_grad s m       send the gradient of stage s's input to the rank of stage s - 1
    recv_grad s m       receive the gradient of stage s's output from the rank of stage s + 1

``send_act s m`` is received by ``recv_act s+1 m``, ``send_grad s m`` by ``recv_grad s-1 m``
(the transpose of sending an activation is receiving its gradient). A send starts an
asynchronous transfer and does not wait; a recv waits for its data. Between one pair of ranks,
messages are received in the order they were sent, so the k-th recv a rank posts from a peer
takes the k-th send that peer posts to it. Consecutive stages on one rank (one pp rank) pass
activations in memory, with no ops.

Between them, FSDP's actions on the stage's units (``gather u``, ``wait u``, ``free u``,
``reduce u``, ``wait_reduce u``, ``copy_in u``, ``copy_out u``; see [Note: schedule ops and
events] in ``schedule.py``), in the order :func:`fsdpfn._plan.schedule.unit_ops` issues them for
the stage's units: its forward's gathers and waits before the stage's first ``stage_forward``,
its backward's frees and reduces after its last ``stage_backward`` (or
``stage_backward_weight``). That is the generated
policy (parameters stay unsharded through the step's micro-batches, gradients are accumulated
locally and reduced once per stage at the end of the step, as torchtitan runs FSDP under
pipelining), and it is in the list to be read or edited, not hidden in the runtime.

The validator's rules: every op is on the rank of its stage; each stage runs forward and backward
once per micro-batch, in order, the backward either whole (``stage_backward``) or as one
``stage_backward_input`` then one ``stage_backward_weight``, never both; an activation or
gradient is received (or computed on the same rank) before it is used, and computed before it
is sent (``send_grad`` after the input half); every recv has a matching send on its peer, in
order, and every send a recv; run together, no rank waits forever (a deadlock names
each waiting rank's op); a unit is gathered and waited for whenever its stage computes, reduced
once after its stage's last backward (its last parameter gradients: a split backward's
weight half), and freed by the end.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Union, cast

from fsdpfn._plan.schedule import (
    UNIT_FINAL_RULES,
    UNIT_RULES,
    GradState,
    Op,
    OpKind,
    ScheduleError,
    UnitState,
    Walk,
    unit_ops,
)
from fsdpfn._plan.stages import Stages
from fsdpfn._plan.values import ROOT, ROOT_LABEL, PlanValues, unit_label

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipeKind",
    "PipeOp",
    "PipelineSchedule",
    "forward_only",
    "pipeline_schedule",
    "run_order",
    "validate_pipeline",
]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class PipeKind(enum.Enum):
    """A stage op's kind (see [Note: pipeline ops]).

    Example:
      >>> PipeKind("send_act"), PipeKind.RECV_GRAD.is_recv, PipeKind.STAGE_FORWARD.is_compute
      (<PipeKind.SEND_ACT: 'send_act'>, True, True)
      >>> [(k.computes_input_grad, k.computes_weight_grad) for k in (PipeKind.STAGE_BACKWARD,
      ...  PipeKind.STAGE_BACKWARD_INPUT, PipeKind.STAGE_BACKWARD_WEIGHT)]
      [(True, True), (True, False), (False, True)]
    """

    STAGE_FORWARD = "stage_forward"
    STAGE_BACKWARD = "stage_backward"
    STAGE_BACKWARD_INPUT = "stage_backward_input"
    STAGE_BACKWARD_WEIGHT = "stage_backward_weight"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        return self in (
            PipeKind.STAGE_FORWARD,
            PipeKind.STAGE_BACKWARD,
            PipeKind.STAGE_BACKWARD_INPUT,
            PipeKind.STAGE_BACKWARD_WEIGHT,
        )

    @property
    def computes_input_grad(self) -> bool:
        """A backward that produces the gradient of the stage's input (what ``send_grad`` sends)."""
        return self in (PipeKind.STAGE_BACKWARD, PipeKind.STAGE_BACKWARD_INPUT)

    @property
    def computes_weight_grad(self) -> bool:
        """A backward that completes the stage's parameter gradients of its micro-batch."""
        return self in (PipeKind.STAGE_BACKWARD, PipeKind.STAGE_BACKWARD_WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (PipeKind.SEND_ACT, PipeKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (PipeKind.RECV_ACT, PipeKind.RECV_GRAD)


@dataclasses.dataclass(frozen=True)
class PipeOp:
    """A stage op: ``kind`` on ``stage`` and micro-batch ``micro``.

    Example:
      >>> op = PipeOp("send_act", 0, 3)
      >>> str(op), op.peer_stage, op.partner()
      ('send_act s0 m3', 1, PipeOp(kind=<PipeKind.RECV_ACT: 'recv_act'>, stage=1, micro=3))
    """

    kind: PipeKind
    stage: int
    micro: int

    def __post_init__(self):
        if not isinstance(self.kind, PipeKind):
            try:
                object.__setattr__(self, "kind", PipeKind(self.kind))
            except ValueError:
                raise ScheduleError(
                    f"unknown pipeline op kind {self.kind!r}; choose one of {', '.join(k.value for k in PipeKind)}"
                ) from None
        for field in ("stage", "micro"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"{self.kind.value}: {field} must be an int >= 0, got {value!r}")

    @property
    def peer_stage(self) -> int:
        """The stage on the other end of a send or recv (the next stage for activations, the
        previous one for gradients)."""
        forward = self.kind in (PipeKind.SEND_ACT, PipeKind.RECV_GRAD)
        return self.stage + 1 if forward else self.stage - 1

    def partner(self) -> "PipeOp":
        """The op on the peer that a send or recv pairs with."""
        swap = {
            PipeKind.SEND_ACT: PipeKind.RECV_ACT,
            PipeKind.RECV_ACT: PipeKind.SEND_ACT,
            PipeKind.SEND_GRAD: PipeKind.RECV_GRAD,
            PipeKind.RECV_GRAD: PipeKind.SEND_GRAD,
        }
        return PipeOp(swap[self.kind], self.peer_stage, self.micro)

    def __str__(self) -> str:
        return f"{self.kind.value} s{self.stage} m{self.micro}"


AnyOp = Union[PipeOp, Op]
_FSDP_ACTIONS = frozenset(
    {OpKind.GATHER, OpKind.WAIT, OpKind.FREE, OpKind.REDUCE, OpKind.WAIT_REDUCE, OpKind.COPY_IN, OpKind.COPY_OUT}
)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Every pp rank's ops for one step (see [Note: pipeline ops]).

    Attributes:
      name: the generator (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``) or
        any label.
      plan_fingerprint: the plan it was made for; ``"-"`` for one made from bare :class:`fsdpfn.Stages`.
      pp_size: pp ranks; stage ``s`` runs on rank ``s % pp_size``.
      num_stages: stages (``pp_size`` x virtual stages per rank).
      micro_batches: micro-batches per step.
      ranks: ``ranks[r]``: rank r's ops, each a :class:`PipeOp` or an FSDP action ``Op``.

    Example:
      >>> ps = pipeline_schedule(Stages((("a",), ("b",)), 2), "gpipe", 2)
      >>> print(ps)
      Pipeline schedule gpipe for plan - (pp=2, stages=2, micro_batches=2):
      rank 0:
        0  stage_forward s0 m0
        1      send_act s0 m0  # to rank 1
        2  stage_forward s0 m1
        3      send_act s0 m1  # to rank 1
        4      recv_grad s0 m0  # from rank 1
        5  stage_backward s0 m0
        6      recv_grad s0 m1  # from rank 1
        7  stage_backward s0 m1
      rank 1:
        0      recv_act s1 m0  # from rank 0
        1  stage_forward s1 m0
        2      recv_act s1 m1  # from rank 0
        3  stage_forward s1 m1
        4  stage_backward s1 m0
        5      send_grad s1 m0  # to rank 0
        6  stage_backward s1 m1
        7      send_grad s1 m1  # to rank 0
      >>> PipelineSchedule.from_str(str(ps)) == ps
      True
    """

    name: str
    plan_fingerprint: str
    pp_size: int
    num_stages: int
    micro_batches: int
    ranks: tuple[tuple[AnyOp, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(tuple(ops) for ops in self.ranks))
        for name in ("pp_size", "num_stages", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"PipelineSchedule: {name} must be an int >= 1, got {value!r}")
        if self.num_stages % self.pp_size:
            raise ScheduleError(
                f"PipelineSchedule: {self.num_stages} stages over {self.pp_size} pp ranks; the stages must be a "
                "multiple of the pp size"
            )
        if len(self.ranks) != self.pp_size:
            raise ScheduleError(
                f"PipelineSchedule: {len(self.ranks)} op lists for pp={self.pp_size}; give one per pp rank"
            )
        for r, ops in enumerate(self.ranks):
            for i, op in enumerate(ops):
                if not isinstance(op, (PipeOp, Op)):
                    raise ScheduleError(f"rank {r} op #{i}: {op!r} is neither a PipeOp nor an Op")

    def rank_of(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        return stage % self.pp_size

    def peer(self, op: PipeOp) -> int:
        """The rank a send goes to or a recv comes from."""
        return self.rank_of(op.peer_stage)

    def __str__(self) -> str:
        lines = [
            f"Pipeline schedule {self.name} for plan {self.plan_fingerprint} (pp={self.pp_size}, stages={self.num_stages}, "
            f"micro_batches={self.micro_batches}):"
        ]
        for r, ops in enumerate(self.ranks):
            lines.append(f"rank {r}:")
            width = len(str(max(len(ops) - 1, 0)))
            for i, op in enumerate(ops):
                compute = isinstance(op, PipeOp) and op.kind.is_compute
                note = ""
                if isinstance(op, PipeOp) and not compute:
                    note = f"  # {'to' if op.kind.is_send else 'from'} rank {self.peer(op)}"
                lines.append(f"  {i:>{width}}{'  ' if compute else '      '}{op}{note}")
        return "\n".join(lines)

    @classmethod
    def from_str(cls, text: str) -> "PipelineSchedule":
        """Parses :meth:`__str__`'s output; op numbers and ``#`` comments are optional and
        ignored, so a printed schedule can be edited as text and loaded back."""
        lines = [ln.split("#", 1)[0].strip() for ln in text.strip().splitlines()]
        head = (
            re.match(
                r"Pipeline schedule (\S+) for plan (\S+) \(pp=(\d+), stages=(\d+), micro_batches=(\d+)\):", lines[0]
            )
            if lines
            else None
        )
        if head is None:
            raise ScheduleError(
                "pipeline schedule text must start with 'Pipeline schedule <name> for plan <fingerprint> "
                "(pp=<p>, stages=<s>, micro_batches=<m>):'"
            )
        ranks: list[list[AnyOp]] = []
        for n, ln in enumerate(lines[1:], start=2):
            if not ln:
                continue
            rank = re.fullmatch(r"rank (\d+):", ln)
            if rank:
                if int(rank.group(1)) != len(ranks):
                    raise ScheduleError(f"line {n}: 'rank {rank.group(1)}:' out of order; list ranks 0, 1, ... in turn")
                ranks.append([])
                continue
            if not ranks:
                raise ScheduleError(f"line {n}: {ln!r} comes before any 'rank <r>:' line")
            parts = ln.split()
            if parts[0].isdigit():
                parts = parts[1:]
            stage_op = re.fullmatch(r"s(\d+) m(\d+)", " ".join(parts[1:]))
            if len(parts) == 3 and stage_op:
                ranks[-1].append(
                    PipeOp(
                        PipeKind(parts[0]) if parts[0] in _PIPE_NAMES else parts[0],  # type: ignore[arg-type]
                        int(stage_op.group(1)),
                        int(stage_op.group(2)),
                    )
                )
            elif len(parts) == 2 and parts[0] not in _PIPE_NAMES:
                ranks[-1].append(
                    Op(
                        OpKind(parts[0]) if parts[0] in _OP_NAMES else parts[0],  # type: ignore[arg-type]
                        ROOT if parts[1] == ROOT_LABEL else parts[1],
                    )
                )
            else:
                raise ScheduleError(
                    f"line {n}: cannot parse {ln!r}; expected '<kind> s<stage> m<micro-batch>' or '<action> <unit>'"
                )
        p, s, m = (int(head.group(i)) for i in (3, 4, 5))
        return cls(head.group(1), head.group(2), p, s, m, tuple(tuple(ops) for ops in ranks))


_PIPE_NAMES = frozenset(k.value for k in PipeKind)
_OP_NAMES = frozenset(k.value for k in OpKind)


# ---- generators ---------------------------------------------------------------------------------


def _compute_order(name: str, p: int, v: int, m: int, r: int) -> list[tuple[PipeKind, int, int]]:
    """Rank r's forwards and backwards, ``(kind, stage, micro-batch)`` in the order it runs them."""
    F, B = PipeKind.STAGE_FORWARD, PipeKind.STAGE_BACKWARD
    stages = list(range(r, p * v, p))
    if name == "gpipe":  # every forward, then every backward (last stage first)
        return [(F, s, i) for s in stages for i in range(m)] + [(B, s, i) for s in reversed(stages) for i in range(m)]
    if name == "zero_bubble":
        return _zero_bubble_order(p, m, r)
    total = m * v

    def pick(k: int, kind: PipeKind) -> tuple[PipeKind, int, int]:
        # Megatron's interleaving: p micro-batches through one virtual stage, then the next.
        chunk = (k // p) % v
        if kind is B:
            chunk = v - 1 - chunk
        return (kind, chunk * p + r, (k // (p * v)) * p + k % p)

    # Warm-up forwards: enough that the last stage has work the moment its first forward can run.
    warmup = min(total, p - r - 1 if v == 1 else (p - r - 1) * 2 + (v - 1) * p)
    order = [pick(k, F) for k in range(warmup)]
    for k in range(total - warmup):
        order += [pick(warmup + k, F), pick(k, B)]
    return order + [pick(k, B) for k in range(total - warmup, total)]


def _zero_bubble_order(p: int, m: int, r: int) -> list[tuple[PipeKind, int, int]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) on rank r: 1F1B's forwards
    and input gradients, each micro-batch's weight gradient deferred by ``r`` micro-batches.

    [Note: the zero-bubble schedule]
    In 1F1B the gradient of micro-batch k reaches rank r only after every later stage ran its
    whole backward of k. Split, only the input half is on that path: the weight half of k can
    wait. Rank r runs 1F1B's warm-up (``p - r - 1`` forwards), then per step one forward, one
    input half, and the weight half of the micro-batch ``r`` before; after its last forward, an
    input half then a deferred weight half; the remaining weight halves last. Deferring ``r`` on
    rank r is what makes every rank finish together: the last rank (``r = p - 1``) runs ``F B``
    pairs for its first ``p - 1`` micro-batches, so gradients start flowing back a weight half
    sooner per micro-batch, and rank r's ``r + 1`` trailing weight halves fill what in 1F1B is
    its cool-down wait for gradients. A micro-batch's activations live from its forward to its
    weight half (that half needs the stage's inputs), so rank r keeps ``(p - r) + r = p`` at
    once: every rank holds rank 0's 1F1B peak, and no rank more.

    The bubble, with forward ``f``, input half ``b`` and weight half ``w`` per stage, no transfer
    time and ``m >= p``: each rank computes ``m (f + b + w)`` of a makespan
    ``m (f + b + w) + (p - 1) max(f + b - w, f, b)``. Two of the terms are waits no order can
    avoid: the last rank's first input arrives after ``p - 1`` forwards, and rank 0, done with
    the ``p`` forwards it runs before its first input half, waits ``p - 1`` input halves (one
    per later rank) for that half's gradient; every rank computes the same ``m (f + b + w)``, so
    a wait of one rank's lengthens the step by as much. The third is
    the ZB-H1 paper's ``(p - 1)(f + b - w)``: the weight halves that rank 0 and the last rank
    cannot place in a wait. The largest of the three is what ``pipeline_times`` gives on every
    (``p``, ``m >= p``, ``f``, ``b``, ``w``) the tests try. With ``f = b = w = 1`` each rank idles
    ``p - 1`` of ``3m + p - 1``, where 1F1B (``b + w = 2``) idles ``3 (p - 1)`` of
    ``3 (m + p - 1)``: the bubble ``(p - 1) / (3m + p - 1)``. (With fewer micro-batches than
    stages the step is the last micro-batch's round trip: ``2m + 2p - 1`` at ``f = b = w = 1``.)
    """
    F, BI, BW = PipeKind.STAGE_FORWARD, PipeKind.STAGE_BACKWARD_INPUT, PipeKind.STAGE_BACKWARD_WEIGHT
    warmup = min(m, p - r - 1)
    order = [(F, r, i) for i in range(warmup)]
    weights = 0  # weight halves issued so far, in micro-batch order
    for k in range(m):
        if warmup + k < m:
            order.append((F, r, warmup + k))
        order.append((BI, r, k))
        if k - weights >= r:  # keep exactly r input halves ahead of the weight halves
            order.append((BW, r, weights))
            weights += 1
    return order + [(BW, r, i) for i in range(weights, m)]


def _with_p2p(order: list[tuple[PipeKind, int, int]], p: int, num_stages: int) -> list[PipeOp]:
    """Each recv right before the op that uses what it brings, each send right after the op that
    computes it; none between stages on one rank."""
    F = PipeKind.STAGE_FORWARD
    ops: list[PipeOp] = []
    for kind, s, i in order:
        if kind is F:
            if s > 0 and (s - 1) % p != s % p:
                ops.append(PipeOp(PipeKind.RECV_ACT, s, i))
            ops.append(PipeOp(kind, s, i))
            if s < num_stages - 1 and (s + 1) % p != s % p:
                ops.append(PipeOp(PipeKind.SEND_ACT, s, i))
        elif kind is PipeKind.STAGE_BACKWARD_WEIGHT:  # nothing arrives for it, nothing leaves
            ops.append(PipeOp(kind, s, i))
        else:
            if s < num_stages - 1 and (s + 1) % p != s % p:
                ops.append(PipeOp(PipeKind.RECV_GRAD, s, i))
            ops.append(PipeOp(kind, s, i))
            if s > 0 and (s - 1) % p != s % p:
                ops.append(PipeOp(PipeKind.SEND_GRAD, s, i))
    return ops


def _with_fsdp(ops: list[PipeOp], plan: PlanValues, stages: Stages, prefetch: int) -> list[AnyOp]:
    """Each stage's FSDP actions from the one builder (see [Note: pipeline ops]): its forward's
    before the stage's first forward, its backward's after its last backward."""
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    for s in {op.stage for op in ops}:
        unit_list = unit_ops(plan, set(stages.units[s]), prefetch, reshard_after_forward=False)
        first_back = next(i for i, op in enumerate(unit_list) if op.kind is OpKind.BACKWARD)
        before[s] = [op for op in unit_list[:first_back] if not op.is_event]
        after[s] = [op for op in unit_list[first_back:] if not op.is_event]
    # The gathers start before the recv that feeds the stage's first forward (they overlap it);
    # the reduces start after the send of the last gradient (the peer is waiting for it).
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind is PipeKind.STAGE_FORWARD and op.stage not in first:
            first[op.stage] = i - 1 if i and ops[i - 1] == PipeOp(PipeKind.RECV_ACT, op.stage, op.micro) else i
        if op.kind.computes_weight_grad:
            sends = i + 1 < len(ops) and ops[i + 1] == PipeOp(PipeKind.SEND_GRAD, op.stage, op.micro)
            last[op.stage] = i + 1 if sends else i
    out: list[AnyOp] = []
    for i, op in enumerate(ops):
        out += [a for s, at in first.items() if at == i for a in before[s]]
        out.append(op)
        out += [a for s, at in last.items() if at == i for a in after[s]]
    return out


def pipeline_schedule(
    plan_or_stages: "PlanValues | Stages", name: str = "1f1b", micro_batches: int = 8, *, prefetch: int = 1
) -> PipelineSchedule:
    """Generates every pp rank's op list for one step of ``micro_batches`` micro-batches.

    Args:
      plan_or_stages: a pipelined plan (a mesh with a ``pp`` axis; its stages' FSDP gathers,
        frees and reduces join the lists), or bare :class:`fsdpfn.Stages` (stage ops only).
      name: ``"gpipe"`` (every forward, then every backward; activations of all ``m``
        micro-batches live at once), ``"1f1b"`` (after a warm-up, one forward then one
        backward: at most ``p`` micro-batches' activations live; one stage per rank) or
        ``"interleaved_1f1b"`` (1F1B over ``v`` virtual stages per rank, Megatron's order:
        the bubble shrinks ``v``-fold; ``micro_batches`` a multiple of ``p``) or ``"zero_bubble"``
        (ZB-H1: 1F1B with each backward split into ``stage_backward_input`` and
        ``stage_backward_weight``, the weight halves deferred into the cool-down; 1F1B's peak
        activations, ``p`` micro-batches; one stage per rank; see [Note: the zero-bubble schedule]).
      micro_batches: micro-batches per step, ``m``.
      prefetch: the FSDP builder's prefetch within a stage's gathers.

    Returns:
      a :class:`PipelineSchedule`; :func:`validate_pipeline` accepts it. With forward time
      ``f`` and backward ``b`` per stage, GPipe and 1F1B idle a fraction ``(p - 1) / (m + p - 1)``
      of the step (:func:`fsdpfn.pipeline_times`), interleaved 1F1B ``(p - 1) / (v m + p - 1)``; zero
      bubble, with each backward half as long as the forward, ``(p - 1) / (3 m + p - 1)``
      (``m >= p``): a third of 1F1B's idle time.

    Raises:
      ValueError: an unknown name, ``1f1b`` or ``zero_bubble`` with virtual stages, an interleaved schedule whose
        ``micro_batches`` is not a multiple of ``p``, or a plan without stages.

    Example:
      >>> ps = pipeline_schedule(Stages(tuple((f"u{s}",) for s in range(4)), 2), "interleaved_1f1b", 4)
      >>> [str(op) for op in ps.ranks[0][:4]]
      ['stage_forward s0 m0', 'send_act s0 m0', 'stage_forward s0 m1', 'send_act s0 m1']
      >>> round(fsdpfn.pipeline_times(ps, forward=0.5, backward=1.0).bubble, 4)  # (p - 1) / (v m + p - 1)
      0.1111
    """
    plan = plan_or_stages if isinstance(plan_or_stages, PlanValues) else None
    stages = plan.stages if plan is not None else plan_or_stages
    if not isinstance(stages, Stages):
        what = (
            "a plan without pipeline stages (its mesh has no 'pp' axis)"
            if plan is not None
            else type(plan_or_stages).__name__
        )
        raise ValueError(
            f"pipeline_schedule needs a pipelined plan or fsdpfn.Stages, got {what}; build the plan on a mesh with "
            "a pp axis, e.g. fsdpfn.pipeline_plan(model, {'pp': 2, 'dp': 1}, units=[...])"
        )
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    p, v, m = stages.pp_size, stages.virtual, micro_batches
    if name in ("1f1b", "zero_bubble") and v > 1:
        raise ValueError(
            f"{name} runs one stage per pp rank, but the plan has {v} virtual stages per rank "
            f"({stages.num_stages} stages over pp={p}); use 'interleaved_1f1b', or build the plan with stages={p}"
        )
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(
            f"interleaved_1f1b sends micro-batches through each virtual stage in groups of pp={p}; micro_batches="
            f"{m} is not a multiple of {p}. Use micro_batches={(m // p + 1) * p}"
        )
    ranks = []
    for r in range(p):
        ops: list[AnyOp] = list(_with_p2p(_compute_order(name, p, v, m, r), p, stages.num_stages))
        if plan is not None:
            ops = _with_fsdp(ops, plan, stages, prefetch)  # type: ignore[arg-type]
        ranks.append(tuple(ops))
    return PipelineSchedule(name, plan.fingerprint if plan is not None else "-", p, stages.num_stages, m, tuple(ranks))


def forward_only(plan: PlanValues, micro_batches: int, *, prefetch: int = 1) -> PipelineSchedule:
    """Every pp rank's op list for a forward pass alone (``PipelineRuntime.evaluate``): GPipe's forwards and
    activation transfers, each stage's gathers before its first forward and a ``free`` of each
    unit after its last, and nothing of the backward (no gradient transfers, no reduces).

    It is GPipe's list with the backward taken out, so its transfers pair up as GPipe's do (a
    recv takes its peer's send in order, checked here); :func:`validate_pipeline`, which asks
    every micro-batch for a backward, is for training lists.

    Example:
      >>> ps = forward_only(fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=["embed", "pos", "blocks.0", "blocks.1",
      ...                   "norm", "head"]), 2)
      >>> [str(op) for op in ps.ranks[1]][-5:]
      ['recv_act s1 m1', 'stage_forward s1 m1', 'free blocks.1', 'free norm', 'free head']
    """
    full = pipeline_schedule(plan, "gpipe", micro_batches, prefetch=prefetch)
    stages = cast(Stages, plan.stages)
    ranks = []
    for ops in full.ranks:
        kept: list[AnyOp] = []
        for op in ops:
            if isinstance(op, Op):
                if op.kind in (OpKind.GATHER, OpKind.WAIT):  # the forward's; frees and reduces are the backward's
                    kept.append(op)
            elif op.kind in (PipeKind.STAGE_FORWARD, PipeKind.SEND_ACT, PipeKind.RECV_ACT):
                kept.append(op)
                if op.kind is PipeKind.STAGE_FORWARD and op.micro == micro_batches - 1:
                    kept += [Op(OpKind.FREE, u) for u in stages.units[op.stage]]
        ranks.append(tuple(kept))
    ps = PipelineSchedule("forward", full.plan_fingerprint, full.pp_size, full.num_stages, micro_batches, tuple(ranks))
    _check_pairs(ps)
    return ps


# ---- the validator ------------------------------------------------------------------------------


def _fail(r: int, i: int, op: AnyOp, msg: str) -> ScheduleError:
    return ScheduleError(f"invalid pipeline schedule: rank {r} op #{i} ({op}): {msg}")


class _RankWalk(Walk):
    """One rank's list under the unit rules of the single-stage validator ([Note: one table of
    unit rules] in ``schedule.py``) and the stage rules below, its errors naming the rank. A
    unit's gradients are complete after its stage's last backward: ``backs`` counts the stages'
    backwards so far; ``done`` holds each stage op run so far, with its index."""

    def __init__(self, ps: PipelineSchedule, r: int, stages: Stages | None, offloaded: frozenset[str]):
        units = [u for names in stages.units for u in names] if stages is not None else []
        mine = tuple(u for u in units if stages is not None and ps.rank_of(stages.stage_of(u)) == r)
        super().__init__(mine, ps.ranks[r])
        self.ps, self.r, self.stages, self.all_units = ps, r, stages, units
        self.m = ps.micro_batches
        self.offloaded = offloaded & frozenset(mine)
        self.backs: dict[int, int] = {}
        self.done: dict[PipeOp, int] = {}
        # to name the op a send_grad waits for
        self.input_halves = {op for op in self.ops if isinstance(op, PipeOp) and op.kind is _BI}

    def fail(self, msg: str) -> None:
        raise _fail(self.r, self.at, self.ops[self.at], msg)

    def final(self, msg: str) -> ScheduleError:
        return ScheduleError(f"invalid pipeline schedule: rank {self.r}: {msg}")

    def complete_hint(self, unit: str) -> str:
        done = self.backs.get(self.stages.stage_of(unit), 0) if self.stages is not None else 0
        return (
            f"they are complete after its stage's last backward ({done} of {self.m} micro-batches done): "
            "move it after that"
        )

    def advance_stage(self, op: PipeOp) -> None:
        """Past a stage op: a stage's units' gradients are complete after its last backward."""
        if op.kind.computes_weight_grad:
            s = op.stage
            self.backs[s] = self.backs.get(s, 0) + 1
            if self.backs[s] == self.m:
                for u in self.stages.units[s] if self.stages is not None else ():
                    self.grads[u] = GradState.COMPLETE
        self.done[op] = self.at


_F, _B = PipeKind.STAGE_FORWARD, PipeKind.STAGE_BACKWARD
_BI, _BW = PipeKind.STAGE_BACKWARD_INPUT, PipeKind.STAGE_BACKWARD_WEIGHT


# ---- where an FSDP action may stand in a pipeline list (then the shared UNIT_RULES) ----------


def _an_fsdp_action(w: _RankWalk, op: Op) -> None:
    if op.kind not in _FSDP_ACTIONS:
        w.fail(
            "per-unit events have no place in a pipeline list (the stage ops run them); keep only "
            "gather, wait, free, reduce, wait_reduce, copy_in and copy_out"
        )
    if w.stages is None:
        w.fail("FSDP actions need a schedule made for a plan (plan fingerprint '-' has no units)")


def _unit_in_a_stage_here(w: _RankWalk, op: Op) -> None:
    if w.stages is None:  # refused by _an_fsdp_action
        return
    if op.unit not in w.all_units:
        w.fail(
            f"unit {unit_label(op.unit)!r} is not in the plan's stages; units: {', '.join(map(unit_label, w.all_units))}"
        )
    s = w.stages.stage_of(op.unit)
    if w.ps.rank_of(s) != w.r:
        w.fail(f"unit {unit_label(op.unit)!r} is in stage {s}, on rank {w.ps.rank_of(s)}; move the op there")


# ---- the stage rules: each stage op of one rank's list ---------------------------------------


def _stage_here_and_in_range(w: _RankWalk, op: PipeOp) -> None:
    s, mb, S, m = op.stage, op.micro, w.ps.num_stages, w.m
    if s >= S or mb >= m:
        w.fail(f"stage {s} / micro-batch {mb} out of range (stages 0..{S - 1}, micro-batches 0..{m - 1})")
    if w.ps.rank_of(s) != w.r:
        w.fail(
            f"stage {s} runs on rank {w.ps.rank_of(s)}, not rank {w.r}; move the op to rank {w.ps.rank_of(s)}'s list"
        )


def _peer_on_another_rank(w: _RankWalk, op: PipeOp) -> None:
    if not (op.kind.is_send or op.kind.is_recv):
        return
    s = op.stage
    if not 0 <= op.peer_stage < w.ps.num_stages:
        w.fail(f"stage {s} has no {'next' if op.peer_stage > s else 'previous'} stage to talk to; remove the op")
    if w.ps.rank_of(op.peer_stage) == w.r:
        w.fail(f"stages {s} and {op.peer_stage} are both on rank {w.r}: they pass data in memory; remove the op")


def _runs_once(w: _RankWalk, op: PipeOp) -> None:
    if op in w.done:
        w.fail(f"appears twice (first at op #{w.done[op]}); each happens once per step")


def _forward_after_its_input(w: _RankWalk, op: PipeOp) -> None:
    s, mb = op.stage, op.micro
    if op.kind is _F and s > 0:
        need = PipeOp(_F, s - 1, mb) if w.ps.rank_of(s - 1) == w.r else PipeOp(PipeKind.RECV_ACT, s, mb)
        if need not in w.done:
            w.fail(f"uses the activation of micro-batch {mb} before it arrives; put '{need}' before it")


def _backward_whole_or_halves(w: _RankWalk, op: PipeOp) -> None:
    s, mb = op.stage, op.micro
    if op.kind not in (_B, _BI, _BW):
        return
    other = [PipeOp(k, s, mb) for k in ((_BI, _BW) if op.kind is _B else (_B,)) if PipeOp(k, s, mb) in w.done]
    if other:
        w.fail(
            f"'{other[0]}' already ran (op #{w.done[other[0]]}); a micro-batch's backward is either one "
            f"'stage_backward s{s} m{mb}' or one 'stage_backward_input s{s} m{mb}' and one "
            f"'stage_backward_weight s{s} m{mb}': remove one of them"
        )


def _backward_after_forward_and_gradient(w: _RankWalk, op: PipeOp) -> None:
    s, mb = op.stage, op.micro
    if op.kind not in (_B, _BI):
        return
    if PipeOp(_F, s, mb) not in w.done:
        w.fail(f"runs before 'stage_forward s{s} m{mb}'; a backward follows its forward")
    if s < w.ps.num_stages - 1:
        if w.ps.rank_of(s + 1) == w.r:
            need = next(
                (PipeOp(k, s + 1, mb) for k in (_BI, _B) if PipeOp(k, s + 1, mb) in w.done), PipeOp(_B, s + 1, mb)
            )
        else:
            need = PipeOp(PipeKind.RECV_GRAD, s, mb)
        if need not in w.done:
            w.fail(f"uses the gradient of micro-batch {mb} before it arrives; put '{need}' before it")


def _weight_half_after_input_half(w: _RankWalk, op: PipeOp) -> None:
    s, mb = op.stage, op.micro
    if op.kind is _BW and PipeOp(_BI, s, mb) not in w.done:
        w.fail(
            f"runs before 'stage_backward_input s{s} m{mb}'; the weight half follows the input half "
            "(it reuses the output gradient the input half was seeded with)"
        )


def _send_after_its_source(w: _RankWalk, op: PipeOp) -> None:
    if not op.kind.is_send:
        return
    s, mb = op.stage, op.micro
    if op.kind is PipeKind.SEND_ACT:
        src = PipeOp(_F, s, mb)
    else:  # whichever backward the rank runs for (s, mb) computes the input gradient
        src = PipeOp(_BI if PipeOp(_BI, s, mb) in w.input_halves else _B, s, mb)
    if src not in w.done:
        w.fail(f"sends what '{src}' computes before it runs; move the send after it")


def _stage_units_gathered_for_compute(w: _RankWalk, op: PipeOp) -> None:
    if not op.kind.is_compute:
        return
    for u in w.stages.units[op.stage] if w.stages is not None else ():
        if w.params[u] is not UnitState.GATHERED:
            w.fail(
                f"stage {op.stage}'s unit {unit_label(u)!r} is not gathered and waited for; put "
                f"'gather {unit_label(u)}' and 'wait {unit_label(u)}' before it"
            )


def _every_micro_batch_runs(w: _RankWalk) -> None:
    """Each stage of the rank runs forward and backward once per micro-batch."""
    for s in _stages_on(w.ps, w.r):
        for mb in range(w.m):
            missing = PipeOp(_F, s, mb) if PipeOp(_F, s, mb) not in w.done else None
            if missing is None and PipeOp(_B, s, mb) not in w.done:
                split = [PipeOp(k, s, mb) for k in (_BI, _BW)]
                if any(o in w.done for o in split):
                    missing = next((o for o in split if o not in w.done), None)
                else:
                    missing = PipeOp(_B, s, mb)
            if missing is not None:
                raise ScheduleError(
                    f"invalid pipeline schedule: rank {w.r} never runs '{missing}'; each stage runs forward and "
                    "backward once per micro-batch (a backward whole, or its input and weight halves)"
                )


# [Note: the pipeline's rule tables]
# A rank's list holds two vocabularies. Its FSDP actions stand where the rank holds their unit,
# then follow UNIT_RULES, the single-stage validator's own table ([Note: one table of unit
# rules]). Its stage ops follow STAGE_RULES: compute after its inputs, once, whole or in halves,
# sends after what they send, a stage's units gathered while it computes. The walk's state
# (each unit's, each stage op done) is one value, _RankWalk, that every rule reads.
FSDP_ACTION_RULES = (_an_fsdp_action, _unit_in_a_stage_here, *UNIT_RULES)
STAGE_RULES = (
    _stage_here_and_in_range,
    _peer_on_another_rank,
    _runs_once,
    _forward_after_its_input,
    _backward_whole_or_halves,
    _backward_after_forward_and_gradient,
    _weight_half_after_input_half,
    _send_after_its_source,
    _stage_units_gathered_for_compute,
)
RANK_FINAL_RULES = (_every_micro_batch_runs, *UNIT_FINAL_RULES)


def _check_rank(ps: PipelineSchedule, r: int, stages: Stages | None, offloaded: frozenset[str] = frozenset()) -> None:
    """One rank's list alone, under the rule tables ([Note: the pipeline's rule tables])."""
    walk = _RankWalk(ps, r, stages, offloaded)
    for i, op in enumerate(walk.ops):
        walk.at = i
        if isinstance(op, Op):
            for rule in FSDP_ACTION_RULES:
                rule(walk, op)
            walk.advance(op)
        else:
            for stage_rule in STAGE_RULES:
                stage_rule(walk, op)
            walk.advance_stage(op)
    walk.at = len(walk.ops) - 1
    for final_rule in RANK_FINAL_RULES:
        final_rule(walk)


def _stages_on(ps: PipelineSchedule, r: int) -> tuple[int, ...]:
    """The stages rank ``r`` runs."""
    return tuple(range(r, ps.num_stages, ps.pp_size))


def _check_pairs(ps: PipelineSchedule) -> dict[tuple[int, int], int]:
    """Every recv matches its peer's send in order; returns, for each recv (rank, index), the
    index of the send it takes on the peer."""
    sends: dict[tuple[int, int], list[tuple[int, PipeOp]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, PipeOp]]] = {}
    for r, ops in enumerate(ps.ranks):
        for i, op in enumerate(ops):
            if isinstance(op, PipeOp) and op.kind.is_send:
                sends.setdefault((r, ps.peer(op)), []).append((i, op))
            elif isinstance(op, PipeOp) and op.kind.is_recv:
                recvs.setdefault((ps.peer(op), r), []).append((i, op))
    match: dict[tuple[int, int], int] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, inn = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (j, rop) in enumerate(inn):
            if k >= len(out):
                raise _fail(
                    dst,
                    j,
                    rop,
                    f"has no matching send: rank {src} sends rank {dst} only {len(out)} messages, and this is "
                    f"recv number {k + 1} from it; add '{rop.partner()}' to rank {src}'s list",
                )
            i, sop = out[k]
            if sop != rop.partner():
                raise _fail(
                    dst,
                    j,
                    rop,
                    f"would receive rank {src}'s op #{i} ({sop}): between two ranks, messages arrive in the "
                    f"order they are sent. Send '{rop.partner()}' before '{sop}' on rank {src}, or receive "
                    "in the order they are sent",
                )
            match[(dst, j)] = i
        for i, sop in out[len(inn) :]:
            raise _fail(
                src, i, sop, f"is never received: rank {dst} has no '{sop.partner()}'; add it there or remove the send"
            )
    return match


def run_order(ps: PipelineSchedule, plan: PlanValues | None = None) -> tuple[tuple[int, int, int | None], ...]:
    """Validates ``ps`` and returns an order in which every rank's ops can run together: one
    ``(rank, op index, send index)`` per op, each rank's ops in their order, a recv after the
    send it takes (``send index``: that send's index in the peer's list; ``None`` for every
    other op). The walk the timing engine prices (:func:`fsdpfn.pipeline_times`); its checks
    are :func:`validate_pipeline`'s.

    Raises:
      ScheduleError: as :func:`validate_pipeline`.

    Example:
      >>> ps = pipeline_schedule(Stages((("a",), ("b",)), 2), "gpipe", 1)
      >>> [(r, ps.ranks[r][i]) for r, i, _ in run_order(ps)][:3]
      [(0, PipeOp(kind=<PipeKind.STAGE_FORWARD: 'stage_forward'>, stage=0, micro=0)), (0, PipeOp(kind=<PipeKind.SEND_ACT: 'send_act'>, stage=0, micro=0)), (1, PipeOp(kind=<PipeKind.RECV_ACT: 'recv_act'>, stage=1, micro=0))]
    """
    if plan is not None:
        if ps.plan_fingerprint != plan.fingerprint:
            raise ScheduleError(
                f"pipeline schedule was made for plan {ps.plan_fingerprint}, not this plan ({plan.fingerprint}); "
                "derive it from this plan with fsdpfn.pipeline_schedule(plan, ...)"
            )
        if plan.stages is None or (plan.stages.pp_size, plan.stages.num_stages) != (ps.pp_size, ps.num_stages):
            raise ScheduleError(
                f"pipeline schedule has pp={ps.pp_size}, {ps.num_stages} stages, but the plan's stages are "
                f"{None if plan.stages is None else (plan.stages.pp_size, plan.stages.num_stages)}; regenerate it"
            )
    stages = plan.stages if plan is not None else None
    offloaded = frozenset(u.name for u in plan.units if u.offload) if plan is not None else frozenset()
    for r in range(ps.pp_size):
        _check_rank(ps, r, stages, offloaded)
    match = _check_pairs(ps)
    pc = [0] * ps.pp_size
    sent: set[tuple[int, int]] = set()
    order: list[tuple[int, int, int | None]] = []
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(ps.ranks):
            while pc[r] < len(ops):
                op, takes = ops[pc[r]], None
                if isinstance(op, PipeOp) and op.kind.is_recv:
                    takes = match[(r, pc[r])]
                    if (ps.peer(op), takes) not in sent:
                        break  # its send has not run yet: wait, let the other ranks move
                if isinstance(op, PipeOp) and op.kind.is_send:
                    sent.add((r, pc[r]))
                order.append((r, pc[r], takes))
                pc[r] += 1
                moved = True
    stuck = [r for r in range(ps.pp_size) if pc[r] < len(ps.ranks[r])]
    if stuck:
        waits = "; ".join(
            f"rank {r} op #{pc[r]} ({ps.ranks[r][pc[r]]}) waits for rank {ps.peer(ps.ranks[r][pc[r]])}'s op "  # type: ignore[arg-type]
            f"#{match[(r, pc[r])]} ({ps.ranks[ps.peer(ps.ranks[r][pc[r]])][match[(r, pc[r])]]})"  # type: ignore[arg-type]
            for r in stuck
        )
        raise ScheduleError(
            f"invalid pipeline schedule: deadlock, every rank left waits for another: {waits}. Move a send "
            "earlier (before the recv its rank blocks in) or a recv later"
        )
    return tuple(order)


def validate_pipeline(ps: PipelineSchedule, plan: PlanValues | None = None) -> None:
    """Checks that ``ps`` can run; nothing runs, nothing is communicated.

    Each rank's list alone (see [Note: pipeline ops]), then every recv against its peer's
    sends in order, then every rank's list run together: a schedule in which ranks wait for
    each other in a circle is a deadlock, named by each waiting rank's op.

    Args:
      ps: the schedule, e.g. :func:`pipeline_schedule`'s, edited.
      plan: the plan it runs (checks its FSDP actions and fingerprint); ``None`` for one made
        from bare stages.

    Raises:
      ScheduleError: naming the rank, the op's position and the op, and the fix.

    Example:
      >>> ps = pipeline_schedule(Stages((("a",), ("b",)), 2), "gpipe", 2)
      >>> validate_pipeline(ps)
      >>> r1 = list(ps.ranks[1]); r1[4:6] = [r1[5], r1[4]]  # send a gradient before computing it
      >>> validate_pipeline(dataclasses.replace(ps, ranks=(ps.ranks[0], tuple(r1))))
      Traceback (most recent call last):
      fsdpfn._plan.schedule.ScheduleError: invalid pipeline schedule: rank 1 op #4 (send_grad s1 m0): sends what 'stage_backward s1 m0' computes before it runs; move the send after it
    """
    run_order(ps, plan)
