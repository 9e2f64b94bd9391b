"""Placements as data: where a parameter lives on each model-parallel mesh axis, and everything
derived from that.

A :class:`fsdpfn.ParamSpec` carries one :class:`AxisPlacement` per model-parallel axis it is
placed on (:data:`PLACED_ROLES`: ``tp`` and ``ep`` today), in the vocabulary of DTensor and of
JAX's ``PartitionSpec``:

=========================  ===================================================================
placement                  what rank ``r`` of the axis's ``n`` ranks holds
=========================  ===================================================================
``Replicate()``            the whole tensor (the default: no entry)
``Shard(d)``               the ``r``-th of ``n`` equal blocks along dim ``d`` (a colwise
                           Linear: ``Shard(0)`` over ``tp``; rowwise: ``Shard(1)``; a packed
                           expert weight: ``Shard(0)`` over ``ep``)
``StridedShard(d, k)``     dim ``d`` holds ``k`` fused parts side by side; the ``r``-th block of
                           each part, stacked (``colwise_fused:k``, see [Note: fused colwise]
                           in ``fsdpfn/_plan/values.py``)
``Partial()``              the whole tensor, used as a partial sum: rank 0 uses it, the others
                           zeros, so the sum over the axis adds it once (a rowwise bias)
=========================  ===================================================================

The data-parallel ``shard`` axis is not among them: how a unit's flat buffer cuts rows over it
belongs to the unit's strategy (``Unit.slots``, [Note: flat-buffer layout]). What the plan, the
transforms, the checkpoint and the simulator need from placements is derived here and nowhere
else: the local shape, the local part or box of the global tensor, which zeros a ``Partial``
rank uses, which data-parallel axes a parameter's rows are cut over and its gradient reduced
over (a dense parameter beside ``ep`` is replicated over it, so it is sharded and reduced over
``ep`` x ``shard``; an expert weight is split over ``ep``, so over ``shard`` alone; a ``cp``
axis beside them joins both: ``ep`` x ``shard`` x ``cp`` and ``shard`` x ``cp``), the DTensor
placements the user sees, and the parameter's JSON fields.

[Note: adding an axis]
A new model-parallel axis is a :class:`fsdpfn.Role`, an entry in :data:`PLACED_ROLES` and, if
its split is not a block along a dim, a :class:`Placement` subclass overriding the methods of the
base. Readers never branch on the axis: they ask a placement for its local shape, part, box or
DTensor form, and ask this module which axes a parameter is split over and which its rows and
gradient run over. Context parallelism (``cp``, the sequence split) for example: its parameters
are ``Replicate()`` on ``cp`` and its gradients are summed over it, so with ``Role.CP`` data
parallel and not the replicate axis, :func:`row_roles` already gives ``cp`` x ``shard`` (FSDP over
both, flattened, as dense parameters beside ``ep`` are) and :func:`reduce_roles` sums over it;
what is left is its activation collectives, which are not placements.

This module imports nothing above the plan layer (DTensor's placement types are imported when
asked for).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from fsdpfn._plan.axes import MeshAxes, Role

if TYPE_CHECKING:
    import torch

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "Partial",
    "AxisPlacement",
    "PLACED_ROLES",
    "placement_of",
    "axis_size",
    "local_shape",
    "local_part",
    "local_box",
    "uses_zeros",
    "split_roles",
    "row_roles",
    "rows_over",
    "rows_size",
    "unit_row_roles",
    "reduce_roles",
    "mesh_dims",
    "dtensor_placements",
    "normalise",
    "check",
    "from_legacy",
    "legacy_fields",
    "module_placement",
]

# The mesh axes a ParamSpec carries placements for, in the order they are composed (an axis
# further on cuts the part the earlier ones left). The data-parallel shard and replicate axes are
# the units' business.
PLACED_ROLES: tuple[Role, ...] = (Role.EP, Role.TP)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a tensor lives on one mesh axis of ``size`` ranks. Subclasses override what differs
    from the whole tensor on every rank, which is this base's behaviour.

    Example:
      >>> Shard(1).local_shape((8, 6), 3), Replicate().local_shape((8, 6), 3)
      ((8, 2), (8, 6))
    """

    @property
    def is_split(self) -> bool:
        """Each rank holds a different part (so the axis is not a data-parallel copy of it)."""
        return False

    @property
    def dim(self) -> int | None:
        """The dim it splits, or ``None``."""
        return None

    @property
    def parts(self) -> int:
        """Fused parts the split dim holds side by side (1: one)."""
        return 1

    def local_shape(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The shape of one rank's part of a tensor of ``shape``."""
        return shape

    def part(self, full: "torch.Tensor", size: int, index: int) -> "torch.Tensor":
        """Rank ``index``'s part of ``full`` (a view where one exists)."""
        return full

    def offsets(self, shape: tuple[int, ...], size: int, index: int) -> tuple[int, ...] | None:
        """Where rank ``index``'s part starts along each dim of ``shape``, or ``None`` when it is
        not one box of the tensor."""
        return (0,) * len(shape)

    def uses_zeros(self, index: int) -> bool:
        """Rank ``index`` computes with zeros in place of the tensor (see :class:`Partial`)."""
        return False

    def check(self, name: str, shape: tuple[int, ...], axis: Role, size: int) -> None:
        """Raises ``ValueError`` if ``shape`` cannot be placed so over ``size`` ranks."""

    @property
    def cuts_rows(self) -> bool:
        """Whether data-parallel rows cut from a part are a placement DTensor can describe (so a
        unit may shard the part over a data-parallel axis of more than one rank)."""
        return True

    def to_dtensor(self) -> Any:
        """The DTensor placement a user sees for this one: replicated unless split."""
        from torch.distributed.tensor import Replicate as DReplicate

        return DReplicate()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclasses.dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """The whole tensor on every rank of the axis.

    Example:
      >>> Replicate().is_split, Replicate()
      (False, Replicate())
    """


@dataclasses.dataclass(frozen=True, repr=False)
class Partial(Placement):
    """The whole tensor on every rank, used as a partial sum: rank 0 of the axis computes with it
    and the others with zeros, so the sum over the axis (a rowwise Linear's all-reduce) adds it
    once. Its gradient, the same on every rank, reaches it whole. The user sees it replicated.

    Example:
      >>> [Partial().uses_zeros(r) for r in range(3)]
      [False, True, True]
    """

    def uses_zeros(self, index: int) -> bool:
        return index != 0


@dataclasses.dataclass(frozen=True, repr=False)
class Shard(Placement):
    """The ``r``-th of ``size`` equal blocks along ``dim`` (``Shard(d)`` of DTensor, a name in
    that position of a JAX ``PartitionSpec``).

    Example:
      >>> s = Shard(0)
      >>> s.local_shape((6, 4), 2), s.offsets((6, 4), 2, 1), s.part(torch.arange(6), 3, 2).tolist()
      ((3, 4), (3, 0), [4, 5])
    """

    split_dim: int = 0

    @property
    def is_split(self) -> bool:
        return True

    @property
    def dim(self) -> int | None:
        return self.split_dim

    def local_shape(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        d = self.split_dim
        return tuple(s // size if i == d else s for i, s in enumerate(shape))

    def part(self, full: "torch.Tensor", size: int, index: int) -> "torch.Tensor":
        n = full.shape[self.split_dim] // size
        return full.narrow(self.split_dim, index * n, n)

    def offsets(self, shape: tuple[int, ...], size: int, index: int) -> tuple[int, ...] | None:
        n = shape[self.split_dim] // size
        return tuple(index * n if i == self.split_dim else 0 for i in range(len(shape)))

    def check(self, name: str, shape: tuple[int, ...], axis: Role, size: int) -> None:
        d = self.split_dim
        if axis is Role.EP and d == 0:
            # The expert axis splits the packed experts: say it in those words.
            if not shape:
                raise ValueError(f"parameter {name!r} is 0-d; an expert weight packs its experts along dim 0")
            if shape[0] % size:
                raise ValueError(
                    f"expert parameter {name!r} packs {shape[0]} experts (dim 0 of {shape}), which do not divide "
                    f"over ep={size} ranks; choose a number of experts that is a multiple of ep, or a smaller ep"
                )
            return
        if d >= len(shape):
            raise ValueError(
                f"parameter {name!r} of shape {shape} cannot be split along dim {d} ({axis.value}={self!r})"
            )
        if shape[d] % size:
            raise ValueError(
                f"parameter {name!r} has {shape[d]} along dim {d}, which does not divide over {axis.value}={size} "
                f"ranks; choose a {axis.value} degree that divides it, or leave this module out of {axis.value}="
            )

    def to_dtensor(self) -> Any:
        from torch.distributed.tensor import Shard as DShard

        return DShard(self.split_dim)

    def __repr__(self) -> str:
        return f"Shard({self.split_dim})"


@dataclasses.dataclass(frozen=True, repr=False)
class StridedShard(Shard):
    """Dim ``dim`` holds ``parts`` fused parts side by side (q|k|v); rank ``r`` of ``size`` holds
    the ``r``-th block of each part, stacked: DTensor's ``_StridedShard(dim, split_factor=parts)``,
    Megatron's ``partition_stride``. Not one box of the tensor, and data-parallel rows cut from it
    would straddle the parts, so it is never cut over a data-parallel axis of more than one rank.

    Example:
      >>> StridedShard(0, 3).part(torch.arange(6), 2, 1).tolist()  # parts [0 1] [2 3] [4 5]
      [1, 3, 5]
    """

    fused: int = 2

    def __post_init__(self):
        if self.fused < 2:
            raise ValueError(
                f"StridedShard needs >= 2 fused parts, got {self.fused}; one part is Shard({self.split_dim})"
            )

    @property
    def parts(self) -> int:
        return self.fused

    def part(self, full: "torch.Tensor", size: int, index: int) -> "torch.Tensor":
        d, k = self.split_dim, self.fused
        if d != 0:
            raise NotImplementedError("StridedShard along a dim other than 0")
        n = full.shape[0] // size
        return full.reshape(k, size, n // k, *full.shape[1:])[:, index].reshape(n, *full.shape[1:])

    def offsets(self, shape: tuple[int, ...], size: int, index: int) -> tuple[int, ...] | None:
        return None

    def check(self, name: str, shape: tuple[int, ...], axis: Role, size: int) -> None:
        super().check(name, shape, axis, size)
        if shape[self.split_dim] % (self.fused * size):
            raise ValueError(
                f"parameter {name!r} has {shape[self.split_dim]} rows, which do not make {self.fused} fused parts of equal "
                f"size that each divide over {axis.value}={size} ranks (colwise_fused:{self.fused}); check the number of "
                f"fused parts, or choose a {axis.value} degree that divides each part"
            )

    @property
    def cuts_rows(self) -> bool:
        return False

    def to_dtensor(self) -> Any:
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(self.split_dim, split_factor=self.fused)

    def __repr__(self) -> str:
        return f"StridedShard({self.split_dim}, parts={self.fused})"


@dataclasses.dataclass(frozen=True)
class AxisPlacement:
    """A parameter's :class:`Placement` on the mesh axis with role ``axis``, of ``size`` ranks.

    Example:
      >>> AxisPlacement("tp", 2, Shard(1))
      AxisPlacement('tp', 2, Shard(1))
    """

    axis: Role
    size: int
    placement: Placement

    def __post_init__(self):
        object.__setattr__(self, "axis", Role(self.axis))
        if self.axis not in PLACED_ROLES:
            raise ValueError(
                f"a parameter is placed on the axes {[r.value for r in PLACED_ROLES]}, not {self.axis.value!r}: "
                "the data-parallel axes are its unit's"
            )
        if not isinstance(self.placement, Placement):
            raise ValueError(f"placement on {self.axis.value!r} must be an fsdpfn Placement, got {self.placement!r}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"{self.axis.value}_size must be >= 1, got {self.size}")

    def __repr__(self) -> str:
        return f"AxisPlacement({self.axis.value!r}, {self.size}, {self.placement!r})"


def normalise(entries: Iterable[AxisPlacement]) -> tuple[AxisPlacement, ...]:
    """``entries`` in :data:`PLACED_ROLES` order, without the ones that say nothing (replicated
    over one rank), so that equal placements compare equal; two entries for one axis are refused.

    Example:
      >>> normalise([AxisPlacement("tp", 2, Shard(0)), AxisPlacement("ep", 1, Replicate())])
      (AxisPlacement('tp', 2, Shard(0)),)
    """
    by_axis: dict[Role, AxisPlacement] = {}
    for e in entries:
        if e.axis in by_axis:
            raise ValueError(f"two placements on axis {e.axis.value!r}: {by_axis[e.axis]!r} and {e!r}")
        by_axis[e.axis] = e
    return tuple(
        by_axis[r]
        for r in PLACED_ROLES
        if r in by_axis and (by_axis[r].size > 1 or type(by_axis[r].placement) is not Replicate)
    )


# ---- what one parameter's placements say -------------------------------------------------------
# ``spec`` below is anything with ``name``, ``shape`` and ``placements`` (a ParamSpec).


def placement_of(spec, axis: Role) -> Placement:
    """``spec``'s placement on ``axis`` (``Replicate()`` where it has none).

    Example:
      >>> p = fsdpfn.ParamSpec("w", (4, 6), torch.float32, tp="shard1", tp_size=2)
      >>> placement_of(p, Role.TP), placement_of(p, Role.EP)
      (Shard(1), Replicate())
    """
    for e in spec.placements:
        if e.axis is axis:
            return e.placement
    return Replicate()


def axis_size(spec, axis: Role) -> int:
    """Ranks on ``axis`` that ``spec`` was placed for (1 where it has no entry)."""
    for e in spec.placements:
        if e.axis is axis:
            return e.size
    return 1


def local_shape(spec) -> tuple[int, ...]:
    """The shape of one rank's model-parallel part of ``spec``: each axis cuts the part the
    earlier ones left. What a unit gathers over its data-parallel axes.

    Example:
      >>> local_shape(fsdpfn.ParamSpec("w", (4, 6), torch.float32, tp="shard1", tp_size=2))
      (4, 3)
    """
    shape = tuple(spec.shape)
    for e in spec.placements:
        shape = e.placement.local_shape(shape, e.size)
    return shape


def local_part(spec, full: "torch.Tensor", index: Mapping[Role, int]) -> "torch.Tensor":
    """The part of the global tensor ``full`` held at position ``index[axis]`` of each axis
    ``spec`` is placed on (a view, or a copy for a :class:`StridedShard`).

    Example:
      >>> p = fsdpfn.ParamSpec("w", (4,), torch.float32, tp="shard0", tp_size=2)
      >>> local_part(p, torch.arange(4), {Role.TP: 1}).tolist()
      [2, 3]
    """
    for e in spec.placements:
        full = e.placement.part(full, e.size, index.get(e.axis, 0))
    return full


def local_box(spec, rows: tuple[int, int], index: Mapping[Role, int]) -> tuple[slice, ...] | None:
    """The box of the global tensor holding rows ``[start, stop)`` of the part at ``index``
    (one ``slice`` per leading dim up to the last one cut: ``()`` for a 0-d tensor), or ``None``
    when the part is not one box (a :class:`StridedShard`).

    Example:
      >>> p = fsdpfn.ParamSpec("w", (4, 6), torch.float32, tp="shard1", tp_size=2)
      >>> local_box(p, (1, 3), {Role.TP: 1})
      (slice(1, 3, None), slice(3, 6, None))
    """
    shape = tuple(spec.shape)
    if not shape:
        return ()
    start = [0] * len(shape)
    for e in spec.placements:
        off = e.placement.offsets(shape, e.size, index.get(e.axis, 0))
        if off is None:
            return None
        start = [a + b for a, b in zip(start, off)]
        shape = e.placement.local_shape(shape, e.size)
    cut = [
        e.placement.dim for e in spec.placements if e.placement.is_split and e.placement.dim
    ]  # dims past 0 some axis splits
    box = [slice(start[0] + rows[0], start[0] + rows[1])]
    for d in range(1, (max(cut) + 1) if cut else 1):
        box.append(slice(start[d], start[d] + shape[d]) if d in cut else slice(None))
    return tuple(box)


def uses_zeros(spec, index: Mapping[Role, int]) -> bool:
    """Whether the rank at ``index`` computes with zeros in place of ``spec`` (a
    :class:`Partial` placement, at any position but 0)."""
    return any(e.placement.uses_zeros(index.get(e.axis, 0)) for e in spec.placements)


def split_roles(spec) -> tuple[Role, ...]:
    """The axes over which ``spec`` is split (each rank a different part)."""
    return tuple(e.axis for e in spec.placements if e.placement.is_split)


def check(spec) -> None:
    """Raises ``ValueError`` (``NotImplementedError`` for what is not supported yet) unless every
    placement of ``spec`` fits its shape."""
    split = split_roles(spec)
    if len(split) > 1:
        # The packed experts would need their ep part split again over tp: no layer computes that.
        raise NotImplementedError(
            f"parameter {spec.name!r} is split over {' and '.join(r.value for r in split)} "
            f"({', '.join(repr(e.placement) for e in spec.placements if e.placement.is_split)}); a parameter split over two "
            "model-parallel axes is not supported yet (experts split over both ep and tp). Leave the expert layers out of tp="
        )
    for e in spec.placements:
        e.placement.check(spec.name, tuple(spec.shape), e.axis, e.size)


# ---- which axes a parameter's rows and gradients run over ---------------------------------------


def row_roles(spec, axes: MeshAxes) -> tuple[Role, ...]:
    """The data-parallel mesh axes a unit holding ``spec`` cuts its rows over and gathers and
    reduce-scatters over, in mesh order: the shard axis, and every data-parallel axis that is not
    the replicate axis and does not split ``spec`` (a dense parameter beside ``ep`` is sharded
    over ``ep`` x ``shard`` flattened; an expert weight, split over ``ep``, over ``shard`` alone).

    Example:
      >>> dense = fsdpfn.ParamSpec("w", (4, 6), torch.float32)
      >>> expert = fsdpfn.ParamSpec("e", (4, 6), torch.float32, expert=True, ep_size=2)
      >>> axes = MeshAxes.from_shape({"ep": 2, "edp": 2})
      >>> row_roles(dense, axes), row_roles(expert, axes)
      ((<Role.EP: 'ep'>, <Role.SHARD: 'shard'>), (<Role.SHARD: 'shard'>,))
      >>> with_cp = MeshAxes.from_shape({"ep": 2, "edp": 1, "cp": 2})  # cp splits neither
      >>> [r.value for r in row_roles(dense, with_cp)], [r.value for r in row_roles(expert, with_cp)]
      (['ep', 'shard', 'cp'], ['shard', 'cp'])
    """
    return rows_over(split_roles(spec), axes)


def rows_over(split: Sequence[Role], axes: MeshAxes) -> tuple[Role, ...]:
    """:func:`row_roles` of a parameter split over the axes ``split``: ``rows_over((), axes)``
    are a dense (unsplit) parameter's."""
    return tuple(r for r in axes.roles if r.is_data_parallel and r is not Role.REPLICATE and r not in split)


def rows_size(specs: Sequence, axes: MeshAxes) -> int:
    """Ranks a unit holding ``specs`` cuts its rows over (its ``shard_size``): the product of
    their :func:`row_roles`' sizes.

    Example:
      >>> rows_size([fsdpfn.ParamSpec("w", (4, 6), torch.float32)], MeshAxes.from_shape({"ep": 2, "edp": 3}))
      6
    """
    return math.prod(axes.size(r) for r in (row_roles(specs[0], axes) if specs else rows_over((), axes)))


def unit_row_roles(unit, axes: MeshAxes) -> tuple[Role, ...]:
    """:func:`row_roles` of ``unit``'s parameters, which its flat buffer cuts over together (a
    unit never mixes parameters split over different data-parallel axes: ``Unit`` refuses expert
    weights beside dense ones). More than one axis: they are flattened into one group.

    Example:
      >>> unit_row_roles(plan.units[0], plan.axes)
      (<Role.SHARD: 'shard'>,)
    """
    return row_roles(unit.params[0], axes) if unit.params else rows_over((), axes)


def reduce_roles(spec, axes: MeshAxes) -> tuple[Role, ...]:
    """The mesh axes ``spec``'s gradient is summed over: every data-parallel axis that does not
    split it (its rows' axes, then the replicate axis). Never a split axis: an expert's gradient
    already sums every ``ep`` rank's tokens (the all-to-all's backward), and a ``tp`` part's is
    its own.

    Example:
      >>> reduce_roles(fsdpfn.ParamSpec("w", (4,), torch.float32, tp="shard0", tp_size=2), MeshAxes.from_shape({"dp": 2, "tp": 2}))
      (<Role.SHARD: 'shard'>,)
    """
    rep = (Role.REPLICATE,) if Role.REPLICATE in axes.roles else ()
    return row_roles(spec, axes) + rep


def mesh_dims(rows: Sequence[Role], axes: MeshAxes) -> tuple[tuple[Role, ...], ...]:
    """The dims of the mesh a parameter whose rows are cut over ``rows`` (its
    :func:`row_roles`) is placed on, in mesh order, each as the roles it joins: the row axes
    flattened into one dim where the first of them is, every other axis a dim of its own. With
    one row axis, the plan's mesh itself; a dense parameter beside ``ep`` lives on
    ``(ep x shard)``, one beside ``cp`` and ``tp`` on ``(shard x cp, tp)``.

    Example:
      >>> mesh_dims((Role.SHARD, Role.CP), MeshAxes.from_shape({"replicate": 2, "dp": 2, "cp": 2, "tp": 2}))
      ((<Role.REPLICATE: 'replicate'>,), (<Role.SHARD: 'shard'>, <Role.CP: 'cp'>), (<Role.TP: 'tp'>,))
    """
    rows = tuple(rows)
    out: list[tuple[Role, ...]] = []
    for role in axes.roles:
        if role not in rows:
            out.append((role,))
        elif role is rows[0]:
            out.append(rows)
    return tuple(out)


def dtensor_placements(spec, axes: MeshAxes, sharded: bool) -> tuple:
    """The DTensor placements of ``spec``, one per dim of the mesh its unit lives on
    (:func:`mesh_dims` of its :func:`row_roles`: the plan's mesh when its rows are cut over one
    axis, else those axes flattened into one dim): the rows' dim ``Shard(0)`` if ``sharded``
    (its unit shards it) else ``Replicate()``, each model-parallel axis placed as ``spec`` says,
    the replicate axis ``Replicate()``. Data-parallel rows cut from a part that a later mesh dim
    splits along dim 0 are ``_StridedShard(0, split_factor=that axis's size)`` (as FSDP2 places
    them on a 2-D mesh).

    Example:
      >>> p = fsdpfn.ParamSpec("w", (4, 6), torch.float32, tp="shard0", tp_size=2)
      >>> dtensor_placements(p, MeshAxes.from_shape({"dp": 2, "tp": 2}), True)
      (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = row_roles(spec, axes)
    dims = mesh_dims(rows, axes)
    position = {role: i for i, dim in enumerate(dims) for role in dim}
    out: list = []
    for i, dim in enumerate(dims):
        if dim == rows:
            later = [e for e in spec.placements if e.placement.dim == 0 and e.size > 1 and position.get(e.axis, -1) > i]
            rows_one = math.prod(axes.size(r) for r in rows) == 1
            if not sharded or (rows_one and not all(e.placement.cuts_rows for e in spec.placements)):
                # A fused part is never cut over a data-parallel axis of > 1 rank (the plan refuses it).
                out.append(DReplicate())
            elif later:
                out.append(_StridedShard(0, split_factor=later[0].size))
            else:
                out.append(DShard(0))
        elif dim[0] in PLACED_ROLES:
            out.append(placement_of(spec, dim[0]).to_dtensor())
        else:
            out.append(DReplicate())
    return tuple(out)


# ---- the plan builder's and JSON's vocabulary ---------------------------------------------------
# Plans name tp placements by style strings (ParamSpec(tp="shard0"), JSON "tp": "shard1") and
# expert weights by a flag; these are the one translation between those and placements.

_TP_STYLE = {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1), "partial": Partial()}


def from_legacy(
    name: str, tp: str = "replicate", tp_size: int = 1, expert: bool = False, ep_size: int = 1, tp_stride: int = 1
) -> tuple[AxisPlacement, ...]:
    """The placements the ``tp`` / ``tp_size`` / ``tp_stride`` / ``expert`` / ``ep_size`` words
    of parameter ``name`` mean (what ``ParamSpec(..., tp=..., tp_size=...)`` and plan JSON say).

    Example:
      >>> from_legacy("qkv.weight", "shard0", 2, tp_stride=3)
      (AxisPlacement('tp', 2, StridedShard(0, parts=3)),)
    """
    if tp_stride < 1 or (tp_stride > 1 and tp != "shard0"):
        raise ValueError(
            f"parameter {name!r}: tp_stride={tp_stride} needs tp='shard0' and a stride >= 1 (got tp={tp!r})"
        )
    if tp not in _TP_STYLE:
        raise ValueError(
            f"parameter {name!r}: unknown tensor-parallel placement {tp!r}; choose one of {', '.join(_TP_STYLE)}"
        )
    if tp_size < 1:
        raise ValueError(f"parameter {name!r}: tp_size must be >= 1, got {tp_size}")
    if ep_size < 1:
        raise ValueError(f"parameter {name!r}: ep_size must be >= 1, got {ep_size}")
    tp_placement = StridedShard(0, tp_stride) if tp_stride > 1 else _TP_STYLE[tp]
    return normalise(
        [
            AxisPlacement(Role.EP, ep_size, Shard(0) if expert else Replicate()),
            AxisPlacement(Role.TP, tp_size, tp_placement),
        ]
    )


def legacy_fields(spec) -> dict[str, Any]:
    """``{"tp": style, "tp_stride": k, "expert": bool}`` of ``spec``: what its placements are
    called in plan JSON and by the compatibility properties of :class:`fsdpfn.ParamSpec`.

    Example:
      >>> legacy_fields(fsdpfn.ParamSpec("w", (4, 6), torch.float32, tp="shard1", tp_size=2))
      {'tp': 'shard1', 'tp_stride': 1, 'expert': False}
    """
    tp = placement_of(spec, Role.TP)
    style = next(
        (s for s, p in _TP_STYLE.items() if p == tp or (type(tp) is StridedShard and p == Shard(tp.split_dim))), None
    )
    if style is None:
        raise ValueError(f"parameter {spec.name!r} is placed {tp!r} over tp, which plan JSON has no word for (yet)")
    return {"tp": style, "tp_stride": tp.parts, "expert": placement_of(spec, Role.EP).is_split}


def module_placement(parts: int | None, rowwise: bool, leaf: str) -> Placement:
    """The tp placement of parameter ``leaf`` of a Linear split by output features into ``parts``
    fused parts (1: plain colwise), or by input features (``rowwise``); ``parts=None``: not split.

    Example:
      >>> module_placement(1, True, "weight"), module_placement(1, True, "bias"), module_placement(3, False, "bias")
      (Shard(1), Partial(), StridedShard(0, parts=3))
    """
    if parts is None:
        return Replicate()
    if rowwise:
        return Shard(1) if leaf == "weight" else Partial()  # input features; the bias is added once
    return StridedShard(0, parts) if parts > 1 else Shard(0)  # output features: weight rows and bias
