"""The GPU check: one prepared command that runs fsdpfn's CUDA path on one GPU and measures the
simulator's compute model there, in under 10 minutes, writing its results under ``$OUT``::

    OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh
    python benchmarks/gpu_check.py --out /tmp/gpu-check                      # the same, without the shell wrapper
    python benchmarks/gpu_check.py --out /tmp/gpu-check --steps demo,sim_kernels   # some steps only
    python benchmarks/gpu_check.py --list                                    # the steps and their time limits

The steps, in order of value, each in a process of its own under ``timeout`` with its own time
limit, so that a slow or hung step cannot eat the others' time (a step's limit is cut to what is
left of ``--budget``; a step with less than 15 s left does not run):

  install         what is missing: fsdpfn from this checkout (editable, without build isolation:
                  the machine may be offline), then the test extra's packages; versions printed
  cuda_tests      the tests that skip without CUDA (found by :func:`cuda_tests`), on 1 process
  streams         the runtime's all-gather stream beside compute, in a torch.profiler trace
                  (2 gloo ranks sharing the GPU: NCCL needs one device per rank; then 1 rank)
  reshard_memory  reshard-after-forward against torch.cuda.max_memory_allocated
  offload         pinned host offload: bitwise the run without it, nothing held between steps
  fp8_gather      the FP8 (MXFP8) parameter all-gather on CUDA, beside bf16
  compile         fsdpfn.compile (inductor) on CUDA, against the eager step
  demo            examples/train_gpt.py --device cuda under torchrun, 1 process, 100 steps
  sim_kernels     matmul rates by shape, SDPA flash attention forward and backward at 1k-32k
                  tokens, memory-bound kernels, each beside the H100 preset's rate
  sim_step        the simulator's predicted step beside the measured one (the demo model, and one
                  Llama-3-8B-shaped block in bf16)
  te              Transformer Engine, if it imports or installs in time: the FP8 hand-over with
                  Hopper's recipe (Float8CurrentScaling), and MXFP8's (Blackwell's: refused on
                  Hopper, by name)

Without CUDA every step says "skipped: no CUDA" (tests/test_gpu_check.py runs it so). To rehearse
a step's code on a machine without a GPU, run it alone with ``FSDPFN_GPU_CHECK_DEVICE=cpu`` (small
models; the CUDA-only measurements fail at once)::

    FSDPFN_GPU_CHECK_DEVICE=cpu PYTHONPATH=. python3 benchmarks/gpu_check.py --run-step offload --result /tmp/offload.json --work /tmp

Outputs (at most 8 files under ``--out``): ``summary.json`` (every step: status, reason, seconds,
figures), ``summary.md`` (the same for people: passed / failed / did not run, with reasons, and
the figures' tables), ``log.txt`` (each step's output, its last 200 kB), ``demo_metrics.jsonl``
(the demo's metrics, when it ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NO_CUDA = "skipped: no CUDA"
# The check's whole run fits 10 minutes on one H100 with room to spare: the steps' limits are cut
# to what is left of this budget, and the summary takes a few seconds after the last step.
BUDGET_S = 540.0
MIN_STEP_S = 15.0  # below this a step could not even start a CUDA process
LOG_TAIL = 200_000  # characters of each step's output kept in log.txt
MAX_FILES = 8


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check: its name, its time limit (seconds) and what it does."""

    name: str
    limit_s: float
    what: str


STEPS = (
    Step("install", 60, "install what is missing; print versions"),
    Step("cuda_tests", 75, "the tests that skip without CUDA, on 1 process"),
    Step("streams", 70, "all-gather stream beside compute (torch.profiler), 2 gloo ranks on one GPU"),
    Step("reshard_memory", 70, "reshard-after-forward against torch.cuda.max_memory_allocated"),
    Step("offload", 70, "pinned host offload, bitwise the run without it"),
    Step("fp8_gather", 70, "FP8 (MXFP8) parameter all-gather on CUDA, beside bf16"),
    Step("compile", 90, "fsdpfn.compile (inductor) on CUDA against the eager step"),
    Step("demo", 100, "examples/train_gpt.py --device cuda, torchrun, 1 process, 100 steps"),
    Step("sim_kernels", 90, "matmul, SDPA flash attention, memory-bound kernels beside the H100 preset"),
    Step("sim_step", 60, "the simulator's predicted step beside the measured one"),
    Step("te", 90, "Transformer Engine FP8 hand-over with Hopper's recipe, if it installs"),
)
BY_NAME = {s.name: s for s in STEPS}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _steps_arg(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown or [value]}; the steps are {', '.join(BY_NAME)}")
    return [s.name for s in STEPS if s.name in names]  # always in the check's order of value


def _positive(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The check's arguments; ``--out`` defaults to ``$OUT``.

    Example:
      >>> a = parse_args(["--out", "/tmp/x", "--steps", "demo,install"])
      >>> a.steps, a.budget
      (['install', 'demo'], 540.0)
    """
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="where the results go (default: $OUT)")
    p.add_argument(
        "--steps", type=_steps_arg, default=[s.name for s in STEPS], help=f"comma-separated, of: {', '.join(BY_NAME)}"
    )
    p.add_argument("--budget", type=_positive, default=BUDGET_S, help="seconds for all the steps together")
    p.add_argument("--list", action="store_true", help="list the steps and their time limits, and stop")
    # Internal: one step, in the process the orchestrator starts under `timeout`.
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_step is not None and args.run_step not in BY_NAME:
        p.error(f"--run-step {args.run_step!r} is not a step; the steps are {', '.join(BY_NAME)}")
    if not args.list and args.run_step is None and not args.out:
        p.error(
            "where should the results go? pass --out DIR or set $OUT (OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh)"
        )
    return args


# ---------------------------------------------------------------------------------------------
# Comparison code: pure functions over recorded numbers (tested on CPU in tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------------


def kernel_preset(hw):
    """``hw`` with its kernels at the rates of their own benchmarks (``sustained=1``): what one
    kernel timed alone should reach; the step-level ``sustained`` factor is for whole steps.

    Example:
      >>> from fsdpfn import sim
      >>> kernel_preset(sim.H100_SXM).kernels.sustained
      1.0
    """
    return dataclasses.replace(hw, kernels=dataclasses.replace(hw.kernels, sustained=1.0))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 and math.isfinite(a) and math.isfinite(b) else None


def matmul_rows(measured: list[tuple[str, int, int, int, str, float]], hw) -> list[dict]:
    """Rows of ``(label, m, n, k, dtype, seconds)`` measured matmuls beside ``hw``'s kernel rate
    for the same shape (:func:`kernel_preset`): TFLOP/s each and measured / preset.

    Example:
      >>> from fsdpfn import sim
      >>> r = matmul_rows([("square", 8192, 8192, 8192, "bfloat16", 1.5e-3)], sim.H100_SXM)[0]
      >>> r["measured_tflops"], r["preset_tflops"]
      (733.0, 807.7)
    """
    kernel_hw = kernel_preset(hw)
    rows = []
    for label, m, n, k, dtype, seconds in measured:
        flops = 2.0 * m * n * k
        preset = kernel_hw.kernels.achieved(m, n, k, dtype, kernel_hw)
        rows.append(
            dict(
                label=label,
                m=m,
                n=n,
                k=k,
                dtype=dtype,
                seconds=seconds,
                measured_tflops=round(flops / seconds / 1e12, 1),
                preset_tflops=round(preset / 1e12, 1),
                ratio=_ratio(flops / seconds, preset),
            )
        )
    return rows


def attention_work(batch: int, heads: int, seq: int, head_dim: int, part: str) -> tuple[float, float]:
    """``(flops, bytes)`` of causal bf16 attention as :func:`fsdpfn.sim.profile` counts them:
    the forward ``2 b h s^2 d`` (causal half of ``4 b h s^2 d``) over q, k, v and the output; the
    backward twice the forward over q, k, v, the output, its gradient and dq, dk, dv.

    Example:
      >>> f, b = attention_work(2, 16, 8192, 128, "fwd+bwd")
      >>> round(f / b)   # FLOP per byte: s / 4
      2048
    """
    fwd = 2.0 * batch * heads * seq * seq * head_dim
    tensor = batch * heads * seq * head_dim * 2  # one bf16 tensor of the shape of q
    parts = {"fwd": (fwd, 4 * tensor), "bwd": (2 * fwd, 8 * tensor), "fwd+bwd": (3 * fwd, 12 * tensor)}
    if part not in parts:
        raise ValueError(f"attention_work: part must be one of {sorted(parts)}, got {part!r}")
    return parts[part]


def attention_rows(measured: list[tuple[int, int, int, int, float, float]], hw) -> list[dict]:
    """Rows of ``(batch, heads, seq, head_dim, forward seconds, backward seconds)`` measured
    causal bf16 attention beside ``hw``'s fused-attention rate (:func:`kernel_preset`): the
    preset's forward + backward seconds, the measured ones, TFLOP/s in the profile's FLOPs.

    Example:
      >>> from fsdpfn import sim
      >>> r = attention_rows([(2, 16, 8192, 128, 1.935e-3, 4.788e-3)], sim.H100_SXM)[0]   # FlashAttention-2's own figures
      >>> r["ratio"]   # the preset is built from them
      1.0
    """
    kernel_hw = kernel_preset(hw)
    k = kernel_hw.kernels
    rows = []
    for b, h, s, d, fwd_s, bwd_s in measured:
        flops, nbytes = attention_work(b, h, s, d, "fwd+bwd")
        preset_s = k.attention_flop_ratio * flops / k.attention_rate("bfloat16", flops, nbytes, kernel_hw)
        total = fwd_s + bwd_s
        rows.append(
            dict(
                batch=b,
                heads=h,
                seq=s,
                head_dim=d,
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                measured_tflops=round(flops / total / 1e12, 1),
                preset_tflops=round(flops / preset_s / 1e12, 1),
                preset_s=preset_s,
                ratio=_ratio(preset_s, total),
            )
        )
    return rows


def memory_rows(measured: list[tuple[str, float, float]], hw) -> list[dict]:
    """Rows of ``(kernel, bytes moved, seconds)`` memory-bound kernels beside ``hw``'s
    streaming rate (``memory_efficiency * memory_bandwidth``), GB/s each.

    Example:
      >>> from fsdpfn import sim
      >>> memory_rows([("copy", 2e9, 1e-3)], sim.H100_SXM)[0]["measured_gbs"]
      2000.0
    """
    rate = kernel_preset(hw).kernels.memory_efficiency * hw.memory_bandwidth
    return [
        dict(
            kernel=name,
            bytes=nbytes,
            seconds=seconds,
            measured_gbs=round(nbytes / seconds / 1e9, 1),
            preset_gbs=round(rate / 1e9, 1),
            ratio=_ratio(nbytes / seconds, rate),
        )
        for name, nbytes, seconds in measured
    ]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(events: list[dict]) -> dict:
    """What ran on each CUDA stream of a ``torch.profiler`` chrome trace's ``traceEvents``
    (kernels, copies, memsets): the compute stream is the one with the most kernel time; for
    every other stream its busy time and the part of it that ran while compute did (µs).

    Example:
      >>> ev = [dict(ph="X", cat="kernel", name="gemm", ts=0, dur=100, args=dict(stream=7)),
      ...       dict(ph="X", cat="kernel", name="cat", ts=50, dur=100, args=dict(stream=21))]
      >>> s = stream_overlap(ev)
      >>> s["compute_stream"], s["overlap_us"]
      (7, 50.0)
    """
    by_stream: dict[int, list[dict]] = {}
    for e in events:
        if (
            e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and "stream" in e.get("args", {})
        ):
            by_stream.setdefault(int(e["args"]["stream"]), []).append(e)
    if not by_stream:
        return dict(compute_stream=None, streams={}, overlap_us=0.0, other_busy_us=0.0)

    def kernel_time(evs):
        return sum(float(e["dur"]) for e in evs if e["cat"] == "kernel")

    compute = max(by_stream, key=lambda s: (kernel_time(by_stream[s]), -s))
    spans = {
        s: _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]) for s, evs in by_stream.items()
    }
    streams = {}
    for s, evs in sorted(by_stream.items()):
        names: dict[str, float] = {}
        for e in evs:
            names[e["name"]] = names.get(e["name"], 0.0) + float(e["dur"])
        streams[s] = dict(
            events=len(evs),
            busy_us=round(sum(b - a for a, b in spans[s]), 1),
            overlap_with_compute_us=round(_intersection(spans[s], spans[compute]), 1) if s != compute else None,
            top=[n[:80] for n, _ in sorted(names.items(), key=lambda kv: -kv[1])[:4]],
        )
    others = [v for s, v in streams.items() if s != compute]
    return dict(
        compute_stream=compute,
        streams=streams,
        overlap_us=round(sum(v["overlap_with_compute_us"] for v in others), 1),
        other_busy_us=round(sum(v["busy_us"] for v in others), 1),
    )


def demo_summary(rows: list[dict], steps: int) -> dict:
    """The demo's loss curve and step time from its ``metrics.jsonl`` rows: the seconds per step
    of each logged window after the first (the first pays for warm-up), their median.

    Example:
      >>> rows = [dict(step=s, loss=4.0 - s / 50, elapsed_s=1.0 + 0.01 * s) for s in (10, 20, 30)]
      >>> d = demo_summary(rows, 30)
      >>> d["step_s"], d["loss_first"], d["loss_last"], d["steps_done"]
      (0.01, 3.8, 3.4, 30)
    """
    if not rows:
        return dict(steps_done=0, loss_curve=[], step_s=None, loss_first=None, loss_last=None, loss_fell=False)
    windows = [
        (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
        for a, b in zip(rows, rows[1:])
        if b["step"] > a["step"]
    ]
    return dict(
        steps_done=rows[-1]["step"],
        steps_asked=steps,
        loss_curve=[[r["step"], r["loss"]] for r in rows],
        step_s=round(statistics.median(windows), 6) if windows else None,
        loss_first=rows[0]["loss"],
        loss_last=rows[-1]["loss"],
        loss_fell=rows[-1]["loss"] < rows[0]["loss"],
        tokens_per_s=rows[-1].get("tokens_per_s"),
    )


# Files whose CUDA branch is not a CUDA test: test_docs_commands.py only swaps `--device cuda`
# for `cpu` where CUDA is missing before parsing a documented command's flags (the demo step runs
# that command on the GPU), and collecting it parses every documented command (minutes).
NOT_CUDA_TESTS = {"test_docs_commands.py"}
_DECORATED = re.compile(r"((?:^@.*\n)+)^def (test_\w+)\(", re.M)
_BODY = re.compile(r"^def (test_\w+)\(.*?(?=^def |^@|^class |\Z)", re.M | re.S)


def cuda_tests(root: str = ROOT) -> list[str]:
    """Test ids (``path::name``) of the suite's tests that do not run without CUDA: those skipped
    unless CUDA is present (a ``skipif(not torch.cuda.is_available())`` decorator, or a marker
    whose condition needs CUDA) and those whose body takes another branch with it.

    Example:
      >>> "tests/test_runtime.py::test_cuda_comm_orders_streams" in cuda_tests()
      True
    """
    found: list[str] = []
    for name in sorted(os.listdir(os.path.join(root, "tests"))):
        if not (name.startswith("test_") and name.endswith(".py")) or name in NOT_CUDA_TESTS:
            continue
        path = os.path.join(root, "tests", name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # Markers defined in the module as a skip whose condition needs CUDA (directly or through a helper).
        markers = {
            m
            for m, cond in re.findall(r"^(\w+) = pytest\.mark\.skipif\((.*?)(?:,|\))", text, re.M)
            if "cuda" in cond
            or re.search(rf"def {re.escape(cond.strip().removeprefix('not ').rstrip('()'))}\(\).*?cuda", text, re.S)
        }
        ids = []
        for decorators, test in _DECORATED.findall(text):
            if re.search(r"skipif\(not torch\.cuda\.is_available\(\)", decorators) or any(
                f"@{m}\n" in decorators + "\n" for m in markers
            ):
                ids.append(test)
        for body in _BODY.finditer(text):
            if "torch.cuda.is_available()" in body.group(0) and body.group(1) not in ids:
                ids.append(body.group(1))
        found += [f"tests/{name}::{t}" for t in ids]
    return found


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

STATUSES = ("passed", "failed", "timed out", "did not run", "skipped")


def summarize(steps: list[dict], meta: dict) -> dict:
    """The JSON summary: ``meta`` (host, versions, budget), the steps' records, counts by status.

    Example:
      >>> s = summarize([dict(name="demo", status="passed", reason="")], dict(cuda=True))
      >>> s["counts"]["passed"], s["ok"]
      (1, True)
    """
    for s in steps:
        if s["status"] not in STATUSES:
            raise ValueError(f"step {s['name']!r} has status {s['status']!r}; a status is one of {STATUSES}")
    counts = {k: sum(s["status"] == k for s in steps) for k in STATUSES}
    return dict(meta, steps=steps, counts=counts, ok=counts["failed"] == 0 and counts["timed out"] == 0)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:,.3f}".rstrip("0").rstrip(".")
    return str(v)


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    if not rows:
        return []
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows
    ]


def markdown(summary: dict) -> str:
    """The human-readable summary: one line per step (status, time against its limit, reason),
    then the figures each step measured.

    Example:
      >>> md = markdown(summarize([dict(name="demo", status="skipped", reason="skipped: no CUDA", seconds=0, limit_s=100)], {}))
      >>> "| demo | skipped | 0 / 100 s | skipped: no CUDA |" in md
      True
    """
    out = [f"# GPU check: {summary.get('device') or 'no CUDA device'}", ""]
    for key in ("started_utc", "wall_s", "budget_s", "torch", "cuda_version", "fsdpfn_commit"):
        if summary.get(key) is not None:
            out.append(f"- {key}: {summary[key]}")
    c = summary["counts"]
    out += [
        "",
        "passed {passed}, failed {failed}, timed out {tt}, did not run {dnr}, skipped {skipped}".format(
            passed=c["passed"], failed=c["failed"], tt=c["timed out"], dnr=c["did not run"], skipped=c["skipped"]
        ),
        "",
        "| step | status | seconds / limit | reason |",
        "|---|---|---|---|",
    ]
    for s in summary["steps"]:
        out.append(
            f"| {s['name']} | {s['status']} | {_fmt(s.get('seconds'))} / {_fmt(s.get('limit_s'))} s | {s.get('reason') or ''} |"
        )
    for s in summary["steps"]:
        r = s.get("results") or {}
        if not r:
            continue
        out += ["", f"## {s['name']}", ""]
        for key, value in r.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                out += [f"{key}:", ""] + _table(value, list(value[0])) + [""]
            else:
                text = json.dumps(value) if not isinstance(value, str) else value
                out.append(f"- {key}: {text if len(text) < 600 else text[:600] + ' ...'}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The orchestrator: each step in its own process, under `timeout`
# ---------------------------------------------------------------------------------------------


def _now() -> float:
    """Seconds on the orchestrator's clock (the budget's)."""
    return time.monotonic()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _step_env() -> dict:
    # PYTHONPATH: fsdpfn imports from this checkout even where its install failed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("OMP_NUM_THREADS", "4")
    return env


def _run_limited(cmd: list[str], limit: float, log) -> tuple[int, float]:
    """Runs ``cmd`` under ``timeout`` (SIGTERM at the limit, SIGKILL 10 s later), its output
    appended to ``log``; ``(exit status, seconds)``. 124 or 137: it ran out of time."""
    t0 = time.monotonic()
    if shutil.which("timeout"):
        cmd = ["timeout", "-k", "10", f"{limit:.0f}", *cmd]
    with tempfile.TemporaryFile("w+") as buf:
        proc = subprocess.Popen(
            cmd, stdout=buf, stderr=subprocess.STDOUT, cwd=ROOT, env=_step_env(), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit + 20)  # `timeout` ends it first; this is the backstop
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            rc = 137 if rc in (-9, 137) else rc
        buf.seek(0)
        text = buf.read()
    log.write(text[-LOG_TAIL:])
    print(text[-4000:], end="", flush=True)
    return rc, time.monotonic() - t0


def _host_meta() -> dict:
    meta: dict[str, Any] = dict(python=platform.python_version(), platform=platform.platform())
    try:
        import torch

        meta.update(torch=torch.__version__, cuda_version=torch.version.cuda, cuda=torch.cuda.is_available())
        if torch.cuda.is_available():
            meta.update(
                device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0)))
            )
    except ImportError:
        meta.update(torch=None, cuda=False)
    try:
        meta["fsdpfn_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        meta["fsdpfn_commit"] = None
    return meta


def orchestrate(args: argparse.Namespace) -> dict:
    """Runs the chosen steps in order, each in its own process under its time limit, and writes
    ``summary.json``, ``summary.md`` and ``log.txt`` under ``args.out``; returns the summary."""
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="fsdpfn-gpu-check-")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = _now()
    records: list[dict] = []
    cuda = _has_cuda()
    with open(os.path.join(args.out, "log.txt"), "w", encoding="utf-8") as log:
        for name in args.steps:
            step = BY_NAME[name]
            record: dict[str, Any] = dict(name=name, what=step.what, limit_s=step.limit_s, seconds=0.0, results={})
            left = args.budget - (_now() - t0)
            log.write(f"\n===== {name} ({step.what}) =====\n")
            print(f"\n===== {name}: {step.what} =====", flush=True)
            if not cuda:
                # Nothing is installed either: without a GPU this is a dry run (the test suite's),
                # and an install here would repoint the environment's fsdpfn.
                record.update(status="skipped", reason=NO_CUDA)
                if name == "install":
                    record["results"] = dict(versions=_versions())
            elif left < MIN_STEP_S:
                record.update(
                    status="did not run", reason=f"the check's time budget ({args.budget:.0f} s) was spent before it"
                )
            else:
                limit = min(step.limit_s, left)
                result_path = os.path.join(work, f"{name}.json")
                rc, seconds = _run_limited(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--run-step",
                        name,
                        "--result",
                        result_path,
                        "--work",
                        work,
                    ],
                    limit,
                    log,
                )
                record.update(limit_s=round(limit), seconds=round(seconds, 1))
                got = _read_json(result_path) or {}
                record["results"] = got.get("results", {})
                if rc in (124, 137) and seconds >= limit - 2:
                    record.update(
                        status="timed out",
                        reason=f"stopped at its limit of {limit:.0f} s"
                        + (f"; it had finished: {', '.join(record['results'])}" if record["results"] else ""),
                    )
                elif rc in (-9, 137):  # killed before its limit: the kernel's OOM killer, most likely
                    record.update(
                        status="failed", reason=f"killed after {seconds:.0f} s (SIGKILL: out of host memory?)"
                    )
                elif "status" in got:
                    record.update(status=got["status"], reason=got.get("reason", ""))
                else:
                    record.update(status="failed", reason=f"exit status {rc} before it wrote a result: see log.txt")
            log.write(f"----- {name}: {record['status']} {record.get('reason', '')}\n")
            log.flush()
            print(f"----- {name}: {record['status']} {record.get('reason', '')}", flush=True)
            records.append(record)
    meta = _host_meta()
    install = next((r for r in records if r["name"] == "install"), None)
    if install:
        meta["versions"] = install["results"].get("versions")
    meta.update(started_utc=started.isoformat(timespec="seconds"), wall_s=round(_now() - t0, 1), budget_s=args.budget)
    summary = summarize(records, meta)
    metrics = os.path.join(work, "demo", "metrics.jsonl")
    if os.path.exists(metrics):
        shutil.copy(metrics, os.path.join(args.out, "demo_metrics.jsonl"))
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown(summary))
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{' '.join(f'{k} {v}' for k, v in summary['counts'].items())}; results in {args.out}: {', '.join(sorted(os.listdir(args.out)))}"
    )
    return summary


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Inside a step's process
# ---------------------------------------------------------------------------------------------


class StepContext:
    """What a step writes: ``record(key, value)`` saves the result file at once, so a step stopped
    at its limit keeps what it had measured; ``check(name, ok, detail)`` an expectation."""

    def __init__(self, path: str, work: str):
        self.path, self.work = path, work
        self.results: dict[str, Any] = {}
        self.failed: list[str] = []
        self.status, self.reason = "passed", ""

    def record(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.save()

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.setdefault("checks", {})[name] = bool(ok)
        if not ok:
            self.failed.append(f"{name}{f' ({detail})' if detail else ''}")
        self.save()

    def save(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(dict(status=self.status, reason=self.reason, results=self.results), f, indent=1, default=str)


def run_step(name: str, result: str, work: str) -> int:
    """One step, in this process: its function, its result file (statuses: passed, failed, did
    not run); a check that did not hold or an exception fails it with the reason."""
    ctx = StepContext(result, work)
    ctx.status, ctx.reason = "failed", "it stopped before its end"  # until it finishes
    ctx.save()
    try:
        outcome = STEP_FUNCS[name](ctx)
    except Exception as e:  # noqa: BLE001 - any failure is a result of the check, named in the summary
        import traceback

        traceback.print_exc()
        # The first two lines: a RankError's second names the rank's own error (or its hang).
        lines = [line.strip() for line in str(e).splitlines() if line.strip()][:2]
        ctx.status, ctx.reason = "failed", f"{type(e).__name__}: {' '.join(lines)[:300]}"
    else:
        if isinstance(outcome, str):  # a reason it could not run
            ctx.status, ctx.reason = "did not run", outcome
        elif ctx.failed:
            ctx.status, ctx.reason = "failed", "; ".join(ctx.failed)[:600]
        else:
            ctx.status, ctx.reason = "passed", ""
    ctx.save()
    return 0


def _pip(args: list[str], limit: float) -> tuple[bool, str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--timeout",
        "10",
        "--retries",
        "0",
        *args,
    ]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return False, f"pip install {' '.join(args)}: no answer within {limit:.0f} s"
    print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
    return p.returncode == 0, (p.stderr.strip().splitlines() or [""])[-1][:300]


def _fsdpfn_from_here() -> bool:
    # Looked up without this checkout on the path, as pip installed it (the Makefile's check).
    code = (
        "import sys, os, importlib.util as u; sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(sys.argv[1])]; "
        "f = u.find_spec('fsdpfn'); sys.exit(f is None or os.path.realpath(os.path.dirname(f.origin or '')) != os.path.realpath(os.path.join(sys.argv[1], 'fsdpfn')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, ROOT], cwd="/", env=env).returncode == 0


# The test extra's packages (pyproject.toml), by import name.
TEST_EXTRA = {"pytest": "pytest>=8", "hypothesis": "hypothesis>=6.100", "ml_dtypes": "ml-dtypes>=0.4"}


def _versions() -> dict:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in (
        "torch",
        "optree",
        "safetensors",
        "pytest",
        "hypothesis",
        "ml-dtypes",
        "transformer-engine",
        "triton",
        "fsdpfn",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out.update(
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        )
        if torch.cuda.is_available():
            out.update(
                device=torch.cuda.get_device_name(0),
                capability=list(torch.cuda.get_device_capability(0)),
                memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            )
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["nvidia_smi"] = smi.stdout.strip()
    return out


def step_install(ctx: StepContext):
    installed = []
    if not _fsdpfn_from_here():
        # Without build isolation: an offline machine cannot fetch setuptools into a fresh build env.
        ok, why = _pip(["--no-build-isolation", "--no-deps", "-e", "."], 40)
        installed.append(dict(package="fsdpfn (editable, this checkout)", ok=ok, note=why))
        ctx.check("fsdpfn installed from this checkout", ok, why)
    missing = [spec for mod, spec in TEST_EXTRA.items() if importlib.util.find_spec(mod) is None]
    missing += [
        spec
        for mod, spec in (("optree", "optree>=0.13"), ("safetensors", "safetensors>=0.4"))
        if importlib.util.find_spec(mod) is None
    ]
    if missing:
        ok, why = _pip(missing, 40)
        installed.append(dict(package=" ".join(missing), ok=ok, note=why))
        ctx.check("the test extra's packages installed", ok, why)
    ctx.record("installed", installed or "nothing: everything was present")
    ctx.record("versions", _versions())
    print(json.dumps(ctx.results, indent=1), flush=True)


def step_cuda_tests(ctx: StepContext):
    if importlib.util.find_spec("pytest") is None:
        return "pytest is not installed (the install step could not install it)"
    import xml.etree.ElementTree as ET
    from importlib import metadata

    ids = cuda_tests()
    ctx.record("tests", ids)
    junit = os.path.join(ctx.work, "cuda_tests.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "--fsdpfn-timeout",
        "60",
        *ids,
    ]
    if not any(ep.value.startswith("fsdpfn.") for ep in metadata.entry_points(group="pytest11")):
        cmd[3:3] = ["-p", "fsdpfn.testing.pytest_plugin"]  # not installed: the plugin by module name
    if importlib.util.find_spec("hypothesis") is None:
        cmd[3:3] = ["--noconftest"]  # tests/conftest.py configures hypothesis
    p = subprocess.run(cmd, cwd=ROOT, env=_step_env(), capture_output=True, text=True)
    print(p.stdout[-20000:], p.stderr[-5000:], flush=True)
    outcomes = []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            detail = next((c.get("message", "") for c in case if c.tag in ("failure", "error", "skipped")), "")
            outcomes.append(
                dict(test=f"{case.get('classname', '')}::{case.get('name')}", outcome=kind, detail=detail[:300])
            )
    ctx.record("outcomes", outcomes)
    bad = [o["test"] for o in outcomes if o["outcome"] in ("failure", "error")]
    ctx.check(
        "every CUDA test passed or skipped with a reason",
        p.returncode in (0, 5) and not bad,
        ", ".join(bad) or f"pytest exit {p.returncode}",
    )


# ---- probes on ranks (functions at module level: run_on_ranks pickles them) ------------------


# Where the probes run: "cuda"; "cpu" only to rehearse the probes' code on a machine without a
# GPU (FSDPFN_GPU_CHECK_DEVICE=cpu, by hand: the CUDA-only measurements then fail at once).
DEV = os.environ.get("FSDPFN_GPU_CHECK_DEVICE", "cuda")

# Seconds each world size of a probe may take (ranks' start, CUDA's initialisation, the probe):
# two of them fit their step's limit, so a hang at one still leaves the other its time.
PER_WORLD_S = 30


def _sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.empty_cache()


def _cuda_mesh(world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if DEV == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU; gloo carries the collectives
    return init_device_mesh(DEV, (world,))


def _gpt(width: int, depth: int, heads: int, seq: int, vocab: int = 256):
    import torch
    from fsdpfn.models import GPT, GPTConfig

    if DEV != "cuda":  # a rehearsal on CPU: the same code on a model small enough for a CPU
        width, depth = 64, 2
    torch.manual_seed(0)
    with torch.device(DEV):
        return GPT(GPTConfig(vocab_size=vocab, seq_len=seq, width=width, depth=depth, heads=heads))


def _batch(rank: int, batch: int, seq: int, vocab: int = 256, step: int = 0):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(DEV)
    return t[:, :-1], t[:, 1:]


def _ce(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _streams_rank(rank: int, world: int, trace_path: str):
    import torch

    import fsdpfn
    from fsdpfn.runtime import Runtime

    mesh = _cuda_mesh(world)
    model = _gpt(1024, 6, 8, 256)
    plan = fsdpfn.plan(model, mesh, mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    rt = Runtime(model, plan, prefetch=1, device=DEV)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(rank, 8, 256)
    step = rt.value_and_grad(lambda ps, x, y: _ce(rt.apply(ps, x), y))
    for _ in range(2):  # warm-up: the allocator's pools, cuBLAS handles
        step(params, x, y)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step(params, x, y)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    if rank:
        return None
    prof.export_chrome_trace(trace_path)
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return dict(
        stream_overlap(events),
        step_s=round(seconds, 5),
        comm_streams=sorted(rt._ex.comm.streams) if hasattr(rt._ex, "comm") else None,
    )


def step_streams(ctx: StepContext):
    from fsdpfn import testing

    # 2 ranks: the all-gather moves bytes between them; 1 rank: the same stream still casts and
    # copies each unit's shards ahead of its compute (and runs should gloo refuse CUDA tensors).
    for world in (2, 1):
        try:
            out = testing.run_on_ranks(
                _streams_rank, world, os.path.join(ctx.work, f"trace{world}.json"), timeout=PER_WORLD_S
            )[0]
        except Exception as e:  # noqa: BLE001 - recorded; the other world size still runs
            ctx.check(f"world {world} ran", False, f"{type(e).__name__}: {str(e)[-300:]}")
            continue
        ctx.record(f"world {world}", out)
        others = {s: v for s, v in out["streams"].items() if s != out["compute_stream"]}
        ctx.check(
            f"world {world}: kernels or copies ran on a stream beside compute",
            bool(others),
            f"streams seen: {sorted(out['streams'])}",
        )
        ctx.check(
            f"world {world}: work beside compute overlapped it",
            out["overlap_us"] > 0,
            f"overlap {out['overlap_us']} us of {out['other_busy_us']} us",
        )


def _memory_rank(rank: int, world: int):
    import torch

    import fsdpfn
    from fsdpfn.runtime import Runtime

    mesh = _cuda_mesh(world)
    model = _gpt(1024, 8, 8, 64)
    x, y = _batch(rank, 2, 64)
    out = {}
    for raf in (True, False):
        plan = fsdpfn.plan(
            model, mesh, mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
        rt = Runtime(model, plan, prefetch=1, reshard_after_forward=raf, device=DEV)
        params = fsdpfn.shard(model, plan)
        step = rt.value_and_grad(lambda ps, x, y: _ce(rt.apply(ps, x), y))  # noqa: F821 - deleted after the loop's last call
        step(params, x, y)  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        rt.memory.reset()
        grads, _ = step(params, x, y)
        torch.cuda.synchronize()
        out[f"raf_{raf}"] = dict(
            peak_above_start=torch.cuda.max_memory_allocated() - base, tracker_high_water=rt.memory.high_water
        )
        del grads, params, rt, step
        torch.cuda.empty_cache()
    return out


def step_reshard_memory(ctx: StepContext):
    from fsdpfn import testing

    for world in (2, 1):
        try:
            r = testing.run_on_ranks(_memory_rank, world, timeout=PER_WORLD_S)[0]
        except Exception as e:  # noqa: BLE001 - recorded; the other world size still runs
            ctx.check(f"world {world} ran", False, f"{type(e).__name__}: {str(e)[-300:]}")
            continue
        on, off = r["raf_True"], r["raf_False"]
        measured = off["peak_above_start"] - on["peak_above_start"]
        counted = off["tracker_high_water"] - on["tracker_high_water"]
        ctx.record(
            f"world {world}",
            dict(r, measured_saving=measured, tracker_saving=counted, saving_ratio=_ratio(measured, counted)),
        )
        ctx.check(
            f"world {world}: reshard-after-forward lowers max_memory_allocated",
            on["peak_above_start"] < off["peak_above_start"],
            f"{on['peak_above_start']} vs {off['peak_above_start']} bytes",
        )
        ctx.check(
            f"world {world}: the saving is the tracker's within 25%",
            counted > 0 and abs(measured - counted) <= 0.25 * counted,
            f"measured {measured} bytes, tracker {counted}",
        )


def _pinned(params) -> list[str]:
    """Whether the host-resident shards of the blocks are pinned (``["True"]``: all of them)."""
    return sorted(
        {
            str(p._local_tensor.is_pinned())
            for n, p in params.items()
            if n.startswith("blocks.") and p._local_tensor.device.type == "cpu"
        }
    )


def _offload_rank(rank: int, world: int):
    import torch

    import fsdpfn
    from fsdpfn.runtime import Runtime

    mesh = _cuda_mesh(world)
    results = {}
    for offload in (None, {"blocks.*": True}):
        model = _gpt(512, 4, 8, 64)
        plan = fsdpfn.plan(model, mesh, offload=offload)
        rt = Runtime(model, plan, prefetch=1, device=DEV)
        params = fsdpfn.shard(model, plan)
        pinned_at_shard = _pinned(params)
        opt = fsdpfn.optim.adamw(lr=1e-3)
        state = opt.init(params)
        times = []
        for i in range(4):
            x, y = _batch(rank, 4, 64, step=i)
            _sync()
            t0 = time.perf_counter()
            g, loss = rt.value_and_grad(lambda ps, x, y: _ce(rt.apply(ps, x), y))(params, x, y)
            updates, state = opt.update(g, state, params)
            params = fsdpfn.optim.apply_updates(params, updates)
            _sync()
            times.append(time.perf_counter() - t0)
        local = {n: p._local_tensor for n, p in params.items()}
        results[bool(offload)] = dict(
            params={n: t.detach().cpu() for n, t in local.items()},
            step_s=statistics.median(times[1:]),
            pinned_at_shard=pinned_at_shard,
            pinned_after_steps=_pinned(params),
            devices=sorted({str(t.device) for t in local.values()}),
            held_between=dict(rt.memory.offloaded),
            copies=len(rt.last_step.copies),
        )
    on, off = results[True], results[False]
    same = all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"])
    for r in results.values():
        del r["params"]
    return dict(bitwise_same=same, offload=on, plain=off)


def step_offload(ctx: StepContext):
    from fsdpfn import testing

    for world in (1, 2):
        try:
            r = testing.run_on_ranks(_offload_rank, world, timeout=PER_WORLD_S)[0]
        except Exception as e:  # noqa: BLE001 - recorded; the other world size still runs
            ctx.check(f"world {world} ran", False, f"{type(e).__name__}: {str(e)[-300:]}")
            continue
        ctx.record(f"world {world}", r)
        ctx.check(f"world {world}: 4 AdamW steps bitwise the run without offload", r["bitwise_same"])
        ctx.check(
            f"world {world}: offloaded shards in pinned host memory",
            r["offload"]["pinned_at_shard"] == ["True"],
            str(r["offload"]["pinned_at_shard"]),
        )
        ctx.check(
            f"world {world}: still pinned after 4 optimizer steps (else each copy-in is synchronous)",
            r["offload"]["pinned_after_steps"] == ["True"],
            str(r["offload"]["pinned_after_steps"]),
        )
        ctx.check(
            f"world {world}: no device bytes held between steps",
            not r["offload"]["held_between"],
            str(r["offload"]["held_between"]),
        )


def _fp8_rank(rank: int, world: int):
    import torch

    import fsdpfn

    mesh = _cuda_mesh(world)
    model = _gpt(1024, 4, 8, 128)
    out = {}
    for fp8 in (None, "mxfp8"):
        plan = fsdpfn.plan(
            model, mesh, mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, fp8=fp8)
        )
        params = fsdpfn.shard(model, plan)
        x, y = _batch(rank, 4, 128)

        def loss_fn(ps, x, y, plan=plan):
            return _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)

        step = torch.func.grad_and_value(loss_fn)
        step(params, x, y)
        _sync()
        t0 = time.perf_counter()
        for _ in range(3):
            grads, loss = step(params, x, y)
        _sync()
        finite = all(bool(torch.isfinite(g.to_local()).all()) for g in grads.values())
        out[fp8 or "bf16"] = dict(
            loss=loss.item(),
            step_s=(time.perf_counter() - t0) / 3,
            grads_finite=finite,
            all_gather_bytes=plan.cost().collectives["all_gather"].nbytes,
        )
    return out


def step_fp8_gather(ctx: StepContext):
    from fsdpfn import testing

    for world in (1, 2):
        try:
            r = testing.run_on_ranks(_fp8_rank, world, timeout=PER_WORLD_S)[0]
        except Exception as e:  # noqa: BLE001 - recorded; the other world size still runs
            ctx.check(f"world {world} ran", False, f"{type(e).__name__}: {str(e)[-300:]}")
            continue
        ctx.record(f"world {world}", r)
        ctx.check(f"world {world}: finite FP8 gradients", r["mxfp8"]["grads_finite"])
        ctx.check(
            f"world {world}: FP8 loss within 5% of bf16",
            abs(r["mxfp8"]["loss"] - r["bf16"]["loss"]) <= 0.05 * abs(r["bf16"]["loss"]),
            f"{r['mxfp8']['loss']:.4f} vs {r['bf16']['loss']:.4f}",
        )
        ctx.check(
            f"world {world}: FP8 gathers under 60% of bf16's bytes",
            r["mxfp8"]["all_gather_bytes"] < 0.6 * r["bf16"]["all_gather_bytes"],
        )


def _compile_rank(rank: int, world: int):
    import torch

    import fsdpfn

    mesh = _cuda_mesh(world)
    model = _gpt(512, 4, 8, 128)
    plan = fsdpfn.plan(model, mesh)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(rank, 4, 128)

    def loss_fn(ps, x, y):
        return _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)

    eager = torch.func.grad_and_value(loss_fn)
    compiled = fsdpfn.compile(loss_fn)
    t0 = time.perf_counter()
    g_c, loss_c = compiled(params, x, y)
    _sync()
    compile_s = time.perf_counter() - t0
    g_e, loss_e = eager(params, x, y)
    worst = max(
        ((g_c[n].to_local() - g_e[n].to_local()).abs().max() / g_e[n].to_local().abs().max().clamp_min(1e-12)).item()
        for n in g_e
    )

    def timed(fn):
        fn(params, x, y)
        _sync()
        t = time.perf_counter()
        for _ in range(5):
            fn(params, x, y)
        _sync()
        return (time.perf_counter() - t) / 5

    return dict(
        first_call_s=round(compile_s, 2),
        loss_compiled=loss_c.item(),
        loss_eager=loss_e.item(),
        worst_grad_rel_diff=worst,
        step_s_compiled=timed(compiled),
        step_s_eager=timed(eager),
    )


def step_compile(ctx: StepContext):
    from fsdpfn import testing

    r = testing.run_on_ranks(_compile_rank, 1, timeout=85)[0]
    ctx.record("world 1", r)
    ctx.check(
        "compiled gradients equal eager's to 1e-3",
        r["worst_grad_rel_diff"] < 1e-3,
        f"worst relative difference {r['worst_grad_rel_diff']:.2e}",
    )


DEMO_STEPS = 100


def step_demo(ctx: StepContext):
    out = os.path.join(ctx.work, "demo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--device",
        "cuda",
        "--steps",
        str(DEMO_STEPS),
        "--out",
        out,
        "--no-progress",
        "--log-every",
        "5",
        "--eval-every",
        "0",
        "--sample-chars",
        "200",
        "--ckpt-every",
        str(DEMO_STEPS),
    ]
    ctx.record("command", "python " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=_step_env(), capture_output=True, text=True)
    print(p.stdout[-20000:], p.stderr[-10000:], flush=True)
    ctx.record("wall_s", round(time.perf_counter() - t0, 1))
    rows = []
    path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    d = demo_summary(rows, DEMO_STEPS)
    ctx.record("demo", d)
    ctx.check(
        "the demo exited 0",
        p.returncode == 0,
        f"exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:200]}",
    )
    ctx.check(f"{DEMO_STEPS} steps logged", d["steps_done"] == DEMO_STEPS, f"{d['steps_done']} logged")
    ctx.check("the loss fell", d["loss_fell"], f"{d['loss_first']} -> {d['loss_last']}")


def _time_cuda(fn: Callable[[], Any], min_s: float = 0.02, repeats: int = 5) -> float:
    """Median seconds of ``fn`` on the device: CUDA events around enough calls to last ``min_s``."""
    import torch

    if DEV != "cuda":  # a rehearsal on CPU
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(200, int(min_s / max(start.elapsed_time(end) / 1e3, 1e-7))))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def demo_vocab() -> int:
    """Characters in the demo's corpus (its vocabulary)."""
    with open(os.path.join(ROOT, "examples", "data", "tiny_tales.txt"), encoding="utf-8") as f:
        return len(set(f.read()))


# (label, m, n, k): the demo model's matmuls (16 x 64 tokens, width 128), one Llama-3-8B block's
# at 8,192 tokens (forward; the backward's are the same shapes transposed), and grid points of
# the H100 shape table.
def matmul_shapes() -> list[tuple[str, int, int, int]]:
    v = demo_vocab()
    return [
        ("demo qkv", 1024, 384, 128),
        ("demo attn out", 1024, 128, 128),
        ("demo mlp up", 1024, 512, 128),
        ("demo mlp down", 1024, 128, 512),
        ("demo head", 1024, v, 128),
        ("8B wq/wo", 8192, 4096, 4096),
        ("8B wk/wv", 8192, 1024, 4096),
        ("8B w1/w3", 8192, 14336, 4096),
        ("8B w2", 8192, 4096, 14336),
        ("8B w1 grad (weight)", 4096, 14336, 8192),
        ("8B w2 grad (input)", 8192, 14336, 4096),
        ("table 1024^3", 1024, 1024, 1024),
        ("table 4096^3", 4096, 4096, 4096),
        ("table 16384x2048x4096", 16384, 2048, 4096),
    ]


ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384, 32768)


def step_sim_kernels(ctx: StepContext):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsdpfn import sim

    hw = sim.H100_SXM
    dev, bf16 = "cuda", torch.bfloat16
    measured: list[tuple[str, int, int, int, str, float]] = []
    for label, m, n, k in matmul_shapes():
        lhs, rhs = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
        measured.append((label, m, n, k, "bfloat16", _time_cuda(lambda lhs=lhs, rhs=rhs: lhs @ rhs)))
        del lhs, rhs
    ctx.record("matmul", matmul_rows(measured, hw))
    att: list[tuple[int, int, int, int, float, float]] = []
    for seq in (
        ATTENTION_SEQS
    ):  # 16k tokens per batch below 16k (FlashAttention's benchmark keeps tokens fixed), 32 heads of 128
        batch, heads, head_dim = max(1, 16384 // seq), 32, 128
        q, kk, v = (
            torch.randn(batch, heads, seq, head_dim, device=dev, dtype=bf16, requires_grad=True) for _ in range(3)
        )
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the kernel class the preset's rate is for (FlashAttention-2)
            fwd = _time_cuda(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True), repeats=3)  # noqa: F821 - deleted after the loop's last call
            out = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            grad = torch.randn_like(out)
            both = _time_cuda(
                lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, kk, v, is_causal=True), (q, kk, v), grad),  # noqa: F821 - deleted after the loop's last call
                repeats=3,
            )
        att.append((batch, heads, seq, head_dim, fwd, max(both - fwd, 0.0)))
        ctx.record("attention", attention_rows(att, hw))
        del q, kk, v, out, grad
    torch.cuda.empty_cache()
    n = 64 * 2**20  # elements: 128 MiB of bf16 per tensor
    x, y = torch.randn(n, device=dev, dtype=bf16), torch.randn(n, device=dev, dtype=bf16)
    rows, w = torch.randn(8192, 4096, device=dev, dtype=bf16), torch.ones(4096, device=dev, dtype=bf16)
    mem: list[tuple[str, float, float]] = [
        ("copy", 2 * 2 * n, _time_cuda(lambda: x.clone())),
        ("add", 3 * 2 * n, _time_cuda(lambda: x + y)),
        ("silu * mul (SwiGLU)", 3 * 2 * n, _time_cuda(lambda: F.silu(x) * y)),
        ("rms_norm 8192x4096", 2 * 2 * rows.numel(), _time_cuda(lambda: F.rms_norm(rows, (4096,), w))),
        ("float32 cast", (2 + 4) * n, _time_cuda(lambda: x.float())),
    ]
    ctx.record("memory_bound", memory_rows(mem, hw))
    ctx.check(
        "every kernel timed",
        all(r["seconds"] > 0 for r in ctx.results["matmul"]) and len(ctx.results["attention"]) == len(ATTENTION_SEQS),
    )


def _demo_step_rank(rank: int, world: int, vocab: int):

    import fsdpfn
    from fsdpfn import sim
    from fsdpfn.runtime import Runtime, schedule

    mesh = _cuda_mesh(world)
    model = _gpt(128, 4, 4, 64, vocab)  # the demo's defaults: width 128, 4 blocks, 4 heads, 64 characters, batch 16
    plan = fsdpfn.plan(model, mesh)
    rt = Runtime(model, plan, prefetch=1, device=DEV)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(rank, 16, 64, vocab)
    step = rt.value_and_grad(lambda ps, x, y: _ce(rt.apply(ps, x), y))
    measured = _time_cuda(lambda: step(params, x, y), min_s=0.2)
    wl = sim.profile(model, plan, x, loss_fn=lambda out: _ce(out, y))
    r = sim.simulate(plan, schedule(plan, prefetch=1), wl, sim.Muon(), sim.H100_SXM)
    return dict(
        measured_forward_backward_s=measured,
        predicted_step_s=r.step_time,
        predicted_optimizer_s=r.optimizer_time,
        predicted_forward_backward_s=r.step_time - r.optimizer_time,
        ops=sum(w.ops for _, w in wl.work),
    )


def _block_prediction(seq: int) -> tuple[float, float]:
    """The H100 preset's forward and backward seconds of one Llama-3-8B block at ``seq`` tokens, bf16."""
    import torch

    import fsdpfn
    from fsdpfn import sim
    from fsdpfn.models import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=4096, layers=1, heads=32, kv_heads=8, ffn=14336, vocab=256))
        tokens = torch.zeros(1, seq, dtype=torch.long)
    plan = fsdpfn.plan(model, (1,), mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    wl = sim.profile(model, plan, tokens)
    fwd, bwd = wl.forward_backward("layers.0")
    return fwd.seconds(sim.H100_SXM), bwd.seconds(sim.H100_SXM)


def step_sim_step(ctx: StepContext):
    import torch

    from fsdpfn import testing
    from fsdpfn.models._llama import Block
    from fsdpfn.models import LlamaConfig

    # A rehearsal on CPU runs the same code on 16 tokens in float32 (CPUs are slow at bf16).
    seq, dtype = (8192, torch.bfloat16) if DEV == "cuda" else (16, torch.float32)
    torch.manual_seed(0)
    block = Block(LlamaConfig(dim=4096, layers=1, heads=32, kv_heads=8, ffn=14336, vocab=256)).to(DEV, dtype)
    x = torch.randn(1, seq, 4096, device=DEV, dtype=dtype, requires_grad=True)
    fwd = _time_cuda(lambda: block(x), repeats=3)  # noqa: F821 - deleted after its last call
    out = block(x)
    grad = torch.randn_like(out)
    both = _time_cuda(lambda: torch.autograd.grad(block(x), [x, *block.parameters()], grad), repeats=3)  # noqa: F821 - deleted after its last call
    p_fwd, p_bwd = _block_prediction(seq)
    ctx.record("llama3_8b_block_tokens", seq)
    ctx.record(
        "llama3_8b_block",
        [
            dict(part="forward", measured_s=fwd, predicted_s=p_fwd, ratio=_ratio(p_fwd, fwd)),
            dict(part="backward", measured_s=both - fwd, predicted_s=p_bwd, ratio=_ratio(p_bwd, both - fwd)),
            dict(
                part="forward+backward", measured_s=both, predicted_s=p_fwd + p_bwd, ratio=_ratio(p_fwd + p_bwd, both)
            ),
        ],
    )
    del block, x, out, grad
    _empty_cache()
    demo = testing.run_on_ranks(_demo_step_rank, 1, demo_vocab(), timeout=40)[0]
    row = dict(demo, ratio=_ratio(demo["predicted_forward_backward_s"], demo["measured_forward_backward_s"]))
    demo_result = _read_json(os.path.join(ctx.work, "demo.json")) or {}
    measured_step = ((demo_result.get("results") or {}).get("demo") or {}).get("step_s")
    if measured_step:
        row.update(demo_step_s=measured_step, step_ratio=_ratio(demo["predicted_step_s"], measured_step))
    ctx.record("demo_model", row)


def step_te(ctx: StepContext):
    try:
        import transformer_engine.pytorch  # noqa: F401

        ctx.record("transformer_engine", "present")
    except Exception as first:  # noqa: BLE001 - absent or broken: try to install it within the step's limit
        ok, why = _pip(["transformer-engine[pytorch]>=2.0"], 25)
        ctx.record("install", dict(ok=ok, note=why, import_error=f"{type(first).__name__}: {str(first)[:200]}"))
        try:
            import transformer_engine.pytorch  # noqa: F401,F811
        except Exception as e:  # noqa: BLE001
            return (
                f"Transformer Engine is not installed and did not install within its limit ({why or type(e).__name__})"
            )
    from fsdpfn import testing

    for recipe in ("tensorwise", "mxfp8"):  # Hopper runs per-tensor current scaling; MXFP8 needs Blackwell
        try:
            r = testing.run_on_ranks(_te_handoff_rank, 1, recipe, timeout=30)[0]
        except Exception as e:  # noqa: BLE001 - recorded, the next recipe still runs
            r = dict(error=f"{type(e).__name__}: {str(e)[-400:]}")
        ctx.record(recipe, r)
    hopper = ctx.results["tensorwise"]
    ctx.check(
        "the tensorwise (Float8CurrentScaling) hand-over gives TE tensors with our bytes",
        hopper.get("same") is True,
        str(hopper)[:300],
    )
    mx = ctx.results["mxfp8"]
    ctx.check(
        "MXFP8 hands over, or is refused naming the GPU",
        mx.get("same") is True or "cannot run MXFP8BlockScaling" in mx.get("error", ""),
        str(mx)[:300],
    )


def _te_handoff_rank(rank: int, world: int, recipe: str):
    import importlib
    import warnings

    import torch
    import transformer_engine.pytorch as te
    from torch import nn

    import fsdpfn
    from fsdpfn.fp8 import Float8GatherPolicy

    mesh = _cuda_mesh(world)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(
            te.Linear(128, 256, params_dtype=torch.bfloat16), te.Linear(256, 128, params_dtype=torch.bfloat16)
        )
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    handed = fsdpfn.plan(
        model, mesh, units=[], mp=fsdpfn.MixedPrecision(**bf16, fp8=Float8GatherPolicy(recipe=recipe, backend="te"))
    )
    plain = fsdpfn.plan(model, mesh, units=[], mp=fsdpfn.MixedPrecision(**bf16, fp8=recipe))
    params = fsdpfn.shard(model, handed)
    te_full, torch_full = fsdpfn.unshard(params, handed), fsdpfn.unshard(params, plain)
    fp8_names = handed.units[0].fp8
    kinds = sorted({type(v).__name__ for n, v in te_full.items() if n in fp8_names})
    same = all(torch.equal(te_full[n].dequantize(), torch_full[n]) for n in fp8_names)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    names = {"tensorwise": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling"}
    te_recipe = getattr(importlib.import_module("transformer_engine.common.recipe"), names[recipe])()
    autocast = (
        te.autocast(enabled=True, recipe=te_recipe)
        if hasattr(te, "autocast")
        else te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)
    )
    with warnings.catch_warnings(), autocast:
        warnings.simplefilter("ignore")  # TE's own deprecation notices
        y = torch.func.functional_call(model, te_full, (x,))
    ref = torch.func.functional_call(model, torch_full, (x,))
    rel = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return dict(kinds=kinds, same=same, forward_rel_diff=rel)


STEP_FUNCS: dict[str, Callable[[StepContext], Any]] = {
    "install": step_install,
    "cuda_tests": step_cuda_tests,
    "streams": step_streams,
    "reshard_memory": step_reshard_memory,
    "offload": step_offload,
    "fp8_gather": step_fp8_gather,
    "compile": step_compile,
    "demo": step_demo,
    "sim_kernels": step_sim_kernels,
    "sim_step": step_sim_step,
    "te": step_te,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in STEPS:
            print(f"{s.name:15} {s.limit_s:4.0f} s  {s.what}")
        print(f"budget: {args.budget:.0f} s in all")
        return 0
    if args.run_step is not None:
        return run_step(args.run_step, args.result, args.work)
    orchestrate(args)
    return 0  # a failed step is a result, written in the summary: the check itself succeeded


if __name__ == "__main__":
    sys.exit(main())
