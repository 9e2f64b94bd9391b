"""The executor: binds a plan and a schedule to a model and runs one step op by op, as the
model reaches the schedule's events through the Functions of :mod:`fsdpfn.runtime._autograd`
(see [Note: one autograd node per unit] there).

[Note: offload]
An offloaded unit (``Unit.offload``) keeps its sharded parameters, their gradients and hence
the optimizer state built on them in host memory: the shards you pass live there (on CUDA,
:func:`fsdpfn.shard` pins them). ``copy_in u`` copies the shards to the compute device right
before ``gather u`` (so the schedule's prefetch carries the copy too), the gather consumes the
copy and ``wait u`` drops it; ``copy_out u`` copies the reduced gradient shards to host memory
after ``wait_reduce u`` and drops the device ones. Between steps the unit holds nothing on the
device; the optimizer steps where the state lives. The arithmetic is that of the unit without
offload (copies are exact), so results are bitwise equal. On a CPU-only machine the device is
the CPU and the copies go between two host buffers, so the same path runs and is tested.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from fsdpfn._plan import ROOT, Plan, Unit, unit_label
from fsdpfn._plan.interpret import FSDP_ACTIONS, bind_handlers
from fsdpfn._plan.steps import micro_batch_ops
from fsdpfn.runtime._comm import CpuComm, Handle
from fsdpfn.runtime._memory import MemoryTracker
from fsdpfn._plan.schedule import Op, OpKind, Schedule
from fsdpfn.transforms import from_local, gather_unit, reduce_unit

__all__ = ["Executor", "RuntimeScheduleError", "StepRecord", "StepState"]


class RuntimeScheduleError(RuntimeError):
    """The model did not follow the schedule (units ran in another order, a backward did not
    run, a stale graph was differentiated)."""


@dataclasses.dataclass
class StepRecord:
    """What the last step did, for tests and benchmarks.

    Attributes:
      events: ``(op index, event)`` in the order the model reached them.
      in_flight: for each ``forward``/``backward`` event, the gathers and reduces in flight when
        the unit started computing: the overlap the schedule achieved, counted not timed.
      recomputed: units whose forward was recomputed in backward (a ``remat`` policy), in order.
      recompute_flops: ``{unit: FLOPs}`` of the matmul-like operators each recompute ran
        (those a selective policy kept are not run again), counted as ``fsdpfn.sim`` counts them.
      copies: ``(kind, unit, bytes)`` of each ``copy_in``/``copy_out`` (offloaded units).
      kept_bytes: ``{unit: bytes}`` a rematerialised unit holds from its forward to its
        backward: its inputs and the results its policy keeps (distinct storages).
    """

    events: list = dataclasses.field(default_factory=list)
    in_flight: list = dataclasses.field(default_factory=list)
    recomputed: list = dataclasses.field(default_factory=list)
    recompute_flops: dict = dataclasses.field(default_factory=dict)
    kept_bytes: dict = dataclasses.field(default_factory=dict)
    copies: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepState:
    """What the executor holds for the step (one micro-batch's op list) in progress, as one
    value: a fresh one each :meth:`Executor.begin`, so nothing of one step reaches the next.
    The gradients kept across micro-batches (``full_grads``, ``local_acc``) and the buffers in
    flight (gathers, reduces) are the executor's own: they outlive a micro-batch by design."""

    number: int  # the step's number, which a stale graph's backward is checked against
    ops: tuple  # its op list (the micro-batch's: Executor.micro_batch_ops)
    cursor: int = 0  # the next op
    results: dict = dataclasses.field(default_factory=dict)  # unit -> its reduced gradient shards
    record: StepRecord = dataclasses.field(default_factory=StepRecord)

    @property
    def over(self) -> bool:
        """Every op has run (or the step was abandoned)."""
        return self.cursor >= len(self.ops)


def _check_no_remat_around_units(plan: Plan) -> None:
    """[Note: remat around another unit]
    The runtime recomputes a rematerialised unit's forward in that unit's backward, after the
    forward that routes the units nested in it (an expert unit inside its block) through the
    schedule has returned. The recompute would call the nested unit plainly, on parameters this
    rank does not hold (an ep rank's experts are a slice), and its gather is not in the
    backward's op list at that point. So a plan that rematerialises a unit holding another one is
    refused when a runtime is built, on every rank alike, before any collective; the pure loop
    (``fsdpfn.unshard`` under ``fsdpfn.transforms.apply_remat``) recomputes such a block whole."""
    names = [u.name for u in plan.units]
    for unit in plan.units:
        if unit.name == ROOT or unit.remat == "none":
            continue
        inner = [n for n in names if n.startswith(unit.name + ".")]
        if inner:
            raise ValueError(
                f"unit {unit_label(unit.name)!r} has remat={unit.remat!r} and holds unit {unit_label(inner[0])!r}: the "
                "runtime recomputes a unit's forward outside the forward that runs its nested units through the "
                f"schedule, so it cannot rematerialise {unit_label(unit.name)!r}. Leave it out of remat= (e.g. "
                f"remat={{'other.*': {unit.remat!r}}}), or train this plan with the pure loop (fsdpfn.unshard), "
                "which recomputes the block whole"
            )


class Executor:
    """Runs a :class:`Schedule`'s ops as the model reaches its events. One per runtime.

    Each micro-batch runs its op list (:func:`fsdpfn._plan.steps.micro_batch_ops`): the one
    that ends the step ``sched.ops``, the others their ``accumulate`` ops where gradients are
    summed locally. Whether a unit reduces is whether its ``reduce`` op is there; the executor
    asks no rule of its own, so a hand-edited list is obeyed as written.
    """

    def __init__(self, plan: Plan, sched: Schedule, comm=None, accumulate: str = "reduce"):
        _check_no_remat_around_units(plan)
        self.plan = plan
        self.sched = sched
        self.micro_batch_ops = {last: micro_batch_ops(plan, sched, last, accumulate) for last in (True, False)}
        self.comm = comm or CpuComm()
        self.accumulate = accumulate
        self.units: dict[str, Unit] = {u.name: u for u in plan.units}
        self.memory = MemoryTracker()
        self.full: dict[str, list[torch.Tensor]] = {}
        self.locals: dict[str, list[torch.Tensor]] = {}
        self.gathers: dict[str, Handle] = {}
        self.reduces: dict[str, Handle] = {}
        self.full_grads: dict[str, list] = {}
        self.local_acc: dict[str, list] = {}
        self.staged: dict[str, list[torch.Tensor]] = {}  # offloaded units' shards copied to the device
        ops = self.micro_batch_ops[True]
        self.now = StepState(0, ops, cursor=len(ops))  # no step open yet
        self.inside: str | None = None  # the unit whose own code runs now (it calls its modules plainly)
        self.handlers = bind_handlers(self, FSDP_ACTIONS)  # see [Note: one interpreter protocol]

    # ---- step lifecycle ------------------------------------------------------------------

    def begin(self, *, sync: bool) -> int:
        """Starts a step (abandoning one still open) and returns its number."""
        if not self.now.over:
            self.abandon()
        # sync: the micro-batch that ends the step, every unit reduces
        self.now = StepState(self.now.number + 1, self.micro_batch_ops[sync])
        return self.now.number

    @property
    def record(self) -> StepRecord:
        """What the step in progress (or the last one) did: see :class:`StepRecord`."""
        return self.now.record

    def set_locals(self, shards) -> None:
        """This step's local shards, in plan order (plain DTensors: called below functorch)."""
        it = iter(shards)
        self.locals = {
            u.name: [s._local_tensor if isinstance(s, DTensor) else s for s in (next(it) for _ in u.params)]
            for u in self.plan.units
        }

    def abandon(self) -> None:
        """Ends a step whose backward never ran (evaluation, a loss not differentiated)."""
        with torch._C._DisableFuncTorch():
            for handle in (*self.gathers.values(), *self.reduces.values()):
                self.comm.wait(handle)  # its buffers are about to be freed or reused
            self.gathers.clear()
            self.reduces.clear()
            for name in list(self.memory.live):
                self._free(Op(OpKind.FREE, name))
            self.staged.clear()
            self.memory.offloaded.clear()
            self.full_grads.clear()
            self.now.cursor = len(self.now.ops)

    def reset_grads(self) -> None:
        """Drops every gradient this runtime holds for the step: the micro-batch's full ones,
        those kept summed across micro-batches, and the reduced ones (an evaluation step)."""
        self.now.results, self.full_grads, self.local_acc = {}, {}, {}

    def reset_step(self) -> None:
        """Starts a step whose ops are given one by one (:meth:`run`, as the pipeline runtime
        gives a stage's): whatever a step left in flight is waited for and dropped, with every
        gradient held (see [Note: one interpreter protocol] in ``fsdpfn/_plan/interpret.py``)."""
        self.abandon()
        self.reset_grads()

    def run(self, op: Op) -> None:
        """Runs one action op of the schedule's vocabulary (``gather``, ``wait``, ``free``,
        ``reduce``, ``wait_reduce``, ``copy_in``, ``copy_out``, ``accumulate``) now. :meth:`event`
        runs a schedule's actions this way as the model reaches its events; the pipeline runtime
        runs its ranks' op lists through it."""
        if op.is_event:
            raise RuntimeScheduleError(f"run() takes action ops; '{op}' is an event the model reaches (event())")
        with torch._C._DisableFuncTorch(), torch.no_grad():
            self.handlers[op.kind](op)

    def set_grads(self, name: str, grads: list) -> None:
        """Unit ``name``'s full gradients of this micro-batch (its backward's), which the next
        ``accumulate`` or ``reduce`` op of the unit takes."""
        self.full_grads[name] = grads

    def add_grads(self, name: str, grads: list) -> None:
        """As :meth:`set_grads`, but gradients of an earlier micro-batch still waiting are first
        summed into the unit's kept sum (an ``accumulate`` op run now): a pipeline's stage takes
        every micro-batch's before its one reduce."""
        if name in self.full_grads:
            self.run(Op(OpKind.ACCUMULATE, name))
        self.set_grads(name, grads)

    def check_step(self, step: int, what: str) -> None:
        """Raises unless ``step`` is the step in progress (a stale graph is differentiated)."""
        if step != self.now.number or self.now.over:
            raise RuntimeScheduleError(
                f"{what} belongs to step {step}, but the runtime is at step {self.now.number}"
                f"{' (finished)' if self.now.over else ''}: differentiate each step's loss "
                "once, before the next forward (no retain_graph=True double backward through the runtime)"
            )

    # ---- events --------------------------------------------------------------------------

    def event(self, kind: OpKind, unit: str = ROOT) -> None:
        """The model reached event ``kind`` of ``unit``: check it is the schedule's next op, then
        run the actions up to the following event."""
        if unit == ROOT and kind is not OpKind.END and ROOT not in self.units:
            return  # the root owns no parameters: the plan has no root unit, its schedule no root events
        now = self.now
        ops = now.ops
        got = Op(kind, unit)
        if now.over or ops[now.cursor] != got:
            expected = ops[now.cursor] if not now.over else "nothing (the step is over)"
            skipped = isinstance(expected, Op) and expected.kind in (OpKind.BACKWARD, OpKind.BACKWARD_DONE)
            if kind in (OpKind.BACKWARD, OpKind.END) and skipped:
                why = (
                    f"The backward of unit {unit_label(cast(Op, expected).unit)!r} did not run: its output does not reach the "
                    "loss (or was detached). Every unit the forward ran must take part in the backward; "
                    "its gradients would otherwise be silently missing."
                )
            else:
                why = (
                    "Units ran in another order than the schedule's: build the plan with units in execution "
                    "order, or edit the schedule to match the model."
                )
            raise RuntimeScheduleError(
                f"the model reached '{got}' but the schedule expects '{expected}' (op #{now.cursor}). {why}"
            )
        now.record.events.append((now.cursor, str(got)))
        now.cursor += 1
        # Below functorch: buffers allocated here must be plain tensors whose storage we own.
        with torch._C._DisableFuncTorch(), torch.no_grad():
            while not now.over and not ops[now.cursor].is_event:
                op = ops[now.cursor]
                self.handlers[op.kind](op)
                now.cursor += 1
        if kind in (OpKind.FORWARD, OpKind.BACKWARD):
            now.record.in_flight.append((str(got), tuple(self.gathers), tuple(self.reduces)))
        if kind is OpKind.END and (self.memory.live or self.gathers or self.reduces):
            labels = [list(map(unit_label, d)) for d in (self.memory.live, self.gathers, self.reduces)]
            raise RuntimeScheduleError(
                f"after 'end', units {labels[0]} are still unsharded and {labels[1]} / "
                f"{labels[2]} still in flight; the schedule must free and wait for everything"
            )

    def forward_only_done(self) -> None:
        """The root's forward returned without autograd recording: finish the step now."""
        self.abandon()

    # ---- actions (see [Note: schedule ops and events]) ------------------------------------

    def _gather(self, op: Op) -> None:
        name = op.unit
        unit = self.units[name]
        dtype = self.plan.gather_dtype(unit)
        locals_ = self.staged[name] if unit.offload else self.locals[name]
        # Every buffer lives on the device of the tensors it serves: here, the unit's shards.
        device = locals_[0].device if locals_ else torch.device("cpu")
        full = self.full.get(name)
        if full is None or (full and full[0].device != device):
            self.full[name] = [torch.empty(p.local_shape, dtype=dtype, device=device) for p in unit.params]
        else:
            for t in full:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        self.memory.allocate(name, sum(t.numel() * t.element_size() for t in self.full[name]))
        start = functools.partial(gather_unit, self.plan, unit, locals_, async_op=True)
        self.gathers[name] = self.comm.start("all_gather", start)

    def _wait(self, op: Op) -> None:
        name = op.unit
        handle = self.gathers.pop(name)
        gathered = self.comm.wait(handle)
        full = self.full[name]
        # Refill the storage autograd saved in forward without bumping its version (as FSDP2).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(full)):
            handle.finish(gathered, out=full)
        _release_wire(gathered, full)
        if self.units[name].offload:  # the gather consumed the device copy of the shards
            del self.staged[name]
            self.memory.offloaded.pop(name, None)

    def _copy_in(self, op: Op) -> None:
        name = op.unit
        host = self.locals[name]
        device = self.comm.compute_device()
        for t in host:
            if t.device.type != "cpu":
                raise RuntimeScheduleError(
                    f"unit {unit_label(name)!r} is offloaded but its shards are on {t.device}; pass shards in "
                    "host memory (fsdpfn.shard places an offloaded unit's shards there)"
                )
        # non_blocking from pinned memory: the copy overlaps, ordered before the gather on the device.
        self.staged[name] = [
            torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t, non_blocking=True) for t in host
        ]
        nbytes = sum(t.numel() * t.element_size() for t in host)
        self.memory.offloaded[name] = nbytes
        self.now.record.copies.append(("copy_in", name, nbytes))

    def _free(self, op: Op) -> None:
        name = op.unit
        for t in self.full.get(name, ()):
            t.untyped_storage().resize_(0)
        self.memory.release(name)

    def _summed(self, name: str) -> tuple[list, bool]:
        """The unit's gradients of this micro-batch plus those it accumulated before (and
        whether there were any)."""
        grads = self.full_grads.pop(name, None)
        if grads is None:
            raise RuntimeScheduleError(
                f"unit {unit_label(name)!r} has no gradients to reduce: its backward did not run. "
                "Every unit the forward used must take part in the loss's backward."
            )
        rdtype = self.plan.reduce_dtype(self.units[name])
        acc = self.local_acc.pop(name, None)
        if acc is not None:
            grads = [a if g is None else (g.to(rdtype) if a is None else a + g) for a, g in zip(acc, grads)]
        return grads, acc is not None

    def _accumulate(self, op: Op) -> None:
        name = op.unit
        # Full gradients summed here until a micro-batch reduces them.
        grads, summed = self._summed(name)
        rdtype = self.plan.reduce_dtype(self.units[name])
        self.local_acc[name] = [None if g is None else g if summed else g.to(rdtype, copy=True) for g in grads]

    def _reduce(self, op: Op) -> None:
        name = op.unit
        unit = self.units[name]
        grads, _ = self._summed(name)
        plan = self.plan
        self.reduces[name] = self.comm.start(
            "reduce_scatter", lambda: reduce_unit(plan, unit, list(grads), async_op=True)
        )

    def _wait_reduce(self, op: Op) -> None:
        name = op.unit
        handle = self.reduces.pop(name)
        self.comm.wait(handle)
        self.now.results[name] = handle.finish()
        if self.units[name].offload:
            self.memory.offloaded[name] = sum(t.numel() * t.element_size() for t in self.now.results[name])

    def _copy_out(self, op: Op) -> None:
        name = op.unit
        grads = self.now.results.get(name)
        if grads is None:  # accumulating locally: no reduced gradients this micro-batch
            return
        pin = any(t.is_cuda for t in grads)
        # Blocking device-to-host copies: the gradients are read by the optimizer right after the step.
        self.now.results[name] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in grads]
        self.memory.offloaded.pop(name, None)
        self.now.record.copies.append(("copy_out", name, sum(t.numel() * t.element_size() for t in grads)))

    # ---- what the Functions ask for ------------------------------------------------------

    def full_params(self, name: str) -> list[torch.Tensor]:
        return self.full[name]

    def shard_grads(self) -> list[DTensor | None]:
        """Reduced gradient shards of every parameter in plan order (``None`` while
        accumulating locally)."""
        out: list[DTensor | None] = []
        for unit in self.plan.units:
            shards = self.now.results.get(unit.name)
            for i, p in enumerate(unit.params):
                out.append(None if shards is None else from_local(self.plan, p.name, shards[i]))
        return out


def _release_wire(gathered, full) -> None:
    """Frees the storage of a gather's flat receive buffer once its rows are unpacked into
    ``full``. gloo's last finished work stays referenced after its wait (see [Note: the last gloo
    work] in fsdpfn.comm), and with it this buffer, a unit's whole gathered parameters outside
    :attr:`Runtime.memory`'s accounting; emptied here, the work keeps only an empty tensor. CPU
    only: a CUDA buffer may still be read by kernels queued on the compute stream."""
    if not isinstance(gathered, torch.Tensor) or gathered.device.type != "cpu":
        return
    storage = gathered.untyped_storage()
    if storage.nbytes() and all(t.untyped_storage().data_ptr() != storage.data_ptr() for t in full):
        storage.resize_(0)
