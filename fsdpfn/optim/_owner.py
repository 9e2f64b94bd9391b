"""The ``"owner"`` layout: every block has one owner rank; rows travel there in buckets, and the
communication of one bucket runs under the Newton–Schulz of another.

[Note: the pipelined owner layout]
The unit of work is a block (``fsdpfn/optim/_blocks.py``, [Note: blocks]; a whole matrix is one
block; a batch of matrices ``[E, m, n]`` is ``E`` of them). Each rank holds a box of every leaf
(rows over data parallel, rows or columns over tensor parallel: ``fsdpfn/optim/_layout.py``,
[Note: holdings]). :func:`owner_schedule` keeps a block where it lies when one rank holds it
whole and no other rank holds any of it (an expert of a batch split over experts, a head inside
a tensor-parallel slice), counting it towards that rank's load first; gives every other block an
owner, greedily, largest Newton–Schulz FLOPs first to the least loaded of the ranks holding it
(whole, else in part); then cuts every owner's travelling blocks into ``B`` buckets of about
equal FLOPs, so that each bucket keeps every rank about equally busy. Bucket ``k`` is a set of
blocks; their pieces go to their owners in one all-to-all ("out k") and come back orthogonalised
to every rank holding a part in another ("back k"). The ranks run::

    launch out 0; orthogonalise the kept blocks
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
import math
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from fsdpfn import comm as C
from fsdpfn.optim._blocks import WHOLE, BlockSpec, merge_blocks, split_blocks
from fsdpfn.optim._layout import Box, whole_holdings

__all__ = [
    "AUTO_BUCKET_BYTES",
    "AUTO_MAX_BUCKETS",
    "Block",
    "BucketRecord",
    "OwnerSchedule",
    "PipelineRecord",
    "SplitTotals",
    "assign_owners",
    "bucket_splits",
    "bucket_totals",
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
    matrix ``mat`` of leaf ``leaf`` (seen as ``[B, R, C]``; 0 for a 2-D leaf), costing ``flops``."""

    leaf: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    flops: int
    mat: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])

    @property
    def box(self) -> Box:
        return Box((self.mat, self.mat + 1), self.rows, self.cols)


class OwnerSchedule(NamedTuple):
    """Who orthogonalises what, and in which bucket (see [Note: the pipelined owner layout]).

    Attributes:
      world: ranks in the work group.
      blocks: every leaf's blocks, leaf by leaf, matrix by matrix, row-major within a matrix.
      owners: the owner rank of each block.
      buckets: the travelling blocks of each bucket, in the order they are sent.
      loads: Newton–Schulz FLOPs each rank runs, kept blocks included.
      local: the leaves with 3 or more dimensions (batches of matrices).
      kept: the blocks orthogonalised where they lie: their owner holds them whole and no
        other rank holds any part of them (no communication).
      held: per leaf, the box each rank holds (``fsdpfn/optim/_layout.py``, [Note: holdings]).
      pieces: per block, ``((source rank, box), ...)``: who sends which part to its owner.
      returns: per block, ``((rank, box), ...)``: which part of the result goes back to whom.
    """

    world: int
    blocks: tuple[Block, ...]
    owners: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    local: tuple[int, ...]
    kept: tuple[int, ...] = ()
    held: tuple[tuple[Box, ...], ...] = ()
    pieces: tuple[tuple[tuple[int, Box], ...], ...] = ()
    returns: tuple[tuple[tuple[int, Box], ...], ...] = ()


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
    held: Sequence[Sequence[Box]] | None = None,
) -> OwnerSchedule:
    """The owner layout's schedule for leaves of global ``shapes`` spread over ``world`` ranks.

    Pure and deterministic: every rank computes the same one from the shapes and holdings alone.
    A block held whole by one rank and touched by no other is *kept*: orthogonalised there, no
    communication, counted towards that rank's load first. A block held whole by several ranks
    (replicas) is owned by the least loaded of them, so only its result travels. Every other
    block goes to an owner chosen greedily (largest first, to the least loaded of the ranks
    holding part of it), and every
    distinct piece of it is sent by one of the ranks holding it (the owner itself if it can,
    else one chosen by the block's number, spreading the sending over replicas).

    Args:
      shapes: global shapes (2-D: matrices; more dimensions: batches of matrices).
      world: ranks.
      flops: Newton–Schulz FLOPs of a ``(rows, cols)`` or ``(batch, rows, cols)`` shape.
      specs: block spec ``(m, n)`` per leaf (default: whole matrices).
      buckets: number of buckets, or ``None`` for the automatic choice (see the Note).
      itemsize: bytes per element sent (for the automatic choice).
      held: per leaf, the :class:`Box` each rank holds (default: rows split along dim 0 with
        ``torch.chunk`` semantics, the 1-D data-parallel layout).

    Example:
      >>> s = owner_schedule([(8, 4), (4, 4), (4, 4)], 2, lambda shape: shape[-2] * shape[-1], specs=[(2, 1), (1, 1), (1, 1)], buckets=2)
      >>> [(b.leaf, b.rows) for b in s.blocks]
      [(0, (0, 4)), (0, (4, 8)), (1, (0, 4)), (2, (0, 4))]
      >>> s.owners, s.kept, s.buckets, s.loads
      ((0, 1, 0, 1), (0, 1), ((2, 3),), (32, 32))
    """
    specs = list(specs) if specs is not None else [WHOLE] * len(shapes)
    held = tuple(tuple(h) for h in held) if held is not None else tuple(whole_holdings(s, world) for s in shapes)
    local = tuple(i for i, s in enumerate(shapes) if len(s) > 2)
    blocks = []
    for i, shape in enumerate(shapes):
        (m, n), rows, cols = specs[i], shape[-2], shape[-1]
        br, bc = rows // m, cols // n
        cost = flops((br, bc))
        for e in range(math.prod(shape[:-2])):
            for a in range(m):
                for b in range(n):
                    blocks.append(Block(i, (a * br, (a + 1) * br), (b * bc, (b + 1) * bc), cost, e))
    touch, holders = [], []
    for blk in blocks:
        box = blk.box
        parts = [(q, h.intersect(box)) for q, h in enumerate(held[blk.leaf])]
        parts = [(q, p) for q, p in parts if p.numel]
        touch.append(parts)
        holders.append([q for q, p in parts if p == box])
    loads = [0] * world
    owners: list[int] = [-1] * len(blocks)
    for j, hs in enumerate(holders):
        if len(hs) == 1:
            owners[j] = hs[0]
            loads[hs[0]] += blocks[j].flops
    for j in sorted((j for j in range(len(blocks)) if owners[j] < 0), key=lambda j: (-blocks[j].flops, j)):
        # Among the ranks holding it whole, else among those holding part of it (their own part
        # then stays put, and a block inside one tensor-parallel slice stays in its dp group).
        r = min(holders[j] or [q for q, _ in touch[j]], key=lambda q: (loads[q], q))
        owners[j] = r
        loads[r] += blocks[j].flops
    kept = tuple(j for j in range(len(blocks)) if [q for q, _ in touch[j]] == [owners[j]])
    pieces, returns = [], []
    for j in range(len(blocks)):
        by_box: dict[Box, list[int]] = {}
        for q, p in touch[j]:
            by_box.setdefault(p, []).append(q)
        pieces.append(tuple((owners[j] if owners[j] in qs else qs[j % len(qs)], p) for p, qs in by_box.items()))
        returns.append(tuple(touch[j]))
        assert sum(p.numel for _, p in pieces[-1]) == blocks[j].shape[0] * blocks[j].shape[1], (
            "holdings do not tile the leaf"
        )
    kept_set = set(kept)
    travel = [j for j in range(len(blocks)) if j not in kept_set]
    count = (
        _auto_buckets([blocks[j] for j in travel], [owners[j] for j in travel], world, itemsize)
        if buckets is None
        else buckets
    )
    bucket_of = {}
    for r in range(world):
        mine = sorted((j for j in travel if owners[j] == r), key=lambda j: (-blocks[j].flops, j))
        total = sum(blocks[j].flops for j in mine)
        done = 0
        for j in mine:
            # The bucket holding this block's FLOP midpoint: every owner's work cut in equal parts.
            bucket_of[j] = min(count - 1, int((done + blocks[j].flops / 2) * count / total)) if total else 0
            done += blocks[j].flops
    grouped = tuple(tuple(j for j in travel if bucket_of[j] == k) for k in range(count))
    return OwnerSchedule(
        world,
        tuple(blocks),
        tuple(owners),
        tuple(g for g in grouped if g),
        tuple(loads),
        local,
        kept,
        held,
        tuple(pieces),
        tuple(returns),
    )


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


# Process state: each thread's stack of active pipeline records (record_pipeline).
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


def _piece(h: Box, x: torch.Tensor, box: Box) -> torch.Tensor:
    """``box`` (global) of a leaf in ``x``, the piece ``h`` of it a rank holds, as ``[b, r, c]``."""
    v = x.view(-1, h.rows[1] - h.rows[0], h.cols[1] - h.cols[0]) if x.numel() else x.reshape(0, 0, 0)
    return v[
        box.mats[0] - h.mats[0] : box.mats[1] - h.mats[0],
        box.rows[0] - h.rows[0] : box.rows[1] - h.rows[0],
        box.cols[0] - h.cols[0] : box.cols[1] - h.cols[0],
    ]


class _Bucket:
    """One bucket as this rank sees it: which pieces it sends where and receives from whom, and
    how they are packed into the flat all-to-all buffers (by peer, then block, then piece)."""

    def __init__(self, sched: OwnerSchedule, k: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.world, self.rank, self.dtype, self.device, self.sched = sched.world, rank, dtype, device, sched
        w = sched.world
        self.send_out: list[list[tuple[int, Box]]] = [[] for _ in range(w)]
        self.recv_out: list[list[tuple[int, Box]]] = [[] for _ in range(w)]
        self.send_back: list[list[tuple[int, Box]]] = [[] for _ in range(w)]
        self.recv_back: list[list[tuple[int, Box]]] = [[] for _ in range(w)]
        idx = sched.buckets[k]
        for j in idx:
            o = sched.owners[j]
            for src, box in sched.pieces[j]:
                if src == rank:
                    self.send_out[o].append((j, box))
                if o == rank:
                    self.recv_out[src].append((j, box))
            for dst, box in sched.returns[j]:
                if o == rank:
                    self.send_back[dst].append((j, box))
                if dst == rank:
                    self.recv_back[o].append((j, box))
        self.idx = [j for j in idx if sched.owners[j] == rank]
        self.mine = [sched.blocks[j] for j in self.idx]
        self.label = f"{k}/{len(sched.buckets)}"

    @staticmethod
    def _splits(lists: list[list[tuple[int, Box]]]) -> list[int]:
        return [sum(box.numel for _, box in items) for items in lists]

    def splits(self, way: str) -> tuple[list[int], list[int]]:
        """``(input splits, output splits)`` of the ``"out"`` or ``"back"`` all-to-all."""
        if way == "out":
            return self._splits(self.send_out), self._splits(self.recv_out)
        return self._splits(self.send_back), self._splits(self.recv_back)

    def _view(self, leaf: int, x: torch.Tensor, box: Box) -> torch.Tensor:
        return _piece(self.sched.held[leaf][self.rank], x, box)

    def _in_block(self, stacks, slot, j: int, box: Box) -> torch.Tensor:
        b = self.sched.blocks[j]
        s, i = slot[j]
        return stacks[s][
            i, box.rows[0] - b.rows[0] : box.rows[1] - b.rows[0], box.cols[0] - b.cols[0] : box.cols[1] - b.cols[0]
        ]

    def pack_out(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """My pieces of every block, grouped by owner, cast to the send dtype while copied."""
        buf = torch.empty(sum(self._splits(self.send_out)), dtype=self.dtype, device=self.device)
        off = 0
        for items in self.send_out:
            for j, box in items:
                piece = self._view(self.sched.blocks[j].leaf, locals_[self.sched.blocks[j].leaf], box)
                buf[off : off + box.numel].view(piece.shape).copy_(piece)
                off += box.numel
        return buf

    def assemble(self, got: torch.Tensor):
        """The blocks I own, from every rank's pieces, stacked by shape: ``(stacks, slot)``."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for j in self.idx:
            by_shape.setdefault(self.sched.blocks[j].shape, []).append(j)
        stacks = {s: torch.empty((len(js), *s), dtype=self.dtype, device=self.device) for s, js in by_shape.items()}
        slot = {j: (s, i) for s, js in by_shape.items() for i, j in enumerate(js)}
        off = 0
        for items in self.recv_out:
            for j, box in items:
                dst = self._in_block(stacks, slot, j, box)
                dst.copy_(got[off : off + box.numel].view(dst.shape))
                off += box.numel
        return stacks, slot

    def pack_back(self, ortho, slot) -> torch.Tensor:
        """Every holder's part of the blocks I orthogonalised."""
        buf = torch.empty(sum(self._splits(self.send_back)), dtype=self.dtype, device=self.device)
        off = 0
        for items in self.send_back:
            for j, box in items:
                src = self._in_block(ortho, slot, j, box)
                buf[off : off + box.numel].view(src.shape).copy_(src)
                off += box.numel
        return buf

    def unpack_back(self, got: torch.Tensor, results: list[torch.Tensor]) -> None:
        off = 0
        for items in self.recv_back:
            for j, box in items:
                leaf = self.sched.blocks[j].leaf
                out = self._view(leaf, results[leaf], box)
                out.copy_(got[off : off + box.numel].view(out.shape))
                off += box.numel


def bucket_splits(
    sched: OwnerSchedule, rank: int
) -> tuple[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]], ...]:
    """Per bucket of ``sched``, the ``(input splits, output splits)`` (elements per peer) of
    rank ``rank``'s "out" and "back" all-to-alls: what :func:`run_owner` sends, read from the
    same packing, so that a cost model counts the bytes the optimizer moves.

    Example:
      >>> s = owner_schedule([(8, 4), (4, 4)], 2, lambda shape: shape[-2] * shape[-1], buckets=1)
      >>> bucket_splits(s, 0)   # rank 0 owns the 8 x 4 matrix: gets 16 of its elements from rank 1, sends rank 1 its 8 of the 4 x 4
      ((([16, 8], [16, 16]), ([16, 16], [16, 8])),)
    """
    out = []
    for k in range(len(sched.buckets)):
        b = _Bucket(sched, k, rank, torch.float32, torch.device("meta"))
        out.append((b.splits("out"), b.splits("back")))
    return tuple(out)


class SplitTotals(NamedTuple):
    """One all-to-all of one bucket, summed per rank (see :func:`bucket_totals`): tuples indexed
    by rank of elements sent (``sum`` of its input splits), received (``sum`` of its output
    splits), kept (its split to itself, sent and received alike) and the peers it sends a
    non-empty split to (itself included)."""

    sent: tuple[int, ...]
    received: tuple[int, ...]
    kept: tuple[int, ...]
    peers: tuple[int, ...]


def bucket_totals(sched: OwnerSchedule) -> tuple[tuple[SplitTotals, SplitTotals], ...]:
    """Per bucket of ``sched``, the ``("out", "back")`` all-to-alls' :class:`SplitTotals` for
    every rank at once: the sums of :func:`bucket_splits` of each rank, read from the same
    pieces and returns in one pass. ``bucket_splits`` walks every piece of a bucket for one
    rank, so all ranks' splits cost ``world`` times the pieces; a cost model of a 1,024-rank
    group wants the totals, in one walk.

    Example:
      >>> s = owner_schedule([(8, 4), (4, 4)], 2, lambda shape: shape[-2] * shape[-1], buckets=1)
      >>> out, back = bucket_totals(s)[0]
      >>> out.sent, out.received, out.kept, out.peers   # rank 0 sends 8 to rank 1 and keeps 16: see bucket_splits' example
      ((24, 24), (32, 16), (16, 8), (2, 2))
    """
    w = sched.world
    out: list[Any] = []
    for idx in sched.buckets:
        totals = []
        for way in ("out", "back"):
            sent, received, kept = [0] * w, [0] * w, [0] * w
            pairs: set[tuple[int, int]] = set()
            for j in idx:
                o = sched.owners[j]
                for q, box in sched.pieces[j] if way == "out" else sched.returns[j]:
                    src, dst = (q, o) if way == "out" else (o, q)
                    sent[src] += box.numel
                    received[dst] += box.numel
                    if src == dst:
                        kept[src] += box.numel
                    pairs.add((src, dst))
            peers = [0] * w
            for src, _ in pairs:
                peers[src] += 1
            totals.append(SplitTotals(tuple(sent), tuple(received), tuple(kept), tuple(peers)))
        out.append(tuple(totals))
    return tuple(out)


def _kept_ns(sched: OwnerSchedule, rank: int, locals_, results, ns, dtype, device) -> tuple[int, int]:
    """Newton–Schulz of the blocks this rank keeps, same shapes stacked; ``(blocks, flops)``."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for j in sched.kept:
        if sched.owners[j] == rank:
            by_shape.setdefault(sched.blocks[j].shape, []).append(j)
    count = flops = 0
    for shape, js in by_shape.items():
        stack = torch.empty((len(js), *shape), dtype=dtype, device=device)
        for i, j in enumerate(js):
            b = sched.blocks[j]
            stack[i].copy_(_piece(sched.held[b.leaf][rank], locals_[b.leaf], b.box)[0])
        ortho = ns(stack)
        for i, j in enumerate(js):
            b = sched.blocks[j]
            _piece(sched.held[b.leaf][rank], results[b.leaf], b.box)[0].copy_(ortho[i])
            flops += b.flops
        count += len(js)
    return count, flops


# Process state: a cache of owner schedules (at most 64), a pure function of their key.
_SCHEDULES: dict[tuple, OwnerSchedule] = {}


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
    held: Sequence[Sequence[Box]] | None = None,
) -> list[torch.Tensor]:
    """Newton–Schulz of every leaf's blocks in the pipelined owner layout (see [Note: the
    pipelined owner layout]); returns this rank's piece of each result in ``send`` (the compute
    dtype), given this rank's pieces ``locals_`` of every leaf (boxes ``held``, default rows
    split along dim 0)."""
    held = tuple(tuple(h) for h in held) if held is not None else tuple(whole_holdings(s, world) for s in shapes)
    key = (tuple(map(tuple, shapes)), world, flops, tuple(specs), buckets, send.itemsize, held)
    sched = _SCHEDULES.get(key)
    if sched is None:
        if len(_SCHEDULES) > 64:
            _SCHEDULES.clear()
        sched = _SCHEDULES[key] = owner_schedule(
            shapes, world, flops, specs=specs, buckets=buckets, itemsize=send.itemsize, held=held
        )
    locals_ = [x.contiguous() for x in locals_]
    device = locals_[0].device  # every buffer on the device of the tensors it serves
    results: list[Any] = [torch.empty(x.shape, dtype=send, device=device) for x in locals_]
    plans = [_Bucket(sched, k, rank, send, device) for k in range(len(sched.buckets))]

    def trip(p: _Bucket, buf: torch.Tensor, way: str):
        # The buffer stays referenced with the pending work until it is waited for.
        in_splits, out_splits = p.splits(way)
        got = torch.empty(sum(out_splits), dtype=send, device=device)
        return C.all_to_all(
            got, buf, group, output_splits=out_splits, input_splits=in_splits, async_op=True, tag="muon_owner"
        ), buf

    def finish_back(p: _Bucket, launched) -> None:
        t0 = time.perf_counter()
        got = launched[0].wait()
        _note_back(time.perf_counter() - t0)
        p.unpack_back(got, results)

    out = trip(plans[0], plans[0].pack_out(locals_), "out") if plans else None
    t0 = time.perf_counter()
    kept, kept_flops = _kept_ns(
        sched, rank, locals_, results, ns, send, device
    )  # under the first bucket's pieces travelling
    if kept:
        _note(
            BucketRecord(
                "local", kept, kept_flops, (f"out {plans[0].label}",) if plans else (), 0.0, time.perf_counter() - t0
            )
        )
    back: dict[int, Any] = {}
    for k, p in enumerate(plans):
        t0 = time.perf_counter()
        assert out is not None  # launched for this bucket before its turn
        got = out[0].wait()
        waited = time.perf_counter() - t0
        nxt = plans[k + 1] if k + 1 < len(plans) else None
        out = trip(nxt, nxt.pack_out(locals_), "out") if nxt else None
        flying = ((f"out {nxt.label}",) if nxt else ()) + tuple(f"back {plans[j].label}" for j in back)
        t0 = time.perf_counter()
        stacks, slot = p.assemble(got)
        ortho = {s: ns(stack) for s, stack in stacks.items()}  # same shapes: one batched call
        _note(
            BucketRecord(p.label, len(p.mine), sum(b.flops for b in p.mine), flying, waited, time.perf_counter() - t0)
        )
        back[k] = trip(p, p.pack_back(ortho, slot), "back")
        if k - 1 in back:
            finish_back(plans[k - 1], back.pop(k - 1))
    for k in list(back):
        finish_back(plans[k], back.pop(k))
    return results
