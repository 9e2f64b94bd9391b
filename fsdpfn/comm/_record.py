"""What every collective leaves behind: a counter for tests and benchmarks, and a flight recorder
that names the rank which is behind when a collective fails.

[Note: the flight recorder]
A rank stuck in a collective cannot tell, from gloo's "Operation timed out" or "Connection
closed by peer", which peer is at fault. So every collective with more than one rank gets a
sequence number on its process group (the same on every rank of the group, since every rank runs
the same program) and a record in a fixed-size ring buffer of this process: sequence number,
kind, group, tag, bytes and start time. Nothing leaves the process on that path: no store
traffic, no system call. The last record of each group is also written into a small
memory-mapped file (one ``struct.pack_into``) that the other processes of the host can read, even
once this one is stopped or dead.

Only when a collective fails do the ranks exchange what names the ranks that are behind:

- the failing rank writes its last sequence number per group to the store and raises an alarm
  (one ``store.add``);
- a rank waiting in a collective looks at the alarm once a second while it waits, and answers
  with its own last sequence number per group;
- the failing rank reads its peers on the same host from their files, and waits a bounded time
  (:data:`ANSWER_WAIT_S`) for the answers of peers on other hosts.

A peer whose sequence number on the group is lower than ours never reached this collective; one
that neither answers nor has a readable file is busy outside collectives, stopped or dead, and on
the same host ``/proc`` says which. The only store traffic before any failure is one ``store.set``
per process, at its first collective: its pid, host and file, so that a peer can find them later.
Every store call on the failure paths is bounded (it runs on a helper thread): the store may be
served by the very process that is stopped.

[Note: failures reach the waiting ranks]
A rank that raises outside a collective (a ValueError in its own input checks, a bug) leaves
its peers waiting in the next collective. The launchers (:func:`fsdpfn.launch.launch`,
:func:`fsdpfn.testing.run_on_ranks`) therefore announce a rank's exception in the store
(:func:`announce_failure`, which also raises the alarm), and a rank waiting in a collective that
sees the alarm reads the announcements of its group: it fails at once with the peer's error
instead of waiting out the timeout. Keys carry the current job label (:func:`set_job`) so a
persistent worker pool never acts on an announcement left over from an earlier job.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import hashlib
import json
import mmap
import os
import queue
import secrets
import socket
import struct
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, cast

import torch
import torch.distributed as dist

from fsdpfn._wire import wire_bytes
from fsdpfn.comm import _groups

__all__ = [
    "ANSWER_WAIT_S",
    "CollectiveCall",
    "CollectiveCounter",
    "FlightRecord",
    "announce_failure",
    "bounded_store_call",
    "count_collectives",
    "flight_records",
    "group_info",
    "job_label",
    "peer_failures",
    "peer_report",
    "record",
    "set_flight_dir",
    "set_job",
]


class CollectiveCall(NamedTuple):
    """One recorded collective.

    Attributes:
      kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``, ``"send_recv"``,
        ``"broadcast"`` or ``"barrier"``.
      group_size: ranks taking part.
      nbytes: size of the larger of input and output buffer (the full-length buffer).
      wire_bytes: bytes each rank sends under a bandwidth-optimal algorithm:
        ``(W-1)/W * nbytes`` for all-gather, reduce-scatter, all-to-all and broadcast,
        ``2 (W-1)/W * nbytes`` for all-reduce and a barrier (a one-element all-reduce); see
        [Note: bytes on the wire] in ``fsdpfn/_wire.py``, which every predicted figure shares.
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


# Process state: each thread's stack of active collective counters (count_collectives).
_local = threading.local()


def _active() -> list[CollectiveCounter]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Collectives inside the block are not counted by the enclosing :func:`count_collectives`
    blocks (they still run, are timed out and flight-recorded): the differential check's
    collectives are not part of the step that the counts, ``plan.cost()`` and the simulator
    describe.

    Example:
      >>> with fsdpfn.comm.count_collectives() as counter:
      ...     with fsdpfn.comm.uncounted():
      ...         _ = fsdpfn.comm.all_reduce(torch.ones(4))
      >>> counter.counts()
      {}
    """
    saved = _active()[:]
    _local.stack = []
    try:
        yield
    finally:
        _local.stack = saved


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


class FlightRecord(NamedTuple):
    """One collective as the flight recorder saw it: ``seq`` (its number on its group, the same on
    every rank of the group), ``kind``, ``tag`` (the unit, or the caller's label), ``nbytes``, the
    global ``ranks`` of the group and ``start`` (``time.time()`` when it started)."""

    seq: int
    kind: str
    tag: str
    nbytes: int
    ranks: tuple[int, ...]
    start: float = 0.0

    def describe(self) -> str:
        what = f"#{self.seq} {self.kind}"
        return f"{what} of {self.tag!r}" if self.tag else what


_HISTORY = 32
# How long a failing rank waits for the answers of peers on other hosts: they look at the alarm
# once a second while they wait in a collective (see [Note: the flight recorder]).
ANSWER_WAIT_S = 2.5
# A look at the alarm while waiting in a collective gives up after this long (an unresponsive store).
_POLL_S = 0.5
# Process state: the flight recorder, a process's as NCCL's is: the last records, per group.
_ring: collections.deque = collections.deque(maxlen=_HISTORY)
_seq: dict[int, int] = {}  # group id -> sequence number of its last collective
_last: dict[int, FlightRecord] = {}  # group id -> its last record
_flight: dict[str, Any] = {"job": "", "latest": None, "alarm_seen": 0, "identified": None}
_PREFIX = "fsdpfn/flight/"
_FAILED_PREFIX = "fsdpfn/failed/"


def set_job(label: str) -> None:
    """Labels the work this process does from now on (see [Note: failures reach the waiting
    ranks]); a worker pool calls it with a new label for every task."""
    _flight["job"] = str(label)
    _flight["alarm_seen"] = 0


def _key(*parts) -> str:
    return _PREFIX + "/".join(str(p) for p in parts)


def _failed_key(rank: int) -> str:
    return f"{_FAILED_PREFIX}{_flight['job']}/{rank}"


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


# ---------------------------------------------------------------------------------------------
# The hot path: a ring buffer, the last record per group, the host-readable file
# ---------------------------------------------------------------------------------------------

# Process state: the groups' numbers in the flight records, given in the order groups appear.
_GROUP_IDS: dict[tuple[int, ...], int] = {}
_GROUP_INFO: dict[Any, tuple[tuple[int, ...], int]] = {}


def _group_id(ranks: tuple[int, ...]) -> int:
    gid = _GROUP_IDS.get(ranks)
    if gid is None:
        digest = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).digest()
        gid = _GROUP_IDS[ranks] = int.from_bytes(digest, "little") or 1  # 0 marks an empty slot
    return gid


def group_info(group=None) -> tuple[tuple[int, ...], int]:
    """``(global ranks, group id)`` of a process group, cached per group object. A tuple of
    global ranks stands for the ranks themselves (the store-based exchanges of
    :mod:`fsdpfn.comm._agree` need no process group)."""
    key = group if group is not None else dist.group.WORLD
    info = _GROUP_INFO.get(key)
    if info is None:
        ranks = tuple(sorted(group)) if isinstance(group, tuple) else tuple(_groups.group_ranks(group))
        info = _GROUP_INFO[key] = (ranks, _group_id(ranks))
    return info


_KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "barrier",
    "send_recv",
)  # append only: codes are stored
_KIND_CODE = {k: i for i, k in enumerate(_KINDS)}
_MAGIC = b"FSDPFNFR"
_HEADER = struct.Struct("<8sIIqi4x")  # magic, version, slots, pid, slot written last
_TAG_BYTES = 90
_SLOT = struct.Struct(f"<QQQdBB{_TAG_BYTES}s")  # group id, seq, nbytes, start, kind, tag length, tag (utf-8)
_LAST_AT = struct.calcsize("<8sIIq")
_SLOTS = 32


class _Mirror:
    """The last record of each group of this process, in a memory-mapped file that the other
    processes of the host can read (see [Note: the flight recorder]). One slot per group (at most
    32; the group written longest ago gives up its slot)."""

    def __init__(self):
        self.mm: mmap.mmap | None = None
        self.path: str | None = None
        self.dir: str | None = None
        self.broken = False
        self.slots: dict[int, int] = {}
        self.stamps = [0] * _SLOTS
        self.writes = 0
        self.tags: dict[str, bytes] = {}

    def _open(self) -> None:
        try:
            folder = self.dir or _default_dir()
            os.makedirs(folder, exist_ok=True)
            _sweep(folder)
            path = os.path.join(folder, f"fsdpfn-flight-{os.getpid()}-{secrets.token_hex(4)}")
            size = _HEADER.size + _SLOTS * _SLOT.size
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except (OSError, ValueError):  # no writable folder: peers on this host read nothing
            self.broken = True
            return
        _HEADER.pack_into(self.mm, 0, _MAGIC, 1, _SLOTS, os.getpid(), -1)
        self.path = path
        atexit.register(self.close)

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(Exception):
                self.mm.close()
            with contextlib.suppress(OSError):
                os.unlink(cast(str, self.path))  # set with mm
        self.mm, self.path, self.slots, self.stamps = None, None, {}, [0] * _SLOTS

    def write(self, gid: int, rec: FlightRecord) -> None:
        if self.mm is None:
            if self.broken:
                return
            self._open()
            if self.mm is None:
                return
        slot = self.slots.get(gid)
        if slot is None:
            slot = min(range(_SLOTS), key=self.stamps.__getitem__)
            for old, s in list(self.slots.items()):
                if s == slot:
                    del self.slots[old]
            self.slots[gid] = slot
        self.writes += 1
        self.stamps[slot] = self.writes
        tag = self.tags.get(rec.tag)
        if tag is None:
            tag = rec.tag.encode("utf-8", "replace")[:_TAG_BYTES]
            if len(self.tags) < 4096:
                self.tags[rec.tag] = tag
        _SLOT.pack_into(
            self.mm,
            _HEADER.size + slot * _SLOT.size,
            gid,
            rec.seq,
            rec.nbytes,
            rec.start,
            _KIND_CODE.get(rec.kind, 255),
            len(tag),
            tag,
        )
        struct.pack_into("<i", self.mm, _LAST_AT, slot)


def _default_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _sweep(folder: str) -> None:
    """Removes the files of processes that died without removing theirs (killed), once they are
    ten minutes old: a long-dead job's files, never a live peer's."""
    if not sys.platform.startswith("linux"):
        return
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if not name.startswith("fsdpfn-flight-"):
                continue
            pid = name.split("-")[2]
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError, ValueError):
                if not os.path.exists(f"/proc/{int(pid)}") and now - os.path.getmtime(path) > 600:
                    os.unlink(path)


_mirror = _Mirror()


def set_flight_dir(path: str | None) -> None:
    """Where this process keeps its host-readable flight file (default ``/dev/shm``, else the
    temporary folder). The launchers point it at their own temporary folder, which they remove
    afterwards, so that not even a killed rank leaves its file behind."""
    _mirror.close()
    _mirror.dir, _mirror.broken = path, False


def _read_mirror(path: str, pid: int) -> tuple[dict[int, FlightRecord], int | None] | None:
    """Another process's file: ``({group id: last record}, group id written last)``, or ``None``
    if it is gone or not that process's."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        magic, _, slots, owner, last = _HEADER.unpack_from(data, 0)
    except (OSError, struct.error):
        return None
    if magic != _MAGIC or owner != pid:
        return None
    records, latest = {}, None
    for s in range(slots):
        gid, seq, nbytes, start, kind, n, tag = _SLOT.unpack_from(data, _HEADER.size + s * _SLOT.size)
        if gid:
            kind_name = _KINDS[kind] if kind < len(_KINDS) else "collective"
            records[gid] = FlightRecord(seq, kind_name, tag[:n].decode("utf-8", "replace"), nbytes, (), start)
            if s == last:
                latest = gid
    return records, latest


def reset() -> None:
    """Forgets every group (called when the process group is destroyed: a new one starts at 1)."""
    _seq.clear()
    _last.clear()
    _ring.clear()
    _GROUP_INFO.clear()
    _flight.update(latest=None, identified=None, alarm_seen=0)
    _mirror.close()


def flight_records() -> list[FlightRecord]:
    """The last collectives this process started, oldest first (at most 32).

    Example:
      >>> records = fsdpfn.comm.flight_records()
      >>> all(isinstance(r, fsdpfn.comm.FlightRecord) for r in records)
      True
    """
    return list(_ring)


def record(
    kind: str, group_size: int, nbytes: int, dtype: torch.dtype, tag: str, ranks=None, gid: int | None = None
) -> FlightRecord | None:
    """Counts one collective and, when it involves other ranks (``ranks``, their group id
    ``gid``), gives it the next sequence number of its group and records it (see [Note: the flight
    recorder]). Touches nothing outside this process but the host-readable file."""
    call = CollectiveCall(kind, group_size, nbytes, wire_bytes(kind, group_size, nbytes), dtype, tag)
    for counter in _active():
        counter.calls.append(call)
    if group_size == 1:
        return None
    ranks = tuple(ranks or ())
    if gid is None:
        gid = _group_id(ranks)
    seq = _seq[gid] = _seq.get(gid, 0) + 1
    rec = FlightRecord(seq, kind, tag, nbytes, ranks, time.time())
    _ring.append(rec)
    _last[gid] = rec
    _flight["latest"] = gid
    _mirror.write(gid, rec)
    if seq == 1:  # a new group: the store may be new too
        identify()
    return rec


# ---------------------------------------------------------------------------------------------
# Store traffic: once per process before any failure, then only on the failure paths
# ---------------------------------------------------------------------------------------------


def identify() -> None:
    """Tells the store this process's pid, host and flight file, once per store: what a peer
    needs to find this rank's records, and its state in ``/proc``, after a failure."""
    store = _groups.store()
    if store is None or _flight["identified"] is store:
        return
    value = {**_me(), "file": _mirror.path}
    with contextlib.suppress(Exception):  # the recorder must never be the thing that fails
        store.set(_key("whois", _groups.rank()), json.dumps(value))
        _flight["identified"] = store


class _Helper:
    """Runs store calls on one daemon thread, so a caller can give up on a store that does not
    answer (served by a stopped process) and still fail within its timeout."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[[], Any], seconds: float) -> Any:
        """``fn()``, or ``TimeoutError`` after ``seconds``."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, daemon=True, name="fsdpfn-flight-store")
            self.thread.start()
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        if not done.wait(seconds):
            raise TimeoutError(f"the store did not answer within {seconds:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value


_helper = _Helper()


def bounded_store_call(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()`` (store calls), or ``TimeoutError`` after ``seconds``: a store served by a stopped
    process never answers, and nothing on a failure path may wait on it for longer than that."""
    return _helper.call(fn, seconds)


def job_label() -> str:
    """The label :func:`set_job` gave the current work."""
    return _flight["job"]


def _my_state() -> dict:
    groups = {f"{gid:x}": [r.seq, r.kind, r.tag, r.start] for gid, r in _last.items()}
    latest = _flight["latest"]
    return {**_me(), "groups": groups, "latest": f"{latest:x}" if latest is not None else None}


def _raise_alarm(store, rank: int) -> None:
    store.set(_key(_flight["job"], "state", rank), json.dumps(_my_state()))
    _flight["alarm_seen"] = store.add(_key(_flight["job"], "alarm"), 1)


def announce_failure(store, rank: int, error: BaseException | str) -> None:
    """Tells the peers that ``rank`` failed outside a collective, so their waits end at once."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    value = {"job": _flight["job"], "error": text.strip().splitlines()[-1][:400] if text.strip() else "", **_me()}

    def tell():
        store.set(_failed_key(rank), json.dumps(value))
        _raise_alarm(store, rank)

    with contextlib.suppress(Exception):
        _helper.call(tell, ANSWER_WAIT_S)


def _read_failures(store, ranks, me: int) -> dict[int, str]:
    out = {}
    for r in ranks:
        key = _failed_key(r)
        if r == me or not store.check([key]):
            continue
        value = json.loads(store.get(key))
        if value.get("job") == _flight["job"]:
            out[r] = value.get("error", "")
    return out


def peer_failures(store, ranks, me: int) -> dict[int, str]:
    """What a rank waiting in a collective does once a second: if the alarm went off since it
    last looked, it answers with its own records and returns ``{rank: error}`` for the peers
    among ``ranks`` that announced a failure in this job. One store call when nothing happened;
    ``{}`` if the store does not answer within half a second."""
    if store is None:
        return {}

    def look():
        alarm = store.add(_key(_flight["job"], "alarm"), 0)
        if alarm <= _flight["alarm_seen"]:
            return {}
        _flight["alarm_seen"] = alarm
        store.set(_key(_flight["job"], "state", me), json.dumps(_my_state()))
        return _read_failures(store, ranks, me)

    try:
        return _helper.call(look, _POLL_S)
    except Exception:  # noqa: BLE001 - a store we cannot read announces nothing
        return {}


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "has exited"
    except OSError:
        return ""
    return {"T": "is stopped", "t": "is stopped (traced)", "Z": "has exited (zombie)"}.get(state, "")


def _read(store, keys: list[str]) -> dict[str, bytes]:
    if not keys:
        return {}
    if store.check(keys):
        return dict(zip(keys, store.multi_get(keys)))
    return {k: store.get(k) for k in keys if store.check([k])}


def _gather_peers(store, peers: list[int], me: int, wait_s: float) -> dict[int, dict]:
    """Raises the alarm with this rank's records, then collects each peer's: from its file when
    it is on this host, else from its answer in the store (waiting at most ``wait_s``)."""
    _raise_alarm(store, me)
    host = socket.gethostname()
    whois = {
        int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in _read(store, [_key("whois", r) for r in peers]).items()
    }
    found: dict[int, dict] = {}
    remote = []
    for r, who in whois.items():
        found[r] = {"who": who}
        mirrored = _read_mirror(who["file"], who["pid"]) if who.get("file") and who.get("host") == host else None
        if mirrored is not None:
            found[r]["records"], found[r]["latest"] = mirrored
        else:
            remote.append(r)
    keys = [_key(_flight["job"], "state", r) for r in remote]
    if keys:
        with contextlib.suppress(Exception):  # a peer that does not answer in time is reported as such
            store.wait(keys, datetime.timedelta(seconds=wait_s))
        for k, v in _read(store, keys).items():
            state = json.loads(v)
            records = {
                int(g, 16): FlightRecord(s, kind, tag, 0, (), start)
                for g, (s, kind, tag, start) in state["groups"].items()
            }
            found[int(k.rsplit("/", 1)[1])].update(
                records=records, latest=int(state["latest"], 16) if state["latest"] else None
            )
    return found


def peer_report(
    store, rec: FlightRecord | None, me: int, wait_s: float = ANSWER_WAIT_S
) -> tuple[str, list[int], list[int]]:
    """Lines naming where each rank of ``rec``'s group is; the ranks that are behind (they never
    started this collective, or did not answer); the ranks that started it, or a later one, but
    are stopped or dead (see [Note: the flight recorder]). Takes at most ``wait_s`` plus a few
    store round trips when some peers are on other hosts, a few milliseconds when all are on this
    one."""
    if rec is None or store is None:
        return "", [], []
    peers = [r for r in rec.ranks if r != me]
    unreachable = ""
    try:
        found = _helper.call(lambda: _gather_peers(store, peers, me, wait_s), wait_s + 2.0)
    except Exception as e:  # noqa: BLE001 - the store may be served by the stopped process
        found, unreachable = (
            {},
            f" (the store did not answer: {str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__})",
        )
    gid, host = _group_id(rec.ranks), socket.gethostname()
    lines, behind, stuck = [], [], []
    for r in rec.ranks:
        if r == me:
            lines.append(f"  rank {r}: in {rec.describe()} (this rank)")
            continue
        peer = found.get(r)
        if peer is None:
            lines.append(
                f"  rank {r}: no record (it has not started any collective, or the store is unreachable){unreachable}"
            )
            behind.append(r)
            continue
        who = peer["who"]
        state = _process_state(who["pid"]) if who.get("host") == host else ""
        proc = f"; process {who['pid']} {state}" if state else ""
        records = peer.get("records")
        if records is None:
            lines.append(
                f"  rank {r}: no answer within {wait_s:g} s (busy outside collectives, stopped or dead; "
                f"host {who.get('host')}, pid {who.get('pid')}){proc}"
            )
            behind.append(r)
            continue
        mine = records.get(gid)
        lag = rec.seq - (mine.seq if mine else 0)
        ago = f" {max(time.time() - mine.start, 0.0):.1f} s ago" if mine and mine.start else ""
        where = f"last started {mine.describe()}{ago}" if mine else "has started no collective on this group"
        note = f", {lag} collective(s) behind" if lag > 0 and mine else ""
        latest = records.get(peer.get("latest")) if peer.get("latest") not in (None, gid) else None
        then = f"; then {latest.describe()} on another group" if latest else ""
        lines.append(f"  rank {r}: {where}{note}{then}{proc}")
        if lag > 0 or not mine:
            behind.append(r)
        elif state:
            stuck.append(r)
    return "\n".join(lines), behind, stuck
