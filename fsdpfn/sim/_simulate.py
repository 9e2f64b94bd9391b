"""The simulator: a plan, the runtime's schedule, a workload, an optimizer and the hardware in;
a predicted step (timeline, exposed communication, bytes per link level, memory per rank) out.

[Note: from schedule ops to tasks]
The schedule is walked in order, as the runtime's executor walks it, and each op becomes tasks
of the timeline engine (``fsdpfn/sim/_engine.py``):

- an *event* ends the work of the previous event: that work becomes a compute task. The work
  after an event runs after the actions that follow it (the executor runs them in the event's
  hook, before the unit computes);
- ``gather u``: a pack copy (compute) and the all-gather on the ``all_gather`` stream. It is
  issued when the host gets there: after the compute before it (on CUDA the collective's
  stream waits for the compute stream, on CPU the host issues it then). An FP8 unit gathers its
  byte segment; under the per-tensor recipe the amax all-reduce runs first, blocking;
- ``wait u``: the compute stream waits for the gather, then unpacks (a copy of the full unit);
- ``reduce u``: a pack copy, then the reduce-scatter (all-reduce for ``replicate`` units) on
  the ``reduce_scatter`` stream;
- ``wait_reduce u``: the compute stream waits for it; under HSDP the all-reduce over the
  replicate axis then runs *blocking* (``fsdpfn.transforms`` issues it inside the reduce's
  finish), and the shard is cast and scaled;
- ``free u``: memory only;
- ``accumulate u``: u's full gradients added to the kept sum (a copy), nothing sent;
- a tensor-parallel unit's activation collectives (its rowwise outputs' all-reduces in forward,
  its colwise inputs' gradient all-reduces in backward) run blocking on the ``tp`` stream after
  the unit's compute of that event (they sit between its matmuls; the compute stream waits for
  each). The root's run with its first stretch (after ``forward <root>`` / ``backward <root>``).
  An expert layer's token exchange before its experts (the counts and the dispatch at ``forward``
  of the expert unit, the combine's transpose at its ``backward``) runs blocking when the event
  is reached, before the experts' gather and compute; its combine after them. So the timeline
  issues the collectives in the op list's order (:func:`fsdpfn.step_collectives`).

Memory follows the same walk in op order: a unit's unsharded parameters count from its
``gather`` to its ``free``, exactly as ``fsdpfn.runtime.MemoryTracker`` counts them
(:func:`fsdpfn._plan.steps.unsharded_bytes`, the walk ``plan.cost()`` reads too), so
``SimResult.memory["unsharded_peak"]`` is the runtime's ``rt.memory.high_water``. Flat
communication buffers, full gradients (from a unit's backward to its reduce), and activations
(from a unit's forward to the end of its backward) are added on top for the total peak, and
while a stretch's work runs, its transient bytes (``Workload.transient``: the results its
operators hold at once besides the saved activations, such as the loss's float32 logits and
their gradient) on top of those.

The optimizer step follows the last micro-batch: its phases in order; a collective blocks unless
it is tagged (Muon's pipelined owner layout), then it runs on the ``optimizer`` stream until
the :class:`fsdpfn.sim.Wait` of its tag.
Which collectives run, on which op, with which bytes, and whether a micro-batch reduces, is not
worked out here: the walk is over ``fsdpfn._plan.steps.step_ops`` of the plan and the schedule, each
op with the collectives it issues (the list :func:`fsdpfn.step_collectives` gives, which
``plan.cost()`` sums and tests compare with a ``count_collectives()`` record of a real step);
the simulator times it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, NamedTuple, cast

from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn._plan.axes import Role
from fsdpfn._plan.interpret import FSDP_ACTIONS, bind_handlers
from fsdpfn._plan.placements import rows_over, unit_row_roles
from fsdpfn._plan.schedule import Op, OpKind, Schedule, schedule as default_schedule, validate
from fsdpfn._plan.steps import (
    Collective,
    StepOp,
    static_memory,
    step_collectives,
    step_ops,
    totals,
    unsharded_bytes,
    unsharded_peak,
)
from fsdpfn.sim._engine import Task, run
from fsdpfn.sim._hardware import Hardware
from fsdpfn.sim._optimizer import CommCost, Wait
from fsdpfn.sim._workload import EMPTY, Work, Workload

__all__ = ["SimResult", "Span", "Traffic", "simulate"]

ROOT = ""
ACCUMULATE = ("reduce", "local")


class Traffic(NamedTuple):
    """Collectives of one kind per rank per step: ``calls``, ``nbytes`` (full buffers) and
    ``wire_bytes`` (sent), as ``fsdpfn.comm`` counts them (fields named like ``plan.cost()``'s)."""

    calls: int = 0
    nbytes: int = 0
    wire_bytes: float = 0.0

    def __add__(self, other):
        return Traffic(self.calls + other.calls, self.nbytes + other.nbytes, self.wire_bytes + other.wire_bytes)


class Span(NamedTuple):
    """One bar of the timeline: ``stream``, ``start``/``end`` seconds, ``kind`` (``forward``,
    ``backward``, ``copy``, ``wait``, ``optimizer``, or a collective kind), ``unit``, ``nbytes``;
    ``op``: the index of the schedule op that made it (``-1``: the optimizer step), in
    ``micro_batch``."""

    stream: str
    start: float
    end: float
    kind: str
    unit: str
    nbytes: float = 0.0
    op: int = -1
    micro_batch: int = 0

    @property
    def label(self) -> str:
        if self.op == -1:  # the optimizer step: the unit is a tag ("out 0") or nothing
            return f"{self.kind} {self.unit}" if self.unit else self.kind
        unit = "<root>" if self.unit == ROOT else self.unit
        return f"{self.kind} {unit}" if self.unit is not None else self.kind


def kept_grad_bytes(plan, unit) -> int:
    """Bytes of a unit's full gradients kept over micro-batches, in its reduce dtype."""
    return unit.numel * plan.reduce_dtype(unit).itemsize


def accumulate_work(plan, unit) -> Work:
    """Adding one micro-batch's full gradients of ``unit`` to the kept sum: read both, write
    one, in the reduce dtype, one operator per parameter. The one-stage and the pipelined
    simulators price accumulation with it."""
    return Work(bytes=3 * kept_grad_bytes(plan, unit), ops=len(unit.params))


@dataclasses.dataclass(frozen=True)
class SimResult:
    """A predicted training step on one rank.

    Attributes:
      step_time: seconds from the first forward to the end of the optimizer step.
      optimizer_time: the optimizer step's part of it (after the schedule's last op).
      compute_time: seconds the compute stream is busy.
      comm_time: seconds some collective is in flight.
      exposed_comm: seconds the compute stream waits for communication (not hidden).
      traffic: ``{"step": {kind: Traffic}, "optimizer": {kind: Traffic}}`` per rank: the
        schedule's collectives and the optimizer's.
      level_bytes: ``{"intra": bytes, "inter": bytes}`` sent per rank per level.
      memory: bytes per rank: ``params``, ``grads``, ``optimizer_state`` (held on the device
        between steps), ``host`` (what offloaded units hold in host memory instead; only when
        some are), ``unsharded_peak`` (the runtime's high-water mark), ``activations_peak``,
        ``peak`` (everything allocated at the worst moment of the step: comparable with
        ``torch.cuda.max_memory_allocated()``), ``reserved`` (``peak`` with the caching
        allocator's reserve, ``Hardware.memory_reserve``: comparable with
        ``max_memory_reserved()``, the figure training logs report).
      spans: the timeline.
      plan, schedule, hardware: what was simulated.
      notes: what the model assumed that a reader should know.
      host_copies: ``{"copy_in": bytes, "copy_out": bytes}`` of offloaded units' host-device
        copies per step (the runtime's ``StepRecord.copies`` summed), and ``stream_in`` /
        ``stream_out`` with a streamed optimizer step.
      calls: every collective timed (:class:`fsdpfn.Collective`): the schedule's, from
        :func:`fsdpfn.step_collectives`, then the optimizer's (phase ``"optimizer"``);
        ``traffic`` sums them.

    Example:
      >>> r = fsdpfn.sim.simulate(plan, runtime.schedule(plan), fsdpfn.sim.profile(model, plan, x), None, fsdpfn.sim.H100_SXM)
      >>> r.memory["unsharded_peak"] == rt.memory.high_water, r.traffic["step"]["all_gather"].calls
      (True, 5)
    """

    step_time: float
    optimizer_time: float
    compute_time: float
    exposed_comm: float
    traffic: dict
    level_bytes: dict
    memory: dict
    spans: tuple[Span, ...]
    comm_time: float = 0.0
    plan: Plan | None = dataclasses.field(repr=False, compare=False, default=None)
    schedule: Schedule | None = dataclasses.field(repr=False, compare=False, default=None)
    hardware: Hardware | None = dataclasses.field(repr=False, compare=False, default=None)
    notes: tuple[str, ...] = ()
    calls: tuple = dataclasses.field(default=(), repr=False, compare=False)
    host_copies: dict = dataclasses.field(default_factory=dict)

    @property
    def collectives(self) -> dict[str, Traffic]:
        """Every collective of the step (schedule and optimizer), per kind."""
        out: dict[str, Traffic] = {}
        for part in self.traffic.values():
            for k, t in part.items():
                out[k] = out.get(k, Traffic()) + t
        return out

    def summary(self) -> str:
        gib = 2**30
        m = self.memory
        plan = self.plan
        mesh = "x".join(map(str, plan.mesh_shape)) if plan is not None else "?"
        lines = [
            f"step {self.step_time * 1e3:,.2f} ms on {self.hardware.name if self.hardware else '?'} (mesh {mesh}), "
            f"optimizer {self.optimizer_time * 1e3:,.2f} ms of it: compute {self.compute_time * 1e3:,.2f} ms, communication {self.comm_time * 1e3:,.2f} ms, "
            f"exposed {self.exposed_comm * 1e3:,.2f} ms",
            "bytes sent per rank: " + ", ".join(f"{k} {v / 2**20:,.2f} MiB" for k, v in self.level_bytes.items()),
            "memory per rank: " + ", ".join(f"{k} {v / gib:,.3f} GiB" for k, v in m.items() if v is not None),
        ]
        for part, kinds in self.traffic.items():
            for kind, t in kinds.items():
                lines.append(
                    f"  {part:<9} {kind:<15} {t.calls:>5} calls  {t.nbytes / 2**20:12,.2f} MiB buffers  {t.wire_bytes / 2**20:12,.2f} MiB sent"
                )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def timeline(self, limit: int | None = None) -> str:
        """The spans, one a line, by start time: ``start end (ms) stream what``."""
        spans = sorted(self.spans, key=lambda s: (s.start, s.stream))
        shown = spans if limit is None else spans[:limit]
        lines = ["   start ms     end ms  stream           what"]
        for s in shown:
            size = f"  {s.nbytes / 2**20:,.2f} MiB" if s.nbytes else ""
            lines.append(f"{s.start * 1e3:11.3f} {s.end * 1e3:10.3f}  {s.stream:<16} {s.label}{size}")
        if limit is not None and len(spans) > limit:
            lines.append(f"... {len(spans) - limit} more spans (result.timeline() prints them all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.timeline(limit=60)

    def plot(self, path: str | None = None, ax=None, title: str | None = None):
        """A Gantt chart of the timeline, one row per stream (needs matplotlib). Saves to
        ``path`` if given; returns the figure."""
        from fsdpfn.sim._plot import plot

        return plot(self, path, ax, title)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _mesh_groups(plan: Plan | PipelinedPlan, rank: int) -> dict[str, list[int]]:
    """``{role: global ranks}`` of ``rank``'s group along each mesh axis (ranks laid out
    row-major over the mesh's dims, as ``init_device_mesh`` lays them out)."""
    shape = plan.mesh_shape
    coords, rest = [], rank
    for size in reversed(shape):
        rest, c = divmod(rest, size)
        coords.append(c)
    coords.reverse()
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    base = sum(c * st for c, st in zip(coords, strides))
    groups = {}
    for role in Role:
        d = plan.axes.dim(role)
        groups[role.value] = [rank] if d is None else [base + (q - coords[d]) * strides[d] for q in range(shape[d])]
    # A dense unit's rows: the data-parallel axes no parameter is split over, flattened (the
    # shard axis alone, or it with ep or cp beside it), the rule the op list names them by.
    dense = {rank}
    for role in rows_over((), plan.axes):
        dense = {r - rank + q for r in dense for q in groups[role.value]}
    if len(rows_over((), plan.axes)) > 1:
        groups["dense"] = sorted(dense)
    return groups


class _Builder:
    """Walks the schedule (see [Note: from schedule ops to tasks])."""

    def __init__(self, plan: Plan, wl: Workload, hw: Hardware, rank: int):
        self.plan, self.wl, self.hw = plan, wl, hw
        self.units = {u.name: u for u in plan.units}
        self.rank = rank
        self.groups = _mesh_groups(plan, rank)
        self.level = {g: ("inter" if hw.spans_nodes(ranks) else "intra") for g, ranks in self.groups.items()}
        total = sum(u.local_numel for u in plan.units) or 1
        self.host_fraction = sum(u.local_numel for u in plan.units if u.offload) / total
        self.handlers = bind_handlers(self, FSDP_ACTIONS)  # see [Note: one interpreter protocol]
        self.reset_step()

    def reset_step(self) -> None:
        """Starts a step: no tasks, nothing held, nothing in flight."""
        self.tasks: list[Task] = []
        self.op, self.micro_batch = -1, 0  # what the tasks made now belong to
        self.last_compute: int | None = None
        self.gathers: dict[str, int] = {}
        self.reduces: dict[str, int] = {}
        self.copies: dict[str, int] = {}  # offloaded unit -> its copy_in task, which its gather waits for
        self.copied = {"copy_in": 0, "copy_out": 0}
        self.calls: list[Collective] = []
        self.level_bytes = {"intra": 0.0, "inter": 0.0}
        # memory, in op order
        self.live = {"unsharded": 0, "buffers": 0, "activations": 0, "grads": 0}
        self.streamed, self.streamed_bytes = False, (0, 0)
        self.peak = {"total": 0, "activations": 0}
        self.held: dict[tuple[str, str], int] = {}

    # ---- tasks -------------------------------------------------------------------------

    def compute(self, work: Work, kind: str, unit: str, after: int | None = None) -> int | None:
        if not work and after is None:
            return None
        deps = (after,) if after is not None else ()
        self.tasks.append(
            Task("compute", "compute", work.seconds(self.hw), deps, kind, unit, 0.0, self.op, self.micro_batch)
        )
        self.last_compute = len(self.tasks) - 1
        return self.last_compute

    def collective(
        self, c: Collective, stream: str, sent: float | None = None, after: int | None = None, key: str | None = None
    ) -> int:
        """Times one listed collective on ``stream``, after the compute before it (and ``after``),
        over ``rank``'s group ``key`` (default: the collective's role's)."""
        if key is None:
            key = c.role.value
            unit = self.units.get(c.unit)
            rows = unit_row_roles(unit, self.plan.axes) if key == "shard" and unit is not None else ()
            if len(rows) > 1 and rows != rows_over((), self.plan.axes):  # expert units beside cp: shard x cp
                key = self._optimizer_group("+".join(r.value for r in rows))
            elif key == "shard" and "dense" in self.groups and c.group_size == len(self.groups["dense"]):
                key = "dense"
        ranks = self.groups[key]
        level = self.level[key]
        seconds = self.hw.collective_seconds(c.kind, ranks, c.nbytes, sent)
        self.calls.append(c)
        self.level_bytes[level] += c.wire_bytes
        deps = ((self.last_compute,) if self.last_compute is not None else ()) + ((after,) if after is not None else ())
        self.tasks.append(Task(stream, level, seconds, deps, c.kind, c.tag, c.nbytes, self.op, self.micro_batch))
        return len(self.tasks) - 1

    def _optimizer_group(self, group: str) -> str:
        """The ranks of an optimizer collective's group (one role, several joined by ``"+"``:
        Muon's work group over the shard and tp axes, or ``"dense"``), made once."""
        if group not in self.groups:
            ranks = {self.rank}
            for role in group.split("+"):
                ranks = {r - self.rank + q for r in ranks for q in self.groups[role]}
            self.groups[group] = sorted(ranks)
            self.level[group] = "inter" if self.hw.spans_nodes(self.groups[group]) else "intra"
        return group

    def copy(self, kind: str, name: str, nbytes: int) -> int:
        """A host-device copy of an offloaded unit on its own stream (a copy engine each way)."""
        deps = (self.last_compute,) if self.last_compute is not None else ()
        stream = "h2d" if kind in ("copy_in", "stream_in") else "d2h"
        self.tasks.append(
            Task(
                stream, "host", self.hw.copy_seconds(nbytes), deps, kind, name, float(nbytes), self.op, self.micro_batch
            )
        )
        self.copied[kind] = self.copied.get(kind, 0) + nbytes
        return len(self.tasks) - 1

    def blocking(self, c: Collective, stream: str) -> None:
        """A collective the host waits for at once."""
        self.compute(EMPTY, "wait", c.tag, after=self.collective(c, stream))

    @staticmethod
    def listed(s: StepOp, purpose: str) -> list[Collective]:
        return [c for c in s.collectives if c.purpose == purpose]

    # ---- memory ------------------------------------------------------------------------

    def hold(self, what: str, unit: str, nbytes: int) -> None:
        key = (what, unit)
        self.held[key] = self.held.get(key, 0) + nbytes
        self.live[what] += nbytes
        self.peak["activations"] = max(self.peak["activations"], self.live["activations"])
        self.peak["total"] = max(self.peak["total"], sum(self.live.values()))

    def momentary(self, nbytes: int) -> None:
        """Bytes live only while the current work runs (its transient memory) on top of what is held."""
        self.peak["total"] = max(self.peak["total"], sum(self.live.values()) + nbytes)

    def drop(self, what: str, unit: str) -> None:
        self.live[what] -= self.held.pop((what, unit), 0)

    # ---- ops ---------------------------------------------------------------------------

    def _gather(self, s: StepOp) -> None:
        name = s.op.unit
        unit, plan = self.units[name], self.plan
        w = plan.shard_size
        for c in self.listed(s, "amax"):  # the per-tensor FP8 scales need the whole tensor's amax first
            self.blocking(c, "all_gather")
        copied = self.copies.pop(name, None)
        for c in self.listed(s, "gather"):
            segment = c.nbytes // w
            self.compute(Work(bytes=2 * segment, ops=2 * len(unit.params)), "copy", name, after=copied)
            self.hold("buffers", "gather " + name, c.nbytes + segment)
            self.gathers[name] = self.collective(c, "all_gather")

    def _wait(self, s: StepOp) -> None:
        name = s.op.unit
        unit = self.units[name]
        item = self.plan.gather_dtype(unit).itemsize
        self.compute(
            Work(bytes=2 * unit.numel * item, ops=len(unit.params)), "copy", name, after=self.gathers.pop(name, None)
        )
        self.drop("buffers", "gather " + name)
        self.drop("buffers", "staged " + name)  # an offloaded unit's device copy of its shards

    def _copy_in(self, s: StepOp) -> None:
        name = s.op.unit
        nbytes = _shard_bytes(self.units[name])
        self.hold("buffers", "staged " + name, nbytes)
        self.copies[name] = self.copy("copy_in", name, nbytes)

    def _copy_out(self, s: StepOp) -> None:
        name = s.op.unit
        unit = self.units[name]
        nbytes = _shard_bytes(unit, self.plan.reduce_dtype(unit).itemsize)
        self.hold("buffers", "grad out " + name, nbytes)
        done = self.copy("copy_out", name, nbytes)
        self.compute(EMPTY, "wait", name, after=done)  # the runtime's device-to-host copy is blocking
        self.drop("buffers", "grad out " + name)

    def _free(self, s: StepOp) -> None:
        pass  # unsharded bytes: step() sets them from the op list's walk

    def unsharded(self, nbytes: int) -> None:
        """The unsharded parameters alive from this op on (:func:`fsdpfn._plan.steps.unsharded_bytes`)."""
        self.live["unsharded"] = nbytes
        self.peak["total"] = max(self.peak["total"], sum(self.live.values()))

    def _accumulate(self, s: StepOp) -> None:
        """Summed into a kept full gradient, nothing sent."""
        name = s.op.unit
        unit = self.units[name]
        self.drop("grads", name)
        self.compute(accumulate_work(self.plan, unit), "copy", name)
        if ("acc", name) not in self.held:
            self.held[("acc", name)] = 0
            self.hold("grads", "acc " + name, kept_grad_bytes(self.plan, unit))

    def _reduce(self, s: StepOp) -> None:
        name = s.op.unit
        unit, plan = self.units[name], self.plan
        r_item = plan.reduce_dtype(unit).itemsize
        w = plan.shard_size
        self.drop("grads", name)
        self.drop("grads", "acc " + name)
        self.held.pop(("acc", name), None)
        if unit.sharded:
            size = w * unit.reduce_numel * r_item
            self.compute(Work(bytes=size + 2 * unit.numel * r_item, ops=2 * len(unit.params) + 1), "copy", name)
            self.hold("buffers", "reduce " + name, 2 * size + unit.reduce_numel * r_item)
        else:
            size = unit.numel * r_item
            self.compute(Work(bytes=2 * size, ops=len(unit.params) + 1), "copy", name)
            self.hold("buffers", "reduce " + name, size)
        for c in self.listed(s, "reduce"):
            self.reduces[name] = self.collective(c, "reduce_scatter")

    def _wait_reduce(self, s: StepOp) -> None:
        name = s.op.unit
        unit, plan = self.units[name], self.plan
        r_item = plan.reduce_dtype(unit).itemsize
        n = unit.local_numel
        after = self.reduces.pop(name, None)
        for c in self.listed(s, "replicate_reduce"):  # HSDP: fsdpfn.transforms runs it inside the reduce's finish
            if after is not None:
                self.compute(EMPTY, "wait", name, after=after)
            after = self.collective(c, "all_reduce")
        master = unit.params[0].dtype.itemsize if unit.params else 4
        self.compute(Work(bytes=n * (r_item + 2 * master), ops=2 * len(unit.params)), "copy", name, after=after)
        self.drop("buffers", "reduce " + name)

    def event(self, op: Op) -> None:
        kind, unit = op.kind, op.unit
        if kind is OpKind.FORWARD:
            self.hold("activations", unit, self.wl.activation(unit))
        elif kind is OpKind.BACKWARD and unit in self.units:
            u = self.units[unit]
            self.hold("grads", unit, u.numel * self.plan.gather_dtype(u).itemsize)
        elif kind is OpKind.BACKWARD_DONE:
            self.drop("activations", unit)
        elif kind is OpKind.END:
            self.drop("activations", ROOT)

    def work(self, s: StepOp) -> None:
        """The work after event ``s`` (and the actions following it): its compute, in the op's
        phase, then the activation collectives issued while it computes (``with_compute``),
        each on its axis's stream: blocking (they sit between its matmuls), unless its
        ``overlap`` says it is a hop the attention's blocks run beside (:meth:`ring`)."""
        self.op, self.micro_batch = s.index, s.micro_batch
        # After a unit's *_done event (and 'end') the root's own code runs.
        owner = s.op.unit if s.op.kind in (OpKind.FORWARD, OpKind.BACKWARD) else ROOT
        hops = [c for c in s.with_compute if c.overlap]
        if hops:
            self.ring(self.wl.at(s.op), hops, s.phase, owner)
        else:
            self.compute(self.wl.at(s.op), s.phase, owner)
        self.momentary(self.wl.transient_at(s.op))
        for c in s.with_compute:
            if not c.overlap:
                self.blocking(c, c.role.value)

    def ring(self, work: Work, hops: list[Collective], phase: str, owner: str) -> None:
        """A unit's work whose attention passes key/value blocks around the cp ring: the rest of
        its work first, then the attention in one equal block per key/value block (hops with
        ``overlap="blocks"``, + 1), block ``k + 1`` after the ``k``-th of them; the hops (and,
        in backward, the dK/dV accumulator's, ``overlap="beside"``, between them) run back to
        back on their axis's stream from the start of the attention, each one's block already received (double
        buffering, as ring attention kernels overlap them), so a hop shorter than a block is
        hidden."""
        attention = Work(tuple(m for m in work.matmuls if m[0].startswith("attention")))
        self.compute(work.minus(attention) if attention else work, phase, owner)
        landed = [self.collective(c, c.role.value) for c in hops]
        kv = [t for t, c in zip(landed, hops) if c.overlap == "blocks"] or landed
        piece = attention.unmeasured().seconds(self.hw) / (len(kv) + 1)
        for k in range(len(kv) + 1):
            deps = (kv[k - 1],) if k else ()
            self.tasks.append(Task("compute", "compute", piece, deps, phase, owner, 0.0, self.op, self.micro_batch))
            self.last_compute = len(self.tasks) - 1

    def step(self, ops: tuple[StepOp, ...]) -> None:
        """Walks the step's ops (every micro-batch's), each with the collectives it issues, in
        the op list's order: an event's own collectives (an expert layer's token exchange) when
        it is reached, before the actions after it (the experts' gather), as the runtime issues them."""
        pending: StepOp | None = None
        for s, unsharded in zip(ops, unsharded_bytes(self.plan, ops)):
            if pending is not None and (s.op.is_event or s.micro_batch != pending.micro_batch):
                self.work(pending)
                pending = None
            self.op, self.micro_batch = s.index, s.micro_batch
            self.unsharded(unsharded)
            if s.op.is_event:
                self.event(s.op)
                for c in s.collectives:
                    self.blocking(c, c.role.value)
                pending = s
            else:
                self.run(s)
        if pending is not None:
            self.work(pending)
        self.micro_batch += 1

    def run(self, s: StepOp) -> None:
        """Prices one action op (its collectives as tasks on their streams, its memory)."""
        self.handlers[s.op.kind](s)

    def optimizer(self, cost) -> None:
        self.op = -1
        launched: dict[str, int] = {}
        axes = self.plan.axes
        for phase in cost.phases:
            if isinstance(phase, CommCost):
                key = self._optimizer_group(phase.group)
                role = Role.SHARD if key == "dense" else Role(key.split("+")[0])
                names = (
                    [axes.names[cast(int, axes.dim(Role(r)))] for r in key.split("+") if axes.dim(Role(r)) is not None]
                    if key != "dense"
                    else []
                )
                listed = Collective(
                    phase.kind,
                    ROOT,
                    phase.tag,
                    role,
                    "+".join(names) or None,
                    len(self.groups[key]),
                    phase.nbytes,
                    phase.dtype,
                    "optimizer",
                    phase.tag or "optimizer",
                )
                c = self.collective(listed, "optimizer", sent=phase.sent, key=key)
                if phase.tag:
                    launched[phase.tag] = c
                else:
                    self.compute(EMPTY, "wait", "", after=c)
            elif isinstance(phase, Wait):
                if phase.tag not in launched:
                    raise ValueError(f"optimizer phase waits for {phase.tag!r}, which was not launched before it")
                self.compute(EMPTY, "wait", phase.tag, after=launched.pop(phase.tag))
            elif self.host_fraction and self.streamed:  # offloaded units' step streamed through the device
                nbytes = self.streamed_bytes
                copied_in = self.copy("stream_in", "", nbytes[0])
                self.compute(phase, "optimizer", "", after=copied_in)
                self.compute(EMPTY, "wait", "", after=self.copy("stream_out", "", nbytes[1]))
            elif self.host_fraction:  # offloaded units step on the host, at its memory bandwidth
                host = dataclasses.replace(
                    self.hw, memory_bandwidth=self.hw.host_memory_bandwidth or self.hw.memory_bandwidth, kernels=None
                )
                seconds = (1 - self.host_fraction) * phase.seconds(self.hw) + self.host_fraction * phase.seconds(host)
                self.tasks.append(
                    Task("compute", "compute", seconds, (), "optimizer", "", 0.0, self.op, self.micro_batch)
                )
                self.last_compute = len(self.tasks) - 1
            else:
                self.compute(phase, "optimizer", "")
        if launched:
            raise ValueError(f"optimizer phases launch {sorted(launched)} and never wait for them")


def simulate(
    plan: Plan,
    schedule: Schedule | None = None,
    workload: Workload | None = None,
    optimizer: Any = None,
    hardware: Hardware | None = None,
    *,
    micro_batches: int = 1,
    accumulate: str = "reduce",
    rank: int = 0,
    exact: bool = False,
) -> SimResult:
    """Predicts one training step of ``plan`` run by ``schedule`` (see [Note: from schedule ops
    to tasks]).

    Args:
      plan: the plan (bound to a mesh or abstract, e.g. ``fsdpfn.plan(model, (16, 64))``).
      schedule: a schedule for it (default ``fsdpfn.runtime.schedule(plan)``); validated.
      workload: one micro-batch's compute per rank (:func:`fsdpfn.sim.profile`).
      optimizer: :class:`fsdpfn.sim.AdamW`, :class:`fsdpfn.sim.Muon`, or ``None`` (no step).
      hardware: a :class:`fsdpfn.sim.Hardware` (a preset or :func:`fsdpfn.sim.measure`'s).
      micro_batches: micro-batches per step, each running the whole schedule.
      accumulate: as the runtime's: ``"reduce"`` (every micro-batch reduces) or ``"local"``
        (only the last one does).
      rank: the rank whose bytes and memory are reported (timing takes the busiest rank's
        optimizer work).
      exact: simulate every micro-batch. By default a step of more than 3 micro-batches is
        simulated with 2 and with 3, and times and bytes are extended linearly from their
        difference (micro-batches repeat the same ops, so every one after the first costs the
        same); the spans then show 3 micro-batches (``notes`` says so).

    Returns:
      a :class:`SimResult`: ``print(result)`` shows the summary and the timeline,
      ``result.plot("step.png")`` draws it.

    Example:
      >>> wl = fsdpfn.sim.profile(model, plan, x)
      >>> r = fsdpfn.sim.simulate(plan, runtime.schedule(plan, prefetch=1), wl, fsdpfn.sim.AdamW(), fsdpfn.sim.H100_SXM)
      >>> r.step_time > 0, r.exposed_comm <= r.step_time
      (True, True)
    """
    if workload is None or hardware is None:
        raise ValueError(
            "simulate needs a workload (fsdpfn.sim.profile(model, plan, batch)) and a hardware (a preset or fsdpfn.sim.measure())"
        )
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    sched = default_schedule(plan) if schedule is None else schedule
    validate(sched, plan)
    if micro_batches > 3 and not exact:
        return _extrapolated(plan, sched, workload, optimizer, hardware, micro_batches, accumulate, rank)
    ops = step_ops(
        plan,
        sched,
        micro_batches=micro_batches,
        accumulate=accumulate,
        tokens=workload.tokens,
        attention=workload.attention,
    )
    listed = sum(len(s.collectives) + len(s.with_compute) for s in ops)
    b = _Builder(plan, workload, hardware, rank)
    b.step(ops)
    opt_cost = optimizer.cost(plan, rank) if optimizer is not None else None
    b.streamed = bool(getattr(optimizer, "streamed", False))
    if b.streamed and opt_cost is not None:  # in: params, grads, state; out: state, updates (offloaded units)
        shards = sum(_shard_bytes(u) for u in plan.units if u.offload)
        state = int(round(opt_cost.state_bytes * b.host_fraction))
        b.streamed_bytes = (2 * shards + state, shards + state)
    first_opt = len(b.tasks)
    if opt_cost is not None:
        b.optimizer(opt_cost)
    end = run(b.tasks, hardware.overlap)
    schedule_end = max((t.end for t in b.tasks[:first_opt]), default=0.0)
    spans = tuple(
        Span(t.stream, t.start, t.end, t.kind, t.unit, t.nbytes, t.op, t.micro_batch)
        for t in b.tasks
        if t.end > t.start
    )
    busy = _union([(s.start, s.end) for s in spans if s.stream == "compute"])
    in_flight = _union([(s.start, s.end) for s in spans if s.stream != "compute"])
    static = _static_memory(plan, opt_cost)
    if len(b.calls) - sum(c.phase == "optimizer" for c in b.calls) != listed:
        raise AssertionError(f"the simulator timed {len(b.calls)} of the step's {listed} listed collectives")
    peak = sum(v for k, v in static.items() if k != "host") + b.peak["total"]
    memory = {
        **static,
        "unsharded_peak": unsharded_peak(plan, ops),
        "activations_peak": b.peak["activations"],
        "peak": peak,
        "reserved": int(peak * (1.0 + hardware.memory_reserve)),
    }
    notes = [n for n in (over_memory(memory["reserved"], hardware),) if n]
    if plan.hsdp:
        notes.append(
            "HSDP: the replicate-axis all-reduce runs blocking inside wait_reduce (as fsdpfn.transforms issues it)"
        )
    exchanged = sorted({c.role.value for c in b.calls if c.activation})
    if exchanged:
        notes.append(
            f"activation exchanges over {', '.join(exchanged)}: sized by "
            + (
                f"{workload.tokens:,} tokens per micro-batch"
                if workload.tokens
                else "0 tokens (the workload has none: profile it with integer token inputs)"
            )
            + f" and {len(workload.attention)} profiled attention calls; each blocks after its unit's compute, "
            "but ring hops, which overlap the attention's blocks. Compute is the workload's as profiled "
            "(fsdpfn.sim.profile runs each rank's local layers)"
        )
    traffic = {
        "step": _traffic(c for c in b.calls if c.phase != "optimizer"),
        "optimizer": _traffic(c for c in b.calls if c.phase == "optimizer"),
    }
    return SimResult(
        end,
        end - schedule_end,
        busy,
        max(0.0, end - busy),
        traffic,
        dict(b.level_bytes),
        memory,
        spans,
        in_flight,
        plan,
        sched,
        hardware,
        tuple(notes),
        tuple(b.calls),
        dict(b.copied),
    )


def _extrapolated(plan, sched, workload, optimizer, hardware, micro_batches, accumulate, rank) -> SimResult:
    """A step of ``micro_batches`` from steps of 2 and 3 (see ``simulate(exact=...)``)."""
    r2, r3 = (
        simulate(
            plan, sched, workload, optimizer, hardware, micro_batches=k, accumulate=accumulate, rank=rank, exact=True
        )
        for k in (2, 3)
    )
    k = micro_batches - 3

    def ext(a: float, b: float) -> float:
        return b + k * (b - a)

    # Bytes need no extension: the whole step's list is at hand.
    step = step_collectives(
        plan,
        schedule=sched,
        micro_batches=micro_batches,
        accumulate=accumulate,
        tokens=workload.tokens,
        attention=workload.attention,
    )
    opt = tuple(c for c in r3.calls if c.phase == "optimizer")
    traffic = {"step": _traffic(step), "optimizer": r3.traffic["optimizer"]}
    calls = step + opt
    return dataclasses.replace(
        r3,
        step_time=ext(r2.step_time, r3.step_time),
        compute_time=ext(r2.compute_time, r3.compute_time),
        comm_time=ext(r2.comm_time, r3.comm_time),
        exposed_comm=ext(r2.exposed_comm, r3.exposed_comm),
        traffic=traffic,
        calls=calls,
        level_bytes={lv: ext(r2.level_bytes[lv], v) for lv, v in r3.level_bytes.items()},
        host_copies={k: ext(r2.host_copies[k], v) for k, v in r3.host_copies.items()},
        notes=r3.notes
        + (
            f"{micro_batches} micro-batches: times and bytes extended from simulations of 2 and 3 "
            "(each further micro-batch repeats the same ops); the spans show 3",
        ),
    )


def _traffic(calls) -> dict[str, Traffic]:
    """``{kind: Traffic}`` of ``calls``, kinds sorted."""
    return {k: Traffic(t.calls, t.nbytes, t.wire_bytes) for k, t in sorted(totals(calls).items())}


def _shard_bytes(unit, itemsize: int | None = None) -> int:
    """Bytes of one rank's shards of ``unit`` (the largest rank's), in its master dtype or ``itemsize``."""
    item = itemsize or (unit.params[0].dtype.itemsize if unit.params else 4)
    return unit.local_numel * item


def over_memory(reserved: int, hardware: Hardware, where: str = "") -> str | None:
    """The note a prediction carries when its reserved bytes exceed the part's memory: the step
    does not fit as planned, and near the limit the caching allocator frees its cache and retries
    allocations (``num_alloc_retries`` in ``torch.cuda.memory_stats()``), time the prediction does
    not include. ``None`` when it fits."""
    if reserved <= hardware.memory:
        return None
    gib = 2**30
    return (
        f"memory{where}: {reserved / gib:,.1f} GiB reserved is above the {hardware.memory / gib:,.1f} GiB of {hardware.name}: "
        "the step does not fit as planned (at the limit the caching allocator frees and retries, which this time leaves out)"
    )


def _static_memory(plan: Plan, opt_cost) -> dict[str, int]:
    """Bytes held on the device between steps: sharded masters and gradients
    (:func:`fsdpfn._plan.steps.static_memory`, as ``plan.cost()`` counts them) and the optimizer's
    state, less what offloaded units keep in host memory (``host``)."""
    m = static_memory(plan)
    state = opt_cost.state_bytes if opt_cost is not None else 0
    offloaded = [u for u in plan.units if u.offload]
    if not offloaded:
        return {"params": m["params"], "grads": m["grads"], "optimizer_state": state}
    off = static_memory(types.SimpleNamespace(units=tuple(offloaded)))  # type: ignore[arg-type]  # it reads the units alone
    frac = off["params"] / m["params"] if m["params"] else 0.0
    host_state = int(round(state * frac))
    return {
        "params": m["params"] - off["params"],
        "grads": m["grads"] - off["grads"],
        "optimizer_state": state - host_state,
        "host": off["params"] + off["grads"] + host_state,
    }
