"""Which process groups and ranks a plan's mesh axes are: every collective's group is derived
here from the axes' roles (see :class:`fsdpfn.MeshAxes`), never from how many dims the mesh has."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import mesh_dims, rows_over, split_roles, unit_row_roles
from fsdpfn._plan.stage_mesh import copy_stage_mark
from fsdpfn._plan import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["axis_index", "cp_group", "cp_rank", "dp_rank", "ep_group", "ep_rank", "replicate_group", "shard_group", "shard_rank", "tp_group", "tp_rank",
           "unit_group", "unit_mesh", "unit_rank"]


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


def ep_group(plan: Plan):
    """The process group of the plan's expert-parallel axis (``None`` without one).

    Example:
      >>> fsdpfn.transforms.ep_group(plan) is None  # a plan without an ep axis
      True
    """
    return _group(plan, Role.EP)


def ep_rank(plan: Plan) -> int:
    """This process's index on the expert-parallel axis (0 without one): which ``experts / ep``
    of each expert layer it holds.

    Example:
      >>> fsdpfn.transforms.ep_rank(plan)
      0
    """
    return _axis_rank(plan, Role.EP)


def cp_group(plan: Plan):
    """The process group of the plan's context-parallel axis (``None`` without one): the ranks
    that hold parts of the same sequences.

    Example:
      >>> fsdpfn.transforms.cp_group(plan) is None  # a plan without a cp axis
      True
    """
    return _group(plan, Role.CP)


def cp_rank(plan: Plan) -> int:
    """This process's index on the context-parallel axis (0 without one): which head and tail
    chunks of each sequence it holds (:func:`fsdpfn.context_parallel_shard`).

    Example:
      >>> fsdpfn.transforms.cp_rank(plan)
      0
    """
    return _axis_rank(plan, Role.CP)


def axis_index(plan: Plan, spec, rank: int | None = None) -> dict[Role, int]:
    """``{axis: position}`` of this process on every axis that splits parameter ``spec`` (what
    :mod:`fsdpfn._plan.placements` cuts its part by); ``rank`` instead of the process's position
    when given. Axes that do not split it are left out: their parts are the whole tensor.

    Example:
      >>> axis_index(plan, plan.param("blocks.0.fc.weight"))
      {}
    """
    return {role: _axis_rank(plan, role) if rank is None else rank for role in split_roles(spec)}


_DENSE = "_fsdpfn_dense_mesh"


def _dense_dims(plan: Plan):
    return mesh_dims(rows_over((), plan.axes), plan.axes)


def _rows_dim(plan: Plan) -> int:
    """Which dim of :func:`_dense_mesh` holds the dense rows' axes, flattened."""
    rows = rows_over((), plan.axes)
    return _dense_dims(plan).index(rows)


def _dense_mesh(plan: Plan):
    """The mesh dense parameters live on beside experts or cp: the axes their rows are cut over
    (:func:`fsdpfn._plan.placements.row_roles`: ``ep`` or ``cp``, and ``shard``) flattened into
    one dim, every other axis (replicate, tp) a dim of its own, in mesh order
    (:func:`fsdpfn._plan.placements.mesh_dims`). Made once per mesh (its groups are created
    collectively, at the same point of every rank's program)."""
    mesh = _mesh(plan)
    cached = getattr(mesh, _DENSE, None)
    if cached is None:
        axes = plan.axes
        parts = []
        for dim in _dense_dims(plan):
            names = tuple(axes.names[cast(int, axes.dim(r))] for r in dim)
            sub = mesh[names if len(names) > 1 else names[0]]
            parts.append(sub._flatten("_".join(names)) if len(names) > 1 else sub)
        # The other axes' groups already exist: nothing more is created collectively here.
        cached = parts[0] if len(parts) == 1 else type(mesh)._concatenate(parts)
        copy_stage_mark(mesh, cached)  # a stage's dense mesh is still that stage's
        setattr(mesh, _DENSE, cached)
    return cached


def unit_mesh(plan: Plan, unit) -> DeviceMesh:
    """The mesh ``unit``'s parameters are placed on: the plan's mesh, except for dense units
    beside an ``ep`` or ``cp`` axis, which live on the ``ep`` (``cp``) x ``shard`` axes flattened
    (beside the replicate and tp axes, when the mesh has them).

    Example:
      >>> fsdpfn.transforms.unit_mesh(plan, plan.units[0]) is plan.mesh
      True
    """
    if len(unit_row_roles(unit, plan.axes)) == 1:  # its rows are cut over the shard axis alone
        return _mesh(plan)
    return _dense_mesh(plan)


def unit_group(plan: Plan, unit):
    """The process group ``unit`` is gathered and reduced over: the shard axis, or, for dense
    units beside an ``ep`` or ``cp`` axis, those axes and ``shard`` flattened (see [Note: expert
    units] in ``fsdpfn/_plan/values.py``; a parameter is not split over cp, so every cp rank
    holds a distinct shard of it).

    Example:
      >>> fsdpfn.transforms.unit_group(plan, plan.units[0]) is fsdpfn.transforms.shard_group(plan)
      True
    """
    if len(unit_row_roles(unit, plan.axes)) == 1:  # its rows are cut over the shard axis alone
        return shard_group(plan)
    return _dense_mesh(plan).get_group(_rows_dim(plan))


def unit_rank(plan: Plan, unit) -> int:
    """This process's index in :func:`unit_group`.

    Example:
      >>> fsdpfn.transforms.unit_rank(plan, plan.units[0])
      0
    """
    if len(unit_row_roles(unit, plan.axes)) == 1:  # its rows are cut over the shard axis alone
        return shard_rank(plan)
    return _dense_mesh(plan).get_local_rank(_rows_dim(plan))


def dp_rank(plan: Plan) -> int:
    """This process's index among the data-parallel ranks (``replicate_rank * shard_size +
    shard_rank``), in ``[0, plan.dp_size)``: which slice of the global batch it reads. Ranks
    that differ only in their tensor- or context-parallel position read the same slice (cp
    ranks then keep their own part of each sequence: :func:`fsdpfn.context_parallel_shard`).

    Example:
      >>> fsdpfn.transforms.dp_rank(plan), plan.dp_size
      (0, 1)
    """
    if plan.axes.dim(Role.EP) is not None:  # every ep x shard rank of every replica reads its own batch
        return _axis_rank(plan, Role.REPLICATE) * plan.axes.dense_shard_size + _dense_mesh(plan).get_local_rank(_rows_dim(plan))
    return _axis_rank(plan, Role.REPLICATE) * plan.shard_size + shard_rank(plan)


def tp_rank(plan: Plan) -> int:
    """This process's index on the tensor-parallel axis (0 without one)."""
    return _axis_rank(plan, Role.TP)
