"""Start a training function on N ranks: under ``torchrun`` as it is, else by spawning N local
gloo processes. Examples use it so that one command works on a laptop and on a cluster."""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "under_torchrun"]


def under_torchrun() -> bool:
    """True if this process was started by ``torchrun`` (or another launcher setting ``RANK``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _entry(rank: int, world_size: int, init_file: str, backend: str, threads: int, main, args) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10)
    )
    try:
        main(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def launch(main: Callable[..., Any], world_size: int = 2, *args: Any, backend: str | None = None) -> None:
    """Runs ``main(rank, world_size, *args)`` on every rank with the default process group set up.

    Under ``torchrun`` this process is one rank: the group is initialised from the environment
    (NCCL if CUDA is available, else gloo) and ``world_size`` is ignored. Otherwise
    ``world_size`` local CPU processes are spawned with gloo, one thread each (the cores are
    shared), and the call returns when all finished; a failing rank raises here.

    Example:
      >>> def main(rank, world_size):  # doctest: +SKIP
      ...     print(rank, torch.distributed.get_world_size())
      >>> launch(main, world_size=2)  # doctest: +SKIP
    """
    if under_torchrun():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            main(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            dist.destroy_process_group()
        return
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="fsdpfn_launch_") as tmp:
        init_file = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(world_size, init_file, backend or "gloo", threads, main, args), nprocs=world_size, join=True)
