"""Newton–Schulz on sharded matrices: the ``"gather"`` and ``"owner"`` layouts.

Muon leaves arrive as DTensors sharded ``Shard(0)`` over one mesh dimension (the shard group;
under HSDP the other dimension is ``Replicate()`` and each replicate group computes the same
thing) or replicated, or as plain tensors. Local rows follow ``torch.chunk``
(:func:`fsdpfn._plan.chunk_bounds`, the one definition of the split): ``R`` rows over ``W`` ranks
give rank ``r`` rows ``[min(r c, R), min((r+1) c, R))`` with ``c = ceil(R / W)``, so shards can
be uneven or empty.

[Note: the two layouts]
``"gather"`` (the simple baseline): one all-gather brings every full matrix to every rank (local
shards padded to ``c`` rows inside the flat buffer, trimmed after), every rank runs Newton–Schulz
on all of them and keeps its rows. Per rank it moves ``(W-1)/W`` of the Muon bytes and the ranks
together do ``W`` times the one-process FLOPs.

``"owner"``: every 2-D matrix gets one owner rank, chosen greedily (largest first, to the least
loaded rank) so that Newton–Schulz FLOPs balance. One all-to-all (uneven splits) sends each
rank's rows to the owners, each owner orthogonalises its matrices (same shapes stacked into one
batched call) and a second all-to-all, the first's transpose, sends the rows back. Per rank
that moves ``2 (W-1)/W^2`` of the Muon bytes on average, and the FLOPs summed over ranks equal
the one-process FLOPs. Leaves with 3 or more dimensions (e.g. experts ``[E, m, n]``) are
sharded along the batch dimension, so every rank already holds whole matrices: it
orthogonalises its own, with no communication, and they count towards its load first.

Both layouts send in the Newton–Schulz compute dtype: Newton–Schulz casts its input first, so
casting before sending changes no bit and halves the bytes in bf16.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpfn._plan import chunk_bounds, chunk_size
from fsdpfn.optim._checks import check_choice
from fsdpfn.optim._newton_schulz import DEFAULT_GRAM_RESTARTS, check_settings, newton_schulz, newton_schulz_flops
from fsdpfn.optim._tree import like
from fsdpfn import comm as C

__all__ = ["LAYOUTS", "assign_owners", "orthogonalize"]

LAYOUTS = ("gather", "owner")


def assign_owners(flops: list[int], world: int, base_load: list[int] | None = None) -> list[int]:
    """Owner rank of each matrix: largest first, to the least loaded rank (lowest on ties).

    Deterministic, so every rank computes the same assignment without communicating.

    Example:
      >>> assign_owners([8, 1, 4, 4], world=2)
      [0, 0, 1, 1]
    """
    loads = list(base_load) if base_load is not None else [0] * world
    owners = [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        r = min(range(world), key=lambda q: (loads[q], q))
        owners[i] = r
        loads[r] += flops[i]
    return owners


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
        return newton_schulz(x, self.steps, self.coeffs, eps=self.eps, dtype=self.dtype, method=self.method, gram_restarts=self.gram_restarts)

    def flops(self, shape: tuple[int, ...]) -> int:
        return newton_schulz_flops(shape, self.steps, self.method, self.gram_restarts)

    def send_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.dtype or x.dtype


def _shard_dim(x: torch.Tensor, name: str) -> int | None:
    """The mesh dimension ``x`` is sharded on (``Shard(0)``), or ``None`` if ``x`` is whole here."""
    if not isinstance(x, DTensor):
        return None
    dims = []
    for d, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim == 0:
            dims.append(d)
        elif not isinstance(p, Replicate):
            raise NotImplementedError(
                f"Muon leaf {name!r} has placements {x.placements}; distributed Newton–Schulz supports "
                "Shard(0) on one mesh dimension and Replicate() elsewhere (what fsdpfn.shard produces)"
            )
    if len(dims) > 1:
        raise NotImplementedError(f"Muon leaf {name!r} is sharded on {len(dims)} mesh dimensions; only one is supported")
    if not dims or x.device_mesh.size(dims[0]) == 1:
        return None
    return dims[0]


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
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of every leaf's full matrices, returned placed like the leaf.

    Args:
      leaves: tensors or DTensors with at least 2 dimensions (the last two are the matrix).
      names: one name per leaf, for error messages.
      layout: ``"gather"`` or ``"owner"`` (see [Note: the two layouts]).
      steps, coeffs, eps, dtype, method, gram_restarts: as :func:`newton_schulz`.

    Returns:
      One tensor per leaf in the compute dtype: DTensors with the input's placements, plain
      tensors for plain inputs. Equals :func:`newton_schulz` of the full tensor, row for row.

    Raises:
      ValueError: a setting is invalid (see :func:`check_settings`), on every rank before any
        collective; or a leaf is not a matrix (every rank holds the same leaves, so every rank).
    """
    # Host-side checks, the same verdict on every rank, before any rank communicates.
    check_choice("orthogonalize", "layout", layout, LAYOUTS)
    check_settings("orthogonalize", steps, coeffs, eps, dtype, method, gram_restarts)
    ns = _NS(steps, tuple(coeffs), eps, dtype, method, tuple(gram_restarts))
    out: list[Any] = [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    meshes: dict[tuple, tuple[Any, int]] = {}
    for i, (x, name) in enumerate(zip(leaves, names)):
        if x.dim() < 2:
            raise ValueError(f"Muon leaf {name!r} has shape {tuple(x.shape)}; Muon needs matrices (>= 2-D). Label it for AdamW instead.")
        d = _shard_dim(x, name)
        if d is None:
            loc = x._local_tensor if isinstance(x, DTensor) else x
            out[i] = like(x, ns(loc))
            continue
        key = (id(x.device_mesh), d, ns.send_dtype(x))
        groups.setdefault(key, []).append(i)
        meshes[key] = (x.device_mesh, d)
    for key, idx in groups.items():  # insertion order: the same on every rank
        mesh, d = meshes[key]
        run = _gather if layout == "gather" else _owner
        results = run([leaves[i] for i in idx], mesh, d, ns, key[2])
        for i, r in zip(idx, results):
            out[i] = like(leaves[i], r)
    return out


# ---------------------------------------------------------------------------------------------
# "gather": every rank orthogonalises every matrix
# ---------------------------------------------------------------------------------------------


def _gather(xs: list[DTensor], mesh, dim: int, ns: _NS, send: torch.dtype) -> list[torch.Tensor]:
    world, rank, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    chunks = []
    for x in xs:
        rows = x.shape[0]
        c = chunk_size(rows, world)
        row_numel = math.prod(x.shape[1:])
        chunks.append((rows, c, row_numel))
    total = sum(c * rn for _, c, rn in chunks)
    device = xs[0]._local_tensor.device  # every buffer on the device of the tensors it serves
    buf = torch.zeros(total, dtype=send, device=device)
    off = 0
    for x, (rows, c, rn) in zip(xs, chunks):
        loc = x._local_tensor.reshape(-1)
        buf[off : off + loc.numel()].copy_(loc)
        off += c * rn
    gathered = torch.empty(world * total, dtype=send, device=device)
    if total:
        C.all_gather(gathered, buf, group, tag="muon_gather")
    stacked = gathered.view(world, total)
    results, off = [], 0
    for x, (rows, c, rn) in zip(xs, chunks):
        full = stacked[:, off : off + c * rn].reshape(world * c, *x.shape[1:])[:rows]
        off += c * rn
        start, stop = chunk_bounds(rows, world, rank)
        results.append(ns(full)[start:stop].clone())
    return results


# ---------------------------------------------------------------------------------------------
# "owner": each matrix orthogonalised once, by its owner
# ---------------------------------------------------------------------------------------------


def owner_plan(
    shapes: list[tuple[int, ...]], world: int, steps: int = 5, flops: Callable[[tuple[int, ...]], int] | None = None
) -> tuple[list[int | None], list[int]]:
    """Owners of the 2-D leaves (``None`` for batched leaves, which stay local) and the
    Newton–Schulz FLOPs each rank then runs (``flops(shape)``; standard Newton–Schulz with
    ``steps`` iterations by default)."""
    if flops is None:
        flops = lambda shape: newton_schulz_flops(shape, steps)  # noqa: E731
    loads = [0] * world
    for shape in shapes:
        if len(shape) > 2:
            for q in range(world):
                start, stop = chunk_bounds(shape[0], world, q)
                loads[q] += flops((stop - start, *shape[1:]))
    mats = [i for i, s in enumerate(shapes) if len(s) == 2]
    owners2 = assign_owners([flops(shapes[i]) for i in mats], world, loads)
    owners: list[int | None] = [None] * len(shapes)
    for i, o in zip(mats, owners2):
        owners[i] = o
        loads[o] += flops(shapes[i])
    return owners, loads


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def _owner(xs: list[DTensor], mesh, dim: int, ns: _NS, send: torch.dtype) -> list[torch.Tensor]:
    world, rank, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    shapes = [tuple(x.shape) for x in xs]
    owners, _ = owner_plan(shapes, world, flops=ns.flops)
    results: list[Any] = [None] * len(xs)
    owned_by: list[list[int]] = [[] for _ in range(world)]
    for i, o in enumerate(owners):
        if o is None:
            results[i] = ns(xs[i]._local_tensor)
        else:
            owned_by[o].append(i)
    if not any(owned_by):
        return results

    def numel(i: int, src: int) -> int:
        start, stop = chunk_bounds(shapes[i][0], world, src)
        return (stop - start) * shapes[i][1]

    # Out: my rows of every matrix, grouped by owner.
    send_splits = [sum(numel(i, rank) for i in owned_by[s]) for s in range(world)]
    recv_splits = [sum(numel(i, src) for i in owned_by[rank]) for src in range(world)]
    device = xs[0]._local_tensor.device  # every buffer on the device of the tensors it serves
    inp = _cat([xs[i]._local_tensor.reshape(-1).to(send) for s in range(world) for i in owned_by[s]], send, device)
    got = torch.empty(sum(recv_splits), dtype=send, device=device)
    C.all_to_all(got, inp, group, output_splits=recv_splits, input_splits=send_splits, tag="muon_owner")

    # Owner: assemble full matrices, orthogonalise same shapes together.
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in owned_by[rank]}
    off = 0
    for src in range(world):
        for i in owned_by[rank]:
            n = numel(i, src)
            pieces[i].append(got[off : off + n])
            off += n
    full = {i: torch.cat(pieces[i]).view(shapes[i]) for i in owned_by[rank]}
    by_shape: dict[tuple, list[int]] = {}
    for i in owned_by[rank]:
        by_shape.setdefault(shapes[i], []).append(i)
    ortho: dict[int, torch.Tensor] = {}
    for same in by_shape.values():
        if len(same) == 1:
            ortho[same[0]] = ns(full[same[0]])
        else:
            for i, o in zip(same, ns(torch.stack([full[i] for i in same])).unbind(0)):
                ortho[i] = o

    # Back: the transpose of the first all-to-all.
    back = [ortho[i][slice(*chunk_bounds(shapes[i][0], world, src))].reshape(-1) for src in range(world) for i in owned_by[rank]]
    back_in = _cat(back, ns.dtype or send, device)
    back_out = torch.empty(sum(send_splits), dtype=back_in.dtype, device=device)
    C.all_to_all(back_out, back_in, group, output_splits=send_splits, input_splits=recv_splits, tag="muon_owner")
    off = 0
    for s in range(world):
        for i in owned_by[s]:
            start, stop = chunk_bounds(shapes[i][0], world, rank)
            n = (stop - start) * shapes[i][1]
            results[i] = back_out[off : off + n].view(stop - start, shapes[i][1])
            off += n
    return results
