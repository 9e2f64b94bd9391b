"""Attention over a cp axis as the step's op list sees it: which units call
:func:`fsdpfn.context_parallel_attention`, how wide their keys and values are, and the
collectives each call issues.

A plan alone does not know where attention runs or how wide its keys and values are (a fused
``qkv`` projection, grouped-query heads and a model's own attention all hide it), so the op list
takes it as data: one :class:`AttentionCall` per call, written by hand or recorded by
:func:`fsdpfn.sim.profile`, which sees every ``scaled_dot_product_attention`` call with its
shapes and unit.

[Note: what attention over cp issues]
Per attention call of a unit, with ``N`` tokens per rank per micro-batch, keys of ``kv_width``
elements a token (``kv_heads x head_dim``; values the same) in dtype ``e`` bytes, and ``cp``
ranks (``fsdpfn/transforms/_cp.py`` stacks K and V into one buffer ``2 N kv_width e`` bytes):

===============  =====================================  ==========================================
strategy         forward                                backward
===============  =====================================  ==========================================
``"allgather"``  all-gather over cp: ``cp`` x the       the all-gather again (the gathered keys are
                 stacked K/V                            not kept), then the reduce-scatter of dK,
                                                        dV (its transpose): the same bytes
``"ring"``       ``cp - 1`` send_recv hops of the       ``cp - 1`` hops of the stacked K/V again,
                 stacked K/V                            interleaved with ``cp - 1`` hops of a dK/dV
                                                        accumulator in float32 or wider (tag
                                                        ``cp_ring_dkv``, purpose ``cp_ring_grad``)
``"ulysses"``    all-to-all of the stacked Q/K/V,       all-to-all of the output's gradient, then
                 ``N (q_width + 2 kv_width)`` elements  of dQ/dK/dV: the same two buffers
                 (tag ``cp_a2a_qkv``), then of the
                 output, ``N q_width`` (``cp_a2a_out``)
===============  =====================================  ==========================================

Every hop happens under causal masking too: with head-tail balancing no rank's query block is
hidden from any key block, so none is skipped. A unit recomputed in backward (``remat="full"``)
issues its forward's collectives again there, before the backward's.

Memory: each call keeps only its rank's own queries, keys, values, output and log-sum-exp for
its backward (the fused Functions of ``fsdpfn/transforms/_cp.py``, [Note: fused attention over
cp]); the keys and values of the whole sequence, ``2 cp N kv_width e`` bytes, are transient: the
all-gather holds them at once in forward and again in backward, the ring two blocks at a time.
Ulysses holds the whole sequence of ``1 / cp`` of the heads: ``2 N kv_width e`` bytes of keys
and values (:func:`held_kv_bytes`).
"""

from __future__ import annotations

import dataclasses

import torch

from fsdpfn._plan.axes import Role


__all__ = ["AttentionCall", "CP_STRATEGIES", "attention_memory", "held_kv_bytes", "kv_bytes", "sequence_parts"]

CP_STRATEGIES = ("allgather", "ring", "ulysses")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call of a step, as the op list costs it over cp (see [Note: what attention
    over cp issues]).

    Attributes:
      unit: the unit whose forward calls it.
      kv_width: elements of one token's keys (``kv_heads x head_dim``); the values are as wide.
      causal: a causal mask (the collectives are the same; kept for the compute).
      strategy: ``"allgather"``, ``"ring"`` or ``"ulysses"``, as :func:`fsdpfn.context_parallel`
        is given.
      dtype: the keys' dtype (``None``: the unit's gather dtype, what its activations run in).
      q_width: elements of one token's queries (``heads x head_dim``; ``None``: ``kv_width``,
        as without grouped-query heads). Ulysses exchanges the queries too.

    Example:
      >>> a = AttentionCall("layers.0", kv_width=8 * 128, strategy="ring")
      >>> kv_bytes(a, tokens=4096, dtype=torch.bfloat16) / 2**20   # K and V of 4096 tokens
      16.0
    """

    unit: str
    kv_width: int
    causal: bool = True
    strategy: str = "allgather"
    dtype: torch.dtype | None = None
    q_width: int | None = None

    def __post_init__(self):
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"AttentionCall({self.unit!r}): strategy {self.strategy!r} is not one of {CP_STRATEGIES}")
        if not isinstance(self.kv_width, int) or isinstance(self.kv_width, bool) or self.kv_width < 1:
            raise ValueError(
                f"AttentionCall({self.unit!r}): kv_width must be an int >= 1 (kv_heads x head_dim), got {self.kv_width!r}"
            )
        if self.q_width is not None and (
            not isinstance(self.q_width, int) or isinstance(self.q_width, bool) or self.q_width < 1
        ):
            raise ValueError(
                f"AttentionCall({self.unit!r}): q_width must be None or an int >= 1 (heads x head_dim), got {self.q_width!r}"
            )


def kv_bytes(a: AttentionCall, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's stacked keys and values for ``tokens`` tokens (the buffer a ring hop
    sends; an all-gather's is ``cp`` times it).

    Example:
      >>> kv_bytes(AttentionCall("blocks.0", 16), tokens=10, dtype=torch.float32)
      1280
    """
    return 2 * tokens * a.kv_width * (a.dtype or dtype).itemsize


def held_kv_bytes(a: AttentionCall, cp: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one call over ``cp`` ranks holds at once while it runs (see the
    module's Memory paragraph): the whole sequence's, ``cp`` times a rank's own, or under
    Ulysses those of its ``1 / cp`` of the heads, as many as its own.

    Example:
      >>> held_kv_bytes(AttentionCall("blocks.0", 16), 4, tokens=10, dtype=torch.float32)
      5120
      >>> held_kv_bytes(AttentionCall("blocks.0", 16, strategy="ulysses"), 4, tokens=10, dtype=torch.float32)
      1280
    """
    own = kv_bytes(a, tokens, dtype)
    return own if a.strategy == "ulysses" else cp * own


def sequence_parts(plan) -> int:
    """How many ranks' parts of each sequence one rank's attention joins: the cp degree (1
    without a cp axis). A one-rank profile of the step (``fsdpfn.sim.profile``) runs attention
    against that many parts' keys.

    Example:
      >>> sequence_parts(fsdpfn.plan(model, {"dp": 1, "cp": 2})), sequence_parts(plan)
      (2, 1)
    """
    return plan.axes.size(Role.CP)


def attention_memory(plan, attention, tokens: int) -> dict[str, int]:
    """``{"attention_kv": bytes}`` for :meth:`fsdpfn.Plan.cost`'s memory: what the step's
    attention calls over the plan's cp axis hold at once, summed (:func:`held_kv_bytes`, in each
    unit's gather dtype); ``{}`` without a cp axis or calls.

    Example:
      >>> attention_memory(fsdpfn.plan(model, {"dp": 1, "cp": 2}), [AttentionCall("blocks.0", 32)], tokens=8)
      {'attention_kv': 4096}
    """
    cp = plan.axes.size(Role.CP)
    if cp == 1 or not attention:
        return {}
    units = {u.name: u for u in plan.units}
    return {"attention_kv": sum(held_kv_bytes(a, cp, tokens, plan.gather_dtype(units[a.unit])) for a in attention)}
