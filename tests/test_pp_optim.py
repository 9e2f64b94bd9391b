"""Optimizers on a pipeline's stage-local parameters: each pp rank holds only its stages'
parameters (DTensors on the mesh without pp), yet the optimizer must step the whole model as one
process does.

- Muon (owner layout: Newton–Schulz of each matrix on one rank of the stage's data-parallel
  group, with AdamW for the rest) on (pp 2, dp 2), (pp 2, tp 2) and interleaved (pp 2, 4 stages,
  dp 2): 3 steps on fixed gradients, bitwise equal to one process on the full tensors. Muon is a
  function of each matrix alone, so a stage needs nothing from another.
- ``global_norm`` and ``clip_by_global_norm`` span every stage: the norm of the whole model's
  gradients on every pp rank (not the stage's own), and the clipped SGD step one process's.
- ``apply_if_finite``: a NaN in one stage's gradient on one rank skips the step on every rank of
  every stage, and the next finite step updates everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=4, heads=4, bias=True)  # 29: uneven shards
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
EPS = 2.0**-24  # float32's unit roundoff

MESHES = [
    pytest.param((2, 2), ("pp", "dp"), 2, id="pp2xdp2"),
    pytest.param((2, 1, 2), ("pp", "dp", "tp"), 2, id="pp2xtp2"),
    pytest.param((2, 2), ("pp", "dp"), 4, id="pp2x4stages-dp2"),
]


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _stage_layout(model, shape, names, num_stages):
    """This rank's stage plans and its stages' shards of the model's parameters."""
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh(shape, names), units=UNITS, stages=num_stages, tp=GPT_TP_PLAN if "tp" in names else None
    )
    here = plan.stages.stages_of(plan.mesh.get_local_rank("pp"))
    return [plan.stage_plan(s) for s in here]


def _shard(tree, stage_plans):
    out = {}
    for sp in stage_plans:
        out.update(fsdpfn.shard({n: tree[n] for n in sp.param_names}, sp, check=False))
    return out


def _muon():
    return optim.muon(lr=0.05, weight_decay=0.1, adamw_lr=0.01, ns_dtype=torch.float32)


def _muon_parity(rank, world, shape, names, num_stages, steps=3):
    model = _model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage_plans = _stage_layout(model, shape, names, num_stages)
    params = _shard(full, stage_plans)
    ref = {n: full[n] for n in params}  # one process, restricted to the names this rank holds
    opt, ref_opt = _muon(), _muon()
    state = opt.init(params)
    ref_state = ref_opt.init(full)
    ref_full = full
    for step in range(steps):
        g = _grads(model, 100 + step)
        updates, state = opt.update(_shard(g, stage_plans), state, params)
        params = optim.apply_updates(params, updates)
        ref_updates, ref_state = ref_opt.update(g, ref_state, ref_full)
        ref_full = optim.apply_updates(ref_full, ref_updates)
    ref = {n: ref_full[n] for n in params}
    return {n: torch.equal(params[n].full_tensor(), ref[n]) for n in params}, sorted(params)


@pytest.mark.parametrize("shape,names,num_stages", MESHES)
def test_muon_on_stage_parameters_equals_one_process_bitwise(run_on_ranks, shape, names, num_stages):
    results = run_on_ranks(_muon_parity, math.prod(shape), shape, names, num_stages)
    held = set()
    for same, mine in results:
        assert all(same.values()), [n for n, ok in same.items() if not ok]
        held |= set(mine)
    assert held == {n for n, _ in _model().named_parameters()}  # every parameter is stepped somewhere


def _norm_and_clip(rank, world, shape, names, num_stages, poison):
    model = _model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage_plans = _stage_layout(model, shape, names, num_stages)
    params = _shard(full, stage_plans)
    g = _grads(model, 5)
    grads = _shard(g, stage_plans)
    norm = optim.global_norm(grads).item()
    ref_norm = optim.global_norm(g).item()

    clip = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    updates, _ = clip.update(grads, clip.init(params), params)
    ref_updates, _ = clip.update(g, clip.init(full), full)
    clip_err = max(
        ((updates[n].full_tensor() - ref_updates[n]).abs().max() / ref_updates[n].abs().max()).item() for n in updates
    )

    # apply_if_finite: a NaN in one gradient of the last stage, on the last rank only.
    guarded = optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=3)
    state = guarded.init(params)
    bad = dict(grads)
    if rank == world - 1:
        name = next(n for n in stage_plans[-1].param_names if n.startswith("head"))
        local = bad[name].to_local().clone()
        local.view(-1)[0] = float("nan")
        bad[name] = torch.distributed.tensor.DTensor.from_local(
            local, bad[name].device_mesh, bad[name].placements, shape=bad[name].shape, stride=bad[name].stride()
        )
    updates, state = guarded.update(bad if poison else grads, state, params)
    stepped = optim.apply_updates(params, updates)
    unchanged = all(torch.equal(stepped[n].to_local(), params[n].to_local()) for n in params)
    skipped = (state.last_finite, state.notfinite_count, unchanged)
    updates, state = guarded.update(grads, state, params)  # the next step is finite everywhere
    stepped = optim.apply_updates(params, updates)
    moved = all(
        not torch.equal(stepped[n].to_local(), params[n].to_local()) for n in params if params[n].to_local().numel()
    )
    return norm, ref_norm, clip_err, skipped, (state.last_finite, moved)


@pytest.mark.parametrize("shape,names,num_stages", MESHES)
def test_global_norm_clip_and_finite_checks_span_every_stage(run_on_ranks, shape, names, num_stages):
    """The norm is the whole model's on every rank. One process sums n = 2,600-odd squares
    (``GPT(CFG)``'s parameters) in one order, the stages in another: reordering a sum of n
    positive terms moves it by at most (n - 1) eps of it, and the square root halves that, so
    the norms agree within n eps / 2 ~= 8e-5 relative; the stage's own norm, what each stage
    used before, is off by tens of percent here (the stages hold about half of the model each).
    The clipped update is g * (1 / norm) * lr: within the norm's error of one process's."""
    n = sum(p.numel() for p in _model().parameters())
    bound = n * EPS / 2
    results = run_on_ranks(_norm_and_clip, math.prod(shape), shape, names, num_stages, True)
    norms = {r[0] for r in results}
    assert len(norms) == 1, norms  # one all-reduced value: the same bits on every rank
    for norm, ref_norm, clip_err, skipped, after in results:
        assert abs(norm - ref_norm) <= bound * ref_norm, (norm, ref_norm)
        assert clip_err <= 2 * bound, clip_err
        assert skipped == (False, 1, True), skipped  # every rank of every stage skipped the same step
        assert after == (True, True), after


def _mixed(rank, world):
    model = _model()
    stage_plans = _stage_layout(model, (2, 1), ("pp", "dp"), 2)
    grads = _shard(_grads(model, 1), stage_plans)
    with pytest.raises(ValueError, match="mixes pipeline-stage parameters with a plain"):
        optim.global_norm({**grads, "extra": torch.ones(3)})
    return True


def test_a_stage_tree_mixed_with_other_leaves_is_refused(run_on_ranks):
    assert all(run_on_ranks(_mixed, 2))
