"""The one asynchronous save a process may have in flight, and waiting for it (see
[Note: asynchronous checkpoints] in ``_async.py``). Apart from ``_async`` so that ``save`` and
``load`` can wait for it without importing the module that builds on them."""

from __future__ import annotations

import atexit
import concurrent.futures
import sys

__all__ = ["AsyncCheckpoint", "settled", "wait"]


class AsyncCheckpoint(concurrent.futures.Future):
    """The future of one :func:`async_save`: ``result()`` waits for the commit and returns the
    checkpoint directory, or raises the save's error (the same on every rank).

    Attributes:
      path: the directory the checkpoint has once committed, e.g. ``runs/x/ckpt/step_00000100``.

    Example:
      >>> pending = fsdpfn.checkpoint.async_save("runs/x/ckpt", {"params": params, "step": 100}, plan)
      >>> pending.path
      'runs/x/ckpt/step_00000100'
      >>> pending.result()
      'runs/x/ckpt/step_00000100'
    """

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.seen = False  # the outcome reached the caller: a later wait need not raise it again

    def result(self, timeout: float | None = None) -> str:
        try:
            return super().result(timeout)  # the save's error is raised here, as given to the caller
        finally:
            self.seen = self.seen or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self.seen = self.seen or self.done()


# Process state: a process writes one checkpoint at a time; the next save waits for this one.
_pending: list[AsyncCheckpoint] = []  # the save in flight (or finished and not yet waited for)


def wait(timeout: float | None = None) -> str | None:
    """Waits for this process's :func:`async_save` in flight; returns its checkpoint directory,
    or raises its error (on every rank). ``None`` when there is none, or when its future already
    gave the outcome to the caller (``result()``). Call it before the job ends.

    Raises:
      TimeoutError: ``timeout`` seconds passed first (the save stays in flight).

    Example:
      >>> _ = fsdpfn.checkpoint.async_save("runs/x/ckpt", {"params": params, "step": 100}, plan)
      >>> fsdpfn.checkpoint.wait()
      'runs/x/ckpt/step_00000100'
      >>> fsdpfn.checkpoint.wait() is None
      True
    """
    if not _pending:
        return None
    pending = _pending[0]
    concurrent.futures.wait([pending], timeout)
    if not pending.done():
        raise TimeoutError(f"the checkpoint {pending.path!r} is still being written after {timeout:g} s")
    _pending.clear()
    if pending.seen:  # its future already gave the outcome to the caller
        return None
    pending.seen = True
    error = concurrent.futures.Future.exception(pending)
    if error is not None:
        raise error
    return concurrent.futures.Future.result(pending)


def settled() -> None:
    """Waits for a save in flight without raising its error (it stays for :func:`wait`): what a
    load does, so that it never reads a root a background commit is changing."""
    if _pending:
        concurrent.futures.wait([_pending[0]])


@atexit.register
def _unseen_at_exit() -> None:
    """An error nobody waited for is still told (the thread was joined before ``atexit`` runs)."""
    if _pending and _pending[0].done() and not _pending[0].seen and _pending[0].exception() is not None:
        print(
            f"fsdpfn.checkpoint.async_save of {_pending[0].path!r} failed and nothing waited for it "
            f"(call fsdpfn.checkpoint.wait()): {_pending[0].exception()}",
            file=sys.stderr,
        )
