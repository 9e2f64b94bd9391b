"""Smoke test of the README's main command, examples/train_gpt.py, on a tiny model.

Three short runs of the real program (2 spawned gloo ranks each): one stopped half-way, its
``--resume``, and the same job straight through. Checks that the metrics log, plot, checkpoint,
plain model file and sample appear, that the resume continues from the saved step, and that
resuming changes nothing: the resumed run's losses and final weights equal the straight run's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

from fsdpfn import checkpoint, optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--steps",
    "8",
    "--warmup",
    "2",
    "--log-every",
    "2",
    "--eval-every",
    "4",
    "--ckpt-every",
    "4",
    "--sample-chars",
    "20",
    "--no-progress",
    "--world-size",
    "2",
]


def _run(out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY, "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.e2e
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
    assert _metrics(straight) == [
        {**r, **{k: s[k] for k in ("tokens_per_s", "elapsed_s")}} for r, s in zip(_metrics(half), _metrics(straight))
    ]
    a = torch.load(half / "model.pt", weights_only=True)
    b = torch.load(straight / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run_raw(out, *extra, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, *TINY, "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.e2e
def test_bad_flags_are_named_before_any_rank_starts(tmp_path, capsys):
    # End to end once (the exit code and message of the command, and nothing written), then
    # every case through the script's own parse_args in this process, which is what main()
    # runs before any rank starts (an interpreter per case would cost seconds each).
    proc = _run_raw(tmp_path / "bad", "--heads", "3", timeout=60)
    assert proc.returncode == 2 and "--heads 3 must divide --width 32" in proc.stderr, proc.stderr[-500:]
    # The reason first, and no usage block of every flag to scroll past: two lines in all.
    assert proc.stderr.startswith("train_gpt.py: error: --heads 3 must divide --width 32"), proc.stderr[-500:]
    assert len(proc.stderr.splitlines()) == 2 and "usage:" not in proc.stderr, proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    mod = _example()
    for flags, named in [
        (["--replicas", "0"], "--replicas"),
        (["--heads", "3"], "--heads 3 must divide --width 32"),
        (["--ckpt-every", "0"], "--ckpt-every"),
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "-1"], "--lr"),
        (["--world-size", "3", "--replicas", "2"], "--replicas 2 must divide"),
        (["--timeout", "0"], "--timeout"),
        (["--resume", str(tmp_path / "nowhere")], "--resume"),
        (["--ep", "2"], "--ep 2 needs --experts"),
        (["--experts", "3", "--ep", "2"], "--ep 2 must divide --experts 3"),
        (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor must be a number > 0"),
        (["--experts", "2", "--top-k", "3"], "--top-k 3 must be at most --experts 2"),
        (["--experts", "4", "--tp", "2"], "--experts with --tp 2"),
    ]:
        with pytest.raises(SystemExit) as exited:
            mod.parse_args([*TINY, "--out", str(tmp_path / "bad"), *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and named in err, (flags, err[-500:])
        assert err.splitlines()[0].startswith("train_gpt.py: error: ") and "usage:" not in err, err
    # argparse's own errors (an unknown flag, a value of the wrong type) come the same way.
    for flags, named in [
        (["--stesp", "3"], "unrecognized arguments: --stesp 3"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ]:
        with pytest.raises(SystemExit) as exited:
            mod.parse_args([*TINY, *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(f"train_gpt.py: error: {named}") and "usage:" not in err, err


@pytest.mark.e2e
def test_logs_gradient_norm_and_lr_and_resumes_from_a_named_checkpoint(tmp_path):
    _run(tmp_path / "a")
    rows = _metrics(tmp_path / "a")
    assert all(r["grad_norm"] > 0 and r["lr"] >= 0 and r["skipped"] == 0 for r in rows), rows
    log = _run(tmp_path / "b", "--resume", str(tmp_path / "a" / "ckpt" / "step_00000004"))
    assert f"resumed from {tmp_path / 'a' / 'ckpt' / 'step_00000004'} (step 4," in log, log
    assert [r["step"] for r in _metrics(tmp_path / "b")] == [6, 8]


@pytest.mark.e2e
def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path):
    # A learning rate of 1e30 sends the weights to inf after one step: every later gradient is NaN.
    proc = _run_raw(
        tmp_path / "nan", "--optimizer", "adamw", "--adamw-lr", "1e30", "--warmup", "0", "--max-nonfinite", "2"
    )
    assert proc.returncode != 0
    assert "non-finite gradients, update skipped on every rank (1 in a row, 1 in all)" in proc.stdout, proc.stdout[
        -2000:
    ]
    assert "(2 in a row, 2 in all)" in proc.stdout
    assert "FloatingPointError" in proc.stderr and "rank 0" in proc.stderr and "rank 1" in proc.stderr, proc.stderr[
        -3000:
    ]


@pytest.mark.e2e
def test_a_second_job_cannot_write_into_a_running_jobs_directory(tmp_path):
    out = tmp_path / "busy"
    # The first job sleeps between its steps: it only has to hold the lock, not to compete for the CPU.
    first = subprocess.Popen(
        [sys.executable, SCRIPT, *TINY, "--steps", "400", "--step-delay", "5", "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc = _run_raw(out, timeout=60)
        assert proc.returncode != 0 and "is in use by pid" in proc.stderr and "--out DIR" in proc.stderr, proc.stderr[
            -500:
        ]
    finally:
        first.kill()
        first.wait()


# ---------------------------------------------------------------------------------------------
# What a newcomer meets: --help, --device cuda without CUDA, resuming a finished run, extending a
# run (the lr schedule's horizon), and the README's commands in order.
# ---------------------------------------------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _option_blocks(help_text: str) -> dict[str, str]:
    """``--flag`` -> its whole entry in ``--help`` (invocation and help, joined)."""
    blocks, current = {}, None
    for line in help_text.splitlines():
        m = re.match(r"  (-\S+)", line)
        if m:
            current = m.group(1).split(",")[0]
            blocks[current] = line
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.e2e
def test_help_describes_every_flag_and_shows_each_default_once():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--schedule-steps" in text and "--resume latest" in text
    blocks = _option_blocks(text)
    parser = _example().build_parser()
    for action in parser._actions:
        flag = action.option_strings[0]
        assert action.help and action.help.strip(), f"{flag} has no help"
        block = blocks[flag]
        assert block.count("(default") <= 1, block
        if action.default is not None and action.default is not False and flag != "-h":
            # argparse wraps long lines after a hyphen too ("/work/wt- check/..."): join such breaks
            joined = re.sub(r"(?<=\S-) (?=\S)", "", block)
            assert f"(default: {action.default})" in joined or "(default: $" in block, block
    assert "(default: $FSDPFN_TIMEOUT, else 600)" in blocks["--timeout"]


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
def test_device_cuda_without_cuda_says_what_is_missing(tmp_path):
    proc = _run_raw(tmp_path / "gpu", "--device", "cuda", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--device cuda: this torch" in proc.stderr and "or use --device cpu" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
def test_readme_torchrun_line_without_cuda_fails_on_every_rank_with_the_reason(tmp_path):
    # The README's GPU command as printed, through `python -m torch.distributed.run --standalone`
    # (torchrun itself, with a free port) and with 2 processes instead of 8 to spare the CPU.
    line = next(c for c in _readme_commands() if c[0] == "torchrun")
    assert line[1:3] == ["--nproc_per_node", "8"], line
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        SCRIPT,
        *line[4:],
        "--out",
        str(tmp_path / "gpu"),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode != 0
    # Each rank checks its flags before any collective and says why it stops. Under torchrun the
    # first rank to exit makes the agent SIGTERM the others, so a rank still importing torch on a
    # busy machine is stopped before it prints: every rank that printed must give this reason, and
    # the ones that did not were ended by the agent's SIGTERM, not left waiting.
    said = proc.stderr.count("--device cuda: this torch")
    assert said >= 1, proc.stderr[-3000:]
    assert said == 2 or "SIGTERM" in proc.stderr, proc.stderr[-3000:]
    assert 'Traceback (most recent call last):\n  File "' + SCRIPT not in proc.stderr, proc.stderr[-3000:]
    assert "_cuda_setDevice" not in proc.stderr and "AttributeError" not in proc.stderr, proc.stderr[-3000:]


def _snapshot(root) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run trained to its --steps 8 (checkpoints at 4 and 8; lr horizon 8)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    _run(out)
    return out


@pytest.mark.e2e
def test_resuming_a_finished_run_says_so_and_changes_nothing(finished_run):
    before = _snapshot(finished_run)
    ckpt = finished_run / "ckpt" / "step_00000008"
    for flags, limit, more in [
        ([], "--steps 8", "a larger --steps"),
        (["--steps", "6"], "--steps 6", "a larger --steps"),
        (["--steps", "12", "--stop-at", "8"], "--stop-at 8", "a larger --stop-at, or none,"),
    ]:
        log = _run(finished_run, "--resume", *flags)
        assert log.strip() == (
            f"nothing to train: the checkpoint {ckpt} is at step 8 and {limit}; pass {more} to "
            "continue the run. Outputs left as they are."
        ), log
    assert _snapshot(finished_run) == before


@pytest.mark.e2e
def test_ckpt_async_stops_resumes_and_equals_the_synchronous_run(finished_run, tmp_path):
    # --ckpt-async: the checkpoints written in the background hold the same state, so a run
    # stopped at 4 and resumed equals the straight run with synchronous saves, bit for bit.
    out = tmp_path / "async"
    first = _run(out, "--ckpt-async", "--stop-at", "4")
    assert checkpoint.read_info(out / "ckpt")["values"]["step"] == 4
    # Each save says what it cost training and how long its write took, once committed (the
    # write's time starts with the call, so it includes the stall).
    said = re.findall(
        r"^checkpoint (step_\d+): training stalled (\d+\.\d+) s, written beside it in (\d+\.\d+) s$", first, re.M
    )
    assert [name for name, _, _ in said] == ["step_00000004"] and all(float(a) <= float(b) for _, a, b in said), first
    log = _run(out, "--ckpt-async", "--resume")
    assert "(step 4," in log, log
    assert checkpoint.read_info(out / "ckpt")["values"]["step"] == 8
    assert not any(p.name.startswith(".partial-") for p in (out / "ckpt").iterdir())
    assert _metrics(out) == [
        {**r, **{k: s[k] for k in ("tokens_per_s", "elapsed_s")}} for r, s in zip(_metrics(finished_run), _metrics(out))
    ]
    a = torch.load(finished_run / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _lr(peak, warmup, horizon, step):
    """The logged lr of the row ``step`` (the schedule at the step being taken, ``step - 1``)."""
    return optim.warmup_cosine_schedule(peak, warmup, horizon, end_value=0.1 * peak)(step - 1)


@pytest.mark.e2e
def test_extending_steps_keeps_the_checkpoints_lr_horizon(finished_run, tmp_path):
    extended, straight = tmp_path / "extended", tmp_path / "straight"
    shutil.copytree(finished_run, extended)
    log = _run(extended, "--resume", "--steps", "12")
    assert "lr schedule: kept the checkpoint's horizon of 8 steps (--steps 12 does not move it)" in log, log
    rows = _metrics(extended)
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    # TINY: peak 0.02, warm-up 2; past the horizon the lr holds its final value, 0.1 * peak.
    assert [r["lr"] for r in rows] == [_lr(0.02, 2, 8, r["step"]) for r in rows]
    assert rows[-1]["lr"] == rows[-2]["lr"] == 0.1 * 0.02
    assert checkpoint.read_info(extended / "ckpt")["values"]["schedule_steps"] == 8

    # The extended run is the straight run with that horizon, bit for bit.
    _run(straight, "--steps", "12", "--schedule-steps", "8")
    assert _metrics(straight) == [
        {**r, **{k: s[k] for k in ("tokens_per_s", "elapsed_s")}} for r, s in zip(rows, _metrics(straight))
    ]
    a = torch.load(extended / "model.pt", weights_only=True)
    b = torch.load(straight / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
def test_schedule_steps_on_resume_stretches_the_decay_and_says_so(finished_run, tmp_path):
    out = tmp_path / "stretched"
    log = _run(out, "--resume", str(finished_run / "ckpt" / "latest"), "--steps", "12", "--schedule-steps", "12")
    expected = f"lr schedule: horizon 8 -> 12 steps (--schedule-steps): the lr at step 8 is {_lr(0.02, 2, 12, 9):.3g}, "
    assert f"resumed from {finished_run / 'ckpt' / 'step_00000008'} (step 8," in log and expected in log, log
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [10, 12]
    assert [r["lr"] for r in rows] == [_lr(0.02, 2, 12, 10), _lr(0.02, 2, 12, 12)]
    assert rows[0]["lr"] > 0.1 * 0.02  # back up from the final lr of the 8-step schedule
    assert checkpoint.read_info(out / "ckpt")["values"]["schedule_steps"] == 12


def _readme_commands() -> list[list[str]]:
    """The demo page's block of further commands, in order, comments dropped."""
    with open(os.path.join(ROOT, "docs", "getting-started.md"), encoding="utf-8") as f:
        text = f.read()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "--resume --steps 400" in b)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


@pytest.mark.e2e
def test_readme_demo_commands_run_in_order_on_a_fresh_directory(tmp_path):
    # `make demo` first (its recipe is `python examples/train_gpt.py`), then the demo page's commands
    # as printed, in a fresh directory; a tiny model (the flags below go first, so the README's
    # own flags win) keeps it to a few minutes. The torchrun line needs GPUs: see the test above.
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "\t$(PYTHON) examples/train_gpt.py\n" in f.read()
    tiny = [
        "--width",
        "32",
        "--depth",
        "1",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--sample-chars",
        "20",
        "--log-every",
        "50",
        "--eval-every",
        "0",
        "--no-progress",
    ]
    commands = [["python", "examples/train_gpt.py"]] + [c for c in _readme_commands() if c[0] != "torchrun"]
    assert len(commands) == 7 and all(c[:2] == ["python", "examples/train_gpt.py"] for c in commands), commands
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"}
    logs = []
    for c in commands:
        proc = subprocess.run(
            [sys.executable, SCRIPT, *tiny, *c[2:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, (c, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert "nothing to train" not in proc.stdout, (c, proc.stdout[-2000:])
        logs.append(proc.stdout)
    gpt = tmp_path / "runs" / "gpt"
    assert "resumed from runs/gpt/ckpt/step_00000300 (step 300," in logs[1]
    assert "resumed from runs/gpt/ckpt/step_00000400 (step 400, saved on 2 rank(s); now 3 rank(s), zero2)" in logs[2]
    assert "resumed from runs/gpt/ckpt/step_00000400 (step 400," in logs[5]
    assert sorted(p.name for p in (gpt / "ckpt").glob("step_*")) == ["step_00000400", "step_00000500"]
    for out, step in [("gpt", 500), ("adamw", 300), ("gram", 300), ("from400", 600), ("timeout30", 300)]:
        assert checkpoint.read_info(tmp_path / "runs" / out / "ckpt")["values"]["step"] == step, out
    # The README's account of the schedule: steps 300-500 at the final lr (horizon 300, peak 0.02),
    # and the lr at step 300 of a 400-step horizon.
    rows = _metrics(gpt)
    assert all(r["lr"] == 0.1 * 0.02 for r in rows if r["step"] > 300), rows
    assert "lr schedule: kept the checkpoint's horizon of 300 steps" in logs[1]
    assert f"{optim.warmup_cosine_schedule(0.02, 20, 400, end_value=0.002)(300):.2g}" == "0.0049"
    # Run again, the first resume has nothing left to do.
    proc = subprocess.run(
        [sys.executable, SCRIPT, *tiny, *commands[1][2:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(
        "nothing to train: the checkpoint runs/gpt/ckpt/step_00000500 is at step 500 and --steps 400;"
    ), proc.stdout


# ---------------------------------------------------------------------------------------------
# Mixture of experts on an (ep, edp) mesh: --experts / --ep / --top-k / --capacity-factor
# ---------------------------------------------------------------------------------------------

MOE = ["--experts", "4", "--ep", "2", "--top-k", "2", "--capacity-factor", "1.25", "--depth", "2", "--moe-every", "2"]


@pytest.mark.e2e
def test_moe_demo_on_an_ep_mesh_trains_and_resumes_bitwise(tmp_path):
    # A run under torchrun (2 processes); then a job spawned from its step-4 checkpoint into
    # another directory: its losses and final weights equal the first run's from step 4 on.
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        SCRIPT,
        *TINY,
        *MOE,
        "--out",
        str(first),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 MoE layer(s) of 4 experts (top-2, capacity factor 1.25) over ep=2" in proc.stdout, proc.stdout
    rows = _metrics(first)
    assert [r["step"] for r in rows] == [2, 4, 6, 8] and rows[-1]["loss"] < rows[0]["loss"] - 0.1, rows
    assert all(0 <= r["dropped"] < 0.5 for r in rows) and any(r["dropped"] > 0 for r in rows), rows  # capacity 1.25

    log = _run(resumed, *MOE, "--resume", str(first / "ckpt" / "step_00000004"))
    assert "(step 4, saved on 2 rank(s)" in log, log
    assert _metrics(resumed) == [
        {**r, **{k: s[k] for k in ("tokens_per_s", "elapsed_s")}} for r, s in zip(rows[2:], _metrics(resumed))
    ]
    a = torch.load(first / "model.pt", weights_only=True)
    b = torch.load(resumed / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The exported weights are the whole model (every expert), for the model class alone.
    from fsdpfn.models import GPT, GPTConfig

    with open(first / "config.json") as f:
        model = GPT(GPTConfig(**json.load(f)["model"]))
    model.load_state_dict(a)
    assert a["blocks.0.moe.experts.w1"].shape[0] == 4 and "blocks.1.fc.weight" in a


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: --pp / --schedule / --micro-batches
# ---------------------------------------------------------------------------------------------

PP = ["--depth", "2", "--optimizer", "adamw"]


def _close(a, b):
    """Logged numbers (rounded to 5 decimals) of two runs whose gradients sum the same terms in
    another order: within the rounding (1e-5) plus 1e-6 relative (see [Note: the tolerance of
    the pipeline parity tests] in test_pp_runtime.py: <= 1e-6 relative after 10 AdamW steps)."""
    return abs(a - b) <= 1e-5 + 1e-6 * abs(b)


@pytest.mark.e2e
def test_pipelined_demo_equals_the_unpipelined_run_and_resumes_without_pp(tmp_path):
    # (pp 2, dp 2) on 4 ranks reads the batches of dp 2 on 2 ranks: the same run, step by step;
    # its step-4 checkpoint resumes on 2 ranks without pp, as the unpipelined run continues.
    piped, flat, resumed = tmp_path / "piped", tmp_path / "flat", tmp_path / "resumed"
    log = _run(piped, *PP, "--world-size", "4", "--pp", "2")
    assert "2 data-parallel rank(s) of 4 x 2 x 16 tokens per step; zero3 x pp=2 (1f1b, 2 micro-batches)" in log, log
    _run(flat, *PP)
    a, b = _metrics(piped), _metrics(flat)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6, 8]
    for r, s in zip(a, b):
        for key in ("loss", "grad_norm", "val_loss"):
            assert (key in r) == (key in s) and (key not in r or _close(r[key], s[key])), (key, r, s)
    assert "Once upon a time" in (piped / "sample.txt").read_text()
    pa = torch.load(piped / "model.pt", weights_only=True)
    pb = torch.load(flat / "model.pt", weights_only=True)
    assert pa.keys() == pb.keys()
    for k in pb:
        a_k, b_k = pa[k], pb[k]
        if k.endswith("qkv.bias"):
            # The key part of a qkv bias has an exactly-zero true gradient (softmax ignores a
            # shift common to a row's logits): its gradient is rounding noise, which AdamW
            # scales to steps of up to ~lr each, in either run. So it is bounded by 2 lr per step
            # (--adamw-lr 3e-3, 8 steps), the rest as every other parameter. Rows are head-major
            # (q, k, v of head 0, then head 1), heads of 16.
            rows = a_k.view(2, 3, 16)
            keys = (rows[:, 1] - b_k.view(2, 3, 16)[:, 1]).abs().max()
            assert keys <= 2 * 3e-3 * 8, (k, keys)
            a_k, b_k = rows[:, 0::2].reshape(-1), b_k.view(2, 3, 16)[:, 0::2].reshape(-1)
        assert (a_k - b_k).norm() <= 1e-6 * b_k.norm(), (k, ((a_k - b_k).norm() / b_k.norm()).item())

    log = _run(resumed, *PP, "--resume", str(piped / "ckpt" / "step_00000004"))
    assert "(step 4, saved on 4 rank(s)" in log, log
    for r, s in zip(_metrics(resumed), b[2:]):
        assert r["step"] == s["step"] and _close(r["loss"], s["loss"]), (r, s)


def test_pipeline_flags_are_named_before_any_rank_starts(tmp_path, capsys):
    # The script's own parse_args (what main() runs first, before any rank starts), in this
    # process: an interpreter per case would cost seconds each (test_bad_flags_are_named_...
    # checks the exit code and message end to end).
    mod = _example()
    for flags, named in [
        (["--schedule", "gpipe"], "--schedule needs --pp"),
        (["--micro-batches", "2"], "--micro-batches needs --pp"),
        (["--pp", "2", "--ft", "--replicas", "2", "--world-size", "4"], "--pp 2 with --ft: not supported yet"),
        (["--pp", "2", "--experts", "2"], "--pp 2 with --experts: not supported yet"),
        (["--pp", "2", "--micro-batches", "3"], "--micro-batches 3 must be >= 1 and divide --batch-size 2"),
        (["--pp", "2", "--world-size", "3"], "--pp 2 x --replicas 1 x --cp 1 x --tp 1 must divide the world size 3"),
        (["--pp", "4", "--world-size", "4", "--schedule", "interleaved_1f1b"], "cuts the model into 8 stages"),
        (["--pp", "2", "--schedule", "nope"], "invalid choice: 'nope'"),
    ]:
        with pytest.raises(SystemExit) as exited:
            mod.parse_args([*TINY, "--out", str(tmp_path / "bad"), *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and named in err, (flags, err[-500:])
        assert err.splitlines()[0].startswith("train_gpt.py: error: ") and "usage:" not in err, err
    # argparse's own errors (an unknown flag, a value of the wrong type) come the same way.
    for flags, named in [
        (["--stesp", "3"], "unrecognized arguments: --stesp 3"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ]:
        with pytest.raises(SystemExit) as exited:
            mod.parse_args([*TINY, *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(f"train_gpt.py: error: {named}") and "usage:" not in err, err
    args = mod.parse_args(
        [*TINY, "--pp", "2", "--world-size", "4", "--schedule", "interleaved_1f1b", "--batch-size", "8"]
    )
    assert (args.schedule, args.micro_batches) == ("interleaved_1f1b", 4)  # the most up to 2 x pp, a multiple of pp


# ---- --ft's terminal: the job's lines, not torchft's ------------------------------------------


def test_ft_is_quiet_by_default_and_verbose_on_request(tmp_path, monkeypatch, capsys):
    # main() sets RUST_LOG=warn for torchft's Rust side (the lighthouse it starts and, through
    # the environment, every replica group) unless the user set RUST_LOG or asked --ft-verbose;
    # the replica groups run without progress bars (two cannot share a terminal).
    pytest.importorskip("torchft")
    import fsdpfn.ft

    mod = _example()
    seen = []
    monkeypatch.setattr(
        fsdpfn.ft, "run_replica_groups", lambda command, replicas, **kw: seen.append(command(0, "h:1")) or 0
    )
    base = [*TINY, "--world-size", "4", "--replicas", "2", "--ft", "--out", str(tmp_path)]
    for extra, env, want in [([], None, "warn"), ([], "debug", "debug"), (["--ft-verbose"], None, None)]:
        if env is None:
            monkeypatch.delenv("RUST_LOG", raising=False)
        else:
            monkeypatch.setenv("RUST_LOG", env)
        args = mod.parse_args([*base, *extra])
        mod.quiet_torchft_rust(args)
        assert os.environ.get("RUST_LOG") == want, (extra, env)
        assert mod.run_ft(args, [*base, *extra]) == 0
        assert seen[-1][-1] == "--no-progress" and "--replica-group" in seen[-1], seen[-1]
    monkeypatch.delenv("RUST_LOG", raising=False)
    with pytest.raises(SystemExit):
        mod.parse_args([*TINY, "--ft-verbose"])  # --ft-verbose alone: named, as the other --ft flags
    assert "--ft-verbose needs --ft" in capsys.readouterr().err


def test_quiet_torchft_leaves_one_line_per_warning(monkeypatch, capsys):
    # In each rank: torchft's Python loggers at WARNING, a warning's traceback cut to its line,
    # the flight-recorder note dropped where there is no NCCL, no HTTP access lines.
    pytest.importorskip("torchft")
    import logging
    from http.server import BaseHTTPRequestHandler

    mod = _example()
    names = ["torchft", "torchft_quorums", "torchft_commits", "torchft_errors"]
    saved = {
        n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
        for n in names
    }
    monkeypatch.setattr(BaseHTTPRequestHandler, "log_request", BaseHTTPRequestHandler.log_request)
    try:
        mod.quiet_torchft("cpu")
        log = logging.getLogger("torchft.manager.test")  # created after the call, as torchft's Manager's logger
        log.info("quorum 3 reached")
        log.warning("[replica0/0 - step 0] Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        try:
            raise RuntimeError("peer lost")
        except RuntimeError:
            log.exception("[replica0/0 - step 5] got exception in pg configure: peer lost")
        err = capsys.readouterr().err
        assert err == "[replica0/0 - step 5] got exception in pg configure: peer lost\n", err
        assert BaseHTTPRequestHandler.log_request(None, 200) is None  # no access line, and no handler state needed
    finally:
        for n, (level, handlers, propagate) in saved.items():
            logging.getLogger(n).setLevel(level)
            logging.getLogger(n).handlers[:] = handlers
            logging.getLogger(n).propagate = propagate


# ---- Ctrl-C and SIGTERM: save the step reached, say how to resume, no traceback ----------------


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_and_prints_the_resume_command(tmp_path, sig):
    # SIGINT as Ctrl-C sends it, to the whole process group (the launcher and its ranks); SIGTERM
    # as a scheduler often does, to the launcher alone, which passes it on. Either way every rank
    # stops at the same step boundary, after a verified checkpoint of that step.
    import signal as signals

    out = tmp_path / "run"
    flags = [
        *TINY,
        "--steps",
        "100000",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--sample-chars",
        "0",
        "--ckpt-every",
        "1000",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        if sig == "SIGINT":
            os.killpg(proc.pid, signals.SIGINT)
        else:
            proc.send_signal(signals.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signals.SIGKILL)
    assert proc.returncode == 128 + signals.Signals[sig].value, (proc.returncode, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    m = re.search(
        rf"^stopped by {sig} at step (\d+) of 100000; checkpoint (\S+)\. Resume with: (python examples/train_gpt\.py .* --resume)$",
        stdout,
        re.M,
    )
    assert m, stdout[-2000:]
    step, saved, command = int(m[1]), m[2], m[3]
    # The checkpoint of the step it stopped at, verified (checksums) and committed as the newest.
    assert (
        step >= 2 and saved.endswith(f"step_{step:08d}") and checkpoint.latest(str(out / "ckpt"), verify=True) == saved
    )
    # The command as printed resumes from it (one step more, so that it ends at once).
    argv = shlex.split(command)[1:]
    resumed = subprocess.run(
        [sys.executable, os.path.join(ROOT, argv[0]), *argv[1:], "--steps", str(step + 1)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from {saved} (step {step}," in resumed.stdout, resumed.stdout[-2000:]
