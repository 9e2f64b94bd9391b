"""Newton–Schulz on sharded matrices: the ``"owner"``, ``"duplicated"`` and ``"blockwise"`` layouts.

Muon leaves arrive as DTensors split over any of a mesh's dims: rows over the data-parallel
shard axis, rows or columns over a tensor-parallel axis, both (``_StridedShard`` for data-parallel
rows cut from each tensor-parallel slice), replicated over the rest (HSDP's replicate axis, tp
for weights it does not split); or as plain tensors. Each rank's piece is a box of the leaf
(``fsdpfn/optim/_layout.py``, [Note: holdings]); local rows and columns follow ``torch.chunk``
(:func:`fsdpfn._plan.chunk_bounds`), so pieces can be uneven or empty. The ranks that share the
work (the *work group*) are the mesh dims along which any leaf is split, one process group
(flattened when several dims); every group of the other axes computes the same thing. A leaf
may be orthogonalised as independent blocks (``fsdpfn/optim/_blocks.py``, [Note: blocks]).

[Note: the two layouts]
(Three with ``"blockwise"``, which changes what is computed; ``"gather"`` is the old name of
``"duplicated"``.) ``W`` is the work group's size, ``N`` the Muon elements.

``"duplicated"`` (the simple baseline, Megatron's name): one all-gather brings every full matrix
to every rank (local pieces padded to the largest piece inside the flat buffer), every rank runs
Newton–Schulz on all of them (block by block where a leaf has blocks) and keeps its piece. Per
rank it receives ``(W-1)/W`` of the Muon bytes and the ranks together do ``W`` times the
one-process FLOPs.

``"owner"``: every block (a whole matrix unless the leaf has blocks) gets one owner rank, chosen
greedily (largest first, to the least loaded rank) so that Newton–Schulz FLOPs balance. An
all-to-all (uneven splits) sends each piece of each block to its owner (one sender per distinct
piece, so replicas do not send twice), which assembles the block, orthogonalises it (same shapes
stacked into one batched call), and a second all-to-all sends every holder its part back. The
blocks travel in buckets, each bucket's communication running under another bucket's
Newton–Schulz (``fsdpfn/optim/_owner.py``, [Note: the pipelined owner layout]). Per rank that
moves ``2 (W-1)/W^2`` of the Muon bytes on average when no leaf is replicated inside the work
group (``2/W`` of ``"duplicated"``: 0.25x at ``W = 8``), and the FLOPs summed over the work group
equal the one-process FLOPs. A block one rank holds whole and no other rank touches (an expert
of a batch ``[E, m, n]`` split over experts, a head inside a tensor-parallel slice) is
orthogonalised there with no communication and counts towards that rank's load first.

``"blockwise"``: ``"owner"`` on blocks that never cross a tensor-parallel piece: each tp piece of
a matrix (and each of the user's blocks inside it) is orthogonalised alone, Megatron's blockwise
mode. Without data-parallel sharding nothing travels. The update then depends on the tp degree
(a matrix split in 2 and in 4 gives different orthogonal pieces), which is why it is not the
default: use it to compare, or where a mesh is fixed for the whole run.

All layouts send in the Newton–Schulz compute dtype: Newton–Schulz casts its input first, so
casting before sending changes no bit and halves the bytes in bf16. ``"owner"`` and
``"duplicated"`` give the one-process update bit for bit whatever the mesh (each block is
assembled from copied bits and orthogonalised by the same calls).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn.optim._blocks import WHOLE, BlockSpec, block_shape
from fsdpfn.optim._checks import check_choice, check_int
from fsdpfn.optim._newton_schulz import DEFAULT_GRAM_RESTARTS, check_settings, newton_schulz, newton_schulz_flops
from fsdpfn.optim._layout import Box, holdings, split_dims, whole_holdings, work_group  # noqa: F401 - gather_pads's example uses whole_holdings
from fsdpfn.optim._owner import assign_owners, local_blocks_ns, owner_schedule, run_owner
from fsdpfn.optim._tree import like
from fsdpfn import comm as C

__all__ = [
    "LAYOUTS",
    "assign_owners",
    "blockwise_spec",
    "blockwise_spec_on_mesh",
    "check_buckets",
    "gather_pads",
    "ns_block_spec",
    "orthogonalize",
    "owner_plan",
]

LAYOUTS = ("owner", "duplicated", "blockwise", "gather")


def check_buckets(who: str, buckets: Any, name: str = "buckets") -> int | None:
    """``None`` (automatic) or an int >= 1: the owner layout's number of buckets."""
    if buckets is None:
        return None
    return check_int(who, name, buckets, lo=1, fix="None picks a number from the bytes sent; 1 turns pipelining off.")


class _NS(NamedTuple):
    steps: int
    coeffs: tuple[float, float, float]
    eps: float
    dtype: torch.dtype | None
    method: str = "standard"
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x.to(self.dtype or x.dtype)
        return newton_schulz(
            x,
            self.steps,
            self.coeffs,
            eps=self.eps,
            dtype=self.dtype,
            method=self.method,
            gram_restarts=self.gram_restarts,
        )

    def flops(self, shape: tuple[int, ...]) -> int:
        return newton_schulz_flops(shape, self.steps, self.method, self.gram_restarts)

    def send_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.dtype or x.dtype


def ns_block_spec(x: torch.Tensor, name: str, spec: BlockSpec, layout: str) -> BlockSpec:
    """The blocks Newton–Schulz runs on for leaf ``x`` under ``layout``: the user's ``spec``,
    refined by ``"blockwise"`` into the tensor-parallel pieces. The one source of the block
    shape for both :func:`orthogonalize` and the learning-rate ratio of
    :func:`fsdpfn.optim.scale_by_muon_lr`, which must agree on it.

    Example:
      >>> ns_block_spec(torch.zeros(12, 4), "w", (3, 1), "blockwise")  # no tp pieces: the user's blocks
      (3, 1)
    """
    block_shape(name, tuple(x.shape), spec)
    return _blockwise_spec(x, name, spec) if layout == "blockwise" else spec


def _blockwise_spec(x: torch.Tensor, name: str, spec: BlockSpec) -> BlockSpec:
    """``spec`` refined so that no block crosses a tensor-parallel piece of ``x`` (the
    ``"blockwise"`` layout): the tp pieces are the blocks, or the user's blocks inside them."""
    if not isinstance(x, DTensor) or x.dim() < 2:
        return spec
    mesh = x.device_mesh
    try:
        axes = MeshAxes.from_mesh(mesh)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(
            f"layout='blockwise' orthogonalises each tensor-parallel piece of Muon leaf {name!r} alone, so it must know which "
            f"mesh dim is tensor parallel, and the mesh's dim names do not say ({e}); name that dim 'tp'"
        ) from None
    return blockwise_spec_on_mesh(tuple(x.shape), x.placements, tuple(mesh.shape), axes, spec, name)


def blockwise_spec_on_mesh(
    shape: tuple[int, ...], placements, sizes: tuple[int, ...], axes: MeshAxes, spec: BlockSpec = WHOLE, name: str = ""
) -> BlockSpec:
    """:func:`blockwise_spec` for a leaf of global ``shape`` with ``placements`` on a mesh of
    ``sizes`` whose dims have the roles of ``axes``: the pieces are those of its
    tensor-parallel dim (none: ``spec`` as it is). What ``layout="blockwise"`` orthogonalises,
    for a DTensor and for a plan alike (``fsdpfn.sim`` prices it from the plan).

    Example:
      >>> from fsdpfn._plan.axes import MeshAxes
      >>> axes = MeshAxes.from_shape({"dp": 2, "tp": 2})
      >>> blockwise_spec_on_mesh((12, 4), (Shard(0), Shard(0)), (2, 2), axes)
      (2, 1)
    """
    d = axes.dim(Role.TP)
    if d is None:
        return spec
    return blockwise_spec(tuple(shape), placements[d], sizes[d], spec, name)


def blockwise_spec(
    shape: tuple[int, ...], tp_placement: Any, tp: int, spec: BlockSpec = WHOLE, name: str = ""
) -> BlockSpec:
    """The blocks ``layout="blockwise"`` orthogonalises a leaf of global ``shape`` in: ``spec``
    refined so that no block crosses one of the ``tp`` pieces the leaf's placement on the
    tensor-parallel mesh dim (``tp_placement``) cuts it into.

    Example:
      >>> blockwise_spec((12, 4), Shard(0), 2), blockwise_spec((12, 4), Shard(1), 2, (4, 1))
      ((2, 1), (4, 2))
    """
    if len(shape) < 2 or tp == 1 or not isinstance(tp_placement, Shard):
        return spec
    tdim = tp_placement.dim % len(shape)
    if len(shape) > 2 and tdim == 0:
        return spec  # whole matrices per piece already
    axis = 0 if tdim == len(shape) - 2 else 1
    m = list(spec)
    if max(m[axis], tp) % min(m[axis], tp):
        raise ValueError(
            f"Muon leaf {name!r}: its blocks {spec} cut across its {tp} tensor-parallel pieces along dim {tdim} "
            f"(layout='blockwise' needs every block inside one piece, or every piece a union of blocks); use a block count "
            f"that divides or is a multiple of {tp} along that dim"
        )
    m[axis] = max(m[axis], tp)
    block_shape(name, tuple(shape), (m[0], m[1]))
    return (m[0], m[1])


def gather_pads(held: Sequence[Sequence[Box]]) -> list[int]:
    """Elements each leaf takes in the ``"duplicated"`` layout's all-gather buffer, per rank:
    the largest piece any rank holds (smaller pieces are padded to it).

    Example:
      >>> gather_pads([whole_holdings((5, 4), 2)])
      [12]
    """
    return [max(h.numel for h in hs) for hs in held]


def orthogonalize(
    leaves: list[torch.Tensor],
    names: list[str],
    *,
    layout: str = "owner",
    steps: int = 5,
    coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    method: str = "standard",
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS,
    blocks: list[BlockSpec] | None = None,
    buckets: int | None = None,
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of every leaf's full matrices (or of their blocks), returned placed
    like the leaf.

    Leaves may be split over any mesh dims (data parallel, tensor parallel, both: see
    ``fsdpfn/optim/_layout.py``, [Note: holdings]); the result does not depend on how, except
    with ``layout="blockwise"``.

    Args:
      leaves: tensors or DTensors with at least 2 dimensions (the last two are the matrix).
      names: one name per leaf, for error messages.
      layout: ``"owner"``, ``"duplicated"`` (alias ``"gather"``) or ``"blockwise"`` (see
        [Note: the layouts]).
      steps, coeffs, eps, dtype, method, gram_restarts: as :func:`newton_schulz`.
      blocks: per leaf, ``(m, n)``: orthogonalise each matrix as ``m`` row blocks times ``n``
        column blocks, each alone (``fsdpfn/optim/_blocks.py``); default whole matrices.
      buckets: owner layout: number of buckets whose communication is pipelined under the
        Newton–Schulz of the others; ``None`` chooses from the bytes sent, ``1`` is unpipelined
        (see ``fsdpfn/optim/_owner.py``). Every choice gives the same bits.

    Returns:
      One tensor per leaf in the compute dtype: DTensors with the input's placements, plain
      tensors for plain inputs. Equals :func:`newton_schulz` of the full tensor (of each block
      of it), piece for piece.

    Raises:
      ValueError: a setting is invalid (see :func:`check_settings`), on every rank before any
        collective; or a leaf is not a matrix, its blocks do not divide it, or (blockwise) they
        cut across its tensor-parallel pieces (every rank holds the same leaves, so every rank).
      NotImplementedError: a leaf's placements are not Shard/Replicate (e.g. ``Partial``), named.

    Example:
      >>> w = torch.randn(12, 8)
      >>> o = fsdpfn.optim.orthogonalize([w], ["qkv"], dtype=torch.float32, blocks=[(3, 1)])[0]
      >>> torch.allclose(o[4:8], fsdpfn.optim.newton_schulz(w[4:8], dtype=torch.float32), atol=1e-6)
      True
    """
    # Host-side checks, the same verdict on every rank, before any rank communicates.
    check_choice("orthogonalize", "layout", layout, LAYOUTS)
    check_settings("orthogonalize", steps, coeffs, eps, dtype, method, gram_restarts)
    buckets = check_buckets("orthogonalize", buckets)
    specs = list(blocks) if blocks is not None else [WHOLE] * len(leaves)
    ns = _NS(steps, cast("tuple[float, float, float]", tuple(coeffs)), eps, dtype, method, tuple(gram_restarts))
    out: list[Any] = [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    meshes: dict[tuple, Any] = {}
    dims_of: dict[int, tuple[int, ...]] = {}
    for i, (x, name) in enumerate(zip(leaves, names)):
        if x.dim() < 2:
            raise ValueError(
                f"Muon leaf {name!r} has shape {tuple(x.shape)}; Muon needs matrices (>= 2-D). Label it for AdamW instead."
            )
        specs[i] = ns_block_spec(x, name, specs[i], layout)
        dims_of[i] = split_dims(x, name)
    for i, (x, name) in enumerate(zip(leaves, names)):
        if not dims_of[i]:
            loc = x._local_tensor if isinstance(x, DTensor) else x
            out[i] = like(x, local_blocks_ns(loc, specs[i], ns))  # type: ignore[arg-type]  # mypy misses a NamedTuple's __call__
            continue
        assert isinstance(x, DTensor)  # split_dims is () for a plain tensor
        key = (id(x.device_mesh), ns.send_dtype(x))
        groups.setdefault(key, []).append(i)
        meshes[key] = x.device_mesh
    for key, idx in groups.items():  # insertion order: the same on every rank
        mesh = meshes[key]
        dims = tuple(sorted({d for i in idx for d in dims_of[i]}))
        wg = work_group(mesh, dims)
        xs, sp = [cast(DTensor, leaves[i]) for i in idx], [specs[i] for i in idx]
        held = [holdings(x, names[i], wg.coords) for x, i in zip(xs, idx)]
        locs = [x._local_tensor for x in xs]
        for x, i, h, loc in zip(xs, idx, held, locs):
            mine = h[wg.rank]
            if loc.numel() != mine.numel:
                raise ValueError(
                    f"Muon leaf {names[i]!r} on rank {C.rank()} has local shape {tuple(loc.shape)}, but its placements "
                    f"{x.placements} give this rank matrices {mine.mats}, rows {mine.rows}, cols {mine.cols} of "
                    f"{tuple(x.shape)}; build the DTensor with torch.chunk splits (fsdpfn.shard or DTensor.from_local)"
                )
        if layout in ("gather", "duplicated"):
            results = _gather(xs, held, sp, wg, ns, key[1])
        else:
            # mypy misses a NamedTuple's __call__ (ns) below
            results = run_owner(
                locs,
                [tuple(x.shape) for x in xs],
                sp,
                wg.group,
                wg.size,
                wg.rank,
                ns,  # type: ignore[arg-type]
                ns.flops,
                key[1],
                buckets,
                held,
            )
        for i, r in zip(idx, results):
            out[i] = like(leaves[i], r)
    return out


def owner_plan(
    shapes: list[tuple[int, ...]], world: int, steps: int = 5, flops: Callable[[tuple[int, ...]], int] | None = None
) -> tuple[list[int | None], list[int]]:
    """Owners of whole 2-D leaves (``None`` for batched leaves, which stay local) and the
    Newton–Schulz FLOPs each rank then runs (``flops(shape)``; standard Newton–Schulz with
    ``steps`` iterations by default): :func:`fsdpfn.optim.owner_schedule` without blocks.

    Example:
      >>> owner_plan([(4, 8, 8), (8, 8)], world=2)[0]
      [None, 0]
    """
    if flops is None:
        flops = lambda shape: newton_schulz_flops(shape, steps)  # noqa: E731
    sched = owner_schedule(shapes, world, flops, buckets=1)
    owners: list[int | None] = [None] * len(shapes)
    for b, o in zip(sched.blocks, sched.owners):
        if len(shapes[b.leaf]) == 2:
            owners[b.leaf] = o
    return owners, list(sched.loads)


# ---------------------------------------------------------------------------------------------
# "gather": every rank orthogonalises every matrix
# ---------------------------------------------------------------------------------------------


def _gather(xs: list[DTensor], held, specs: list[BlockSpec], wg, ns: _NS, send: torch.dtype) -> list[torch.Tensor]:
    pads = gather_pads(held)
    total = sum(pads)
    device = xs[0]._local_tensor.device  # every buffer on the device of the tensors it serves
    buf = torch.zeros(total, dtype=send, device=device)
    off = 0
    for x, pad in zip(xs, pads):
        loc = x._local_tensor.reshape(-1)
        buf[off : off + loc.numel()].copy_(loc)
        off += pad
    gathered = torch.empty(wg.size * total, dtype=send, device=device)
    if total:
        C.all_gather(gathered, buf, wg.group, tag="muon_gather")
    stacked = gathered.view(wg.size, total)
    results, off = [], 0
    for x, hs, spec, pad in zip(xs, held, specs, pads):
        shape = tuple(x.shape)
        full = torch.empty((math.prod(shape[:-2]), *shape[-2:]), dtype=send, device=device)
        seen = set()
        for q, h in enumerate(hs):
            if h.numel and h not in seen:  # replicas hold the same values: one of them is enough
                seen.add(h)
                dst = full[h.mats[0] : h.mats[1], h.rows[0] : h.rows[1], h.cols[0] : h.cols[1]]
                dst.copy_(stacked[q, off : off + h.numel].view(dst.shape))
        off += pad
        o = local_blocks_ns(full.view(shape), spec, ns).reshape(full.shape)  # type: ignore[arg-type]  # mypy misses a NamedTuple's __call__
        h = hs[wg.rank]
        results.append(
            o[h.mats[0] : h.mats[1], h.rows[0] : h.rows[1], h.cols[0] : h.cols[1]]
            .reshape(x._local_tensor.shape)
            .clone()
        )
    return results
