"""The two checks every gather starts with, and the gather of one unit: what the transforms, the
runtime and the differential check share (a module of its own, so that none of them imports the
others for it)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor

from fsdpfn._plan import PipelinedPlan, Plan, Unit
from fsdpfn.transforms import _unit_comm
from fsdpfn.transforms._axes import unit_group, unit_rank
from fsdpfn.transforms._checks import check_on_every_rank

__all__ = ["check_params", "check_plan_kind", "gather_unit"]


def _local_shape(plan: Plan, unit: Unit, name: str, rank: int) -> tuple[int, ...]:
    start, stop = unit.local_rows(name, rank)
    shape = plan.param(name).local_shape
    return (stop - start, *shape[1:]) if shape else ()


def check_plan_kind(plan: Any, what: str) -> None:
    """Raises ``ValueError`` unless ``plan`` is a :class:`fsdpfn.Plan`, naming the way in for a
    :class:`fsdpfn.PipelinedPlan`: each pp rank holds its own stages' parameters only, so a
    transform over every parameter of the plan would hold (and step) every stage on every rank,
    a model that trains without its pipeline ([Note: a pipelined plan is its own type]).

    Example:
      >>> fsdpfn.transforms.check_plan_kind(plan, "my_transform")  # a Plan passes
      >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=["embed", "pos", "blocks.0", "blocks.1", "norm", "head"])
      >>> fsdpfn.transforms.check_plan_kind(pp, "my_transform")
      Traceback (most recent call last):
      ...
      ValueError: my_transform: the plan is cut into 2 pipeline stages (a fsdpfn.PipelinedPlan), ...
    """
    if isinstance(plan, PipelinedPlan):
        raise ValueError(
            f"{what}: the plan is cut into {plan.stages.num_stages} pipeline stages (a fsdpfn.PipelinedPlan), and each pp "
            "rank holds its own stages' parameters only. Use fsdpfn.runtime.PipelineRuntime(model, plan, schedule, "
            "micro_batches).shard(model), or pass plan.stage_plan(stage) for each stage this rank runs "
            "(plan.stages.stages_of(its pp rank))"
        )
    if not isinstance(plan, Plan):
        raise ValueError(f"{what}: plan must be an fsdpfn.Plan (fsdpfn.plan(model, mesh)), got {type(plan).__name__}")


def check_params(
    tree: Mapping[str, Any], plan: Plan, what: str = "params", allow_none: bool = False, tp_local: bool = False
) -> None:
    """Raises ``ValueError`` unless ``tree`` is a dict holding exactly the plan's parameters, each
    a tensor of the plan's global shape (``None`` allowed with ``allow_none``): the one check of
    "these parameters belong to this plan", used by the transforms, the runtime and checkpoints.

    Example:
      >>> fsdpfn.transforms.check_params(params, plan)
      >>> fsdpfn.transforms.check_params({}, plan)
      Traceback (most recent call last):
      ...
      ValueError: params does not match the plan (missing [...]...
    """
    check_plan_kind(plan, what)
    if not isinstance(tree, Mapping):
        raise ValueError(f"{what} must be a dict {{parameter name: tensor}}, got {type(tree).__name__}")
    expected = set(plan.param_names)
    missing = [n for n in plan.param_names if n not in tree]
    extra = sorted(k for k in tree if k not in expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"not in the plan {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise ValueError(
            f"{what} does not match the plan ({'; '.join(parts)}). Pass exactly the plan's parameters: "
            "the dict fsdpfn.shard(model, plan) returned, or a plan built for this model."
        )
    for name in plan.param_names:
        value = tree[name]
        if value is None and allow_none:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}[{name!r}] must be a tensor, got {type(value).__name__}")
        spec = plan.param(name)
        expected_shape = spec.local_shape if tp_local and not isinstance(value, DTensor) else spec.shape
        if tuple(value.shape) != expected_shape:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(value.shape)}, but the plan says {expected_shape}; "
                "was the plan built for another model?"
            )


def _check_local_rows(plan: Plan, unit: Unit, locals_: list[torch.Tensor], rank: int) -> None:
    """Shards of the right global shape but another row split (``tensor_split`` instead of
    ``torch.chunk``, another world size) would gather into silently wrong parameters; their local
    shapes give them away for free."""
    for p, local in zip(unit.params, locals_):
        expected = _local_shape(plan, unit, p.name, rank)
        if tuple(local.shape) != expected:
            start, stop = unit.local_rows(p.name, rank)
            raise ValueError(
                f"params[{p.name!r}] on shard rank {rank} has local shape {tuple(local.shape)}, but the plan gives this rank "
                f"rows [{start}, {stop}) of {p.rows} (local shape {expected}; torch.chunk split over {unit.shard_size} ranks). "
                "Make shards with fsdpfn.shard(model, plan) (or DTensor Shard(0) / torch.chunk), not tensor_split or "
                "another world size."
            )


def gather_unit(plan: Plan, unit: Unit, locals_: list[torch.Tensor], *, async_op: bool = False):
    """Starts the all-gather of ``unit`` from this rank's local shards.

    Returns ``(pending, finish)``: ``finish(pending.wait())`` gives the full parameters, in
    ``unit.params`` order and in the gather dtype, written into ``out`` (a list of tensors shaped
    like the parameters) if given. Split so the runtime can overlap the wait. One path for every
    unit: its codec packs the shards (plain rows, or FP8 bytes and scales, see [Note: FP8
    gather]), one all-gather moves them, the codec unpacks them. Under tensor parallelism "full"
    is the tp-local part, and a ``"partial"`` parameter (a rowwise layer's bias) is zeros on
    every tp position but 0, so the all-reduce after the layer adds it once; its gradient, the
    same on every tp position, still reaches it whole.
    """
    group = unit_group(plan, unit)
    check_on_every_rank(plan, unit.name, group, lambda: _check_local_rows(plan, unit, locals_, unit_rank(plan, unit)))
    return _unit_comm.gather(plan, unit, locals_, _unit_comm.EagerWire(async_op))
