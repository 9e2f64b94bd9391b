"""The launching process's side of a fault-tolerant job: keep every replica group running.

[Note: supervising replica groups]
:class:`fsdpfn.ft.ReplicaGroup` lets the live replica groups go on without a lost one and takes
a restarted one back; something has to do the restarting. :func:`run_replica_groups` is that
something for a job on one host (what torchelastic's agent or a cluster scheduler does on many):
it starts a lighthouse (unless given one), starts each replica group as a process of its own (a
command, e.g. the demo with ``--replica-group I``), and when one exits with an error while
another still trains, starts it again with the same command. The restarted group asks for a
quorum like any other and receives the live state at a step boundary.

Two things the replica groups read from their environment:

- ``FSDPFN_FT_START``: a directory, on the first start only. :func:`start_together` makes every
  replica group wait there until all of them are up, so that the first quorum holds them all
  (otherwise the first group up would train alone until the next one arrives, and the run
  without a fault would depend on start-up times);
- ``FSDPFN_FT_RESTARTS``: how many times this replica group was restarted (:func:`restarts`),
  e.g. so that an injected fault is not injected again;
- ``FSDPFN_FT_FINISHED``: a path that exists once a replica group finished the job
  (:func:`job_finished`): a restarted group alone in its first quorum then has nothing to do,
  rather than training the end of the job again from its checkpoint.

[Note: liveness per rank]
torchft knows a replica group by its rank 0 alone: that rank's manager server heartbeats to the
lighthouse, and it answers a quorum only once every rank of its group asked. So a group whose
rank 0 is healthy but whose rank 1 died or stopped keeps heartbeating and never joins the quorum;
the lighthouse counts it as alive, and with two groups it forms no quorum from the other one
alone (it needs more than half of those heartbeating): the whole job waits, and fails when its
quorum times out. :class:`watch_ranks` closes that gap on the host that started the group's ranks:
each rank registers its pid at its start (:func:`rank_up`) and says when it ended well
(:func:`rank_done`); a watchdog thread in the group's launching process ends the whole group
(SIGKILL to every rank) as soon as a rank is gone without having ended well, or has been stopped
(SIGSTOP, ``T`` in ``/proc``) for ``stop_grace_s``. With its rank 0 gone the group stops
heartbeating and the lighthouse leaves it out of the next quorum after its heartbeat timeout; the
supervisor restarts it and it rejoins. :func:`run_replica_groups` does the same for a group's
launching process itself (stopped for ``stop_grace_s``: killed, its ranks die with it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Sequence

__all__ = [
    "NOTHING_TO_REJOIN",
    "job_finished",
    "mark_finished",
    "rank_done",
    "rank_up",
    "restarts",
    "run_replica_groups",
    "start_together",
    "watch_ranks",
]

START_ENV = "FSDPFN_FT_START"
RESTARTS_ENV = "FSDPFN_FT_RESTARTS"
FINISHED_ENV = "FSDPFN_FT_FINISHED"
WATCH_ENV = "FSDPFN_FT_WATCH"  # the directory where a replica group's ranks register (watch_ranks)
# The exit status of a restarted replica group that found no live one to rejoin (EX_TEMPFAIL):
# not a failure to restart again, and not a group that finished the job.
NOTHING_TO_REJOIN = 75


def restarts() -> int:
    """How many times the supervisor restarted this replica group (0 on its first start, and
    outside :func:`run_replica_groups`).

    Example:
      >>> fsdpfn.ft.restarts()
      0
    """
    return int(os.environ.get(RESTARTS_ENV, "0"))


def job_finished() -> bool:
    """Whether a replica group of this job has finished it (under :func:`run_replica_groups`;
    elsewhere ``False``): a group restarted after that, alone, has nothing left to do.

    Example:
      >>> fsdpfn.ft.job_finished()   # no supervisor
      False
    """
    where = os.environ.get(FINISHED_ENV)
    return where is not None and where != "" and os.path.exists(where)


def mark_finished() -> None:
    """Says that this replica group has trained the job's last step (under
    :func:`run_replica_groups`; elsewhere nothing): call it before leaving the quorum
    (:meth:`~fsdpfn.ft.ReplicaGroup.shutdown`), so that a group restarting meanwhile, alone in
    its first quorum once this one left, knows there is nothing left to train
    (:func:`job_finished`).

    Example:
      >>> fsdpfn.ft.mark_finished()   # no supervisor: nothing to tell
    """
    where = os.environ.get(FINISHED_ENV)
    if where:
        open(where, "w").close()


def start_together(replica: int, *, timeout: float = 600.0) -> None:
    """On a first start under :func:`run_replica_groups`: says this replica group is up and
    waits until every replica group is, so that the first quorum holds them all. Every rank of
    the group calls it, after creating its :class:`~fsdpfn.ft.ReplicaGroup` (so that the group
    heartbeats) and before its first step. Elsewhere (a restart, or no supervisor) it returns
    at once.

    Example:
      >>> fsdpfn.ft.start_together(0)   # no supervisor: returns at once
    """
    where = os.environ.get(START_ENV)
    if not where:
        return
    from fsdpfn import comm

    comm.barrier(tag="replica group up")  # the group's ranks all have their ReplicaGroup
    if comm.rank() == 0:
        open(os.path.join(where, f"up.{replica}"), "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(where, "go")):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"replica group {replica}: the other replica groups were not up within {timeout:g} s "
                f"(waiting for {os.path.join(where, 'go')!r}); see their output"
            )
        time.sleep(0.02)


def _say(line: str) -> None:
    # One write, line and newline together: the ranks of every group share one pipe, and
    # print's two writes would let another rank's line in between.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def rank_up(replica: int, rank: int, *, echo: Callable[[str], None] | None = None) -> str:
    """Called by every rank of a replica group at its start: says which process it is (one
    line, ``ft: replica group R, rank K: pid N``, so that a fault seen from outside can be told
    apart) and, under :class:`watch_ranks`, registers its pid with the group's watchdog.
    Returns the line.

    Example:
      >>> fsdpfn.ft.rank_up(1, 0, echo=lambda line: None).startswith("ft: replica group 1, rank 0: pid ")
      True
    """
    line = f"ft: replica group {replica}, rank {rank}: pid {os.getpid()}"
    (echo or _say)(line)
    where = os.environ.get(WATCH_ENV)
    if where:
        tmp = os.path.join(where, f".rank{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(where, f"rank{rank}"))  # whole or absent: the watchdog never reads half
    return line


def rank_done(rank: int) -> None:
    """Called by a rank of a replica group that ended well (its part of the job done, or
    nothing to do): under :class:`watch_ranks`, its exit is then not a failure of the group.
    Elsewhere it does nothing.

    Example:
      >>> fsdpfn.ft.rank_done(0)   # no watchdog: nothing to tell
    """
    where = os.environ.get(WATCH_ENV)
    if where:
        open(os.path.join(where, f"done{rank}"), "w").close()


def _proc(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc``, or ``None`` if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _stopped(pid: int) -> bool:
    proc = _proc(pid)
    return proc is not None and proc[0] in ("T", "t")


class watch_ranks:
    """The watchdog of a replica group's ranks, in the process that starts them (see
    [Note: liveness per rank]): used as a context manager around the launch of the group's
    ranks, which inherit ``$FSDPFN_FT_WATCH`` from it and call :func:`rank_up` and
    :func:`rank_done`. As soon as a rank is gone without :func:`rank_done`, or has been stopped
    for ``stop_grace_s``, it says so through ``echo``, kills every rank of the group (SIGKILL)
    and keeps the line in :attr:`reason`, so that the launch fails at once and the supervisor
    restarts the group. Needs ``/proc`` (Linux); elsewhere it watches nothing.

    ``replica``: the group, for the lines; ``ranks``: how many ranks register.

    Example (in a replica group's launching process; ``train`` calls :func:`rank_up` and
    :func:`rank_done` on every rank):
      >>> with fsdpfn.ft.watch_ranks(1, 2, stop_grace_s=2.0) as watch:  # doctest: +SKIP
      ...     fsdpfn.launch.launch(train, 2)
    """

    def __init__(
        self,
        replica: int,
        ranks: int,
        *,
        stop_grace_s: float,
        echo: Callable[[str], None] | None = None,
        poll_s: float = 0.05,
    ):
        if not stop_grace_s > 0:
            raise ValueError(f"watch_ranks: stop_grace_s must be > 0 seconds, got {stop_grace_s!r}")
        self.replica, self.ranks, self.stop_grace_s, self.poll_s = replica, ranks, stop_grace_s, poll_s
        self.echo = echo or (lambda text: print(text, flush=True))
        self.reason: str | None = None
        self._dir = tempfile.mkdtemp(prefix="fsdpfn_ft_watch_")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdpfn-ft-watch", daemon=True)
        self._old: str | None = None

    def __enter__(self) -> "watch_ranks":
        self._old = os.environ.get(WATCH_ENV)
        os.environ[WATCH_ENV] = self._dir  # the ranks, spawned from here, inherit it
        if os.path.isdir("/proc"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._old is None:
            os.environ.pop(WATCH_ENV, None)
        else:
            os.environ[WATCH_ENV] = self._old
        shutil.rmtree(self._dir, ignore_errors=True)

    def _pids(self) -> dict[int, int]:
        pids = {}
        for k in range(self.ranks):
            try:
                with open(os.path.join(self._dir, f"rank{k}")) as f:
                    pids[k] = int(f.read())
            except (OSError, ValueError):
                pass
        return pids

    def _run(self) -> None:
        me = os.getpid()
        stopped_since: dict[int, float] = {}
        while not self._stop.wait(self.poll_s):
            pids = self._pids()
            why = None
            for k, pid in pids.items():
                if os.path.exists(os.path.join(self._dir, f"done{k}")):
                    continue
                proc = _proc(pid)
                if proc is None or proc[0] in ("Z", "X") or proc[1] != me:
                    why = f"rank {k} (pid {pid}) is gone"
                    break
                if proc[0] in ("T", "t"):
                    since = stopped_since.setdefault(k, time.monotonic())
                    if time.monotonic() - since >= self.stop_grace_s:
                        why = (
                            f"rank {k} (pid {pid}) has been stopped (SIGSTOP or a debugger) for {self.stop_grace_s:g} s"
                        )
                        break
                else:
                    stopped_since.pop(k, None)
            if why is None:
                continue
            self.reason = (
                f"ft: replica group {self.replica}: {why}; ending the group so that the other replica "
                "groups go on without it (the supervisor restarts it)"
            )
            self.echo(self.reason)
            for k, pid in pids.items():
                proc = _proc(pid)
                if proc is not None and proc[1] == me:  # still this group's rank, not a reused pid
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return


def _die_with_parent() -> None:
    # A replica group outliving its supervisor would train on with no one to restart or stop it.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG


def exit_reason(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL``, for a process's return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_replica_groups(
    command: Callable[[int, str], Sequence[str]],
    replicas: int,
    *,
    lighthouse: str | None = None,
    max_restarts: int = 3,
    join_timeout_s: float = 1.0,
    heartbeat_timeout_s: float = 2.0,
    env: dict | None = None,
    echo: Callable[[str], None] = print,
    poll_s: float = 0.05,
    restart_alone: bool = False,
    stop_grace_s: float | None = None,
) -> int:
    """Runs ``replicas`` replica groups of a fault-tolerant job on this host and restarts any
    that fails while another still trains (see [Note: supervising replica groups]).

    Args:
      command: ``command(replica, lighthouse_address)``: the argv of replica group ``replica``
        (one process that starts the group's ranks), e.g.
        ``[sys.executable, "train.py", "--replica-group", str(replica), "--lighthouse", address]``.
      replicas: replica groups, >= 2.
      lighthouse: the address of a running lighthouse; default: one started here (``min_replicas``
        1, ``join_timeout_s``, ``heartbeat_timeout_s``), shut down at the end.
      max_restarts: restarts per replica group; one that fails more often is left out.
      env: the replica groups' environment (default this process's).
      echo: where the supervisor's lines go (default ``print``).
      restart_alone: also restart a group that failed while no other one was training (every
        group lost): right for a job with checkpoints, whose restarted groups resume from their
        latest verified checkpoint; without (the default) such a group is left out. A group that
        fails after another one finished the job is never restarted.
      stop_grace_s: a group's process (the one ``command`` starts) that has been stopped
        (SIGSTOP) for this long is killed, and restarted like a failed one (``None``: never).

    Returns:
      0 if a replica group finished the job and none was left out; 1 if one finished but another
      was left out (its restarts used up); 2 if none finished. A restarted group that exits with
      :data:`NOTHING_TO_REJOIN` (no live group was left to take it back) counts as neither.

    Example:
      >>> argv = lambda r, address: [sys.executable, "examples/train_gpt.py", "--ft", "--replicas", "2",
      ...                             "--replica-group", str(r), "--lighthouse", address]
      >>> fsdpfn.ft.run_replica_groups(argv, 2)   # doctest: +SKIP
      0
    """
    if not isinstance(replicas, int) or replicas < 2:
        raise ValueError(
            f"run_replica_groups: replicas must be an int >= 2 (the replica groups that outlive "
            f"each other), got {replicas!r}"
        )
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"run_replica_groups: max_restarts must be an int >= 0, got {max_restarts!r}")
    own = None
    if lighthouse is None:
        from fsdpfn.comm import Lighthouse

        own = Lighthouse(min_replicas=1, join_timeout_s=join_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
        lighthouse = own.address
    base = dict(os.environ if env is None else env)
    start_dir = tempfile.mkdtemp(prefix="fsdpfn_ft_start_")
    procs: dict[int, subprocess.Popen] = {}
    tries = dict.fromkeys(range(replicas), 0)
    finished: set[int] = set()
    dropped: set[int] = set()
    idle: set[int] = set()  # restarted after the others were gone: nothing to rejoin
    stopped_since: dict[int, float] = {}

    def start(r: int) -> None:
        child = {**base, RESTARTS_ENV: str(tries[r]), FINISHED_ENV: os.path.join(start_dir, "finished")}
        if tries[r] == 0:
            child[START_ENV] = start_dir
        else:
            child.pop(START_ENV, None)
        procs[r] = subprocess.Popen(list(command(r, lighthouse)), env=child, preexec_fn=_die_with_parent)

    try:
        for r in range(replicas):
            start(r)
        gone = False
        while len(finished) + len(dropped) + len(idle) < replicas:
            if not gone and all(os.path.exists(os.path.join(start_dir, f"up.{r}")) for r in range(replicas)):
                open(os.path.join(start_dir, "go"), "w").close()
                gone = True
            # every group that ended since the last look, before deciding about any: groups lost
            # together (the lighthouse gone, a host down) are each restarted knowing it
            ended = [(r, code) for r, code in ((r, p.poll()) for r, p in list(procs.items())) if code is not None]
            for r, _ in ended:
                del procs[r]
            for r, code in ended:
                if code == 0:
                    finished.add(r)
                    open(os.path.join(start_dir, "finished"), "w").close()
                    continue
                if code == NOTHING_TO_REJOIN:
                    echo(f"ft: replica group {r} was restarted, but no live replica group was left to rejoin")
                    idle.add(r)
                    continue
                if not gone:  # before the first step: nothing to rejoin, the job cannot start as asked
                    echo(f"ft: replica group {r} failed before the job started ({exit_reason(code)}); stopping")
                    return 2
                if finished:
                    echo(
                        f"ft: replica group {r} failed ({exit_reason(code)}) after replica group(s) "
                        f"{sorted(finished)} finished the job: not restarted"
                    )
                    idle.add(r)
                elif not procs and not restart_alone:
                    echo(
                        f"ft: replica group {r} failed ({exit_reason(code)}) and no other replica group is "
                        "training: nothing to rejoin"
                    )
                    dropped.add(r)
                elif tries[r] >= max_restarts:
                    echo(
                        f"ft: replica group {r} failed ({exit_reason(code)}) after {tries[r]} restart(s); "
                        f"left out (max_restarts={max_restarts}), the others go on"
                    )
                    dropped.add(r)
                else:
                    tries[r] += 1
                    how = (
                        "it rejoins with a live replica's state"
                        if procs
                        else "no other replica group is training: it resumes from its latest verified checkpoint"
                    )
                    echo(
                        f"ft: replica group {r} failed ({exit_reason(code)}); restarting it ({tries[r]} of "
                        f"{max_restarts}): {how}"
                    )
                    start(r)
            if stop_grace_s is not None:
                now = time.monotonic()
                for r, p in procs.items():
                    if not _stopped(p.pid):
                        stopped_since.pop(r, None)
                    elif now - stopped_since.setdefault(r, now) >= stop_grace_s:
                        echo(
                            f"ft: replica group {r}'s process (pid {p.pid}) has been stopped (SIGSTOP) for "
                            f"{stop_grace_s:g} s: killing it, its ranks end with it"
                        )
                        p.kill()  # its next poll() is a failure like any other
                        stopped_since.pop(r, None)
            time.sleep(poll_s)
    finally:
        for p in procs.values():  # an interrupted supervisor leaves no replica group running
            if p.poll() is None:
                p.kill()
                p.wait()
        if own is not None:
            own.shutdown()
        shutil.rmtree(start_dir, ignore_errors=True)
    if dropped or idle:
        echo(f"ft: replica group(s) {sorted(finished)} finished; {sorted(dropped | idle)} did not")
    if not finished:
        return 2
    return 1 if dropped else 0
