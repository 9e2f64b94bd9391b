"""examples/plan_search.py, the README's rerunnable search: a meta model, a preset or custom
hardware, a budget; the pick fits, is no slower than the default, and is printed with the lines
that build it."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fsdpfn
from fsdpfn import sim

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("plan_search", ROOT / "examples" / "plan_search.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpt_on_a_preset(capsys):
    res = _example().main(
        [
            "--model",
            "gpt",
            "--gpus",
            "4",
            "--seq",
            "64",
            "--global-tokens",
            "1024",
            "--budget-gib",
            "0.25",
            "--optimizer",
            "adamw",
        ]
    )
    out = capsys.readouterr().out
    assert res.result.memory["peak"] <= 0.25 * 2**30
    assert res.result.step_time <= res.default.step_time
    assert (
        "pick:" in out
        and "default: zero3, prefetch 1" in out
        and "rt = fsdpfn.runtime.Runtime(model, plan, prefetch=" in out
    )
    # the printed strategy builds the picked plan
    strategy = {(u.name or "<root>"): u.strategy for u in res.plan.units}
    with torch.device("meta"):
        model = _example().build_model("gpt", 64)
    assert fsdpfn.plan(model, res.plan.mesh_shape, strategy=strategy) == res.plan


def test_custom_hardware_flags_reach_the_search(capsys):
    """Your own numbers instead of a preset (the 8B default search runs as the README's command,
    tests/test_docs_commands.py): a small GPT keeps this to the flags' plumbing."""
    res = _example().main(
        [
            "--model",
            "gpt",
            "--gpus",
            "16",
            "--seq",
            "64",
            "--global-tokens",
            "4096",
            "--prefetch",
            "1",
            "--optimizer",
            "adamw",
            "--flops",
            "700e12",
            "--intra-gbps",
            "300",
            "--inter-gbps",
            "25",
            "--memory-gib",
            "96",
            "--gpus-per-node",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "custom: 700 TFLOP/s, 300/25 GB/s" in out
    assert res.result.hardware.devices_per_node == 4
    assert res.result.memory["peak"] <= 96 * 2**30


def test_bad_flags_name_themselves(capsys):
    with pytest.raises(SystemExit):
        _example().main(["--flops", "1e15"])
    with pytest.raises(SystemExit):
        _example().main(["--gpus", "0"])
    err = capsys.readouterr().err
    assert "--gpus" in err


def test_llama_shapes():
    with torch.device("meta"):
        m = fsdpfn.models.Llama(fsdpfn.models.LLAMA3_70B)
    assert round(sum(p.numel() for p in m.parameters()) / 1e9, 1) == 70.6
    with pytest.raises(ValueError, match="kv_heads"):
        fsdpfn.models.LlamaConfig(dim=64, layers=1, heads=6, kv_heads=4, ffn=128)
    assert isinstance(sim.H100_SXM, sim.Hardware)


@pytest.mark.e2e
def test_help_has_the_whole_description_every_flag_and_each_default_once():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_search.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    # The description whole, as written (its first sentence used to be cut after "a cluster that").
    assert (
        "for a model and a cluster that\nneed not exist here" in text
        and "  python examples/plan_search.py --plot" in text
    )
    assert "(default: None)" not in text and "(default: False)" not in text
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-\S+)", line)
        if m:
            current = m.group(1).split(",")[0]
            blocks[current] = line
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    for action in _example().build_parser()._actions:
        flag = action.option_strings[0]
        assert action.help and action.help.strip(), f"{flag} has no help"
        assert blocks[flag].count("(default") <= 1, blocks[flag]
        if action.default is not None and action.default is not False and flag != "-h":
            assert f"(default: {action.default})" in blocks[flag], blocks[flag]
    assert "(default: the hardware's memory)" in blocks["--budget-gib"]


def test_a_tight_budget_picks_activation_checkpointing_and_the_printed_plan_builds(capsys):
    """Under a budget the plans without checkpointing exceed, the search picks a remat policy;
    the printed ``fsdpfn.plan(...)`` line, evaluated, builds the picked plan."""
    args = [
        "--model",
        "gpt",
        "--gpus",
        "4",
        "--seq",
        "256",
        "--global-tokens",
        "4096",
        "--optimizer",
        "adamw",
        "--prefetch",
        "1",
    ]
    free = _example().main(args + ["--budget-gib", "100", "--remat", "none,save_dots,full"])
    smallest = min(c.peak for c in free.candidates if not c.remat)  # no plan without checkpointing gets below this
    smallest_remat = min(c.peak for c in free.candidates if c.remat)
    assert smallest_remat < smallest
    # Between the two: checkpointing saves the blocks' activations, not the loss's transient
    # memory, so the gap is what the blocks save.
    tight = (smallest + smallest_remat) / 2 / 2**30
    res = _example().main(args + ["--budget-gib", f"{tight}", "--remat", "none,save_dots,full"])
    out = capsys.readouterr().out
    assert res.result.memory["peak"] <= tight * 2**30 < smallest
    assert {u.remat for u in res.plan.units if u.name} != {"none"}
    line = [ln for ln in out.splitlines() if "plan = fsdpfn.plan(" in ln][-1]
    with torch.device("meta"):
        model = _example().build_model("gpt", 256)
    mesh = res.plan.mesh_shape
    assert eval(line.split("=", 1)[1].strip(), {"fsdpfn": fsdpfn, "model": model, "mesh": mesh}) == res.plan
    with pytest.raises(SystemExit):
        _example().main(args + ["--remat", "sometimes"])


def _picked_degree_and_plan(args, axis: str, label: str, model):
    """Runs ``examples/plan_search.py args`` and checks what it prints for the ``axis`` degrees
    given: exit 0, which degree won ("<label>: <axis> N picked among 2, 4"), the pick line, the
    printed mesh's size on ``axis``; returns that degree and the printed ``fsdpfn.plan(...)``
    line built on ``model``."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_search.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(rf"^{label}: {axis} (\d+) picked among 2, 4$", proc.stdout, re.M)
    assert m and int(m.group(1)) in (2, 4), proc.stdout[-3000:]
    degree = int(m.group(1))
    assert re.search(rf"^pick: +mesh \S+ \({axis} {degree}\)", proc.stdout, re.M), proc.stdout[-3000:]
    mesh_line = re.search(r'init_device_mesh\("cuda", (\([^)]*\)), mesh_dim_names=(\([^)]*\))\)', proc.stdout)
    shape, names = eval(mesh_line.group(1)), eval(mesh_line.group(2))
    assert dict(zip(names, shape))[axis] == degree
    line = [ln for ln in proc.stdout.splitlines() if "plan = fsdpfn.plan(" in ln][-1]
    plan = eval(line.split("=", 1)[1].strip(), {"fsdpfn": fsdpfn, "model": model, "mesh": dict(zip(names, shape))})
    return degree, plan


@pytest.mark.e2e
def test_tp_degrees_are_searched_and_the_pick_is_printed():
    """``--tp 2,4``: the script exits 0, prints which degree won (one of those given), and the
    printed ``fsdpfn.plan(...)`` line, with the printed mesh's names, builds the picked tp plan.
    Degrees above 1 only, so that the tp lines of the output are the ones printed."""
    args = [
        "--model",
        "gpt",
        "--gpus",
        "4",
        "--seq",
        "64",
        "--global-tokens",
        "1024",
        "--budget-gib",
        "0.25",
        "--optimizer",
        "adamw",
        "--prefetch",
        "1",
        "--tp",
        "2,4",
    ]
    with torch.device("meta"):
        model = _example().build_model("gpt", 64)
    tp, plan = _picked_degree_and_plan(args, "tp", "tensor parallel", model)
    assert plan.tp_size == tp and plan.world_size == 4


def test_bad_tp_degrees_name_the_flag(capsys):
    for bad in ("3", "x", "0"):
        with pytest.raises(SystemExit):
            _example().main(["--model", "gpt", "--gpus", "4", "--tp", bad])
        assert "--tp" in capsys.readouterr().err


@pytest.mark.e2e
def test_ep_degrees_are_searched_and_the_pick_is_printed():
    """``--experts 4 --ep 2,4``: the script exits 0, prints which degree won (one of those
    given), and the printed ``fsdpfn.plan(...)`` line, with the printed mesh's names, builds
    the picked ep plan. Degrees above 1 only, so that the ep lines of the output are the ones
    printed."""
    # One micro-batch per rank (256 tokens over 4 ranks of 64): the smallest search, as the model
    # with experts is profiled for real.
    args = [
        "--model",
        "gpt",
        "--gpus",
        "4",
        "--seq",
        "64",
        "--global-tokens",
        "256",
        "--budget-gib",
        "0.25",
        "--optimizer",
        "adamw",
        "--prefetch",
        "1",
        "--experts",
        "4",
        "--ep",
        "2,4",
    ]
    ep, plan = _picked_degree_and_plan(args, "ep", "expert parallel", _example().build_model("gpt", 64, 4))
    assert plan.axes.dim(fsdpfn.Role.EP) is not None and plan.world_size == 4
    assert dict(zip(plan.mesh_dim_names, plan.mesh_shape))["ep"] == ep


def test_bad_ep_degrees_name_the_flag(capsys):
    for bad in (
        ["--experts", "4", "--ep", "3"],
        ["--experts", "4", "--ep", "x"],
        ["--ep", "2"],
        ["--experts", "2", "--ep", "4"],
        ["--experts", "4", "--ep", "2", "--tp", "2"],
    ):
        with pytest.raises(SystemExit):
            _example().main(["--model", "gpt", "--gpus", "4", *bad])
        assert "--ep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _example().main(["--model", "8b", "--gpus", "4", "--experts", "4"])
    assert "--experts" in capsys.readouterr().err
