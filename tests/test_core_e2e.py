"""End to end: the pure training loop (shard, unshard inside the loss, ``torch.func.grad``,
update) under every strategy, against one process, step by step, and gradients against torch
FSDP2's ``fully_shard`` on the same model and batch."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=8, width=12, depth=2, heads=2)  # 29 rows: uneven on 2, 3, 4
STEPS, LR, PER_RANK = 5, 0.2, 2


def _batch(world, step):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (world * PER_RANK, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, params, x, y):
    logits = torch.func.functional_call(model, params, (x,))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sgd_parity(rank, world, strategy, mesh_shape):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names), strategy=strategy)
    params = fsdpfn.shard(model, plan)
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    worst = []
    for step in range(STEPS):
        x, y = _batch(world, step)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        grads = torch.func.grad(lambda ps: _loss(model, fsdpfn.unshard(ps, plan), x[mine], y[mine]))(params)
        params = {n: p - LR * grads[n] for n, p in params.items()}
        ref_grads = torch.func.grad(lambda ps: _loss(reference, ps, x, y))(ref_params)
        ref_params = {n: p - LR * ref_grads[n] for n, p in ref_params.items()}
        worst.append(max(_rel(params[n].full_tensor(), ref_params[n]) for n in ref_params))
        assert all(params[n].placements == fsdpfn.transforms.placements(plan, n) for n in params)
    return worst


@pytest.mark.parametrize(
    "strategy,mesh_shape",
    [("replicate", (2,)), ("zero1", (2,)), ("zero2", (3,)), ("zero3", (2,)), ("zero3", (3,)), ("zero3", (2, 2))],
    ids=["replicate", "zero1", "zero2-w3", "zero3", "zero3-w3", "hsdp-2x2"],
)
def test_five_sgd_steps_match_one_process(run_on_ranks, strategy, mesh_shape):
    world = 1
    for d in mesh_shape:
        world *= d
    for per_step in run_on_ranks(_sgd_parity, world, strategy, mesh_shape):
        assert len(per_step) == STEPS
        assert max(per_step) < 1e-5, per_step


def test_mixed_strategies_per_unit(run_on_ranks):
    strategy = {"<root>": "replicate", "blocks.0": "zero2", "blocks.1": "zero3"}
    for per_step in run_on_ranks(_sgd_parity, 2, strategy, (2,)):
        assert max(per_step) < 1e-5, per_step


def _vs_fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    theirs = copy.deepcopy(model)
    mesh = testing.mesh((world,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    params = fsdpfn.shard(model, plan)
    x, y = _batch(world, 0)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    grads = torch.func.grad(lambda ps: _loss(model, fsdpfn.unshard(ps, plan), x[mine], y[mine]))(params)
    F.cross_entropy(theirs(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
    errors, local_equal_shape = {}, True
    for name, p in theirs.named_parameters():
        errors[name] = _rel(grads[name].full_tensor(), p.grad.full_tensor())
        local_equal_shape &= grads[name].to_local().shape == p.grad.to_local().shape
    return max(errors.values()), local_equal_shape


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_equal_torch_fsdp2(run_on_ranks, world):
    for err, same_local_shapes in run_on_ranks(_vs_fsdp2, world):
        assert err < 1e-6
        assert same_local_shapes  # same torch.chunk split of every parameter as FSDP2
