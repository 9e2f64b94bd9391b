"""Telling every rank about a problem one rank found in its own input, before any collective.

[Note: agreeing through the store]
Some input checks can only fail on some ranks: a shard whose local shape is wrong on rank 1 is
right on rank 0, which then waits in the all-gather that rank 1 never starts. An agreement
collective before every gather would cost a collective per gather, and one only the first time
would still show up in every collective count (the counts that the cost model predicts). So the
agreement goes through the process group's store, once per check site: each rank writes its
problem (or none) and counts itself in; the last one in writes how many had a problem; everyone
waits for that, bounded by the collective timeout, and reads the problems only if there are any.
Four store round trips per rank, no collective, and every rank raises the same error.
"""

from __future__ import annotations

import datetime
import json
import time

from fsdpfn.comm import _groups
from fsdpfn.comm import _record

__all__ = ["exchange_problems", "exchange_values"]

# Process state: (label, group) -> rounds run, for the current job only: a job that ended on one rank in the
# middle of its checks (a pool task that raised) must not shift the next job's round numbers.
_ROUNDS: dict[tuple[str, int], int] = {}
_ROUNDS_JOB: list[str] = [""]


def exchange_problems(label: str, problem: str | None, group=None) -> dict[int, str]:
    """Every rank of ``group`` calls this with the same ``label`` and its own ``problem`` (``None``
    when it has none); each gets back ``{global rank: problem}`` of the ranks that had one (see
    [Note: agreeing through the store]).

    Raises :class:`~fsdpfn.comm.CollectiveError` naming the ranks that did not arrive within the
    collective timeout, or at once if one of them announced a failure meanwhile.

    Example:
      >>> exchange_problems("my check", None)   # one process: nothing to exchange
      {}
    """
    return _exchange(label, problem, group, read_all=False)


def exchange_values(label: str, value, group=None) -> dict[int, object]:
    """Every rank of ``group`` calls this with the same ``label`` and its own JSON-serialisable
    ``value``; each gets back ``{global rank: value}`` of every rank, through the store like
    :func:`exchange_problems`: no collective, so nothing a collective counter or the cost model
    sees. For small values exchanged rarely (each rank reads every rank's key).

    Example:
      >>> exchange_values("rows", [4])   # one process
      {0: [4]}
    """
    return _exchange(label, value, group, read_all=True)


def _exchange(label: str, value, group, read_all: bool) -> dict:
    from fsdpfn.comm._collectives import CollectiveError

    ranks, gid = _record.group_info(group)
    me = _groups.rank()
    store = _groups.store() if len(ranks) > 1 else None
    if store is None:
        return {me: value} if (value or read_all) else {}
    # Every rank runs the same checks in the same order, so the round number agrees too.
    job = _record.job_label()
    if _ROUNDS_JOB[0] != job:
        _ROUNDS.clear()
        _ROUNDS_JOB[0] = job
    n = _ROUNDS[(label, gid)] = _ROUNDS.get((label, gid), 0) + 1
    base = f"fsdpfn/agree/{job}/{gid:x}/{label}/{n}"
    seconds = _groups.timeout()

    def arrive() -> None:
        store.set(f"{base}/at/{me}", json.dumps(value))
        if value and not read_all:
            store.add(f"{base}/bad", 1)
        if store.add(f"{base}/arrived", 1) == len(ranks):
            store.set(f"{base}/done", str(store.add(f"{base}/bad", 0)))

    deadline = time.monotonic() + seconds
    _record.bounded_store_call(arrive, seconds)
    while True:
        left = deadline - time.monotonic()
        step = max(min(left, 1.0), 0.001)
        try:
            bad = int(
                _record.bounded_store_call(
                    lambda: (store.wait([f"{base}/done"], datetime.timedelta(seconds=step)), store.get(f"{base}/done"))[
                        1
                    ],
                    step + 1.0,
                )
            )
            break
        except Exception:  # noqa: BLE001 - not everyone is in yet (or the store is slow): look again
            failed = _record.peer_failures(store, ranks, me)
            if failed or left <= 1.0:
                try:
                    missing = _record.bounded_store_call(
                        lambda: [r for r in ranks if not store.check([f"{base}/at/{r}"])], 2.0
                    )
                except Exception:  # noqa: BLE001
                    missing = []
                what = (
                    "; ".join(f"rank {r} raised: {e}" for r, e in sorted(failed.items()))
                    if failed
                    else (
                        f"rank(s) {missing} did not reach it within {seconds:g} s (stopped, dead, or taking another code path)"
                    )
                )
                raise CollectiveError(
                    f"every rank of {list(ranks)} must run the check {label}, but {what}",
                    sorted(set(missing) | set(failed)),
                ) from None
    if not bad and not read_all:
        return {}

    def read() -> dict:
        out = {}
        for r in ranks:
            got = json.loads(store.get(f"{base}/at/{r}"))
            if got or read_all:
                out[r] = got
        return out

    return _record.bounded_store_call(read, seconds)
