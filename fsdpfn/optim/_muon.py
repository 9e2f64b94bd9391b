"""Muon in layers: :func:`scale_by_muon` (momentum + distributed Newton–Schulz), the learning
rate and weight decay of ``torch.optim.Muon``, and :func:`muon`, which sends hidden matrices to
Muon and everything else to AdamW.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Union

import optree
import torch

from fsdpfn.optim._base import GradientTransformation, chain, partition
from fsdpfn.optim._distributed_ns import LAYOUTS, orthogonalize
from fsdpfn.optim._newton_schulz import DEFAULT_GRAM_RESTARTS, DEFAULT_NS_COEFFS, NS_METHODS, check_method
from fsdpfn.optim._schedules import ScalarOrSchedule, resolve
from fsdpfn.optim._sgd_adamw import adamw
from fsdpfn.optim._tree import like, local, map_local, named_leaves, zeros_like_tree

__all__ = ["MuonLRState", "ScaleByMuonState", "muon", "muon_labels", "scale_by_muon", "scale_by_muon_lr"]

ADJUST_LR_FNS = ("original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`.

    Attributes:
      momentum_buffer: a tree like the parameters (same dtype and placements: sharded, never
        replicated, when the parameters are).
    """

    momentum_buffer: Any


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | None = torch.bfloat16,
    layout: str = "owner",
    ns_method: str = "standard",
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS,
) -> GradientTransformation:
    """Momentum, then Newton–Schulz orthogonalisation of every leaf's matrices.

    ``b = lerp(b, g, 1 - momentum)``; the direction is ``lerp(g, b, momentum)`` with nesterov,
    else ``b``; the update is :func:`newton_schulz` of it, cast back to the gradient's dtype (no
    learning rate: see :func:`scale_by_muon_lr`). Momentum is elementwise on local shards; the
    orthogonalisation needs whole matrices and runs in the chosen distributed ``layout`` (see
    ``fsdpfn/optim/_distributed_ns.py``, [Note: the two layouts]). Leaves with more than two
    dimensions are batches of matrices (the last two dimensions), each orthogonalised alone.

    Args:
      momentum: momentum factor.
      nesterov: use Nesterov momentum.
      ns_steps, ns_coeffs, eps: Newton–Schulz iterations, coefficients and norm floor.
      ns_dtype: Newton–Schulz compute dtype: ``torch.bfloat16`` (as ``torch.optim.Muon``) or
        ``torch.float32``; ``None`` keeps the gradient's dtype.
      layout: ``"owner"`` (each matrix orthogonalised once, by one rank) or ``"gather"``
        (every rank orthogonalises every matrix).
      ns_method, gram_restarts: ``"standard"`` (``torch.optim.Muon``'s iteration) or ``"gram"``
        (the same polynomial computed on the Gram matrix: fewer FLOPs on matrices wider than
        1.5:1, equal up to rounding); see :func:`newton_schulz`.

    Example:
      >>> opt = fsdpfn.optim.scale_by_muon()
      >>> g = {"w": torch.randn(8, 16)}
      >>> o, _ = opt.update(g, opt.init(g))
      >>> o["w"].dtype
      torch.float32

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/
    """
    if momentum < 0:
        raise ValueError(f"scale_by_muon: momentum must be >= 0, got {momentum}")
    if layout not in LAYOUTS:
        raise ValueError(f"scale_by_muon: layout must be one of {LAYOUTS}, got {layout!r}")
    if ns_method not in NS_METHODS:
        raise ValueError(f"scale_by_muon: ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    check_method(ns_method, ns_steps, gram_restarts)  # now, not at the first step

    def init(params):
        return ScaleByMuonState(zeros_like_tree(params))

    def update(updates, state, params=None):
        buf = map_local(lambda b, g: b.lerp(g, 1 - momentum), state.momentum_buffer, updates)
        direction = map_local(lambda g, b: g.lerp(b, momentum), updates, buf) if nesterov else buf
        names, leaves, spec = named_leaves(direction)
        ortho = orthogonalize(
            leaves, names, layout=layout, steps=ns_steps, coeffs=ns_coeffs, eps=eps, dtype=ns_dtype, method=ns_method, gram_restarts=gram_restarts
        )
        out = [like(x, local(o).to(local(x).dtype)) for x, o in zip(leaves, ortho)]
        return optree.tree_unflatten(spec, out), ScaleByMuonState(buf)

    return GradientTransformation(init, update)


def _lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str) -> float:
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


class MuonLRState(NamedTuple):
    """State of :func:`scale_by_muon_lr`: ``count``, updates done so far (int)."""

    count: int


def scale_by_muon_lr(lr: ScalarOrSchedule, weight_decay: float = 0.0, adjust_lr_fn: str | None = "original") -> GradientTransformation:
    """``-lr * ratio(shape) * o - lr * weight_decay * p``: ``torch.optim.Muon``'s step after the
    orthogonalisation, as an update.

    ``ratio`` is ``max(1, rows/cols) ** 0.5`` (``"original"``, Keller Jordan) or
    ``0.2 * max(rows, cols) ** 0.5`` (``"match_rms_adamw"``, Moonlight: the update's RMS matches
    AdamW's so AdamW's learning rate and weight decay carry over), with rows and cols the last two
    dimensions of the global shape. Weight decay is decoupled and uses the unadjusted ``lr``.

    Example:
      >>> opt = fsdpfn.optim.scale_by_muon_lr(0.1, adjust_lr_fn="original")
      >>> u, _ = opt.update({"w": torch.ones(4, 1)}, opt.init(None))
      >>> u["w"].flatten()
      tensor([-0.2000, -0.2000, -0.2000, -0.2000])

    References:
      Jingyuan Liu et al., "Muon is Scalable for LLM Training" (Moonlight), 2025,
      https://arxiv.org/abs/2502.16982
    """
    adjust_lr_fn = "original" if adjust_lr_fn is None else adjust_lr_fn
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS} (or None for 'original'), got {adjust_lr_fn!r}")
    schedule = resolve(lr)

    def update(updates, state, params=None):
        step_lr = schedule(state.count)
        if weight_decay and params is None:
            raise ValueError("scale_by_muon_lr with weight_decay != 0 needs the parameters: call update(grads, state, params)")

        def leaf(u, p=None):
            new = local(u).mul(-step_lr * _lr_ratio(tuple(u.shape), adjust_lr_fn))
            if weight_decay:
                new = new.sub_(local(p).to(new.dtype), alpha=step_lr * weight_decay)
            return like(u, new)

        new = optree.tree_map(leaf, updates, params) if weight_decay else optree.tree_map(leaf, updates)
        return new, MuonLRState(state.count + 1)

    return GradientTransformation(lambda params: MuonLRState(0), update)


# ---------------------------------------------------------------------------------------------
# muon = partition({"muon": ..., "adamw": ...}, labels)
# ---------------------------------------------------------------------------------------------

_NOT_HIDDEN = frozenset({"embed", "embedding", "embeddings", "pos", "head", "lm_head", "wte", "wpe", "output"})


def muon_labels(name: str, param: torch.Tensor) -> str:
    """The default labels of :func:`muon`: ``"muon"`` for hidden matrices (>= 2-D, no path
    component naming an embedding or the output head: ``embed*``, ``pos``, ``head``,
    ``lm_head``, ``wte``, ``wpe``, ``output``), ``"adamw"`` for the rest (embeddings, head, norms,
    biases, scalars).

    Example:
      >>> muon_labels("blocks.0.fc.weight", torch.zeros(8, 4)), muon_labels("embed.weight", torch.zeros(8, 4))
      ('muon', 'adamw')
    """
    parts = name.split(".")
    hidden = not any(p in _NOT_HIDDEN or p.startswith("embed") for p in parts)
    return "muon" if param.dim() >= 2 and hidden else "adamw"


LabelFn = Callable[[str, torch.Tensor], str]


def _labels_tree(labels: Union[None, LabelFn, Mapping[str, str]]) -> Callable[[Any], Any]:
    if labels is None:
        fn: LabelFn = muon_labels
    elif callable(labels):
        fn = labels
    elif isinstance(labels, Mapping):
        table = dict(labels)

        def fn(name, param):
            if name not in table:
                raise ValueError(f"muon: parameter {name!r} has no entry in labels; give it 'muon' or 'adamw' (or pass a function)")
            return table[name]
    else:
        raise ValueError(f"muon: labels must be None, a function (name, param) -> label or a dict {{name: label}}, got {type(labels).__name__}")

    def tree(params):
        names, leaves, spec = named_leaves(params)
        return optree.tree_unflatten(spec, [fn(n, p) for n, p in zip(names, leaves)])

    return tree


def muon(
    lr: ScalarOrSchedule = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.1,
    ns_steps: int = 5,
    ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | None = torch.bfloat16,
    adjust_lr_fn: str | None = "original",
    layout: str = "owner",
    ns_method: str = "standard",
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS,
    labels: Union[None, LabelFn, Mapping[str, str]] = None,
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
) -> GradientTransformation:
    """Muon for hidden matrices, AdamW for everything else.

    ``partition({"muon": chain(scale_by_muon(...), scale_by_muon_lr(...)), "adamw": adamw(...)},
    labels)``. On 2-D parameters the update is ``torch.optim.Muon``'s (see the tests for which
    parts are bitwise).

    Args:
      lr: Muon learning rate (a number or a schedule).
      momentum, nesterov: Muon momentum.
      weight_decay: decoupled weight decay of the Muon parameters.
      ns_steps, ns_coeffs, eps, ns_dtype: Newton–Schulz settings (see :func:`newton_schulz`).
      adjust_lr_fn: ``"original"`` or ``"match_rms_adamw"`` (see :func:`scale_by_muon_lr`).
      layout: distributed Newton–Schulz, ``"owner"`` or ``"gather"``.
      ns_method, gram_restarts: ``"standard"`` or ``"gram"`` and the latter's restart
        iterations (see :func:`newton_schulz`; ``"gram"`` is not bitwise ``torch.optim.Muon``).
      labels: ``None`` (:func:`muon_labels`), a function ``(name, param) -> "muon" | "adamw"``,
        or a dict ``{name: label}`` covering every parameter. Names are the dotted tree paths
        (the keys of ``fsdpfn.shard``'s dict).
      adamw_lr: AdamW learning rate; ``None`` uses ``lr``.
      adamw_betas, adamw_eps: AdamW settings.
      adamw_weight_decay: AdamW weight decay; ``None`` uses ``weight_decay``.

    Example:
      >>> opt = fsdpfn.optim.muon(lr=0.02)
      >>> params = {"fc.weight": torch.randn(8, 16), "fc.bias": torch.zeros(8)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
      >>> params = fsdpfn.optim.apply_updates(params, updates)

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/;
      Jingyuan Liu et al., "Muon is Scalable for LLM Training" (Moonlight), 2025,
      https://arxiv.org/abs/2502.16982
    """
    muon_part = chain(
        scale_by_muon(momentum, nesterov, ns_steps, ns_coeffs, eps, ns_dtype, layout, ns_method, gram_restarts),
        scale_by_muon_lr(lr, weight_decay, adjust_lr_fn),
    )
    adam_part = adamw(
        lr if adamw_lr is None else adamw_lr,
        adamw_betas[0],
        adamw_betas[1],
        adamw_eps,
        weight_decay if adamw_weight_decay is None else adamw_weight_decay,
    )
    return partition({"muon": muon_part, "adamw": adam_part}, _labels_tree(labels))
