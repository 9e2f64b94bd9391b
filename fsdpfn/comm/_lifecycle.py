"""Ending a process group: the one step that touches both the groups and the flight recorder
(a new group numbers its collectives from 1 again)."""

from __future__ import annotations

import torch.distributed as dist

from fsdpfn.comm import _record
from fsdpfn.comm._groups import is_initialized

__all__ = ["destroy_process_group"]


def destroy_process_group() -> None:
    """Destroys the default process group (if any) and resets the flight recorder's numbering.

    Example:
      >>> fsdpfn.comm.destroy_process_group()  # at the end of a rank's work  # doctest: +SKIP
      >>> fsdpfn.comm.is_initialized()  # doctest: +SKIP
      False
    """
    if is_initialized():
        dist.destroy_process_group()
    _record.reset()  # a new group numbers its collectives from 1 again
