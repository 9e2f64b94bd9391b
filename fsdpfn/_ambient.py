"""Ambient state a recompute must see again: the context-parallel axes active while a unit ran.

:func:`fsdpfn.context_parallel` pushes the cp axis that :func:`fsdpfn.context_parallel_attention`
uses when it is given no plan. A rematerialised unit recomputes its forward in backward, which
may run after the ``with`` block has ended (``torch.func.grad(loss)(params)`` inside it, the
backward of ``loss.backward()`` outside): the recompute would then attend locally, not over cp.
So the remat machinery (``fsdpfn._remat.SaveMode`` / ``ReplayMode``) snapshots this stack when
the forward runs and restores it around the recompute, as it does the generator state. A leaf
module: it imports nothing of fsdpfn, so both the remat machinery and the transforms can use it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["CP_STACK", "LAST_CUT", "restored", "snapshot"]

# Process state: the cp axes active in this process, innermost last, as torch's own modes are a
# process's: a `with fsdpfn.context_parallel(...)` block pushes one for the code under it.
CP_STACK: list[Any] = []

# Process state: what the last call of fsdpfn.context_parallel_shard cut (each tensor's shape and two sums, as
# tensors: read only when a batch check runs, so no device sync otherwise), for the first steps'
# batch check (see [Note: cp peers cut the same sequences]).
LAST_CUT: list[Any] = [None]


def snapshot() -> tuple:
    """The active cp axes, innermost last."""
    return tuple(CP_STACK)


@contextlib.contextmanager
def restored(snap: tuple) -> Iterator[None]:
    """Runs the block with the cp axes of ``snap`` active, then puts back the current ones."""
    saved = list(CP_STACK)
    CP_STACK[:] = list(snap)
    try:
        yield
    finally:
        CP_STACK[:] = saved
