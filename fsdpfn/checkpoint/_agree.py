"""Errors that reach every rank.

[Note: one rank fails, every rank raises]
A checkpoint call is collective. If one rank raised while the others went on to the next
collective, they would wait there until the timeout (the seed-001 hang, in another guise). So
every step that can fail on some ranks only (a file one rank cannot write, a shard one rank
finds damaged) ends in one collective that tells each rank every rank's outcome: :func:`agree`
(an all-gather of each rank's error or ``None``) where any rank may fail, :func:`decide` (rank 0
acts, broadcasts the outcome) where only rank 0 acts. Then every rank raises an exception of
the same type (when it is one of the few below; else ``RuntimeError``) whose message says what
failed, on which rank, and why; on the failing rank it is chained to the original (``from``),
so its traceback is kept.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from fsdpfn import comm
from fsdpfn.checkpoint._manifest import CheckpointError

__all__ = ["agree", "decide", "portable", "rebuild", "timeout_scope"]

_KINDS = {
    c.__name__: c
    for c in (
        ValueError,
        FileNotFoundError,
        NotADirectoryError,
        PermissionError,
        FileExistsError,
        OSError,
        CheckpointError,
    )
}


def portable(error: BaseException | None):
    """What other ranks need of ``error``: plain strings, so it always pickles."""
    if error is None:
        return None
    return type(error).__name__, str(error), getattr(error, "path", None), getattr(error, "file", None)


def rebuild(outcome, rank: int, what: str) -> BaseException:
    kind, message, path, file = outcome
    text = f"{what} failed on rank {rank}: {message}"
    if kind == CheckpointError.__name__:
        return CheckpointError(text, path, file)
    cls = _KINDS.get(kind)
    return cls(text) if cls is not None else RuntimeError(f"{what} failed on rank {rank}: {kind}: {message}")


def agree(error: BaseException | None, what: str, payload: Any = None, group=None) -> list:
    """Every rank's ``error`` and ``payload`` (one all-gather over ``group``, default every rank);
    raises on every rank if any rank has an error.

    Returns:
      Every rank's ``payload``, in rank order, when no rank failed.
    """
    outcomes = comm.all_gather_object((portable(error), payload), group, tag=what)
    if error is not None:
        raise rebuild(portable(error), comm.rank(), what) from error
    for r, (outcome, _) in enumerate(outcomes):
        if outcome is not None:
            raise rebuild(outcome, r, what)
    return [p for _, p in outcomes]


def decide(action: Callable[[], Any], what: str, group=None) -> Any:
    """Runs ``action`` on rank 0 and gives its result to every rank of ``group`` (one broadcast);
    if it raised, every rank raises."""
    result, error = None, None
    if comm.rank() == 0:
        try:
            result = action()
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            error = e
    outcome = comm.broadcast_object(
        ("error", portable(error)) if error is not None else ("ok", result), 0, group, tag=what
    )
    if error is not None:
        raise rebuild(portable(error), 0, what) from error
    if outcome[0] == "error":
        raise rebuild(outcome[1], 0, what)
    return outcome[1]


def timeout_scope(seconds: float | None):
    """``fsdpfn.comm.timeout_scope(seconds)``, or the process's timeout when ``None``."""
    return contextlib.nullcontext() if seconds is None else comm.timeout_scope(seconds)
