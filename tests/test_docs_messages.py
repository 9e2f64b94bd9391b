"""Messages the documentation promises: what they name must be what differs.

``checkpoint.load`` into a template whose parameters match the checkpoint but whose optimizer
state does not (saved with AdamW, loaded with Muon) names the optimizer state, not the model.
"""

from __future__ import annotations

import re

import pytest
import torch

import fsdpfn
from fsdpfn import checkpoint, optim
from fsdpfn.models import GPT, GPTConfig


def _load_with_other_optimizer(rank, world_size, root):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=4, width=8, depth=1, heads=2))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    params = fsdpfn.shard(model, plan)
    checkpoint.save(root, {"params": params, "opt_state": optim.adamw(1e-3).init(params), "step": 1}, plan)
    other = optim.muon(1e-3)
    template = {"params": fsdpfn.shard(model, plan), "opt_state": other.init(params), "step": 0}
    try:
        checkpoint.load(root, template, plan)
    except ValueError as e:
        message = str(e)
    else:
        message = "loaded"
    # The parameters alone still load: the message's advice works.
    loaded = checkpoint.load(root, {"params": fsdpfn.shard(model, plan), "step": 0}, plan)
    assert all(torch.equal(loaded["params"][n].to_local(), params[n].to_local()) for n in params)
    return message


def test_load_with_only_the_optimizer_state_differing_names_the_optimizer(run_on_ranks, tmp_path):
    messages = run_on_ranks(_load_with_other_optimizer, 2, str(tmp_path / "ckpt"))
    assert messages[0] == messages[1] != "loaded"
    message = messages[0]
    assert "'opt_state'" in message and "optimizer" in message, message
    assert "Only the optimizer state differs: 'opt_state' (the template's 'params', 'step' match" in message, message
    assert "model configuration" not in message, message


def _train_gpt():
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("_train_gpt_messages", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_lr_schedule_message_prints_two_different_numbers():
    # Resuming a 300-step schedule with --steps 301: at step 300 the stretched schedule's lr is
    # 0.002 plus a hair; 3 significant digits printed "would then be 0.002, not 0.002".
    ex = _train_gpt()
    args = ex.parse_args(["--steps", "301"])
    line = ex.resolve_schedule(args, 300, {"values": {"schedule_steps": 300}, "dir": "runs/gpt/ckpt/step_00000300"})
    m = re.search(r"would then be (\S+), not (\S+)\)", line)
    assert m and m[1] != m[2], line
    assert float(m[2]) == pytest.approx(0.002) and float(m[1]) > float(m[2]), line
    assert ex.distinct(0.0049, 0.002) == ("0.0049", "0.002") and ex.distinct(0.002, 0.002) == ("0.002", "0.002")


def _full_tensors_on_dp_tp(rank, world_size):
    import logging

    from fsdpfn.models import GPT_TP_PLAN

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, width=32, depth=1, heads=4))
    plan = fsdpfn.plan(model, fsdpfn.testing.mesh((2, 2), ("dp", "tp")), tp=GPT_TP_PLAN)
    p = fsdpfn.shard(model, plan)["blocks.0.qkv.weight"]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addHandler(handler)
    try:
        ours = fsdpfn.comm.full_tensor(p)
    finally:
        logger.removeHandler(handler)
    whole = model.state_dict()["blocks.0.qkv.weight"]
    return [r.getMessage() for r in records], torch.equal(ours, whole), torch.equal(p.full_tensor(), whole)


def test_comm_full_tensor_of_a_strided_weight_is_exact_and_quiet(run_on_ranks):
    # tensor-parallel.md: torch's p.full_tensor() logs a line about sequential all-gathers on a
    # (_StridedShard, Shard) weight; fsdpfn.comm.full_tensor gives the same tensor without it.
    for logged, ours_exact, torchs_exact in run_on_ranks(_full_tensors_on_dp_tp, 4):
        assert logged == [] and ours_exact and torchs_exact, logged
