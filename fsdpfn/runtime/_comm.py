"""Where collectives run: one interface over CUDA streams + events and CPU async gloo work.

The executor never touches streams itself. It asks the comm context to *start* a collective of
a kind and later to *wait* for it; :class:`CpuComm` and :class:`CudaComm` give the same
interface, so the schedule and the executor are device-agnostic.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CpuComm", "CudaComm", "comm_for"]


class Handle:
    """A started collective: ``pending`` (a :class:`fsdpfn.comm.Pending`),
    the ``finish`` function of the kernel that started it, and an optional CUDA event."""

    __slots__ = ("pending", "finish", "event")

    def __init__(self, pending, finish, event=None):
        self.pending = pending
        self.finish = finish
        self.event = event


class CpuComm:
    """CPU: gloo runs each async collective on its own threads; a work handle is all we need.

    Nothing orders memory between "streams" on CPU: the tensors handed to a collective are
    complete when it starts (the caller computed them synchronously), and we only read the
    output after ``wait()``.
    """

    def compute_device(self) -> torch.device:
        """Where units compute: an offloaded unit's shards are copied here before a gather."""
        return torch.device("cpu")

    def start(self, kind: str, fn: Callable[[], tuple[Any, Callable]]) -> Handle:
        pending, finish = fn()
        return Handle(pending, finish)

    def wait(self, handle: Handle):
        out = handle.pending.wait()
        return out


class CudaComm:
    """CUDA: one stream per collective kind, ordered against the compute stream with events.

    Streams, and why each exists:

      - ``all_gather``: the next unit's parameters are gathered while the current unit computes
        on the default stream. It first waits for the default stream, so shards an optimizer
        just wrote are complete before they are read (else a gather could ship stale shards).
      - ``reduce_scatter``: a unit's gradients are reduced while the previous unit's backward
        computes. Separate from ``all_gather`` so a prefetch never queues behind a reduce
        (FSDP2 does the same). It waits for the default stream: the gradients were produced
        there.

    The default stream waits on a collective's event before using its output; buffers stay
    referenced by the handle until then, so the caching allocator cannot hand them out early.
    """

    def __init__(self):
        self.streams = {
            "all_gather": torch.cuda.Stream(priority=-1),
            "reduce_scatter": torch.cuda.Stream(priority=-1),
        }

    def compute_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def start(self, kind: str, fn: Callable[[], tuple[Any, Callable]]) -> Handle:
        stream = self.streams[kind]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            pending, finish = fn()
            event = torch.cuda.Event()
            event.record(stream)
        return Handle(pending, finish, event)

    def wait(self, handle: Handle):
        out = handle.pending.wait()
        if handle.event is not None:
            torch.cuda.current_stream().wait_event(handle.event)
        return out


def comm_for(device: torch.device | str | None = None):
    """The comm context for ``device`` (default: CUDA if available, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CudaComm() if torch.device(device).type == "cuda" else CpuComm()
