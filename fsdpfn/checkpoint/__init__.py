"""Distributed checkpoints of training state on ``torch.distributed.checkpoint`` (DCP).

``save`` writes any pytree of DTensors, tensors and Python numbers collectively (every rank
calls it; there is no rank-0 gate to deadlock), keyed by the leaves' paths, so ``load`` can
reshard it into another plan or world size. Saves are atomic: a save killed half-way leaves the
previous checkpoint loadable. Every file carries a checksum; ``load`` verifies what it reads and,
given a checkpoint root, falls back past a damaged checkpoint to the newest intact one (with a
warning). An error on one rank is raised on every rank (:class:`CheckpointError` for missing or
damaged files). Every collective goes through :mod:`fsdpfn.comm`, DCP's own included (DCP runs
without a process group; see [Note: collective-free DCP] in ``_shards.py``). ``export_full``
writes one plain ``state_dict`` file that ``model.load_state_dict`` accepts without fsdpfn.

Example:
  >>> from fsdpfn import checkpoint
  >>> state = {"params": params, "opt_state": opt_state, "step": 100}  # doctest: +SKIP
  >>> checkpoint.save("runs/x/ckpt", state, plan)  # doctest: +SKIP
  >>> state = checkpoint.load("runs/x/ckpt", template, other_plan)  # doctest: +SKIP
  >>> checkpoint.export_full("runs/x/model.pt", state["params"], plan, model=model)  # doctest: +SKIP
"""

from fsdpfn.checkpoint._atomic import latest as latest
from fsdpfn.checkpoint._dcp import load as load
from fsdpfn.checkpoint._dcp import read_info as read_info
from fsdpfn.checkpoint._dcp import save as save
from fsdpfn.checkpoint._export import export_full as export_full
from fsdpfn.checkpoint._manifest import CheckpointError as CheckpointError
from fsdpfn.checkpoint._tree import flatten_state as flatten_state

__all__ = ["CheckpointError", "export_full", "flatten_state", "latest", "load", "read_info", "save"]
