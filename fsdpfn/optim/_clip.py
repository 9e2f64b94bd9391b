"""Clipping by the global norm, where "global" spans every leaf, shard and rank."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdpfn.optim._base import EmptyState, GradientTransformation
from fsdpfn.optim._tree import map_local
from fsdpfn import comm as C

__all__ = ["clip_by_global_norm", "global_norm"]


def _sharded_dims(x: DTensor) -> tuple[int, ...]:
    dims = []
    for d, p in enumerate(x.placements):
        if isinstance(p, Partial):
            raise NotImplementedError("global_norm: Partial placements are not supported; reduce the gradients first")
        if isinstance(p, Shard):
            dims.append(d)
        elif not isinstance(p, Replicate):
            raise NotImplementedError(f"global_norm: placement {p} is not supported")
    return tuple(dims)


def global_norm(tree: Any) -> torch.Tensor:
    """The 2-norm of all leaves together, as a 0-d fp32 tensor equal on every rank.

    A DTensor leaf's local squares are summed over the mesh dimensions it is sharded on (one
    all-reduce per group of leaves placed alike) and counted once over the dimensions it is
    replicated on, so the result is the norm of the full tensors.

    Example:
      >>> fsdpfn.optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    totals: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, Any] = {}
    for x in optree.tree_leaves(tree):
        if isinstance(x, DTensor):
            key = (id(x.device_mesh), _sharded_dims(x))
            meshes[key] = x.device_mesh
            value = x._local_tensor
        else:
            key, value = (None, ()), x
        sq = value.float().square().sum()
        totals[key] = totals[key] + sq if key in totals else sq
    total = torch.zeros((), dtype=torch.float32)
    for key, sq in totals.items():  # insertion order: the same on every rank
        buf = sq.reshape(1).clone()
        for d in key[1]:
            C.all_reduce(buf, meshes[key].get_group(d), tag="global_norm")
        total = total + buf[0]
    return total.sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales updates by ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``
    does, with ``norm`` the :func:`global_norm` over all leaves, shards and ranks.

    Example:
      >>> opt = fsdpfn.optim.clip_by_global_norm(1.0)
      >>> updates, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(None))
      >>> updates["w"]
      tensor([0.6000, 0.8000])
    """
    if max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def update(updates, state, params=None):
        coef = torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0)
        return map_local(lambda u: u * coef.to(u.dtype), updates), state

    return GradientTransformation(lambda params: EmptyState(), update)
