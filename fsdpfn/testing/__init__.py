"""Test utilities for fsdpfn users: run a function on N gloo ranks on one CPU machine."""

from fsdpfn.testing._harness import RankError as RankError
from fsdpfn.testing._harness import mesh as mesh
from fsdpfn.testing._harness import run_on_ranks as run_on_ranks
from fsdpfn.testing._harness import shutdown_pools as shutdown_pools
from fsdpfn.testing._harness import take_started_processes as take_started_processes

__all__ = ["RankError", "mesh", "run_on_ranks", "shutdown_pools", "take_started_processes"]
