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
  e.g. so that an injected fault is not injected again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

__all__ = ["NOTHING_TO_REJOIN", "restarts", "run_replica_groups", "start_together"]

START_ENV = "FSDPFN_FT_START"
RESTARTS_ENV = "FSDPFN_FT_RESTARTS"
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
            raise TimeoutError(f"replica group {replica}: the other replica groups were not up within {timeout:g} s "
                               f"(waiting for {os.path.join(where, 'go')!r}); see their output")
        time.sleep(0.02)


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


def run_replica_groups(command: Callable[[int, str], Sequence[str]], replicas: int, *, lighthouse: str | None = None,
                       max_restarts: int = 3, join_timeout_s: float = 1.0, heartbeat_timeout_s: float = 2.0,
                       env: dict | None = None, echo: Callable[[str], None] = print, poll_s: float = 0.05) -> int:
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
        raise ValueError(f"run_replica_groups: replicas must be an int >= 2 (the replica groups that outlive "
                         f"each other), got {replicas!r}")
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

    def start(r: int) -> None:
        child = {**base, RESTARTS_ENV: str(tries[r])}
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
            for r, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                del procs[r]
                if code == 0:
                    finished.add(r)
                    continue
                if code == NOTHING_TO_REJOIN:
                    echo(f"ft: replica group {r} was restarted, but no live replica group was left to rejoin")
                    idle.add(r)
                    continue
                if not gone:  # before the first step: nothing to rejoin, the job cannot start as asked
                    echo(f"ft: replica group {r} failed before the job started ({exit_reason(code)}); stopping")
                    return 2
                if not procs:
                    echo(f"ft: replica group {r} failed ({exit_reason(code)}) and no other replica group is "
                         "training: nothing to rejoin")
                    dropped.add(r)
                elif tries[r] >= max_restarts:
                    echo(f"ft: replica group {r} failed ({exit_reason(code)}) after {tries[r]} restart(s); "
                         f"left out (max_restarts={max_restarts}), the others go on")
                    dropped.add(r)
                else:
                    tries[r] += 1
                    echo(f"ft: replica group {r} failed ({exit_reason(code)}); restarting it ({tries[r]} of "
                         f"{max_restarts}): it rejoins with a live replica's state")
                    start(r)
            time.sleep(poll_s)
    finally:
        for p in procs.values():  # an interrupted supervisor leaves no replica group running
            if p.poll() is None:
                p.kill()
                p.wait()
        if own is not None:
            own.shutdown()
    if dropped or idle:
        echo(f"ft: replica group(s) {sorted(finished)} finished; {sorted(dropped | idle)} did not")
    if not finished:
        return 2
    return 1 if dropped else 0
