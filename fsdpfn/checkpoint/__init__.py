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
``async_save`` is ``save`` that stalls the caller only while the shards are copied to host
memory: the write and the atomic commit run on a background thread (see [Note: asynchronous
checkpoints] in ``_async.py``); ``wait`` waits for it.

Example:
  >>> from fsdpfn import checkpoint
  >>> state = {"params": params, "opt_state": opt.init(params), "step": 100}
  >>> checkpoint.save("runs/x/ckpt", state, plan)
  'runs/x/ckpt/step_00000100'
  >>> other_plan = fsdpfn.plan(model, mesh, strategy="zero2")  # load reshards into any plan
  >>> fresh = fsdpfn.shard(model, other_plan)
  >>> template = {"params": fresh, "opt_state": opt.init(fresh), "step": 0}
  >>> state = checkpoint.load("runs/x/ckpt", template, other_plan)
  >>> state["step"]
  100
  >>> checkpoint.export_full("runs/x/model.pt", state["params"], other_plan, model=model)
  'runs/x/model.pt'
"""

from fsdpfn.checkpoint._async import async_save as async_save
from fsdpfn.checkpoint._inflight import AsyncCheckpoint as AsyncCheckpoint
from fsdpfn.checkpoint._inflight import wait as wait
from fsdpfn.checkpoint._atomic import latest as latest
from fsdpfn.checkpoint._dcp import load as load
from fsdpfn.checkpoint._dcp import read_info as read_info
from fsdpfn.checkpoint._dcp import save as save
from fsdpfn.checkpoint._export import export_full as export_full
from fsdpfn.checkpoint._manifest import CheckpointError as CheckpointError
from fsdpfn.checkpoint._tree import flatten_state as flatten_state

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "async_save",
    "export_full",
    "flatten_state",
    "latest",
    "load",
    "read_info",
    "save",
    "wait",
]
