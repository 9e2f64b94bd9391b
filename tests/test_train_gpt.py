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
import time

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


def _run_raw(out, *extra, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, *TINY, "--out", str(out), *extra], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_bad_flags_are_named_before_any_rank_starts(tmp_path):
    for flags, named in [(["--replicas", "0"], "--replicas"), (["--heads", "3"], "--heads 3 must divide --width 32"),
                         (["--ckpt-every", "0"], "--ckpt-every"), (["--batch-size", "0"], "--batch-size"),
                         (["--lr", "-1"], "--lr"), (["--world-size", "3", "--replicas", "2"], "--replicas 2 must divide"),
                         (["--timeout", "0"], "--timeout"), (["--resume", str(tmp_path / "nowhere")], "--resume")]:
        proc = _run_raw(tmp_path / "bad", *flags, timeout=60)
        assert proc.returncode == 2 and named in proc.stderr, (flags, proc.stderr[-500:])
        assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_logs_gradient_norm_and_lr_and_resumes_from_a_named_checkpoint(tmp_path):
    _run(tmp_path / "a")
    rows = _metrics(tmp_path / "a")
    assert all(r["grad_norm"] > 0 and r["lr"] >= 0 and r["skipped"] == 0 for r in rows), rows
    log = _run(tmp_path / "b", "--resume", str(tmp_path / "a" / "ckpt" / "step_00000004"))
    assert f"resumed from {tmp_path / 'a' / 'ckpt' / 'step_00000004'} (step 4," in log, log
    assert [r["step"] for r in _metrics(tmp_path / "b")] == [6, 8]


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path):
    # A learning rate of 1e30 sends the weights to inf after one step: every later gradient is NaN.
    proc = _run_raw(tmp_path / "nan", "--optimizer", "adamw", "--adamw-lr", "1e30", "--warmup", "0", "--max-nonfinite", "2")
    assert proc.returncode != 0
    assert "non-finite gradients, update skipped on every rank (1 in a row, 1 in all)" in proc.stdout, proc.stdout[-2000:]
    assert "(2 in a row, 2 in all)" in proc.stdout
    assert "FloatingPointError" in proc.stderr and "rank 0" in proc.stderr and "rank 1" in proc.stderr, proc.stderr[-3000:]


def test_a_second_job_cannot_write_into_a_running_jobs_directory(tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--steps", "400", "--out", str(out)],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc = _run_raw(out, timeout=60)
        assert proc.returncode != 0 and "is in use by pid" in proc.stderr and "--out DIR" in proc.stderr, proc.stderr[-500:]
    finally:
        first.kill()
        first.wait()
