"""Context parallelism: attention over a sequence split across the ranks of a ``cp`` axis, and
the helpers that split a batch for it.

Every example's sequence of ``S`` tokens is cut into ``2 cp`` chunks; rank ``r`` of the cp
axis holds chunks ``r`` and ``2 cp - 1 - r`` (a head and a tail, see [Note: head-tail
balancing]). Everything outside attention is per token, so the model runs unchanged on a
rank's ``S / cp`` tokens; attention is the one place a token needs the others, and
:func:`context_parallel_attention` brings them in, one of three ways:

- ``"allgather"``: every rank's keys and values are all-gathered and put back in sequence
  order; each local chunk attends to the chunks before it in full and to itself under a causal
  mask, merged by log-sum-exp: no mask is built. Backward gathers them again and
  reduce-scatters dK and dV.
- ``"ring"``: the key/value block of each rank travels around the cp ring (``send_recv`` hops,
  each overlapping the block before it); each rank attends to one block at a time and merges the
  partial results by their log-sum-exp (online softmax), so it never holds more than two blocks.
  Chunk pairs a causal mask hides entirely are skipped. Backward sends the blocks around again
  with an accumulator of their dK and dV.
- ``"ulysses"``: one all-to-all trades the sequence for the heads: each rank receives the whole
  sequence of ``1 / cp`` of the heads, attends over it as one process would, and a second
  all-to-all returns its own tokens of every head (see [Note: attention over cp by heads]). The
  heads must divide by cp.

Each is one autograd Function that saves only the rank's own q, k, v, output and log-sum-exp
(see [Note: fused attention over cp]).

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
from fsdpfn._plan.attention import CP_STRATEGIES
from fsdpfn.transforms._axes import cp_group, cp_rank

__all__ = [
    "STRATEGIES",
    "ring_merge",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_positions",
    "context_parallel_shard",
    "context_parallel_unshard",
    "note_gather",
    "check_reduce",
    "checked",
]

STRATEGIES = CP_STRATEGIES  # the one list, which the op list and the simulator read too

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
            raise ValueError(
                "this plan has no mesh (loaded from JSON?); bind one with plan.bind(mesh) before running attention over cp"
            )
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
            "a cp degree that divides half the sequence length"
        )
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
        raise ValueError(
            f"context_parallel_positions: local_len={local_len} is odd; a cp rank holds two equal chunks of each sequence"
        )
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
    if not C.compiling():  # see [Note: cp peers cut the same sequences]
        from fsdpfn.transforms._guards import fingerprint

        _ambient.LAST_CUT[0] = [fingerprint(t) for t in items]
    out = [
        _cut(
            t,
            seq_dim,
            a.size,
            a.rank,
            f"context_parallel_shard(tensor {i} of shape {tuple(t.shape)}, seq_dim={seq_dim})",
        )
        for i, t in enumerate(items)
    ]
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
        raise ValueError(
            f"context_parallel_unshard: dim {dim} of shape {tuple(x.shape)} holds {x.shape[dim]} tokens, an odd "
            "number; a cp rank's part is two equal chunks"
        )
    full = C.cp_all_gather(x, a.group, dim=dim, tag="cp_unshard")
    return full.index_select(dim, _order(x.shape[dim], a.size, x.device))


# ---- attention ----------------------------------------------------------------------------------

# Process state: cp attention calls so far, and per cp plan the count at its first gather and
# whether a step of it was seen calling cp attention. Keyed by plan: the pure path's step is a
# function call with no object of its own to carry them.
_CALLS = [0]
_MARKS: dict[str, int] = {}
_VERIFIED: set[str] = set()


def _block(q, k, v, mask, scale):
    """Attention of ``q`` to one key block: ``(out, lse)`` in float32 at least (the merge of
    bf16 blocks would lose what the softmax keeps), ``lse`` the log of each row's softmax
    denominator. A row the mask hides entirely gets a finite lse about ``finfo.min`` (not
    ``-inf``: no NaN in forward or backward), which weighs nothing in the merge. The exact
    unfused path of [Note: fused attention over cp] (``k``, ``v`` with ``q``'s heads)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(acc).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.softmax(scores, dim=-1), v.to(acc)), lse


def ring_merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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


# [Note: fused attention over cp]
# Attention over cp is one autograd Function per call (_CPAttention), which runs its exchange
# and its kernels itself and saves only what a rank's own tokens need: q, k, v (local), the
# merged output and its log-sum-exp, O(S/cp x d) a layer. (Composed of SDPA with a materialised
# causal mask, or of unfused score blocks, autograd would save an (S/cp) x S mask or
# (S/cp)^2 probabilities per block: at 16k tokens that outgrew everything else.)
#
# Forward: the keys a rank's queries see are cut into *calls* (_calls): rows of local queries
# against a contiguous run of keys, either all visible (a key chunk before the query chunk) or
# the diagonal chunk under a top-left causal mask; key chunks after a query chunk are skipped.
# Each call is one CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu, which
# returns the log-sum-exp and reads grouped-query heads itself), merged into the rows' running
# (out, lse) by log-sum-exp in float32 or wider (float64 stays float64).
#
# Backward: with the MERGED out and lse, exp(score - lse) is each key's share of the whole
# softmax and rowsum(dout * out) the whole row's, so the flash backward of each call alone gives
# that call's exact dq and its keys' exact dk, dv; summing them is the gradient. The keys of the
# other ranks are exchanged again rather than kept: the all-gather gathers them again and
# reduce-scatters dK, dV; the ring sends K/V around again and, beside them, an accumulator of
# each block's dK/dV that collects every other rank's share on its way home (cp - 1 hops: the
# owner keeps its own share locally). Each ring hop is started before the block it overlaps is
# computed and waited for after: the exchange hides behind the kernels.
#
# Exact fallback: off CPU or in a dtype the kernel does not take, each call runs _block (matmul,
# softmax; its probabilities are transient, never saved) and the backward its formula.

_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FLASH_DTYPES


def _calls(q_chunks, k_chunks, c: int, causal: bool, nk: int) -> list[tuple[int, int, int, int, bool]]:
    """``(q_lo, q_hi, k_lo, k_hi, diagonal)`` calls of local query rows against a contiguous key
    run of the buffer; ``q_chunks``/``k_chunks``: the global chunk index of each ``c``-token
    chunk in local order. Without a causal mask: one call of everything."""
    if not causal:
        return [(0, c * len(q_chunks), 0, nk, False)]
    calls: list[tuple[int, int, int, int, bool]] = []
    for i, qc in enumerate(q_chunks):
        run: list[int] = []
        for j, kc in enumerate(k_chunks):
            if kc < qc and run and run[-1] == j - 1:
                run.append(j)
            elif kc < qc:
                if run:
                    calls.append((i * c, (i + 1) * c, run[0] * c, (run[-1] + 1) * c, False))
                run = [j]
            if kc == qc:
                calls.append((i * c, (i + 1) * c, j * c, (j + 1) * c, True))
        if run:
            calls.append((i * c, (i + 1) * c, run[0] * c, (run[-1] + 1) * c, False))
    # Query chunks that are adjacent and see the same keys in full: one call.
    merged: list[tuple[int, int, int, int, bool]] = []
    for call in sorted(calls, key=lambda t: (t[2], t[3], t[4], t[0])):
        last = merged[-1] if merged else None
        if last and not call[4] and not last[4] and last[2:4] == call[2:4] and last[1] == call[0]:
            merged[-1] = (last[0], call[1], last[2], last[3], False)
        else:
            merged.append(call)
    return merged


def _forward_calls(q, k, v, calls, scale, out, lse) -> None:
    """Runs ``calls`` against ``k``, ``v`` and merges each into the running ``out``, ``lse``
    (accumulation dtype; ``lse`` of shape ``(b, h, rows)``), in place."""
    fused = _fused(q)
    for q_lo, q_hi, k_lo, k_hi, diag in calls:
        qb, kb, vb = q[:, :, q_lo:q_hi], k[:, :, k_lo:k_hi], v[:, :, k_lo:k_hi]
        if fused:
            ob, lb = _flash(qb, kb, vb, 0.0, diag, scale=scale)
        else:
            mask = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool, device=q.device).tril() if diag else None
            ob, lb = _block(qb, _expand_kv(qb, kb), _expand_kv(qb, vb), mask, scale)
            lb = lb.squeeze(-1)
        o, l_ = out[:, :, q_lo:q_hi], lse[:, :, q_lo:q_hi]
        new = torch.logaddexp(l_, lb.to(l_.dtype))
        o.mul_(torch.exp(l_ - new).unsqueeze(-1)).add_(ob.to(o.dtype) * torch.exp(lb.to(new.dtype) - new).unsqueeze(-1))
        l_.copy_(new)


def _backward_calls(g, q, k, v, out, lse, calls, scale, dq, dk, dv) -> None:
    """Each call's exact share of the gradient (see the Note), added into ``dq`` (rows) and
    ``dk``, ``dv`` (keys of this buffer), in place."""
    fused = _fused(q)
    for q_lo, q_hi, k_lo, k_hi, diag in calls:
        rows, keys = slice(q_lo, q_hi), slice(k_lo, k_hi)
        qb, kb, vb, gb, ob, lb = (
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            g[:, :, rows],
            out[:, :, rows],
            lse[:, :, rows],
        )
        if fused:
            gq, gk, gv = _flash_bwd(gb, qb, kb, vb, ob, lb, 0.0, diag, scale=scale)
        else:
            gq, gk, gv = _block_backward(gb, qb, kb, vb, ob, lb, diag, scale)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv


def _block_backward(g, q, k, v, out, lse, diag: bool, scale: float):
    """The exact fallback's backward of one call, given the merged ``out`` and ``lse``."""
    acc = torch.promote_types(q.dtype, torch.float32)
    ke, ve = _expand_kv(q, k).to(acc), _expand_kv(q, v).to(acc)
    qa, ga = q.to(acc), g.to(acc)
    scores = torch.matmul(qa, ke.transpose(-2, -1)) * scale
    if diag:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(), -math.inf)
    p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    dp = torch.matmul(ga, ve.transpose(-2, -1))
    ds = p * (dp - (ga * out.to(acc)).sum(-1, keepdim=True)) * scale
    dq, dk, dv = torch.matmul(ds, ke), torch.matmul(ds.transpose(-2, -1), qa), torch.matmul(p.transpose(-2, -1), ga)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # the gradient of a shared head sums its query heads'
        dk, dv = (t.unflatten(1, (k.shape[1], rep)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _chunks(size: int, rank: int) -> list[int]:
    return [rank, 2 * size - 1 - rank]


# [Note: attention over cp under torch.compile]
# The attention Functions below are written once. Their exchanges go through the four helpers
# that follow: eagerly, fsdpfn.comm's counted, flight-recorded collectives (a ring hop started
# asynchronously, to overlap the block before it) under torch._C._DisableFuncTorch (the recipe of
# [Note: TP collectives under torch.func]); while dynamo traces, the functional collectives of
# [Note: collectives under torch.compile], which it records as graph nodes, so that a compiled
# step holds the same exchanges, of the same bytes, and computes the same numbers. A traced hop
# is waited at once: the graph's scheduler decides what overlaps it.


def _escape():
    return contextlib.nullcontext() if C.compiling() else torch._C._DisableFuncTorch()


def _all_gather(flat: torch.Tensor, a: _Axis, tag: str) -> torch.Tensor:
    if C.compiling():
        return C.traced_all_gather(flat, a.group)
    out = torch.empty(a.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    C.all_gather(out, flat, a.group, tag=tag).wait()
    return out


def _reduce_scatter(flat: torch.Tensor, a: _Axis, tag: str) -> torch.Tensor:
    if C.compiling():
        return C.traced_reduce_scatter(flat, a.group)
    out = torch.empty(flat.numel() // a.size, dtype=flat.dtype, device=flat.device)
    C.reduce_scatter(out, flat, a.group, tag=tag).wait()
    return out


def _all_to_all(flat: torch.Tensor, a: _Axis, tag: str) -> torch.Tensor:
    if C.compiling():
        return C.traced_all_to_all(flat, a.group)
    out = torch.empty_like(flat)
    C.all_to_all(out, flat, a.group, tag=tag).wait()
    return out


def _after(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x`` itself eagerly; while dynamo traces, ``x`` made to depend on the backward's
    incoming gradient ``g`` (joined with none of its elements). The backward exchanges the saved
    K/V again; traced, that exchange depends on forward values only, so the compiler's
    partitioner would run it in the forward graph (a collective is never recomputed) and keep
    every rank's keys (the gathered or travelled blocks, O(S)) for the backward, instead of this
    rank's own share (O(S / cp)) as eager keeps. Depending on ``g``, it runs in the backward."""
    if not C.compiling():
        return x
    return torch.cat([x.reshape(-1), g.reshape(-1)[:0].to(x.dtype)]).view(x.shape)


class _Hop:
    """One ring hop of ``x`` to the next rank, started on creation; ``wait()`` returns what the
    previous rank sent, shaped as ``x``."""

    def __init__(self, x: torch.Tensor, group, tag: str):
        if C.compiling():
            self.buf, self.pending = C.traced_shift(x.contiguous().view(-1), group).view(x.shape), None
            return
        self.buf = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.pending = C.send_recv(self.buf.view(-1), x.contiguous().view(-1), group, shift=1, async_op=True, tag=tag)

    def wait(self) -> torch.Tensor:
        if self.pending is not None:
            self.pending.wait()
        return self.buf


def _gathered(kv: torch.Tensor, a: _Axis) -> torch.Tensor:
    """Every rank's stacked K/V, in sequence order."""
    local = kv.shape[3]
    front = kv.movedim(3, 0).contiguous()
    out = _all_gather(front.view(-1), a, "cp_gather_kv")
    full = out.view(a.size * local, *front.shape[1:]).movedim(0, 3)
    return full.index_select(3, _order(local, a.size, kv.device))


class _CPAttention(torch.autograd.Function):
    """[Note: fused attention over cp]. Returns ``(out, lse)``; ``lse`` is not differentiable."""

    @staticmethod
    def forward(q, k, v, a, causal, scale):
        with _escape():
            acc = torch.promote_types(q.dtype, torch.float32)
            # (batch, seq, heads, dim) in memory, as the flash kernel writes its output: the usual
            # out.transpose(1, 2).reshape(batch, seq, width) is then a view, not a copy that the
            # output projection would save beside this one.
            b, h, n, d = q.shape
            out = torch.zeros(b, n, h, d, dtype=acc, device=q.device).transpose(1, 2)
            lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
            c = q.shape[2] // 2
            mine = _chunks(a.size, a.rank)
            kv = torch.stack([k, v])
            if a.strategy == "allgather":
                full = _gathered(kv, a)
                calls = _calls(mine, list(range(2 * a.size)), c, causal, full.shape[3])
                _forward_calls(q, full[0], full[1], calls, scale, out, lse)
            else:
                for s in range(a.size):
                    nxt = _Hop(kv, a.group, "cp_ring_kv") if s < a.size - 1 else None
                    src = (a.rank - s) % a.size
                    _forward_calls(
                        q, kv[0], kv[1], _calls(mine, _chunks(a.size, src), c, causal, kv.shape[3]), scale, out, lse
                    )
                    if nxt is not None:
                        kv = nxt.wait()
            return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.axis, ctx.causal, ctx.scale = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)

    @staticmethod
    def backward(ctx, g, _g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        a, causal, scale = ctx.axis, ctx.causal, ctx.scale
        with _escape():
            g = g.contiguous()
            acc = torch.promote_types(q.dtype, torch.float32)
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            c = q.shape[2] // 2
            mine = _chunks(a.size, a.rank)
            kv = _after(torch.stack([k, v]), g)
            if a.strategy == "allgather":
                full = _gathered(kv, a)
                dfull = torch.zeros(full.shape, dtype=acc, device=q.device)
                calls = _calls(mine, list(range(2 * a.size)), c, causal, full.shape[3])
                _backward_calls(g, q, full[0], full[1], out, lse, calls, scale, dq, dfull[0], dfull[1])
                # Back to the all-gather's rank order, then its transpose: the reduce-scatter.
                ranked = torch.empty_like(dfull).index_copy_(3, _order(q.shape[2], a.size, q.device), dfull)
                front = ranked.to(k.dtype).movedim(3, 0).contiguous()
                mine_grad = _reduce_scatter(front.view(-1), a, "cp_gather_kv")
                dkv = mine_grad.view(front.shape[0] // a.size, *front.shape[1:]).movedim(0, 3)
            else:
                dkv = torch.zeros(
                    kv.shape, dtype=acc, device=q.device
                )  # this rank's own share, and at the end the others'
                travelling = None  # the Pending accumulator of another rank's block, on its way home
                for s in range(a.size):
                    nxt = _Hop(kv, a.group, "cp_ring_kv") if s < a.size - 1 else None
                    src = (a.rank - s) % a.size
                    calls = _calls(mine, _chunks(a.size, src), c, causal, kv.shape[3])
                    if s == 0:
                        _backward_calls(g, q, kv[0], kv[1], out, lse, calls, scale, dq, dkv[0], dkv[1])
                    else:
                        part = (
                            travelling.wait()
                            if travelling is not None
                            else torch.zeros(kv.shape, dtype=acc, device=q.device)
                        )
                        _backward_calls(g, q, kv[0], kv[1], out, lse, calls, scale, dq, part[0], part[1])
                        travelling = _Hop(part, a.group, "cp_ring_dkv")
                    if nxt is not None:
                        kv = nxt.wait()
                if travelling is not None:
                    dkv += travelling.wait()
            return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ---- [Note: attention over cp by heads] ---------------------------------------------------------
# "ulysses" (DeepSpeed-Ulysses): instead of bringing the other ranks' keys to this rank's
# queries, one all-to-all trades sequence for heads. Each rank sends its tokens of head group j
# (heads j h/cp .. (j + 1) h/cp of q, k and v, stacked into one buffer) to rank j, and receives
# every rank's tokens of its own head group: the whole sequence, h/cp heads, put back in sequence
# order (the head-tail chunks of [Note: head-tail balancing]). Attention is then one plain call
# per rank, no merge: its rows are one process's rows for those heads. A second all-to-all
# returns each rank's tokens of every head. Backward is the transpose: the output's gradient
# travels like the forward's output, backwards; dq, dk, dv like q, k, v, backwards.
#
# Bytes: two all-to-alls a call each way, of N (h + 2 h_kv) d and N h d elements (N a rank's
# tokens), whatever cp is, against the all-gather's cp x 2 N h_kv d; so it pays where cp is large
# and heads many. Its limit is the heads: q's and k's heads must both divide by cp (with tp, the
# heads a tp rank holds). Like the other strategies it is one autograd Function that saves the
# rank's share only: q, k, v, the output and its log-sum-exp of its heads over the whole
# sequence, as many elements as its own tokens of every head.


def _to_heads(xs: list[torch.Tensor], a: _Axis, tag: str) -> list[torch.Tensor]:
    """This rank's tokens of every head, ``(b, h_i, n, d)`` each, to the whole sequence of its
    head group, ``(b, h_i / cp, cp n, d)`` in sequence order: one all-to-all for all of ``xs``."""
    b, _, n, d = xs[0].shape
    send = torch.cat([x.unflatten(1, (a.size, x.shape[1] // a.size)) for x in xs], dim=2)
    send = send.movedim(1, 0).contiguous()  # (destination, b, heads of every x, n, d)
    recv = _all_to_all(send.view(-1), a, tag).view(send.shape)
    full = recv.permute(1, 2, 0, 3, 4).reshape(b, send.shape[2], a.size * n, d)  # sources' tokens, rank order
    full = full.index_select(2, _order(n, a.size, full.device))
    return list(full.split([x.shape[1] // a.size for x in xs], dim=1))


def _to_tokens(xs: list[torch.Tensor], a: _Axis, tag: str) -> list[torch.Tensor]:
    """:func:`_to_heads`'s inverse: the whole sequence of this rank's head group back to its own
    tokens of every head."""
    full = torch.cat(xs, dim=1)
    b, heads, seq, d = full.shape
    n = seq // a.size
    ranked = torch.empty_like(full).index_copy_(2, _order(n, a.size, full.device), full)
    send = ranked.unflatten(2, (a.size, n)).movedim(2, 0).contiguous()  # (destination, b, heads, n, d)
    recv = _all_to_all(send.view(-1), a, tag).view(send.shape)
    out, lo = [], 0
    for x in xs:  # recv: (head group, b, heads, n, d)
        h = x.shape[1]
        out.append(recv[:, :, lo : lo + h].movedim(0, 1).reshape(b, a.size * h, n, d))
        lo += h
    return out


class _UlyssesAttention(torch.autograd.Function):
    """[Note: attention over cp by heads]. Returns ``(out, saved...)``; only ``out`` is
    differentiable."""

    @staticmethod
    def forward(q, k, v, a, causal, scale):
        with _escape():
            qh, kh, vh = _to_heads([q, k, v], a, "cp_a2a_qkv")
            acc = torch.promote_types(q.dtype, torch.float32)
            b, h, seq, d = qh.shape
            out = torch.zeros(b, seq, h, d, dtype=acc, device=q.device).transpose(1, 2)
            lse = torch.full(qh.shape[:3], -math.inf, dtype=acc, device=q.device)
            _forward_calls(qh, kh, vh, [(0, seq, 0, seq, causal)], scale, out, lse)
            oh = out.to(q.dtype)
            (local,) = _to_tokens([oh], a, "cp_a2a_out")
            return local, qh, kh, vh, oh, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, _, ctx.axis, ctx.causal, ctx.scale = inputs
        _, *saved = output
        ctx.mark_non_differentiable(*saved)
        ctx.save_for_backward(*saved)

    @staticmethod
    def backward(ctx, g, *_):
        qh, kh, vh, oh, lse = ctx.saved_tensors
        a, causal, scale = ctx.axis, ctx.causal, ctx.scale
        with _escape():
            (gh,) = _to_heads([g.contiguous()], a, "cp_a2a_out")
            acc = torch.promote_types(qh.dtype, torch.float32)
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (qh, kh, vh))
            seq = qh.shape[2]
            _backward_calls(gh, qh, kh, vh, oh, lse, [(0, seq, 0, seq, causal)], scale, dq, dk, dv)
            dq, dk, dv = _to_tokens([dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype)], a, "cp_a2a_qkv")
            return dq, dk, dv, None, None, None


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan_or_group=None,
    *,
    causal: bool = True,
    strategy: str | None = None,
    scale: float | None = None,
) -> torch.Tensor:
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
      strategy: ``"allgather"`` (gather every rank's keys and values, then one attention),
        ``"ring"`` (pass them around the cp ranks, one block at a time, overlapping the hops) or
        ``"ulysses"`` (trade the sequence for the heads with an all-to-all: each rank attends over
        the whole sequence for ``1 / cp`` of the heads; ``heads`` and ``kv_heads`` must divide
        by cp); ``None``: the :func:`context_parallel` block's, else ``"allgather"``. The user
        guide's "Context parallelism" page (``docs/tour/context-parallel.md``) compares them and
        shows how to make your own attention cp-aware.
      scale: the softmax scale (``1 / sqrt(head_dim)`` when ``None``).

    Raises:
      ValueError: shapes that do not fit, named, on every rank, before any collective.

    Example:
      >>> q = k = v = torch.randn(1, 2, 4, 8)
      >>> out = fsdpfn.context_parallel_attention(q, k, v, causal=True)   # one process: cp = 1
      >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
      True
    """
    if isinstance(plan_or_group, torch.Tensor):
        raise ValueError(
            "context_parallel_attention(q, k, v, plan_or_group): the fourth argument is the plan or process group whose cp "
            f"axis splits the sequence, got a tensor of shape {tuple(plan_or_group.shape)} (F.scaled_dot_product_attention's "
            "attn_mask?). Masks are not taken: pass causal=True for a causal mask, and leave plan_or_group out inside "
            "`with fsdpfn.context_parallel(plan):`"
        )
    a = _axis(plan_or_group, strategy)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"context_parallel_attention takes (batch, heads, seq, head_dim) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: "
            "k and v must have q's batch, seq and head_dim, and q's heads must divide by their heads"
        )
    if a.size == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"context_parallel_attention: this rank holds {q.shape[2]} tokens of each sequence (q {tuple(q.shape)}), "
            f"an odd number; over cp={a.size} each rank holds two equal chunks. Split the batch with "
            "fsdpfn.context_parallel_shard, whose sequence length must divide by 2 x cp"
        )
    if a.strategy == "ulysses":
        for what, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
            if heads % a.size:
                raise ValueError(
                    f"context_parallel_attention(strategy='ulysses'): {heads} {what} heads (q {tuple(q.shape)}, k "
                    f"{tuple(k.shape)}) do not split over cp={a.size}; Ulysses hands each cp rank 1/{a.size} of the heads "
                    "(with tp, of a tp rank's heads). Use strategy='ring' or 'allgather', or a cp degree that divides "
                    "both head counts"
                )
    if not C.compiling():  # the compiled step's first, eager, verified step counts them
        _CALLS[0] += 1
    function = _UlyssesAttention if a.strategy == "ulysses" else _CPAttention
    return function.apply(q, k, v, a, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)[0]


# ---- [Note: detecting attention that is not cp-aware] ---------------------------------------------


def note_gather(plan: Plan) -> None:
    """Called at each unit gather: the first of a cp plan's unverified step notes the count."""
    # compiling() first: dynamo would guard the graph on the sets it reads. A compiled step's
    # first step runs eagerly (fsdpfn.compile's verify), and is checked there.
    if not C.compiling() and plan.cp_size > 1 and plan.fingerprint not in _VERIFIED:
        _MARKS.setdefault(plan.fingerprint, _CALLS[0])


def checked(plan: Plan) -> bool:
    """Whether a step of ``plan`` was seen calling :func:`context_parallel_attention` (always,
    without a cp axis). A compiled step cannot count the calls, so it compiles a cp plan only
    once an eager step has passed the check (``fsdpfn.compile``'s verify step does)."""
    return plan.cp_size == 1 or plan.fingerprint in _VERIFIED


def check_reduce(plan: Plan) -> None:
    """Called at each unit reduce, before its collective: raises if the step since the plan's
    first gather never called :func:`context_parallel_attention` over cp."""
    if C.compiling() or plan.cp_size == 1 or plan.fingerprint in _VERIFIED:
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
            "gains nothing from cp: fold the cp ranks into the data-parallel axis"
        )
    _VERIFIED.add(plan.fingerprint)
