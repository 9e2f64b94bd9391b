"""The demo job (examples/train_gpt.py --ft) under faults, for real on gloo.

One command, as a user runs it: ``train_gpt.py --ft --world-size 4 --replicas 2`` starts a
lighthouse and two replica groups of 2 ranks (fresh processes), and restarts a group that fails.
``--fault 1:K:STEP:HOW`` makes rank K of replica group 1 stop itself (SIGSTOP) in step STEP after
its backward, or kill itself (SIGKILL) during the background write of the asynchronous
checkpoint saved after step STEP. Each test checks what the issue asks: the other replica group
trains on, the failed one is restarted and rejoins with its state, and the loss curve is what it
would have been with the replica groups alive at each step.

Reference: the losses in each group's ``ft.jsonl`` (the group's mean loss, not rounded) are
compared with a replay of the demo's own training (its ``setup``, optimizer and loss, on a
2-rank test pool) that, at each step, computes the gradient of every replica group alive in
that step on that group's batches and averages them as fsdpfn.ft does: the local shards summed
and divided by the number of groups. The replay with both groups at every step is the run
without a fault; the steps before the fault are compared with it. Tolerance: none (bitwise),
for the reasons of tests/test_ft.py: each group's gradient is the same computation on the same
2-rank shard group, the sum of two is one commutative IEEE addition per element, the division
by 1 or 2 the same rounding, and the optimizer then sees equal inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import optree
import pytest
import torch

from fsdpfn import testing

pytest.importorskip("torchft", reason="fsdpfn.ft runs on torchft: pip install 'fsdpfn[ft]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "train_gpt.py")
GROUP = 2  # ranks per replica group
STEPS = 80
CKPT_EVERY = 4
TIMEOUT = 4.0  # --ft-timeout: a stopped replica group is given up on after this
# Slows the survivors so that the restarted group (fresh interpreters importing torch on two busy
# cores: 10-25 s) finds them still training: STEPS x DELAY leaves it about 20 s after the fault.
DELAY = 0.3
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
    "--steps",
    str(STEPS),
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--sample-chars",
    "0",
    "--no-progress",
    "--ckpt-every",
    str(CKPT_EVERY),
    "--ckpt-async",
    "--keep",
    "2",
    "--optimizer",
    "adamw",
    "--adamw-lr",
    "1e-2",
    "--warmup",
    "2",
]


def _demo():
    spec = importlib.util.spec_from_file_location("train_gpt_ft", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _replay(rank, world, lives, ckpt=None, ckpt_step=None):
    """``([{group: its mean loss}] per step, whether ``ckpt`` (a checkpoint of replica group 1)
    loads and equals, bitwise, the replay's state after ``ckpt_step`` steps)``, for training
    where step s averages the replica groups ``lives[s]`` (see the module docstring)."""
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
            *TINY,
            "--steps",
            str(len(lives)),
        ]
    )  # the lr schedule's horizon
    job, state = demo.setup(rank, world, args)
    loss_fn = demo.make_loss(demo.make_forward(job.model, job.plan, args))
    grad_and_loss = torch.func.grad_and_value(loss_fn)
    base = job.data_rank  # group 0's; group r reads those of the r-th replica
    out, same = [], None
    for step, live in enumerate(lives):
        if step == ckpt_step and ckpt is not None:
            got = checkpoint.load(ckpt, state, job.plan)
            pairs = zip(*(optree.tree_leaves(s, none_is_leaf=True) for s in (got, state)))
            same = all(
                torch.equal(a.to_local(), b.to_local())
                if isinstance(a, DTensor)
                else torch.equal(a, b)
                if isinstance(a, torch.Tensor)
                else a == b
                for a, b in pairs
            )
        grads, losses = [], {}
        for r in sorted(live):
            x, y = demo.get_batch(
                job.train_data, step, base + r * job.plan.dp_size, args.batch_size, args.seq_len, args.seed
            )
            g, loss = grad_and_loss(state["params"], x, y)
            grads.append(g)
            total = loss.detach().clone()
            comm.all_reduce(total)
            losses[r] = total.item() / world
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
        out.append(losses)
    if ckpt is not None and ckpt_step == len(lives):  # the state after the last step
        got = checkpoint.load(ckpt, state, job.plan)
        pairs = zip(*(optree.tree_leaves(s, none_is_leaf=True) for s in (got, state)))
        same = all(
            torch.equal(a.to_local(), b.to_local())
            if isinstance(a, DTensor)
            else torch.equal(a, b)
            if isinstance(a, torch.Tensor)
            else a == b
            for a, b in pairs
        )
    return out, same


class _Run:
    """The demo with ``--ft``, its output read line by line as it comes (``on(pattern, fn)``:
    ``fn(match)`` at the first line matching)."""

    def __init__(self, tmp, fault: str | None, extra: tuple[str, ...] = ()):
        self.out = os.path.join(str(tmp), "run")
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("TORCHFT_LIGHTHOUSE", None)
        cmd = [
            sys.executable,
            DEMO,
            "--world-size",
            str(2 * GROUP),
            "--replicas",
            "2",
            "--ft",
            "--out",
            self.out,
            "--ft-timeout",
            str(TIMEOUT),
            "--step-delay",
            str(DELAY),
            *(["--fault", fault] if fault else []),
            *TINY,
            *extra,
        ]
        self.lines: list[str] = []
        self.hooks: list[tuple[re.Pattern, object]] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def on(self, pattern: str, fn) -> None:
        self.hooks.append((re.compile(pattern), fn))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(f"{time.monotonic() - self.t0:6.1f} {line.rstrip()}")
            for hook in list(self.hooks):
                m = hook[0].search(line)
                if m:
                    self.hooks.remove(hook)
                    hook[1](m)  # type: ignore[operator]

    def wait(self, seconds: float = 400) -> int:
        try:
            code = self.proc.wait(timeout=seconds)
        finally:
            if self.proc.poll() is None:  # a failed test leaves no job running (its groups die with it)
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def text(self) -> str:
        with open(os.path.join(os.path.dirname(self.out), "output.txt"), "w") as f:  # for a failed test
            f.write("\n".join(self.lines))
        return "\n".join(line for line in self.lines if "[INFO]" not in line)

    def log(self, group: int) -> list[dict]:
        with open(os.path.join(self.out, f"replica{group}", "ft.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]


def _committed(entries: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for e in entries:
        if e["committed"]:
            assert e["step"] not in out, f"step {e['step']} committed twice"
            out[e["step"]] = e
    return out


def _check_losses(run: _Run, ckpt=None, ckpt_step=None):
    """Replica group 0 committed every step once; group 1 committed exactly the steps group 0
    averaged over two groups: every step before the fault (the first step group 0 committed
    alone), none from there, and again from a rejoin at a step boundary (with a live group's
    state); every loss equals the replay's. Returns the fault step, the rejoin step and whether
    the checkpoint equals the replay's state (see :func:`_replay`)."""
    text = run.text()
    survivor = _committed(run.log(0))
    assert sorted(survivor) == list(range(STEPS)), text
    lives = [{0, 1} if survivor[s]["replicas"] == 2 else {0} for s in range(STEPS)]
    assert {0} in lives, (lives, text)
    fault_step = lives.index({0})
    group1 = run.log(1)
    healed = [e for e in group1 if e["healed"] and e["step"] > 0]
    assert healed, f"replica group 1 did not rejoin\n{text}"
    rejoin = healed[0]["step"]
    assert fault_step < rejoin < STEPS, (rejoin, lives)
    mine = _committed(group1)
    both = {s for s in range(STEPS) if lives[s] == {0, 1}}
    # A group that dies right after a commit may not live to log it (its log line follows an
    # all-reduce inside the group): that one step may be missing, no other.
    assert set(mine) <= both and both - set(mine) <= {fault_step - 1}, (sorted(mine), lives)
    assert all(e["replicas"] == 2 for e in mine.values())

    replay, same = testing.run_on_ranks(_replay, GROUP, lives, ckpt, ckpt_step)[0]
    straight, _ = testing.run_on_ranks(_replay, GROUP, [{0, 1}] * STEPS)[0]  # the run without a fault
    for s in range(STEPS):
        assert survivor[s]["loss"] == replay[s][0], (s, survivor[s], replay[s])
    for s in range(fault_step):  # before the fault: the run without one, both groups
        assert survivor[s]["loss"] == straight[s][0] and (s not in mine or mine[s]["loss"] == straight[s][1]), s
    for s, e in mine.items():
        assert e["loss"] == replay[s][1], (s, e)
    # Not vacuous: without the fault, group 0 would have trained otherwise.
    assert any(survivor[s]["loss"] != straight[s][0] for s in range(fault_step + 1, STEPS))
    return fault_step, rejoin, same


@pytest.mark.faults
def test_demo_rank_killed_during_an_async_save_keeps_the_previous_checkpoint_and_rejoins(tmp_path):
    """Rank 1 of replica group 1 is killed (SIGKILL) during the background write of the
    checkpoint after step ``fault``, at a random save. Its replica group's previous checkpoint
    stays the latest, verifies and equals the training state of that step bitwise; replica
    group 0 trains on; group 1, restarted, rejoins and trains the job's run to the end."""
    fault = random.choice(range(2 * CKPT_EVERY - 1, 4 * CKPT_EVERY, CKPT_EVERY))  # a save's step: 7, 11 or 15
    print("fault after step", fault)
    run = _Run(tmp_path, f"1:1:{fault}:save")
    ckpt = os.path.join(str(tmp_path), "replica1_ckpt_at_the_kill")

    def copy(_):  # before the restarted group saves anything: what the kill left on disk
        shutil.copytree(os.path.join(run.out, "replica1", "ckpt"), ckpt)

    run.on(r"ft: replica group 1 failed", copy)
    t0 = time.monotonic()
    code = run.wait()
    elapsed = time.monotonic() - t0
    text = run.text()
    assert code == 0, text
    assert "SIGKILL during the background write of the checkpoint after step" in text, text
    assert re.search(r"ft: replica group 1 failed \(exit code 1\); restarting it \(1 of 3\)", text), text
    from fsdpfn import checkpoint

    latest = checkpoint.read_info(ckpt)
    assert latest["values"]["step"] == fault + 1 - CKPT_EVERY, latest["dir"]  # the previous save
    assert any(n.startswith(f".partial-step_{fault + 1:08d}") for n in os.listdir(ckpt)), os.listdir(ckpt)
    # The kill is on the save's background thread: the training thread was in a later step, or
    # between two (then group 0 has no failed attempt: its next quorum just lacks group 1).
    broken, rejoin, same = _check_losses(run, ckpt, fault + 1 - CKPT_EVERY)
    assert broken > fault, run.log(0)
    assert same, "the checkpoint left by the kill does not hold the training state of its step"
    # The restarted group's own later checkpoints are complete, and the debris is gone.
    final = os.path.join(run.out, "replica1", "ckpt")
    assert checkpoint.read_info(final)["values"]["step"] == STEPS
    assert not any(n.startswith(".partial-") for n in os.listdir(final)), os.listdir(final)
    print(f"save kill after step {fault}: broken step {broken}, rejoined at {rejoin}, {elapsed:.1f} s")


@pytest.mark.faults
def test_demo_rank_stopped_mid_step_is_given_up_on_after_the_timeout_and_rejoins(tmp_path):
    """Rank 0 of replica group 1 (the rank that heartbeats for its group) stops itself (SIGSTOP)
    in a random step after its backward. Its group's watchdog ends the group after half of
    --ft-timeout (the stopped rank is killed with the others), replica group 0, whose all-reduce
    then fails, trains on without it, within --ft-timeout + 5 s of the stop; the SIGCONT sent
    then finds the process gone. The group, restarted, rejoins with group 0's state, and nothing
    it did reaches group 0's training: every loss is the replay's."""
    fault = random.randrange(2, 7)
    print("stop in step", fault)
    run = _Run(tmp_path, f"1:0:{fault}:stop")
    pid: list[int] = []
    when: dict[str, float] = {}
    continued: list[bool] = []

    def stopped(m):
        pid.append(int(m.group(1)))
        when["stop"] = time.monotonic()

    def cont(_):
        when["on"] = time.monotonic()
        try:
            os.kill(pid[0], signal.SIGCONT)
            continued.append(True)
        except (ProcessLookupError, IndexError):
            continued.append(False)

    run.on(r"fault injection: replica group 1, rank 0 \(pid (\d+)\): SIGSTOP", stopped)
    run.on(rf"replica replica0: step {fault}: 1 replica group\(s\) alive", cont)
    code = run.wait()
    text = run.text()
    assert code == 0, text
    assert pid and continued, text
    assert re.search(rf"replica replica0: step {fault} was not committed \(", text), text
    assert re.search(
        rf"ft: replica group 1: rank 0 \(pid {pid[0]}\) has been stopped \(SIGSTOP or a debugger\) "
        rf"for {TIMEOUT / 2:g} s; ending the group",
        text,
    ), text
    # Group 0 waited for the watchdog's grace (a stopped peer looks like a slow one until then),
    # and not much more: the lighthouse leaves the killed group out after its heartbeat timeout.
    waited = when["on"] - when["stop"]
    assert TIMEOUT / 2 <= waited <= TIMEOUT + 5, waited
    at, rejoin, _ = _check_losses(run)
    assert at == fault, (at, fault)
    # The stop step's first attempt was not committed on group 0, and ran again without group 1.
    assert any(e["step"] == fault and not e["committed"] and e["error"] for e in run.log(0)), run.log(0)
    restarted = "ft: replica group 1 failed" in text
    print(
        f"stop in step {fault}: group 0 went on after {waited:.1f} s; continued: {continued[0]}; "
        f"group 1 {'restarted and ' if restarted else ''}rejoined at step {rejoin}"
    )


@pytest.mark.faults
def test_demo_survives_a_kill_and_a_stop_of_a_non_zero_rank_between_steps(tmp_path):
    """Chaos, seeded and short, sent from outside by pid as a cluster would: rank 1 of replica
    group 1 (not the rank that heartbeats for its group) is killed (SIGKILL) between two steps;
    once its group, restarted, has rejoined, the new rank 1 is stopped (SIGSTOP) between two
    steps, and continued long after. Each time replica group 0 goes on within --ft-timeout + 5 s
    (the group's watchdog ends the broken group, the lighthouse drops it), the job finishes, and
    group 0's final state equals, bitwise, the replay over the replica groups alive at each step
    (see :func:`_replay`)."""
    rng = random.Random(47)
    steps = 110
    kill_at = rng.randrange(3, 7)
    run = _Run(tmp_path, None, ("--steps", str(steps)))
    pids: dict[tuple[int, int], int] = {}
    when: dict[str, float] = {}

    def pid_line(m):
        pids[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))
        run.on(r"ft: replica group (\d), rank (\d): pid (\d+)", pid_line)  # the restarted group's too

    def kill(_):
        when["kill"] = time.time()
        os.kill(pids[(1, 1)], signal.SIGKILL)

    def rejoined(_):
        run.on(r"\[replica group 1\] step \d+/", stop)  # the next step it logs: between two steps

    def stop(_):
        when["stop"] = time.time()
        pid = pids[(1, 1)]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(3 * TIMEOUT, lambda: _continue(pid)).start()

    run.on(r"ft: replica group (\d), rank (\d): pid (\d+)", pid_line)
    run.on(rf"\[replica group 1\] step {kill_at}/", kill)
    run.on(r"replica replica1: rejoined at step", rejoined)
    code = run.wait(400)
    text = run.text()
    assert code == 0, text
    assert "kill" in when and "stop" in when, f"the faults were not both sent: {when}\n{text}"
    assert re.search(r"ft: replica group 1: rank 1 \(pid \d+\) is gone; ending the group", text), text
    assert re.search(
        r"ft: replica group 1: rank 1 \(pid \d+\) has been stopped \(SIGSTOP or a debugger\) for "
        rf"{TIMEOUT / 2:g} s; ending the group",
        text,
    ), text
    survivor = _committed(run.log(0))
    assert sorted(survivor) == list(range(steps)), text
    times = sorted(e["time"] for e in survivor.values())
    for fault, t in when.items():  # the longest time group 0 committed nothing after the fault
        after = [t] + [x for x in times if t < x < t + 60]
        stall = max(b - a for a, b in zip(after, after[1:]))
        assert stall <= TIMEOUT + 5, (fault, stall, text)
        print(f"{fault}: group 0 went on within {stall:.1f} s")
    lives = [{0, 1} if survivor[s]["replicas"] == 2 else {0} for s in range(steps)]
    assert {0} in lives and lives.count({0, 1}) > kill_at, lives  # not vacuous: both faults left group 0 alone
    final = os.path.join(run.out, "replica0", "ckpt")
    _, same = testing.run_on_ranks(_replay, GROUP, lives, final, steps)[0]
    assert same, "group 0's final state is not the replay's over the groups alive at each step"


@pytest.mark.faults
def test_demo_ft_resume_continues_every_group_from_its_checkpoint(tmp_path):
    """A --ft job stopped at step 4 (as if every group had been lost then: the supervisor too),
    run again with --resume: each replica group loads its own latest checkpoint (step 4), they
    form a quorum again and train to the end. The losses after the resume and the final state
    equal, bitwise, the replay of the run without a stop (both groups at every step)."""
    steps, stop = 8, 4
    flags = ("--steps", str(steps), "--ckpt-every", str(stop))
    first = _Run(tmp_path, None, (*flags, "--stop-at", str(stop)))
    assert first.wait(300) == 0, first.text()
    resumed = _Run(tmp_path, None, (*flags, "--resume"))
    assert resumed.wait(300) == 0, resumed.text()
    text = resumed.text()
    for g in (0, 1):
        assert f"resumed from {os.path.join(resumed.out, f'replica{g}', 'ckpt', 'step_00000004')}" in text, text
    replay, same = testing.run_on_ranks(
        _replay, GROUP, [{0, 1}] * steps, os.path.join(resumed.out, "replica1", "ckpt"), steps
    )[0]
    assert same, "replica group 1's final state is not the replay's"
    for g in (0, 1):
        mine = _committed(resumed.log(g))
        assert sorted(mine) == list(range(steps)), (g, sorted(mine))  # the first run's steps, then the resumed ones
        assert all(mine[s]["loss"] == replay[s][g] and mine[s]["replicas"] == 2 for s in range(steps)), (g, mine)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # the watchdog killed it, as it should
        pass


# ---- what needs no ranks: the demo's refusals and the supervisor's restarts ----------------------


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--ft"], "--ft needs --replicas >= 2"),
        (["--ft", "--replicas", "2", "--world-size", "4", "--experts", "4", "--ep", "2"], "--ft with --ep 2"),
        (["--fault", "1:0:3:kill"], "--fault needs --ft"),
        (["--replica-group", "0"], "--replica-group needs --ft"),
        (
            ["--ft", "--replicas", "2", "--world-size", "4", "--replica-group", "2", "--lighthouse", "x"],
            "--replica-group 2 must be in [0, --replicas 2)",
        ),
        (["--ft", "--replicas", "2", "--world-size", "4", "--fault", "1:0:3"], "expected R:K:STEP:HOW"),
        (["--ft", "--replicas", "2", "--world-size", "4", "--fault", "1:2:3:kill"], "do not exist"),
        (["--ft", "--replicas", "2", "--world-size", "4", "--fault", "1:0:3:save"], "needs --ckpt-async"),
    ],
)
def test_demo_refuses_bad_ft_flags_before_any_rank_starts(flags, says, capsys, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(SystemExit) as e:
        _demo().parse_args(flags)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def _fake_group(script: str) -> str:
    """A replica group's stand-in: says it is up (as start_together does), then runs ``script``
    (which sees ``R``, this group, ``N``, its restarts, and, for the stand-ins to order their
    events, ``mark(name)`` and ``wait_for(name)`` on files in ``$FAKE_DIR``)."""
    return (
        "import os, sys, time\n"
        "R, N = int(sys.argv[1]), int(os.environ['FSDPFN_FT_RESTARTS'])\n"
        "D = os.environ.get('FAKE_DIR', '')\n"
        "mark = lambda name: open(os.path.join(D, name), 'w').close()\n"
        "def wait_for(name):\n"
        "    while not os.path.exists(os.path.join(D, name)): time.sleep(0.01)\n"
        "d = os.environ.get('FSDPFN_FT_START')\n"
        "if d:\n"
        "    open(os.path.join(d, f'up.{R}'), 'w').close()\n"
        "    while not os.path.exists(os.path.join(d, 'go')): time.sleep(0.01)\n" + script
    )


@pytest.mark.parametrize(
    "script, code, lines",
    [
        # group 1 fails on its first start only: restarted once, the job finishes
        (
            "time.sleep(1.5 if R == 0 else 0.2)\nsys.exit(1 if (R, N) == (1, 0) else 0)",
            0,
            ["ft: replica group 1 failed (exit code 1); restarting it (1 of 2)"],
        ),
        # group 1 always fails: restarted twice, then left out while group 0 finishes (after it:
        # once a group finished the job, a failed one is not restarted)
        (
            "if R == 1 and N == 2: mark('last')\nif R == 0: wait_for('last'); time.sleep(0.5)\n"
            "sys.exit(1 if R == 1 else 0)",
            1,
            ["restarting it (2 of 2)", "ft: replica group 1 failed (exit code 1) after 2 restart(s); left out"],
        ),
        # group 1 is killed, restarted, and finds no one to rejoin: neither finished nor failed
        (
            "time.sleep(1.5 if R == 0 else 0.2)\nif (R, N) == (1, 0): os.kill(os.getpid(), 9)\nsys.exit(75 if R == 1 else 0)",
            0,
            [
                "failed (killed by SIGKILL); restarting it",
                "ft: replica group 1 was restarted, but no live replica group",
            ],
        ),
    ],
)
@pytest.mark.e2e
def test_run_replica_groups_restarts_a_failed_group_while_another_trains(script, code, lines, tmp_path):
    import fsdpfn.ft

    said: list[str] = []
    got = fsdpfn.ft.run_replica_groups(
        lambda r, address: [sys.executable, "-c", _fake_group(script), str(r)],
        2,
        lighthouse="unused",
        max_restarts=2,
        echo=said.append,
        env={**os.environ, "FAKE_DIR": str(tmp_path)},
    )
    assert got == code, said
    for line in lines:
        assert any(line in s for s in said), (line, said)


def test_run_replica_groups_refuses_fewer_than_two_groups():
    import fsdpfn.ft

    with pytest.raises(ValueError, match="replicas must be an int >= 2"):
        fsdpfn.ft.run_replica_groups(lambda r, a: ["true"], 1, lighthouse="unused")


@pytest.mark.parametrize(
    "script, code, lines",
    [
        # group 1 fails, is restarted and has nothing to rejoin; then group 0 fails too, every group
        # is lost: it is restarted all the same (with checkpoints it resumes from its latest)
        (
            "if (R, N) == (1, 1): mark('idle'); sys.exit(75)\nif (R, N) == (0, 0): wait_for('idle'); time.sleep(0.5)\n"
            "sys.exit(1 if N == 0 else 0)",
            0,
            ["no other replica group is training: it resumes from its latest verified checkpoint"],
        ),
        # group 1 fails after group 0 finished the job: not restarted, and the job is done
        (
            "if R == 1:\n    while not os.path.exists(os.environ['FSDPFN_FT_FINISHED']): time.sleep(0.01)\n"
            "sys.exit(0 if R == 0 else 1)",
            0,
            ["ft: replica group 1 failed (exit code 1) after replica group(s) [0] finished the job: not restarted"],
        ),
        # group 1's process stops itself: killed after the grace, restarted, it finishes
        (
            "if (R, N) == (1, 0): os.kill(os.getpid(), 19)\nif R == 1: mark('back')\nif R == 0: wait_for('back')\n",
            0,
            [
                "ft: replica group 1's process",
                "has been stopped (SIGSTOP) for 0.5 s: killing it",
                "ft: replica group 1 failed (killed by SIGKILL); restarting it (1 of 2)",
            ],
        ),
    ],
)
@pytest.mark.e2e
def test_run_replica_groups_outlives_every_group_and_a_stopped_one(script, code, lines, tmp_path):
    import fsdpfn.ft

    said: list[str] = []
    got = fsdpfn.ft.run_replica_groups(
        lambda r, address: [sys.executable, "-c", _fake_group(script), str(r)],
        2,
        lighthouse="unused",
        max_restarts=2,
        echo=said.append,
        restart_alone=True,
        stop_grace_s=0.5,
        env={**os.environ, "FAKE_DIR": str(tmp_path)},
    )
    assert got == code, said
    for line in lines:
        assert any(line in s for s in said), (line, said)


@pytest.mark.e2e
def test_job_finished_tells_a_restarted_group_that_the_job_is_done(tmp_path):
    """Group 1 fails and is restarted while group 0 trains; group 0 then finishes the job. The
    restarted group 1, alone, reads job_finished() (True only once group 0 finished) and exits
    with NOTHING_TO_REJOIN, as the demo's groups do: the job is done, nothing was left out."""
    import fsdpfn.ft

    script = (
        "import importlib.util\n"  # the module by its path: a stand-in need not import torch
        "spec = importlib.util.spec_from_file_location('sup', os.environ['SUPERVISOR'])\n"
        "sup = importlib.util.module_from_spec(spec); spec.loader.exec_module(sup)\n"
        "if (R, N) == (1, 0): sys.exit(1)\n"
        "if R == 0: wait_for('restarted'); sys.exit(0)\n"
        "before = sup.job_finished(); mark('restarted')\n"
        "while not sup.job_finished(): time.sleep(0.01)\n"
        "sys.exit(75 if not before else 3)\n"
    )
    said: list[str] = []
    supervisor = os.path.join(ROOT, "fsdpfn", "_ft_supervisor.py")
    got = fsdpfn.ft.run_replica_groups(
        lambda r, address: [sys.executable, "-c", _fake_group(script), str(r)],
        2,
        lighthouse="unused",
        max_restarts=2,
        echo=said.append,
        env={**os.environ, "FAKE_DIR": str(tmp_path), "SUPERVISOR": supervisor},
    )
    assert got == 0, said
    assert said[-2:] == [
        "ft: replica group 1 was restarted, but no live replica group was left to rejoin",
        "ft: replica group(s) [0] finished; [1] did not",
    ], said


_FAKE_RANK = (
    "import os, sys, time\n"
    "open(os.path.join(os.environ['FSDPFN_FT_WATCH'], 'rank' + sys.argv[1]), 'w').write(str(os.getpid()))\n"
    "time.sleep(float(sys.argv[2]))\n"
    "if sys.argv[3] == 'done': open(os.path.join(os.environ['FSDPFN_FT_WATCH'], 'done' + sys.argv[1]), 'w').close()\n"
)


def _fake_ranks(watch, lives: list[tuple[float, str]]) -> list[subprocess.Popen]:
    procs = [
        subprocess.Popen([sys.executable, "-c", _FAKE_RANK, str(k), str(t), how]) for k, (t, how) in enumerate(lives)
    ]
    deadline = time.monotonic() + 30
    while len(watch._pids()) < len(procs) and time.monotonic() < deadline:  # every rank registered
        time.sleep(0.01)
    return procs


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["kill", "stop", "exit"])
def test_watch_ranks_ends_the_group_when_any_rank_dies_or_stops(fault):
    """Rank 1 of a 3-rank group is killed, stopped, or exits without saying it ended well: the
    watchdog says which (rank and pid) and kills the other ranks (SIGKILL) at once, or after the
    grace for a stopped one; not before it."""
    import fsdpfn.ft

    said: list[str] = []
    grace = 1.0
    with fsdpfn.ft.watch_ranks(1, 3, stop_grace_s=grace, echo=said.append) as watch:
        procs = _fake_ranks(watch, [(60, ""), (0.2 if fault == "exit" else 60, ""), (60, "")])
        try:
            t0 = time.monotonic()
            if fault == "kill":
                procs[1].kill()
            elif fault == "stop":
                procs[1].send_signal(signal.SIGSTOP)
            codes = [p.wait(timeout=30) for p in procs]
            waited = time.monotonic() - t0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert codes[0] == codes[2] == -signal.SIGKILL, codes
    why = {"kill": "is gone", "exit": "is gone", "stop": f"has been stopped (SIGSTOP or a debugger) for {grace:g} s"}[
        fault
    ]
    assert said == [
        f"ft: replica group 1: rank 1 (pid {procs[1].pid}) {why}; ending the group so that the other "
        "replica groups go on without it (the supervisor restarts it)"
    ], said
    assert watch.reason == said[0]
    if fault == "stop":
        assert grace <= waited < grace + 5, waited
    else:
        assert waited < 5, waited


@pytest.mark.e2e
def test_watch_ranks_lets_ranks_that_ended_well_go():
    """Ranks that said they ended well (rank_done) exit one after the other: nothing is killed."""
    import fsdpfn.ft

    said: list[str] = []
    with fsdpfn.ft.watch_ranks(0, 2, stop_grace_s=0.5, echo=said.append) as watch:
        procs = _fake_ranks(watch, [(0.1, "done"), (1.5, "done")])
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0] and said == [] and watch.reason is None, (codes, said)


def test_rank_up_says_its_pid_and_registers_with_the_watchdog(tmp_path, monkeypatch):
    import fsdpfn.ft

    monkeypatch.setenv("FSDPFN_FT_WATCH", str(tmp_path))
    said: list[str] = []
    line = fsdpfn.ft.rank_up(3, 1, echo=said.append)
    assert said == [line] == [f"ft: replica group 3, rank 1: pid {os.getpid()}"]
    assert (tmp_path / "rank1").read_text() == str(os.getpid())
    fsdpfn.ft.rank_done(1)
    assert (tmp_path / "done1").exists()
