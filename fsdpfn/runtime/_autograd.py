"""The autograd Functions through which the model reaches the schedule's events.

[Note: one autograd node per unit]
FSDP2 frees a unit's full parameters after its forward by resizing their storage to zero while
autograd still holds them as saved tensors, and refills the same storage before the unit's
backward; it finds "before the backward" and "gradients complete" with module and tensor hooks.
Hooks are fragile (hooks that silently do not fire, post-backward order races), and
inside ``torch.func`` transforms saved-tensor hooks are not available at all.

So each unit's forward is one custom ``torch.autograd.Function`` (:class:`UnitFn`) instead.
Its forward waits for the unit's gather, then builds the unit's *own* small autograd graph with
plain tensors inside ``torch._C._DisableFuncTorch()`` (the inputs are detached, the full
parameters are fresh leaves aliasing the runtime's unsharded storage) and keeps that graph on the
call. Its backward refills the storage, runs ``torch.autograd.grad`` on the kept graph, and so
receives the unit's complete parameter gradients in one place, in order: "gradients reached u"
and "u's gradients are complete" are the start and the end of one Python function, never hooks.
Because the graph is built below functorch, the same code serves ``loss.backward()`` and
``torch.func.grad``/``grad_and_value``: reshard-after-forward works in both loop styles, with no
recompute and no saved-tensor hooks (per-unit recompute for the functional style turned out
not to be needed). The costs: the unit is opaque to higher-order
transforms (no double ``grad`` or ``vmap`` through the runtime; the pure path has them), and
the refill must not bump the version counter that saved tensors check, hence
``torch.autograd._unsafe_preserve_version_counter`` as in FSDP2.

The root unit's code wraps every other unit, so it cannot be one node. Its full parameters come
from :class:`RootGather` (backward: the root's full gradients, complete only at the end) and the
model's outputs pass through :class:`RootExit`, whose backward is the ``backward <root>`` event
(refill the root if it was resharded, prefetch the last unit). All parameter shards first pass
through :class:`StepBoundary`, an identity whose backward runs after every unit's: it is the
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
from typing import Sequence, cast

import torch
from torch.distributed.tensor import DTensor

from fsdpfn._plan import ROOT, unit_label
from fsdpfn._remat import ReplayMode, SaveMode
from fsdpfn._tree import flatten, unflatten
from fsdpfn.comm import count_compiled
from fsdpfn.runtime._executor import RuntimeScheduleError
from fsdpfn.transforms import cut_watch
from fsdpfn._plan.schedule import OpKind

__all__ = ["RootExit", "RootGather", "StepBoundary", "UnitCall", "UnitFn"]


def _unwrap(t):
    """The plain tensor under functorch wrappers (backward receives wrapped gradients)."""
    if t is None:
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


class StepBoundary(torch.autograd.Function):
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
            ex.event(OpKind.END)
            return (None, *ex.shard_grads())


class RootGather(torch.autograd.Function):
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
            ex.set_grads(ROOT, [_unwrap(g) for g in grads])
            return (None,) + (None,) * len(grads)


class RootExit(torch.autograd.Function):
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
            ex.event(OpKind.BACKWARD, ROOT)
        return (None, *grads)


class UnitCall:
    """One call of a unit module: what its Function needs, and the graph it keeps."""

    __slots__ = (
        "ex",
        "step",
        "unit",
        "module",
        "n_shards",
        "in_tree",
        "leaves",
        "tensor_idx",
        "out_tree",
        "inner",
        "needs_grad",
        "compiled",
    )

    def __init__(self, ex, step, unit, module, n_shards, in_tree, leaves, tensor_idx, needs_grad, compiled=None):
        self.ex, self.step, self.unit, self.module = ex, step, unit, module
        self.compiled = compiled
        self.n_shards, self.in_tree, self.leaves, self.tensor_idx = n_shards, in_tree, leaves, tensor_idx
        self.needs_grad = needs_grad
        self.out_tree = None
        self.inner = None


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A fresh autograd leaf sharing ``t``'s storage. ``requires_grad_`` is refused while a
    ``torch.func`` transform is active (as in a recompute inside ``torch.func.grad``'s backward);
    building the leaf through ``_make_subclass`` is not."""
    return torch.Tensor._make_subclass(torch.Tensor, t.detach(), requires_grad) if requires_grad else t.detach()


def _run_unit(call: "UnitCall", params, xs, grad: bool):
    """The unit's own forward on ``params`` and inputs ``xs``: a small graph of plain tensors
    (fresh leaves) when ``grad``, else no graph at all. Returns ``(params, xs, flat outputs)``."""
    ex, name = call.ex, call.unit.name
    with torch.enable_grad() if grad else torch.no_grad():
        if grad:
            params = [_leaf(t, True) for t in params]
            xs = [_leaf(x, x.is_floating_point() or x.is_complex()) for x in xs]
        leaves = list(call.leaves)
        for i, x in zip(call.tensor_idx, xs):
            leaves[i] = x
        args, kwargs = unflatten(call.in_tree, leaves)
        named = {p.name[len(name) + 1 :]: t for p, t in zip(call.unit.params, params)}
        prev, ex.inside = ex.inside, name
        # The runtime rematerialises units itself: a pure-loop remat wrapper on the module
        # (fsdpfn.transforms.apply_remat) passes straight through while the unit runs here.
        call.module._fsdpfn_in_remat = True
        try:
            out = torch.func.functional_call(call.module, named, tuple(args), kwargs, strict=False)
        finally:
            ex.inside = prev
            call.module._fsdpfn_in_remat = False
    flat, out_tree = flatten(out)
    return params, xs, flat, out_tree


def _outside_functorch(call: "UnitCall"):
    """[Note: per-unit compile]
    A compiled unit's forward is an AOTAutograd node inside the unit's own plain-tensor graph
    (:class:`UnitFn` builds it below functorch). AOTAutograd refuses to run a compiled backward
    while any ``torch.func`` transform is on the interpreter stack, even a disabled one, so for
    compiled units the inner forward and the inner ``torch.autograd.grad`` run with the stack
    set aside; the outer transform still sees one ``UnitFn`` node, as without compile. Nothing
    else changes: the unit's gather, reduce and every other schedule op stay eager."""
    if call.compiled is None:
        return contextlib.nullcontext()
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages ``tensors`` hold."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _rng_state(xs) -> tuple:
    """The generator states a recompute must start from so random ops (dropout) replay."""
    cuda = sorted({x.device.index or 0 for x in xs if x.is_cuda})
    return torch.get_rng_state(), cuda, [torch.cuda.get_rng_state(d) for d in cuda]


class UnitFn(torch.autograd.Function):
    """One unit's forward and backward as a single autograd node. With a ``remat`` policy (see
    [Note: rematerialised units]) the forward keeps no graph, only its inputs (and the results a
    selective policy keeps), and the backward recomputes the forward on the parameters the
    schedule gathered for backward."""

    @staticmethod
    def forward(call: UnitCall, *tensors):
        ex, name = call.ex, call.unit.name
        with torch._C._DisableFuncTorch():
            ex.event(OpKind.FORWARD, name)
            xs = list(tensors[call.n_shards :])
            policy = call.unit.remat if call.needs_grad else "none"
            remat = policy != "none"
            rng = _rng_state(xs) if remat else None
            # Under "full" too: it records the operator trace the recompute is checked against.
            kept = SaveMode(policy, call.unit.label) if remat else contextlib.nullcontext()
            full = ex.full_params(name)
            with kept, _outside_functorch(call), cut_watch():  # see [Note: a fused layout split plainly]
                params, xs_used, flat, call.out_tree = _run_unit(call, full, xs, call.needs_grad and not remat)
            for o in flat:
                if not isinstance(o, torch.Tensor):
                    raise ValueError(
                        f"unit {unit_label(name)!r} returned a {type(o).__name__}; units must return tensors (or trees of them)"
                    )
            if remat:
                call.inner = ("remat", [x.detach() for x in xs], rng, kept)
                ex.record.kept_bytes[name] = _storage_bytes(
                    xs + ([] if policy == "full" else cast(SaveMode, kept).tensors())
                )
            elif call.needs_grad:
                call.inner = (params, xs_used, flat)
            ex.event(OpKind.FORWARD_DONE, name)
            return tuple(o.detach() for o in flat)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        call: UnitCall = ctx.call
        ex, name = call.ex, call.unit.name
        with torch._C._DisableFuncTorch():
            ex.check_step(call.step, f"the backward of unit {unit_label(name)!r}")
            if call.inner is None:
                raise RuntimeScheduleError(
                    f"unit {unit_label(name)!r} ran its forward without autograd recording and cannot be differentiated"
                )
            ex.event(OpKind.BACKWARD, name)
            if call.inner[0] == "remat":  # recompute on the parameters gathered for backward
                _, saved_xs, (cpu, cuda, cuda_states), kept = call.inner
                replay = ReplayMode(kept, call.unit.label)
                call.inner = None  # the kept results are freed as the recompute consumes them
                full = ex.full_params(name)
                with torch.random.fork_rng(devices=cuda), replay:
                    torch.set_rng_state(cpu)
                    for d, st in zip(cuda, cuda_states):
                        torch.cuda.set_rng_state(st, d)
                    params, xs, flat, _ = _run_unit(call, full, saved_xs, True)
                ex.record.recomputed.append(name)
                ex.record.recompute_flops[name] = replay.flops
            else:
                params, xs, flat = call.inner
            call.inner = None
            pairs = [(o, _unwrap(g)) for o, g in zip(flat, grads) if o.requires_grad and g is not None]
            wrt = list(params) + [x for x in xs if x.requires_grad]
            if pairs:
                with torch.enable_grad(), _outside_functorch(call):
                    got: Sequence[torch.Tensor | None] = torch.autograd.grad(
                        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                    )
            else:
                got = [None] * len(wrt)
            if call.compiled is not None and pairs:
                count_compiled(call.compiled.get("backward", []))
            ex.set_grads(name, list(got[: len(params)]))
            x_grads = iter(got[len(params) :])
            out_x = [next(x_grads) if x.requires_grad else None for x in xs]
            ex.event(OpKind.BACKWARD_DONE, name)
        return (None,) + (None,) * call.n_shards + tuple(out_x)
