"""The plan's cost model: bytes per collective kind per step, and memory per rank.

It mirrors what :mod:`fsdpfn.transforms` issue, call for call, so a test can compare it with a
:func:`fsdpfn.comm.count_collectives` record of a real step. ``wire_bytes`` follows
:class:`fsdpfn.comm.CollectiveCall`: ``(W-1)/W`` of the full buffer for all-gather and
reduce-scatter, ``2 (W-1)/W`` for all-reduce.

FP8 units (``MixedPrecision(fp8=...)``) all-gather their byte segment
(:meth:`fsdpfn.Plan.gather_bytes`: E4M3 elements, scales, ``param_dtype`` for the rest, see
[Note: FP8 gather layout]); the per-tensor recipe adds one all-reduce (max) of a float32 amax per
FP8 parameter before each of the unit's gathers.
"""

from __future__ import annotations

import dataclasses

from fsdpfn._plan import Plan, _human, register_cost_model

__all__ = ["CollectiveCost", "PlanCost", "plan_cost"]


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    calls: int = 0
    nbytes: int = 0
    wire_bytes: float = 0.0

    def __add__(self, other: "CollectiveCost") -> "CollectiveCost":
        return CollectiveCost(self.calls + other.calls, self.nbytes + other.nbytes, self.wire_bytes + other.wire_bytes)


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """Per rank, per training step.

    Attributes:
      collectives: ``{kind: CollectiveCost}`` for ``all_gather``, ``reduce_scatter``,
        ``all_reduce``.
      memory: bytes per rank: ``params`` (sharded masters, largest rank), ``grads`` (sharded
        for zero2/zero3, full for zero1/replicate), ``optimizer_state_per_slot`` (one fp32-like
        slot shaped like the sharded masters, e.g. Adam needs two), ``unsharded_peak`` (full
        parameters alive at once in the gather dtype: ``1 + prefetch`` of the largest units freed
        after forward, plus every unit kept gathered from forward to backward; the runtime's
        high-water mark stays within it).

    Example:
      >>> print(fsdpfn.plan(model, (8,)).cost())  # 8 ranks, projected from a shape
      collective        calls   buffer bytes   sent per rank
      all_gather            5      216.8 KiB       189.7 KiB
      reduce_scatter        3      117.5 KiB       102.8 KiB
      memory per rank: params 14.7 KiB, grads 14.7 KiB, optimizer_state_per_slot 14.7 KiB, unsharded_peak 117.5 KiB
    """

    collectives: dict
    memory: dict

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives.values())

    def __str__(self) -> str:
        lines = ["collective        calls   buffer bytes   sent per rank"]
        for kind, c in self.collectives.items():
            lines.append(f"{kind:<16} {c.calls:>6}   {_human(c.nbytes):>12}   {_human(c.wire_bytes):>13}")
        lines.append("memory per rank: " + ", ".join(f"{k} {_human(v)}" for k, v in self.memory.items()))
        return "\n".join(lines)


def _cc(group_size: int, nbytes: int, factor: float = 1.0, calls: int = 1) -> CollectiveCost:
    return CollectiveCost(calls, calls * nbytes, calls * factor * (group_size - 1) / group_size * nbytes)


def plan_cost(plan: Plan, reshard_after_forward: bool | None = None, prefetch: int = 1) -> PlanCost:
    w, r = plan.shard_size, plan.replicate_size
    kinds = {k: CollectiveCost() for k in ("all_gather", "reduce_scatter", "all_reduce")}
    mem = {"params": 0, "grads": 0, "optimizer_state_per_slot": 0, "unsharded_peak": 0}
    freed = []  # gathered bytes of the units freed after forward
    for unit in plan.units:
        g_item = plan.gather_dtype(unit).itemsize
        r_item = plan.reduce_dtype(unit).itemsize
        master = sum(p.numel * p.dtype.itemsize for p in unit.params)
        full_gathered = unit.numel * g_item
        if not unit.sharded:
            if unit.numel:
                kinds["all_reduce"] += _cc(w, unit.numel * r_item, 2.0)
                if plan.hsdp:
                    kinds["all_reduce"] += _cc(r, unit.numel * r_item, 2.0)
            mem["params"] += master
            mem["grads"] += master
            mem["optimizer_state_per_slot"] += master
            mem["unsharded_peak"] += full_gathered  # unshard's cast copy
            continue
        # The runtime's default frees zero3 units after forward except the root, whose backward
        # starts right after its forward (FSDP2 makes the same exception).
        resharded = reshard_after_forward is True or (reshard_after_forward is None and unit.name != "")
        gathers = 2 if unit.strategy == "zero3" and resharded else 1
        if unit.shard_numel:
            kinds["all_gather"] += _cc(w, w * plan.gather_bytes(unit), calls=gathers)
        layout = plan.fp8_layout(unit)
        if layout is not None and layout.amax_params:
            kinds["all_reduce"] += _cc(w, 4 * len(layout.amax_params), 2.0, calls=gathers)
        if unit.reduce_numel:
            kinds["reduce_scatter"] += _cc(w, w * unit.reduce_numel * r_item)
            if plan.hsdp:
                kinds["all_reduce"] += _cc(r, unit.reduce_numel * r_item, 2.0)
        item = unit.params[0].dtype.itemsize
        sharded_master = unit.reduce_numel * item
        mem["params"] += sharded_master
        mem["optimizer_state_per_slot"] += sharded_master
        mem["grads"] += master if unit.strategy == "zero1" else sharded_master
        if gathers == 2:
            freed.append(full_gathered)
        else:
            mem["unsharded_peak"] += full_gathered
    # A freed unit is alive from its gather to its free; with prefetch, 1 + prefetch of them.
    mem["unsharded_peak"] += min(sum(freed), (1 + prefetch) * max(freed, default=0))
    return PlanCost({k: v for k, v in kinds.items() if v.calls}, mem)


register_cost_model(plan_cost)
