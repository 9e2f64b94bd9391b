"""The loss check: the step's objective against the loss function on the whole batch.

[Note: the loss check]
The unit-by-unit check (:mod:`fsdpfn.transforms._verify`) proves that the sharded model computes
what the model computes on one process. What the step then trains is the loss function on each
rank's part of the batch, reduced over the ranks that read different data (``plan.grad_ranks``:
the data-parallel ranks times ``cp``): with ``grad_op="mean"`` the mean of the ranks' losses, with
``"sum"`` their sum, times ``grad_scale``. One process trains the loss function on the whole
batch. The two agree only if the loss is that kind of reduction over the batch: a mean over a
rank's *counted* tokens (``cross_entropy(..., ignore_index=...)``, a masked mean) averaged over
ranks whose counts differ is not the mean over the batch's counted tokens, and the step trains
another objective with no error.

So :func:`check_loss` runs the loss function twice, with its model's forward replaced:

1. **this rank**: the model runs as the step runs it (sharded, without autograd); its outputs
   become leaves, and the loss function gives this rank's loss ``L_r`` and ``g_r = dL_r/dO_r``;
2. **the whole batch**: the loss function's tensor arguments and the model's outputs are gathered
   over the batch ranks (rows over the data-parallel ranks, in ``dp_rank`` order; sequences over
   ``cp``, in token order), the model's forward returns the gathered outputs, and the loss
   function gives ``L`` and ``G = dL/dO``.

It compares ``c * sum_r L_r`` with ``L`` and ``c * g_r`` with this rank's part of ``G``
(``c = 1 / grad_ranks`` for ``"mean"``, 1 for ``"sum"``; ``grad_scale`` multiplies both sides).
An output without the batch rows (an auxiliary loss) is per rank by design: the whole batch's is
taken as the ranks' mean (``"mean"``) or sum (``"sum"``), which is what the step's reduction makes
of it, so it agrees whenever the loss function uses it linearly.

**What is a batch tensor.** A tensor whose first dim has the rows of the model's first input is
gathered over the data-parallel ranks; under ``cp``, one whose second dim has this rank's
sequence length is gathered over ``cp`` first. Anything else is passed as it is.

**The bound.** Both sides compute from the same model outputs, so they differ only by the loss
function's own sums taken in another order: ``4 u (tokens + classes)`` norm-wise (the
dot-product bound of [Note: the differential check], ``u = 2**-24``), with tokens the whole
batch's rows times sequence and classes the outputs' last dim.

**Memory.** The whole batch's model outputs live on every rank for the check (for a language
model, the logits of the global batch). When they would pass ``_LIMIT`` elements the check is
skipped and the report says so.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, cast

import torch

from fsdpfn import comm as C
from fsdpfn._plan import Plan
from fsdpfn._tree import flatten, unflatten
from fsdpfn.transforms._axes import cp_group, cp_rank, dp_rank

__all__ = ["check_loss"]

_U32 = 2.0**-24
_LIMIT = 2**26  # elements of gathered outputs, over every rank: 256 MiB of float32 on each


def _scalar(result) -> torch.Tensor | None:
    """The loss of ``loss_fn``'s result: a 0-dim float tensor, or the first item of ``(loss, aux)``."""
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if isinstance(result, torch.Tensor) and result.dim() == 0 and result.is_floating_point():
        return result
    return None


class _Batch:
    """How a tensor of this rank is made whole over the batch ranks, and cut back."""

    def __init__(self, plan: Plan, rows: int, seq: int | None):
        self.plan, self.rows, self.seq = plan, rows, seq
        self.cp = plan.cp_size
        self.cp_group = cp_group(plan) if self.cp > 1 else None

    def rowed(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == self.rows

    def seqd(self, t) -> bool:
        return self.cp > 1 and self.rowed(t) and t.dim() >= 2 and t.shape[1] == self.seq


def _world_rows(t: torch.Tensor, group=None) -> torch.Tensor:
    wire = t.to(torch.uint8) if t.dtype == torch.bool else t
    out = C.all_gather_rows(wire.contiguous(), group, tag="verify_loss")
    return out.to(torch.bool) if t.dtype == torch.bool else out


def check_loss(
    loss_fn: Callable[..., Any],
    params: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    cap,
    compare: Callable[[str, torch.Tensor, torch.Tensor, float], None],
    note: Callable[[str], None],
    group=None,
) -> None:
    """[Note: the loss check] for ``loss_fn(params, *args, **kwargs)``, whose model, plan and
    gradient reduction ``cap`` (a :func:`fsdpfn.transforms._guards.capturing` record) found.
    ``compare(what, step, one_process, bound)`` records each comparison; ``note(why)`` says why
    the check was skipped. Every rank of the mesh (of ``group``, the process group of the plan's
    ranks: a pipeline's last stage) calls it at the same point."""
    from fsdpfn.transforms._guards import capturing
    from fsdpfn.transforms._intercept import intercept as _intercept

    plan, model = cap.plan, cap.model
    first = next(
        (a for a in flatten((list(cap.args), cap.kwargs))[0] if isinstance(a, torch.Tensor) and a.dim() >= 1), None
    )
    if first is None:
        return note("the model's inputs have no batch tensor")
    batch = _Batch(plan, first.shape[0], first.shape[1] if first.dim() >= 2 else None)
    if not any(batch.rowed(a) for a in flatten((list(args), kwargs))[0]):
        # The loss function closes over its batch: the whole batch cannot be handed to it.
        return note("loss check skipped: no argument of the loss function holds the batch's rows")
    detached = {n: t.detach() for n, t in params.items()}

    # ---- 1. this rank's loss and its gradient for the model's outputs --------------------------
    calls: list = []

    def local(name, module, orig, a, kw):
        with torch.no_grad():
            out = orig(*a, **kw)
        leaves, spec = flatten(out, none_is_leaf=True)
        leaves = [
            x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in leaves
        ]
        calls.append((leaves, spec))
        return unflatten(spec, leaves)

    problem = None
    with capturing() as guard, _intercept({"": model}, local), torch.enable_grad():
        guard.inert = True
        loss = _scalar(loss_fn(detached, *args, **kwargs))
    if len(calls) != 1:
        problem = f"the loss function called its model {len(calls)} times"
    elif loss is None:
        problem = "the loss function returned no scalar float loss"
    outs, out_spec = calls[0] if calls else ([], None)
    grads: list[torch.Tensor | None] = [None] * len(outs)
    if problem is None and loss is not None:
        wrt = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        found = iter(torch.autograd.grad(loss, wrt, allow_unused=True) if wrt else [])
        grads = [next(found) if isinstance(o, torch.Tensor) and o.requires_grad else None for o in outs]

    # Every rank learns every rank's position, loss, tensors' shapes and any reason to stop.
    arg_leaves, arg_spec = flatten((list(args), kwargs), none_is_leaf=True)
    mine = {
        "pos": [dp_rank(plan), cp_rank(plan)],
        "loss": float(loss.detach()) if loss is not None else None,
        "problem": problem,
        "rows": batch.rows,
        "size": sum(o.numel() for o in outs if isinstance(o, torch.Tensor)),
    }
    table = cast("dict[int, dict[str, Any]]", C.exchange_values(f"verify loss {plan.fingerprint}", mine, group))
    stopped = sorted({v["problem"] for v in table.values() if v["problem"]})
    if stopped:
        return note(f"loss check skipped: {stopped[0]}")
    if sum(v["size"] for v in table.values()) * len(table) > _LIMIT:
        return note(
            "loss check skipped: the whole batch's model outputs would take more than "
            f"{_LIMIT * 4 >> 20} MiB on every rank"
        )
    order = sorted(table)  # global ranks, as all_gather_rows stacks them
    by_dp: dict[int, int] = {}
    by_pos: dict[tuple, int] = {}
    for i, r in enumerate(order):
        by_dp.setdefault(table[r]["pos"][0], i)
        by_pos.setdefault(tuple(table[r]["pos"]), i)
    dp_rows = [table[order[by_dp[d]]]["rows"] for d in sorted(by_dp)]
    most = max(dp_rows)
    mean = cap.grad_op == "mean"
    c = 1.0 / plan.grad_ranks if mean else 1.0

    def whole(t):
        """``t`` over the whole batch: its sequences over cp, then its rows over dp."""
        if not batch.rowed(t):
            return t
        if batch.seqd(t):
            from fsdpfn.transforms._cp import context_parallel_unshard

            t = context_parallel_unshard(t.detach(), batch.cp_group)
        padded = torch.cat([t, t.new_zeros((most - t.shape[0], *t.shape[1:]))]) if t.shape[0] < most else t
        stacked = _world_rows(padded.detach(), group)
        return torch.cat([stacked[by_dp[d]][: dp_rows[k]] for k, d in enumerate(sorted(by_dp))])

    def combined(t):
        """An output without batch rows: the ranks' mean (or sum), as the step's reduction makes it."""
        stacked = _world_rows(t.detach(), group)
        picked = torch.stack([stacked[i] for i in by_pos.values()])
        return picked.mean(0) if mean else picked.sum(0)

    def part(t, like):
        """This rank's rows (and, under cp, its part of each sequence) of a whole-batch ``t``."""
        if not batch.rowed(like):
            return t
        start = sum(dp_rows[: sorted(by_dp).index(dp_rank(plan))])
        t = t[start : start + like.shape[0]]
        if batch.seqd(like):
            from fsdpfn.transforms._cp import context_parallel_shard

            t = context_parallel_shard(t, batch.cp_group)
        return t

    # ---- 2. the loss function on the whole batch ---------------------------------------------------
    whole_outs = [
        (whole(o) if batch.rowed(o) else combined(o)).detach().requires_grad_(True)
        if isinstance(o, torch.Tensor) and o.requires_grad
        else o
        for o in outs
    ]
    whole_args = unflatten(arg_spec, [whole(a) if isinstance(a, torch.Tensor) else a for a in arg_leaves])

    def replaced(name, module, orig, a, kw):
        return unflatten(out_spec, whole_outs)

    try:
        with capturing() as guard, _intercept({"": model}, replaced), torch.enable_grad():
            guard.inert = True
            ref = _scalar(loss_fn(detached, *whole_args[0], **whole_args[1]))
    except Exception as e:  # noqa: BLE001 - e.g. targets the loss function closes over: rows of this rank only
        return note(
            f"loss check skipped: the loss function did not run on the whole batch ({type(e).__name__}: "
            f"{str(e)[:200]}); are all its batch tensors among its arguments?"
        )
    if ref is None:
        return note("loss check skipped: the loss function returned no scalar loss on the whole batch")
    wrt = [o for o in whole_outs if isinstance(o, torch.Tensor) and o.requires_grad]
    found = iter(torch.autograd.grad(ref, wrt, allow_unused=True) if wrt else [])
    ref_grads = [next(found) if isinstance(o, torch.Tensor) and o.requires_grad else None for o in whole_outs]

    big = next((o for o in whole_outs if isinstance(o, torch.Tensor) and o.dim() >= 1), None)
    classes = big.shape[-1] if big is not None and big.dim() >= 2 else 1
    tokens = big.numel() // classes if big is not None else 1
    bound = 4 * _U32 * (tokens + classes)
    step = c * sum(table[order[i]]["loss"] for i in by_pos.values())
    compare("the loss", torch.tensor(step, dtype=torch.float64), ref.detach().double(), bound)
    for k, (o, g, gw) in enumerate(zip(outs, grads, ref_grads)):
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            continue
        g = torch.zeros_like(o) if g is None else g
        gw = torch.zeros_like(whole_outs[k]) if gw is None else gw
        # An output without rows was combined as the ranks' mean (or sum): each rank's share of its gradient.
        mine_ref = part(gw, o) if batch.rowed(o) else gw * c
        compare(f"the loss's gradient for model output {k}", c * g, mine_ref, bound)
    return None


def describe_mismatch(plan: Plan, grad_op: str, what: str, step: float, one: float, err: float, bound: float) -> str:
    """The text of a failed loss comparison: both objectives, and the usual cause with its fix."""
    how = (
        f"the mean over the {plan.grad_ranks} ranks that read different data of each rank's loss"
        if grad_op == "mean"
        else "the sum over the ranks that read different data of each rank's loss"
    )
    values = f" ({how}: {step:.6g}; the loss function on the whole batch: {one:.6g})" if math.isfinite(step) else ""
    return (
        f"{what} the step trains differs from the loss function on the whole batch (every rank's rows and tokens "
        f"gathered){values}: relative error {err:.3g} > bound {bound:.3g}. The step would train another objective than "
        "one process. Usually the loss is a mean over this rank's counted tokens (cross_entropy with ignore_index, a "
        "masked mean) while ranks count different numbers of tokens: sum the loss and divide by the global count, "
        "fsdpfn.unshard(params, plan, grad_op='sum', grad_scale=1 / global_count) with reduction='sum' (see 'How fsdpfn "
        "checks your model' in the docs)"
    )
