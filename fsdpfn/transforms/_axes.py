"""Which process groups and ranks a plan's mesh axes are: every collective's group is derived
here from the axes' roles (see :class:`fsdpfn.MeshAxes`), never from how many dims the mesh has."""

from __future__ import annotations

from fsdpfn._mesh import Role
from fsdpfn._plan import Plan

__all__ = ["dp_rank", "replicate_group", "shard_group", "shard_rank", "tp_group", "tp_rank"]


def _mesh(plan: Plan):
    if plan.mesh is None:
        raise ValueError("this plan has no mesh (loaded from JSON?); bind one with plan.bind(mesh) or Plan.from_json(s, mesh)")
    return plan.mesh


def _group(plan: Plan, role: Role):
    d = plan.axes.dim(role)
    return None if d is None else _mesh(plan).get_group(d)


def shard_group(plan: Plan):
    """The process group of the plan's data-parallel shard axis."""
    return _group(plan, Role.SHARD)


def replicate_group(plan: Plan):
    """The process group of the plan's data-parallel replicate axis (``None`` without one)."""
    return _group(plan, Role.REPLICATE)


def tp_group(plan: Plan):
    """The process group of the plan's tensor-parallel axis (``None`` without one)."""
    return _group(plan, Role.TP)


def _axis_rank(plan: Plan, role: Role) -> int:
    d = plan.axes.dim(role)
    return 0 if d is None else _mesh(plan).get_local_rank(d)


def shard_rank(plan: Plan) -> int:
    """This process's index on the shard axis."""
    return _axis_rank(plan, Role.SHARD)


def dp_rank(plan: Plan) -> int:
    """This process's index among the data-parallel ranks (``replicate_rank * shard_size +
    shard_rank``), in ``[0, plan.dp_size)``: which slice of the global batch it reads. Ranks
    that differ only in their tensor-parallel position read the same slice.

    Example:
      >>> fsdpfn.transforms.dp_rank(plan), plan.dp_size
      (0, 1)
    """
    return _axis_rank(plan, Role.REPLICATE) * plan.shard_size + shard_rank(plan)


def tp_rank(plan: Plan) -> int:
    """This process's index on the tensor-parallel axis (0 without one)."""
    return _axis_rank(plan, Role.TP)
