"""The executor: binds a plan and a schedule to a model and runs one step op by op.

[Note: one autograd node per unit]
FSDP2 frees a unit's full parameters after its forward by resizing their storage to zero while
autograd still holds them as saved tensors, and refills the same storage before the unit's
backward; it finds "before the backward" and "gradients complete" with module and tensor hooks.
Hooks are where seed 002's bugs lived (hooks that silently do not fire, post-backward order
races), and inside ``torch.func`` transforms saved-tensor hooks are not available at all.

So each unit's forward is one custom ``torch.autograd.Function`` (:class:`_UnitFn`) instead.
Its forward waits for the unit's gather, then builds the unit's *own* small autograd graph with
plain tensors inside ``torch._C._DisableFuncTorch()`` (the inputs are detached, the full
parameters are fresh leaves aliasing the runtime's unsharded storage) and keeps that graph on the
call. Its backward refills the storage, runs ``torch.autograd.grad`` on the kept graph, and so
receives the unit's complete parameter gradients in one place, in order: "gradients reached u"
and "u's gradients are complete" are the start and the end of one Python function, never hooks.
Because the graph is built below functorch, the same code serves ``loss.backward()`` and
``torch.func.grad``/``grad_and_value``: reshard-after-forward works in both loop styles, with no
recompute and no saved-tensor hooks (the issue allowed per-unit recompute for the functional
style; we measured that it is not needed). The costs: the unit is opaque to higher-order
transforms (no double ``grad`` or ``vmap`` through the runtime; the pure path has them), and
the refill must not bump the version counter that saved tensors check, hence
``torch.autograd._unsafe_preserve_version_counter`` as in FSDP2.

The root unit's code wraps every other unit, so it cannot be one node. Its full parameters come
from :class:`_RootGather` (backward: the root's full gradients, complete only at the end) and the
model's outputs pass through :class:`_RootExit`, whose backward is the ``backward <root>`` event
(refill the root if it was resharded, prefetch the last unit). All parameter shards first pass
through :class:`_StepBoundary`, an identity whose backward runs after every unit's: it is the
``end`` event, where every reduce is waited for and the sharded gradients are returned to
autograd (``param.grad`` in eager, the result of ``torch.func.grad``). The unit Functions give
``None`` to their shard inputs, so each reduce-scatter runs asynchronously from its unit's end
to its ``wait_reduce`` (by default: the end of the next unit's backward), overlapping the backward
of the unit before it.

Every event checks it is the one the schedule expects next, and ``end`` checks that every unit's
backward ran: a unit whose backward did not run is an error naming it, never silent wrong
gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import optree
import torch
from torch.distributed.tensor import DTensor

from fsdpfn._plan import Plan, Unit
from fsdpfn.runtime._comm import CpuComm, Handle
from fsdpfn.runtime._memory import MemoryTracker
from fsdpfn.runtime._schedule import ROOT, Op, Schedule, _label
from fsdpfn.transforms import from_local, gather_unit, reduce_unit

__all__ = ["Executor", "RuntimeScheduleError", "StepRecord"]


class RuntimeScheduleError(RuntimeError):
    """The model did not follow the schedule (units ran in another order, a backward did not
    run, a stale graph was differentiated)."""


def _unwrap(t):
    """The plain tensor under functorch wrappers (backward receives wrapped gradients)."""
    if t is None:
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


@dataclasses.dataclass
class StepRecord:
    """What the last step did, for tests and benchmarks.

    Attributes:
      events: ``(op index, event)`` in the order the model reached them.
      in_flight: for each ``forward``/``backward`` event, the gathers and reduces in flight when
        the unit started computing: the overlap the schedule achieved, counted not timed.
    """

    events: list = dataclasses.field(default_factory=list)
    in_flight: list = dataclasses.field(default_factory=list)


class Executor:
    """Runs a :class:`Schedule`'s ops as the model reaches its events. One per runtime."""

    def __init__(self, plan: Plan, sched: Schedule, comm=None, accumulate: str = "reduce"):
        self.plan = plan
        self.sched = sched
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
        self.results: dict[str, list[torch.Tensor]] = {}
        self.cursor = len(sched.ops)
        self.step = 0
        self.sync = True
        self.grad_step = False
        self.record = StepRecord()
        self.inside: str | None = None

    # ---- step lifecycle ------------------------------------------------------------------

    def begin(self, *, sync: bool, grad: bool) -> int:
        if self.cursor < len(self.sched.ops):
            self.abandon()
        self.step += 1
        self.cursor = 0
        self.sync = sync or self.accumulate == "reduce"
        self.grad_step = grad
        self.results = {}
        self.record = StepRecord()
        return self.step

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
            self._abandon()

    def _abandon(self) -> None:
        for name, h in list(self.gathers.items()):
            self.comm.wait(h)
        for name, h in list(self.reduces.items()):
            self.comm.wait(h)
        self.gathers.clear()
        self.reduces.clear()
        for name in list(self.memory.live):
            self._free(name)
        self.full_grads.clear()
        self.cursor = len(self.sched.ops)

    def check_step(self, step: int, what: str) -> None:
        if step != self.step or self.cursor >= len(self.sched.ops):
            raise RuntimeScheduleError(
                f"{what} belongs to step {step}, but the runtime is at step {self.step}"
                f"{' (finished)' if self.cursor >= len(self.sched.ops) else ''}: differentiate each step's loss "
                "once, before the next forward (no retain_graph=True double backward through the runtime)"
            )

    # ---- events --------------------------------------------------------------------------

    def event(self, kind: str, unit: str = ROOT) -> None:
        ops = self.sched.ops
        got = Op(kind, unit)
        if self.cursor >= len(ops) or ops[self.cursor] != got:
            expected = ops[self.cursor] if self.cursor < len(ops) else "nothing (the step is over)"
            if kind in ("backward", "end") and isinstance(expected, Op) and expected.kind in ("backward", "backward_done"):
                why = (f"The backward of unit {_label(expected.unit)!r} did not run: its output does not reach the "
                       "loss (or was detached). Every unit the forward ran must take part in the backward; "
                       "its gradients would otherwise be silently missing.")
            else:
                why = ("Units ran in another order than the schedule's: build the plan with units in execution "
                       "order, or edit the schedule to match the model.")
            raise RuntimeScheduleError(f"the model reached '{got}' but the schedule expects '{expected}' (op #{self.cursor}). {why}")
        self.record.events.append((self.cursor, str(got)))
        self.cursor += 1
        # Below functorch: buffers allocated here must be plain tensors whose storage we own.
        with torch._C._DisableFuncTorch(), torch.no_grad():
            while self.cursor < len(ops) and not ops[self.cursor].is_event:
                self._run(ops[self.cursor])
                self.cursor += 1
        if kind in ("forward", "backward"):
            self.record.in_flight.append((str(got), tuple(self.gathers), tuple(self.reduces)))
        if kind == "end":
            self._finish_step()

    def _finish_step(self) -> None:
        leftover = [n for n in self.memory.live]
        if leftover or self.gathers or self.reduces:
            raise RuntimeScheduleError(f"after 'end', units {list(map(_label, leftover))} are still unsharded and "
                                       f"{list(map(_label, self.gathers))} / {list(map(_label, self.reduces))} still in flight; the schedule must free and wait for everything")

    def forward_only_done(self) -> None:
        """The root's forward returned without autograd recording: finish the step now."""
        self.abandon()

    # ---- actions -------------------------------------------------------------------------

    def _run(self, op: Op) -> None:
        getattr(self, "_" + op.kind)(op.unit)

    def _gather(self, name: str) -> None:
        unit = self.units[name]
        dtype = self.plan.gather_dtype(unit)
        locals_ = self.locals[name]
        device = locals_[0].device if locals_ else torch.device("cpu")  # the shards' device: CUDA on GPUs
        full = self.full.get(name)
        if full is None or (full and full[0].device != device):
            self.full[name] = [torch.empty(p.shape, dtype=dtype, device=device) for p in unit.params]
        else:
            for t in full:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        self.memory.allocate(name, sum(t.numel() * t.element_size() for t in self.full[name]))
        start = functools.partial(gather_unit, self.plan, unit, locals_, async_op=True)
        self.gathers[name] = self.comm.start("all_gather", start)

    def _wait(self, name: str) -> None:
        handle = self.gathers.pop(name)
        gathered = self.comm.wait(handle)
        full = self.full[name]
        # Refill the storage autograd saved in forward without bumping its version (as FSDP2).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(full)):
            handle.finish(gathered, out=full)

    def _free(self, name: str) -> None:
        for t in self.full.get(name, ()):
            t.untyped_storage().resize_(0)
        self.memory.release(name)

    def _reduce(self, name: str) -> None:
        unit = self.units[name]
        grads = self.full_grads.pop(name, None)
        if grads is None:
            raise RuntimeScheduleError(f"unit {_label(name)!r} has no gradients to reduce: its backward did not run. "
                                       "Every unit the forward used must take part in the loss's backward.")
        rdtype = self.plan.reduce_dtype(unit)
        acc = self.local_acc.pop(name, None)
        if acc is not None:
            grads = [a if g is None else (g.to(rdtype) if a is None else a + g) for a, g in zip(acc, grads)]
        if not self.sync:  # accumulate="local": no communication until the last micro-batch
            self.local_acc[name] = [None if g is None else g.to(rdtype, copy=True) if acc is None else g for g in grads]
            return
        plan = self.plan
        self.reduces[name] = self.comm.start(
            "reduce_scatter", lambda: reduce_unit(plan, unit, list(grads), async_op=True)
        )

    def _wait_reduce(self, name: str) -> None:
        if not self.sync:
            return
        handle = self.reduces.pop(name)
        self.comm.wait(handle)
        self.results[name] = handle.finish()

    # ---- what the Functions ask for ------------------------------------------------------

    def full_params(self, name: str) -> list[torch.Tensor]:
        return self.full[name]

    def shard_grads(self) -> list[DTensor | None]:
        """Reduced gradient shards of every parameter in plan order (``None`` while
        accumulating locally)."""
        out: list[DTensor | None] = []
        for unit in self.plan.units:
            shards = self.results.get(unit.name)
            for i, p in enumerate(unit.params):
                out.append(None if shards is None else from_local(self.plan, p.name, shards[i]))
        return out


# ---------------------------------------------------------------------------------------------
# The autograd Functions (see [Note: one autograd node per unit])
# ---------------------------------------------------------------------------------------------


class _StepBoundary(torch.autograd.Function):
    """Identity on every parameter shard. Backward: the ``end`` event; returns the reduced
    gradient shards."""

    @staticmethod
    def forward(info, *shards):
        ex, step = info
        with torch._C._DisableFuncTorch():
            ex.set_locals(shards)
            return tuple(
                DTensor(s._local_tensor, s._spec, requires_grad=False) if isinstance(s, DTensor) else s.view_as(s)
                for s in shards
            )

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.info = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ex, step = ctx.info
        with torch._C._DisableFuncTorch():
            ex.check_step(step, "a backward")
            ex.event("end")
            return (None, *ex.shard_grads())


class _RootGather(torch.autograd.Function):
    """The root's full parameters (already waited for). Backward: keeps its full gradients,
    complete only now, for the ``reduce <root>`` op after ``end``."""

    @staticmethod
    def forward(info, *shards):
        ex, step = info
        with torch._C._DisableFuncTorch():
            return tuple(t.detach() for t in ex.full_params(ROOT))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.info = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ex, step = ctx.info
        with torch._C._DisableFuncTorch():
            ex.check_step(step, "the root's backward")
            ex.full_grads[ROOT] = [_unwrap(g) for g in grads]
            return (None,) + (None,) * len(grads)


class _RootExit(torch.autograd.Function):
    """Identity on the model's outputs. Backward: the ``backward <root>`` event."""

    @staticmethod
    def forward(info, *outs):
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.info = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ex, step = ctx.info
        with torch._C._DisableFuncTorch():
            ex.check_step(step, "the model's backward")
            ex.event("backward", ROOT)
        return (None, *grads)


class UnitCall:
    """One call of a unit module: what its Function needs, and the graph it keeps."""

    __slots__ = ("ex", "step", "unit", "module", "n_shards", "in_tree", "leaves", "tensor_idx", "out_tree", "inner", "needs_grad")

    def __init__(self, ex, step, unit, module, n_shards, in_tree, leaves, tensor_idx, needs_grad):
        self.ex, self.step, self.unit, self.module = ex, step, unit, module
        self.n_shards, self.in_tree, self.leaves, self.tensor_idx = n_shards, in_tree, leaves, tensor_idx
        self.needs_grad = needs_grad
        self.out_tree = None
        self.inner = None


class _UnitFn(torch.autograd.Function):
    """One unit's forward and backward as a single autograd node."""

    @staticmethod
    def forward(call: UnitCall, *tensors):
        ex, name = call.ex, call.unit.name
        with torch._C._DisableFuncTorch():
            ex.event("forward", name)
            xs = tensors[call.n_shards :]
            params = ex.full_params(name)
            with torch.enable_grad() if call.needs_grad else contextlib.nullcontext():
                if call.needs_grad:
                    params = [t.detach().requires_grad_() for t in params]
                    xs = [x.detach().requires_grad_(x.is_floating_point() or x.is_complex()) for x in xs]
                leaves = list(call.leaves)
                for i, x in zip(call.tensor_idx, xs):
                    leaves[i] = x
                args, kwargs = optree.tree_unflatten(call.in_tree, leaves)
                named = {p.name[len(name) + 1 :]: t for p, t in zip(call.unit.params, params)}
                prev, ex.inside = ex.inside, name
                try:
                    out = torch.func.functional_call(call.module, named, tuple(args), kwargs, strict=False)
                finally:
                    ex.inside = prev
            flat, call.out_tree = optree.tree_flatten(out)
            for o in flat:
                if not isinstance(o, torch.Tensor):
                    raise ValueError(f"unit {_label(name)!r} returned a {type(o).__name__}; units must return tensors (or trees of them)")
            if call.needs_grad:
                call.inner = (params, xs, flat)
            ex.event("forward_done", name)
            return tuple(o.detach() for o in flat)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        call: UnitCall = ctx.call
        ex, name = call.ex, call.unit.name
        with torch._C._DisableFuncTorch():
            ex.check_step(call.step, f"the backward of unit {_label(name)!r}")
            if call.inner is None:
                raise RuntimeScheduleError(f"unit {_label(name)!r} ran its forward without autograd recording and cannot be differentiated")
            ex.event("backward", name)
            params, xs, flat = call.inner
            call.inner = None
            pairs = [(o, _unwrap(g)) for o, g in zip(flat, grads) if o.requires_grad and g is not None]
            wrt = list(params) + [x for x in xs if x.requires_grad]
            if pairs:
                with torch.enable_grad():
                    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            else:
                got = [None] * len(wrt)
            ex.full_grads[name] = list(got[: len(params)])
            x_grads = iter(got[len(params) :])
            out_x = [next(x_grads) if x.requires_grad else None for x in xs]
            ex.event("backward_done", name)
        return (None,) + (None,) * call.n_shards + tuple(out_x)
