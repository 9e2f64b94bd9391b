"""The activation exchanges of every axis, as one table: what each axis sends while a unit
computes, as values of one type, asked through one signature.

:func:`fsdpfn._plan.steps.step_ops` gives each event of the op list the collectives it issues.
Gathers and reduces belong to the schedule's own ops; what the model's activations exchange
belongs to an axis: tensor parallelism's all-reduces and gathers around its split Linears,
expert parallelism's token all-to-alls, context parallelism's key/value gathers or ring hops.
Each axis answers one question here, with one signature: *which* :class:`Exchange` *s does a
unit issue at this event, for this many tokens?* ``step_ops`` asks every axis of
:data:`AXES` the same way and never names one; adding an axis is a row of that table.

[Note: activation exchanges]
The order a rank issues them in, for one unit, follows from how the model runs:

- forward events ask the axes in table order (tp, ep, cp), backward events in reverse (the
  backward runs the forward's modules last to first);
- an exchange with ``at_event`` is issued when the event is reached, before the schedule's
  actions after it (an expert layer's counts and dispatch, which run before the experts'
  gather); the others while the unit computes, after those actions;
- a unit recomputed in its backward (any ``remat`` policy but ``"none"``) issues its
  forward's exchanges again there, before the backward's: the recompute runs every collective
  of the forward again, tensor parallelism's all-reduces as well as attention's key/value
  exchange. A selective policy (``"save_dots"``, ...) keeps operators' results, not the
  collectives', so tp's all-reduces run again under it too (a record of a real step says so).
  An axis that cannot say what a selective policy replays refuses to cost the unit (cp's
  exchanges sit inside one fused attention Function).

An exchange's ``overlap`` says how it runs against the unit's compute: ``""`` blocks the
compute where it sits (between two matmuls); ``"blocks"`` is a point-to-point hop that the
attention's next block waits for, double-buffered (ring attention); ``"beside"`` runs on the
same stream between those hops and nothing waits for it (the ring's dK/dV accumulator).
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Callable, Iterable, Protocol, Sequence

import torch

from fsdpfn._plan.attention import AttentionCall, kv_bytes
from fsdpfn._plan.axes import Role
from fsdpfn._plan.schedule import OpKind
from fsdpfn._plan.tp_styles import TpStyle, style_row
from fsdpfn._plan.values import ROOT, PlanValues, Unit, unit_label

__all__ = ["AXES", "Exchange", "Exchanges", "attention_entries", "step_exchanges"]

OVERLAPS = ("", "blocks", "beside")


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One activation collective an axis issues at an event of a unit.

    Attributes:
      kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"`` or
        ``"send_recv"``.
      role: the :class:`fsdpfn.Role` of the mesh axis it runs over.
      nbytes: the full buffer's bytes, as :class:`fsdpfn.comm.CollectiveCall` counts them.
      dtype: the element type sent.
      purpose: what it is for (``"tp_reduce"``, ``"ep_dispatch"``, ``"cp_ring"``, ...).
      tag: what :mod:`fsdpfn.comm` records as its tag (the module, or the exchange's name).
      at_event: issued when the event is reached, before the actions after it; else while the
        unit computes.
      overlap: ``""``, ``"blocks"`` or ``"beside"`` (see [Note: activation exchanges]).

    Example:
      >>> Exchange("all_reduce", Role.TP, 4096, torch.float32, "tp_reduce", "blocks.0.proj").overlap
      ''
    """

    kind: str
    role: Role
    nbytes: int
    dtype: torch.dtype
    purpose: str
    tag: str
    at_event: bool = False
    overlap: str = ""

    def __post_init__(self):
        if self.overlap not in OVERLAPS:
            raise ValueError(f"Exchange {self.tag!r}: overlap must be one of {OVERLAPS}, got {self.overlap!r}")


class Exchanges(Protocol):
    """One axis's exchanges over a plan: ``exchanges(unit, event, tokens)`` lists what ``unit``
    issues at ``event`` (a :class:`fsdpfn.runtime.OpKind` event) with ``tokens`` tokens per rank
    per micro-batch, its forward ones only (``recompute`` aside, the table adds the replays)."""

    def __call__(self, unit: Unit, event: OpKind, tokens: int) -> Sequence[Exchange]: ...


# ---- tensor parallelism ------------------------------------------------------------------


def tensor_parallel(plan: PlanValues, attention: Iterable[AttentionCall]) -> Exchanges | None:
    """tp's exchanges: per split Linear, by style, with ``N`` tokens and the activations in the
    unit's gather dtype (``in_features``/``out_features`` the Linear's global sizes):
    ``colwise`` all-reduces its input's gradient in backward (``N x in_features``);
    ``colwise_gather`` also all-gathers its output in forward (``N x out_features``);
    ``rowwise`` all-reduces its output in forward (``N x out_features``); a ``vocab`` Embedding
    all-reduces its output in forward (``N x width``); a ``colwise_loss`` head is colwise, and
    the loss over its split logits all-reduces each token's max, then its two sums (``N`` and
    ``2 N`` float32), after the root's forward.

    Example:
      >>> tp_plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=fsdpfn.models.GPT_TP_PLAN)
      >>> ex = tensor_parallel(tp_plan, ())
      >>> [e.purpose for e in ex(tp_plan.unit("blocks.0"), OpKind.FORWARD, 8)]
      ['tp_reduce', 'tp_reduce']
    """
    if not plan.tp:
        return None
    modules: dict[str, list[tuple[str, TpStyle, int, int, torch.dtype]]] = {}
    names = set(plan.param_names)
    for module, style in plan.tp:
        weight = f"{module}.weight"
        if weight not in names:
            raise ValueError(
                f"tensor-parallel module {module!r} has no parameter {weight!r} in the plan (a weight tied to another "
                "module's?), so its activation sizes are unknown; leave it out of tp= to cost this plan"
            )
        unit = plan.unit_of(weight)
        row, shape = style_row(style), plan.param(weight).shape
        modules.setdefault(unit.name, []).append(
            (module, row, row.in_width(shape), row.out_width(shape), plan.gather_dtype(unit))
        )
    t = plan.axes.size(Role.TP)
    # The loss over split logits sums in float32 or wider, whatever the head computes in.
    split_loss = [
        torch.promote_types(dtype, torch.float32)
        for ms in modules.values()
        for _, row, *_, dtype in ms
        if row.gives == "logits"
    ]

    def exchanges(unit: Unit, event: OpKind, tokens: int) -> list[Exchange]:
        out = []
        if event is OpKind.FORWARD_DONE and unit.name == ROOT and split_loss:
            acc = split_loss[0]
            out.append(Exchange("all_reduce", Role.TP, tokens * acc.itemsize, acc, "tp_loss", "vocab_max"))
            out.append(Exchange("all_reduce", Role.TP, 2 * tokens * acc.itemsize, acc, "tp_loss", "vocab_sum"))
        if event is OpKind.FORWARD:
            for module, row, _, out_w, dtype in modules.get(unit.name, ()):
                if row.forward == "all_reduce":  # partial sums of the whole output
                    out.append(
                        Exchange("all_reduce", Role.TP, tokens * out_w * dtype.itemsize, dtype, "tp_reduce", module)
                    )
                elif row.forward == "all_gather":
                    # tp ranks' out_w / t columns each, gathered: the full output's bytes.
                    nbytes = tokens * (out_w // t) * t * dtype.itemsize
                    out.append(Exchange("all_gather", Role.TP, nbytes, dtype, "tp_gather", module))
        elif event is OpKind.BACKWARD:
            for module, row, in_w, _, dtype in reversed(modules.get(unit.name, ())):
                if row.backward == "all_reduce":  # partial sums of the whole input's gradient
                    out.append(
                        Exchange("all_reduce", Role.TP, tokens * in_w * dtype.itemsize, dtype, "tp_copy", module)
                    )
        return out

    return exchanges


# ---- expert parallelism ------------------------------------------------------------------


def expert_parallel(plan: PlanValues, attention: Iterable[AttentionCall]) -> Exchanges | None:
    """ep's exchanges: each expert layer (an expert unit, its router's ``top_k`` = ``k``, token
    width ``d`` = the last dim of its first weight) sends its per-expert counts (int64) and
    dispatches ``N k`` rows of ``d`` before its experts run (``at_event``: before their gather),
    and combines them after; backward transposes both.

    Example:
      >>> class Block(nn.Module):
      ...     def __init__(self):
      ...         super().__init__()
      ...         self.moe = fsdpfn.models.MoE(fsdpfn.models.MoEConfig(width=8, hidden=12, experts=4, top_k=2))
      >>> moe_plan = fsdpfn.plan(nn.ModuleList([Block()]), {"ep": 2, "edp": 2})
      >>> ex = expert_parallel(moe_plan, ())
      >>> [(e.purpose, e.at_event) for e in ex(moe_plan.unit("0.moe.experts"), OpKind.FORWARD, 16)]
      [('ep_counts', True), ('ep_dispatch', True)]
    """
    if plan.axes.size(Role.EP) == 1:
        return None

    def exchanges(unit: Unit, event: OpKind, tokens: int) -> list[Exchange]:
        if not unit.experts:
            return []
        first = unit.params[0]
        dtype = plan.gather_dtype(unit)
        experts = first.shape[0]
        if unit.padded_capacity is None:
            rows = tokens * unit.top_k
        else:  # every expert's slots, filled or not (MoEConfig.capacity's exact ceiling)
            num, den = fractions.Fraction(repr(float(unit.padded_capacity))).as_integer_ratio()
            rows = experts * -(-num * tokens * unit.top_k // (den * experts))
        nbytes = rows * first.shape[-1] * dtype.itemsize
        dispatch = Exchange("all_to_all", Role.EP, nbytes, dtype, "ep_dispatch", "moe_dispatch")
        combine = Exchange("all_to_all", Role.EP, nbytes, dtype, "ep_combine", "moe_combine")
        # Padded, the sizes are known everywhere: no counts travel.
        counts = [Exchange("all_to_all", Role.EP, 8 * experts, torch.int64, "ep_counts", "ep_counts")]
        by_event = {
            OpKind.FORWARD: [*counts[: unit.padded_capacity is None], dispatch],
            OpKind.FORWARD_DONE: [combine],
            OpKind.BACKWARD: [combine],
            OpKind.BACKWARD_DONE: [dispatch],
        }
        at_event = event in (OpKind.FORWARD, OpKind.BACKWARD)
        return [dataclasses.replace(e, at_event=at_event) for e in by_event.get(event, ())]

    return exchanges


# ---- context parallelism -----------------------------------------------------------------


def attention_entries(a: AttentionCall, cp: int, phase: str, tokens: int, dtype: torch.dtype) -> list[Exchange]:
    """The :class:`Exchange` s of one attention call in ``phase`` (``"forward"`` or
    ``"backward"``), over ``cp`` ranks (see [Note: what attention over cp issues] in
    ``fsdpfn/_plan/attention.py``). Tags are those ``fsdpfn.transforms`` gives the collectives,
    so a record of a real step compares.

    Example:
      >>> [e.tag for e in attention_entries(AttentionCall("b", 4, strategy="ring"), 3, "backward", 8, torch.float32)]
      ['cp_ring_kv', 'cp_ring_kv', 'cp_ring_dkv', 'cp_ring_dkv']
    """
    if cp == 1:
        return []
    dt = a.dtype or dtype
    n = kv_bytes(a, tokens, dt)
    if a.strategy == "allgather":
        gather = Exchange("all_gather", Role.CP, cp * n, dt, "cp_gather", "cp_gather_kv")
        fwd = [gather]
        bwd = [gather, Exchange("reduce_scatter", Role.CP, cp * n, dt, "cp_scatter", "cp_gather_kv")]
    elif a.strategy == "ulysses":
        q = tokens * (a.q_width or a.kv_width) * dt.itemsize
        qkv = Exchange("all_to_all", Role.CP, q + n, dt, "cp_heads", "cp_a2a_qkv")
        out = Exchange("all_to_all", Role.CP, q, dt, "cp_heads", "cp_a2a_out")
        fwd, bwd = [qkv, out], [out, qkv]
    else:
        kv = Exchange("send_recv", Role.CP, n, dt, "cp_ring", "cp_ring_kv", overlap="blocks")
        acc = torch.promote_types(dt, torch.float32)
        dkv = Exchange(
            "send_recv", Role.CP, kv_bytes(a, tokens, acc), acc, "cp_ring_grad", "cp_ring_dkv", overlap="beside"
        )
        fwd = [kv] * (cp - 1)
        # In the order the backward starts them: K/V hop s + 1 before block s, the accumulator
        # of block s after it.
        bwd = [kv] + [kv, dkv] * (cp - 2) + [dkv]
    return fwd if phase == "forward" else bwd


def context_parallel(plan: PlanValues, attention: Iterable[AttentionCall]) -> Exchanges | None:
    """cp's exchanges: each attention call's keys and values, gathered or passed around the
    ring (:func:`attention_entries`), in its unit's forward and backward.

    Example:
      >>> cp_plan = fsdpfn.plan(model, {"dp": 1, "cp": 2})
      >>> ex = context_parallel(cp_plan, [AttentionCall("blocks.0", 16)])
      >>> [e.kind for e in ex(cp_plan.unit("blocks.0"), OpKind.BACKWARD, 8)]
      ['all_gather', 'reduce_scatter']
    """
    cp = plan.axes.size(Role.CP)
    calls: dict[str, list[AttentionCall]] = {}
    names = {u.name for u in plan.units}
    for a in attention:
        if not isinstance(a, AttentionCall):
            raise ValueError(
                f"attention= takes fsdpfn.AttentionCall values (fsdpfn.sim.profile(...).attention), got {a!r}"
            )
        if a.unit not in names:
            raise ValueError(
                f"attention call of unit {a.unit!r}: the plan has no such unit (units: "
                f"{', '.join(unit_label(n) for n in sorted(names))})"
            )
        calls.setdefault(a.unit, []).append(a)
    if cp == 1 or not calls:
        return None

    def exchanges(unit: Unit, event: OpKind, tokens: int) -> list[Exchange]:
        if event not in (OpKind.FORWARD, OpKind.BACKWARD) or unit.name not in calls:
            return []
        if unit.remat not in ("none", "full"):
            raise NotImplementedError(
                f"unit {unit_label(unit.name)!r} recomputes with the selective policy {unit.remat!r}; whether its "
                "attention's exchange over cp runs again in backward depends on what the policy keeps inside the "
                "fused attention, which the op list does not model yet: cost it with remat='none' or 'full'"
            )
        order = calls[unit.name] if event is OpKind.FORWARD else reversed(calls[unit.name])
        dtype = plan.gather_dtype(unit)
        return [e for a in order for e in attention_entries(a, cp, event.value, tokens, dtype)]

    return exchanges


# ---- the table ---------------------------------------------------------------------------

AXES: tuple[Callable[[PlanValues, Iterable[AttentionCall]], Exchanges | None], ...] = (
    tensor_parallel,
    expert_parallel,
    context_parallel,
)
"""Every axis with activation exchanges, in the order a unit's forward issues them."""

_FORWARD_EVENTS = (OpKind.FORWARD, OpKind.FORWARD_DONE)


def step_exchanges(
    plan: PlanValues, attention: Iterable[AttentionCall] = ()
) -> Callable[[Unit, OpKind, int], tuple[Exchange, ...]]:
    """What a step of ``plan`` exchanges at each event: ``step_exchanges(plan)(unit, event,
    tokens)`` asks every axis of :data:`AXES` (forward events in table order, backward ones in
    reverse) and adds a recomputed unit's replays (see [Note: activation exchanges]).

    Example:
      >>> tp_plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=fsdpfn.models.GPT_TP_PLAN, remat="full")
      >>> at = step_exchanges(tp_plan)
      >>> [e.purpose for e in at(tp_plan.unit("blocks.0"), OpKind.BACKWARD, 8)]
      ['tp_reduce', 'tp_reduce', 'tp_copy', 'tp_copy']
    """
    attention = tuple(attention)
    axes = [ex for make in AXES if (ex := make(plan, attention)) is not None]

    def ask(unit: Unit, event: OpKind, tokens: int) -> list[Exchange]:
        order = axes if event in _FORWARD_EVENTS else axes[::-1]
        return [e for ex in order for e in ex(unit, event, tokens)]

    def at(unit: Unit, event: OpKind, tokens: int) -> tuple[Exchange, ...]:
        out = ask(unit, event, tokens)
        if event is OpKind.BACKWARD and unit.remat != "none":
            out = [dataclasses.replace(e, at_event=False) for f in _FORWARD_EVENTS for e in ask(unit, f, tokens)] + out
        return tuple(out)

    return at
