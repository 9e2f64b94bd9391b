"""What an optimizer step costs one rank: descriptions of fsdpfn.optim's AdamW and Muon that the
simulator can cost for any plan, abstract ones included.

[Note: costing the real optimizer]
The elementwise part of a step (moments, momentum, weight decay, ``apply_updates``) is counted
by running the real ``fsdpfn.optim`` transform on meta tensors shaped like this rank's local
shards (:func:`fsdpfn.sim.count_work`): every operator, its bytes, nothing computed. Muon's
Newton–Schulz is then taken out of that count (on meta it ran on the local shards) and put back
where the chosen layout runs it, again counted on meta: on every full matrix (``"gather"``), or
on the matrices this rank owns, same shapes batched (``"owner"``). The collectives and their
bytes follow ``fsdpfn/optim/_distributed_ns.py``'s [Note: the two layouts].

[Note: the owner assignment]
The owner layout's schedule is ``fsdpfn.optim.owner_schedule`` itself, called with the shapes,
the Newton–Schulz FLOPs and the bucket count the real step uses: owners balanced largest
first, every owner's blocks cut into buckets of about equal FLOPs. The step is then costed as
``fsdpfn/optim/_owner.py``'s [Note: the pipelined owner layout] runs it: "out 0" launched,
the local (3-D) leaves orthogonalised under it, then per bucket ``k``: wait for out ``k``,
launch out ``k+1``, assemble and orthogonalise bucket ``k``, launch back ``k``, wait for back
``k-1`` and write its rows. The collectives are asynchronous phases (:class:`CommCost` with a
``tag``, ended by a :class:`Wait`), so the timeline overlaps them with the Newton–Schulz of
the neighbouring buckets exactly as the dependencies allow. Every all-to-all is counted as
``fsdpfn.comm`` records it (``max(input, output)`` bytes on the rank), and timed by the bytes
the busiest rank sends or receives; each bucket's compute is the busiest rank's in that bucket
(an all-to-all waits for every rank). ``tests/test_sim.py`` checks the calls, bytes and FLOPs
against a real step on every rank, one bucket and several.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import torch

from fsdpfn import Plan, optim
from fsdpfn._mesh import Role
from fsdpfn._rows import chunk_bounds
from fsdpfn.sim._workload import EMPTY, Work, count_work

__all__ = ["AdamW", "CommCost", "Muon", "OptimizerCost", "Wait", "local_shapes", "owner_loads"]


class CommCost(NamedTuple):
    """One blocking collective of an optimizer step.

    Attributes:
      kind: collective kind.
      group: ``"shard"`` (the plan's shard axis) -- the only group optimizers use here.
      nbytes: full-buffer bytes on the costed rank, as ``fsdpfn.comm.CollectiveCall`` records.
      wire_bytes: what the counter records as sent (``(W-1)/W * nbytes``).
      sent: bytes the busiest rank really sends or receives (what sets the time).
      dtype: element type sent.
      tag: ``""``: blocking (the step waits for it at once); otherwise launched asynchronously
        and waited for by the later :class:`Wait` of the same tag.
    """

    kind: str
    group: str
    nbytes: int
    wire_bytes: float
    sent: float
    dtype: torch.dtype
    tag: str = ""


class Wait(NamedTuple):
    """An optimizer phase: the step waits for the asynchronous :class:`CommCost` ``tag``."""

    tag: str


class OptimizerCost(NamedTuple):
    """One optimizer step on one rank: ``phases`` run in order, each a :class:`Work` (compute),
    a :class:`CommCost` (a collective: blocking, or launched asynchronously) or a :class:`Wait`
    for an asynchronous one; ``state_bytes`` of optimizer state;
    ``ns_flops`` per rank (Newton–Schulz, the busiest rank's in ``phases``)."""

    phases: tuple
    state_bytes: int
    ns_flops: tuple[float, ...] = ()


def _shard_rank(plan: Plan, rank: int) -> int:
    """``rank``'s index on the shard axis (ranks laid out row-major over the mesh's dims)."""
    d = plan.axes.dim(Role.SHARD)
    after = math.prod(plan.mesh_shape[d + 1:])
    return (rank // after) % plan.mesh_shape[d]


def local_shapes(plan: Plan, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of ``rank``'s local shards of every parameter (``torch.chunk`` rows over the shard
    axis of the tensor-parallel-local part; whole tensors for ``replicate`` units and 0-d
    parameters), in plan order.

    Example:
      >>> fsdpfn.sim.local_shapes(fsdpfn.plan(model, (3,)), rank=2)["head.weight"]
      (20, 32)
    """
    w = plan.shard_size
    s = _shard_rank(plan, rank)
    out = {}
    for unit in plan.units:
        for p in unit.params:
            if unit.sharded and p.shape:
                start, stop = chunk_bounds(p.rows, w, s)
                out[p.name] = (stop - start, *p.local_shape[1:])
            else:
                out[p.name] = tuple(p.local_shape)
    return out


def _meta_tree(plan: Plan, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shapes[n], dtype=plan.param(n).dtype, device="meta") for n in sorted(shapes)}


@functools.lru_cache(maxsize=4096)
def _leaf_work(make: Callable, label: str, shape: tuple[int, ...], dtype: torch.dtype) -> Work:
    """Work of ``update`` + ``apply_updates`` on one meta leaf labelled ``label``. Updates are
    elementwise per leaf, so a tree's work is the sum of its leaves' (cached across plans)."""
    tree = {"w": torch.zeros(shape, dtype=dtype, device="meta")}
    opt = make({"w": label})
    state = opt.init(tree)

    def step():
        updates, _ = opt.update(tree, state, tree)
        return optim.apply_updates(tree, updates)

    return count_work(step)[1]


def _update_work(make: Callable, key: tuple, labels: dict[str, str] | None = None) -> Work:
    """Work of one update of a tree of meta leaves ``key`` = ((name, shape, dtype), ...)."""
    total = EMPTY
    for name, shape, dtype in key:
        total = total + _leaf_work(make, labels[name] if labels else "adamw", shape, dtype)
    return total


def _key(plan: Plan, shapes: dict[str, tuple[int, ...]]) -> tuple:
    return tuple((n, shapes[n], plan.param(n).dtype) for n in sorted(shapes))


def _state_bytes(plan: Plan, shapes: dict[str, tuple[int, ...]], slots: Callable[[str], int]) -> int:
    return sum(math.prod(s) * plan.param(n).dtype.itemsize * slots(n) for n, s in shapes.items())


@dataclasses.dataclass(frozen=True)
class AdamW:
    """``fsdpfn.optim.adamw`` on every parameter: elementwise on local shards, two state slots,
    no communication. Offloaded units step on the host, or with ``streamed=True`` as
    ``fsdpfn.optim.streamed`` runs them: on the device, parameters, gradients and state copied in
    over ``Hardware.host`` and state and updates copied back.

    Example:
      >>> c = fsdpfn.sim.AdamW().cost(plan)
      >>> c.state_bytes == 2 * plan.cost().memory["optimizer_state_per_slot"], len(c.phases)
      (True, 1)
    """

    streamed: bool = False

    def labels(self, plan: Plan) -> dict[str, str]:
        return {n: "adamw" for n in plan.param_names}

    def cost(self, plan: Plan, rank: int = 0) -> OptimizerCost:
        shapes = local_shapes(plan, rank)
        work = _update_work(_adamw, _key(plan, shapes))
        return OptimizerCost((work,), _state_bytes(plan, shapes, lambda n: 2))

    def __str__(self) -> str:
        return "adamw (streamed)" if self.streamed else "adamw"


def _adamw(labels=None):
    return optim.adamw(1e-3, weight_decay=0.1)


def owner_loads(shapes: list[tuple[int, ...]], world: int, flops: Callable[[tuple[int, ...]], float]) -> tuple[list[int | None], list[float]]:
    """Owner of each leaf (``None``: a batched leaf, orthogonalised where it lies) and the
    Newton–Schulz FLOPs each rank runs: ``fsdpfn.optim.owner_schedule`` of whole matrices.

    Example:
      >>> fsdpfn.sim.owner_loads([(8, 8), (2, 2), (4, 4), (4, 4)], 2, lambda s: s[0] * s[1])
      ([0, 1, 1, 1], [64, 36])
    """
    sched = optim.owner_schedule(shapes, world, flops, buckets=1)
    owners: list[int | None] = [None] * len(shapes)
    for b, o in zip(sched.blocks, sched.owners):
        if len(shapes[b.leaf]) == 2:  # a batch's matrices are blocks of their own, kept where they lie
            owners[b.leaf] = o
    return owners, list(sched.loads)


@dataclasses.dataclass(frozen=True)
class Muon:
    """``fsdpfn.optim.muon``: hidden matrices by Muon (momentum, distributed Newton–Schulz in
    ``layout``), the rest by AdamW (see [Note: costing the real optimizer]).

    Attributes:
      layout: ``"owner"`` or ``"gather"``.
      ns_method: ``"standard"`` or ``"gram"``.
      ns_steps: Newton–Schulz iterations.
      ns_dtype: Newton–Schulz compute (and send) dtype; ``None``: the parameters'.
      labels_fn: ``(name, param) -> "muon" | "adamw"`` (default ``fsdpfn.optim.muon_labels``).
      buckets: owner layout: as ``fsdpfn.optim.muon(buckets=...)`` (``None``: its automatic
        choice, one bucket per 4 MiB each rank sends, at most 4).

    Example:
      >>> c = fsdpfn.sim.Muon(layout="gather", ns_dtype=torch.float32).cost(fsdpfn.plan(model, (2,)))
      >>> [p.kind for p in c.phases if isinstance(p, fsdpfn.sim.CommCost)]
      ['all_gather']
    """

    layout: str = "owner"
    ns_method: str = "standard"
    ns_steps: int = 5
    ns_dtype: torch.dtype | None = torch.bfloat16
    labels_fn: Callable | None = None
    buckets: int | None = None

    def __post_init__(self):
        if self.layout not in ("owner", "gather"):
            raise ValueError(f"Muon.layout must be 'owner' or 'gather', got {self.layout!r}")
        if self.ns_method not in ("standard", "gram"):
            raise ValueError(f"Muon.ns_method must be 'standard' or 'gram', got {self.ns_method!r}")
        if self.buckets is not None and (isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or self.buckets < 1):
            raise ValueError(f"Muon.buckets must be None (automatic) or an int >= 1, got {self.buckets!r}")

    def __str__(self) -> str:
        return f"muon {self.layout}" + (f" {self.ns_method}" if self.ns_method != "standard" else "")

    def labels(self, plan: Plan) -> dict[str, str]:
        fn = self.labels_fn or optim.muon_labels
        return {n: fn(n, torch.empty(plan.param(n).shape, device="meta")) for n in plan.param_names}

    def _make(self, labels):
        return optim.muon(0.02, ns_steps=self.ns_steps, ns_dtype=self.ns_dtype, layout=self.layout, ns_method=self.ns_method,
                          labels=labels)

    def _ns_work(self, shape: tuple[int, ...], dtype: torch.dtype) -> Work:
        return _ns_work(shape, dtype, self.ns_steps, self.ns_dtype, self.ns_method)

    def flops(self, shape: tuple[int, ...]) -> float:
        return optim.newton_schulz_flops(shape, self.ns_steps, self.ns_method)

    def cost(self, plan: Plan, rank: int = 0) -> OptimizerCost:
        shapes = local_shapes(plan, rank)
        labels = self.labels(plan)
        split = sorted(n for n in plan.param_names if labels[n] == "muon" and plan.param(n).tp != "replicate")
        if split:  # fsdpfn.optim.muon runs them (over shard x tp groups); this cost model does not have those groups yet
            raise NotImplementedError(
                f"fsdpfn.sim.Muon cannot cost Muon on tensor-parallel leaves yet ({split[:3]}{' ...' if len(split) > 3 else ''}); "
                "the optimizer runs them, benchmarks/muon.py --mesh DxT and --project count its bytes and FLOPs. "
                "Simulate this plan with fsdpfn.sim.AdamW() or without an optimizer")
        muon_names = sorted(n for n in plan.param_names if labels[n] == "muon")
        # Elementwise work: the real transform on meta local shards, minus its Newton-Schulz there.
        total = _update_work(self._make, _key(plan, shapes), labels)
        for n in muon_names:
            if math.prod(shapes[n]):
                total = _minus(total, self._ns_work(shapes[n], plan.param(n).dtype))
        state = _state_bytes(plan, shapes, lambda n: 1 if labels[n] == "muon" else 2)
        w = plan.shard_size
        distributed = [n for n in muon_names if plan.unit_of(n).sharded and w > 1]
        local = [n for n in muon_names if n not in distributed]
        ns_local = EMPTY
        for n in local:  # whole matrices here (replicate units, one shard rank): every rank runs them
            if math.prod(shapes[n]):
                ns_local = ns_local + self._ns_work(shapes[n], plan.param(n).dtype)
        if not distributed:
            return OptimizerCost((total + ns_local,), state, (ns_local.flops,) * w)
        dtype = self.ns_dtype or plan.param(distributed[0]).dtype
        run = self._owner if self.layout == "owner" else self._gather
        phases, ns_flops = run(plan, [tuple(plan.param(n).shape) for n in distributed], rank % w, w, dtype)
        return OptimizerCost((total + ns_local, *phases), state, tuple(f + ns_local.flops for f in ns_flops))

    def _gather(self, plan, full, me, w, dtype):
        item = dtype.itemsize
        per_rank = sum(-(-s[0] // w) * math.prod(s[1:]) for s in full)
        nbytes = w * per_rank * item
        comm = CommCost("all_gather", "shard", nbytes, (w - 1) / w * nbytes, (w - 1) / w * nbytes, dtype)
        ns = EMPTY
        for s in full:
            ns = ns + self._ns_work(s, dtype)
        local = sum(math.prod(s) for s in full) / w * item
        copies = Work(bytes=2 * per_rank * item + 2 * sum(math.prod(s) for s in full) * item + 2 * local, ops=3 * len(full))
        return (comm, ns + copies), (ns.flops,) * w

    def _owner(self, plan, full, me, w, dtype):
        """Phases of the pipelined owner layout (see [Note: the owner assignment])."""
        item = dtype.itemsize
        sched = optim.owner_schedule(full, w, self.flops, buckets=self.buckets, itemsize=item)
        bounds = [[chunk_bounds(s[0], w, q) for q in range(w)] for s in full]

        def held(b, q: int) -> int:  # elements of block b on rank q
            start, stop = bounds[b.leaf][q]
            return max(0, min(stop, b.rows[1]) - max(start, b.rows[0])) * (b.cols[1] - b.cols[0])

        local_ns: dict[int, Work] = {}
        for q in range(w):  # batched (3-D) leaves: orthogonalised where they lie
            ns = EMPTY
            for i in sched.local:
                start, stop = bounds[i][q]
                if stop > start:
                    ns = ns + self._ns_work((stop - start, *full[i][1:]), dtype)
            local_ns[q] = ns
        buckets = []
        for k, idx in enumerate(sched.buckets):
            ins = [sum(held(sched.blocks[j], q) for j in idx) for q in range(w)]  # rows each rank sends out
            outs = [sum(sched.blocks[j].shape[0] * sched.blocks[j].shape[1] for j in idx if sched.owners[j] == q) for q in range(w)]
            own = [sum(held(sched.blocks[j], q) for j in idx if sched.owners[j] == q) for q in range(w)]
            nbytes = max(ins[me], outs[me]) * item  # as fsdpfn.comm records an all-to-all
            sent = max(max(ins[q], outs[q]) - own[q] for q in range(w)) * item
            work = []
            for q in range(w):
                ns = EMPTY
                by_shape: dict[tuple[int, int], int] = {}
                for j in idx:
                    if sched.owners[j] == q:
                        by_shape[sched.blocks[j].shape] = by_shape.get(sched.blocks[j].shape, 0) + 1
                for s, n in by_shape.items():
                    ns = ns + self._ns_work(s if n == 1 else (n, *s), dtype)
                # assembling the owned blocks from the received rows, and packing them back
                work.append(ns + Work(bytes=4 * outs[q] * item, ops=2 * sum(1 for j in idx if sched.owners[j] == q)))
            pack = [Work(bytes=2 * ins[q] * item, ops=sum(1 for j in idx if held(sched.blocks[j], q))) for q in range(w)]
            buckets.append((nbytes, sent, work, pack))

        def busiest(works: list[Work]) -> Work:
            return max(works, key=lambda x: (x.flops, x.bytes))

        def a2a(k: int, way: str) -> CommCost:
            nbytes, sent = buckets[k][0], buckets[k][1]
            return CommCost("all_to_all", "shard", nbytes, (w - 1) / w * nbytes, sent, dtype, f"{way} {k}")

        phases: list = []
        if buckets:
            phases += [busiest(buckets[0][3]), a2a(0, "out")]
        phases.append(busiest(list(local_ns.values())))
        for k in range(len(buckets)):
            phases.append(Wait(f"out {k}"))
            if k + 1 < len(buckets):
                phases += [busiest(buckets[k + 1][3]), a2a(k + 1, "out")]
            phases += [busiest(buckets[k][2]), a2a(k, "back")]
            if k:
                phases += [Wait(f"back {k - 1}"), busiest(buckets[k - 1][3])]  # unpacking: the packing's copy, reversed
        if buckets:
            phases += [Wait(f"back {len(buckets) - 1}"), busiest(buckets[-1][3])]
        return [p for p in phases if not isinstance(p, Work) or p], tuple(sched.loads)


def _minus(a: Work, b: Work) -> Work:
    counts = {(d, f, by): c for d, f, by, c in a.matmuls}
    for d, f, by, c in b.matmuls:
        counts[(d, f, by)] = counts.get((d, f, by), 0) - c
    mm = tuple((d, f, by, c) for (d, f, by), c in sorted(counts.items()) if c > 0)
    return Work(mm, max(0.0, a.bytes - b.bytes), max(0, a.ops - b.ops))


@functools.lru_cache(maxsize=4096)
def _ns_work(shape: tuple[int, ...], dtype: torch.dtype, steps: int, ns_dtype, method: str) -> Work:
    x = torch.zeros(shape, dtype=dtype, device="meta")
    return count_work(optim.newton_schulz, x, steps, dtype=ns_dtype, method=method)[1]
