"""What an optimizer step costs one rank: descriptions of fsdpfn.optim's AdamW and Muon that the
simulator can cost for any plan, abstract ones included.

[Note: costing the real optimizer]
The elementwise part of a step (moments, momentum, weight decay, ``apply_updates``) is counted
by running the real ``fsdpfn.optim`` transform on meta tensors shaped like this rank's local
shards (:func:`fsdpfn.sim.count_work`): every operator, its bytes, nothing computed. Muon's
Newton–Schulz is then taken out of that count (on meta it ran on the local shards) and put back
where the chosen layout runs it, again counted on meta: on every full matrix
(``"duplicated"``), or on the blocks this rank owns, same shapes batched (``"owner"``; and
``"blockwise"``, whose blocks are the tensor-parallel pieces, ``fsdpfn.optim.blockwise_spec``). The collectives and their
bytes follow ``fsdpfn/optim/_distributed_ns.py``'s [Note: the two layouts].

[Note: the owner assignment]
The optimizer's work groups are formed as ``fsdpfn.optim.orthogonalize`` forms them: Muon leaves
split along no mesh dim are orthogonalised where they lie; the others are grouped per mesh (the
plan's, or the ``ep`` x ``shard`` axes flattened for dense units beside experts) over the mesh
dims any of them is split along (shard and tp on a tp plan). Each member's box of every leaf is
``fsdpfn.optim.leaf_holdings`` of the plan's placements (``fsdpfn.transforms.placements``),
the boxes the optimizer reads off the DTensors. The owner layout's schedule is
``fsdpfn.optim.owner_schedule`` itself, called with those boxes, the Newton–Schulz FLOPs and the
bucket count the real step uses: blocks a rank holds whole and alone kept there (experts, heads
inside a tp slice), the others balanced largest first, every owner's blocks cut into buckets of
about equal FLOPs; each bucket's all-to-all splits are those of ``fsdpfn.optim.bucket_splits``,
the packing the optimizer sends, summed for every rank in one pass (``bucket_totals``). The step
is then costed as ``fsdpfn/optim/_owner.py``'s [Note: the pipelined owner layout] runs it: "out
0" launched, the local (3-D) leaves orthogonalised under it, then per bucket ``k``: wait for out ``k``,
launch out ``k+1``, assemble and orthogonalise bucket ``k``, launch back ``k``, wait for back
``k-1`` and write its rows. The collectives are asynchronous phases (:class:`CommCost` with a
``tag``, ended by a :class:`Wait`), so the timeline overlaps them with the Newton–Schulz of
the neighbouring buckets exactly as the dependencies allow. Every all-to-all is counted as
``fsdpfn.comm`` records it (``max(input, output)`` bytes on the rank), and timed by the bytes
the busiest rank sends or receives; each bucket's compute is the busiest rank's in that bucket
(an all-to-all waits for every rank). ``tests/test_sim.py`` checks the calls, bytes and FLOPs
against a real step on every rank, one bucket and several; ``tests/test_sim_muon_tp.py`` on
tensor-parallel meshes and expert-parallel plans, every layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, NamedTuple, cast

import torch

from fsdpfn import optim
from fsdpfn._plan import Plan
from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import mesh_dims, unit_row_roles
from fsdpfn._rows import chunk_bounds
from fsdpfn._wire import wire_bytes
from fsdpfn.sim._workload import EMPTY, Work, count_work

__all__ = ["AdamW", "CommCost", "Muon", "OptimizerCost", "Wait", "local_shapes", "owner_loads"]


class CommCost(NamedTuple):
    """One blocking collective of an optimizer step.

    Attributes:
      kind: collective kind.
      group: the mesh axes it runs over: their roles joined by ``"+"`` (``"shard"``,
        ``"shard+tp"``: Muon's work group over both), or ``"dense"`` (the ``ep`` x ``shard``
        axes flattened, where dense units live beside experts).
      nbytes: full-buffer bytes on the costed rank, as ``fsdpfn.comm.CollectiveCall`` records.
      wire_bytes: what the counter records as sent (:func:`fsdpfn.sim.wire_bytes`).
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
    ``ns_flops``: Newton–Schulz FLOPs of every rank of the mesh, by global rank (``phases`` time
    the busiest rank's)."""

    phases: tuple
    state_bytes: int
    ns_flops: tuple[float, ...] = ()


def _coords(plan: Plan, rank: int) -> tuple[int, ...]:
    """``rank``'s coordinates on the plan's mesh (ranks laid out row-major over its dims)."""
    out, rest = [], rank
    for size in reversed(plan.mesh_shape):
        rest, c = divmod(rest, size)
        out.append(c)
    return tuple(reversed(out))


def _dense(plan: Plan, unit) -> bool:
    """A unit whose rows are cut over several axes (a dense one beside ``ep``: ``ep`` x
    ``shard``, :func:`fsdpfn._plan.placements.row_roles`): its parameters live on them flattened
    in mesh order (``fsdpfn.transforms.unit_mesh``)."""
    return len(unit_row_roles(unit, plan.axes)) > 1


def _mesh_of(plan: Plan, unit, rank: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(key, sizes, rank's coordinates)`` of the mesh ``unit``'s parameters are placed on
    (:func:`fsdpfn._plan.placements.mesh_dims`, as ``fsdpfn.transforms.unit_mesh`` builds it)."""
    coords = _coords(plan, rank)
    if not _dense(plan, unit):
        return "mesh", tuple(plan.mesh_shape), coords
    sizes, index = [], []
    for dim in mesh_dims(unit_row_roles(unit, plan.axes), plan.axes):
        i = 0
        for d in (cast(int, plan.axes.dim(r)) for r in dim):  # in mesh order, flattened row-major
            i = i * plan.mesh_shape[d] + coords[d]
        sizes.append(math.prod(plan.axes.size(r) for r in dim))
        index.append(i)
    return "dense", tuple(sizes), tuple(index)


def _rows_dim(plan: Plan, unit) -> int:
    rows = unit_row_roles(unit, plan.axes)
    return mesh_dims(rows, plan.axes).index(rows)


def local_shapes(plan: Plan, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of ``rank``'s local shards of every parameter (``torch.chunk`` rows over the shard
    axis of the tensor- or expert-parallel-local part, over the ``ep`` x ``shard`` axes for dense
    units beside experts; whole tensors for ``replicate`` units and 0-d parameters), in plan
    order.

    Example:
      >>> fsdpfn.sim.local_shapes(fsdpfn.plan(model, (3,)), rank=2)["head.weight"]
      (20, 32)
    """
    out = {}
    for unit in plan.units:
        _, sizes, coords = _mesh_of(plan, unit, rank)
        dense = _dense(plan, unit)
        w = sizes[_rows_dim(plan, unit)] if dense else plan.shard_size
        s = (
            coords[_rows_dim(plan, unit)]
            if dense
            else coords[cast(int, plan.axes.dim(Role.SHARD))]
            if plan.axes.dim(Role.SHARD) is not None
            else 0
        )
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


def owner_loads(
    shapes: list[tuple[int, ...]], world: int, flops: Callable[[tuple[int, ...]], int]
) -> tuple[list[int | None], list[float]]:
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
    ``layout``), the rest by AdamW (see [Note: costing the real optimizer]), on any plan: data
    parallel, HSDP, tensor parallel (the work group spans the shard and tp axes), experts.

    Attributes:
      layout: ``"owner"``, ``"duplicated"`` (alias ``"gather"``) or ``"blockwise"``.
      ns_method: ``"standard"`` or ``"gram"``.
      ns_steps: Newton–Schulz iterations.
      ns_dtype: Newton–Schulz compute (and send) dtype; ``None``: the parameters'.
      labels_fn: ``(name, param) -> "muon" | "adamw"`` (default ``fsdpfn.optim.muon_labels``).
      blocks: as ``fsdpfn.optim.muon(blocks=...)``: leaves orthogonalised as independent blocks
        (per head: ``fsdpfn.optim.head_blocks(heads)``); ``None``: whole matrices.
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
    blocks: Any = dataclasses.field(default=None, hash=False)  # a dict is not hashable

    def __post_init__(self):
        if self.layout not in optim.LAYOUTS:
            raise ValueError(
                f"Muon.layout must be one of {optim.LAYOUTS} ('gather' is 'duplicated'), got {self.layout!r}"
            )
        if self.ns_method not in ("standard", "gram"):
            raise ValueError(f"Muon.ns_method must be 'standard' or 'gram', got {self.ns_method!r}")
        object.__setattr__(self, "_spec_fn", optim.check_blocks("fsdpfn.sim.Muon", self.blocks))
        if self.buckets is not None and (
            isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or self.buckets < 1
        ):
            raise ValueError(f"Muon.buckets must be None (automatic) or an int >= 1, got {self.buckets!r}")
        # cost() per layout: a plan search costs the same parameter layout under many strategies,
        # prefetch depths and accumulation modes, and a 1,024-rank owner schedule takes seconds.
        object.__setattr__(self, "_costs", {})

    def __str__(self) -> str:
        return f"muon {self.layout}" + (f" {self.ns_method}" if self.ns_method != "standard" else "")

    def labels(self, plan: Plan) -> dict[str, str]:
        fn = self.labels_fn or optim.muon_labels
        return {n: fn(n, torch.empty(plan.param(n).shape, device="meta")) for n in plan.param_names}

    def _make(self, labels):
        return optim.muon(
            0.02,
            ns_steps=self.ns_steps,
            ns_dtype=self.ns_dtype,
            layout=self.layout,
            ns_method=self.ns_method,
            labels=labels,
        )

    def _ns_work(self, shape: tuple[int, ...], dtype: torch.dtype) -> Work:
        return _ns_work(shape, dtype, self.ns_steps, self.ns_dtype, self.ns_method)

    def flops(self, shape: tuple[int, ...]) -> int:
        return optim.newton_schulz_flops(shape, self.ns_steps, self.ns_method)

    def cost(self, plan: Plan, rank: int = 0) -> OptimizerCost:
        from fsdpfn.transforms import placements  # plans only: no process group is touched

        shapes = local_shapes(plan, rank)
        # Everything below reads the plan through these: the mesh, every parameter's global and
        # local shape, dtype and placements, and which mesh its unit lives on.
        key = (
            rank,
            tuple(plan.mesh_shape),
            plan.axes,
            tuple(
                (
                    n,
                    tuple(plan.param(n).shape),
                    plan.param(n).dtype,
                    shapes[n],
                    tuple(placements(plan, n)),
                    _dense(plan, plan.unit_of(n)),
                )
                for n in plan.param_names
            ),
        )
        if key not in self._costs:  # type: ignore[attr-defined]  # set in __post_init__ (a frozen dataclass's cache)
            self._costs[key] = self._cost(plan, rank, shapes)  # type: ignore[attr-defined]
        return self._costs[key]  # type: ignore[attr-defined]

    def _cost(self, plan: Plan, rank: int, shapes: dict[str, tuple[int, ...]]) -> OptimizerCost:
        labels = self.labels(plan)
        muon_names = sorted(n for n in plan.param_names if labels[n] == "muon")  # the optimizer's tree order
        # Elementwise work: the real transform on meta local shards, minus its Newton-Schulz there.
        total = _update_work(self._make, _key(plan, shapes), labels)
        for n in muon_names:
            if math.prod(shapes[n]):
                total = _minus(total, self._ns_work(shapes[n], plan.param(n).dtype))
        state = _state_bytes(plan, shapes, lambda n: 1 if labels[n] == "muon" else 2)
        world = plan.world_size
        flops = [0] * world
        ns_local = EMPTY
        phases: list = []
        for group in self._groups(plan, muon_names, rank):
            if group.dims is None:  # split along no mesh dim: every rank orthogonalises it where it lies
                n = group.names[0]
                shape, spec = group.shapes[0], group.specs[0]
                ns_local = ns_local + self._blocks_work(shape, spec, group.dtype)
                for r in range(world):
                    flops[r] += self._blocks_flops(shape, spec)
                continue
            run = self._owner if self.layout in ("owner", "blockwise") else self._gather
            group_phases, per_member = run(group)
            phases += group_phases
            for r in range(world):
                flops[r] += per_member[group.member(plan, r)]
        return OptimizerCost((total + ns_local, *phases), state, tuple(flops))

    def _groups(self, plan: Plan, names: list[str], rank: int) -> list["_Group"]:
        """The optimizer's work groups, in the order ``fsdpfn.optim.orthogonalize`` runs them:
        leaves split along no mesh dim first (one pseudo-group each), then one group per mesh and
        send dtype, over the mesh dims any of its leaves is split along."""
        from fsdpfn.transforms import placements  # plans only: no process group is touched

        axes = plan.axes
        local: list[_Group] = []
        grouped: dict[tuple, list] = {}
        for n in names:
            unit = plan.unit_of(n)
            key, sizes, coords = _mesh_of(plan, unit, rank)
            place = tuple(placements(plan, n))
            shape = tuple(plan.param(n).shape)
            spec = self._spec_fn(n, torch.empty(shape, device="meta"))  # type: ignore[attr-defined]  # set in __post_init__
            optim.block_shape(n, shape, spec)  # blocks that do not divide the leaf: named, as the optimizer names them
            if self.layout == "blockwise" and key == "mesh":
                spec = optim.blockwise_spec_on_mesh(shape, place, sizes, axes, spec, n)
            dtype = self.ns_dtype or plan.param(n).dtype
            dims = optim.split_mesh_dims(place, sizes)
            if not dims:
                local.append(_Group((n,), (shape,), (spec,), (), dtype, None, (), 0, sizes, key, ""))
                continue
            grouped.setdefault((key, dtype), []).append((n, shape, spec, place, dims, sizes, coords))
        out = list(local)
        for (key, dtype), items in grouped.items():
            sizes, coords = items[0][5], items[0][6]
            dims = tuple(sorted({d for it in items for d in it[4]}))
            members = tuple(dict(zip(dims, idx)) for idx in itertools.product(*(range(sizes[d]) for d in dims)))
            me = members.index({d: coords[d] for d in dims})
            held = tuple(optim.leaf_holdings(it[1], it[3], sizes, members, it[0]) for it in items)
            roles = "+".join(axes.roles[d].value for d in dims) if key == "mesh" else "dense"
            out.append(
                _Group(
                    tuple(it[0] for it in items),
                    tuple(it[1] for it in items),
                    tuple(it[2] for it in items),
                    held,
                    dtype,
                    dims,
                    members,
                    me,
                    sizes,
                    key,
                    roles,
                )
            )
        return out

    def _blocks_flops(self, shape: tuple[int, ...], spec: tuple[int, int]) -> int:
        return self.flops(_blocks_shape(shape, spec))

    def _blocks_work(self, shape: tuple[int, ...], spec: tuple[int, int], dtype: torch.dtype) -> Work:
        return self._ns_work(_blocks_shape(shape, spec), dtype)

    def _gather(self, g: "_Group"):
        """The duplicated layout: one all-gather of every piece (padded to the largest), then
        every rank orthogonalises every matrix (``fsdpfn/optim/_distributed_ns.py``)."""
        w, item = len(g.members), g.dtype.itemsize
        pads = optim.gather_pads(g.held)
        per_rank = sum(pads)
        ns = EMPTY
        for shape, spec in zip(g.shapes, g.specs):
            ns = ns + self._blocks_work(shape, spec, g.dtype)
        full = sum(math.prod(s) for s in g.shapes)
        mine = sum(h[g.rank].numel for h in g.held)
        copies = Work(bytes=2 * per_rank * item + 2 * full * item + 2 * mine * item, ops=3 * len(g.shapes))
        flops = sum(self._blocks_flops(s, spec) for s, spec in zip(g.shapes, g.specs))
        if not per_rank:
            return [ns + copies], (flops,) * w
        nbytes = w * per_rank * item
        wire = wire_bytes("all_gather", w, nbytes)
        comm = CommCost("all_gather", g.roles, nbytes, wire, wire, g.dtype)
        return [comm, ns + copies], (flops,) * w

    def _owner(self, g: "_Group"):
        """Phases of the pipelined owner layout (see [Note: the owner assignment]), from the
        schedule and the all-to-all splits the optimizer runs."""
        w, item, me = len(g.members), g.dtype.itemsize, g.rank
        sched = optim.owner_schedule(
            g.shapes, w, self.flops, specs=list(g.specs), buckets=self.buckets, itemsize=item, held=g.held
        )
        totals = optim.bucket_totals(sched)  # [bucket] -> (out, back), summed per rank from the same pieces

        def stacked(js) -> Work:  # same shapes batched into one call, as the optimizer stacks them
            by_shape: dict[tuple[int, int], int] = {}
            for j in js:
                by_shape[sched.blocks[j].shape] = by_shape.get(sched.blocks[j].shape, 0) + 1
            ns = EMPTY
            for s, n in by_shape.items():
                ns = ns + self._ns_work((n, *s), g.dtype)
            return ns

        kept = [stacked(j for j in sched.kept if sched.owners[j] == q) for q in range(w)]
        buckets = []
        for k, idx in enumerate(sched.buckets):
            cost = {}
            for way, t in zip(("out", "back"), totals[k]):
                # the recorded size (the larger of a rank's two buffers), and the most any rank
                # sends to or receives from others
                recorded = max(t.sent[me], t.received[me])
                across = max(max(t.sent[q] - t.kept[q], t.received[q] - t.kept[q]) for q in range(w))
                cost[way] = (recorded * item, across * item)
            owned_by: dict[int, list[int]] = {}
            for j in idx:
                owned_by.setdefault(sched.owners[j], []).append(j)
            out = totals[k][0]
            # assembling the owned blocks from the received rows, and packing them back
            work = [
                stacked(owned_by.get(q, ())) + Work(bytes=4 * out.received[q] * item, ops=2 * len(owned_by.get(q, ())))
                for q in range(w)
            ]
            pack = [Work(bytes=2 * out.sent[q] * item, ops=out.peers[q]) for q in range(w)]
            buckets.append((cost, work, pack))

        def busiest(works: list[Work]) -> Work:
            return max(works, key=lambda x: (x.flops, x.bytes))

        def a2a(k: int, way: str) -> CommCost:
            nbytes, sent = buckets[k][0][way]
            return CommCost(
                "all_to_all", g.roles, nbytes, wire_bytes("all_to_all", w, nbytes), sent, g.dtype, f"{way} {k}"
            )

        phases: list = []
        if buckets:
            phases += [busiest(buckets[0][2]), a2a(0, "out")]
        phases.append(busiest(kept))
        for k in range(len(buckets)):
            phases.append(Wait(f"out {k}"))
            if k + 1 < len(buckets):
                phases += [busiest(buckets[k + 1][2]), a2a(k + 1, "out")]
            phases += [busiest(buckets[k][1]), a2a(k, "back")]
            if k:
                phases += [Wait(f"back {k - 1}"), busiest(buckets[k - 1][2])]  # unpacking: the packing's copy, reversed
        if buckets:
            phases += [Wait(f"back {len(buckets) - 1}"), busiest(buckets[-1][2])]
        return [p for p in phases if not isinstance(p, Work) or p], tuple(sched.loads)


_WHOLE = (1, 1)


def _blocks_shape(shape: tuple[int, ...], spec: tuple[int, int]) -> tuple[int, ...]:
    """The shape Newton–Schulz runs on for a leaf of ``shape`` cut into ``spec`` blocks: the
    leaf itself when whole, else its blocks stacked (``fsdpfn.optim``'s ``split_blocks``)."""
    if spec == _WHOLE:
        return tuple(shape)
    m, n = spec
    return (math.prod(shape[:-2]) * m * n, shape[-2] // m, shape[-1] // n)


class _Group(NamedTuple):
    """One work group of ``fsdpfn.optim.orthogonalize`` on one rank (``dims`` ``None``: a leaf
    split along no mesh dim, orthogonalised where it lies)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    specs: tuple[tuple[int, int], ...]
    held: tuple
    dtype: torch.dtype
    dims: tuple[int, ...] | None
    members: tuple[dict[int, int], ...]  # the members' coordinates on ``dims``, in group order
    rank: int  # the costed rank's index among them
    sizes: tuple[int, ...]
    mesh: str
    roles: str  # CommCost.group: the roles of ``dims`` joined by "+", or "dense"

    def member(self, plan: Plan, rank: int) -> int:
        """``rank``'s index in its own group of this shape (every group of the other mesh dims
        runs the same schedule)."""
        coords = _mesh_of(plan, plan.unit_of(self.names[0]), rank)[2]
        return self.members.index(
            {d: coords[d] for d in cast("tuple[int, ...]", self.dims)}
        )  # a group split along dims


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
