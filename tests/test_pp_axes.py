"""The pipeline beside the other data-parallel axes: within a stage, HSDP and context
parallelism work as without pp.

- (pp 2, replicate 2, shard 1): the stages' gradients all-reduced over the replicas;
- (pp 2, dp 1, cp 2), both cp strategies: ``PipelineRuntime`` gives each cp rank its part of
  every sequence and runs the stages inside the cp axis; the loss is the mean over the rank's
  tokens (the cp ranks' losses average to the batch's), the gradients are averaged over dp x cp;
- 5 AdamW steps, 1F1B and GPipe, within 1e-6 relative of one process on the whole batch, step
  by step (see [Note: the tolerance of the pipeline parity tests] in test_pp_runtime.py; the cp
  attention adds the reordered sums of its log-sum-exp merge over 2 blocks, covered by the same
  bound as in test_cp.py);
- a mixture-of-experts model is refused by name when it is cut into stages (its blocks return
  the load-balancing loss beside the activation, which a stage cannot pass on yet).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import PipelineRuntime
from _parity import one_process

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=4, heads=4, bias=False)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
MICRO, PER_RANK, STEPS, TOL = 4, 4, 5, 1e-6


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(dp, step):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (dp * PER_RANK, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@one_process
def _reference(dp):
    torch.manual_seed(0)
    model = GPT(CFG)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    out, losses = [], []
    for step in range(STEPS):
        x, y = _batch(dp, step)
        with torch.no_grad():
            logits = torch.func.functional_call(model, params, (x,))
            losses.append(
                [
                    _ce(logits[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]).item()
                    for r in range(dp)
                ]
            )
        g = torch.func.grad(lambda ps: _ce(torch.func.functional_call(model, ps, (x,)), y))(params)
        updates, state = opt.update(g, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        out.append(params)
    return out, losses


def _train(rank, world, shape, names, schedule, cp_strategy):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(model, testing.mesh(shape, names), units=UNITS)
    pipe = PipelineRuntime(model, plan, schedule, MICRO, loss_fn=_ce, cp_strategy=cp_strategy)
    dp, dp_rank = plan.dp_size, fsdpfn.transforms.dp_rank(plan)
    params = pipe.shard(model)
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    ref_params, ref_losses = _reference(dp)
    worst, losses = 0.0, []
    for step in range(STEPS):
        x, y = _batch(dp, step)
        mine = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
        grads, loss = pipe.step(params, x[mine], y[mine])
        with torch.no_grad():
            updates, state = opt.update(grads, state, params)
            params = fsdpfn.optim.apply_updates(params, updates)
        worst = max(worst, max(_rel(params[n].full_tensor(), ref_params[step][n]) for n in params))
        losses.append((loss.item(), ref_losses[step][dp_rank]))
    cp_rank = plan.mesh.get_local_rank("cp") if "cp" in names else 0
    return worst, losses, dp_rank, cp_rank


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(
    "shape,names,cp_strategy",
    [
        pytest.param((2, 2, 1), ("pp", "replicate", "shard"), "allgather", id="pp2xhsdp2"),
        pytest.param((2, 1, 2), ("pp", "dp", "cp"), "allgather", id="pp2xcp2-allgather"),
        pytest.param((2, 1, 2), ("pp", "dp", "cp"), "ring", id="pp2xcp2-ring"),
        pytest.param((2, 1, 2), ("pp", "dp", "cp"), "ulysses", id="pp2xcp2-ulysses"),
    ],
)
def test_pipeline_beside_hsdp_and_cp_trains_as_one_process(run_on_ranks, shape, names, cp_strategy, schedule):
    results = run_on_ranks(_train, math.prod(shape), shape, names, schedule, cp_strategy)
    for worst, _, _, _ in results:
        assert worst <= TOL, worst
    # the loss of a step: each cp rank's tokens' mean; their average is the batch's (equal halves)
    by_dp: dict[int, list] = {}
    for _, losses, dp_rank, cp_rank in results:
        by_dp.setdefault(dp_rank, {})[cp_rank] = losses
    for per_cp in by_dp.values():
        for step in range(STEPS):
            got = sum(per_cp[c][step][0] for c in per_cp) / len(per_cp)
            want = per_cp[0][step][1]
            assert abs(got - want) <= TOL * abs(want), (step, got, want)


def _moe(rank, world):
    cfg = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=2, heads=4, experts=2)
    model = GPT(cfg)
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh((2, 1), ("pp", "dp")), units=["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
    )
    with pytest.raises(NotImplementedError, match="MoE blocks return"):
        PipelineRuntime(model, plan, "1f1b", 2, loss_fn=_ce)
    with pytest.raises(ValueError, match="cp_strategy must be one of"):
        PipelineRuntime(
            GPT(CFG),
            fsdpfn.pipeline_plan(GPT(CFG), testing.mesh((2, 1), ("pp", "dp")), units=UNITS),
            "1f1b",
            2,
            loss_fn=_ce,
            cp_strategy="zigzag",
        )
    return True


def test_moe_stages_and_unknown_cp_strategies_are_refused_by_name(run_on_ranks):
    assert all(run_on_ranks(_moe, 2))
