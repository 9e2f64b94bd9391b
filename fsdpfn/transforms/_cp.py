"""Context parallelism: attention over a sequence split across the ranks of a ``cp`` axis, and
the helpers that split a batch for it.

Every example's sequence of ``S`` tokens is cut into ``2 cp`` chunks; rank ``r`` of the cp
axis holds chunks ``r`` and ``2 cp - 1 - r`` (a head and a tail, see [Note: head-tail
balancing]). Everything outside attention is per token, so the model runs unchanged on a
rank's ``S / cp`` tokens; attention is the one place a token needs the others, and
:func:`context_parallel_attention` brings them in, one of two ways:

- ``"allgather"``: every rank's keys and values are all-gathered (``fsdpfn.comm.cp_all_gather``,
  whose transpose, the reduce-scatter of dK and dV, is its backward), put back in sequence
  order, and attended to with a causal mask by position. Pure and differentiable.
- ``"ring"``: the key/value block of each rank travels around the cp ring
  (``fsdpfn.comm.cp_ring_shift``, transposed by the shift back); each rank attends to one block
  at a time and merges the partial results by their log-sum-exp (online softmax), so it never
  holds more than two blocks. Blocks a causal mask hides entirely are skipped.

[Note: head-tail balancing]
With a causal mask, token ``i`` attends to ``i + 1`` keys: split the sequence into ``cp``
contiguous parts and the last rank does ``2 cp - 1`` times the first's work. Rank ``r``
holding chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` gets work ``(r + 1/2) + (2 cp - r - 1/2)
= 2 cp`` chunk-units, the same on every rank (torchtitan's ``_HeadTailLoadBalancer``,
Megatron's ``get_batch_on_this_cp_rank``). The positions of a rank's tokens
(:func:`context_parallel_positions`) are therefore not contiguous: position embeddings and RoPE
must take them, never ``arange``.

[Note: the loss over cp]
Each cp rank computes the loss over its own tokens (the mean, as usual); gradients are averaged
over dp x cp (``plan.grad_ranks``), and since every rank holds the same number of tokens the
mean of the ranks' means is the mean over the global batch's tokens (a reassociation of one
process's sum, exact up to rounding). A loss with ignored tokens (``ignore_index``) counts
different numbers per rank: reduce with ``fsdpfn.unshard(..., grad_op="sum", grad_scale=1 /
global count)`` and a summed loss.

[Note: detecting attention that is not cp-aware]
A model whose attention never calls :func:`context_parallel_attention` still runs on a cp mesh:
each rank attends within its own chunks and the step trains, wrong. So every real (cp > 1)
call is counted, the first gather of a plan's step notes the count, and that plan's first
reduce raises on every rank (before its collective; every rank runs the same model, so every
rank raises) if the count did not move. Checked once per plan: the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, Sequence, TypeVar

import torch
import torch.nn.functional as F

from fsdpfn import _ambient
from fsdpfn import comm as C
from fsdpfn._plan import Plan
from fsdpfn.transforms._axes import cp_group, cp_rank

__all__ = ["STRATEGIES", "ring_merge", "context_parallel", "context_parallel_attention", "context_parallel_positions",
           "context_parallel_shard", "context_parallel_unshard", "note_gather", "check_reduce"]

STRATEGIES = ("allgather", "ring")

T = TypeVar("T", torch.Tensor, Sequence[torch.Tensor])


@dataclasses.dataclass(frozen=True)
class _Axis:
    group: object
    size: int
    rank: int
    strategy: str = "allgather"


_ACTIVE: list[_Axis] = _ambient.CP_STACK  # restored around a remat recompute (fsdpfn/_ambient.py)


def _check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"context-parallel strategy {strategy!r} is not one of {', '.join(map(repr, STRATEGIES))}")
    return strategy


def _axis(plan_or_group, strategy: str | None = None) -> _Axis:
    if plan_or_group is None:
        if _ACTIVE:
            a = _ACTIVE[-1]
            return a if strategy is None else dataclasses.replace(a, strategy=_check_strategy(strategy))
        return _Axis(None, 1, 0, _check_strategy(strategy or "allgather"))
    strategy = _check_strategy(strategy or (_ACTIVE[-1].strategy if _ACTIVE else "allgather"))
    if isinstance(plan_or_group, Plan):
        plan = plan_or_group
        if plan.cp_size > 1 and plan.mesh is None:
            raise ValueError("this plan has no mesh (loaded from JSON?); bind one with plan.bind(mesh) before running attention over cp")
        return _Axis(cp_group(plan), plan.cp_size, cp_rank(plan), strategy)
    return _Axis(plan_or_group, C.group_size(plan_or_group), C.group_rank(plan_or_group), strategy)


@contextlib.contextmanager
def context_parallel(plan_or_group, *, strategy: str = "allgather") -> Iterator[None]:
    """Inside the block, :func:`context_parallel_attention`, :func:`context_parallel_positions`,
    :func:`context_parallel_shard` and :func:`context_parallel_unshard` called without a plan
    use ``plan_or_group``'s cp axis (a :class:`fsdpfn.Plan`, or a process group) and
    ``strategy``. A model can then call them with no plan in sight and still run in one
    process (outside any block: cp = 1). Keep the backward inside the block too when the model
    recomputes activations (remat), so that the recomputed attention is the same.

    Example:
      >>> q = k = v = torch.randn(1, 2, 4, 8)
      >>> with fsdpfn.context_parallel(plan, strategy="ring"):   # plan: any plan; here cp = 1
      ...     out = fsdpfn.context_parallel_attention(q, k, v, causal=True)
      ...     logits = model(x)   # GPT's attention and positions use the block's cp axis
      >>> out.shape, logits.shape
      (torch.Size([1, 2, 4, 8]), torch.Size([2, 8, 64]))
    """
    _ACTIVE.append(_axis(plan_or_group, strategy))
    try:
        yield
    finally:
        _ACTIVE.pop()


# ---- the balancer: which tokens a rank holds ----------------------------------------------------


def _chunk(seq: int, size: int, what: str) -> int:
    if seq % (2 * size):
        raise ValueError(
            f"{what}: a sequence of {seq} tokens does not split into 2 x cp = {2 * size} equal chunks (each cp rank holds a "
            f"head and a tail chunk, for causal balance); pad the sequences to a multiple of {2 * size} tokens, or use "
            "a cp degree that divides half the sequence length")
    return seq // (2 * size)


def _positions(local: int, size: int, rank: int, device=None) -> torch.Tensor:
    c = local // 2
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([head, head + (2 * size - 1 - 2 * rank) * c])


def context_parallel_positions(local_len: int, plan_or_group=None, *, device=None) -> torch.Tensor:
    """Positions in the full sequence of this rank's ``local_len`` tokens (what
    :func:`context_parallel_shard` of ``torch.arange(S)`` gives, ``S = local_len x cp``): feed
    them to position embeddings or RoPE instead of ``arange(local_len)``.

    Example:
      >>> fsdpfn.context_parallel_positions(8).tolist()   # one process: cp = 1
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    a = _axis(plan_or_group)
    if a.size == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2:
        raise ValueError(f"context_parallel_positions: local_len={local_len} is odd; a cp rank holds two equal chunks of each sequence")
    return _positions(local_len, a.size, a.rank, device)


def _cut(x: torch.Tensor, dim: int, size: int, rank: int, what: str) -> torch.Tensor:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: seq_dim={dim} is not a dim of a tensor of shape {tuple(x.shape)}")
    c = _chunk(x.shape[dim], size, what)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * size - 1 - rank) * c, c)], dim=dim)


def context_parallel_shard(tensors: T, plan_or_group=None, *, seq_dim: int = 1) -> T:
    """This rank's part of every sequence of ``tensors`` (one tensor, or a list/tuple of them:
    inputs, labels, positions, masks), cut along ``seq_dim``: chunks ``r`` and ``2 cp - 1 - r``
    of ``2 cp``, concatenated (see [Note: head-tail balancing]). Local and differentiable: no
    collective. :func:`context_parallel_unshard` is its inverse.

    Raises:
      ValueError: a sequence length does not divide by ``2 x cp`` (named, with the fix).

    Example:
      >>> x, y = fsdpfn.context_parallel_shard((torch.arange(8).view(1, 8), torch.ones(1, 8)))
      >>> x.tolist()   # one process: everything
      [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    a = _axis(plan_or_group)
    many = not isinstance(tensors, torch.Tensor)
    items: list[torch.Tensor] = list(tensors) if many else [tensors]  # type: ignore[list-item]
    if a.size == 1:
        return tensors
    out = [_cut(t, seq_dim, a.size, a.rank, f"context_parallel_shard(tensor {i} of shape {tuple(t.shape)}, seq_dim={seq_dim})")
           for i, t in enumerate(items)]
    return (type(tensors)(out) if isinstance(tensors, (tuple, list)) else out) if many else out[0]  # type: ignore[return-value]


def _order(local: int, size: int, device=None) -> torch.Tensor:
    """Where each position's token sits in the rank-ordered concatenation of local parts."""
    gathered = torch.cat([_positions(local, size, r) for r in range(size)])
    return torch.argsort(gathered).to(device)


def context_parallel_unshard(x: torch.Tensor, plan_or_group=None, *, seq_dim: int = 1) -> torch.Tensor:
    """The full sequences from every cp rank's part (:func:`context_parallel_shard`'s inverse):
    one all-gather over cp, on every rank of it, then the chunks back in order. Differentiable
    (its backward keeps this rank's part of the gradient, summed over ranks).

    Example:
      >>> fsdpfn.context_parallel_unshard(torch.arange(4).view(1, 4)).tolist()   # one process
      [[0, 1, 2, 3]]
    """
    a = _axis(plan_or_group)
    if a.size == 1:
        return x
    dim = seq_dim % x.dim()
    if x.shape[dim] % 2:
        raise ValueError(f"context_parallel_unshard: dim {dim} of shape {tuple(x.shape)} holds {x.shape[dim]} tokens, an odd "
                         "number; a cp rank's part is two equal chunks")
    full = C.cp_all_gather(x, a.group, dim=dim, tag="cp_unshard")
    return full.index_select(dim, _order(x.shape[dim], a.size, x.device))


# ---- attention ----------------------------------------------------------------------------------

_CALLS = [0]
_MARKS: dict[str, int] = {}
_VERIFIED: set[str] = set()


def _block(q, k, v, mask, scale):
    """Attention of ``q`` to one key block: ``(out, lse)`` in float32 at least (the merge of
    bf16 blocks would lose what the softmax keeps), ``lse`` the log of each row's softmax
    denominator. A row the mask hides entirely gets a finite lse about ``finfo.min`` (not
    ``-inf``: no NaN in forward or backward), which weighs nothing in the merge."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(acc).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.softmax(scores, dim=-1), v.to(acc)), lse


def ring_merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attentions over disjoint key sets (online softmax): each ``out`` is
    normalised by its own denominator ``exp(lse)``; the merged one by their sum.

    Example:
      >>> o, l = ring_merge(torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1))
      >>> o.item(), round(l.item(), 4)   # equal weights: the mean; lse = log 2
      (0.5, 0.6931)
    """
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new) + out_b * torch.exp(lse_b - new), new


def _expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // kv.shape[1]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)  # SDPA's enable_gqa grouping


def _ring(q, k, v, a: _Axis, causal: bool, scale: float) -> torch.Tensor:
    local = q.shape[2]
    pos_q = _positions(local, a.size, a.rank, q.device)
    kv = torch.stack([k, v])
    out = lse = None
    for s in range(a.size):
        src = (a.rank - s) % a.size
        mask = pos_q[:, None] >= _positions(local, a.size, src, q.device)[None, :] if causal else None
        if mask is None or bool(mask.any()):  # positions are the same on every rank: so is the skip
            o_b, l_b = _block(q, _expand_kv(q, kv[0]), _expand_kv(q, kv[1]), mask, scale)
            out, lse = (o_b, l_b) if out is None or lse is None else ring_merge(out, lse, o_b, l_b)
        if s < a.size - 1:
            kv = C.cp_ring_shift(kv, a.group, tag="cp_ring_kv")
    assert out is not None  # step 0 is this rank's own block, which holds the diagonal
    return out.to(q.dtype)


def _allgather(q, k, v, a: _Axis, causal: bool, scale: float | None) -> torch.Tensor:
    local = q.shape[2]
    kv = C.cp_all_gather(torch.stack([k, v]), a.group, dim=3, tag="cp_gather_kv")
    # Keys back in sequence order, so each row sums its keys in one process's order.
    kv = kv.index_select(3, _order(local, a.size, q.device))
    mask = None
    if causal:
        pos_q = _positions(local, a.size, a.rank, q.device)
        mask = pos_q[:, None] >= torch.arange(local * a.size, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=kv.shape[2] != q.shape[1])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_or_group=None, *,
                               causal: bool = True, strategy: str | None = None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention of this rank's queries to the keys and values of the whole
    sequence, which is split over the cp axis of ``plan_or_group`` (a :class:`fsdpfn.Plan`, a
    process group, or ``None``: the active :func:`context_parallel` block's, else one process).
    A drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` on a rank's
    part of each sequence (:func:`context_parallel_shard`); differentiable under
    ``loss.backward()`` and ``torch.func.grad``.

    Args:
      q: ``(batch, heads, local_len, head_dim)``, this rank's tokens.
      k, v: ``(batch, kv_heads, local_len, head_dim)``; ``heads`` divisible by ``kv_heads``
        (grouped-query attention).
      plan_or_group: whose cp axis.
      causal: each token attends to the tokens at or before its position in the full sequence.
      strategy: ``"allgather"`` or ``"ring"`` (module docstring); ``None``: the block's, else
        ``"allgather"``.
      scale: the softmax scale (``1 / sqrt(head_dim)`` when ``None``).

    Raises:
      ValueError: shapes that do not fit, named, on every rank, before any collective.

    Example:
      >>> q = k = v = torch.randn(1, 2, 4, 8)
      >>> out = fsdpfn.context_parallel_attention(q, k, v, causal=True)   # one process: cp = 1
      >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
      True
    """
    a = _axis(plan_or_group, strategy)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"context_parallel_attention takes (batch, heads, seq, head_dim) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
                         "k and v must have q's batch, seq and head_dim, and q's heads must divide by their heads")
    if a.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if q.shape[2] % 2:
        raise ValueError(f"context_parallel_attention: this rank holds {q.shape[2]} tokens of each sequence (q {tuple(q.shape)}), "
                         f"an odd number; over cp={a.size} each rank holds two equal chunks. Split the batch with "
                         "fsdpfn.context_parallel_shard, whose sequence length must divide by 2 x cp")
    _CALLS[0] += 1
    if a.strategy == "ring":
        return _ring(q, k, v, a, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return _allgather(q, k, v, a, causal, scale)


# ---- [Note: detecting attention that is not cp-aware] ---------------------------------------------


def note_gather(plan: Plan) -> None:
    """Called at each unit gather: the first of a cp plan's unverified step notes the count."""
    if plan.cp_size > 1 and plan.fingerprint not in _VERIFIED:
        _MARKS.setdefault(plan.fingerprint, _CALLS[0])


def check_reduce(plan: Plan) -> None:
    """Called at each unit reduce, before its collective: raises if the step since the plan's
    first gather never called :func:`context_parallel_attention` over cp."""
    if plan.cp_size == 1 or plan.fingerprint in _VERIFIED:
        return
    mark = _MARKS.pop(plan.fingerprint, None)
    if mark is None:
        return
    if _CALLS[0] == mark:
        raise ValueError(
            f"the plan's mesh has a context-parallel axis (cp={plan.cp_size}): each rank holds 1/{plan.cp_size} of every "
            "sequence, but this step's forward never called fsdpfn.context_parallel_attention, so attention saw only this "
            "rank's own tokens and the gradients would be wrong. Make the model's attention call "
            "fsdpfn.context_parallel_attention(q, k, v, causal=...) in place of F.scaled_dot_product_attention, and run the "
            "step inside `with fsdpfn.context_parallel(plan):` (docs/tour/context-parallel.md). A model without attention "
            "gains nothing from cp: fold the cp ranks into the data-parallel axis")
    _VERIFIED.add(plan.fingerprint)
