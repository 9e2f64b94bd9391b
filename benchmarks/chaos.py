"""Chaos: the fault-tolerant demo under random faults sent from outside, by pid.

Runs ``examples/train_gpt.py --ft`` (2 replica groups of 2 gloo ranks, a tiny model, asynchronous
checkpoints) against a lighthouse in a process of its own, for a fixed number of steps, and sends
``--faults`` faults at random times (seeded), the way a cluster delivers them:

- ``kill``: SIGKILL of a random rank of a random replica group;
- ``stop``: SIGSTOP of a random rank, SIGCONT after a random 0.5 s to 2 x ``--ft-timeout``;
- ``save``: SIGKILL of a random rank of a group just after it logged a step that saves a
  checkpoint (its asynchronous write is then in flight);
- ``lighthouse``: the lighthouse killed and started again on the same port.

The ranks' pids come from the line each rank prints at its start (``ft: replica group R, rank K:
pid N``). Then it reports:

- job losses: the job did not finish every step (target 0);
- steps lost against the run without a fault: attempts that were not committed, plus steps
  trained again after every group was lost and the job resumed from its checkpoints;
- the longest stall of the survivors after a fault (a replica group that was training and was
  not the one hit: the longest time it committed no step), against ``--ft-timeout`` + 5 s;
- that every checkpoint the groups committed verifies (sizes and SHA-256 against the manifest);
- that the final parameters (each finished group's last checkpoint) equal, bitwise, a replay of
  the demo's training over the replica groups alive at each step (read from the groups' logs).

Usage:
  python benchmarks/chaos.py                            # 20 faults, about 15 min on 2 busy CPU cores
  python benchmarks/chaos.py --faults 3 --steps 120     # a short one
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = [
    "--width",
    "16",
    "--depth",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--sample-chars",
    "0",
    "--no-progress",
    "--ckpt-async",
    "--optimizer",
    "adamw",
    "--adamw-lr",
    "1e-2",
    "--warmup",
    "2",
]
PID_LINE = re.compile(r"ft: replica group (\d+), rank (\d+): pid (\d+)")
STEP_LINE = re.compile(r"\[replica group (\d+)\] step (\d+)/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LighthouseProcess:
    """torchft's lighthouse in a process of its own, on a fixed port, so that it can be killed
    and started again where the replica groups look for it."""

    def __init__(self, port: int, env: dict):
        self.port, self.env, self.proc = port, env, None
        self.address = f"http://{socket.gethostname()}:{port}"

    def start(self) -> None:
        code = (
            "import time\nfrom fsdpfn.comm import Lighthouse\n"
            f"l = Lighthouse(min_replicas=1, bind='[::]:{self.port}', join_timeout_s=1.0, heartbeat_timeout_s=2.0)\n"
            "print('lighthouse up', flush=True)\nwhile True: time.sleep(60)\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # up: the port is bound

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Job:
    """The demo job, its output read line by line: the ranks' pids, each group's last step."""

    def __init__(self, out: str, args, lighthouse: str, env: dict, quiet: bool = True):
        cmd = [
            sys.executable,
            DEMO,
            "--world-size",
            "4",
            "--replicas",
            "2",
            "--ft",
            "--out",
            out,
            "--lighthouse",
            lighthouse,
            "--ft-timeout",
            str(args.ft_timeout),
            "--ft-restarts",
            "1000",
            "--steps",
            str(args.steps),
            "--ckpt-every",
            str(args.ckpt_every),
            "--keep",
            "1000",
            "--step-delay",
            str(args.step_delay),
            *TINY,
        ]
        self.out, self.quiet = out, quiet
        self.pids: dict[tuple[int, int], int] = {}
        self.saves: list[tuple[float, int]] = []  # (time, group) of a step that saves a checkpoint
        self.lines: list[str] = []
        self.ckpt_every = args.ckpt_every
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "[INFO]" in line or "GET /checkpoint" in line:
                continue
            self.lines.append(f"{time.time() - self.t0:7.1f} {line.rstrip()}")
            # finditer: the lines of several processes can share one line of the pipe
            for m in PID_LINE.finditer(line):
                self.pids[(int(m[1]), int(m[2]))] = int(m[3])
            for m in STEP_LINE.finditer(line):
                if int(m[2]) % self.ckpt_every == 0:
                    self.saves.append((time.time(), int(m[1])))

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, seconds: float) -> int:
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its groups die with it
            self.proc.wait()
            return -9

    def log(self, group: int) -> list[dict]:
        try:
            with open(os.path.join(self.out, f"replica{group}", "ft.jsonl")) as f:
                return [dict(json.loads(line), group=group) for line in f if line.strip()]
        except FileNotFoundError:
            return []


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (or stopped) process, not one gone or a zombie: a fault sent
    to a rank of a group that is being restarted would hit nothing, and must not count."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def send_faults(job: Job, lighthouse: LighthouseProcess, args, rng: random.Random) -> list[dict]:
    """The faults, at random times while the job runs; returns what was sent, when, to whom."""
    sent: list[dict] = []
    kinds = ["kill", "stop", "save", "lighthouse"]
    weights = [4, 3, 2, 1]
    while job.running() and len(sent) < args.faults:
        time.sleep(rng.uniform(args.gap / 2, args.gap * 1.5))
        if not job.running() or len(job.pids) < 4:
            continue
        kind = rng.choices(kinds, weights)[0]
        group, rank = rng.randrange(2), rng.randrange(2)
        fault = {"kind": kind, "group": group, "rank": rank}
        if kind == "lighthouse":
            fault["time"] = time.time()
            lighthouse.kill()
            lighthouse.start()
            fault.update(group=None, rank=None)
        elif kind == "save":
            seen = len(job.saves)
            deadline = time.time() + 30
            while len(job.saves) == seen and job.running() and time.time() < deadline:
                time.sleep(0.005)
            if len(job.saves) == seen:
                continue
            group = job.saves[-1][1]
            fault.update(group=group, time=time.time(), pid=job.pids[(group, rank)])
            if not (_alive(fault["pid"]) and _signal(fault["pid"], signal.SIGKILL)):
                continue  # that group is being restarted: nothing to hit
        else:
            fault.update(time=time.time(), pid=job.pids[(group, rank)])
            if not _alive(fault["pid"]):
                continue  # that group is being restarted: nothing to hit
            if kind == "kill":
                if not _signal(fault["pid"], signal.SIGKILL):
                    continue
            elif _signal(fault["pid"], signal.SIGSTOP):
                fault["held_s"] = rng.uniform(0.5, 2 * args.ft_timeout)
                time.sleep(fault["held_s"])
                _signal(fault["pid"], signal.SIGCONT)
            else:
                continue
        sent.append(fault)
        if not job.quiet:
            print(
                f"  fault {len(sent)}: {kind} {fault.get('group')}:{fault.get('rank')} at "
                f"{fault['time'] - job.t0:.1f} s",
                flush=True,
            )
    return sent


def lineage(entries: list[dict], steps: int, cluster_s: float = 5.0) -> tuple[list[set], int]:
    """The replica groups whose gradients each step of the final run averaged, and how many
    step commits the final run does not contain (steps trained again: after every group was
    lost and the groups resumed from their checkpoints, or a group's commits that a peer further
    on replaced at a quorum).

    The final run is walked back from its last step: the commit of step s it contains is the
    latest one made before the commit of step s + 1 it contains (a later commit of s belongs to a
    run that was then replaced); the groups of that commit are those of its ``replicas``
    (commits of one step by the groups of one quorum come within ``cluster_s`` of each other)."""
    by_step: dict[int, list[dict]] = {}
    for e in entries:
        if e["committed"]:
            by_step.setdefault(e["step"], []).append(e)
    lives: list[set] = [set()] * steps
    later = float("inf")
    for s in reversed(range(steps)):
        commits = [e for e in by_step.get(s, []) if e["time"] < later]
        if not commits:
            raise AssertionError(f"step {s} was never committed before step {s + 1}")
        last = max(commits, key=lambda e: e["time"])
        final = [e for e in commits if last["time"] - e["time"] <= cluster_s]
        lives[s] = {0, 1} if any(e["replicas"] == 2 for e in final) else {e["group"] for e in final}
        later = min(e["time"] for e in final)
    kept = sum(len(x) for x in lives)
    again = sum(len(v) for v in by_step.values()) - kept
    return lives, max(again, 0)


def stalls(entries: list[dict], faults: list[dict], horizon_s: float = 120.0) -> list[float]:
    """Per fault on a replica group: how long the other group, training when the fault came (a
    commit in the 3 s before), then committed nothing: the longest time between the fault and
    its commits after it, up to the next fault that hits that group itself or the lighthouse
    (its own restart is not a stall caused by this fault). ``nan`` where it was not training,
    or was hit again before it committed."""
    out = []
    for i, f in enumerate(faults):
        if f.get("group") is None:
            continue
        other = sorted(e["time"] for e in entries if e["committed"] and e["group"] != f["group"])
        end = min(
            [g["time"] for g in faults[i + 1 :] if g.get("group") in (None, 1 - f["group"])] + [f["time"] + horizon_s]
        )
        before = [t for t in other if f["time"] - 3.0 <= t <= f["time"]]
        after = [t for t in other if f["time"] < t <= end]
        if not before or not after:
            out.append(float("nan"))
            continue
        window = [f["time"], *after]
        out.append(max(b - a for a, b in zip(window, window[1:])))
    return out


def verify_checkpoints(out: str) -> tuple[int, list[str]]:
    """Every committed checkpoint of every group: its files against its manifest (sizes and
    SHA-256). Returns how many and the failures."""
    from fsdpfn.checkpoint import _atomic, _manifest

    bad, n = [], 0
    for ckpt in sorted(glob.glob(os.path.join(out, "replica*", "ckpt", "step_*"))):
        n += 1
        try:
            info = _atomic.check_complete(ckpt)
            _manifest.verify(ckpt, info, info.get("files") or ())
        except Exception as e:  # noqa: BLE001 - reported
            bad.append(f"{ckpt}: {e}")
    return n, bad


def _demo():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_chaos", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def replay(rank: int, world: int, lives: list[set], steps: int, ckpts: list[str]) -> list[bool]:
    """On a 2-rank pool: the demo's training where step s averages the gradients of the groups
    ``lives[s]`` on their own batches (the local shards summed, divided by their number, as
    fsdpfn.ft does); whether each of ``ckpts`` equals the final state bitwise."""
    import optree
    import torch
    from torch.distributed.tensor import DTensor

    from fsdpfn import checkpoint, comm, optim

    demo = _demo()
    args = demo.parse_args(
        [
            "--world-size",
            str(2 * world),
            "--replicas",
            "2",
            "--ft",
            "--replica-group",
            "0",
            "--lighthouse",
            "unused",
            "--steps",
            str(steps),
            *TINY,
        ]
    )
    job, state = demo.setup(rank, world, args)
    loss_fn = demo.make_loss(demo.make_forward(job.model, job.plan, args))
    grad = torch.func.grad(lambda p, x, y: loss_fn(p, x, y))
    for step, live in enumerate(lives):
        grads = []
        for r in sorted(live):
            x, y = demo.get_batch(
                job.train_data, step, job.data_rank + r * job.plan.dp_size, args.batch_size, args.seq_len, args.seed
            )
            grads.append(grad(state["params"], x, y))
        mean = {}
        for k, g in grads[0].items():
            local = g.to_local().clone()
            for other in grads[1:]:
                local += other[k].to_local()
            local /= len(live)
            mean[k] = DTensor.from_local(
                local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
            )
        updates, opt_state = job.opt.update(mean, state["opt_state"], state["params"])
        state = {"params": optim.apply_updates(state["params"], updates), "opt_state": opt_state, "step": step + 1}
    same = []
    for ckpt in ckpts:
        got = checkpoint.load(ckpt, state, job.plan)
        pairs = zip(*(optree.tree_leaves(s, none_is_leaf=True) for s in (got, state)))
        ok = all(
            torch.equal(a.to_local(), b.to_local())
            if isinstance(a, DTensor)
            else torch.equal(a, b)
            if isinstance(a, torch.Tensor)
            else a == b
            for a, b in pairs
        )
        flag = torch.tensor([1.0 if ok else 0.0])
        comm.all_reduce(flag)  # equal on every rank's shards
        same.append(flag.item() == world)
    return same


def run_once(args, faults: int, seed: int, where: str, env: dict) -> dict:
    """One job, with ``faults`` faults (0: the run without a fault); its figures."""
    rng = random.Random(seed)
    lighthouse = LighthouseProcess(_free_port(), env)
    lighthouse.start()
    out = os.path.join(where, f"faults{faults}")
    t0 = time.time()
    job = Job(out, args, lighthouse.address, env)
    try:
        args_f = argparse.Namespace(**{**vars(args), "faults": faults})
        sent = send_faults(job, lighthouse, args_f, rng)
        code = job.wait(args.job_timeout)
    finally:
        lighthouse.kill()
    wall = time.time() - t0
    with open(os.path.join(where, f"output{faults}.txt"), "w") as f:
        f.write("\n".join(job.lines))
    entries = job.log(0) + job.log(1)
    finished = [g for g in (0, 1) if os.path.exists(os.path.join(out, f"replica{g}", "model.pt"))]
    row = {
        "run": "chaos" if faults else "no fault",
        "faults": len(sent),
        "kinds": {k: sum(f["kind"] == k for f in sent) for k in ("kill", "stop", "save", "lighthouse")},
        "exit": code,
        "wall_s": wall,
        "lost_job": code != 0 or not finished,
        "sent": sent,
    }
    row["uncommitted"] = sum(not e["committed"] for e in entries)
    try:
        lives, again = lineage(entries, args.steps)
    except AssertionError as e:
        row.update(again=None, replay_equal=None, lives=None, error=str(e))
        lives = None
    else:
        row.update(again=again, lives=[sorted(x) for x in lives])
    gaps = stalls(entries, sent)
    row["stall_max_s"] = max((g for g in gaps if g == g), default=0.0)
    row["stalls"] = gaps
    row["checkpoints"], row["bad_checkpoints"] = verify_checkpoints(out)
    if lives is not None and finished:
        from fsdpfn import testing

        finals = [os.path.join(out, f"replica{g}", "ckpt") for g in finished]
        row["replay_equal"] = all(testing.run_on_ranks(replay, 2, lives, args.steps, finals, timeout=3600)[0])
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--steps", type=int, default=600, help="training steps of the job")
    p.add_argument("--step-delay", type=float, default=0.3, help="seconds each group sleeps after a step")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ft-timeout", type=float, default=5.0)
    p.add_argument("--gap", type=float, default=12.0, help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the run without a fault")
    p.add_argument("--job-timeout", type=float, default=3600.0)
    p.add_argument("--keep", default=None, help="keep the runs' directories here (default: a temporary one, removed)")
    args = p.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TORCHFT_LIGHTHOUSE", None)
    where = args.keep or tempfile.mkdtemp(prefix="fsdpfn_chaos_")
    os.makedirs(where, exist_ok=True)
    print(
        f"chaos: the demo with --ft, 2 replica groups of 2 ranks, {args.steps} steps, checkpoints every "
        f"{args.ckpt_every} (async), --ft-timeout {args.ft_timeout:g}; {args.faults} faults, seed {args.seed}; "
        f"runs in {where}",
        flush=True,
    )
    rows = []
    if not args.no_baseline:
        rows.append(run_once(args, 0, args.seed, where, env))
    rows.append(run_once(args, args.faults, args.seed, where, env))
    with open(os.path.join(where, "chaos.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    limit = args.ft_timeout + 5
    print(
        f"\n{'run':<10} {'faults':>6} {'kill/stop/save/lh':>17} {'job lost':>8} {'wall s':>7} {'uncommitted':>11} "
        f"{'steps again':>11} {'max stall s':>11} {'ckpts ok':>9} {'replay ==':>9}"
    )
    for row in rows:
        k = row["kinds"]
        print(
            f"{row['run']:<10} {row['faults']:>6} "
            f"{k['kill']:>5}/{k['stop']}/{k['save']}/{k['lighthouse']:<5} {'yes' if row['lost_job'] else 'no':>8} "
            f"{row['wall_s']:>7.0f} {row['uncommitted']:>11} {str(row['again']):>11} {row['stall_max_s']:>11.1f} "
            f"{row['checkpoints'] - len(row['bad_checkpoints'])}/{row['checkpoints']:<4} {str(row.get('replay_equal')):>9}"
        )
    chaos = rows[-1]
    print(
        f"\nlongest survivor stall {chaos['stall_max_s']:.1f} s against --ft-timeout + 5 s = {limit:g} s: "
        f"{'within' if chaos['stall_max_s'] <= limit else 'OVER'}"
    )
    for path in chaos["bad_checkpoints"]:
        print("checkpoint that does not verify:", path)
    if not args.keep:
        import shutil

        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
