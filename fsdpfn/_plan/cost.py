"""The plan's cost model: bytes per collective kind per step, and memory per rank.

Both come from :mod:`fsdpfn._plan.steps`, the one list of what a step issues (see [Note: what a step
issues] there): :func:`plan_cost` sums :func:`fsdpfn._plan.steps.step_collectives` per kind, so a
test can compare it with a :func:`fsdpfn.comm.count_collectives` record of a real step call for
call. ``wire_bytes`` follows :class:`fsdpfn.comm.CollectiveCall`: ``(W-1)/W`` of the full buffer
for all-gather and reduce-scatter, ``2 (W-1)/W`` for all-reduce.

FP8 units (``MixedPrecision(fp8=...)``) all-gather their byte segment
(:meth:`fsdpfn.Plan.gather_bytes`: E4M3 elements, scales, ``param_dtype`` for the rest, see
[Note: FP8 gather layout]); the per-tensor recipe adds one all-reduce (max) of a float32 amax per
FP8 parameter before each of the unit's gathers. Tensor-parallel modules add their activation
all-reduces and all-gathers over the ``tp`` axis, whose bytes need ``tokens``; attention calls
(``attention=``) add their keys' and values' exchange over ``cp`` and, in ``memory``, the keys
and values of the whole sequence they hold at once while they run (``attention_kv``).
"""

from __future__ import annotations

import dataclasses

from fsdpfn._plan.attention import AttentionCall, attention_memory
from fsdpfn._plan.values import PlanValues, _human
from fsdpfn._plan.schedule import Schedule, validate
from fsdpfn._plan.schedule import schedule as default_schedule  # ``schedule`` is an argument below
from fsdpfn._plan.steps import (
    Collective,
    CollectiveCost,
    static_memory,
    step_collectives,
    step_ops,
    totals,
    unsharded_peak,
)

__all__ = ["CollectiveCost", "PlanCost", "plan_cost"]


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """Per rank, per training step.

    Attributes:
      collectives: ``{kind: CollectiveCost}`` for ``all_gather``, ``reduce_scatter``,
        ``all_reduce`` (tensor-parallel activation collectives included).
      memory: bytes per rank: ``params`` (sharded masters, largest rank), ``grads`` (sharded
        for zero2/zero3, full for zero1/replicate), ``optimizer_state_per_slot`` (one fp32-like
        slot shaped like the sharded masters, e.g. Adam needs two), ``unsharded_peak`` (full
        parameters alive at once in the gather dtype, walking the schedule's gathers and frees:
        :func:`fsdpfn._plan.steps.unsharded_peak`, the runtime's ``rt.memory.high_water``);
        with ``attention=`` calls on a cp plan, ``attention_kv``: the keys and values of the whole
        sequence, ``cp`` times a rank's own, summed over the calls: what the all-gather strategy
        holds at once inside each call, in forward and again in backward (transient: a call
        keeps only its rank's own for backward; the ring holds two blocks at a time; see [Note:
        what attention over cp issues]).
      calls: every collective of the step, in order (:class:`fsdpfn.Collective`), which
        ``collectives`` sums.
      tokens: the tokens per rank per micro-batch the activation bytes were counted for
        (``None``: tensor-parallel activation collectives are listed with 0 bytes).

    Example:
      >>> print(fsdpfn.plan(model, (8,)).cost())  # 8 ranks, projected from a shape
      collective        calls   buffer bytes   sent per rank
      all_gather            5      216.8 KiB       189.7 KiB
      reduce_scatter        3      117.5 KiB       102.8 KiB
      memory per rank: params 14.7 KiB, grads 14.7 KiB, optimizer_state_per_slot 14.7 KiB, unsharded_peak 117.5 KiB
      >>> tp = fsdpfn.plan(model, {"dp": 2, "tp": 2}, tp=fsdpfn.models.GPT_TP_PLAN)
      >>> print(tp.cost(tokens=2 * 16).collectives["all_reduce"])  # batch 2 x sequence 16 per rank
      CollectiveCost(calls=8, nbytes=32768, wire_bytes=32768.0)
    """

    collectives: dict
    memory: dict
    calls: tuple = ()
    tokens: int | None = None

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives.values())

    def by(self, key) -> dict:
        """``{key(collective): CollectiveCost}``, e.g. ``cost.by(lambda c: (c.phase, c.role))``.

        Example:
          >>> sorted(fsdpfn.plan(model, (2,)).cost().by(lambda c: c.phase))
          ['backward', 'forward']
        """
        return totals(self.calls, key)

    def __str__(self) -> str:
        lines = ["collective        calls   buffer bytes   sent per rank"]
        for kind, c in self.collectives.items():
            lines.append(f"{kind:<16} {c.calls:>6}   {_human(c.nbytes):>12}   {_human(c.wire_bytes):>13}")
        tp = [c for c in self.calls if c.activation]
        if tp:
            t = totals(tp, lambda c: "tp")["tp"]
            if self.tokens is None:
                lines.append(
                    f"  of which {t.calls} activation collectives (tensor, expert or context parallel), listed with 0 bytes: "
                    "pass cost(tokens=...) (tokens per rank per micro-batch) to count them"
                )
            else:
                lines.append(
                    f"  of which activations over tp, ep and cp ({self.tokens:,} tokens per rank per micro-batch): "
                    f"{t.calls} calls, {_human(t.nbytes)} buffers, {_human(t.wire_bytes)} sent"
                )
        lines.append("memory per rank: " + ", ".join(f"{k} {_human(v)}" for k, v in self.memory.items()))
        return "\n".join(lines)


def plan_cost(
    plan: PlanValues,
    reshard_after_forward: bool | None = None,
    prefetch: int = 1,
    *,
    tokens: int | None = None,
    micro_batches: int = 1,
    accumulate: str = "reduce",
    schedule: Schedule | None = None,
    attention: tuple[AttentionCall, ...] = (),
) -> PlanCost:
    """:meth:`fsdpfn.Plan.cost` (see there)."""
    attention = tuple(attention)
    if schedule is not None:
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be an fsdpfn.runtime.Schedule, got {type(schedule).__name__}")
        validate(schedule, plan)
    calls: tuple[Collective, ...] = step_collectives(
        plan,
        schedule=schedule,
        reshard_after_forward=reshard_after_forward,
        micro_batches=micro_batches,
        accumulate=accumulate,
        tokens=tokens,
        attention=attention,
    )
    kinds = {k: CollectiveCost() for k in ("all_gather", "reduce_scatter", "all_reduce")}
    kinds.update(totals(calls))
    # The unsharded peak walks the gathers and frees of the ops the runtime runs, every
    # micro-batch's (the simulator reads the same walk), so a hand-edited schedule's moved free
    # is seen, and prefetch is where its gathers are.
    sched = schedule if schedule is not None else default_schedule(plan, prefetch, reshard_after_forward)
    ops = step_ops(plan, sched, micro_batches=micro_batches, accumulate=accumulate)
    mem = {**static_memory(plan), "unsharded_peak": unsharded_peak(plan, ops)}
    mem.update(attention_memory(plan, attention, tokens or 0))
    return PlanCost({k: v for k, v in kinds.items() if v.calls}, mem, calls, tokens)
