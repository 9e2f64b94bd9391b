"""DCP without DCP's collectives: each rank writes and reads its shards alone.

[Note: collective-free DCP]
``torch.distributed.checkpoint`` coordinates a save with its own object collectives (it gathers
every rank's plan, scatters the global plan, gathers the write results), which the
:mod:`fsdpfn.comm` counter, timeout and flight recorder never see. So every rank runs DCP with
``no_dist=True`` into its own subdirectory ``rank_<r>/`` and we do the coordination:

* Save: a rank writes only the shards it owns (:func:`owned`): a DTensor's local shard if the
  rank sits at coordinate 0 of every mesh dim the tensor is replicated over, a plain tensor on
  rank 0 only, so replicas are written once, as DCP's own de-duplication would. Its local
  ``Metadata`` (global shapes, the chunk each shard covers, where its bytes are) goes to rank 0
  through one :func:`fsdpfn.comm.all_gather_object`, and rank 0 writes one :func:`merge`\\ d
  ``.metadata`` at the checkpoint root whose storage entries point into ``rank_<r>/``.
* Load: each rank reads that ``.metadata`` and runs DCP's planner for its own targets with
  ``no_dist=True``: a DTensor target reads exactly the saved chunks that overlap its local shard,
  whatever plan or world size wrote them. No collective at all.

The result is an ordinary DCP checkpoint: ``FileSystemReader(ckpt)`` reads it without fsdpfn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from fsdpfn import comm
from fsdpfn.checkpoint._manifest import METADATA, CheckpointError

__all__ = ["files_read", "merge", "owned", "read", "write"]


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns whenever it runs without a process group, even when asked to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _unwrapped(e: CheckpointException) -> BaseException:
    """DCP wraps a failure in a ``CheckpointException``, a ``BaseException`` that ``except
    Exception`` does not catch; the original (a full disk's ``OSError``) is more useful."""
    for failure in getattr(e, "failures", {}).values():
        return failure[0] if isinstance(failure, tuple) else failure
    return RuntimeError(str(e))


def rank_dir(rank: int) -> str:
    return f"rank_{rank}"


def _splits(p) -> bool:
    """Whether ranks along a mesh dim placed ``p`` hold different pieces of the tensor. A
    ``_StridedShard`` (the data-parallel rows of a tensor-parallel weight) is a shard, though its
    ``is_shard()`` says no: taken for a replica, only data-parallel rank 0 would write its rows."""
    return p.is_shard() or isinstance(p, _StridedShard)


# [Note: fused shards in checkpoints]
# A colwise_fused:k weight is placed _StridedShard(0, split_factor=k) alone on the tp axis: rank r
# holds the r-th slice of each of k parts, k boxes of the tensor, where DCP's chunk metadata has
# one box per shard (it would write the k slices as if they were one block: a silently permuted
# checkpoint). Such a leaf is saved whole (gathered over tp, written once) and loaded whole, then
# cut into its fused slices on each rank: checkpoints stay keyed by path and plan-independent.


def fused_split(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(mesh dim, tensor dim, parts)`` of a DTensor whose only split of a tensor dim is a
    ``_StridedShard`` (a fused colwise weight), else ``None``."""
    if not isinstance(x, DTensor):
        return None
    for i, p in enumerate(x.placements):
        if isinstance(p, _StridedShard) and x.device_mesh.size(i) > 1:
            cutting = [
                j
                for j, q in enumerate(x.placements)
                if (q.is_shard() or isinstance(q, _StridedShard)) and q.dim == p.dim  # type: ignore[attr-defined]  # a Shard: .dim
            ]
            if cutting == [i]:
                return i, p.dim, int(p.split_factor)
    return None


def whole(x: DTensor, full: torch.Tensor | None = None) -> DTensor:
    """``x`` as a DTensor replicated on its mesh, holding ``full`` (default: ``x``'s full tensor,
    gathered: collective)."""
    full = comm.full_tensor(x) if full is None else full
    return DTensor.from_local(
        full, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False, shape=x.shape, stride=x.stride()
    )


def fused_part(whole_x: DTensor, like: DTensor) -> DTensor:
    """The fused slices of the replicated ``whole_x`` this rank holds in ``like``'s placements."""
    split = fused_split(like)
    coordinate = like.device_mesh.get_coordinate()
    assert split is not None and coordinate is not None, "fused_part: a fused DTensor on a mesh holding this rank"
    i, d, parts = split
    w, r = like.device_mesh.size(i), coordinate[i]
    full = whole_x.to_local().movedim(d, 0)
    n = full.shape[0] // (parts * w)
    local = full.reshape(parts, w, n, *full.shape[1:])[:, r].reshape(parts * n, *full.shape[1:]).movedim(0, d)
    return DTensor.from_local(
        local.contiguous(), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def owned(path: str, x: torch.Tensor, rank: int) -> bool:
    """Whether this rank writes ``x`` (see [Note: collective-free DCP]).

    Which rows and columns a DTensor's local shard covers is DCP's to say
    (``compute_local_shape_and_global_offset`` reads the placements, ``_StridedShard`` and
    ``Shard(1)`` included); here only who writes is decided."""
    if not isinstance(x, DTensor):
        return rank == 0
    coord = x.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return False
    for i, p in enumerate(x.placements):
        if p.is_partial():
            raise ValueError(
                f"state leaf {path!r} is a DTensor with a Partial placement {x.placements}: its local values are "
                "summands, not the tensor. Reduce it first (x.redistribute(placements=[Replicate()]) or "
                "fsdpfn.comm.full_tensor(x))."
            )
        if not p.is_replicate() and not _splits(p):
            raise ValueError(
                f"state leaf {path!r} is a DTensor placed {x.placements}: placement {p} is neither a "
                "shard nor a replica, and checkpoints write only those. Redistribute it first."
            )
        if not _splits(p) and coord[i] != 0:
            return False
    return True


def write(tensors: dict[str, torch.Tensor], directory: str, *, in_thread: bool = False) -> Metadata | None:
    """Writes ``tensors`` with DCP alone into ``directory``; returns their local metadata (whose
    storage entries name files relative to ``directory``), or ``None`` if there is nothing.

    ``in_thread``: called off the main thread (a background checkpoint). ``dcp.save`` warns on
    every call without a process group, and a warnings filter cannot be scoped to one thread
    (``catch_warnings`` swaps the process-wide filters, under ``-W error`` the warning is an
    exception), so there DCP's saving function is called directly, as ``dcp.save`` does after
    its warning."""
    if not tensors:
        return None
    writer = dcp.FileSystemWriter(directory)
    try:
        if in_thread:
            meta = _save_state_dict(state_dict=tensors, storage_writer=writer, no_dist=True)
        else:
            with _quiet_no_dist():
                meta = dcp.save(tensors, storage_writer=writer, no_dist=True)
    except CheckpointException as e:
        raise _unwrapped(e) from None
    # Superseded by the merged root .metadata; every file left is listed in the manifest.
    os.remove(os.path.join(directory, METADATA))
    return meta


def _relocated(info, prefix: str):
    return dataclasses.replace(info, relative_path=f"{prefix}/{info.relative_path}")


def merge(metas: list[Metadata | None], save_id: str) -> Metadata:
    """One global ``Metadata`` from every rank's local one (``metas[r]`` written under
    ``rank_<r>/``): each tensor's chunks united, a chunk saved by several ranks kept once (the
    lowest rank's), byte entries kept once.

    Raises:
      ValueError: ranks saved a path with different shapes or dtypes, or the chunks do not tile
        the tensor exactly (names the path).
    """
    entries: dict = {}
    storage: dict = {}
    planner_data: dict = {}
    first: dict[str, int] = {}
    version = None
    for r, md in enumerate(metas):
        if md is None:
            continue
        version = version or md.version
        planner_data.update(md.planner_data or {})
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                if fqn not in entries:
                    entries[fqn], first[fqn] = item, r
                    storage[MetadataIndex(fqn)] = _relocated(md.storage_data[MetadataIndex(fqn)], rank_dir(r))
                continue
            mine = entries.get(fqn)
            if mine is None:
                mine = entries[fqn] = TensorStorageMetadata(item.properties, item.size, [])
                first[fqn] = r
            elif not isinstance(mine, TensorStorageMetadata) or _layout(mine) != _layout(item):
                raise ValueError(
                    f"ranks saved {fqn!r} differently: rank {first[fqn]} as {_describe(mine)}, rank {r} as "
                    f"{_describe(item)}. Every rank must save the same state structure."
                )
            have = {(tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks}
            for chunk in item.chunks:
                if (tuple(chunk.offsets), tuple(chunk.sizes)) in have:
                    continue  # a replica another rank already wrote
                mine.chunks.append(chunk)
                index = MetadataIndex(fqn, chunk.offsets)
                storage[index] = _relocated(md.storage_data[index], rank_dir(r))
    for fqn, item in entries.items():
        if isinstance(item, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in item.chunks)
            if covered != math.prod(item.size):
                raise ValueError(
                    f"the saved chunks of {fqn!r} cover {covered} of its {math.prod(item.size)} elements "
                    f"(shape {tuple(item.size)}): ranks disagree on how it is sharded."
                )
    return Metadata(
        entries,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(save_id=save_id),
        version=version,
    )


def _layout(item: TensorStorageMetadata) -> tuple:
    return tuple(item.size), item.properties.dtype


def _describe(item) -> str:
    if isinstance(item, TensorStorageMetadata):
        return f"{str(item.properties.dtype).removeprefix('torch.')} {tuple(item.size)}"
    return "bytes"


def files_read(metadata: Metadata, targets: dict[str, torch.Tensor]) -> set[str]:
    """The files (relative to the checkpoint) that loading ``targets`` reads on this rank: DCP's
    own local read plan, without reading anything."""
    if not targets:
        return set()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dict(targets), metadata, True)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, remembering which file it is in, so that an error can name it."""

    current: str | None = None

    def _slice_file(self, file, sinfo):
        self.current = sinfo.relative_path
        return super()._slice_file(file, sinfo)


def read(targets: dict[str, torch.Tensor], ckpt: str) -> None:
    """Fills ``targets`` (tensors and DTensors, in place) from the checkpoint ``ckpt``, DCP alone.

    Raises:
      CheckpointError: DCP failed; the message names the file it was reading.
    """
    if not targets:
        return
    reader = _Reader(ckpt)
    try:
        try:
            with _quiet_no_dist():
                dcp.load(targets, storage_reader=reader, no_dist=True)
        except CheckpointException as e:
            raise _unwrapped(e) from None
    except Exception as e:
        where = f"{os.path.join(ckpt, reader.current)!r}" if reader.current else f"checkpoint {ckpt!r}"
        raise CheckpointError(
            f"reading {where} failed: {type(e).__name__}: {str(e).strip()[:500]}", ckpt, reader.current
        ) from e
