"""A lost replica does not stop the job (fsdpfn.ft, on torchft), tested for real on gloo.

Two replica groups of 2 ranks each (HSDP replicate=2 x shard=2), each a job of its own started
as ``python examples/ft_replicas.py`` (fresh processes, as a user's job would be), with a
lighthouse in this process. Rank 1 of replica 1 kills (SIGKILL) or stops (SIGSTOP) itself in
step FAULT, after its backward and before the replicas' all-reduce. Replica 0 must finish the
step without it and keep training; replica 1, started again, must rejoin with replica 0's state.

Reference: every loss is compared with a replay of the same training on one 2-rank group (a
persistent test pool) that, at every step, computes the gradient of each replica alive in that
step on that replica's batches and averages them as the job does: the ranks' shards
concatenated, summed, divided by the number of replicas. The replay with both replicas at every
step is the run without a fault. Tolerance: none (bitwise). Each replica's gradient is the same
computation on the same 2-rank shard group as in the job; the sum of two replicas is one IEEE
addition per element, which is commutative, so gloo's all-reduce and the replay's ``a + b`` give
the same bits; dividing by 1 or 2 is exact or the same rounding; the optimizer then sees equal
inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fsdpfn import testing

pytest.importorskip("torchft", reason="fsdpfn.ft runs on torchft: pip install 'fsdpfn[ft]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ft_replicas.py")
SHARD = 2
STEPS = 12
FAULT = 3
REJOIN = 6  # replica 0 holds before this step until the restarted replica 1 is up
TIMEOUT = 5.0


def _example():
    spec = importlib.util.spec_from_file_location("ft_replicas", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay(rank, world, lives):
    """Losses ``[{replica: this rank's loss}]`` of training where step s averages the replicas
    ``lives[s]`` (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    from fsdpfn import optim

    ex = _example()
    model, plan, params, opt, state = ex.build(world)
    f = ex.loss_fn(model, plan)
    out = []
    for step, live in enumerate(lives):
        grads, losses = [], {}
        for r in sorted(live):
            x, y = ex.batch(r, rank, step)
            g, loss = torch.func.grad_and_value(f)(params, x, y)
            grads.append(g)
            losses[r] = loss.item()
        mean = {}
        for k, g in grads[0].items():
            total = g.to_local().clone()
            for other in grads[1:]:
                total += other[k].to_local()
            total /= len(live)
            mean[k] = DTensor.from_local(
                total, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
            )
        updates, state = opt.update(mean, state, params)
        params = optim.apply_updates(params, updates)
        out.append(losses)
    return out


def _read(prefix: str, rank: int) -> list[dict]:
    path = f"{prefix}.{rank}"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class _Job:
    def __init__(self, tmp, how: str):
        import fsdpfn.ft

        self.tmp, self.how = str(tmp), how
        self.lighthouse = fsdpfn.ft.Lighthouse(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=2.0)
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start(self, replica: int, run: str, *extra: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            EXAMPLE,
            "--lighthouse",
            self.lighthouse.address,
            "--replica",
            str(replica),
            "--shard",
            str(SHARD),
            "--steps",
            str(STEPS),
            "--timeout",
            str(TIMEOUT),
            "--log",
            os.path.join(self.tmp, run),
            *extra,
        ]
        with open(os.path.join(self.tmp, run + ".out"), "w") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:  # a failed test leaves no replica running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()

    def output(self, run: str) -> str:
        with open(os.path.join(self.tmp, run + ".out")) as f:
            return "\n".join(line for line in f.read().splitlines() if "[INFO]" not in line)


def _wait(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {seconds:g} s")
        time.sleep(0.05)


def _committed(entries: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for e in entries:
        if e["committed"]:
            assert e["step"] not in out, f"step {e['step']} committed twice"
            out[e["step"]] = e
    return out


@pytest.mark.faults
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_replica_does_not_stop_the_job_and_a_restarted_one_rejoins(tmp_path, how):
    t0 = time.monotonic()
    job = _Job(tmp_path, how)
    try:
        ready = [os.path.join(job.tmp, f"ready{r}") for r in (0, 1)]
        # Replica 0 trains alone from the fault on, and holds before step REJOIN until the restarted
        # replica 1 is up (fresh processes take seconds to tens of seconds on two busy cores), so
        # that the rejoin lands at a known step.
        hold = os.path.join(job.tmp, "hold")
        p0 = job.start(0, "r0", "--ready", ready[0], "--hold-at", str(REJOIN), "--hold-file", hold)
        p1 = job.start(1, "r1", "--ready", ready[1], "--die-at", str(FAULT), "--die-rank", "1", "--how", how)
        # Both replicas heartbeat before either starts: the first quorum holds both.
        _wait(lambda: all(os.path.exists(f"{p}.{k}") for p in ready for k in range(SHARD)), 120, "both replicas up")
        for p in ready:
            open(p + ".go", "w").close()
        p1.wait(timeout=60)
        assert p1.returncode != 0, job.output("r1")
        fault_at = time.monotonic()
        again = os.path.join(job.tmp, "again")
        p1b = job.start(1, "r1b", "--ready", again)  # the restarted replica joins a running job
        _wait(lambda: all(os.path.exists(f"{again}.{k}") for k in range(SHARD)), 120, "replica 1 up again")
        _wait(lambda: len(_committed(_read(os.path.join(job.tmp, "r0"), 0))) >= REJOIN, 60, "replica 0 at the hold")
        open(again + ".go", "w").close()
        open(hold, "w").close()
        p0.wait(timeout=120)
        p1b.wait(timeout=60)
        assert p0.returncode == 0 and p1b.returncode == 0, job.output("r0") + job.output("r1b")
    finally:
        job.close()
    elapsed = time.monotonic() - t0

    r0 = [_read(os.path.join(job.tmp, "r0"), k) for k in range(SHARD)]
    r1 = [_read(os.path.join(job.tmp, "r1"), k) for k in range(SHARD)]
    r1b = [_read(os.path.join(job.tmp, "r1b"), k) for k in range(SHARD)]
    survivor = [_committed(e) for e in r0]
    assert all(sorted(s) == list(range(STEPS)) for s in survivor), "replica 0 must commit every step once"
    # The fault step: replica 0's first attempt was not committed (the all-reduce lost its peer),
    # and it ran again with the one replica alive.
    broken = [e for e in r0[1] if e["step"] == FAULT and not e["committed"]]
    assert broken and broken[0]["error"], r0[1]
    assert all(survivor[k][s]["replicas"] == 2 for k in range(SHARD) for s in range(FAULT))
    assert all(survivor[k][FAULT]["replicas"] == 1 for k in range(SHARD))
    # The restarted replica received replica 0's state at a step boundary, then took part in every step.
    # (at REJOIN, or a step later when replica 0's quorum for REJOIN formed before replica 1 asked)
    rejoin = r1b[0][0]["step"]
    assert REJOIN <= rejoin < STEPS, r1b
    assert all(e[0]["healed"] and e[0]["step"] == rejoin for e in r1b), r1b
    assert all(e["committed"] and e["replicas"] == 2 for k in range(SHARD) for e in r1b[k]), r1b
    lives = [{0, 1}] * FAULT + [{0}] * (rejoin - FAULT) + [{0, 1}] * (STEPS - rejoin)
    assert [survivor[0][s]["replicas"] for s in range(STEPS)] == [len(live) for live in lives]

    replay = testing.run_on_ranks(_replay, SHARD, lives)
    straight = testing.run_on_ranks(_replay, SHARD, [{0, 1}] * STEPS)  # the run without a fault
    for k in range(SHARD):
        for s in range(STEPS):
            assert survivor[k][s]["loss"] == replay[k][s][0], (k, s, survivor[k][s], replay[k][s])
            if s < FAULT:
                assert survivor[k][s]["loss"] == straight[k][s][0], (k, s)
        for s in range(FAULT):  # replica 1 before its fault
            assert _committed(r1[k])[s]["loss"] == replay[k][s][1], (k, s)
        for e in r1b[k]:  # replica 1 after its rejoin
            assert e["loss"] == replay[k][e["step"]][1], (k, e)
    # Not vacuous: without the fault, replica 0 would have trained otherwise.
    assert any(survivor[0][s]["loss"] != straight[0][s][0] for s in range(FAULT + 1, STEPS))
    # Losing the replica cost one step's attempt and the collective timeout at most, not the job.
    assert elapsed < 180, elapsed
    print(f"{how}: rejoined at step {rejoin}, {elapsed:.1f} s, fault at +{fault_at - t0:.1f} s")
