"""Does every way of starting a job exit 0 after it succeeded? Launches a small 2-rank job N times
each way and counts the runs whose exit code is not 0 (0 is required).

The ways: ``spawn`` (the script's own ``torch.multiprocessing.spawn``, each rank ending with
``fsdpfn.launch.shutdown()``), ``launch`` (``fsdpfn.launch.launch`` spawning the ranks), ``torchrun``
(``fsdpfn.launch.launch`` inside ``torchrun``, the script ending with ``shutdown()``) and ``testing``
(``fsdpfn.testing.run_on_ranks``' worker pool, stopped at exit). The job ends with torch's own
collectives (``DTensor.full_tensor()``, ``dist.all_reduce``), the case that aborted: see
[Note: a clean exit] in ``fsdpfn.launch``. ``--no-shutdown`` runs the same job ending with a plain
``destroy_process_group()`` instead (the ``spawn`` and ``torchrun`` ways), to measure the abort rate
without the fix.

  python benchmarks/exit_stress.py                      # 30 runs each way
  python benchmarks/exit_stress.py -n 5 --ways spawn torchrun
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("spawn", "launch", "torchrun", "testing")


def job(rank: int, world_size: int) -> float:
    """One runtime step of a tiny GPT, then torch's own collectives last."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fsdpfn
    from fsdpfn import testing
    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, testing.mesh((world_size,)))
    params = fsdpfn.shard(model, plan)
    rt = fsdpfn.runtime.Runtime(model, plan)
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
    grads, loss = rt.value_and_grad(
        lambda ps: F.cross_entropy(rt.apply(ps, x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    )(params)
    total = sum(g.full_tensor().sum() for g in grads.values())  # DTensor: torch's functional collectives
    t = torch.tensor([float(loss)])
    for _ in range(20):
        dist.all_reduce(t)  # torch's own collective last
    return float(total) + t.item()


def _spawned(rank: int, world_size: int, init: str, clean: bool) -> None:
    import torch.distributed as dist

    from fsdpfn import comm
    from fsdpfn.launch import shutdown

    comm.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    job(rank, world_size)
    if clean:
        shutdown()
    else:
        dist.destroy_process_group()


def _run_job(way: str, clean: bool) -> None:
    """One job, the way named (this process is the job's launcher or, under torchrun, a rank)."""
    import tempfile

    import torch.multiprocessing as mp

    from fsdpfn.launch import launch, shutdown

    if way == "spawn":
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(2, f"file://{tmp}/store", clean), nprocs=2)
    elif way in ("launch", "torchrun"):
        if way == "torchrun" and not clean:
            import torch.distributed as dist

            from fsdpfn import comm

            comm.init_process_group("gloo")
            job(comm.rank(), comm.world_size())
            dist.destroy_process_group()
            return
        print(launch(job, 2))
        shutdown()
    elif way == "testing":
        from fsdpfn.testing import run_on_ranks

        print(run_on_ranks(job, 2))  # the pool stops at exit (atexit), each worker with shutdown()


def _command(way: str, clean: bool, port: int) -> list[str]:
    me = [os.path.abspath(__file__), "--job", way] + ([] if clean else ["--no-shutdown"])
    if way == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)] + me
    return [sys.executable] + me


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=30, help="runs per way (default 30)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument(
        "--no-shutdown", action="store_true", help="end with destroy_process_group() only (spawn, torchrun)"
    )
    parser.add_argument("--job", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        sys.path.insert(0, ROOT)
        _run_job(args.job, not args.no_shutdown)
        return
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    print("command:", " ".join([sys.executable] + sys.argv), flush=True)
    bad_total = 0
    for way in args.ways:
        bad, codes, start = 0, {}, time.monotonic()
        for i in range(args.n):
            cmd = _command(way, not args.no_shutdown, 29500 + (os.getpid() + i) % 400)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            codes[proc.returncode] = codes.get(proc.returncode, 0) + 1
            print(f"  {way} run {i + 1}: exit code {proc.returncode}", flush=True)
            if proc.returncode != 0:
                bad += 1
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                print(f"    {' | '.join(tail)[:300]}", flush=True)
        bad_total += bad
        print(
            f"{way:9s} {bad} non-zero exit(s) in {args.n} runs  (exit codes {codes}, {time.monotonic() - start:.0f} s)",
            flush=True,
        )
    print(f"non-zero exits: {bad_total}")
    sys.exit(1 if bad_total else 0)


if __name__ == "__main__":
    main()
