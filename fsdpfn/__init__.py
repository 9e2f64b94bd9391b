"""fsdpfn: functional fully sharded data parallelism (FSDP / ZeRO / HSDP) and Muon for PyTorch.

Example:
  >>> plan = fsdpfn.plan(model, mesh, strategy="zero3")  # doctest: +SKIP
  >>> params = fsdpfn.shard(model, plan)  # doctest: +SKIP
  >>> full = fsdpfn.unshard(params, plan)  # differentiable; VJP == fsdpfn.reduce  # doctest: +SKIP
"""

from fsdpfn._cost import PlanCost as PlanCost
from fsdpfn._plan import MixedPrecision as MixedPrecision
from fsdpfn._plan import Plan as Plan
from fsdpfn._plan import plan as plan
from fsdpfn.comm import count_collectives as count_collectives
from fsdpfn.transforms import init_full as init_full
from fsdpfn.transforms import init_shards as init_shards
from fsdpfn.transforms import load_safetensors as load_safetensors
from fsdpfn.transforms import reduce as reduce
from fsdpfn.transforms import shard as shard
from fsdpfn.transforms import unshard as unshard

# Subpackages users reach as fsdpfn.comm, fsdpfn.optim, fsdpfn.runtime, fsdpfn.checkpoint, ...
from fsdpfn import checkpoint as checkpoint
from fsdpfn import comm as comm
from fsdpfn import optim as optim
from fsdpfn import runtime as runtime

__version__ = "0.1.0"

__all__ = [
    "MixedPrecision",
    "Plan",
    "PlanCost",
    "checkpoint",
    "comm",
    "count_collectives",
    "init_full",
    "init_shards",
    "load_safetensors",
    "optim",
    "plan",
    "reduce",
    "runtime",
    "shard",
    "unshard",
]
