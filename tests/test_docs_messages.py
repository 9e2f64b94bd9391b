"""Messages the documentation promises: what they name must be what differs.

``checkpoint.load`` into a template whose parameters match the checkpoint but whose optimizer
state does not (saved with AdamW, loaded with Muon) names the optimizer state, not the model.
"""

from __future__ import annotations

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
