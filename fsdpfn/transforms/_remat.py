"""Activation checkpointing in the pure loop: a unit with ``remat="full"`` keeps only its inputs
and recomputes its forward in backward; a selective policy (``"save_dots"``, ...) keeps some
results as well (see [Note: selective rematerialisation] in ``fsdpfn._remat``).

[Note: remat under torch.func]
``torch.utils.checkpoint`` cannot run inside ``torch.func.grad``: the non-reentrant form uses
saved-tensor hooks, which functorch refuses, and the reentrant form is an autograd Function
without ``setup_context``. :class:`_Remat` is a ``setup_context`` Function: its forward runs the
unit without recording a graph, saves the unit's inputs (its parameters and activations) and the
generator state, and its backward re-runs the unit under ``torch.func.vjp`` from the same state,
so random ops replay. The same Function serves ``loss.backward()``. :func:`apply_remat`
installs it around the unit modules' forward, so ``functional_call(model, fsdpfn.unshard(params,
plan), (x,))`` is unchanged; the runtime (:class:`fsdpfn.runtime.Runtime`) runs its own
recompute inside each unit's autograd node and takes the module's forward over while it runs.
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch
from torch import nn

from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn._remat import ReplayMode, SaveMode

__all__ = ["apply_remat"]

_ATTR = "_fsdpfn_remat"


class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(run, n_float, *tensors):
        with torch.no_grad():
            # Kept results and the forward's operator trace ([Note: replay check]) stay on the
            # function (like the generator state): plain tensors, no graph.
            with SaveMode(run.policy, run.unit) as run.kept:
                return run(*tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        run, n_float, *tensors = inputs
        ctx.run, ctx.n_float = run, n_float
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        floats, rest = tensors[: ctx.n_float], tensors[ctx.n_float :]
        # fork_rng by hand: under torch.func the generator state must be read and written as a
        # plain tensor, which torch.random.fork_rng does not do.
        with torch._C._DisableFuncTorch():
            outer = torch.get_rng_state()
            torch.set_rng_state(ctx.run.rng)  # the state before forward ran
        replay = ReplayMode(ctx.run.kept, ctx.run.unit)
        ctx.run.kept = None  # handed over: freed as the recompute consumes them
        try:
            with torch.enable_grad(), replay:
                outs, vjp = torch.func.vjp(lambda *fs: ctx.run(*fs, *rest), *floats)  # type: ignore[misc]  # 2 values without has_aux
        finally:
            with torch._C._DisableFuncTorch():
                torch.set_rng_state(outer)
        cotangents = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads))
        return (None, None, *vjp(cotangents), *(None for _ in rest))


def _wrap(module: nn.Module, original, policy: str, unit: str):
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled() or getattr(module, "_fsdpfn_in_remat", False):
            return original(*args, **kwargs)
        names = [n for n, _ in module.named_parameters()]
        params = [p for _, p in module.named_parameters()]
        leaves, tree = optree.tree_flatten(cast(Any, (list(args), kwargs)), none_is_leaf=True)
        idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        floats = [i for i in idx if leaves[i].is_floating_point()]
        others = [i for i in idx if not leaves[i].is_floating_point()]
        out_tree: list[Any] = []

        def run(*tensors):
            ps, fx, ox = (
                tensors[: len(params)],
                tensors[len(params) : len(params) + len(floats)],
                tensors[len(params) + len(floats) :],
            )
            filled = list(leaves)
            for i, t in zip(floats + others, (*fx, *ox)):
                filled[i] = t
            a, kw = cast("tuple[list, dict]", optree.tree_unflatten(tree, filled))
            module._fsdpfn_in_remat = True  # type: ignore[assignment]  # nn.Module's __setattr__ stub takes tensors and modules only
            try:
                out = torch.func.functional_call(module, dict(zip(names, ps)), tuple(a), kw, strict=False)
            finally:
                module._fsdpfn_in_remat = False  # type: ignore[assignment]  # as above
            flat, spec = optree.tree_flatten(out)
            out_tree[:] = [spec]
            return tuple(flat)

        # Kept on the function, not passed as an input: an input tensor would be wrapped by torch.func.
        with torch._C._DisableFuncTorch():
            run.rng = torch.get_rng_state()  # type: ignore[attr-defined]  # state kept on the function
        run.policy, run.unit, run.kept = policy, unit, None  # type: ignore[attr-defined]  # likewise
        flat = _Remat.apply(
            run, len(params) + len(floats), *params, *(leaves[i] for i in floats), *(leaves[i] for i in others)
        )
        return optree.tree_unflatten(out_tree[0], list(flat))

    return forward


def apply_remat(model: nn.Module, plan: Plan | PipelinedPlan) -> nn.Module:
    """Wraps the forward of every unit whose plan gives a ``remat`` policy other than ``"none"``
    so that, in the pure loop, it keeps only its inputs (and what the policy keeps) and
    recomputes in backward (see [Note: remat under torch.func]). Idempotent; another plan replaces the wrappers. :func:`fsdpfn.shard` calls it.

    Example:
      >>> fsdpfn.transforms.apply_remat(model, plan) is model
      True
    """
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if _ATTR in mod.__dict__:
            del mod.__dict__["forward"]
            del mod.__dict__[_ATTR]
    for unit in plan.units:
        if unit.remat != "none" and unit.name in modules:
            mod = modules[unit.name]
            mod.forward = _wrap(mod, type(mod).forward.__get__(mod), unit.remat, unit.label)
            mod.__dict__[_ATTR] = plan.fingerprint
    return model
