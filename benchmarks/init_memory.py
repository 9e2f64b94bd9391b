"""Peak resident memory per rank when a model starts training: today's full-model path against
meta-device initialisation and safetensors loading.

A GPT-style model of at least 1 GiB in fp32 on 4 gloo ranks (one thread each), zero3. Three
ways to get every rank its shards, each in a fresh launch:

  (a) full         every rank builds the whole model, then ``fsdpfn.shard`` keeps its rows
                   (what ``examples/train_gpt.py --init full`` does)
  (b) meta         the model is built on the meta device, ``fsdpfn.init_shards`` creates one
                   parameter at a time and keeps this rank's rows
  (c) safetensors  the model is built on the meta device, ``fsdpfn.load_safetensors`` reads this
                   rank's rows of a checkpoint in the HF index layout (one file per unit,
                   written beforehand by another launch, not measured)

On every rank: the baseline is the resident set right before the step (imports, process group,
mesh, meta model and plan done); the peak is the high-water mark from there (``VmHWM`` after
resetting it with ``/proc/self/clear_refs``; the process's lifetime ``ru_maxrss`` is printed
beside it). The theory is baseline + this rank's shards + one unit (the largest, in full).

Usage:
  python benchmarks/init_memory.py                              # 1.44 GiB model, 4 ranks, ~2 min
  python benchmarks/init_memory.py --width 512 --depth 2        # smoke run
  python benchmarks/init_memory.py --modes meta,safetensors     # skip the full-model launch

Before each launch the script estimates what the ranks will hold together and refuses to start
if that exceeds 80% of ``MemAvailable`` (pass a smaller ``--width``/``--depth``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdpfn  # noqa: E402
from fsdpfn import comm  # noqa: E402
from fsdpfn.launch import launch  # noqa: E402
from fsdpfn.models import GPT, GPTConfig  # noqa: E402

MIB = 2**20
MODES = ("full", "meta", "safetensors")
LABELS = {
    "full": "(a) full model, then fsdpfn.shard",
    "meta": "(b) meta + fsdpfn.init_shards",
    "safetensors": "(c) meta + fsdpfn.load_safetensors",
}
BASELINE_GUESS = 400 * MIB  # torch + gloo, for the safety estimate only


# ---------------------------------------------------------------------------------------------
# Resident memory of this process (Linux /proc)
# ---------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Resets VmHWM to the current VmRSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------------
# The model, the checkpoint, one measured launch
# ---------------------------------------------------------------------------------------------


def make_config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, width=args.width, depth=args.depth, heads=args.heads, bias=False
    )


def _meta_model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def write_checkpoint(rank: int, world: int, cfg: GPTConfig, directory: str) -> int:
    """One safetensors file per unit plus ``model.safetensors.index.json`` (the layout of HF's
    ``save_pretrained``), holding one unit in memory at a time."""
    from safetensors.torch import save_file

    plan = fsdpfn.plan(_meta_model(cfg), (1,))
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, unit in enumerate(plan.units):
        name = f"model-{i + 1:05d}-of-{len(plan.units):05d}.safetensors"
        tensors = {p.name: torch.randn(p.shape, generator=gen).mul_(0.02) for p in unit.params}
        save_file(tensors, os.path.join(directory, name))
        weight_map.update({n: name for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def measure(rank: int, world: int, mode: str, cfg: GPTConfig, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = _meta_model(cfg)
    plan = fsdpfn.plan(model, mesh, strategy="zero3")  # the same plan as of the full model
    comm.barrier()
    baseline = _status("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    if mode == "full":
        torch.manual_seed(0)
        full = GPT(cfg)
        params = fsdpfn.shard(full, plan)
        full.to("meta")  # train_gpt keeps only a skeleton
        del full
    elif mode == "meta":
        params = fsdpfn.init_shards(model, plan, seed=0)
    else:
        params = fsdpfn.load_safetensors(model, plan, directory)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shards = sum(p.to_local().numel() * p.to_local().element_size() for p in params.values())
    unit = max(u.numel for u in plan.units) * 4
    comm.barrier()
    return dict(
        rank=rank,
        baseline=baseline,
        peak=peak,
        lifetime=lifetime,
        shards=shards,
        unit=unit,
        theory=baseline + shards + unit,
        seconds=seconds,
        reset=reset,
    )


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _estimate(mode: str, model_bytes: int, unit_bytes: int, world: int) -> int:
    """What ``world`` ranks hold together at their peak, generously."""
    shards = model_bytes // world
    per_rank = BASELINE_GUESS + shards + (model_bytes + 2 * unit_bytes if mode == "full" else 2 * unit_bytes)
    return world * per_rank


def _check_room(what: str, need: int) -> None:
    room = int(0.8 * _mem_available())
    if need > room:
        sys.exit(
            f"{what} needs about {need / 2**30:.1f} GiB; 80% of MemAvailable is {room / 2**30:.1f} GiB. "
            "Pass a smaller --width or --depth (or free memory) and run again."
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temporary directory, removed after)"
    )
    p.add_argument("--json", default=None, help="also write the per-rank figures here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    cfg = make_config(args)
    plan = fsdpfn.plan(_meta_model(cfg), (args.world_size,), strategy="zero3")
    model_bytes = sum(u.numel for u in plan.units) * 4
    unit_bytes = max(u.numel for u in plan.units) * 4
    print(
        f"GPT width {cfg.width}, depth {cfg.depth}, vocabulary {cfg.vocab_size}: {model_bytes / 4 / 1e6:.0f}M parameters, "
        f"{model_bytes / 2**30:.2f} GiB fp32; largest unit {unit_bytes / MIB:.0f} MiB; "
        f"{args.world_size} gloo ranks, zero3, one thread each",
        flush=True,
    )

    directory = args.dir or tempfile.mkdtemp(prefix="fsdpfn_init_memory_")
    os.makedirs(directory, exist_ok=True)
    results: dict[str, list[dict]] = {}
    try:
        if "safetensors" in modes:
            _check_room("writing the checkpoint", BASELINE_GUESS + 3 * unit_bytes)
            t0 = time.perf_counter()
            written = launch(write_checkpoint, 1, cfg, directory)[0]
            print(
                f"checkpoint: {written / 2**30:.2f} GiB in {len(plan.units)} files in {directory} "
                f"({time.perf_counter() - t0:.0f} s, not measured)",
                flush=True,
            )
        for mode in modes:
            _check_room(
                f"mode {mode!r} on {args.world_size} ranks", _estimate(mode, model_bytes, unit_bytes, args.world_size)
            )
            results[mode] = launch(measure, args.world_size, mode, cfg, directory)
            worst = max(r["peak"] / r["theory"] for r in results[mode])
            print(f"  {mode}: done, worst peak/theory {worst:.2f}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    _report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)


def _report(results: dict[str, list[dict]]) -> None:
    full = {r["rank"]: r["peak"] for r in results.get("full", [])}
    head = (
        "way to get the shards",
        "peak RSS/rank (max)",
        "baseline",
        "shards + unit",
        "theory",
        "peak / theory (worst rank)",
        "peak / (a) (worst rank)",
        "lifetime maxrss",
        "time",
    )
    rows = [head]
    for mode, ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak"])
        vs_full = (
            f"{max(r['peak'] / full[r['rank']] for r in ranks):.2f}x"
            if full and mode != "full"
            else "1"
            if mode == "full"
            else "-"
        )
        rows.append(
            (
                LABELS[mode],
                f"{worst['peak'] / MIB:,.0f} MiB",
                f"{worst['baseline'] / MIB:,.0f} MiB",
                f"{(worst['shards'] + worst['unit']) / MIB:,.0f} MiB",
                f"{worst['theory'] / MIB:,.0f} MiB",
                f"{max(r['peak'] / r['theory'] for r in ranks):.2f}x",
                vs_full,
                f"{max(r['lifetime'] for r in ranks) / MIB:,.0f} MiB",
                f"{max(r['seconds'] for r in ranks):.1f} s",
            )
        )
    print()
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "|".join("---" for _ in rows[0]) + "|")
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")
    if not all(r["reset"] for ranks in results.values() for r in ranks):
        print("(/proc/self/clear_refs not writable here: peaks are lifetime ru_maxrss)")


if __name__ == "__main__":
    main()
