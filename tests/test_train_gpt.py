"""Smoke test of the README's main command, examples/train_gpt.py, on a tiny model.

Three short runs of the real program (2 spawned gloo ranks each): one stopped half-way, its
``--resume``, and the same job straight through. Checks that the metrics log, plot, checkpoint,
plain model file and sample appear, that the resume continues from the saved step, and that
resuming changes nothing: the resumed run's losses and final weights equal the straight run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from fsdpfn import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--steps", "8",
        "--warmup", "2", "--log-every", "2", "--eval-every", "4", "--ckpt-every", "4", "--sample-chars", "20",
        "--no-progress", "--world-size", "2"]


def _run(out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"}
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--out", str(out), *extra], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_gpt_runs_saves_and_resumes_bitwise(tmp_path):
    half, straight = tmp_path / "half", tmp_path / "straight"

    log = _run(half, "--stop-at", "4")
    for name in ["metrics.jsonl", "loss.png", "model.pt", "config.json", "sample.txt"]:
        assert (half / name).is_file() and (half / name).stat().st_size > 0, name
    assert checkpoint.read_info(half / "ckpt")["values"]["step"] == 4
    assert [r["step"] for r in _metrics(half)] == [2, 4]
    assert "Once upon a time" in (half / "sample.txt").read_text()
    assert "loss" in log and str(half / "loss.png") in log

    log = _run(half, "--resume")
    assert "resumed from" in log and "(step 4," in log, log
    assert checkpoint.read_info(half / "ckpt")["values"]["step"] == 8
    assert [r["step"] for r in _metrics(half)] == [2, 4, 6, 8]

    _run(straight)
    assert _metrics(straight) == [{**r, **{k: s[k] for k in ("tokens_per_s", "elapsed_s")}}
                                  for r, s in zip(_metrics(half), _metrics(straight))]
    a = torch.load(half / "model.pt", weights_only=True)
    b = torch.load(straight / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
