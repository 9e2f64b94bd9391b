"""Which process groups and ranks a plan's mesh axes are: every collective's group is derived
here from the axes' roles (see :class:`fsdpfn.MeshAxes`), never from how many dims the mesh has."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import mesh_dims, split_roles, unit_row_roles
from fsdpfn._plan.stage_mesh import copy_stage_mark
from fsdpfn._plan import PipelinedPlan, Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "axis_index",
    "cp_group",
    "cp_rank",
    "dp_rank",
    "ep_group",
    "ep_rank",
    "replicate_group",
    "shard_group",
    "shard_rank",
    "tp_group",
    "tp_rank",
    "unit_group",
    "unit_mesh",
    "unit_mesh_dim",
    "unit_rank",
]


def _mesh(plan: Plan | PipelinedPlan):
    if plan.mesh is None:
        raise ValueError(
            "this plan has no mesh (loaded from JSON?); bind one with plan.bind(mesh) or Plan.from_json(s, mesh)"
        )
    return plan.mesh


def _axis_group(plan: Plan | PipelinedPlan, role: Role):
    d = plan.axes.dim(role)
    return None if d is None else _mesh(plan).get_group(d)


def shard_group(plan: Plan):
    """The process group of the plan's data-parallel shard axis."""
    return _axis_group(plan, Role.SHARD)


def replicate_group(plan: Plan):
    """The process group of the plan's data-parallel replicate axis (``None`` without one)."""
    return _axis_group(plan, Role.REPLICATE)


def tp_group(plan: Plan | PipelinedPlan):
    """The process group of the plan's tensor-parallel axis (``None`` without one)."""
    return _axis_group(plan, Role.TP)


def _axis_rank(plan: Plan | PipelinedPlan, role: Role) -> int:
    d = plan.axes.dim(role)
    return 0 if d is None else _mesh(plan).get_local_rank(d)


def shard_rank(plan: Plan) -> int:
    """This process's index on the shard axis."""
    return _axis_rank(plan, Role.SHARD)


def ep_group(plan: Plan | PipelinedPlan):
    """The process group of the plan's expert-parallel axis (``None`` without one).

    Example:
      >>> fsdpfn.transforms.ep_group(plan) is None  # a plan without an ep axis
      True
    """
    return _axis_group(plan, Role.EP)


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
    return _axis_group(plan, Role.CP)


def cp_rank(plan: Plan | PipelinedPlan) -> int:
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


_ROWS = "_fsdpfn_rows_meshes"


def _rows_dim(plan: Plan, rows) -> int:
    """Which dim of :func:`_rows_mesh` holds the axes ``rows``, flattened."""
    return mesh_dims(rows, plan.axes).index(rows)


def _rows_mesh(plan: Plan, rows):
    """The mesh a parameter whose rows are cut over the axes ``rows`` (more than one: a dense
    parameter beside ``ep`` or ``cp``, ``ep`` x ``shard`` x ``cp``; an expert weight beside
    ``cp``, ``shard`` x ``cp``; :func:`fsdpfn._plan.placements.row_roles`) lives on: those axes
    flattened into one dim, every other axis (replicate, ep, tp) a dim of its own, in mesh order
    (:func:`fsdpfn._plan.placements.mesh_dims`). Made once per mesh and ``rows`` (its groups are
    created collectively, at the same point of every rank's program).

    Each plan also keeps the ones it asked for (in its ``__dict__``, like a cached property):
    while dynamo traces a compiled step, a ``DeviceMesh`` is an opaque object whose own
    attributes cannot be read, and the groups cannot be created; the plan's are read instead.
    ``fsdpfn.shard`` placed the parameters on them, so a plan that sharded them has them all."""
    own = plan.__dict__.get(_ROWS)
    rows = tuple(rows)
    if own is not None and rows in own:
        return own[rows]
    if torch.compiler.is_compiling():
        raise ValueError(
            f"fsdpfn: the mesh of the parameters sharded over {' x '.join(r.value for r in rows)} flattened was not made "
            "before this step was compiled; call fsdpfn.shard(model, plan) (or fsdpfn.transforms.unit_mesh) with this "
            "plan first, outside torch.compile"
        )
    mesh = _mesh(plan)
    meshes = getattr(mesh, _ROWS, None)
    if meshes is None:
        meshes = {}
        setattr(mesh, _ROWS, meshes)
    cached = meshes.get(rows)
    if cached is None:
        axes = plan.axes
        parts = []
        for dim in mesh_dims(rows, axes):
            names = tuple(axes.names[cast(int, axes.dim(r))] for r in dim)
            sub = mesh[names if len(names) > 1 else names[0]]
            parts.append(sub._flatten("_".join(names)) if len(names) > 1 else sub)
        # The other axes' groups already exist: nothing more is created collectively here.
        cached = parts[0] if len(parts) == 1 else type(mesh)._concatenate(parts)
        copy_stage_mark(mesh, cached)  # a stage's rows mesh is still that stage's
        meshes[rows] = cached
    plan.__dict__.setdefault(_ROWS, {})[rows] = cached
    return cached


def unit_mesh(plan: Plan, unit) -> DeviceMesh:
    """The mesh ``unit``'s parameters are placed on: the plan's mesh, except for units whose rows
    are cut over more than one axis (dense units beside an ``ep`` or ``cp`` axis, which live on
    the ``ep`` x ``shard`` x ``cp`` axes present flattened; expert units beside ``cp``, on
    ``shard`` x ``cp`` flattened), beside the other axes the mesh has.

    Example:
      >>> fsdpfn.transforms.unit_mesh(plan, plan.units[0]) is plan.mesh
      True
    """
    rows = unit_row_roles(unit, plan.axes)
    if len(rows) == 1:  # its rows are cut over the shard axis alone
        return _mesh(plan)
    return _rows_mesh(plan, rows)


def unit_mesh_dim(plan: Plan, unit) -> tuple[DeviceMesh, int]:
    """``(mesh, dim)`` whose group is :func:`unit_group`: the form the functional collectives of
    a compiled step take (dynamo traces a mesh and a dim; see [Note: collectives under
    torch.compile]).

    Example:
      >>> mesh, dim = fsdpfn.transforms.unit_mesh_dim(plan, plan.units[0])
      >>> mesh.get_group(dim) is fsdpfn.transforms.unit_group(plan, plan.units[0])
      True
    """
    rows = unit_row_roles(unit, plan.axes)
    if len(rows) == 1:  # its rows are cut over the shard axis alone
        return _mesh(plan), cast(int, plan.axes.dim(Role.SHARD))
    return _rows_mesh(plan, rows), _rows_dim(plan, rows)


def unit_group(plan: Plan, unit):
    """The process group ``unit`` is gathered and reduced over: the shard axis, or, for units
    whose rows are cut over more than one axis (dense units beside ``ep`` or ``cp``, expert
    units beside ``cp``), those axes flattened (see [Note: expert units] in
    ``fsdpfn/_plan/values.py``; a parameter is not split over cp, so every cp rank holds a
    distinct shard of it).

    Example:
      >>> fsdpfn.transforms.unit_group(plan, plan.units[0]) is fsdpfn.transforms.shard_group(plan)
      True
    """
    rows = unit_row_roles(unit, plan.axes)
    if len(rows) == 1:  # its rows are cut over the shard axis alone
        return shard_group(plan)
    return _rows_mesh(plan, rows).get_group(_rows_dim(plan, rows))


def unit_rank(plan: Plan, unit) -> int:
    """This process's index in :func:`unit_group`.

    Example:
      >>> fsdpfn.transforms.unit_rank(plan, plan.units[0])
      0
    """
    rows = unit_row_roles(unit, plan.axes)
    if len(rows) == 1:  # its rows are cut over the shard axis alone
        return shard_rank(plan)
    return _rows_mesh(plan, rows).get_local_rank(_rows_dim(plan, rows))


def dp_rank(plan: Plan | PipelinedPlan) -> int:
    """This process's index among the data-parallel ranks, in ``[0, plan.dp_size)``: which slice
    of the global batch it reads. The replicate position, then the ``ep`` and shard positions
    row-major in mesh order (``replicate_rank * shard_size + shard_rank`` without ``ep``). Ranks
    that differ only in their tensor- or context-parallel position read the same slice (cp
    ranks then keep their own part of each sequence: :func:`fsdpfn.context_parallel_shard`),
    beside ``ep`` too.

    Example:
      >>> fsdpfn.transforms.dp_rank(plan), plan.dp_size
      (0, 1)
    """
    index = _axis_rank(plan, Role.REPLICATE)
    for role, size in zip(plan.axes.roles, plan.axes.shape):
        if role in (Role.EP, Role.SHARD):  # every ep x shard rank of every replica reads its own batch
            index = index * size + _axis_rank(plan, role)
    return index


def tp_rank(plan: Plan | PipelinedPlan) -> int:
    """This process's index on the tensor-parallel axis (0 without one)."""
    return _axis_rank(plan, Role.TP)
