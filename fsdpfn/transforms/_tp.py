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
``vocab``            ids outside the rank's rows    rows of those ids zeroed, ``tp_reduce``
(an Embedding)       looked up as row 0
``colwise_loss``     ``tp_copy`` (bwd: all-reduce)  nothing: the logits stay split over the
                                                    vocabulary, for
                                                    :func:`vocab_parallel_cross_entropy`
===================  =============================  ========================================

[Note: the loss over a split vocabulary]
At a vocabulary of 128k tokens the logits are the step's largest activation, and the output
Linear its largest matmul. Split ``colwise_loss``, each tp rank computes ``V / tp`` of the
logits and keeps them split; :func:`vocab_parallel_cross_entropy` computes the cross-entropy
from the parts (Megatron's ``vocab_parallel_cross_entropy``, torchtitan's ``loss_parallel``):
the all-reduced max of every row (for stability), then one all-reduce of two numbers a token,
the sum of ``exp(logit - max)`` over the rank's columns and the target's shifted logit (0 on the
ranks that do not hold it). The loss of a token is ``log(sum) - target``. Its backward needs no
collective: each rank's columns of ``softmax - one_hot``. A rank holds ``N x V / tp`` logits and
their softmax, never the whole row.

[Note: logits split for a loss that never came]
Split ``colwise_loss``, the model returns each rank's columns of the logits. A loss that takes
them as whole rows (``F.cross_entropy``) runs without complaint whenever the targets fall in a
rank's slice, and trains wrong. So every tp > 1 call of :func:`vocab_parallel_cross_entropy` is
counted, the first gather of such a plan's step notes the count, and its first reduce raises on
every rank (before its collective: every rank runs the same loss code) if the count did not
move, as attention over cp is checked. Checked once per plan: the first step. The loss itself
checks that it is given a ``colwise_loss`` layer's columns (``out_features / tp`` of them).

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

import torch
import torch.nn.functional as F
from torch import nn

from fsdpfn import comm as C
from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn._plan.axes import Role
from fsdpfn._plan.tp_styles import style_row
from fsdpfn.transforms._axes import ep_group, tp_group, tp_rank
from fsdpfn.transforms._guards import TP_ATTR, install_batch_check, install_split_watch, watch_output

__all__ = ["apply_tp", "check_loss_reduce", "note_loss_gather", "reference_mode", "vocab_parallel_cross_entropy"]

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


def _apply_ep(model: nn.Module, plan: Plan | PipelinedPlan) -> None:
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


def _vocab_lookup(group, rank, tag):
    """An Embedding split by its rows: ids outside this rank's slice look up row 0 and their
    rows are zeroed, so the all-reduce over tp sums each id's one true row."""
    inside: list[torch.Tensor] = []  # the pre-hook's mask, for the hook after the layer

    def before(module, args):
        if _REFERENCE[0]:
            return None
        ids = args[0]
        rows = module.weight.shape[0]
        local = ids - rank * rows
        mask = (local >= 0) & (local < rows)
        inside.append(mask)
        return (torch.where(mask, local, torch.zeros_like(local)), *args[1:])

    def after(module, args, output):
        if _REFERENCE[0]:
            return None
        mask = inside.pop()
        return C.tp_reduce(output * mask.unsqueeze(-1).to(output.dtype), group, tag=tag)

    return before, after


# Process state: vocab_parallel_cross_entropy calls so far, and per plan with a colwise_loss layer
# the count at its first gather and whether a step of it was seen calling the loss. Keyed by plan:
# the pure path's step is a function call with no object of its own to carry them.
_LOSS_CALLS = [0]
_LOSS_MARKS: dict[str, int] = {}
_LOSS_VERIFIED: set[str] = set()


def _loss_layers(plan: Plan) -> list[str]:
    if plan.axes.size(Role.TP) == 1:
        return []
    return [m for m, style in plan.tp if style_row(style).gives == "logits"]


def note_loss_gather(plan: Plan) -> None:
    """Called at each unit gather: the first of a split-logits plan's unchecked step notes the
    count ([Note: logits split for a loss that never came])."""
    if plan.fingerprint not in _LOSS_VERIFIED and _loss_layers(plan):
        _LOSS_MARKS.setdefault(plan.fingerprint, _LOSS_CALLS[0])


def check_loss_reduce(plan: Plan) -> None:
    """Called at each unit reduce, before its collective: raises if the step since the plan's
    first gather never called :func:`vocab_parallel_cross_entropy`."""
    if plan.fingerprint in _LOSS_VERIFIED:
        return
    mark = _LOSS_MARKS.pop(plan.fingerprint, None)
    if mark is None:
        return
    if _LOSS_CALLS[0] == mark:
        layers = _loss_layers(plan)
        raise ValueError(
            f"tp splits {layers[0]!r} 'colwise_loss', so the model returns each tp rank's columns of the logits, but "
            "this step's loss never called fsdpfn.vocab_parallel_cross_entropy: a loss that reads them as whole rows "
            "(F.cross_entropy) trains wrong. Compute the loss with fsdpfn.vocab_parallel_cross_entropy(logits, "
            f"targets, plan), or split {layers[0]!r} 'colwise_gather' to get whole logits back"
        )
    _LOSS_VERIFIED.add(plan.fingerprint)


class _VocabParallelCE(torch.autograd.Function):
    """[Note: the loss over a split vocabulary]: per-token losses from ``(N, V / tp)`` logits."""

    @staticmethod
    def forward(logits, targets, group, rank, ignore_index):
        with torch._C._DisableFuncTorch():
            x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the softmax's sums: float32 or wider
            rows = x.shape[-1]
            peak = x.max(-1).values
            C.all_reduce(peak, group, op="max", tag="vocab_max").wait()
            shifted = x - peak.unsqueeze(-1)
            exp = shifted.exp()
            local = targets - rank * rows
            mine = (local >= 0) & (local < rows) & (targets != ignore_index)
            at = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)
            picked = torch.where(mine, shifted.gather(-1, at).squeeze(-1), torch.zeros_like(peak))
            sums = torch.stack([exp.sum(-1), picked], dim=-1)
            C.all_reduce(sums, group, tag="vocab_sum").wait()
            loss = torch.where(targets != ignore_index, sums[:, 0].log() - sums[:, 1], torch.zeros_like(peak))
            return loss, exp.div_(sums[:, :1]), at.squeeze(-1), mine

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, targets = inputs[:2]
        _, softmax, at, mine = output
        ctx.mark_non_differentiable(softmax, at, mine)
        ctx.save_for_backward(softmax, at, mine, targets)
        ctx.dtype, ctx.ignore_index = logits.dtype, inputs[4]

    @staticmethod
    def backward(ctx, g, *_):
        softmax, at, mine, targets = ctx.saved_tensors
        with torch._C._DisableFuncTorch():
            grad = softmax.clone()
            grad.scatter_add_(-1, at.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
            grad.mul_((g * (targets != ctx.ignore_index)).unsqueeze(-1))
            return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, plan: Plan, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy`` of logits split over the vocabulary across ``plan``'s tp axis (the
    output of a ``"colwise_loss"`` Linear), without ever gathering a whole row: see [Note: the
    loss over a split vocabulary]. Differentiable under ``loss.backward()`` and
    ``torch.func.grad``; with tp = 1, ``F.cross_entropy`` itself.

    Args:
      logits: ``(..., V / tp)``, this rank's columns of the logits.
      targets: ``(...)``, class indices into the whole vocabulary (the same on every tp rank).
      plan: the plan whose tp axis splits the vocabulary.
      ignore_index: targets with this value count for nothing (as ``F.cross_entropy``).
      reduction: ``"mean"`` (over the targets not ignored), ``"sum"`` or ``"none"``.

    Example:
      >>> logits = torch.randn(2, 8, 64)  # one process: the whole vocabulary
      >>> loss = fsdpfn.vocab_parallel_cross_entropy(logits, y, plan)
      >>> torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)))
      True
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not fit: "
            "the logits are the targets' shape plus this rank's slice of the vocabulary"
        )
    size = plan.axes.size(Role.TP)
    if size == 1:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
        ).reshape(targets.shape if reduction == "none" else ())
    if plan.mesh is None:
        raise ValueError("vocab_parallel_cross_entropy needs a plan bound to a mesh; bind one with plan.bind(mesh)")
    layers = _loss_layers(plan)
    if not layers:
        raise ValueError(
            f"vocab_parallel_cross_entropy: the plan splits no output layer 'colwise_loss' over its tp axis (tp={size}), "
            "so its logits are whole on every rank: use F.cross_entropy, or split the output Linear with "
            "tp={'<head>': 'colwise_loss'}"
        )
    names = set(plan.param_names)
    widths = {m: plan.param(f"{m}.weight").shape[0] for m in layers if f"{m}.weight" in names}
    if widths and logits.shape[-1] * size not in widths.values():
        m, rows = next(iter(widths.items()))
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} have {logits.shape[-1]} columns, but the plan's "
            f"'colwise_loss' layer {m!r} splits its {rows} outputs over tp={size}: {rows // size} a rank. Pass that "
            "layer's output, as the model returns it"
        )
    _LOSS_CALLS[0] += 1
    flat = targets.reshape(-1)
    per_token = _VocabParallelCE.apply(
        logits.reshape(-1, logits.shape[-1]), flat, tp_group(plan), tp_rank(plan), ignore_index
    )[0]
    if reduction == "none":
        return per_token.reshape(targets.shape)
    total = per_token.sum()
    return total if reduction == "sum" else total / (flat != ignore_index).sum().clamp(min=1)


def _post_reduce(group, tag):
    def hook(module, args, output):
        if _REFERENCE[0]:
            return None
        return C.tp_reduce(output, group, tag=tag)

    return hook


def apply_tp(model: nn.Module, plan: Plan | PipelinedPlan) -> nn.Module:
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
        # The style's row says what the layer exchanges ([Note: a tp style's row]): the hooks
        # below are those exchanges, the same ones the op list prices.
        row = style_row(style)
        handles = []
        if row.lookup:  # the ids' rows in this rank's slice; the all-reduce sums each id's one row
            before, after = _vocab_lookup(group, tp_rank(plan), name)
            handles += [mod.register_forward_pre_hook(before), mod.register_forward_hook(after)]
        if row.backward == "all_reduce":
            handles.append(mod.register_forward_pre_hook(_pre_copy(group, name)))
        if row.gives == "split" and row.parts == 1:  # [Note: a fused layout split plainly]
            handles.append(mod.register_forward_hook(watch_output(name)))
        if row.forward == "all_gather":
            handles.append(mod.register_forward_hook(_post_gather(group, name)))
        if row.forward == "all_reduce" and not row.lookup:
            handles.append(mod.register_forward_hook(_post_reduce(group, name)))
        setattr(mod, _ATTR, (plan.fingerprint, plan.mesh, handles))
    return model
