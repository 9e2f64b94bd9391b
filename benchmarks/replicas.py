"""Steps lost to a replica failure: fsdpfn.ft (the job goes on) against a stop-and-restart from
the last checkpoint.

Runs the fault-tolerant HSDP job of ``examples/ft_replicas.py``: 2 replica groups of ``--shard``
gloo ranks each and a lighthouse in this process. Rank 1 of replica 1 kills itself (SIGKILL) in
step ``--fault``, after its backward. Measured:

- the step time (median of replica 0's committed steps before the fault, 2 replicas);
- fsdpfn.ft: the time replica 0 made no progress around the fault (the commit of the fault step
  minus the commit of the step before, minus one step time), in steps;
- a restart: replica 1 started again from nothing (fresh processes, imports, the process group,
  the model) until its first committed step, which includes receiving the state from replica 0.
  A stop-and-restart restarts every replica group like this (concurrently, so this is its
  wall time), loads the checkpoint instead of receiving the state, and then recomputes the steps
  since that checkpoint: on average half the checkpoint interval ``--ckpt-every``.

Usage:
  python benchmarks/replicas.py                        # 2 replica groups of 2 ranks, a minute or two
  python benchmarks/replicas.py --ckpt-every 1000      # against a job that checkpoints every 1000 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ft_replicas.py")


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {seconds:g} s")
        time.sleep(0.02)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--fault", type=int, default=8)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval of the stop-and-restart job, steps")
    args = p.parse_args(argv)
    import fsdpfn.ft

    if not fsdpfn.ft.available():
        raise SystemExit("needs torchft: pip install 'fsdpfn[ft]'")
    hold_at = args.fault + 3
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs: list[subprocess.Popen] = []
    with (
        tempfile.TemporaryDirectory(prefix="fsdpfn_replicas_") as tmp,
        fsdpfn.ft.Lighthouse(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=2.0) as lighthouse,
    ):

        def start(replica: int, run: str, *extra: str) -> subprocess.Popen:
            cmd = [
                sys.executable,
                EXAMPLE,
                "--lighthouse",
                lighthouse.address,
                "--replica",
                str(replica),
                "--shard",
                str(args.shard),
                "--steps",
                str(args.steps),
                "--timeout",
                str(args.timeout),
                "--log",
                os.path.join(tmp, run),
                *extra,
            ]
            with open(os.path.join(tmp, run + ".out"), "w") as out:
                proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            procs.append(proc)
            return proc

        try:
            ready = [os.path.join(tmp, f"ready{r}") for r in (0, 1)]
            hold = os.path.join(tmp, "hold")
            p0 = start(0, "r0", "--ready", ready[0], "--hold-at", str(hold_at), "--hold-file", hold)
            p1 = start(1, "r1", "--ready", ready[1], "--die-at", str(args.fault), "--die-rank", "1")
            _wait(lambda: all(os.path.exists(f"{r}.{k}") for r in ready for k in range(args.shard)), 300, "replicas up")
            for r in ready:
                open(r + ".go", "w").close()
            p1.wait(timeout=300)
            launched = time.time()
            again = os.path.join(tmp, "again")
            p1b = start(1, "r1b", "--ready", again)
            _wait(lambda: all(os.path.exists(f"{again}.{k}") for k in range(args.shard)), 300, "replica 1 up again")
            up = time.time()
            _wait(
                lambda: sum(e["committed"] for e in _read(os.path.join(tmp, "r0.0"))) >= hold_at,
                300,
                "replica 0 at the hold",
            )
            go = time.time()
            open(again + ".go", "w").close()
            open(hold, "w").close()
            p0.wait(timeout=300)
            p1b.wait(timeout=300)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        r0 = _read(os.path.join(tmp, "r0.0"))
        r1b = _read(os.path.join(tmp, "r1b.0"))
    done = {e["step"]: e["time"] for e in r0 if e["committed"]}
    step_s = statistics.median(done[s] - done[s - 1] for s in range(2, args.fault))
    stall = done[args.fault] - done[args.fault - 1] - step_s
    first = r1b[0]
    restart = (up - launched) + (first["time"] - go)
    since_ckpt = args.ckpt_every / 2
    ft_steps = stall / step_s
    restart_steps = restart / step_s + since_ckpt
    print(
        f"step time {step_s * 1e3:.0f} ms (2 replica groups of {args.shard} ranks; median of steps 2-{args.fault - 1})"
    )
    print(
        f"fsdpfn.ft: replica 0 went on alone after {stall:.2f} s = {ft_steps:.1f} steps lost "
        f"(timeout {args.timeout:g} s; replica 1 rejoined at step {first['step']} with the live state)"
    )
    print(
        f"stop-and-restart: {restart:.1f} s to restart a replica group (measured) = {restart / step_s:.1f} steps, "
        f"+ {since_ckpt:g} steps since the checkpoint (every {args.ckpt_every}, on average) = {restart_steps:.1f} steps lost"
    )
    print(f"steps lost, fsdpfn.ft / stop-and-restart: {ft_steps / restart_steps:.3f}x")


if __name__ == "__main__":
    main()
