"""What every collective leaves behind: a counter for tests and benchmarks, and a flight recorder
that names the rank which is behind when a collective fails.

[Note: the flight recorder]
A rank stuck in a collective cannot tell, from gloo's "Operation timed out" or "Connection
closed by peer", which peer is at fault. So every collective with more than one rank gets a
sequence number (the same on every rank, since every rank runs the same program) and, before
it starts, publishes ``seq kind tag`` with its pid and host to the process group's store (one
``store.set``: ~20 microseconds on CPU). When a collective fails, the failing rank reads every
rank's last record: a rank whose sequence number is lower than ours never reached this
collective (it is behind, stopped or dead), and on one host ``/proc`` says which of those it is.
The last records of this rank are kept in a ring buffer for the error message too.

[Note: failures reach the waiting ranks]
A rank that raises outside a collective (a ValueError in its own input checks, a bug) leaves
its peers waiting in the next collective. The launchers (:func:`fsdpfn.launch.launch`,
:func:`fsdpfn.testing.run_on_ranks`) therefore announce a rank's exception in the store
(:func:`announce_failure`), and a rank waiting in a collective looks for announcements from its
group once a second: it fails at once with the peer's error instead of waiting out the timeout.
Announcements carry the current job label (:func:`set_job`) so a persistent worker pool never
acts on one left over from an earlier job.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import socket
import threading
from typing import Iterator, NamedTuple

import torch

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "FlightRecord",
    "announce_failure",
    "count_collectives",
    "flight_records",
    "peer_failures",
    "record",
    "set_job",
]


class CollectiveCall(NamedTuple):
    """One recorded collective.

    Attributes:
      kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``,
        ``"broadcast"`` or ``"barrier"``.
      group_size: ranks taking part.
      nbytes: size of the larger of input and output buffer (the full-length buffer).
      wire_bytes: bytes each rank sends under a bandwidth-optimal algorithm:
        ``(W-1)/W * nbytes`` for all-gather, reduce-scatter, all-to-all and broadcast,
        ``2 (W-1)/W * nbytes`` for all-reduce and a barrier (a one-element all-reduce).
      dtype: the element type sent.
      tag: free-form label given by the caller (a unit name), or ``""``.
    """

    kind: str
    group_size: int
    nbytes: int
    wire_bytes: float
    dtype: torch.dtype
    tag: str


@dataclasses.dataclass
class CollectiveCounter:
    """What ran inside a :func:`count_collectives` block."""

    calls: list[CollectiveCall] = dataclasses.field(default_factory=list)

    def _sum(self, field: str, zero):
        out: dict = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, zero) + (1 if field == "calls" else getattr(c, field))
        return out

    def counts(self) -> dict[str, int]:
        """Number of calls per kind."""
        return self._sum("calls", 0)

    def wire_bytes(self) -> dict[str, float]:
        """Bytes sent per rank, per kind (see :class:`CollectiveCall`)."""
        return self._sum("wire_bytes", 0.0)

    def nbytes(self) -> dict[str, int]:
        """Full-buffer bytes per kind."""
        return self._sum("nbytes", 0)


_local = threading.local()


def _active() -> list[CollectiveCounter]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Records every collective fsdpfn runs in this thread inside the block.

    Every distributed call of the package goes through :mod:`fsdpfn.comm` (the transforms, the
    optimizers, the runtime, checkpoints and the rank-agreement checks), so this sees all of it.

    Example:
      >>> with fsdpfn.comm.count_collectives() as counter:
      ...     _ = fsdpfn.comm.all_reduce(torch.ones(4))   # one process: nothing is sent
      >>> counter.counts()
      {'all_reduce': 1}
    """
    counter = CollectiveCounter()
    _active().append(counter)
    try:
        yield counter
    finally:
        _active().remove(counter)


_WIRE_FACTOR = {"all_reduce": 2.0, "barrier": 2.0}


class FlightRecord(NamedTuple):
    """One collective as the flight recorder saw it: ``seq`` (the same on every rank for the same
    collective), ``kind``, ``tag`` (the unit, or the caller's label), ``nbytes``, the global
    ``ranks`` of the group."""

    seq: int
    kind: str
    tag: str
    nbytes: int
    ranks: tuple[int, ...]

    def describe(self) -> str:
        what = f"#{self.seq} {self.kind}"
        return f"{what} of {self.tag!r}" if self.tag else what


_HISTORY = 32
_flight = {"seq": 0, "records": collections.deque(maxlen=_HISTORY), "job": ""}
_STORE_PREFIX = "fsdpfn/flight/"
_FAILED_PREFIX = "fsdpfn/failed/"


def set_job(label: str) -> None:
    """Labels the work this process does from now on (see [Note: failures reach the waiting
    ranks]); a worker pool calls it with a new label for every task."""
    _flight["job"] = str(label)


def announce_failure(store, rank: int, error: BaseException | str) -> None:
    """Tells the peers that ``rank`` failed outside a collective, so their waits end at once."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    value = {"job": _flight["job"], "error": text.strip().splitlines()[-1][:400] if text.strip() else "", **_me()}
    with contextlib.suppress(Exception):
        store.set(f"{_FAILED_PREFIX}{rank}", json.dumps(value))


def peer_failures(store, ranks, me: int) -> dict[int, str]:
    """``{rank: error}`` for the peers among ``ranks`` that announced a failure in this job."""
    out = {}
    for r in ranks:
        key = f"{_FAILED_PREFIX}{r}"
        if r == me:
            continue
        try:
            if not store.check([key]):
                continue
            value = json.loads(store.get(key))
        except Exception:  # noqa: BLE001 - a store we cannot read announces nothing
            continue
        if value.get("job") == _flight["job"]:
            out[r] = value.get("error", "")
    return out


def flight_records() -> list[FlightRecord]:
    """The last collectives this process started, oldest first (at most 32).

    Example:
      >>> records = fsdpfn.comm.flight_records()
      >>> all(isinstance(r, fsdpfn.comm.FlightRecord) for r in records)
      True
    """
    return list(_flight["records"])


def record(kind: str, group_size: int, nbytes: int, dtype: torch.dtype, tag: str, ranks=None, store=None) -> FlightRecord | None:
    """Counts one collective and, when it involves other ranks, gives it the next sequence number
    and publishes it (see [Note: the flight recorder])."""
    wire = _WIRE_FACTOR.get(kind, 1.0) * (group_size - 1) / group_size * nbytes
    call = CollectiveCall(kind, group_size, nbytes, wire, dtype, tag)
    for counter in _active():
        counter.calls.append(call)
    if group_size == 1:
        return None
    _flight["seq"] += 1
    rec = FlightRecord(_flight["seq"], kind, tag, nbytes, tuple(ranks or ()))
    _flight["records"].append(rec)
    if store is not None:
        _publish(store, rec)
    return rec


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _publish(store, rec: FlightRecord) -> None:
    from fsdpfn.comm._groups import rank

    value = {"seq": rec.seq, "kind": rec.kind, "tag": rec.tag, **_me()}
    with contextlib.suppress(Exception):  # the recorder must never be the thing that fails
        store.set(f"{_STORE_PREFIX}{rank()}", json.dumps(value))


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "has exited"
    except OSError:
        return ""
    return {"T": "is stopped", "t": "is stopped (traced)", "Z": "has exited (zombie)"}.get(state, "")


def peer_report(store, rec: FlightRecord | None, me: int) -> tuple[str, list[int]]:
    """Lines naming where each rank of ``rec``'s group is, and the ranks that are behind."""
    if rec is None or store is None:
        return "", []
    lines, behind, host = [], [], socket.gethostname()
    for r in rec.ranks:
        if r == me:
            lines.append(f"  rank {r}: in {rec.describe()} (this rank)")
            continue
        try:
            key = f"{_STORE_PREFIX}{r}"
            peer = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store may live on the dead rank
            peer = None
        if peer is None:
            lines.append(f"  rank {r}: no record (it has not started any collective, or the store is unreachable)")
            behind.append(r)
            continue
        where = f"#{peer['seq']} {peer['kind']}" + (f" of {peer['tag']!r}" if peer["tag"] else "")
        state = _process_state(peer["pid"]) if peer["host"] == host else ""
        lag = rec.seq - peer["seq"]
        note = f", {lag} collective(s) behind" if lag > 0 else ""
        proc = f"; process {peer['pid']} {state}" if state else ""
        lines.append(f"  rank {r}: last started {where}{note}{proc}")
        if lag > 0 or state:
            behind.append(r)
    return "\n".join(lines), behind
