"""Tensor-parallel layouts the plan can see are wrong, refused when the plan is built.

A ``tp=`` dict names Linear layers one by one, so it can split one layer of a pair and not the
other, or split attention into pieces that are not whole heads. Nothing fails at once: the
forward either computes something else (a split ``q_proj`` beside a whole ``k_proj`` attends over
mismatched heads, and trains) or fails deep inside the model with a shape error. Every rule here
reads only the model's modules and the plan's styles, so every rank raises the same error before
any collective.

[Note: tp layout rules]
For each module ``P`` whose Linear children tp splits (in model order):

1. *Every Linear child of P is split or marked.* A Linear beside split ones sees (or makes) split
   activations, so it is split too or explicitly ``"replicate"`` in ``tp=`` (a layer that really
   sees whole activations, e.g. a router).
2. *colwise layers have rowwise partners.* A ``colwise`` (or ``colwise_fused:k``) layer's output
   stays split, so a ``rowwise`` layer must take it and all-reduce; a ``rowwise`` layer's input
   must come split from a colwise one. The partner is a sibling (Megatron's and HF's attention and
   MLP blocks), or, failing that, a layer in a sibling module (BERT's ``attention.self.query``
   and ``attention.output.dense``). ``colwise_gather`` needs none: its output is whole again;
   nor does ``colwise_loss``, whose logits go split to the vocabulary-parallel loss. A
   layer marked ``"replicate"`` beside them must not read a split output: one whose input width
   only a colwise sibling makes (and no rowwise sibling takes) is refused.
3. *Whole heads per rank.* Head counts the module states (``heads``, ``num_heads``,
   ``num_key_value_heads``, ...; for a Hugging Face attention module, its ``config``'s) must
   divide by tp: attention splits by heads, and a kv head cannot be shared across ranks.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Mapping

from torch import nn

from fsdpfn._plan.tp_styles import style_row

__all__ = ["check_tp_layout", "HEAD_ATTRS"]

# Attributes under which attention modules state their head counts (fsdpfn's GPT and Llama,
# nanoGPT, HF configs and older HF modules).
HEAD_ATTRS = (
    "heads",
    "kv_heads",
    "n_head",
    "n_heads",
    "n_kv_heads",
    "num_heads",
    "num_kv_heads",
    "num_attention_heads",
    "num_key_value_heads",
)


def _label(name: str) -> str:
    return repr(name) if name else "the model itself"


def _pattern(name: str) -> str:
    """``name`` with its list indices as ``*``: the tp= key that names it in every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _leaves_split(style: str) -> bool:
    """The layer's output stays split over tp (for a partner, or for the loss)."""
    return style_row(style).leaves_split


def _takes_split(style: str) -> bool:
    return style_row(style).takes == "split"


def _head_counts(mod: nn.Module) -> dict[str, int]:
    counts = {
        a: getattr(mod, a)
        for a in HEAD_ATTRS
        if isinstance(getattr(mod, a, None), int) and not isinstance(getattr(mod, a), bool)
    }
    config = getattr(mod, "config", None)
    if not counts and config is not None and hasattr(mod, "head_dim"):  # HF attention: counts live in its config
        counts = {
            f"config.{a}": getattr(config, a)
            for a in HEAD_ATTRS
            if isinstance(getattr(config, a, None), int) and not isinstance(getattr(config, a), bool)
        }
    return counts


def check_tp_layout(model: nn.Module, tp: Mapping[str, str], styles: Mapping[str, str], tp_size: int) -> None:
    """Raises ``ValueError`` naming the module and the fix when ``styles`` (``{Linear name: style}``
    from ``tp``) breaks one of the rules of [Note: tp layout rules].

    Example:
      >>> check_tp_layout(model, {"blocks.*.qkv": "colwise"}, {"blocks.0.qkv": "colwise"}, 2)
      Traceback (most recent call last):
      ...
      ValueError: module 'blocks.0' (Block) has Linear layers split over tp (qkv: colwise) beside ones left whole (proj, fc, out)...
    """
    modules = dict(model.named_modules())
    marked = {
        n
        for n in modules
        if n and any(str(st) == "replicate" and fnmatch.fnmatchcase(n, pat) for pat, st in tp.items())
    }
    parents = list(dict.fromkeys(name.rpartition(".")[0] for name in styles))
    for parent in sorted(parents, key=list(modules).index):
        mod = modules[parent]
        children = {f"{parent}.{c}" if parent else c: m for c, m in mod.named_children()}
        linears = [n for n, m in children.items() if isinstance(m, nn.Linear)]
        split = [n for n in linears if n in styles]
        whole = [n for n in linears if n not in styles and n not in marked]
        short = lambda n: n.rpartition(".")[2]  # noqa: E731
        if whole:
            shown = ", ".join(f"{short(n)}: {styles[n]}" for n in split)
            raise ValueError(
                f"module {_label(parent)} ({type(mod).__name__}) has Linear layers split over tp ({shown}) beside ones left whole "
                f"({', '.join(short(n) for n in whole)}): those see split activations, or make whole ones the split layers "
                "cannot take (a q_proj split without its k_proj and v_proj attends over mismatched heads, with no error). "
                f"Split them too (e.g. tp={{{_pattern(whole[0])!r}: ...}}): the layer a colwise layer's output feeds is its 'rowwise' "
                "partner, a layer reading the same input as a colwise one is 'colwise' too, and a colwise layer whose output must "
                f"be whole is 'colwise_gather'; or, if one really takes and makes whole activations, mark it "
                f"tp={{{_pattern(whole[0])!r}: 'replicate'}}"
            )
        for n in split:
            _check_partner(n, styles, modules, parent)
        _check_replicated_readers(
            parent, [n for n in linears if n in marked and n not in styles], split, styles, children
        )
        if any(style_row(styles[n]).splits_activations for n in split):
            for attr, count in _head_counts(mod).items():
                if count % tp_size:
                    raise ValueError(
                        f"module {_label(parent)} ({type(mod).__name__}) has {attr} = {count}, which does not divide over tp={tp_size} "
                        f"ranks, but tp splits its layers ({', '.join(short(n) for n in split)}): each tp rank must hold whole "
                        f"attention heads (and whole key/value heads). Choose a tp degree that divides every head count, or "
                        f"leave {_pattern(parent) or 'its layers'}'s layers out of tp="
                    )


def _check_replicated_readers(
    parent: str, replicated: list[str], split: list[str], styles: Mapping[str, str], children: Mapping[str, nn.Module]
) -> None:
    """Rule 2 for a layer marked ``"replicate"``: it reads whole activations, so no split output
    may feed it. Which layer feeds which is only known when the forward runs; the widths tell
    it here: a marked layer whose input width only a split sibling makes, and no rowwise sibling
    takes, would get that sibling's 1/tp slice (MLP's ``out`` marked beside a colwise ``fc``
    while attention's ``proj`` is the block's one rowwise layer)."""
    for n in replicated:
        width = children[n].in_features
        feeders = [s for s in split if _leaves_split(styles[s]) and children[s].out_features == width]
        takers = [s for s in split if _takes_split(styles[s]) and children[s].in_features == width]
        if feeders and not takers:
            feeder = feeders[0]
            raise ValueError(
                f"tp marks {n!r} 'replicate' (it reads whole activations), but its input width ({width}) is the output of "
                f"{feeder!r}, which {styles[feeder]!r} leaves split over tp, and no 'rowwise' layer in {_label(parent)} takes that "
                f"width: {n!r} would get a 1/tp slice (the matmul fails on a shape, or computes on a part). Make it "
                f"{feeder.rpartition('.')[2]}'s rowwise partner (tp={{{_pattern(n)!r}: 'rowwise'}}), or split {_pattern(feeder)!r} "
                "'colwise_gather' to gather its output back"
            )


def _check_partner(name: str, styles: Mapping[str, str], modules: Mapping[str, nn.Module], parent: str) -> None:
    style = styles[name]
    row = style_row(style)
    if row.needs_partner is None:  # whole again, or split for the loss: no partner
        return
    # A partner takes this layer's split output, or makes its split input.
    wants_rowwise = row.gives == "split"
    fits = _takes_split if wants_rowwise else _leaves_split
    siblings = [n for n in styles if n != name and n.rpartition(".")[0] == parent]
    grand = parent.rpartition(".")[0] if parent else None
    cousins = (
        []
        if grand is None
        else [n for n in styles if n.rpartition(".")[0].rpartition(".")[0] == grand and n.rpartition(".")[0] != parent]
    )
    if any(fits(styles[n]) for n in siblings) or any(fits(styles[n]) for n in cousins):
        return
    if wants_rowwise:
        raise ValueError(
            f"tp splits {name!r} {style!r}, so its output stays split over tp, but no layer beside it is 'rowwise' to take it "
            "and all-reduce (the next matmul would fail on a shape, or compute on a part). Add its rowwise partner (the Linear "
            f"its output feeds, beside it in {_label(_pattern(parent))}: tp={{'<its name>': 'rowwise'}}), or use 'colwise_gather' "
            "to gather its output back"
        )
    raise ValueError(
        f"tp splits {name!r} {style!r}, so its input must arrive split over tp, but no layer beside it is 'colwise' to split "
        "it (each rank would multiply the whole input by its part of the weight). Add its colwise partner (the layer feeding "
        "it), or leave it out of tp="
    )
