"""Where each piece of a sharded matrix lives: DTensor placements read as boxes of the matrix.

[Note: holdings]
Muon needs whole matrices; a leaf arrives as a DTensor whose pieces are spread over a mesh: rows
over the data-parallel shard axis (``Shard(0)``), rows or columns over a tensor-parallel axis
(``Shard(0)`` / ``Shard(1)``), and, when both split dim 0, data-parallel rows cut from each
tensor-parallel slice (``_StridedShard(0, split_factor=tp)``, FSDP2's 2-D layout), replicated
over the other axes (HSDP's replicate axis, tp for weights tp does not split). Whatever the
combination, the piece one rank holds is a *box* of the leaf seen as a batch of matrices
``[B, R, C]``: a range of matrices, a range of rows, a range of columns. Along every split
tensor dim the mesh dims cut it one after the other with ``torch.chunk`` semantics (ranges can
be uneven or empty): plain ``Shard`` dims in mesh order first, then ``_StridedShard`` dims,
whose ``split_factor`` must be the product of the plain dims after them (the layouts
``fsdpfn.shard`` and FSDP2 produce). Boxes of ranks that differ only along axes where the leaf
is replicated are equal (replicas); distinct boxes tile the leaf.

The *work group* of a set of leaves on one mesh is the mesh dims along which any of them is
split; its ranks are numbered in the order of the (flattened) process group. Axes outside it
(HSDP's replicate axis) hold the same data everywhere: each of their groups computes the same
thing, as data-parallel replicas do.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdpfn import comm as C
from fsdpfn._rows import chunk_bounds

__all__ = [
    "Box",
    "WorkGroup",
    "box_of",
    "holdings",
    "leaf_holdings",
    "split_dims",
    "split_mesh_dims",
    "whole_holdings",
    "work_group",
]

Span = tuple[int, int]


class Box(NamedTuple):
    """Matrices ``mats``, rows ``rows`` and columns ``cols`` (global, half-open) of a leaf seen
    as ``[B, R, C]``."""

    mats: Span
    rows: Span
    cols: Span

    @property
    def numel(self) -> int:
        return (
            max(0, self.mats[1] - self.mats[0])
            * max(0, self.rows[1] - self.rows[0])
            * max(0, self.cols[1] - self.cols[0])
        )

    def intersect(self, other: "Box") -> "Box":
        def span(a: Span, b: Span) -> Span:
            lo = max(a[0], b[0])
            return lo, max(lo, min(a[1], b[1]))

        return Box(span(self.mats, other.mats), span(self.rows, other.rows), span(self.cols, other.cols))

    def contains(self, other: "Box") -> bool:
        return all(a[0] <= b[0] and b[1] <= a[1] for a, b in zip(self, other))


def box_of(shape: Sequence[int], spans: dict[int, Span]) -> Box:
    """The box of a leaf of ``shape`` holding ``spans`` (``{tensor dim: range}``; other dims
    whole): dim 0 of a batch of matrices ranges over whole matrices.

    Example:
      >>> box_of((4, 3, 5), {0: (1, 3), 2: (0, 2)})
      Box(mats=(1, 3), rows=(0, 3), cols=(0, 2))
    """
    n = len(shape)

    def whole(d: int) -> Span:
        return spans.get(d, (0, shape[d]))

    if n == 2:
        return Box((0, 1), whole(0), whole(1))
    inner = math.prod(shape[1:-2])
    a, b = whole(0)
    return Box((a * inner, b * inner), whole(n - 2), whole(n - 1))


def whole_holdings(shape: Sequence[int], world: int) -> tuple[Box, ...]:
    """Each of ``world`` ranks' box of a leaf split along dim 0 with ``torch.chunk`` semantics.

    Example:
      >>> [b.rows for b in whole_holdings((5, 7), 2)]
      [(0, 3), (3, 5)]
    """
    return tuple(box_of(shape, {0: chunk_bounds(shape[0], world, q)}) for q in range(world))


def split_dims(x: torch.Tensor, name: str) -> tuple[int, ...]:
    """The mesh dims of size > 1 along which DTensor ``x`` is split (none for a plain tensor);
    a ``NotImplementedError`` naming the leaf for a placement Muon cannot read as boxes."""
    if not isinstance(x, DTensor):
        return ()
    sizes = tuple(x.device_mesh.size(d) for d in range(x.device_mesh.ndim))
    _order_of(tuple(x.shape), tuple(x.placements), sizes, name)  # validates
    return split_mesh_dims(tuple(x.placements), sizes)


def split_mesh_dims(placements: Sequence[Any], sizes: Sequence[int]) -> tuple[int, ...]:
    """The mesh dims of size > 1 along which a leaf placed as ``placements`` on a mesh of
    ``sizes`` is split: the dims its Muon work group spans (see [Note: holdings]).

    Example:
      >>> split_mesh_dims((Replicate(), Shard(0), Shard(1)), (2, 2, 2))
      (1, 2)
    """
    # _StridedShard is no Shard subclass in recent torch: a leaf cut only by it is still split.
    return tuple(d for d, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and sizes[d] > 1)


def _order_of(
    shape: tuple[int, ...], placements: Sequence[Any], sizes: Sequence[int], name: str
) -> dict[int, list[int]]:
    """``{tensor dim: mesh dims cutting it, in the order they cut}`` (see [Note: holdings])."""
    n = len(shape)
    plain: dict[int, list[int]] = {}
    strided: dict[int, list[tuple[int, int]]] = {}
    for d, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise NotImplementedError(
                f"Muon leaf {name!r} has placements {tuple(placements)}: distributed Newton–Schulz reads Shard, _StridedShard and "
                f"Replicate placements; mesh dim {d} has {p}. Reduce the partial values first, or label the leaf for AdamW."
            )
        dim = p.dim % n
        if n > 2 and dim not in (0, n - 2, n - 1):
            raise NotImplementedError(
                f"Muon leaf {name!r} of shape {tuple(shape)} is split along dim {dim} on mesh dim {d} ({tuple(placements)}); a batch "
                "of matrices may be split along its first dim or its matrices' rows or columns only"
            )
        if isinstance(p, _StridedShard):
            strided.setdefault(dim, []).append((d, int(p.split_factor)))
        else:
            plain.setdefault(dim, []).append(d)
    order = {dim: list(ds) for dim, ds in plain.items()}
    for dim, items in strided.items():
        for d, factor in items:
            after = math.prod(sizes[e] for e in plain.get(dim, []) if e > d)
            if factor != after:
                raise NotImplementedError(
                    f"Muon leaf {name!r} has placements {tuple(placements)}: a _StridedShard({dim}, split_factor={factor}) on mesh dim "
                    f"{d} must cut the pieces of the Shard({dim}) dims after it (split_factor {after}), as fsdpfn.shard and "
                    "FSDP2 lay out 2-D meshes"
                )
            order.setdefault(dim, []).append(d)
    return order


def holdings(x: DTensor, name: str, coords: Sequence[dict[int, int]]) -> tuple[Box, ...]:
    """The box of ``x`` each rank holds, for ranks at mesh coordinates ``coords`` (one
    ``{mesh dim: index}`` per rank; dims left out must be ones ``x`` is not split along)."""
    sizes = tuple(x.device_mesh.size(d) for d in range(x.device_mesh.ndim))
    return leaf_holdings(tuple(x.shape), tuple(x.placements), sizes, coords, name)


def leaf_holdings(
    shape: Sequence[int],
    placements: Sequence[Any],
    sizes: Sequence[int],
    coords: Sequence[dict[int, int]],
    name: str = "",
) -> tuple[Box, ...]:
    """The box each rank holds of a leaf of global ``shape`` placed as ``placements`` on a mesh
    of ``sizes``, for ranks at mesh coordinates ``coords`` (one ``{mesh dim: index}`` per rank):
    what Muon reads off a DTensor, from its description alone (see [Note: holdings]).

    Example:
      >>> [b.rows for b in leaf_holdings((10, 6), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2), [{0: 0, 1: 1}, {0: 1, 1: 1}])]
      [(5, 8), (8, 10)]
    """
    shape = tuple(shape)
    order = _order_of(shape, placements, sizes, name)
    out = []
    for c in coords:
        spans = {}
        for dim, dims in order.items():
            lo, hi = 0, shape[dim]
            for d in dims:
                a, b = chunk_bounds(hi - lo, sizes[d], c.get(d, 0))  # a dim of size 1 is not in the work group
                lo, hi = lo + a, lo + b
            spans[dim] = (lo, hi)
        out.append(box_of(shape, spans))
    return tuple(out)


class WorkGroup(NamedTuple):
    """The ranks that share a set of leaves' Newton–Schulz work (see [Note: holdings])."""

    group: Any
    size: int
    rank: int
    coords: tuple[dict[int, int], ...]  # per member, in group order: its mesh coordinates


# Process state: the work groups of a mesh, created once per process (they hold process groups).
_GROUPS: dict[tuple, tuple[Any, WorkGroup]] = {}


def work_group(mesh, dims: tuple[int, ...]) -> WorkGroup:
    """The process group over mesh dims ``dims`` (flattened when several) that this rank is in.

    Created once per mesh and dims (a new process group when several dims: every rank of the mesh
    calls this at the same step, as every rank runs the same optimizer on the same leaves)."""
    key = (id(mesh), dims)
    cached = _GROUPS.get(key)
    if cached is not None and cached[0] is mesh:  # the same mesh, not a new one at a reused id
        return cached[1]
    if len(dims) == 1:
        group = mesh.get_group(dims[0])
    else:
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(
                f"Muon leaves are split over mesh dims {dims} of a mesh without dim names; name the mesh's dims "
                "(init_device_mesh(..., mesh_dim_names=...)) so that their ranks can form one group"
            )
        group = C.mesh_subgroup(mesh, dims)
    ranks = C.group_ranks(group)
    grid = mesh.mesh
    coords = []
    for r in ranks:
        where = (grid == r).nonzero()[0].tolist()
        coords.append({d: where[d] for d in dims})
    wg = WorkGroup(group, len(ranks), ranks.index(C.rank()), tuple(coords))
    _GROUPS[key] = (mesh, wg)
    return wg
