"""Muon in layers: :func:`scale_by_muon` (momentum + distributed Newton–Schulz), the learning
rate and weight decay of ``torch.optim.Muon``, and :func:`muon`, which sends hidden matrices to
Muon and everything else to AdamW.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Union

import optree
import torch
from torch import nn

from fsdpfn.optim._base import GradientTransformation, chain, partition
from fsdpfn.optim._blocks import Blocks, block_shape, check_blocks
from fsdpfn.optim._checks import check_choice, check_real, check_schedule
from fsdpfn.optim._distributed_ns import LAYOUTS, check_buckets, ns_block_spec, orthogonalize
from fsdpfn.optim._newton_schulz import DEFAULT_GRAM_RESTARTS, DEFAULT_NS_COEFFS, check_settings
from fsdpfn.optim._schedules import ScalarOrSchedule
from fsdpfn.optim._sgd_adamw import adamw
from fsdpfn.optim._tree import like, local, map_local, named_leaves, zeros_like_tree

__all__ = ["MuonLRState", "ScaleByMuonState", "muon", "muon_labels", "scale_by_muon", "scale_by_muon_lr"]

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_norm")
_MOMENTUM_FIX = (
    "It is the old buffer's weight in lerp(b, g, 1 - momentum): at 1 the buffer never moves. 0.95 is the reference."
)


def _check_muon(
    who: str, momentum, nesterov, ns_steps, ns_coeffs, eps, ns_dtype, layout, ns_method, gram_restarts, blocks, buckets
):
    """Every setting of :func:`scale_by_muon`, named as ``who``'s caller wrote them: the momentum
    and the block spec function."""
    momentum = check_real(who, "momentum", momentum, lo=0.0, hi=1.0, hi_open=True, fix=_MOMENTUM_FIX)
    if not isinstance(nesterov, bool):
        raise ValueError(f"{who}: nesterov={nesterov!r} is invalid: nesterov must be True or False.")
    check_settings(who, ns_steps, ns_coeffs, eps, ns_dtype, ns_method, gram_restarts, prefix="ns_", min_steps=1)
    check_choice(who, "layout", layout, LAYOUTS)
    check_buckets(who, buckets)
    return momentum, check_blocks(who, blocks)


def _leaf_specs(spec_fn, names: list[str], leaves: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each leaf's block spec, checked against its shape (a ``ValueError`` naming the leaf)."""
    specs = [spec_fn(n, x) for n, x in zip(names, leaves)]
    for n, x, s in zip(names, leaves, specs):
        if x.dim() >= 2:
            block_shape(n, tuple(x.shape), s)
    return specs


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
    blocks: Blocks = None,
    buckets: int | None = None,
) -> GradientTransformation:
    """Momentum, then Newton–Schulz orthogonalisation of every leaf's matrices (or blocks).

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
      layout: ``"owner"`` (each matrix orthogonalised once, by one rank, assembled there from
        its data- and tensor-parallel pieces), ``"duplicated"`` (every rank orthogonalises
        every matrix; ``"gather"`` is the same) or ``"blockwise"`` (each tensor-parallel piece
        orthogonalised alone: the update then depends on the tp degree). ``"owner"`` and
        ``"duplicated"`` give the one-process update bit for bit on any mesh.
      ns_method, gram_restarts: ``"standard"`` (``torch.optim.Muon``'s iteration) or ``"gram"``
        (the same polynomial computed on the Gram matrix: fewer FLOPs on matrices wider than
        1.5:1, equal up to rounding); see :func:`newton_schulz`.
      blocks: orthogonalise some leaves as independent blocks (per attention head, per
        expert): ``None`` (whole matrices), a dict ``{name or fnmatch pattern: spec}`` or a
        function ``(name, param) -> spec``, a spec being an int ``m`` (``m`` row blocks), a pair
        ``(m, n)`` (``m`` x ``n`` blocks) or ``None``; see :func:`head_blocks` and
        ``fsdpfn/optim/_blocks.py``, [Note: blocks].
      buckets: owner layout: buckets whose all-to-all runs under another bucket's Newton–Schulz
        (``None``: chosen from the bytes sent; ``1``: no pipelining). Same bits for every choice
        (``fsdpfn/optim/_owner.py``, [Note: the pipelined owner layout]).

    Raises:
      ValueError: when built, on every rank alike: ``momentum`` outside ``[0, 1)``, ``ns_steps``
        not an int >= 1, ``ns_coeffs`` not three finite numbers, ``eps`` not > 0, ``ns_dtype``
        not a floating dtype or ``None``, an unknown ``layout`` or ``ns_method``, restarts
        outside ``1 .. ns_steps-1``, a malformed block spec, ``buckets`` not ``None`` or an int
        >= 1. At ``init``/``update``: a leaf its blocks do not divide (named). The message names
        the setting.

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
    # Now, on every rank, not at the first step on the ranks that own a matrix.
    momentum, spec_fn = _check_muon(
        "scale_by_muon",
        momentum,
        nesterov,
        ns_steps,
        ns_coeffs,
        eps,
        ns_dtype,
        layout,
        ns_method,
        gram_restarts,
        blocks,
        buckets,
    )

    def init(params):
        names, leaves, _ = named_leaves(params)
        # A blocks dict: each pattern must select a leaf ([Note: pattern rule]); a tree with no
        # Muon leaf at all (an AdamW-only param group of TorchOptimizer) has nothing to cut.
        if names and hasattr(spec_fn, "check_names"):
            spec_fn.check_names(names)
        _leaf_specs(spec_fn, names, leaves)  # blocks that do not fit: named now
        return ScaleByMuonState(zeros_like_tree(params))

    def update(updates, state, params=None):
        buf = map_local(lambda b, g: b.lerp(g, 1 - momentum), state.momentum_buffer, updates)
        direction = map_local(lambda g, b: g.lerp(b, momentum), updates, buf) if nesterov else buf
        names, leaves, spec = named_leaves(direction)
        specs = _leaf_specs(spec_fn, names, leaves)
        ortho = orthogonalize(
            leaves,
            names,
            layout=layout,
            steps=ns_steps,
            coeffs=ns_coeffs,
            eps=eps,
            dtype=ns_dtype,
            method=ns_method,
            gram_restarts=gram_restarts,
            blocks=specs,
            buckets=buckets,
        )
        out = [like(x, local(o).to(local(x).dtype)) for x, o in zip(leaves, ortho)]
        return optree.tree_unflatten(spec, out), ScaleByMuonState(buf)

    return GradientTransformation(init, update)


def _lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str) -> float:
    """The factor on ``lr`` for an orthogonal update of ``shape`` (the last two dimensions:
    ``rows = fan_out``, ``cols = fan_in`` in ``nn.Linear``'s layout); see
    :func:`scale_by_muon_lr`."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "spectral_norm":
        return math.sqrt(rows / cols)
    return 0.2 * math.sqrt(max(rows, cols))


class MuonLRState(NamedTuple):
    """State of :func:`scale_by_muon_lr`: ``count``, updates done so far (int)."""

    count: int  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states


def scale_by_muon_lr(
    lr: ScalarOrSchedule,
    weight_decay: float = 0.0,
    adjust_lr_fn: str | None = "original",
    blocks: Blocks = None,
    layout: str = "owner",
) -> GradientTransformation:
    """``-lr * ratio(shape) * o - lr * weight_decay * p``: ``torch.optim.Muon``'s step after the
    orthogonalisation, as an update.

    ``ratio`` depends on the orthogonalised matrix's ``rows x cols``: the last two dimensions of
    the block each Newton–Schulz ran on, whose update is orthogonal block by block (the global
    shape; one of the ``blocks``; with ``layout="blockwise"``, one tensor-parallel piece, or one
    of the ``blocks`` inside it). ``rows`` is ``fan_out`` and ``cols`` ``fan_in`` in ``nn.Linear``'s
    ``(out, in)`` layout:

    - ``"original"``: ``max(1, rows/cols) ** 0.5``. Keller Jordan's Muon and
      ``torch.optim.Muon``'s default: tall matrices get a larger step so that the update's RMS
      does not shrink with the aspect ratio.
    - ``"match_rms_adamw"``: ``0.2 * max(rows, cols) ** 0.5``. Moonlight: the update's RMS is
      0.2, about AdamW's, so AdamW's learning rate and weight decay carry over.
    - ``"spectral_norm"``: ``(rows/cols) ** 0.5``, with no clamp at 1. The spectral condition for
      feature learning: an update of spectral norm ``sqrt(fan_out / fan_in)`` changes each
      layer's features by a width-independent amount, so the learning rate transfers across
      widths; wide matrices (``fan_in > fan_out``) get a smaller step, which ``"original"``
      clamps away. The same rule as Dion's ``adjust_lr="spectral_norm"``.

    Weight decay is decoupled and uses the unadjusted ``lr``.

    Args:
      lr: a number >= 0 or a schedule of the step count (called at step 0 when built, and its
        value checked at every step).
      weight_decay: decoupled weight decay, >= 0.
      adjust_lr_fn: ``"original"``, ``"match_rms_adamw"``, ``"spectral_norm"``, or ``None`` for
        ``"original"``.
      blocks: the block specs :func:`scale_by_muon` used (the ratio is then the block's).
      layout: the ``layout`` :func:`scale_by_muon` used: ``"blockwise"`` orthogonalises each
        tensor-parallel piece alone, so the ratio is the piece's (read off the update's
        placements); the other layouts orthogonalise whole matrices (or ``blocks``).

    Raises:
      ValueError: a setting is out of range (the message names it), raised when built.

    Example:
      >>> opt = fsdpfn.optim.scale_by_muon_lr(0.1, adjust_lr_fn="original")
      >>> u, _ = opt.update({"w": torch.ones(4, 1)}, opt.init(None))
      >>> u["w"].flatten()
      tensor([-0.2000, -0.2000, -0.2000, -0.2000])
      >>> opt = fsdpfn.optim.scale_by_muon_lr(0.1, adjust_lr_fn="spectral_norm")
      >>> opt.update({"w": torch.ones(1, 4)}, opt.init(None))[0]["w"]
      tensor([[-0.0500, -0.0500, -0.0500, -0.0500]])

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/ ("original");
      Jingyuan Liu et al., "Muon is Scalable for LLM Training" (Moonlight), 2025,
      https://arxiv.org/abs/2502.16982 ("match_rms_adamw");
      Greg Yang, James B. Simon, Jeremy Bernstein, "A Spectral Condition for Feature Learning",
      2023, https://arxiv.org/abs/2310.17813 ("spectral_norm").
    """
    who = "scale_by_muon_lr"
    schedule = check_schedule(who, "lr", lr)
    weight_decay = check_real(who, "weight_decay", weight_decay, lo=0.0)
    adjust_lr_fn = check_choice(who, "adjust_lr_fn", adjust_lr_fn, (None, *ADJUST_LR_FNS)) or "original"
    spec_fn = check_blocks(who, blocks)
    check_choice(who, "layout", layout, LAYOUTS)

    def update(updates, state, params=None):
        step_lr = schedule(state.count)
        if weight_decay and params is None:
            raise ValueError(
                "scale_by_muon_lr with weight_decay != 0 needs the parameters: call update(grads, state, params)"
            )
        names, leaves, spec = named_leaves(updates)
        ps = spec.flatten_up_to(params) if weight_decay else [None] * len(leaves)
        out = []
        for name, u, p in zip(names, leaves, ps):
            shape = tuple(u.shape)
            if len(shape) >= 2:  # the block Newton–Schulz ran on, as scale_by_muon chose it
                shape = block_shape(name, shape, ns_block_spec(u, name, spec_fn(name, u), layout))
            new = local(u).mul(-step_lr * _lr_ratio(shape, adjust_lr_fn))
            if weight_decay:
                new = new.sub_(local(p).to(new.dtype), alpha=step_lr * weight_decay)
            out.append(like(u, new))
        return optree.tree_unflatten(spec, out), MuonLRState(state.count + 1)

    return GradientTransformation(lambda params: MuonLRState(0), update)


# ---------------------------------------------------------------------------------------------
# muon = partition({"muon": ..., "adamw": ...}, labels)
# ---------------------------------------------------------------------------------------------

_NOT_HIDDEN = frozenset(
    {"embed", "embedding", "embeddings", "pos", "head", "lm_head", "wte", "wpe", "output", "classifier", "logits"}
)
# A component that spells an embedding in any of the usual ways: emb, tok_emb, pos_emb,
# token_embedding, word_embeddings, embed_tokens, unembed (the output side of a tied pair), or a
# position table by its prefix (pos_table, pos_enc: a bare parameter the module rule gives AdamW).
_EMBEDDING = re.compile(r"(^|_)(un)?emb(ed|eds|edding|eddings)?($|_)|^pos_")

# [Note: which parameters Muon takes]
# Muon is for hidden matrices. An embedding's rows are looked up one token at a time, the output
# layer maps features to logits, and vectors (norms, biases) are no matrices: all three go to
# AdamW (Keller Jordan's Muon, Moonlight). Names cannot tell them apart (`emb`, `tok_emb`,
# `classifier` and `unembed` are all common), so `muon_labels(model)` reads the modules:
#   - a parameter of an nn.Embedding (or EmbeddingBag), or the same tensor tied elsewhere: AdamW;
#   - a 0-D or 1-D parameter: AdamW;
#   - the output layer's parameters: AdamW. It is the last nn.Linear in registration order,
#     unless that one sits inside a repeated block (an element of an nn.ModuleList, or of an
#     nn.Sequential with another element of its type: the head was registered earlier, or
#     there is none), when it refuses to guess and asks for head=;
#   - a bare parameter of the model itself (a position table, a class token): AdamW;
#   - every other parameter (nn.Linear weights, attention in-projections, convolutions, packed
#     experts): Muon.
# Without a model, optim.muon's default labels can only read names: muon_labels(name, param).


def _by_name(name: str, param: torch.Tensor) -> str:
    parts = name.split(".")
    hidden = not any(p in _NOT_HIDDEN or p.startswith("embed") or _EMBEDDING.search(p) for p in parts)
    return "muon" if param.dim() >= 2 and hidden else "adamw"


def _in_repeated_block(name: str, mods: dict[str, nn.Module]) -> str | None:
    """The repeated block module ``name`` lies inside (not the module itself), or ``None``: an
    element of an ``nn.ModuleList``, or of an ``nn.Sequential`` with another element of its
    type (a ``Sequential`` head, ``Linear, GELU, Linear``, holds no block)."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        container = mods.get(".".join(parts[:i]))
        element = ".".join(parts[: i + 1])
        if isinstance(container, nn.ModuleList):
            return element
        if isinstance(container, nn.Sequential):
            kind = type(mods[element])
            if sum(type(c) is kind for c in container.children()) > 1:
                return element
    return None


def _head_names(model: nn.Module, head: Any) -> tuple[str, ...]:
    mods = dict(model.named_modules())
    linears = [n for n, m in mods.items() if isinstance(m, nn.Linear)]
    if head is None:
        return ()
    if head != "auto":
        names = (head,) if isinstance(head, str) else tuple(head)
        for n in names:
            if not isinstance(mods.get(n), nn.Linear):
                raise ValueError(
                    f"muon_labels: head={n!r} names no nn.Linear of {type(model).__name__}; its nn.Linear modules are "
                    f"{linears[-8:]!r}{' (the last 8)' if len(linears) > 8 else ''}. Pass the output layer's module name, or head=None."
                )
        return names
    if not linears:
        return ()
    last = linears[-1]
    block = _in_repeated_block(last, mods)
    if block is None:
        return (last,)
    outside = [n for n in linears if _in_repeated_block(n, mods) is None]
    example = outside[-1] if outside else "<module name>"
    raise ValueError(
        f"muon_labels: cannot tell the output layer of {type(model).__name__}: its last nn.Linear, {last!r}, lies inside "
        f"the repeated block {block!r}, so it looks hidden. Name the layer that produces the output, e.g. "
        f"optim.muon(labels=optim.muon_labels(model, head={example!r})) (nn.Linear modules outside repeated blocks: "
        f"{', '.join(map(repr, outside)) or 'none'}), or head=None if the model has none; or pass "
        "labels={name: 'muon' | 'adamw'} yourself."
    )


def muon_labels(model: nn.Module | str, param: torch.Tensor | None = None, *, head: Any = "auto") -> Any:
    """Which parameters :func:`muon` gives to Muon: ``"muon"`` for hidden matrices, ``"adamw"``
    for embeddings, the output layer, norms, biases and scalars.

    ``muon_labels(model)`` decides by what each parameter is (see [Note: which parameters Muon
    takes] in ``fsdpfn/optim/_muon.py``): parameters of ``nn.Embedding`` modules and tensors
    tied to them, 0-D/1-D parameters, the output layer (the last ``nn.Linear`` registered;
    ``head=`` names it when that one sits in a repeated block) and bare parameters of the root
    module go to AdamW; every other parameter to Muon. It returns ``{name: label}`` for every
    name a parameter goes by (``named_parameters(remove_duplicate=False)``), to pass as
    ``muon(labels=...)``.

    ``muon_labels(name, param)`` is the rule :func:`muon` uses when it is given no labels and
    sees only the parameter tree: by name, ``"adamw"`` for a path with a component that spells
    an embedding (``embed*``, ``emb``, ``tok_emb``, ``token_embedding``, ``unembed``, ...),
    ``pos`` or ``pos_*``, ``head``, ``lm_head``, ``wte``, ``wpe``, ``output``, ``classifier`` or
    ``logits``, or a parameter below 2-D; ``"muon"`` otherwise. A model whose head has another name (``fc``,
    ``proj``) needs ``labels=muon_labels(model)``.

    Args:
      model: the model (or, with ``param``, one parameter's dotted name).
      param: with a name: the parameter (only its number of dimensions is read).
      head: the output layer's module name (or a tuple of names), ``None`` when the model has
        none, or ``"auto"``: the last ``nn.Linear`` registered.

    Returns:
      ``{name: "muon" | "adamw"}`` for a model, one label for a name and parameter.

    Raises:
      ValueError: ``head="auto"`` and the last ``nn.Linear`` lies inside a repeated block (an
        element of an ``nn.ModuleList``, or of an ``nn.Sequential`` with another element of its
        type; the message lists the candidates and the fix), or ``head`` names no ``nn.Linear``.
      TypeError: ``model`` is neither a module nor a name with its parameter.

    Example:
      >>> class Classifier(nn.Module):
      ...     def __init__(self):
      ...         super().__init__()
      ...         self.tok_emb = nn.Embedding(10, 4)
      ...         self.hidden = nn.Linear(4, 4)
      ...         self.classifier = nn.Linear(4, 3)
      >>> fsdpfn.optim.muon_labels(Classifier())
      {'tok_emb.weight': 'adamw', 'hidden.weight': 'muon', 'hidden.bias': 'adamw', 'classifier.weight': 'adamw', 'classifier.bias': 'adamw'}
      >>> opt = fsdpfn.optim.muon(lr=0.02, labels=fsdpfn.optim.muon_labels(Classifier()))
      >>> muon_labels("blocks.0.fc.weight", torch.zeros(8, 4)), muon_labels("embed.weight", torch.zeros(8, 4))
      ('muon', 'adamw')
    """
    if isinstance(model, str) and isinstance(param, torch.Tensor):
        return _by_name(model, param)
    if not isinstance(model, nn.Module) or param is not None:
        raise TypeError(
            f"muon_labels takes a model (muon_labels(model)) or a parameter's name and the parameter "
            f"(muon_labels(name, param)), got {type(model).__name__} and {type(param).__name__}"
        )
    heads = _head_names(model, head)
    mods = dict(model.named_modules())
    adamw_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }
    adamw_ids |= {id(p) for n in heads for p in mods[n].parameters(recurse=False)}
    labels = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{mname}.{pname}" if mname else pname
            other = p.dim() < 2 or id(p) in adamw_ids or not mname
            labels[name] = "adamw" if other else "muon"
    # A tensor goes by several names when tied: one label for all (AdamW if any role says so).
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)] = "adamw" if labels[name] == "adamw" else by_id.get(id(p), "muon")
    return {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


LabelFn = Callable[[str, torch.Tensor], str]


def _labels_tree(labels: Union[None, nn.Module, LabelFn, Mapping[str, str]]) -> Callable[[Any], Any]:
    if labels is None:
        fn: LabelFn = muon_labels
    elif isinstance(labels, nn.Module):  # callable too, but not a label function
        return _labels_tree(muon_labels(labels))
    elif callable(labels):
        fn = labels
    elif isinstance(labels, Mapping):
        table = dict(labels)

        def fn(name, param):
            if name not in table:
                raise ValueError(
                    f"muon: parameter {name!r} has no entry in labels; give it 'muon' or 'adamw' (or pass a function)"
                )
            return table[name]
    else:
        raise ValueError(
            f"muon: labels must be None, a model (its parameters labelled by muon_labels(model)), a function (name, param) -> "
            f"label or a dict {{name: label}}, got {type(labels).__name__}"
        )

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
    labels: Union[None, nn.Module, LabelFn, Mapping[str, str]] = None,
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    blocks: Blocks = None,
    buckets: int | None = None,
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
      adjust_lr_fn: ``"original"``, ``"match_rms_adamw"`` or ``"spectral_norm"`` (see
        :func:`scale_by_muon_lr`).
      layout: distributed Newton–Schulz, ``"owner"``, ``"duplicated"`` (alias ``"gather"``) or
        ``"blockwise"`` (see :func:`scale_by_muon`; the learning-rate ratio is then each
        tensor-parallel piece's, as for ``blocks``).
      ns_method, gram_restarts: ``"standard"`` or ``"gram"`` and the latter's restart
        iterations (see :func:`newton_schulz`; ``"gram"`` is not bitwise ``torch.optim.Muon``).
      labels: which parameters Muon takes. The model (``labels=model``, the same as
        ``labels=muon_labels(model)``: decided by module type and role, so embeddings and the
        output layer go to AdamW whatever they are called), a dict ``{name: label}`` covering
        every parameter, a function ``(name, param) -> "muon" | "adamw"``, or ``None``:
        :func:`muon_labels` by name (``embed*``, ``pos``, ``head``, ``lm_head``, ``wte``,
        ``wpe``, ``output`` and vectors to AdamW), for trees with no model at hand. Names are
        the dotted tree paths (the keys of ``fsdpfn.shard``'s dict).
      adamw_lr: AdamW learning rate; ``None`` uses ``lr``.
      adamw_betas, adamw_eps: AdamW settings.
      adamw_weight_decay: AdamW weight decay; ``None`` uses ``weight_decay``.
      blocks: Muon leaves orthogonalised as independent blocks, e.g. per attention head with
        :func:`head_blocks` (see :func:`scale_by_muon`); the learning-rate ratio then uses the
        block's shape.
      buckets: the owner layout's pipelining (see :func:`scale_by_muon`).

    Raises:
      ValueError: a setting is out of range (as in :func:`scale_by_muon`,
        :func:`scale_by_muon_lr` and :func:`adamw`: the message names this function's argument,
        e.g. ``adamw_betas``), or ``labels=model`` cannot tell the output layer (see
        :func:`muon_labels`), raised when built, on every rank, before any collective.

    Example:
      >>> opt = fsdpfn.optim.muon(lr=0.02)
      >>> params = {"fc.weight": torch.randn(8, 16), "fc.bias": torch.zeros(8)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
      >>> params = fsdpfn.optim.apply_updates(params, updates)
      >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
      >>> opt = fsdpfn.optim.muon(lr=0.02, labels=model)  # embedding and head by module, not by name

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/;
      Jingyuan Liu et al., "Muon is Scalable for LLM Training" (Moonlight), 2025,
      https://arxiv.org/abs/2502.16982;
      Greg Yang, James B. Simon, Jeremy Bernstein, "A Spectral Condition for Feature Learning",
      2023, https://arxiv.org/abs/2310.17813
    """
    # Checked under this function's names first, so that an error names the argument passed here
    # (adamw_betas, not adamw's b1); the factories below check again and agree.
    who = "muon"
    check_schedule(who, "lr", lr)
    _check_muon(
        who, momentum, nesterov, ns_steps, ns_coeffs, eps, ns_dtype, layout, ns_method, gram_restarts, blocks, buckets
    )
    check_real(who, "weight_decay", weight_decay, lo=0.0)
    check_choice(who, "adjust_lr_fn", adjust_lr_fn, (None, *ADJUST_LR_FNS))
    if adamw_lr is not None:
        check_schedule(who, "adamw_lr", adamw_lr)
    _check_betas(who, "adamw_betas", adamw_betas)
    check_real(who, "adamw_eps", adamw_eps, lo=0.0)
    if adamw_weight_decay is not None:
        check_real(who, "adamw_weight_decay", adamw_weight_decay, lo=0.0)
    labels_tree = _labels_tree(labels)
    muon_part = chain(
        scale_by_muon(
            momentum, nesterov, ns_steps, ns_coeffs, eps, ns_dtype, layout, ns_method, gram_restarts, blocks, buckets
        ),
        scale_by_muon_lr(lr, weight_decay, adjust_lr_fn, blocks, layout),
    )
    adam_part = adamw(
        lr if adamw_lr is None else adamw_lr,
        adamw_betas[0],
        adamw_betas[1],
        adamw_eps,
        weight_decay if adamw_weight_decay is None else adamw_weight_decay,
    )
    return partition({"muon": muon_part, "adamw": adam_part}, labels_tree)


def _check_betas(who: str, name: str, betas: Any) -> None:
    try:
        pair = tuple(betas)
    except TypeError:
        pair = ()
    if len(pair) != 2:
        raise ValueError(f"{who}: {name}={betas!r} is invalid: {name} must be a pair (b1, b2), e.g. (0.9, 0.999).")
    for i, b in enumerate(pair):
        check_real(
            who, f"{name}[{i}]", b, lo=0.0, hi=1.0, hi_open=True, fix="Decay rates are in [0, 1), e.g. (0.9, 0.999)."
        )
