"""Clipping by the global norm, where "global" spans every leaf, shard and rank."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdpfn._plan.stage_mesh import pipeline_of
from fsdpfn.optim._base import EmptyState, GradientTransformation
from fsdpfn.optim._checks import check_real
from fsdpfn.optim._tree import map_local
from fsdpfn import comm as C

__all__ = ["clip_by_global_norm", "global_norm"]


def _sharded_dims(x: DTensor) -> tuple[int, ...]:
    """The mesh dims whose ranks hold different pieces of ``x`` (any kind of shard, the strided
    rows of a tensor-parallel weight included): its squares are summed over these and over no
    other, so each element counts once whatever the mesh."""
    dims = []
    for d, p in enumerate(x.placements):
        if isinstance(p, Partial):
            raise NotImplementedError("global_norm: Partial placements are not supported; reduce the gradients first")
        if isinstance(p, (Shard, _StridedShard)):
            dims.append(d)
        elif not isinstance(p, Replicate):
            raise NotImplementedError(f"global_norm: placement {p} is not supported")
    return tuple(dims)


def global_norm(tree: Any) -> torch.Tensor:
    """The 2-norm of all leaves together, as a 0-d fp32 tensor equal on every rank.

    A DTensor leaf's local squares are summed over the mesh dimensions it is sharded on (one
    all-reduce per group of leaves placed alike) and counted once over the dimensions it is
    replicated on, so the result is the norm of the full tensors. On a (dp, tp) mesh a weight
    split over tp is summed over both axes, one replicated over tp over the data-parallel axis
    only. Leaves of a pipeline stage (a tree of :meth:`fsdpfn.runtime.PipelineRuntime.shard`'s
    parameters or gradients, each pp rank holding its own stages') are summed over the pp ranks
    too: the norm of the whole model's tree, the same on every stage (see [Note: a stage's
    parameters are part of one model]).

    Example:
      >>> fsdpfn.optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    totals: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, Any] = {}
    pipelines: dict[int, Any] = {}  # the pp groups of stage leaves, first seen first
    alone: list[str] = []  # leaves outside any pipeline, for the error below
    for x in optree.tree_leaves(tree):
        if isinstance(x, DTensor):
            key: tuple = (id(x.device_mesh), _sharded_dims(x))
            meshes[key] = x.device_mesh
            value = x._local_tensor
            piped = pipeline_of(x.device_mesh)
            if piped is not None:
                pipelines.setdefault(id(piped[0]), piped)
            else:
                alone.append(f"a DTensor on {x.device_mesh}")
        else:
            key, value = (None, ()), x
            alone.append(f"a plain {tuple(x.shape)} tensor")
        sq = value.float().square().sum()
        totals[key] = totals[key] + sq if key in totals else sq
    device = next(iter(totals.values())).device if totals else None  # the leaves' device, not the default one
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, sq in totals.items():  # insertion order: the same on every rank
        buf = sq.reshape(1).clone()
        for d in key[1]:
            C.all_reduce(buf, meshes[key].get_group(d), tag="global_norm")
        total = total + buf[0]
    if pipelines:
        if alone:  # the same leaf on every pp rank would be counted pp times
            raise ValueError(
                f"global_norm: the tree mixes pipeline-stage parameters with {alone[0]}, which belongs to no "
                "stage; pass the stages' tree alone (PipelineRuntime.shard's parameters, or their gradients)"
            )
        buf = total.reshape(1).clone()
        for mesh, pp_name in pipelines.values():
            if mesh.size(mesh.mesh_dim_names.index(pp_name)) > 1:
                C.all_reduce(buf, mesh.get_group(pp_name), tag="global_norm over pp")
        total = buf[0]
    return total.sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales updates by ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``
    does, with ``norm`` the :func:`global_norm` over all leaves, shards and ranks.

    A non-finite norm (a NaN or inf in any leaf on any rank, or finite values whose squares
    overflow) makes every leaf of the result NaN, never a zero or partly zeroed step: see
    [Note: clipping a non-finite norm]. The guard is :func:`apply_if_finite`, which skips such a
    step on every rank. Around the whole chain,
    ``apply_if_finite(chain(clip_by_global_norm(1.0), adamw(1e-3)), 5)``, it checks the
    gradients before they are clipped; after the clip,
    ``chain(clip_by_global_norm(1.0), apply_if_finite(adamw(1e-3), 5))``, it also catches finite
    gradients whose norm overflows.

    Args:
      max_norm: the largest global norm let through, a finite number > 0.

    Raises:
      ValueError: ``max_norm`` is not a finite number > 0 (raised when built).

    Example:
      >>> opt = fsdpfn.optim.clip_by_global_norm(1.0)
      >>> updates, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(None))
      >>> updates["w"]
      tensor([0.6000, 0.8000])
      >>> opt.update({"w": torch.tensor([3.0, float("inf")]), "b": torch.ones(1)}, opt.init(None))[0]["b"]
      tensor([nan])
    """
    max_norm = check_real(
        "clip_by_global_norm",
        "max_norm",
        max_norm,
        lo=0.0,
        lo_open=True,
        fix="To not clip, leave clip_by_global_norm out of the chain.",
    )

    def update(updates, state, params=None):
        norm = global_norm(updates)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.nan)  # [Note: clipping a non-finite norm]
        return map_local(lambda u: u * coef.to(u.dtype), updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


# [Note: clipping a non-finite norm]
# torch's clip_grad_norm_ (error_if_nonfinite=False) scales by max_norm / norm as it comes: a NaN
# norm gives NaN everywhere, but an inf norm gives a factor of 0, which zeroes every finite leaf
# and turns the inf entries into NaN; and finite gradients whose squares overflow fp32 give a
# step of exact zeros, a silently lost step that nothing downstream can tell from a real one.
# Here any non-finite norm gives a NaN factor, so a bad step is NaN on every leaf: it cannot pass
# for a small or zero step, and apply_if_finite sees it wherever it sits in the chain. The
# choice costs no host sync (raising, as error_if_nonfinite=True does, would need one per step);
# finite norms are scaled exactly as torch scales them.
