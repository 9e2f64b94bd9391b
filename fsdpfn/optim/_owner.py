"""The ``"owner"`` layout: every block has one owner rank; rows travel there in buckets, and the
communication of one bucket runs under the Newton–Schulz of another.

[Note: the pipelined owner layout]
The unit of work is a block (``fsdpfn/optim/_blocks.py``, [Note: blocks]; a whole matrix is one
block). :func:`owner_schedule` gives every block of the group's 2-D leaves an owner, greedily,
largest Newton–Schulz FLOPs first to the least loaded rank (leaves of 3 or more dimensions stay
with the rank holding them and count towards its load first), then cuts every owner's blocks
into ``B`` buckets of about equal FLOPs, so that each bucket keeps every rank about equally
busy. Bucket ``k`` is a set of blocks; its rows go to their owners in one all-to-all ("out
k") and come back orthogonalised in another ("back k"). The ranks run::

    launch out 0; orthogonalise the local (3-D) leaves
    for k in 0 .. B-1:
        wait out k; launch out k+1
        Newton–Schulz of bucket k        # in flight: out k+1 and back k-1
        launch back k; wait back k-1, write its rows

so while bucket ``k`` computes, bucket ``k+1``'s rows are on their way in and bucket
``k-1``'s results on their way back. Only out 0 and back ``B-1`` are exposed: about ``1/B`` of
the communication, against all of it with one bucket. Every rank derives the same schedule from
the shapes alone and launches the same collectives in the same order, so no rank waits on a
collective another rank has not started. The bytes are the same whatever ``B`` (each row still
travels once each way); ``B`` buckets cost ``2 B`` all-to-all calls, and at most two buckets'
buffers are live at once instead of all of them.

Results are bitwise those of one bucket: each block is assembled from the same rows and
orthogonalised by the same batched Newton–Schulz; only the other matrices in its batch differ,
and batched Newton–Schulz gives each matrix the same bits whatever else is in the batch
(``tests/test_optim.py`` checks that, fp32 and bf16, standard and Gram).

``buckets=None`` picks ``B`` from the bytes each rank sends: one bucket per
``AUTO_BUCKET_BYTES``, at most ``AUTO_MAX_BUCKETS`` and at most the blocks of the busiest owner;
small models therefore keep one bucket and two all-to-all calls.

On CPU the collectives are async gloo work; on CUDA, NCCL work runs on its own stream and the
waits order the compute stream after it (``async_op=True`` semantics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from fsdpfn import comm as C
from fsdpfn._rows import chunk_bounds
from fsdpfn.optim._blocks import WHOLE, BlockSpec, merge_blocks, split_blocks

__all__ = [
    "AUTO_BUCKET_BYTES",
    "AUTO_MAX_BUCKETS",
    "Block",
    "BucketRecord",
    "OwnerSchedule",
    "PipelineRecord",
    "assign_owners",
    "owner_schedule",
    "record_pipeline",
    "run_owner",
]

AUTO_BUCKET_BYTES = 4 * 2**20
AUTO_MAX_BUCKETS = 4


def assign_owners(flops: list[int], world: int, base_load: list[int] | None = None) -> list[int]:
    """Owner rank of each item: largest first, to the least loaded rank (lowest on ties).

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


class Block(NamedTuple):
    """One unit of Newton–Schulz work: rows ``rows`` and columns ``cols`` (global, half-open) of
    leaf ``leaf``'s matrix, costing ``flops``."""

    leaf: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    flops: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


class OwnerSchedule(NamedTuple):
    """Who orthogonalises what, and in which bucket (see [Note: the pipelined owner layout]).

    Attributes:
      world: ranks in the shard group.
      blocks: the 2-D leaves' blocks, leaf by leaf, row-major within a leaf.
      owners: the owner rank of each block.
      buckets: the blocks of each bucket, in the order they are sent.
      loads: Newton–Schulz FLOPs each rank runs, its local (3-D) leaves included.
      local: the leaves orthogonalised where they are (3 or more dimensions).
    """

    world: int
    blocks: tuple[Block, ...]
    owners: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    local: tuple[int, ...]


def _auto_buckets(blocks: Sequence[Block], owners: Sequence[int], world: int, itemsize: int) -> int:
    sent = sum(b.shape[0] * b.shape[1] for b in blocks) * itemsize / world
    busiest = max((owners.count(r) for r in range(world)), default=0)
    return max(1, min(AUTO_MAX_BUCKETS, busiest, int(sent // AUTO_BUCKET_BYTES)))


def owner_schedule(
    shapes: Sequence[tuple[int, ...]],
    world: int,
    flops: Callable[[tuple[int, ...]], int],
    *,
    specs: Sequence[BlockSpec] | None = None,
    buckets: int | None = None,
    itemsize: int = 2,
) -> OwnerSchedule:
    """The owner layout's schedule for leaves of global ``shapes`` sharded over ``world`` ranks.

    Pure and deterministic: every rank computes the same one from the shapes alone.

    Args:
      shapes: global shapes (2-D: matrices to distribute; more dimensions: batches of matrices
        sharded along the first, orthogonalised where they are).
      world: ranks.
      flops: Newton–Schulz FLOPs of a ``(rows, cols)`` or ``(batch, rows, cols)`` shape.
      specs: block spec ``(m, n)`` per leaf (default: whole matrices).
      buckets: number of buckets, or ``None`` for the automatic choice (see the Note).
      itemsize: bytes per element sent (for the automatic choice).

    Example:
      >>> s = owner_schedule([(8, 4), (4, 4), (4, 4)], 2, lambda shape: shape[-2] * shape[-1], specs=[(2, 1), (1, 1), (1, 1)], buckets=2)
      >>> [(b.leaf, b.rows) for b in s.blocks]
      [(0, (0, 4)), (0, (4, 8)), (1, (0, 4)), (2, (0, 4))]
      >>> s.owners, s.buckets, s.loads
      ((0, 1, 0, 1), ((0, 1), (2, 3)), (32, 32))
    """
    specs = list(specs) if specs is not None else [WHOLE] * len(shapes)
    loads = [0] * world
    local = tuple(i for i, s in enumerate(shapes) if len(s) > 2)
    for i in local:
        m, n = specs[i]
        *_, rows, cols = shapes[i]
        for q in range(world):
            start, stop = chunk_bounds(shapes[i][0], world, q)
            loads[q] += flops(((stop - start) * m * n, rows // m, cols // n))
    blocks = []
    for i, shape in enumerate(shapes):
        if len(shape) != 2:
            continue
        (m, n), (rows, cols) = specs[i], shape
        br, bc = rows // m, cols // n
        for a in range(m):
            for b in range(n):
                blocks.append(Block(i, (a * br, (a + 1) * br), (b * bc, (b + 1) * bc), flops((br, bc))))
    owners = assign_owners([b.flops for b in blocks], world, loads)
    count = _auto_buckets(blocks, owners, world, itemsize) if buckets is None else buckets
    bucket_of = [0] * len(blocks)
    for r in range(world):
        mine = sorted((j for j, o in enumerate(owners) if o == r), key=lambda j: (-blocks[j].flops, j))
        total = sum(blocks[j].flops for j in mine)
        done = 0
        for j in mine:
            # The bucket holding this block's FLOP midpoint: every owner's work cut in equal parts.
            bucket_of[j] = min(count - 1, int((done + blocks[j].flops / 2) * count / total)) if total else 0
            done += blocks[j].flops
    for j, o in enumerate(owners):
        loads[o] += blocks[j].flops
    grouped = tuple(tuple(j for j in range(len(blocks)) if bucket_of[j] == k) for k in range(count))
    return OwnerSchedule(world, tuple(blocks), tuple(owners), tuple(g for g in grouped if g), tuple(loads), local)


# ---------------------------------------------------------------------------------------------
# What was in flight while each bucket computed: counted, not only timed
# ---------------------------------------------------------------------------------------------


class BucketRecord(NamedTuple):
    """One bucket's Newton–Schulz on this rank (see :func:`record_pipeline`).

    Attributes:
      bucket: ``"local"`` (the leaves orthogonalised where they are) or ``"k/B"``.
      blocks: blocks this rank orthogonalised in it.
      flops: their Newton–Schulz FLOPs.
      in_flight: the collectives launched and not yet waited for while it computed, e.g.
        ``("out 2/4", "back 0/4")``.
      wait_s: seconds this rank was blocked waiting for the bucket's rows before computing.
      compute_s: seconds of its assembly and Newton–Schulz.
    """

    bucket: str
    blocks: int
    flops: int
    in_flight: tuple[str, ...]
    wait_s: float
    compute_s: float


@dataclasses.dataclass
class PipelineRecord:
    """What the owner layout did inside a :func:`record_pipeline` block, on this rank."""

    buckets: list[BucketRecord] = dataclasses.field(default_factory=list)
    back_wait_s: float = 0.0

    def overlapped(self) -> int:
        """Buckets that computed with at least one collective in flight."""
        return sum(1 for b in self.buckets if b.in_flight)


_local = threading.local()


def _records() -> list[PipelineRecord]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def record_pipeline() -> Iterator[PipelineRecord]:
    """Records, per bucket of the owner layout run in this thread inside the block, what was in
    flight while it computed and how long this rank waited: the overlap, counted.

    Example:
      >>> opt = fsdpfn.optim.scale_by_muon(layout="owner", buckets=2)
      >>> g = {"a": torch.randn(8, 8), "b": torch.randn(8, 8)}
      >>> with fsdpfn.optim.record_pipeline() as rec:
      ...     _ = opt.update(g, opt.init(g))
      >>> rec.buckets   # plain tensors: nothing is distributed, nothing recorded
      []
    """
    rec = PipelineRecord()
    _records().append(rec)
    try:
        yield rec
    finally:
        _records().remove(rec)


def _note(bucket: BucketRecord) -> None:
    for rec in _records():
        rec.buckets.append(bucket)


def _note_back(seconds: float) -> None:
    for rec in _records():
        rec.back_wait_s += seconds


# ---------------------------------------------------------------------------------------------
# Running a schedule
# ---------------------------------------------------------------------------------------------


def local_blocks_ns(x: torch.Tensor, spec: BlockSpec, ns: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Newton–Schulz of every matrix of ``x`` held here, block by block (whole: ``ns(x)``)."""
    if spec == WHOLE:
        return ns(x)
    return merge_blocks(ns(split_blocks(x, spec)), spec, tuple(x.shape))


class _Bucket:
    """One bucket as this rank sees it: which rows it sends where and receives from whom, and
    how they are packed into the flat all-to-all buffers (by destination, then block)."""

    def __init__(self, sched: OwnerSchedule, k: int, shapes, rank: int, dtype: torch.dtype, device: torch.device):
        self.world, self.rank, self.dtype, self.device = sched.world, rank, dtype, device
        blocks = [(j, sched.blocks[j]) for j in sched.buckets[k]]
        self.to = [[b for j, b in blocks if sched.owners[j] == dst] for dst in range(sched.world)]
        self.mine = self.to[rank]
        self.bounds = {b.leaf: [chunk_bounds(shapes[b.leaf][0], sched.world, q) for q in range(sched.world)] for _, b in blocks}
        self.label = f"{k}/{len(sched.buckets)}"

    def rows(self, b: Block, src: int) -> tuple[int, int]:
        """Global rows of block ``b`` that rank ``src`` holds (possibly none)."""
        start, stop = self.bounds[b.leaf][src]
        lo = max(start, b.rows[0])
        return lo, max(lo, min(stop, b.rows[1]))

    def numel(self, b: Block, src: int) -> int:
        lo, hi = self.rows(b, src)
        return (hi - lo) * b.shape[1]

    def splits_to(self) -> list[int]:
        """Elements this rank sends each owner on the way out (receives on the way back)."""
        return [sum(self.numel(b, self.rank) for b in self.to[dst]) for dst in range(self.world)]

    def splits_from(self) -> list[int]:
        """Elements this rank receives from each rank on the way out (sends on the way back)."""
        return [sum(self.numel(b, src) for b in self.mine) for src in range(self.world)]

    def _mine(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of block ``b`` in ``x``, this rank's rows of ``b``'s leaf."""
        lo, hi = self.rows(b, self.rank)
        start = self.bounds[b.leaf][self.rank][0]
        return x[lo - start : hi - start, b.cols[0] : b.cols[1]]

    def pack_out(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """My rows of every block, grouped by owner, cast to the send dtype while copied."""
        buf = torch.empty(sum(self.splits_to()), dtype=self.dtype, device=self.device)
        off = 0
        for dst in range(self.world):
            for b in self.to[dst]:
                piece = self._mine(b, locals_[b.leaf])
                buf[off : off + piece.numel()].view(piece.shape).copy_(piece)
                off += piece.numel()
        return buf

    def assemble(self, got: torch.Tensor) -> tuple[dict[tuple[int, int], torch.Tensor], dict[Block, tuple[tuple[int, int], int]]]:
        """The blocks I own, from every rank's rows, stacked by shape: ``(stacks, slot)``."""
        by_shape: dict[tuple[int, int], list[Block]] = {}
        for b in self.mine:
            by_shape.setdefault(b.shape, []).append(b)
        stacks = {s: torch.empty((len(bs), *s), dtype=self.dtype, device=self.device) for s, bs in by_shape.items()}
        slot = {b: (s, j) for s, bs in by_shape.items() for j, b in enumerate(bs)}
        off = 0
        for src in range(self.world):
            for b in self.mine:
                lo, hi = self.rows(b, src)
                n = (hi - lo) * b.shape[1]
                s, j = slot[b]
                stacks[s][j, lo - b.rows[0] : hi - b.rows[0]].copy_(got[off : off + n].view(hi - lo, b.shape[1]))
                off += n
        return stacks, slot

    def pack_back(self, ortho: dict[tuple[int, int], torch.Tensor], slot) -> torch.Tensor:
        """Every rank's rows of the blocks I orthogonalised: the first trip, transposed."""
        buf = torch.empty(sum(self.splits_from()), dtype=self.dtype, device=self.device)
        off = 0
        for src in range(self.world):
            for b in self.mine:
                lo, hi = self.rows(b, src)
                n = (hi - lo) * b.shape[1]
                s, j = slot[b]
                buf[off : off + n].view(hi - lo, b.shape[1]).copy_(ortho[s][j, lo - b.rows[0] : hi - b.rows[0]])
                off += n
        return buf

    def unpack_back(self, got: torch.Tensor, results: list[torch.Tensor]) -> None:
        off = 0
        for dst in range(self.world):
            for b in self.to[dst]:
                out = self._mine(b, results[b.leaf])
                out.copy_(got[off : off + out.numel()].view(out.shape))
                off += out.numel()


def run_owner(
    locals_: list[torch.Tensor],
    shapes: list[tuple[int, ...]],
    specs: list[BlockSpec],
    group,
    world: int,
    rank: int,
    ns: Callable[[torch.Tensor], torch.Tensor],
    flops: Callable[[tuple[int, ...]], int],
    send: torch.dtype,
    buckets: int | None,
) -> list[torch.Tensor]:
    """Newton–Schulz of every leaf's blocks in the pipelined owner layout (see [Note: the
    pipelined owner layout]); returns this rank's rows of each result in ``send`` (the compute
    dtype), given this rank's rows ``locals_`` of every leaf."""
    sched = owner_schedule(shapes, world, flops, specs=specs, buckets=buckets, itemsize=send.itemsize)
    device = locals_[0].device  # every buffer on the device of the tensors it serves
    results: list[Any] = [torch.empty(x.shape, dtype=send, device=device) if len(s) == 2 else None for x, s in zip(locals_, shapes)]
    plans = [_Bucket(sched, k, shapes, rank, send, device) for k in range(len(sched.buckets))]

    def trip(p: _Bucket, buf: torch.Tensor, way: str):
        # The buffer stays referenced with the pending work until it is waited for.
        out_splits, in_splits = (p.splits_from(), p.splits_to()) if way == "out" else (p.splits_to(), p.splits_from())
        got = torch.empty(sum(out_splits), dtype=send, device=device)
        return C.all_to_all(got, buf, group, output_splits=out_splits, input_splits=in_splits, async_op=True, tag="muon_owner"), buf

    def finish_back(p: _Bucket, launched) -> None:
        t0 = time.perf_counter()
        got = launched[0].wait()
        _note_back(time.perf_counter() - t0)
        p.unpack_back(got, results)

    out = trip(plans[0], plans[0].pack_out(locals_), "out") if plans else None
    t0 = time.perf_counter()
    for i in sched.local:  # under the first bucket's rows travelling
        results[i] = local_blocks_ns(locals_[i], specs[i], ns)
    if sched.local:
        owned = sum(b.flops for p in plans for b in p.mine)
        _note(BucketRecord("local", 0, sched.loads[rank] - owned, (f"out {plans[0].label}",) if plans else (), 0.0, time.perf_counter() - t0))
    back: dict[int, Any] = {}
    for k, p in enumerate(plans):
        t0 = time.perf_counter()
        got = out[0].wait()
        waited = time.perf_counter() - t0
        nxt = plans[k + 1] if k + 1 < len(plans) else None
        out = trip(nxt, nxt.pack_out(locals_), "out") if nxt else None
        flying = ((f"out {nxt.label}",) if nxt else ()) + tuple(f"back {plans[j].label}" for j in back)
        t0 = time.perf_counter()
        stacks, slot = p.assemble(got)
        ortho = {s: ns(stack) for s, stack in stacks.items()}  # same shapes: one batched call
        _note(BucketRecord(p.label, len(p.mine), sum(b.flops for b in p.mine), flying, waited, time.perf_counter() - t0))
        back[k] = trip(p, p.pack_back(ortho, slot), "back")
        if k - 1 in back:
            finish_back(plans[k - 1], back.pop(k - 1))
    for k in list(back):
        finish_back(plans[k], back.pop(k))
    return results
