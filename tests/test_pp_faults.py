"""The fault suite on a pipeline: a pp rank that raises or is killed in its stage's backward ends
every rank within the collective timeout, with errors that name it; resuming from the last
checkpoint gives the straight run's parameters bit for bit.

The survivor (stage 0) waits in a point-to-point receive for the gradient the failed stage
would send: a killed peer closes the connection, a peer that raised announces its error (see
[Note: a point-to-point wait] in ``fsdpfn/comm/_pp.py``). Each case is a real job started with
:func:`fsdpfn.launch.launch` (fresh processes), on 2 gloo ranks (pp 2), with a 4 s timeout.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import checkpoint, comm, optim, testing
from fsdpfn.launch import RankError, launch
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import PipelineRuntime

TIMEOUT = 4.0
STEPS = 4
FAULT_STEP = 2
VICTIM = 1  # runs stage 1: blocks.1, norm, head
CFG = GPTConfig(vocab_size=32, width=16, depth=2, heads=2, seq_len=8, bias=False)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises or kills the process: a stage that fails half-way through
    its backward."""

    @staticmethod
    def forward(x, how):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.how = inputs[1]

    @staticmethod
    def backward(ctx, g):
        if ctx.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("stage 1 failed in its backward")


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _job(rank, world, root, fault):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(model, testing.mesh((world, 1), ("pp", "dp")), units=UNITS, stages=world)
    pipe = PipelineRuntime(model, plan, "1f1b", micro_batches=2, loss_fn=_ce)
    (stage,) = plan.stages.stages_of(pipe.pp_rank)
    stage_plan = plan.stage_plan(stage)
    params = pipe.shard(model)
    opt = optim.adamw(lr=1e-2)
    state, start = opt.init(params), 0
    if checkpoint.latest(root) is not None:
        loaded = checkpoint.load(root, {"params": params, "opt_state": state, "step": 0}, stage_plan)
        params, state, start = loaded["params"], loaded["opt_state"], loaded["step"]
    for step in range(start, STEPS):
        if fault is not None and rank == VICTIM and step == FAULT_STEP:
            model.blocks[1].register_forward_hook(lambda m, args, out: _FailInBackward.apply(out, fault))
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(step))
        grads, _ = pipe.step(params, tokens[:, :-1], tokens[:, 1:])
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        checkpoint.save(root, {"params": params, "opt_state": state, "step": step + 1}, stage_plan)
    return start, {n: comm.full_tensor(p) for n, p in params.items()}


@functools.lru_cache(maxsize=1)
def _straight(tmp_root: str):
    return [out[1] for out in launch(_job, 2, os.path.join(tmp_root, "straight"), None, timeout=60)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _straight(str(tmp_path_factory.mktemp("pp_faults")))


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_pipeline_rank_fault_ends_every_rank_naming_it_and_resume_is_bitwise(tmp_path, straight, fault):
    root = str(tmp_path / "ckpt")
    t = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_job, 2, root, fault, timeout=TIMEOUT)
    elapsed = time.monotonic() - t
    errors = info.value.errors
    assert elapsed < 60 + 2 * TIMEOUT, elapsed  # start-up and two steps, then at most the timeout
    survivor = errors[0]
    assert "CollectiveError" in survivor and "failed on rank 0" in survivor, survivor
    assert "send_recv" in survivor and "recv_grad s0" in survivor, survivor  # the gradient it waited for
    if fault == "raise":
        assert "RuntimeError: stage 1 failed in its backward" in errors[VICTIM], errors
        assert "Rank 1 raised: RuntimeError: stage 1 failed in its backward" in survivor, survivor
    else:
        assert f"rank {VICTIM} (pid" in errors[VICTIM] and "killed by signal 9" in errors[VICTIM], errors
    # Resumed from the last complete checkpoint, the job ends where the straight run ended.
    outs = launch(_job, 2, root, None, timeout=60)
    assert [start for start, _ in outs] == [FAULT_STEP, FAULT_STEP]
    for (_, resumed), ref in zip(outs, straight):
        assert sorted(resumed) == sorted(ref)
        for name, value in ref.items():
            assert torch.equal(resumed[name], value), name
