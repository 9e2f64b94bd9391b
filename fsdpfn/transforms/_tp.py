"""Tensor parallelism on a model: the plan's activation collectives as forward hooks.

A plan's ``tp`` lists the ``nn.Linear`` modules split over the tensor-parallel axis and their
styles. Their weights reach them already split (:func:`fsdpfn.unshard` returns each rank's
tp-local part); what the model still needs are the activation collectives around them, which
:func:`apply_tp` installs as forward hooks:

===================  =============================  ========================================
style                before the layer               after the layer
===================  =============================  ========================================
``colwise``          ``tp_copy`` (bwd: all-reduce)  nothing: the output stays split
``colwise_gather``   ``tp_copy``                    ``tp_gather_last`` (all-gather)
``colwise_fused:k``  ``tp_copy`` (bwd: all-reduce)  nothing: each of its k parts stays split
``rowwise``          nothing: the input is split    ``tp_reduce`` (all-reduce)
===================  =============================  ========================================

Hooks run inside ``torch.func.functional_call`` and under ``torch.func.grad`` (the collectives
are :mod:`fsdpfn.comm`'s differentiable Functions), so the pure loop stays
``functional_call(model, fsdpfn.unshard(params, plan), (x,))``.

A model whose layers see the split must not assume global sizes: an attention layer after a
colwise ``qkv`` sees ``heads / tp`` heads, so it should infer the number of heads from the
tensor (``view(b, t, -1, head_dim)``), as :class:`fsdpfn.models.GPT` does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from fsdpfn import comm as C
from fsdpfn._plan import Plan
from fsdpfn.transforms._axes import ep_group, tp_group
from fsdpfn.transforms._guards import TP_ATTR, install_batch_check, install_split_watch, watch_output

__all__ = ["apply_tp", "reference_mode"]

_ATTR = TP_ATTR
_EP_ATTR = "_fsdpfn_ep"
# Process state: [True] while the differential check runs a unit unsharded: the hooks pass their input through.
# A list, not a ContextVar: the hooks run under torch.compile too, which reads a global but
# cannot trace ContextVar.get. The check runs on the thread of the step it checks.
_REFERENCE = [False]


@contextlib.contextmanager
def reference_mode(on: bool = True) -> Iterator[None]:
    """Inside the block the tensor-parallel hooks do nothing (``on``; with ``on=False`` they run
    again): a module given its global weights computes what one process computes (the reference
    of [Note: the differential check] in ``fsdpfn/transforms/_verify.py``)."""
    saved, _REFERENCE[0] = _REFERENCE[0], on
    try:
        yield
    finally:
        _REFERENCE[0] = saved


def _apply_ep(model: nn.Module, plan: Plan) -> None:
    """Points the model's expert modules (those with ``set_ep_group``, e.g.
    :class:`fsdpfn.models.MoE`) at the plan's ``ep`` group, so their forward dispatches tokens to
    the ranks holding their experts; a plan without ``ep`` undoes what an earlier plan set."""
    group = ep_group(plan) if plan.ep_size > 1 else None
    for mod in model.modules():
        if not hasattr(mod, "set_ep_group"):
            continue
        if plan.ep_size > 1:
            mod.set_ep_group(group)  # type: ignore[operator]  # hasattr above; nn.Module's __getattr__ stub says Tensor | Module
            setattr(mod, _EP_ATTR, True)
        elif getattr(mod, _EP_ATTR, False):
            mod.set_ep_group(None)  # type: ignore[operator]  # as above
            delattr(mod, _EP_ATTR)


def _pre_copy(group, tag):
    def hook(module, args):
        if _REFERENCE[0]:
            return None
        return (C.tp_copy(args[0], group, tag=tag), *args[1:])

    return hook


def _post_gather(group, tag):
    def hook(module, args, output):
        if _REFERENCE[0]:
            return None
        return C.tp_gather_last(output, group, tag=tag)

    return hook


def _post_reduce(group, tag):
    def hook(module, args, output):
        if _REFERENCE[0]:
            return None
        return C.tp_reduce(output, group, tag=tag)

    return hook


def apply_tp(model: nn.Module, plan: Plan) -> nn.Module:
    """Installs the plan's tensor-parallel activation collectives on ``model`` (in place) and
    returns it. Idempotent: calling it again with the same plan changes nothing, with another
    plan replaces the hooks. A plan without ``tp`` removes any installed hooks.

    The hooks live on this instance only: run this ``model`` (``functional_call(model,
    fsdpfn.unshard(params, plan), ...)``), not another instance of its class; a tp-split weight
    running in a module without its hooks raises ``ValueError`` on every rank. For every plan
    (with or without ``tp``) it also installs a root forward pre-hook that checks, on the first
    two steps, that tensor-parallel peers got the same batch and data-parallel ranks batches of
    the same size.

    :func:`fsdpfn.shard`, :func:`fsdpfn.init_shards`, :func:`fsdpfn.load_safetensors` and
    :class:`fsdpfn.runtime.Runtime` call it when given the model, so most code never does.
    On a mesh with an ``ep`` axis it also points the model's expert modules at the ``ep`` group.

    Args:
      model: the module the plan was built for.
      plan: a plan bound to a mesh.

    Returns:
      ``model``.

    Example:
      >>> fsdpfn.apply_tp(model, plan) is model
      True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_tp takes the nn.Module the plan was built for, got {type(model).__name__}")
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        installed = getattr(mod, _ATTR, None)
        if installed is not None and (installed[0] != plan.fingerprint or installed[1] is not plan.mesh):
            for handle in installed[2]:
                handle.remove()
            delattr(mod, _ATTR)
    if plan.ep_size > 1 and plan.mesh is None:
        raise ValueError("apply_tp needs a plan bound to a mesh; bind one with plan.bind(mesh)")
    _apply_ep(model, plan)
    install_batch_check(model, plan)  # every plan: see [Note: checking the batch]
    install_split_watch(
        model, plan
    )  # a plain colwise split of a fused layout: see [Note: a fused layout split plainly]
    if not plan.tp:
        return model
    group = tp_group(plan) if plan.mesh is not None else None
    if plan.mesh is None:
        raise ValueError("apply_tp needs a plan bound to a mesh; bind one with plan.bind(mesh)")
    for name, style in plan.tp:
        if name not in modules:
            raise ValueError(
                f"the plan splits module {name!r} over tp, but {type(model).__name__} has no such module; was the plan built for another model?"
            )
        mod = modules[name]
        if getattr(mod, _ATTR, None) is not None:
            continue
        handles = []
        if style.startswith("colwise"):  # colwise, colwise_gather, colwise_fused:k
            handles.append(mod.register_forward_pre_hook(_pre_copy(group, name)))
        if style == "colwise":
            handles.append(mod.register_forward_hook(watch_output(name)))
        if style == "colwise_gather":
            handles.append(mod.register_forward_hook(_post_gather(group, name)))
        if style == "rowwise":
            handles.append(mod.register_forward_hook(_post_reduce(group, name)))
        setattr(mod, _ATTR, (plan.fingerprint, plan.mesh, handles))
    return model
