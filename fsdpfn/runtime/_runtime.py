"""The public runtime: a plan and a schedule bound to a model."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from fsdpfn._plan import ROOT, Plan
from fsdpfn._tree import flatten, unflatten
from fsdpfn.runtime._autograd import RootExit, RootGather, StepBoundary, UnitCall, UnitFn
from fsdpfn.runtime._comm import comm_for
from fsdpfn.runtime._executor import Executor
from fsdpfn._plan.schedule import OpKind, Schedule, validate
from fsdpfn._plan.schedule import schedule as default_schedule  # ``schedule`` is an argument below
from fsdpfn.comm import compiling, count_compiled
from fsdpfn.transforms import (
    CompileUnsupportedError,
    note_capture,
    note_step,
    StepChecks,
    apply_tp,
    check_params,
    check_plan_kind,
    recording_backend,
    unshard_traced,
    verify,
)
from fsdpfn.transforms import VerifyReport

__all__ = ["Runtime"]

ACCUMULATE = ("reduce", "local")


class Runtime:
    """Runs a model's training steps under a plan with an explicit schedule.

    Only a few units are unsharded at once (under ``zero3`` with reshard-after-forward: at most
    ``1 + prefetch`` units plus the root), gathers are prefetched, each unit's reduce-scatter
    starts as soon as its gradients are complete, and the numbers are those of the pure path
    (:func:`fsdpfn.unshard` + ``torch.func.grad``). See [Note: one autograd node per unit].

    Args:
      model: the module the plan was made for. The runtime never reads its parameters (they
        come from the shards you pass), so you may free them (``model.to("meta")``) after
        :func:`fsdpfn.shard`; buffers are used as they are.
      plan: the plan (bound to a mesh).
      schedule: a :class:`Schedule` to execute (default: :func:`fsdpfn.runtime.schedule` of the
        plan with ``prefetch`` and ``reshard_after_forward``). Validated before anything runs.
      prefetch, reshard_after_forward: passed to :func:`fsdpfn.runtime.schedule` when no
        schedule is given.
      accumulate: gradient accumulation over micro-batches run inside :meth:`accumulating`.
        ``"reduce"`` (default): every micro-batch reduces its gradients into the sharded result
        (communication per micro-batch, sharded memory), except the units of strategy ``zero1``,
        which always accumulate locally (that is ZeRO-1: full gradients, one reduce per step).
        ``"local"``: micro-batches inside :meth:`accumulating` keep summed full gradients locally
        and do not communicate; the next micro-batch outside it reduces the total (one reduce per
        step, full-gradient memory). A schedule that lists the ops of those micro-batches
        (``Schedule.accumulating``, ``accumulate u`` where u sums locally) is run as written instead.
      device: where collectives run: ``"cpu"`` (async gloo work handles, the default) or
        ``"cuda"`` (one stream per collective kind, ordered with events; see
        :class:`~fsdpfn.runtime.CudaComm`). Every buffer is allocated on the device of the
        tensors it serves (a unit's unsharded parameters on its shards' device), so this only
        picks the streams.

    Example (``torch.func`` style):
      >>> rt = fsdpfn.runtime.Runtime(model, plan, prefetch=1)
      >>> def loss_fn(params, x, y):
      ...     return F.cross_entropy(rt.apply(params, x).flatten(0, 1), y.flatten())
      >>> grads, loss = rt.value_and_grad(loss_fn)(params, x, y)
      >>> grads["blocks.0.fc.weight"].placements  # sharded DTensors, like the params
      (Shard(dim=0),)

    Example (``loss.backward()`` style):
      >>> params = fsdpfn.shard(model, plan, requires_grad=True)
      >>> with rt.bind(params):
      ...     F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
      >>> g = rt.grads(params)  # the params' .grad, sharded and reduced
      >>> torch.allclose(g["head.weight"].to_local(), grads["head.weight"].to_local(), atol=1e-6)
      True
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        schedule: Schedule | None = None,
        *,
        prefetch: int = 1,
        reshard_after_forward: bool | None = None,
        accumulate: str = "reduce",
        device: str | torch.device | None = "cpu",
        verify: bool = True,
    ):
        check_plan_kind(plan, "Runtime")
        if plan.mesh is None:
            raise ValueError("the plan has no mesh; bind one with plan.bind(mesh) before building a Runtime")
        if accumulate not in ACCUMULATE:
            raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
        sched = default_schedule(plan, prefetch, reshard_after_forward) if schedule is None else schedule
        if not isinstance(sched, Schedule):
            raise ValueError(f"schedule must be an fsdpfn.runtime.Schedule, got {type(sched).__name__}")
        validate(sched, plan)
        self.model = model
        self.plan = plan
        self.schedule = sched
        self._resharded = tuple(u.name for u in plan.units if sched.reshard_after_forward(u.name))  # read under compile
        modules = dict(model.named_modules())
        for u in plan.units:
            if u.name not in modules:
                raise ValueError(
                    f"unit {u.name!r} of the plan is not a module of {type(model).__name__}; was the plan built for another model?"
                )
        self._modules = {u.name: modules[u.name] for u in plan.units if u.name != ROOT}
        apply_tp(model, plan)  # the tensor-parallel activation collectives, if the plan has any
        self._ex = Executor(plan, sched, comm_for(device), accumulate)
        # Read under compile: whether an accumulating micro-batch's op list sums some unit locally.
        self._accumulates = any(op.kind is OpKind.ACCUMULATE for op in self._ex.micro_batch_ops[False])
        self._local_only = False
        self._in_apply = False
        self._compiled: dict[str, tuple[Callable, dict[str, list]]] = {}
        self.checks = StepChecks(verify=verify)  # its batch checks are the model's root hook's
        self._verified: VerifyReport | None = None

    # ---- inspection ----------------------------------------------------------------------

    @property
    def memory(self):
        """The :class:`~fsdpfn.runtime.MemoryTracker`: ``high_water`` bytes of live unsharded
        parameters, ``reset()`` to start a new measurement."""
        return self._ex.memory

    @property
    def verified(self):
        """The :class:`fsdpfn.VerifyReport` of the first step's check (``None`` before it ran,
        or with ``verify=False``).

        Example:
          >>> report = rt.verified   # None until the first step ran
          >>> report is None or report.ok
          True
        """
        return self._verified

    @property
    def last_step(self):
        """The :class:`~fsdpfn.runtime.StepRecord` of the last step (events, in-flight ops)."""
        return self._ex.record

    # ---- running -------------------------------------------------------------------------

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any):
        """``model(*args, **kwargs)`` with the sharded ``params``, executed by the schedule.

        Differentiable with ``loss.backward()`` (gradients land in ``params[name].grad``) and
        with ``torch.func.grad``/``grad_and_value`` over ``params``; either way the gradients are
        sharded and reduced (mean over data-parallel ranks), like :func:`fsdpfn.unshard`'s.

        Args:
          params: every parameter of the plan, sharded (:func:`fsdpfn.shard`'s dict).
          *args, **kwargs: the model's inputs.

        Returns:
          the model's output.

        Example:
          >>> rt.apply(params, x).shape  # x: (batch, seq) tokens
          torch.Size([2, 8, 64])
          >>> with torch.no_grad():  # evaluation: gathers, frees, no reduce
          ...     logits = rt.apply(params, x)
        """
        if compiling():  # see [Note: the runtime under torch.compile]
            return self._apply_traced(params, *args, **kwargs)
        check_params(params, self.plan, "Runtime.apply(params)")
        if self.checks.verify_due():
            self._verified = verify(self.model, self.plan, params, *args, **kwargs)
        ex = self._ex
        grad = torch.is_grad_enabled()
        step = ex.begin(sync=not self._local_only)
        names = self.plan.param_names
        shards = StepBoundary.apply((ex, step), *(params[n] for n in names))
        by_name = dict(zip(names, shards))
        ex.event(OpKind.FORWARD, ROOT)
        root = self.plan.unit(ROOT) if any(u.name == ROOT for u in self.plan.units) else None
        root_full = {}
        if root is not None:
            fulls = RootGather.apply((ex, step), *(by_name[p.name] for p in root.params))
            root_full = {p.name: t for p, t in zip(root.params, fulls)}
        # A capture (a compiled step's first steps: its checks) finds the plan and shards here, as
        # in fsdpfn.unshard, and stops at the model's root hook.
        note_capture(self.plan, params)
        note_step(self.plan)  # the model's root hook checks the batch (see [Note: checking the batch])
        with self._routed(by_name, step, grad):
            out = torch.func.functional_call(self.model, root_full, args, kwargs, strict=False)
        flat, tree = flatten(out)  # every mapping too: see [Note: mapping outputs]
        tensors = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)]
        if grad:
            exits = RootExit.apply((ex, step), *(flat[i] for i in tensors))
            for i, o in zip(tensors, exits):
                flat[i] = o
        ex.event(OpKind.FORWARD_DONE, ROOT)
        if not grad:
            ex.forward_only_done()
        return unflatten(tree, flat)

    def _apply_traced(self, params, *args, **kwargs):
        """[Note: the runtime under torch.compile]
        While dynamo traces, the schedule's events (autograd Functions that leave functorch, async
        work, a state machine on the executor) cannot become graph nodes. So a compiled
        ``apply`` is the pure path: every unit gathered with traceable collectives
        (:func:`fsdpfn.unshard` under compile), the model called on the full parameters, and each
        unit's reduce in the backward graph; the numbers are the runtime's. The order and overlap
        of the collectives are then inductor's (its scheduler, and its bucketing and reordering
        passes where enabled), not the schedule's: ``prefetch`` does not apply, but the units the
        schedule reshards after forward are gathered again in the backward graph (see [Note:
        reshard-after-forward under torch.compile]). Micro-batches that would not reduce
        (those whose op list has ``accumulate`` ops: ``accumulating()`` with ``accumulate="local"``,
        ``zero1`` units, a hand-edited ``Schedule.accumulating``) are refused: the compiled step
        reduces every call."""
        if self._local_only and self._accumulates:
            raise CompileUnsupportedError(
                "a micro-batch that accumulates locally (accumulating() with accumulate='local', or zero1 units) "
                "does not compile: the compiled step reduces on every call. Use accumulate='reduce' or run "
                "the accumulating micro-batches eagerly"
            )
        full = unshard_traced(params, self.plan, reshard=self._resharded)
        return torch.func.functional_call(self.model, full, args, kwargs, strict=False)

    def value_and_grad(self, loss_fn: Callable[..., torch.Tensor], has_aux: bool = False):
        """``torch.func.grad_and_value`` of ``loss_fn(params, *args)`` (which calls
        :meth:`apply`), returning ``(grads, loss)`` (``((grads, aux), loss)`` with ``has_aux``).

        ``grads`` are sharded DTensors, reduced. Inside :meth:`accumulating` with
        ``accumulate="local"`` they are zeros: the total arrives with the micro-batch that ends the
        accumulation, so summing every call's grads gives the step's gradient in either mode.

        Example:
          >>> step = rt.value_and_grad(loss_fn)  # loss_fn(params, x, y) calls rt.apply(params, x)
          >>> grads, loss = step(params, x, y)
          >>> grads["head.weight"].shape, loss.shape
          (torch.Size([64, 32]), torch.Size([]))
        """
        return torch.func.grad_and_value(loss_fn, has_aux=has_aux)

    @contextlib.contextmanager
    def bind(self, params: Mapping[str, torch.Tensor]):
        """Inside the block, ``model(...)`` runs as :meth:`apply` with ``params`` (for
        ``loss.backward()`` loops written against the module).

        Example:
          >>> params = fsdpfn.shard(model, plan, requires_grad=True)
          >>> with rt.bind(params):
          ...     F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
          >>> params["head.weight"].grad.placements
          (Shard(dim=0),)
        """
        runtime = self
        original = self.model.__dict__.get("forward")
        owner = type(self.model)

        def forward(*args, **kwargs):
            if runtime._ex.inside is not None or runtime._in_apply:
                return owner.forward(runtime.model, *args, **kwargs)
            runtime._in_apply = True
            try:
                return runtime.apply(params, *args, **kwargs)
            finally:
                runtime._in_apply = False

        self.model.forward = forward
        try:
            yield self
        finally:
            if original is None:
                del self.model.forward
            else:
                self.model.forward = original

    @contextlib.contextmanager
    def accumulating(self):
        """Micro-batches run inside are not the last of their step (see ``accumulate``).

        Example:
          >>> micro_batches = [(x[:1], y[:1]), (x[1:], y[1:])]
          >>> for xb, yb in micro_batches[:-1]:
          ...     with rt.accumulating():
          ...         g0, _ = rt.value_and_grad(loss_fn)(params, xb, yb)
          >>> g1, _ = rt.value_and_grad(loss_fn)(params, *micro_batches[-1])  # reduces
          >>> w = "head.weight"  # the two halves' mean gradient is the whole batch's
          >>> torch.allclose((g0[w] + g1[w]).to_local() / 2, grads[w].to_local(), atol=1e-6)
          True
        """
        prev, self._local_only = self._local_only, True
        try:
            yield
        finally:
            self._local_only = prev

    @staticmethod
    def grads(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """``{name: params[name].grad}``: the sharded gradients an eager backward left.

        Example:
          >>> Runtime.grads({"w": torch.ones(2, requires_grad=True)})
          {'w': None}
        """
        return {n: p.grad for n, p in params.items()}

    def compile_units(self, units=None, *, backend: str = "inductor", fullgraph: bool = True, **options) -> list[str]:
        """Compiles each unit's own forward with ``torch.compile`` and keeps the schedule around
        them (per-unit compile, as torchtitan compiles each transformer block under FSDP2).

        The gathers, prefetch, reshard-after-forward, reduces, accumulation, FP8 gathers and
        offload copies stay the runtime's, eager, exactly as without compile: only the code between
        a unit's gather and its reduce is compiled (see [Note: per-unit compile]). Both loop
        styles work. Modules of one class share their compiled code, so a stack of identical
        blocks compiles once. Collectives inside a unit (tensor-parallel activations) are traced;
        they are listed when compiled and counted on every call, like :func:`fsdpfn.compile`'s.

        Args:
          units: names of the units to compile (default: every unit that can be, see below).
          backend: ``"inductor"`` (generated kernels) or ``"aot_eager"`` (the traced graphs run
            op by op: compiles in seconds, for checking).
          fullgraph: refuse graph breaks inside a unit (the default: a break is an error naming
            its cause, not a silent eager fallback).
          **options: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``options``).

        A unit compiles unless it is the root (its code wraps the other units), contains another
        unit (an expert unit inside a block: compile the inner one), or rematerialises
        (``remat`` other than ``"none"``: the recompute's replay must see every operator the
        forward ran); asking for one of those by name is an error.

        Returns:
          the names of the compiled units.

        Example:
          >>> rt2 = fsdpfn.runtime.Runtime(model, plan)
          >>> rt2.compile_units(backend="aot_eager")
          ['blocks.0', 'blocks.1']
        """
        if self._compiled:
            raise ValueError(
                "compile_units was already called on this Runtime; build a new Runtime to compile other units"
            )
        reasons = {ROOT: "it is the root unit, whose code wraps every other unit"}
        for name, module in self._modules.items():
            inner = [n for n in self._modules if n != name and n.startswith(name + ".")]
            if inner:
                reasons[name] = f"it contains unit(s) {inner[:3]}; compile those instead"
            elif self.plan.unit(name).remat != "none":
                reasons[name] = (
                    f"its remat policy {self.plan.unit(name).remat!r} replays operators one by one, which compiled "
                    "kernels hide; use remat='none' for compiled units"
                )
        if units is None:
            chosen = [n for n in self._modules if n not in reasons]
        else:
            if isinstance(units, str):
                units = [units]
            known = set(self._modules) | {ROOT}
            chosen = list(units)
            for n in chosen:
                if n not in known:
                    raise ValueError(f"compile_units: {n!r} is not a unit of this plan; units: {sorted(known)[:8]}")
                if n in reasons:
                    raise CompileUnsupportedError(
                        f"compile_units: unit {n!r} cannot be compiled on its own: {reasons[n]}"
                    )
        by_class: dict[type, tuple] = {}
        for n in chosen:
            cls = type(self._modules[n])
            if cls not in by_class:
                graphs: dict[str, list] = {}
                fn = torch.compile(
                    cls.forward, backend=recording_backend(backend, graphs), fullgraph=fullgraph, **options
                )
                by_class[cls] = (fn, graphs)
            self._compiled[n] = by_class[cls]
        return chosen

    @property
    def compiled_units(self) -> list[str]:
        """Names of the units whose forward :meth:`compile_units` compiled."""
        return list(self._compiled)

    # ---- routing unit modules through UnitFn ---------------------------------------------

    @contextlib.contextmanager
    def _routed(self, shards: dict[str, torch.Tensor], step: int, grad: bool):
        ex = self._ex
        installed = []
        for name, module in self._modules.items():
            unit = self.plan.unit(name)
            unit_shards = [shards[p.name] for p in unit.params]
            compiled = self._compiled.get(name)
            original = (
                type(module).forward.__get__(module)
                if compiled is None
                else functools.partial(_run_compiled, compiled, module)
            )

            def forward(*args, _name=name, _module=module, _unit=unit, _shards=unit_shards, _orig=original, **kwargs):
                if ex.inside == _name:
                    return _orig(*args, **kwargs)
                leaves, in_tree = flatten((list(args), kwargs), none_is_leaf=True)
                idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
                call = UnitCall(
                    ex,
                    step,
                    _unit,
                    _module,
                    len(_shards),
                    in_tree,
                    leaves,
                    idx,
                    grad,
                    self._compiled.get(_name, (None, None))[1],
                )
                outs = UnitFn.apply(call, *_shards, *(leaves[i] for i in idx))
                return unflatten(call.out_tree, list(outs))

            # The runtime recomputes rematerialised units itself; a pure-loop remat wrapper the
            # module may carry (fsdpfn.transforms.apply_remat) steps aside while it runs.
            installed.append((module, module.__dict__.get("forward")))
            module.forward = forward
        try:
            yield
        finally:
            for module, previous in installed:
                del module.forward
                if previous is not None:
                    module.forward = previous


def _run_compiled(compiled, module, *args, **kwargs):
    """A compiled unit forward; its graph's collectives are counted per call (the backward
    graph's in ``UnitFn.backward``)."""
    fn, graphs = compiled
    out = fn(module, *args, **kwargs)
    count_compiled(graphs.get("forward", []))
    return out
