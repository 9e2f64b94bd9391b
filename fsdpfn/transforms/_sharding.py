"""shard, unshard, reduce: pure functions over parameter dicts, scheduled by a plan.

``unshard`` is one ``torch.autograd.Function`` per unit whose backward is ``reduce``: the
all-gather's transpose is the reduce-scatter. So ``torch.func.grad`` (or ``loss.backward()``) of a
loss written over unsharded parameters returns sharded, already-reduced gradients.

[Note: unshard under torch.func]
Inside ``torch.func`` transforms the inputs seen by Python code are functorch wrappers without
DTensor metadata, and DTensor's own ``from_local``/``to_local`` are autograd Functions without
``setup_context`` that fail there. So: the Function defines ``setup_context``; every piece of
metadata (mesh, placements, shapes) comes from the plan, never from the input; the collectives
and the unwrapping run inside ``torch._C._DisableFuncTorch()``, where the inputs are plain
DTensors again; and gradients are built with the ``DTensor(local, spec, requires_grad=False)``
constructor. This is what makes one implementation serve both ``loss.backward()`` and
``torch.func.grad``/``vjp``.

[Note: FP8 gather]
A unit with FP8 weights (``MixedPrecision(fp8=...)``) gathers bytes (see [Note: FP8 gather
layout] in ``fsdpfn/_plan/values.py``): when the gather *starts*, each rank casts its current shards to
``param_dtype`` and quantizes its rows, so a prefetched gather, or the second gather of a unit
resharded after forward, ships the bytes of the shards of this step, never a stale or zeroed
staging buffer (there is none: the segment is built fresh from the shards every time). After the
wait every rank dequantizes to ``param_dtype`` (or, with ``backend="te"``, hands the bytes to
Transformer Engine). Backward is unchanged: the straight-through VJP of the FP8 gather is the
same reduce-scatter, in ``reduce_dtype``, into the fp32 masters.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from fsdpfn._plan.placements import local_part
from fsdpfn._plan import Plan, Unit
from fsdpfn.transforms._compiled import reduce_traced, unshard_traced
from fsdpfn.transforms._axes import (
    _mesh,
    axis_index,
    dp_rank,
    replicate_group,
    shard_group,
    shard_rank,
    tp_group,
    tp_rank,
    unit_rank,
)
from fsdpfn.transforms._dtensor import from_local, placements
from fsdpfn.transforms import _unit_comm
from fsdpfn import comm as C
from fsdpfn.transforms._checks import check_ranks_agree
from fsdpfn.transforms._remat import apply_remat
from fsdpfn.transforms._tp import apply_tp
from fsdpfn.transforms._guards import note_capture, note_unshard
from fsdpfn.transforms._gather import check_plan_kind as check_plan_kind
from fsdpfn.transforms._gather import check_params as check_params
from fsdpfn.transforms._gather import gather_unit as gather_unit

__all__ = [
    "shard",
    "unshard",
    "reduce",
    "placements",
    "check_params",
    "from_local",
    "gather_unit",
    "reduce_unit",
    "shard_rank",
    "shard_group",
    "replicate_group",
    "tp_group",
    "tp_rank",
    "tp_slice",
    "dp_rank",
]


# ---------------------------------------------------------------------------------------------
# Mesh and DTensor metadata, all read from the plan
# ---------------------------------------------------------------------------------------------


def tp_slice(plan: Plan, name: str, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This rank's model-parallel part of parameter ``name`` (a view of ``full``), as its
    placements say (:func:`fsdpfn._plan.placements.local_part`): the ``rank``-th (default: this
    process's position on the axis that splits it) of ``tp`` equal slices along the parameter's
    tp dim, or ``full`` itself. Split ``colwise_fused:k``, the ``rank``-th slice of each of its
    ``k`` parts, stacked (a copy). An expert weight beside an ``ep`` axis gives its ``rank``-th
    of ``ep`` equal slices along dim 0: the experts this rank holds.

    Example:
      >>> fsdpfn.transforms.tp_slice(plan, "blocks.0.fc.weight", torch.zeros(128, 32)).shape
      torch.Size([128, 32])
    """
    spec = plan.param(name)
    return local_part(spec, full, axis_index(plan, spec, rank))


# ---------------------------------------------------------------------------------------------
# Input checks: name what is wrong and how to fix it
# ---------------------------------------------------------------------------------------------


def _local(x: torch.Tensor, plan: Plan, name: str) -> torch.Tensor:
    if not isinstance(x, DTensor):
        raise ValueError(
            f"params[{name!r}] is a plain {type(x).__name__}; unshard takes the DTensor shards from "
            "fsdpfn.shard(model, plan), not full parameters"
        )
    if tuple(x.placements) != placements(plan, name):
        raise ValueError(f"params[{name!r}] has placements {x.placements}, but the plan says {placements(plan, name)}")
    return x._local_tensor


# ---------------------------------------------------------------------------------------------
# shard
# ---------------------------------------------------------------------------------------------


def shard(model_or_params, plan: Plan, *, requires_grad: bool = False, check: bool = True) -> dict[str, DTensor]:
    """This rank's shards of every parameter, as DTensors placed as the plan says.

    Every rank is expected to hold the same full parameters (same seed, or the same checkpoint)
    and keeps its own ``torch.chunk`` slice along dim 0; 0-d parameters and ``replicate`` units
    are kept whole. Shards are copies: the full model can be freed afterwards. With ``check``
    (the default) one small all-gather per mesh dim first verifies that all ranks built the same
    plan and hold the same parameters, and raises ``ValueError`` naming the parameter and the
    ranks otherwise: a forgotten ``torch.manual_seed`` would else shard a model no rank held.

    Given the model, it also installs the plan's model hooks (:func:`fsdpfn.apply_tp`: the
    tensor-parallel collectives, and the batch checks of the first steps). Given a dict, it
    cannot: call ``fsdpfn.apply_tp(model, plan)`` on the model you run, or a tp-split weight
    run without its all-reduce raises ``ValueError`` at the first step.

    Args:
      model_or_params: an ``nn.Module`` or a dict ``{name: full tensor}`` (then see above).
      plan: the plan.
      requires_grad: mark the shards as leaves requiring grad (for ``loss.backward()`` loops).
      check: verify that ranks agree on the plan and the full parameters (one collective).

    Returns:
      ``{name: DTensor}`` in the plan's order.

    Example:
      >>> params = fsdpfn.shard(model, plan)
      >>> params["blocks.0.fc.weight"].placements
      (Shard(dim=0),)
      >>> params["blocks.0.fc.weight"].to_local().shape  # this rank's rows (of 128, on 1 rank)
      torch.Size([128, 32])
    """
    if isinstance(model_or_params, torch.nn.Module):
        full: dict[str, torch.Tensor] = dict(model_or_params.named_parameters())
    else:
        full = model_or_params
    if plan.pp_stage is not None and isinstance(full, Mapping) and set(plan.param_names) <= set(full):
        full = {n: full[n] for n in plan.param_names}  # one stage's plan takes its own of the whole model's parameters
    check_params(full, plan, "shard(model_or_params)")
    meta = [n for n, v in full.items() if v.is_meta]
    if meta:  # even with check=False: meta shards would hold no values at all
        raise ValueError(
            f"shard: parameters {meta[:3]}{' ...' if len(meta) > 3 else ''} are on the meta device (no values); "
            "build their shards with fsdpfn.init_shards(model, plan) or fsdpfn.load_safetensors(model, plan, path)"
        )
    _mesh(plan)  # an unbound plan is named here, before anything runs
    full = {n: C.full_tensor(v) for n, v in full.items()}
    if check:
        check_ranks_agree(plan, full)
    if isinstance(model_or_params, torch.nn.Module):  # a model carries the tp hooks and remat of its latest plan
        apply_tp(model_or_params, plan)
        apply_remat(model_or_params, plan)
    out: dict[str, DTensor] = {}
    with torch.no_grad():
        for unit in plan.units:
            rank = unit_rank(plan, unit)
            for p in unit.params:
                value = tp_slice(plan, p.name, full[p.name])
                start, stop = unit.local_rows(p.name, rank)
                local = value.detach()[start:stop] if p.shape else value.detach()
                local = local.clone().contiguous()
                if unit.offload and local.is_cuda:  # kept in pinned host memory (see fsdpfn.runtime's offload)
                    local = local.cpu().pin_memory()
                out[p.name] = from_local(plan, p.name, local, requires_grad)
    return out


# ---------------------------------------------------------------------------------------------
# The per-unit kernels: gather one unit, reduce one unit
# ---------------------------------------------------------------------------------------------


def reduce_unit(
    plan: Plan,
    unit: Unit,
    grads: list[torch.Tensor | None],
    *,
    op: str = "mean",
    scale: float | None = None,
    async_op: bool = False,
):
    """Starts the reduction of ``unit``'s full gradients (one reduce-scatter, plus an all-reduce
    over the replicate axis under HSDP; one all-reduce for ``replicate`` units), packed by the
    unit's reduce codec (:meth:`fsdpfn.Plan.reduce_codec`).

    Returns ``(pending, finish)``: ``finish()`` (after the wait) gives this rank's local gradient
    shards in ``unit.params`` order, in each parameter's master dtype. ``None`` gradients count
    as zeros.
    """
    return _unit_comm.reduce(plan, unit, grads, op, scale, _unit_comm.EagerWire(async_op))


# ---------------------------------------------------------------------------------------------
# unshard, differentiable; its VJP is reduce
# ---------------------------------------------------------------------------------------------


class _UnshardUnit(torch.autograd.Function):
    """All-gathers one unit. Backward: reduce the unit (see [Note: unshard under torch.func])."""

    @staticmethod
    def forward(info, *shards):
        plan, unit, _, _ = info
        with torch._C._DisableFuncTorch():
            locals_ = [_local(x, plan, p.name) for x, p in zip(shards, unit.params)]
            pending, finish = gather_unit(plan, unit, locals_)
            return tuple(finish(pending.wait()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.info = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        plan, unit, op, scale = ctx.info
        with torch._C._DisableFuncTorch():
            _, finish = reduce_unit(plan, unit, list(grads), op=op, scale=scale)
            shards = finish()
            return (None, *(from_local(plan, p.name, g) for p, g in zip(unit.params, shards)))


def unshard(
    params: Mapping[str, torch.Tensor], plan: Plan, *, grad_op: str = "mean", grad_scale: float | None = None
) -> dict[str, torch.Tensor]:
    """Full parameters from their shards: one all-gather per unit, cast to ``mp.param_dtype``.

    Differentiable under ``loss.backward()`` and under ``torch.func.grad``/``vjp``; the gradient
    that flows back to the shards is :func:`reduce` of the full gradients (mean over the
    data-parallel ranks, or as ``grad_op``/``grad_scale`` say), so ``grad`` of a loss written
    over unsharded parameters is sharded and already reduced.

    Args:
      params: ``{name: DTensor}`` as returned by :func:`shard` (or an optimizer update of it).
      plan: the plan.
      grad_op, grad_scale: the reduction applied in backward, as in :func:`reduce`.

    Returns:
      ``{name: Tensor}``: full parameters in the plan's order.

    Example:
      >>> def loss_fn(params, x, y):
      ...     out = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
      ...     return F.cross_entropy(out.flatten(0, 1), y.flatten())
      >>> grads = torch.func.grad(loss_fn)(params, x, y)
      >>> grads["blocks.0.fc.weight"].placements  # sharded DTensors, reduced
      (Shard(dim=0),)
    """
    if C.compiling():  # see [Note: unshard under torch.compile]
        return unshard_traced(params, plan, grad_op, grad_scale)
    check_params(params, plan, "unshard(params)")
    _unit_comm.check_op(grad_op)
    note_capture(plan, params, grad_op, grad_scale)
    out: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        fulls = _UnshardUnit.apply((plan, unit, grad_op, grad_scale), *(params[p.name] for p in unit.params))
        out.update(zip((p.name for p in unit.params), fulls))
    note_unshard(plan, out, "mean" if grad_op == "mean" and grad_scale is None else "custom")
    return out


def reduce(
    full_grads: Mapping[str, torch.Tensor | None], plan: Plan, *, op: str = "mean", scale: float | None = None
) -> dict[str, DTensor]:
    """Sharded gradients from every rank's full gradients: one reduce-scatter per unit.

    Gradients are reduced in ``mp.reduce_dtype`` and returned in the parameters' master dtype.
    HSDP: reduce-scatter over ``shard``, then all-reduce over ``replicate``. ``replicate`` units:
    one all-reduce. This is the transpose (VJP) of :func:`unshard`.

    Args:
      full_grads: ``{name: full gradient}``; ``None`` counts as zeros.
      plan: the plan.
      op: ``"mean"`` (default: divide by the data-parallel world size) or ``"sum"``.
      scale: an extra factor applied after ``op`` (e.g. ``1 / tokens`` with ``op="sum"``).

    Returns:
      ``{name: DTensor}`` placed like :func:`shard`'s output.

    Example:
      >>> F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()  # full parameters
      >>> gshards = fsdpfn.reduce({n: p.grad for n, p in model.named_parameters()}, plan)
      >>> gshards["blocks.0.fc.weight"].placements
      (Shard(dim=0),)
    """
    if C.compiling():  # see [Note: unshard under torch.compile]
        return reduce_traced(full_grads, plan, op, scale)
    _unit_comm.check_op(op)
    check_params(full_grads, plan, "reduce(full_grads)", allow_none=True, tp_local=True)
    out: dict[str, DTensor] = {}
    with torch.no_grad():
        for unit in plan.units:
            grads = [full_grads[p.name] for p in unit.params]
            # A DTensor gradient is gathered whole, then cut to this rank's tensor-parallel part.
            grads = [
                tp_slice(plan, p.name, C.full_tensor(g)) if isinstance(g, DTensor) else g
                for p, g in zip(unit.params, grads)
            ]
            _, finish = reduce_unit(plan, unit, grads, op=op, scale=scale)
            for p, g in zip(unit.params, finish()):
                out[p.name] = from_local(plan, p.name, g)
    return out
