"""Shared by the context-parallel parity tests: AdamW steps of a cp plan against one process."""

from __future__ import annotations

from typing import Callable

import torch

import fsdpfn
from fsdpfn.runtime import Runtime


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def cp_adamw_worst(
    model,
    plan,
    style: str,
    strategy: str,
    batch: Callable[[int], tuple],
    loss: Callable,
    ref: list,
    per_rank: int,
    steps: int,
) -> float:
    """``steps`` AdamW steps of ``model`` on ``plan``, this dp rank's ``per_rank`` rows of
    ``batch(step)`` cut into this cp rank's part of each sequence, ``style`` ``"pure"``
    (``torch.func.grad``) or ``"eager"`` (the Runtime); returns the worst relative difference of
    any parameter from ``ref[step]`` (one process's parameters) over all steps."""
    me = fsdpfn.transforms.dp_rank(plan)
    mine = slice(me * per_rank, (me + 1) * per_rank)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    rt = Runtime(model, plan) if style == "eager" else None
    worst = 0.0
    for step in range(steps):
        x, y = batch(step)
        x, y = fsdpfn.context_parallel_shard((x[mine], y[mine]), plan)
        with fsdpfn.context_parallel(plan, strategy=strategy):
            if style == "pure":
                grads = torch.func.grad(
                    lambda ps: loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)
                )(params)
            else:
                assert rt is not None
                with rt.bind(params):
                    loss(model(x), y).backward()
                grads = rt.grads(params)
        with torch.no_grad():
            updates, state = opt.update(grads, state, params)
            params = fsdpfn.optim.apply_updates(params, updates)
        if style == "eager":
            params = {n: p.detach().requires_grad_() for n, p in params.items()}
        # fsdpfn's counted gather, not DTensor.full_tensor(): a rank once died (SIGSEGV) inside
        # DTensor's eager functional-collective redistribute over gloo on the 4-rank HSDP x cp mesh.
        worst = max(worst, max(_rel(fsdpfn.comm.full_tensor(params[n]), ref[step][n]) for n in params))
    return worst
