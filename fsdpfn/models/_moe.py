"""A small mixture-of-experts MLP: top-k router, packed expert weights, load-balancing loss, and
experts optionally sharded over an expert-parallel group with the tokens exchanged by
differentiable all-to-alls (:func:`fsdpfn.comm.ep_all_to_all`).

[Note: expert-parallel dispatch]
Each rank routes its own tokens. Every (token, choice) pair goes to the rank holding its expert
(experts ``[r E/ep, (r+1) E/ep)`` live on rank ``r``): pairs are sorted by expert (stable, so
ties keep token order), the per-expert counts are exchanged (one small all-to-all of integers),
the rows travel by one all-to-all, each rank runs its experts on the rows it received (grouped
by expert), and the outputs go back by the transposed all-to-all and are summed per token with
the router's weights. Gradients follow the same path backwards, so an expert's weight gradient
on its rank is the sum over every rank's tokens routed to it. With ``ep = 1`` (no group) the
same code runs with every expert local and the all-to-alls exchange nothing.

[Note: expert capacity]
With ``capacity_factor`` set, each expert takes at most
``ceil(capacity_factor * tokens * top_k / experts)`` (token, choice) pairs from one call of the
layer, ``tokens`` the rows of that call: the rank-local batch of the rank that routes them, as
in Megatron-LM's ``moe_expert_capacity_factor`` (its ``get_capacity`` of ``tokens * top_k``).
The pairs an expert keeps are the first ones in token order (a token's row index in the call):
Megatron's ``moe_token_drop_policy="position"``, GShard's and Switch's order. A dropped pair is
never sent; its combine weight is 0 (the others keep their weights, not renormalised), so a
token whose every choice is dropped leaves the layer as zeros and passes through the block's
residual alone. By default an expert gets its kept rows only, so capacity bounds the rows an
expert receives from each rank, ``ep`` times capacity in all; ``pad_to_capacity`` pads them
([Note: padded dispatch]). The load-balancing loss counts the router's choices before dropping.
Because capacity is counted per call, a step on ``ep x edp`` ranks equals one process that calls
the layer once per rank's batch (not once on the concatenated batch, which would count capacity
over every rank's tokens together).

[Note: padded dispatch]
With ``pad_to_capacity`` (GShard's and Switch's dispatch, Megatron-LM's
``moe_pad_expert_input_to_capacity``) each expert has ``capacity`` slots per call: a kept pair
goes to slot ``expert x capacity + its place among its expert's pairs`` (token order, as
above), a dropped pair to one spare slot past the end, which is discarded. The slots, ``[ep
ranks, local experts, capacity, width]``, travel by one all-to-all of equal parts, each expert
runs on its ``ep x capacity`` rows (zero rows where no pair came), and the outputs come back by
the transposed all-to-all; each pair reads its slot's row (the spare one reads zeros). Every
size is a function of the call's token count, none of the router's choices: no counts travel,
and a compiled step holds the exchange as it holds a gather. The rows an expert computes are
those of the routed layer plus zero rows, so outputs, drops and gradients are the routed
layer's; the padding costs ``experts x capacity`` rows on the wire per call and the experts'
FLOPs on them.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from fsdpfn import comm as C

__all__ = ["Experts", "MoE", "MoEConfig"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of :class:`MoE`.

    Attributes:
      width: token width.
      hidden: each expert's hidden width.
      experts: number of experts.
      top_k: experts per token.
      aux_weight: weight of the load-balancing loss in :meth:`MoE.forward`'s second output.
      capacity_factor: ``None``: no dropping (every expert takes every token routed to it).
        A number ``> 0``: each expert takes at most ``ceil(capacity_factor * tokens * top_k /
        experts)`` (token, choice) pairs per call, the first ones in token order, and the
        overflowing pairs are dropped ([Note: expert capacity]). The factor counts as written
        in decimal (``1.1`` is 11/10, so 20 tokens, top-1, 2 experts give 11, not 12).
      pad_to_capacity: each expert's rows padded with zero rows to its capacity, as GShard and
        Switch do (Megatron-LM's ``moe_pad_expert_input_to_capacity``): every size of the step
        then follows from the batch's shape, not from the router's choices, which
        :func:`fsdpfn.compile` needs to make one graph of an expert-parallel step ([Note:
        padded dispatch]). The padding costs wire bytes and expert FLOPs; the results are
        those of the unpadded layer. Needs ``capacity_factor``.

    Raises:
      TypeError: ``capacity_factor`` is neither ``None`` nor a number; ``pad_to_capacity`` is
        not a bool.
      ValueError: ``capacity_factor`` is not finite or not ``> 0``; ``pad_to_capacity`` without
        a ``capacity_factor``.

    Example:
      >>> fsdpfn.models.MoEConfig(experts=8, top_k=2, capacity_factor=1.25).capacity(64)  # ceil(1.25 * 64 * 2 / 8)
      20
    """

    width: int = 16
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    aux_weight: float = 0.01
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    # capacity_factor as the exact ratio of two ints (see capacity()).
    _ratio: tuple[int, int] = dataclasses.field(init=False, repr=False, compare=False, default=(0, 1))

    def __post_init__(self):
        c = self.capacity_factor
        if not isinstance(self.pad_to_capacity, bool):
            raise TypeError(f"MoEConfig: pad_to_capacity must be a bool, got {self.pad_to_capacity!r}")
        if self.pad_to_capacity and c is None:
            raise ValueError(
                "MoEConfig: pad_to_capacity=True pads each expert's rows to its capacity, so it needs a capacity_factor "
                "(e.g. capacity_factor=1.25); without one an expert's rows are unbounded"
            )
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise TypeError(
                f"MoEConfig: capacity_factor={c!r} ({type(c).__name__}) must be a number > 0 such as 1.25, or None for no dropping"
            )
        if not math.isfinite(c) or c <= 0:
            raise ValueError(
                f"MoEConfig: capacity_factor={c!r} must be a finite number > 0 (each expert then takes at most "
                "ceil(capacity_factor * tokens * top_k / experts) tokens per call, e.g. 1.25), or None for no dropping"
            )
        # Exact arithmetic on the factor as written: 1.1 * 20 * 1 / 2 is 11.000000000000002 in
        # floats (capacity 12), but 11 with 1.1 read as 11/10. Kept as ints, which a compiled
        # step reads as constants.
        object.__setattr__(self, "_ratio", fractions.Fraction(repr(float(c))).as_integer_ratio())

    def capacity(self, tokens: int) -> int | None:
        """Most (token, choice) pairs one expert takes from a call on ``tokens`` rows; ``None``
        without a ``capacity_factor``."""
        if self.capacity_factor is None:
            return None
        num, den = self._ratio
        return -(-num * tokens * self.top_k // (den * self.experts))  # the ceiling, in ints


class Experts(nn.Module):
    """The packed expert weights of :class:`MoE` and the experts' computation, a module of its
    own so that a plan on a mesh with an ``ep`` axis makes it a unit that holds expert weights
    only (its :attr:`expert_params`).

    Expert ``e`` computes ``gelu(x @ w1[e].T) @ w2[e].T``; ``w1`` is ``[E, hidden, width]`` and
    ``w2`` ``[E, width, hidden]`` (``E`` the experts held here).

    Example:
      >>> ex = fsdpfn.models.Experts(experts=2, width=4, hidden=8)
      >>> ex(torch.randn(5, 4), [[3, 2]]).shape  # 3 rows for expert 0, then 2 for expert 1
      torch.Size([5, 4])
    """

    # The packed expert weights (dim 0: the expert index), which a plan splits over ``ep``.
    expert_params = ("w1", "w2")

    def __init__(
        self,
        experts: int,
        width: int,
        hidden: int,
        total: int | None = None,
        top_k: int = 0,
        padded_capacity: float | None = None,
    ):
        super().__init__()
        self.num_experts = experts if total is None else total  # over every ep rank
        self.top_k = top_k  # experts per token, for the cost of the token exchange (0: unknown)
        # The capacity factor its layer pads each expert's rows to (None: rows as routed), which
        # sets what the token exchange carries.
        self.padded_capacity = padded_capacity
        self.w1 = nn.Parameter(torch.randn(experts, hidden, width) * width**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, width, hidden) * hidden**-0.5)

    def reset_parameters(self) -> None:
        """Draws the weights again, as built: normal with std ``1 / sqrt(fan_in)``."""
        with torch.no_grad():
            self.w1.normal_(0.0, self.w1.shape[-1] ** -0.5)
            self.w2.normal_(0.0, self.w2.shape[-1] ** -0.5)

    def forward(self, inbox: torch.Tensor, counts: list[list[int]] | None = None) -> torch.Tensor:
        """Rows ``inbox`` grouped by source, then by expert: ``counts[s][e]`` rows of source ``s``
        for local expert ``e``. Returns each row's expert output, in the same order.
        ``counts=None``: ``inbox`` is ``[sources, E, capacity, width]``, each source's rows for
        each local expert padded to capacity, and the output has its layout (see
        :meth:`padded`)."""
        if counts is None:
            return self.padded(inbox)
        local = self.w1.shape[0]
        if any(len(row) != local for row in counts):
            held = len(counts[0])
            if local < held:  # a rank's share of the experts, routed as if every expert were here
                raise ValueError(
                    f"Experts: called with {local} experts' weights (one ep rank's share of {self.num_experts}), but its MoE "
                    f"layer routes over {held} experts here: the layer was never given the ep group, so it would not send "
                    "tokens to the ranks holding their experts. Call fsdpfn.apply_tp(model, plan) on the model instance "
                    "you run (fsdpfn.shard(model, plan) and fsdpfn.runtime.Runtime(model, plan) do it for the model they "
                    "are given, not for a copy, nor when you shard a state_dict)"
                )
            raise ValueError(
                f"Experts: called with {local} experts' weights for counts of {held} experts per rank; under expert "
                "parallelism call the layer with this rank's experts (what fsdpfn.unshard gives), or set_ep_group(None) on "
                "the MoE layer for the whole layer"
            )
        flat = [c for row in counts for c in row]
        starts = [sum(flat[:i]) for i in range(len(flat))]
        outs: list = [None] * len(flat)
        for e in range(local):
            idx = torch.cat(
                [torch.arange(starts[s * local + e], starts[s * local + e] + counts[s][e]) for s in range(len(counts))]
            )
            h = F.gelu(inbox[idx] @ self.w1[e].T) @ self.w2[e].T
            off = 0
            for s in range(len(counts)):
                c = counts[s][e]
                outs[s * local + e] = h[off : off + c]
                off += c
        return torch.cat(outs) if outs else inbox

    def padded(self, inbox: torch.Tensor) -> torch.Tensor:
        """Rows ``inbox`` ``[sources, E, capacity, width]``: each source's rows for each local
        expert, padded to capacity. Returns every row's expert output, in the same layout (a
        padding row's output is discarded by the caller)."""
        s, local, cap, d = inbox.shape
        if local != self.w1.shape[0]:
            raise ValueError(
                f"Experts.padded: rows for {local} experts per source, but {self.w1.shape[0]} experts' weights here; "
                "call the layer with this rank's experts (what fsdpfn.unshard gives)"
            )
        rows = inbox.transpose(0, 1).reshape(local, s * cap, d)
        # One F.linear per expert, on the weights themselves: a batched matmul would read them
        # through a transposed view, which a compiled step keeps for its backward instead of
        # gathering a zero3 unit's weights again.
        h = torch.stack([F.linear(F.gelu(F.linear(rows[e], self.w1[e])), self.w2[e]) for e in range(local)])
        return h.view(local, s, cap, d).transpose(0, 1)


class MoE(nn.Module):
    """Top-k mixture-of-experts MLP over a token matrix ``[N, width]``.

    Expert ``e`` computes ``gelu(x @ w1[e].T) @ w2[e].T``; ``experts.w1`` (``[E, hidden, width]``)
    and ``experts.w2`` (``[E, width, hidden]``, an :class:`Experts` module) pack the experts along
    dim 0, so Muon orthogonalises each
    expert's matrices alone (a batch of matrices). The router is a bias-free linear layer; a
    token's ``top_k`` experts are weighted by their softmax probabilities renormalised over the
    chosen ones. The load-balancing loss is Switch Transformer's, ``E * sum_e f_e P_e`` (``f_e``
    the fraction of (token, choice) pairs sent to expert ``e``, ``P_e`` its mean probability),
    times ``aux_weight``. With ``cfg.capacity_factor`` each expert takes at most a fixed number
    of tokens per call and the rest are dropped, the first ones in token order kept ([Note:
    expert capacity]); :attr:`dropped` says how many (token, choice) pairs the last call dropped.

    Under :func:`fsdpfn.plan` on a mesh with an ``ep`` axis, build the whole model (no
    ``ep_group``): ``experts.w1`` and ``experts.w2`` are listed in ``Experts.expert_params``, so the plan splits
    them over ``ep``, and :func:`fsdpfn.shard` / :class:`fsdpfn.runtime.Runtime` point the layer
    at the ``ep`` group (:meth:`set_ep_group`).

    Args:
      cfg: sizes.
      ep_group: an expert-parallel process group: this rank holds experts
        ``[r E/ep, (r+1) E/ep)`` only (``r`` its rank in the group), and tokens are exchanged
        with the other ranks ([Note: expert-parallel dispatch]). ``None``: every expert here.

    Raises:
      ValueError: ``experts`` does not divide over the group, or ``top_k`` is not in
        ``1 .. experts`` (named, when built, before any collective). A bad ``capacity_factor`` is
        named by :class:`MoEConfig` itself.
      TypeError: ``cfg`` is not a :class:`MoEConfig`.

    Example:
      >>> moe = fsdpfn.models.MoE(fsdpfn.models.MoEConfig(width=8, hidden=16, experts=4, top_k=2))
      >>> y, aux = moe(torch.randn(5, 8))
      >>> y.shape, aux.dim()
      (torch.Size([5, 8]), 0)
    """

    def __init__(self, cfg: MoEConfig = MoEConfig(), ep_group=None):
        super().__init__()
        self._route(cfg, ep_group)
        self.router = nn.Linear(cfg.width, cfg.experts, bias=False)
        # (token, choice) pairs the last forward dropped for capacity (0 without capacity_factor).
        self.dropped = 0
        pad = cfg.capacity_factor if cfg.pad_to_capacity else None
        self.experts = Experts(
            self.local, cfg.width, cfg.hidden, total=cfg.experts, top_k=cfg.top_k, padded_capacity=pad
        )

    def set_ep_group(self, ep_group) -> None:
        """Dispatch tokens over ``ep_group`` from now on; the weights this layer is called with
        (``torch.func.functional_call``) must then be this rank's ``experts / ep`` experts, as
        :func:`fsdpfn.unshard` gives them. ``None``: every expert local again.

        Example:
          >>> moe = fsdpfn.models.MoE(fsdpfn.models.MoEConfig(experts=4))
          >>> moe.set_ep_group(None); (moe.ep, moe.local)
          (1, 4)
        """
        self._route(self.cfg, ep_group)

    def _route(self, cfg: MoEConfig, ep_group) -> None:
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoE: cfg must be a MoEConfig, got {type(cfg).__name__}")
        ep = C.group_size(ep_group) if ep_group is not None else 1
        if cfg.experts < 1 or cfg.experts % ep:
            raise ValueError(
                f"MoE: experts={cfg.experts} does not divide over the {ep} expert-parallel ranks; choose a number of experts that "
                f"is a multiple of ep (e.g. {max(ep, cfg.experts - cfg.experts % ep)}) or a smaller ep"
            )
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"MoE: top_k={cfg.top_k} must be in 1 .. experts ({cfg.experts})")
        self.cfg, self.ep_group, self.ep = cfg, ep_group, ep
        self.local = cfg.experts // ep
        self.first = (C.group_rank(ep_group) if ep_group is not None else 0) * self.local

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [N, width], load-balancing loss)``."""
        cfg, n = self.cfg, x.shape[0]
        probs = F.softmax(self.router(x), dim=-1)
        weights, experts = probs.topk(cfg.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.reshape(-1)
        with torch.no_grad():
            # One-hot sums, not bincount: its output's size would depend on the largest id.
            chosen = F.one_hot(flat, cfg.experts).sum(0)
            f = chosen.to(probs.dtype) / max(1, flat.numel())
        aux = cfg.aux_weight * cfg.experts * (f * probs.mean(0)).sum()
        if cfg.pad_to_capacity:
            return self._padded(x, flat, weights, probs), aux
        # Dispatch: (token, choice) pairs sorted by expert, stable (ties keep token order).
        order = torch.sort(flat, stable=True).indices
        load = torch.bincount(flat, minlength=cfg.experts)
        capacity = cfg.capacity(n)
        if capacity is not None:
            # A pair's place among its expert's pairs, in token order: keep the first `capacity`.
            place = torch.arange(order.numel(), device=order.device) - (load.cumsum(0) - load)[flat[order]]
            order = order[place < capacity]
            load = load.clamp(max=capacity)
        self.dropped = flat.numel() - order.numel()
        rows = x[order // cfg.top_k]
        per_expert = load.tolist()
        send = [sum(per_expert[r * self.local : (r + 1) * self.local]) for r in range(self.ep)]
        got_per_expert = C.ep_counts(per_expert, self.ep_group) if self.ep > 1 else per_expert
        recv = [sum(got_per_expert[s * self.local : (s + 1) * self.local]) for s in range(self.ep)]
        inbox = C.ep_all_to_all(rows, send, recv, self.ep_group, tag="moe_dispatch") if self.ep > 1 else rows
        # Received rows come by source rank, then by expert; run each local expert on its rows.
        counts = [got_per_expert[s * self.local : (s + 1) * self.local] for s in range(self.ep)]
        outbox = self.experts(inbox, counts)
        back = C.ep_all_to_all(outbox, recv, send, self.ep_group, tag="moe_combine") if self.ep > 1 else outbox
        # Combine: undo the sort, weight each choice, sum per token (a dropped pair's row stays 0).
        y = torch.zeros(n * cfg.top_k, cfg.width, dtype=back.dtype, device=back.device).index_copy(0, order, back)
        y = (y.view(n, cfg.top_k, cfg.width) * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        return y, aux

    def _padded(self, x, flat, weights, probs) -> torch.Tensor:
        """The layer with each expert's rows padded to its capacity ([Note: padded dispatch])."""
        cfg, n, d = self.cfg, x.shape[0], x.shape[1]
        cap = cfg.capacity(n)
        assert cap is not None  # MoEConfig refuses pad_to_capacity without a capacity_factor
        slots = cfg.experts * cap
        with torch.no_grad():
            # A pair's place among its expert's pairs in token order (pairs are token-major).
            onehot = F.one_hot(flat, cfg.experts)
            place = (onehot.cumsum(0) - onehot).gather(1, flat.unsqueeze(1)).squeeze(1)
            kept = place < cap
            self._dropped = (~kept).sum()
            # Kept pairs fill their expert's slots; dropped ones the one spare slot at the end.
            slot = torch.where(kept, flat * cap + place, torch.full_like(flat, slots))
        rows = x.repeat_interleave(cfg.top_k, dim=0)
        box = x.new_zeros(slots + 1, d).index_put((slot,), rows)[:slots]
        # [experts, cap, d] is [ep ranks, local experts, cap, d]: one equal part per rank.
        inbox = box
        if self.ep > 1:
            part = [self.local * cap] * self.ep
            inbox = C.ep_all_to_all(box, part, part, self.ep_group, tag="moe_dispatch")
        # Through the module's call (not .padded): a runtime hands a unit its weights there.
        outbox = self.experts(inbox.view(self.ep, self.local, cap, d))
        back = outbox.reshape(slots, d)
        if self.ep > 1:
            back = C.ep_all_to_all(back, part, part, self.ep_group, tag="moe_combine")
        back = torch.cat([back, back.new_zeros(1, d)])  # the spare slot: a dropped pair's 0
        y = back[slot] * weights.reshape(-1, 1).to(back.dtype)
        return y.view(n, cfg.top_k, d).sum(1)

    @property
    def dropped(self) -> int:
        """(token, choice) pairs the last call dropped for capacity (0 without ``capacity_factor``)."""
        return int(self._dropped)

    @dropped.setter
    def dropped(self, value) -> None:
        self._dropped = value
