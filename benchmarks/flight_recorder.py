"""What the flight recorder costs per collective: this revision against an earlier one, on 2 gloo ranks.

Each rank imports two copies of the communication layer: this checkout's ``fsdpfn.comm`` and the
``fsdpfn/comm`` of ``--before`` (extracted with ``git show`` into a temporary package), both on
the same process group. Blocks of ``--calls`` small synchronous all-reduces alternate between
them (and a bare ``torch.distributed.all_reduce`` with no recorder at all), in an order that
rotates every round; each block gives a time per call, and the table shows the median over
``--rounds`` rounds with the 10-90% range. Two more lines time the recorder alone (its
``record()`` call, no collective), which is all that differs between the two sides. The store is a TCPStore served by rank 0 (what
``torchrun`` uses) unless ``--store file``.

Usage:
  python benchmarks/flight_recorder.py                       # against 737b6ff, 4 floats, TCPStore
  python benchmarks/flight_recorder.py --before HEAD~1 --numel 1024 --store file
"""

from __future__ import annotations

import argparse
import inspect
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fsdpfn import comm  # noqa: E402
from fsdpfn.launch import start_rank  # noqa: E402


def extract(rev: str, folder: str) -> str:
    """``fsdpfn/comm/{_groups,_record,_collectives}.py`` of ``rev`` as the package ``_before_comm``."""
    found = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], capture_output=True
    )
    if found.returncode:
        # A shallow clone, or a copy without .git, lacks the history the comparison reads.
        sys.exit(
            f"flight_recorder: revision {rev!r} is not in this checkout's git history; in a shallow clone run "
            "`git fetch --unshallow` first, or pass --before with a revision the checkout has"
        )
    pkg = os.path.join(folder, "_before_comm")
    os.makedirs(pkg)
    for name in ("_groups", "_record", "_collectives"):
        src = subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:fsdpfn/comm/{name}.py"], check=True, capture_output=True, text=True
        ).stdout
        src = re.sub(r"\bfsdpfn\.comm\b", "_before_comm", src)
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(src)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("")
    return folder


def _rank(rank, world, init, folder, numel, calls, rounds, out):
    start_rank(rank, world, init, timeout_s=60)
    sys.path.insert(0, folder)
    from _before_comm import _collectives as before  # noqa: PLC0415

    x = torch.ones(numel)
    sides = {
        "bare dist.all_reduce": lambda: dist.all_reduce(x),
        "before": lambda: before.all_reduce(x),
        "after": lambda: comm.all_reduce(x),
    }
    for fn in sides.values():  # warm-up: first calls, the recorder's one-time set-up
        for _ in range(50):
            fn()
    names = list(sides)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % 3 :] + names[: r % 3]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                sides[n]()
            times[n].append((time.perf_counter() - t) / calls)
    # The recorder alone, no collective: what differs between the two sides on every call.
    ranks, gid = comm._record.group_info(None)
    # record() took the store as its last argument up to 737b6ff and a group id since: call the
    # one --before has with what it takes.
    takes_store = list(inspect.signature(before.record).parameters)[-1] == "store"
    last = before._groups.store() if takes_store else before._record.group_info(None)[1]
    alone = {
        "before: record()": lambda: before.record(
            "all_reduce", world, 4 * numel, x.dtype, "", list(ranks) if takes_store else ranks, last
        ),
        "after: record()": lambda: comm._record.record("all_reduce", world, 4 * numel, x.dtype, "", ranks, gid),
    }
    for name, fn in alone.items():
        for _ in range(50):
            fn()
        times[name] = []
    for r in range(rounds):
        for name, fn in alone.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    dist.barrier()
    out.put((rank, times))
    comm.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--before",
        default="737b6ff",
        help="git revision to compare with (default: the last one whose "
        "recorder wrote to the store on every collective)",
    )
    ap.add_argument("--numel", type=int, default=4, help="floats per all-reduce")
    ap.add_argument("--calls", type=int, default=200, help="all-reduces per timed block")
    ap.add_argument("--rounds", type=int, default=40, help="blocks per side")
    ap.add_argument("--store", default="tcp", choices=["tcp", "file"])
    args = ap.parse_args()
    world = 2
    with tempfile.TemporaryDirectory(prefix="fsdpfn_bench_") as tmp:
        folder = extract(args.before, os.path.join(tmp, "pkg"))
        if args.store == "tcp":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        else:
            init = f"file://{os.path.join(tmp, 'store')}"
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, world, init, folder, args.numel, args.calls, args.rounds, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = {}
        while len(results) < world:  # a rank that dies (its traceback above) ends the run instead of a silent wait
            try:
                rank, times = out.get(timeout=1.0)
                results[rank] = times
            except queue.Empty:
                dead = [
                    (r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results
                ]
                if dead:
                    for p in procs:
                        p.kill()
                    sys.exit(
                        f"flight_recorder: rank {dead[0][0]} exited with code {dead[0][1]} before reporting; see its "
                        "traceback above"
                    )
        for p in procs:
            p.join()
    print(
        f"{args.calls} x all_reduce of {args.numel} float32 per block, {args.rounds} rounds, 2 gloo ranks, "
        f"{args.store} store; before = {args.before}"
    )
    print(f"{'per call':24} {'rank 0 median (10-90%)':>30} {'rank 1 median':>14}   overhead over bare (rank 0)")
    bare = statistics.median(results[0]["bare dist.all_reduce"])
    for name in results[0]:
        t0 = sorted(results[0][name])
        lo, hi = t0[len(t0) // 10], t0[(9 * len(t0)) // 10]
        med0, med1 = statistics.median(t0), statistics.median(results[1][name])
        extra = "" if name.startswith("bare") or "record" in name else f"   {1e6 * (med0 - bare):+.1f} us"
        print(f"{name:24} {1e6 * med0:9.1f} us ({1e6 * lo:6.1f}-{1e6 * hi:6.1f}) {1e6 * med1:11.1f} us{extra}")


if __name__ == "__main__":
    main()
