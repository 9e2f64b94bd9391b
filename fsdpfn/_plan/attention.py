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
===============  =====================================  ==========================================

Every hop happens under causal masking too: with head-tail balancing no rank's query block is
hidden from any key block, so none is skipped. A unit recomputed in backward (``remat="full"``)
issues its forward's collectives again there, before the backward's.

Memory: each call keeps only its rank's own queries, keys, values, output and log-sum-exp for
its backward (the fused Function of ``fsdpfn/transforms/_cp.py``, [Note: fused attention over
cp]); the keys and values of the whole sequence, ``2 cp N kv_width e`` bytes, are transient: the
all-gather holds them at once in forward and again in backward, the ring two blocks at a time.
"""

from __future__ import annotations

import dataclasses

import torch

from fsdpfn._plan.axes import Role

__all__ = ["AttentionCall", "CP_STRATEGIES", "attention_entries", "kv_bytes"]

CP_STRATEGIES = ("allgather", "ring")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call of a step, as the op list costs it over cp (see [Note: what attention
    over cp issues]).

    Attributes:
      unit: the unit whose forward calls it.
      kv_width: elements of one token's keys (``kv_heads x head_dim``); the values are as wide.
      causal: a causal mask (the collectives are the same; kept for the compute).
      strategy: ``"allgather"`` or ``"ring"``, as :func:`fsdpfn.context_parallel` is given.
      dtype: the keys' dtype (``None``: the unit's gather dtype, what its activations run in).

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

    def __post_init__(self):
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"AttentionCall({self.unit!r}): strategy {self.strategy!r} is not one of {CP_STRATEGIES}")
        if not isinstance(self.kv_width, int) or isinstance(self.kv_width, bool) or self.kv_width < 1:
            raise ValueError(
                f"AttentionCall({self.unit!r}): kv_width must be an int >= 1 (kv_heads x head_dim), got {self.kv_width!r}"
            )


def kv_bytes(a: AttentionCall, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's stacked keys and values for ``tokens`` tokens (the buffer a ring hop
    sends; an all-gather's is ``cp`` times it).

    Example:
      >>> kv_bytes(AttentionCall("blocks.0", 16), tokens=10, dtype=torch.float32)
      1280
    """
    return 2 * tokens * a.kv_width * (a.dtype or dtype).itemsize


def attention_entries(
    a: AttentionCall, cp: int, phase: str, tokens: int, dtype: torch.dtype, recompute: bool = False
) -> list[tuple]:
    """``(kind, role, nbytes, dtype, purpose, tag)`` of one attention call in ``phase``
    (``"forward"`` or ``"backward"``), over ``cp`` ranks; ``recompute``: the unit's forward runs
    again in its backward (see [Note: what attention over cp issues]). Tags are those
    ``fsdpfn.transforms`` gives the collectives, so a record of a real step compares.

    Example:
      >>> [e[5] for e in attention_entries(AttentionCall("b", 4, strategy="ring"), 3, "backward", 8, torch.float32)]
      ['cp_ring_kv', 'cp_ring_kv', 'cp_ring_dkv', 'cp_ring_dkv']
    """
    if cp == 1:
        return []
    dt = a.dtype or dtype
    n = kv_bytes(a, tokens, dt)
    if a.strategy == "allgather":
        fwd = [("all_gather", Role.CP, cp * n, dt, "cp_gather", "cp_gather_kv")]
        bwd = fwd + [("reduce_scatter", Role.CP, cp * n, dt, "cp_scatter", "cp_gather_kv")]
    else:
        kv = ("send_recv", Role.CP, n, dt, "cp_ring", "cp_ring_kv")
        acc = torch.promote_types(dt, torch.float32)
        dkv = ("send_recv", Role.CP, kv_bytes(a, tokens, acc), acc, "cp_ring_grad", "cp_ring_dkv")
        fwd = [kv] * (cp - 1)
        # In the order the backward starts them: K/V hop s + 1 before block s, the accumulator
        # of block s after it.
        bwd = [kv] + [kv, dkv] * (cp - 2) + [dkv]
    if phase == "forward":
        return fwd
    return (fwd if recompute else []) + bwd
