"""examples/finetune_hf.py and fsdpfn.load_safetensors on real Hugging Face checkpoints
(skipped without transformers, an optional extra): a ``save_pretrained`` GPT-2 read into shards
equals the HF model bitwise, and so does its loss through torch.func; the example runs on a
directory in the hub's older layout (no base-model prefix, stale buffers, sharded index)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fsdpfn  # noqa: E402
from fsdpfn import comm, testing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "finetune_hf.py")


def _example():
    spec = importlib.util.spec_from_file_location("finetune_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    example = _example()
    example.quiet_transformers()
    return example.create_tiny_gpt2(str(tmp_path_factory.mktemp("hf") / "base"), seed=0)


def _load_hf(rank, world, directory):
    example = _example()
    example.quiet_transformers()
    model = example.skeleton(directory).eval()
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.load_safetensors(model, plan, directory, rename=example.hf_rename(model))
    tokens = torch.arange(2 * 17).view(2, 17) % model.config.vocab_size
    loss = example.make_loss(model, plan)(params, tokens[:, :-1], tokens[:, 1:])
    return {n: comm.full_tensor(p) for n, p in params.items()}, loss.item()


def test_save_pretrained_checkpoint_loads_into_shards_bitwise(run_on_ranks, tiny_gpt2):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    expected = dict(reference.named_parameters())  # lm_head.weight is tied to transformer.wte.weight
    tokens = torch.arange(2 * 17).view(2, 17) % reference.config.vocab_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: a kernel's split of its sums over threads is the same
    try:
        with torch.no_grad():
            logits = reference(tokens[:, :-1], use_cache=False).logits
        ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    finally:
        torch.set_num_threads(threads)
    for full, loss in run_on_ranks(_load_hf, 3, tiny_gpt2):
        assert sorted(full) == sorted(expected)
        assert all(torch.equal(full[n], expected[n].detach()) for n in expected)
        # The same parameters (bitwise, above), tokens, forward code and thread count: the same bits.
        assert loss == ref_loss, (loss, ref_loss)


def _hub_layout(base: str, out) -> str:
    """``base`` rewritten as older hub checkpoints are: names without ``transformer.``, the
    attention-mask buffers ``h.N.attn.bias`` saved too, and split over two files with an index."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(base, "model.safetensors"))
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(4):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    os.makedirs(out)
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, os.path.join(out, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(base, "config.json")) as src, open(os.path.join(out, "config.json"), "w") as dst:
        dst.write(src.read())
    return str(out)


@pytest.mark.e2e
def test_finetune_hf_runs_on_a_hub_layout_directory(tiny_gpt2, tmp_path):
    directory = _hub_layout(tiny_gpt2, tmp_path / "hub")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--model",
            directory,
            "--out",
            str(out),
            "--steps",
            "4",
            "--log-every",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--sample-tokens",
            "5",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss" in proc.stdout and "validation" in proc.stdout
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [2, 4]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(out / "finetuned"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    moved = [n for n, p in tuned.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert "transformer.h.0.attn.c_attn.weight" in moved  # trained: Muon moved the hidden matrices
