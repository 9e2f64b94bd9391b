"""DTensor metadata of a plan's parameters: placements, specs and :func:`from_local`, all
read from the plan (see [Note: unshard under torch.func] in ``fsdpfn/transforms/_sharding.py``).
Below both the eager and the compiled transforms, which build their gradients with it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdpfn._plan.placements import dtensor_placements
from fsdpfn._plan import Plan
from fsdpfn.transforms._axes import unit_mesh

__all__ = ["from_local", "placements"]


def placements(plan: Plan, name: str) -> tuple:
    """DTensor placements of parameter ``name``, one per mesh dim, derived from its placements and
    the axes' roles (:func:`fsdpfn._plan.placements.dtensor_placements`).

    Shard axis: ``Shard(0)`` if the parameter is sharded, else ``Replicate()``; when the tp
    axis also splits dim 0 and comes after the shard axis in the mesh, the data-parallel rows
    are cut from the tp-local rows, which DTensor spells ``_StridedShard(0, split_factor=tp)``
    (as FSDP2 does on a 2-D mesh). Replicate axis: ``Replicate()``. Tp axis: ``Shard(d)`` for a
    parameter split along dim ``d``, ``_StridedShard(0, split_factor=k)`` for one split
    ``colwise_fused:k`` (tp rank ``r`` holds the ``r``-th slice of each of the ``k`` parts), else
    ``Replicate()``. Beside an ``ep`` axis an expert weight
    is ``Shard(0)`` over ``ep`` and its rows are cut over ``shard`` from its ep part the same
    way, while a dense parameter lives on the ``ep`` x ``shard`` axes flattened into one mesh
    dim (:func:`fsdpfn.transforms.unit_mesh`), ``Shard(0)`` there (and ``Replicate()`` on the
    replicate axis before it, when the mesh has one).

    Example:
      >>> fsdpfn.transforms.placements(plan, "blocks.0.fc.weight")
      (Shard(dim=0),)
    """
    return _placements(plan, name)


def _placements(plan: Plan, name: str) -> tuple:
    unit = plan.unit_of(name)
    return dtensor_placements(unit.param(name), plan.axes, unit.slots[name].sharded)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _spec(plan: Plan, name: str, dtype: torch.dtype) -> DTensorSpec:
    shape = plan.param(name).shape
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype)
    return DTensorSpec(unit_mesh(plan, plan.unit_of(name)), placements(plan, name), tensor_meta=meta)


def from_local(plan: Plan, name: str, local: torch.Tensor, requires_grad: bool = False) -> DTensor:
    """The DTensor of parameter ``name`` whose local part on this rank is ``local``, placed as the
    plan says. Metadata comes from the plan, never from ``local`` (see [Note: unshard under
    torch.func]), so this works inside ``torch.func`` transforms where ``DTensor.from_local``
    does not.

    Example:
      >>> local_rows = torch.zeros_like(params["blocks.0.fc.weight"].to_local())
      >>> g = fsdpfn.transforms.from_local(plan, "blocks.0.fc.weight", local_rows)
      >>> g.shape, g.placements  # the global shape and placement, from the plan
      (torch.Size([128, 32]), (Shard(dim=0),))
    """
    return DTensor(local, _spec(plan, name, local.dtype), requires_grad=requires_grad)
