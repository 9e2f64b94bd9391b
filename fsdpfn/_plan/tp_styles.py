"""The tensor-parallel module styles, one row each: what every reader of a style needs.

A ``tp=`` entry names a module and a style. Several readers act on it: the plan builder (which
module class the style splits, its parameters' placements, which sizes must divide by tp), the
layout rules (which layers need a partner, which split attention heads), the op list (the
activation exchanges it adds, and their widths), the runtime's module hooks, the checks of a
step, and the simulator's one-rank profile. Each of them reads the row's fields, never the
style's name, so a style is one row of :data:`TP_STYLE_TABLE` and its behaviours are words
each reader already knows.

[Note: a tp style's row]
- ``module``: the class of module it splits (``nn.Linear``, or ``nn.Embedding`` for ``"vocab"``).
- ``split_dim``: the weight dim cut over tp: 0 (a Linear's output features, an Embedding's
  vocabulary rows) or 1 (a Linear's input features). A bias follows dim 0, or is a partial sum
  added once when the input features are cut (see ``module_placement``).
- ``parts``: the output's fused parts cut separately (``"colwise_fused:k"``: ``k``).
- ``takes``: ``"whole"`` or ``"split"``: whether the input arrives split over tp.
- ``gives``: ``"split"`` (the output stays split for a partner), ``"whole"`` (made whole again
  by the forward exchange), or ``"logits"`` (split over the vocabulary for the loss over split
  logits, which has its own exchanges).
- ``forward``: the forward's exchange of the output over tp: ``"all_reduce"`` (partial sums),
  ``"all_gather"`` (column blocks), or ``None``.
- ``backward``: the backward's exchange of the input's gradient over tp (``"all_reduce"``: each
  rank's part of the input's gradient is a partial sum when the input is whole), or ``None``.
- ``lookup``: the input is ids looked up in this rank's slice of the rows (out-of-slice ids
  give zero rows before the all-reduce).

Derived: a style needs a ``rowwise`` partner when it ``gives`` ``"split"``, a ``colwise`` one
when it ``takes`` ``"split"``; its layer splits activations (so its module's heads must divide
by tp) when either side is split; its rows are a vocabulary (padded to a multiple of tp) when
it is an Embedding's or ``gives`` ``"logits"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fsdpfn._plan.axes import Role

__all__ = ["TpStyle", "TP_STYLE_TABLE", "TP_FUSED_PREFIX", "tp_style", "style_row", "style_names", "one_tp_rank"]

# A colwise Linear whose output is k projections side by side (q|k|v-major ``qkv(x).chunk(3, -1)``,
# HF GPT-2's layout; a fused gate|up ``chunk(2, -1)``) is split "colwise_fused:k": each tp rank
# takes its slice of every part, so its local output still chunks into k local parts (see
# [Note: fused colwise]).
TP_FUSED_PREFIX = "colwise_fused:"


@dataclasses.dataclass(frozen=True)
class TpStyle:
    """One tensor-parallel module style (see [Note: a tp style's row]).

    Example:
      >>> s = tp_style("rowwise")
      >>> (s.split_dim, s.takes, s.gives, s.forward, s.needs_partner)
      (1, 'split', 'whole', 'all_reduce', 'colwise')
    """

    name: str
    module: type
    split_dim: int
    takes: str
    gives: str
    forward: str | None = None
    backward: str | None = None
    lookup: bool = False
    parts: int = 1
    doc: str = ""

    @property
    def needs_partner(self) -> str | None:
        """The style a partner layer beside it must have: ``"rowwise"`` to take a split output,
        ``"colwise"`` to make a split input; ``None``: it stands alone."""
        if self.gives == "split":
            return "rowwise"
        if self.takes == "split":
            return "colwise"
        return None

    @property
    def leaves_split(self) -> bool:
        """Its output leaves the layer split over tp (for a partner, or for the loss)."""
        return self.gives in ("split", "logits")

    @property
    def splits_activations(self) -> bool:
        """Its layer computes on a 1/tp part of the activations (so whole heads per rank)."""
        return self.takes == "split" or self.leaves_split

    @property
    def vocabulary(self) -> bool:
        """Its split rows are a vocabulary: they must divide over tp (Megatron pads them)."""
        return self.lookup or self.gives == "logits"

    def out_width(self, weight_shape) -> int:
        """The width of one token's output, from the module's weight shape."""
        return int(weight_shape[1] if self.module is nn.Embedding else weight_shape[0])

    def in_width(self, weight_shape) -> int:
        """The width of one token's input (a Linear's ``in_features``)."""
        return int(weight_shape[1])

    def one_rank_hook(self, module: nn.Module, tp: int):
        """Hooks ``module``, which holds one tp rank's part of its weight and runs without the
        exchanges, so that a one-process run (``fsdpfn.sim.profile``) computes what one rank of
        the step does and passes on what the exchange would: a gathered output widened back to
        the whole width, ids of the whole vocabulary folded into the rank's rows (the lookup's
        cost, not its rows). Returns the hook's handle, or ``None`` when the part alone is right.

        Example:
          >>> lin = nn.Linear(4, 3)  # one rank's 3 of 6 output features
          >>> h = tp_style("colwise_gather").one_rank_hook(lin, 2)
          >>> lin(torch.zeros(5, 4)).shape
          torch.Size([5, 6])
        """
        if self.forward == "all_gather":
            return module.register_forward_hook(lambda m, args, out: torch.cat([out] * tp, -1))
        if self.lookup:
            return module.register_forward_pre_hook(lambda m, args: (args[0] % m.weight.shape[0], *args[1:]))
        return None


TP_STYLE_TABLE: tuple[TpStyle, ...] = (
    TpStyle(
        "colwise",
        nn.Linear,
        split_dim=0,
        takes="whole",
        gives="split",
        backward="all_reduce",
        doc="split by output features; the output stays split for a rowwise partner",
    ),
    TpStyle(
        "colwise_gather",
        nn.Linear,
        split_dim=0,
        takes="whole",
        gives="whole",
        forward="all_gather",
        backward="all_reduce",
        doc="split by output features; the output is all-gathered back",
    ),
    TpStyle(
        "rowwise",
        nn.Linear,
        split_dim=1,
        takes="split",
        gives="whole",
        forward="all_reduce",
        doc="split by input features; the input arrives split, the output is all-reduced",
    ),
    TpStyle(
        "vocab",
        nn.Embedding,
        split_dim=0,
        takes="whole",
        gives="whole",
        forward="all_reduce",
        lookup=True,
        doc="an Embedding split by its vocabulary rows; each rank looks up its slice, the outputs are all-reduced",
    ),
    TpStyle(
        "colwise_loss",
        nn.Linear,
        split_dim=0,
        takes="whole",
        gives="logits",
        backward="all_reduce",
        doc="the output Linear split by its vocabulary; the logits stay split for fsdpfn.vocab_parallel_cross_entropy",
    ),
)
_BY_NAME = {s.name: s for s in TP_STYLE_TABLE}


def style_names() -> tuple[str, ...]:
    """The styles a ``tp=`` entry may name besides ``"replicate"`` and ``"colwise_fused:k"``.

    Example:
      >>> style_names()
      ('colwise', 'colwise_gather', 'rowwise', 'vocab', 'colwise_loss')
    """
    return tuple(_BY_NAME)


def tp_style(name: str) -> TpStyle | None:
    """The row of style ``name``; ``"colwise_fused:k"`` (``k >= 2``) is ``"colwise"`` cut in
    ``k`` parts. ``None`` for an unknown name.

    Example:
      >>> tp_style("colwise_fused:3").parts, tp_style("colwise_fused:1"), tp_style("diagonal")
      (3, None, None)
    """
    if not isinstance(name, str):
        return None
    row = _BY_NAME.get(name)
    if row is not None:
        return row
    if name.startswith(TP_FUSED_PREFIX):
        k = name[len(TP_FUSED_PREFIX) :]
        if k.isdigit() and k == str(int(k)) and int(k) >= 2:
            return dataclasses.replace(_BY_NAME["colwise"], name=name, parts=int(k))
    return None


def style_row(name: str) -> TpStyle:
    """The row of style ``name``, which a plan holds (validated when it was built).

    Example:
      >>> style_row("vocab").lookup
      True
    """
    row = tp_style(name)
    if row is None:
        raise ValueError(
            f"unknown tensor-parallel style {name!r}; choose one of {', '.join(style_names())} or {TP_FUSED_PREFIX}k"
        )
    return row


# plan: a PlanValues (fsdpfn/_plan/values.py reads this table, so it is not imported here).
def one_tp_rank(model: nn.Module, plan: Any, params: dict[str, torch.Tensor]) -> tuple[dict, list]:
    """What a one-process run of ``model`` (``torch.func.functional_call`` with the returned
    parameters) needs to compute what one tp rank of ``plan`` computes: each parameter split
    over tp cut to the first rank's part (every rank's has the same shape; expert weights stay
    whole, a profile runs every expert), and each split module's :meth:`TpStyle.one_rank_hook`.
    Remove the hooks' handles after the run. A plan without tp gives ``params`` back, no hooks.

    Example:
      >>> tp_plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=fsdpfn.models.GPT_TP_PLAN)
      >>> parts, hooks = one_tp_rank(model, tp_plan, dict(model.named_parameters()))
      >>> parts["blocks.0.qkv.weight"].shape[0] * 2 == model.blocks[0].qkv.weight.shape[0]
      True
      >>> for h in hooks: h.remove()
    """
    t = plan.axes.size(Role.TP)
    if not plan.tp or t == 1:
        return params, []
    parts = {}
    for n, p in params.items():
        cuts = [e for e in plan.param(n).placements if e.axis is Role.TP and e.placement.is_split and e.size > 1]
        parts[n] = (
            cuts[0].placement.part(p.detach(), cuts[0].size, 0).contiguous().requires_grad_(p.requires_grad)
            if cuts
            else p
        )
    modules = dict(model.named_modules())
    hooks = [h for name, style in plan.tp if (h := style_row(style).one_rank_hook(modules[name], t)) is not None]
    return parts, hooks
