"""The GPU check (benchmarks/gpu_check.py, docs/gpu.md) without a GPU: its dry run says "skipped:
no CUDA" for every step and installs nothing; its flags, its orchestration (statuses, time
limits cut to the budget, a step stopped at its limit keeping what it measured) and its
comparison code, fed with recorded numbers, are checked here. What it measures needs a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fsdpfn import sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
g = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = g
_spec.loader.exec_module(g)

ALL = [s.name for s in g.STEPS]


def test_the_dry_run_says_skipped_no_cuda_for_every_step(tmp_path):
    out = tmp_path / "out"
    # CUDA hidden: on a GPU machine too this is the dry run, never the real check.
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert files == ["log.txt", "summary.json", "summary.md"] and len(files) <= g.MAX_FILES
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ALL
    assert all(s["status"] == "skipped" and s["reason"] == "skipped: no CUDA" for s in summary["steps"]), summary[
        "steps"
    ]
    assert summary["counts"]["skipped"] == len(ALL) and summary["ok"] and summary["cuda"] is False
    assert summary["versions"]["torch"] and summary["versions"]["fsdpfn"]  # the install step still says what is there
    md = (out / "summary.md").read_text()
    for name in ALL:
        assert f"| {name} | skipped | 0 / " in md and md.count("skipped: no CUDA") == len(ALL)
    assert proc.stdout.count("skipped: no CUDA") == len(ALL)


def test_the_shell_script_asks_for_out():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "set OUT to the directory the results go to" in proc.stderr


def test_arguments(monkeypatch, capsys):
    a = g.parse_args(["--out", "/tmp/x", "--steps", "sim_kernels, demo,install"])
    assert a.steps == ["install", "demo", "sim_kernels"] and a.budget == g.BUDGET_S and a.out == "/tmp/x"
    monkeypatch.setenv("OUT", "/tmp/from-env")
    assert g.parse_args([]).out == "/tmp/from-env" and g.parse_args([]).steps == ALL
    with pytest.raises(SystemExit):
        g.parse_args(["--steps", "demo,warp_drive"])
    assert "unknown step(s) ['warp_drive']; the steps are install, cuda_tests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        g.parse_args(["--budget", "-5"])
    assert "must be a positive number of seconds, got '-5'" in capsys.readouterr().err
    monkeypatch.delenv("OUT")
    with pytest.raises(SystemExit):
        g.parse_args([])
    assert "pass --out DIR or set $OUT" in capsys.readouterr().err
    assert g.parse_args(["--list"]).list and g.main(["--list"]) == 0
    assert f"budget: {g.BUDGET_S:.0f} s in all" in capsys.readouterr().out


def test_the_steps_fit_ten_minutes_and_come_in_order_of_value():
    assert (
        ALL[:2] == ["install", "cuda_tests"]
        and ALL.index("demo") < ALL.index("sim_kernels") < ALL.index("te") == len(ALL) - 1
    )
    assert g.BUDGET_S + 20 <= 590 <= 600  # the shell script's outer limit, inside 10 minutes
    assert set(g.STEP_FUNCS) == set(ALL)


def test_orchestration_statuses_and_the_budget(tmp_path, monkeypatch):
    clock = [0.0]
    # (seconds it takes, exit status, what it writes): a pass, a failure with its reason, one
    # stopped at its limit after recording a figure, one killed before it (out of memory), one
    # that dies before writing anything.
    plan = {
        "install": (10, 0, dict(status="passed", reason="", results=dict(versions=dict(torch="2.x")))),
        "cuda_tests": (10, 0, dict(status="failed", reason="every CUDA test passed (tests/x.py::t)", results={})),
        "streams": (
            70,
            124,
            dict(status="failed", reason="it stopped before its end", results=dict(trace_summary={"overlap_us": 3.0})),
        ),
        "reshard_memory": (5, 137, None),
        "offload": (20, 1, None),
    }
    limits = {}

    def fake_run(cmd, limit, log):
        name = cmd[cmd.index("--run-step") + 1]
        seconds, rc, result = plan[name]
        limits[name] = limit
        if result is not None:
            with open(cmd[cmd.index("--result") + 1], "w") as f:
                json.dump(result, f)
        clock[0] += seconds
        return rc, float(seconds)

    monkeypatch.setattr(g, "_has_cuda", lambda: True)
    monkeypatch.setattr(g, "_run_limited", fake_run)
    monkeypatch.setattr(g, "_now", lambda: clock[0])
    summary = g.orchestrate(g.parse_args(["--out", str(tmp_path), "--budget", "120"]))
    by = {s["name"]: s for s in summary["steps"]}
    assert [by[n]["status"] for n in ALL[:5]] == ["passed", "failed", "timed out", "failed", "failed"]
    assert by["cuda_tests"]["reason"] == "every CUDA test passed (tests/x.py::t)"
    assert by["streams"]["reason"] == "stopped at its limit of 70 s; it had finished: trace_summary"
    assert by["streams"]["results"]["trace_summary"]["overlap_us"] == 3.0
    assert by["reshard_memory"]["reason"] == "killed after 5 s (SIGKILL: out of host memory?)"
    assert by["offload"]["reason"] == "exit status 1 before it wrote a result: see log.txt"
    assert limits["offload"] == 25 and by["offload"]["limit_s"] == 25  # 120 s budget, 95 s spent
    assert all(
        by[n]["status"] == "did not run" and "(120 s) was spent" in by[n]["reason"] for n in ALL[5:]
    )  # 5 s left < 15
    assert (
        summary["counts"] == {"passed": 1, "failed": 3, "timed out": 1, "did not run": 6, "skipped": 0}
        and not summary["ok"]
    )
    assert summary["versions"] == {"torch": "2.x"}
    md = (tmp_path / "summary.md").read_text()
    assert "| streams | timed out | 70 / 70 s | stopped at its limit of 70 s; it had finished: trace_summary |" in md


def test_a_step_that_raises_fails_with_the_reason_and_one_that_cannot_run_says_why(tmp_path, monkeypatch):
    def boom(ctx):
        ctx.record("first", 1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setitem(g.STEP_FUNCS, "streams", boom)
    monkeypatch.setitem(g.STEP_FUNCS, "te", lambda ctx: "Transformer Engine is not installed")
    g.run_step("streams", str(tmp_path / "s.json"), str(tmp_path))
    g.run_step("te", str(tmp_path / "t.json"), str(tmp_path))
    s, t = json.loads((tmp_path / "s.json").read_text()), json.loads((tmp_path / "t.json").read_text())
    assert s == dict(
        status="failed",
        reason="RuntimeError: CUDA error: an illegal memory access was encountered more",
        results=dict(first=1),
    )
    assert t["status"] == "did not run" and t["reason"] == "Transformer Engine is not installed"


def test_checks_that_do_not_hold_fail_the_step_naming_them(tmp_path, monkeypatch):
    def step(ctx):
        ctx.check("loss fell", True)
        ctx.check("overlap", False, "0 us of 120 us")

    monkeypatch.setitem(g.STEP_FUNCS, "streams", step)
    g.run_step("streams", str(tmp_path / "s.json"), str(tmp_path))
    s = json.loads((tmp_path / "s.json").read_text())
    assert (
        s["status"] == "failed"
        and s["reason"] == "overlap (0 us of 120 us)"
        and s["results"]["checks"] == {"loss fell": True, "overlap": False}
    )


# ---- the comparison code, fed with recorded numbers ------------------------------------------


def test_matmul_rows_beside_the_h100_shape_table():
    rows = g.matmul_rows(
        [("square", 8192, 8192, 8192, "bfloat16", 1.5e-3), ("8B wk/wv", 8192, 1024, 4096, "bfloat16", 1.0e-4)],
        sim.H100_SXM,
    )
    assert rows[0]["measured_tflops"] == 733.0 and rows[0]["preset_tflops"] == 807.7 and rows[0]["ratio"] == 0.908
    # (8192, 1024, 4096) is a point of the table: 750.6 TFLOP/s; 2 * 8192 * 1024 * 4096 FLOPs in 0.1 ms is 687.2
    assert rows[1]["preset_tflops"] == 750.6 and rows[1]["measured_tflops"] == 687.2 and rows[1]["ratio"] == 0.916


def test_attention_rows_reproduce_the_published_rate_the_preset_is_built_from():
    # FlashAttention-2 on H100 at batch 2 x 8,192 tokens, 16 heads of 128: forward 1.935 ms, backward 4.788 ms.
    [r] = g.attention_rows([(2, 16, 8192, 128, 1.935e-3, 4.788e-3)], sim.H100_SXM)
    assert abs(r["preset_s"] - 6.723e-3) / 6.723e-3 < 0.005 and r["ratio"] == 1.0
    # the profile's FLOPs: forward + backward = 3 forwards of 2 b h s^2 d (causal)
    assert r["measured_tflops"] == round(3 * 2 * 2 * 16 * 8192**2 * 128 / 6.723e-3 / 1e12, 1)
    # shorter sequences: lower intensity, a lower preset rate (the ramp), for the same kernel
    [short] = g.attention_rows([(16, 16, 1024, 128, 1e-3, 2e-3)], sim.H100_SXM)
    assert short["preset_tflops"] < r["preset_tflops"]
    with pytest.raises(ValueError, match=r"part must be one of \['bwd', 'fwd', 'fwd\+bwd'\], got 'both'"):
        g.attention_work(1, 1, 1024, 128, "both")


def test_memory_rows_beside_the_preset_stream_rate():
    [r] = g.memory_rows([("add", 3 * 2**28, 2.5e-4)], sim.H100_SXM)
    rate = sim.H100_SXM.kernels.memory_efficiency * sim.H100_SXM.memory_bandwidth
    assert r["measured_gbs"] == round(3 * 2**28 / 2.5e-4 / 1e9, 1) and r["preset_gbs"] == round(rate / 1e9, 1)
    assert r["ratio"] == round(3 * 2**28 / 2.5e-4 / rate, 3)


def test_stream_overlap_of_a_recorded_trace():
    def kernel(stream, ts, dur, name="k", cat="kernel"):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=dict(stream=stream))

    events = [
        kernel(7, 0, 100, "sm90_gemm"),
        kernel(7, 150, 100, "sm90_gemm"),
        kernel(7, 240, 30, "elementwise"),
        kernel(20, 50, 110, "CatArrayBatchedCopy"),
        kernel(20, 90, 20, "CatArrayBatchedCopy"),  # nested: counted once
        kernel(24, 300, 40, "Memcpy DtoH", cat="gpu_memcpy"),
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=500, args={}),
        dict(ph="i", name="marker", ts=5),
    ]
    s = g.stream_overlap(events)
    assert s["compute_stream"] == 7 and sorted(s["streams"]) == [7, 20, 24]
    assert s["streams"][20] == dict(events=2, busy_us=110.0, overlap_with_compute_us=60.0, top=["CatArrayBatchedCopy"])
    assert (
        s["streams"][24]["overlap_with_compute_us"] == 0.0 and s["streams"][7]["busy_us"] == 220.0
    )  # 0-100 and 150-270
    assert s["overlap_us"] == 60.0 and s["other_busy_us"] == 150.0
    assert g.stream_overlap([])["compute_stream"] is None


def test_demo_summary_of_recorded_metrics():
    rows = [
        dict(step=s, loss=loss, elapsed_s=e, tokens_per_s=t)
        for s, loss, e, t in [
            (5, 4.1, 3.0, 900.0),
            (10, 3.2, 3.1, 9000.0),
            (15, 2.9, 3.2, 9100.0),
            (20, 2.7, 3.35, 8000.0),
        ]
    ]
    d = g.demo_summary(rows, 20)
    assert (
        d["step_s"] == 0.02 and d["steps_done"] == 20 and d["loss_fell"] and d["tokens_per_s"] == 8000.0
    )  # median of 20, 20, 30 ms
    assert d["loss_curve"] == [[5, 4.1], [10, 3.2], [15, 2.9], [20, 2.7]]
    assert g.demo_summary([], 100) == dict(
        steps_done=0, loss_curve=[], step_s=None, loss_first=None, loss_last=None, loss_fell=False
    )


def test_the_cuda_tests_are_found():
    ids = g.cuda_tests()
    assert "tests/test_runtime.py::test_cuda_comm_orders_streams" in ids
    assert (
        "tests/test_fp8_gather.py::test_te_handoff_gives_te_mxfp8_tensors_with_our_bytes" in ids
    )  # a marker that needs CUDA
    assert (
        "tests/test_fp8_gather.py::test_te_backend_fails_fast_without_te_or_without_the_recipe" in ids
    )  # a CUDA branch
    # skipped where CUDA is present, not where it is missing
    assert not any("test_train_gpt.py" in i or "test_guards_muon.py" in i for i in ids), ids
    assert not any(
        "test_docs_commands.py" in i for i in ids
    )  # its CUDA branch is a flag's value: the demo step runs it


def test_the_summaries(tmp_path):
    with pytest.raises(ValueError, match=r"step 'demo' has status 'ok'; a status is one of \('passed', 'failed'"):
        g.summarize([dict(name="demo", status="ok")], {})
    steps = [
        dict(
            name="sim_kernels",
            status="passed",
            reason="",
            seconds=41.2,
            limit_s=90,
            results=dict(
                matmul=[dict(label="8B w2", measured_tflops=701.5, preset_tflops=783.2, ratio=0.896)], note="bf16"
            ),
        )
    ]
    md = g.markdown(g.summarize(steps, dict(device="NVIDIA H100 80GB HBM3", torch="2.13.0")))
    assert md.startswith("# GPU check: NVIDIA H100 80GB HBM3\n") and "| sim_kernels | passed | 41.2 / 90 s |  |" in md
    assert (
        "| label | measured_tflops | preset_tflops | ratio |\n|---|---|---|---|\n| 8B w2 | 701.5 | 783.2 | 0.896 |"
        in md
    )
    assert "- note: bf16" in md


def test_the_docstring_examples_run():
    import doctest

    result = doctest.testmod(g, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15 and result.failed == 0, result
