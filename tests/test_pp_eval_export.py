"""Evaluation and export on a pipelined plan.

- ``PipelineRuntime.evaluate``: the forward-only op list (GPipe's forwards, the stages' gathers
  and frees) gives the loss ``step`` returns for the same parameters, bitwise (the same forward
  on the same micro-batches), on (pp 2), (pp 2, dp 2) and interleaved (pp 2, 4 stages); within
  float32 rounding of one process's whole-batch loss (see [Note: the tolerance of the pipeline
  parity tests] in test_pp_runtime.py: a mean of m means against one mean, n = 64 tokens, so
  n eps ~= 4e-6 relative bounds it); it keeps no graph and leaves every unit sharded.
- ``checkpoint.export_full`` of a pipelined plan: each rank passes its stages' parameters and
  rank 0 writes the whole model's state dict, bitwise the one-process model's (pp 2; pp 2 x
  dp 2; interleaved; pp 2 x tp 2); parameters of another rank's stage are refused by name on
  every rank.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import PipelineRuntime

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=4, heads=4, bias=False)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
EPS = 2.0**-24

LAYOUTS = [
    pytest.param((2, 1), ("pp", "dp"), 2, id="pp2"),
    pytest.param((2, 2), ("pp", "dp"), 2, id="pp2xdp2"),
    pytest.param((2, 1), ("pp", "dp"), 4, id="pp2-interleaved"),
    pytest.param((2, 1, 2), ("pp", "dp", "tp"), 2, id="pp2xtp2"),
]


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _pipe(shape, names, stages):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh(shape, names), units=UNITS, stages=stages, tp=GPT_TP_PLAN if "tp" in names else None
    )
    pipe = PipelineRuntime(model, plan, "1f1b" if stages == 2 else "interleaved_1f1b", 4, loss_fn=_ce)
    return model, plan, pipe


def _evaluate(rank, world, shape, names, stages):
    model, plan, pipe = _pipe(shape, names, stages)
    ref_model = GPT(CFG)
    ref_model.load_state_dict(model.state_dict())
    params = pipe.shard(model)
    gen = torch.Generator().manual_seed(1 + (plan.mesh.get_local_rank("dp") if "dp" in names else 0))
    tokens = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ev = pipe.evaluate(params, x, y)
    ops = list(pipe.last_ops)
    sharded = all(t.untyped_storage().nbytes() == 0 for ex in pipe._ex.values() for ts in ex.full.values() for t in ts)
    _, trained = pipe.step(params, x, y)
    with torch.no_grad():
        ref = _ce(ref_model(x), y)
    return ev.item(), trained.item(), ref.item(), ev.requires_grad, sharded, ops


@pytest.mark.parametrize("shape,names,stages", LAYOUTS)
def test_evaluate_is_the_steps_loss_without_a_backward(run_on_ranks, shape, names, stages):
    for ev, trained, ref, grad, sharded, ops in run_on_ranks(_evaluate, math.prod(shape), shape, names, stages):
        assert ev == trained, (ev, trained)
        assert abs(ev - ref) <= 8 * CFG.seq_len * EPS * abs(ref), (ev, ref)
        assert not grad and sharded
        assert ops and not any("backward" in op or "grad" in op or op.startswith("reduce") for op in ops), ops


def _export(rank, world, shape, names, stages, folder):
    model, plan, pipe = _pipe(shape, names, stages)
    params = pipe.shard(model)
    path = os.path.join(folder, "model.pt")
    written = fsdpfn.checkpoint.export_full(path, params, plan, model=model)
    same = None
    if rank == 0:
        sd = torch.load(path, weights_only=True)
        ref = model.state_dict()
        same = sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    # another stage's parameter in this rank's dict: refused on every rank, before any transfer
    other = next(n for n in plan.param_names if n not in params)
    try:
        fsdpfn.checkpoint.export_full(path + ".bad", {**params, other: torch.zeros(plan.param(other).shape)}, plan)
        refused = None
    except ValueError as e:
        refused = str(e)
    return written, same, refused


@pytest.mark.parametrize("shape,names,stages", LAYOUTS)
def test_export_full_of_a_pipeline_writes_the_whole_model(run_on_ranks, shape, names, stages):
    with tempfile.TemporaryDirectory() as folder:
        results = run_on_ranks(_export, math.prod(shape), shape, names, stages, folder)
        assert not os.path.exists(os.path.join(folder, "model.pt.bad"))
    assert results[0][:2] == (os.path.join(folder, "model.pt"), True)
    for written, _, refused in results[1:]:
        assert written is None
    for _, _, refused in results:
        assert refused is not None and "export_full" in refused, refused


def _profiled(rank, world, name):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh((2, 1), ("pp", "dp")), units=UNITS, stages=4 if name == "interleaved_1f1b" else 2
    )
    pipe = PipelineRuntime(model, plan, name, 4, loss_fn=_ce, profile=True)
    plain = PipelineRuntime(model, plan, name, 4, loss_fn=_ce)
    params = pipe.shard(model)
    tokens = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    g, loss = pipe.step(params, tokens[:, :-1], tokens[:, 1:])
    g2, loss2 = plain.step(params, tokens[:, :-1], tokens[:, 1:])
    same = torch.equal(loss, loss2) and all(torch.equal(g[n].to_local(), g2[n].to_local()) for n in g)
    return pipe.last_profile, list(pipe.last_ops), same, plain.last_profile


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_profile_records_every_op_and_the_activations_the_schedule_counts(run_on_ranks, name):
    """``profile=True``: one timeline entry per op in order, and the most activation bytes a
    rank kept equal to what ``pipeline_times`` counts from the op lists with each stage's
    measured bytes per micro-batch (the runtime frees a forward's saved tensors exactly at its
    backward); the hooks change no number."""
    results = run_on_ranks(_profiled, 2, name)
    v = 2 if name == "interleaved_1f1b" else 1
    per_stage = {}
    for prof, _, _, _ in results:
        for s, _, nbytes in prof.activations:
            assert per_stage.setdefault(s, nbytes) == nbytes  # every micro-batch of a stage keeps the same
    ps = fsdpfn.pipeline_schedule(fsdpfn.Stages(tuple((f"u{s}",) for s in range(2 * v)), 2), name, 4)
    want = fsdpfn.pipeline_times(ps, activations=[per_stage[s] for s in range(2 * v)]).peak_activations
    for r, (prof, ops, same, plain) in enumerate(results):
        assert same and plain is None
        assert prof.rank == r and prof.schedule == name
        assert [op for op, _, _ in prof.timeline] == ops
        assert all(0 <= a <= b for _, a, b in prof.timeline) and 0 < prof.busy <= prof.makespan
        assert min(per_stage.values()) > 0 and prof.peak_activations == want[r], (prof.peak_activations, want)
