"""Training that goes on when a replica is lost: the replicate dim of HSDP on torchft.

Each replica group is a job of its own, planned on its own mesh (the shard dim, with tp or ep
inside it where they apply); the replica groups average their gradients through
:class:`ReplicaGroup`, whose all-reduce spans only the replicas that are alive. A replica group
whose rank dies or stops is left out from the next step on (the step it broke runs again,
without it); restarted, it rejoins at a step boundary with the parameters and optimizer state
of a live replica. A :class:`Lighthouse` (one per job) decides which replicas are alive. Needs
``torchft`` (``pip install 'fsdpfn[ft]'``); see [Note: fault-tolerant replicas] in
``fsdpfn/comm/_replicas.py`` for how the pieces fit.

Example (each replica group runs this on its ranks; ``lighthouse`` is a
``Lighthouse().address``; ``examples/ft_replicas.py`` is the whole job; :func:`run_replica_groups` starts the replica
groups of a job on one host and restarts a failed one, as ``examples/train_gpt.py --ft`` does):
  >>> replicas = fsdpfn.ft.ReplicaGroup(lighthouse, replica_id="r0")  # needs a lighthouse  # doctest: +SKIP
  >>> while replicas.step < steps:  # a training loop  # doctest: +SKIP
  ...     params, state = replicas.start_step((params, state))            # a late replica: the live state
  ...     grads, loss = torch.func.grad_and_value(loss_fn)(params, *batch(replicas.step))
  ...     grads = replicas.reduce(grads)          # the mean over the replicas alive, or None: not committed
  ...     if grads is not None:                                           # every replica finished the step
  ...         updates, state = opt.update(grads, state, params)
  ...         params = fsdpfn.optim.apply_updates(params, updates)
"""

from __future__ import annotations

import importlib.util

from fsdpfn.comm import Lighthouse as Lighthouse
from fsdpfn.comm import ReplicaGroup as ReplicaGroup
from fsdpfn.comm import ReplicaStep as ReplicaStep
from fsdpfn._ft_supervisor import NOTHING_TO_REJOIN as NOTHING_TO_REJOIN
from fsdpfn._ft_supervisor import restarts as restarts
from fsdpfn._ft_supervisor import run_replica_groups as run_replica_groups
from fsdpfn._ft_supervisor import start_together as start_together
from fsdpfn._ft_supervisor import job_finished as job_finished
from fsdpfn._ft_supervisor import mark_finished as mark_finished
from fsdpfn._ft_supervisor import rank_done as rank_done
from fsdpfn._ft_supervisor import rank_up as rank_up
from fsdpfn._ft_supervisor import watch_ranks as watch_ranks

__all__ = [
    "NOTHING_TO_REJOIN",
    "Lighthouse",
    "ReplicaGroup",
    "ReplicaStep",
    "available",
    "job_finished",
    "mark_finished",
    "rank_done",
    "rank_up",
    "restarts",
    "run_replica_groups",
    "start_together",
    "watch_ranks",
]


def available() -> bool:
    """Whether torchft, which this module runs on, is installed.

    Example:
      >>> isinstance(fsdpfn.ft.available(), bool)
      True
    """
    return importlib.util.find_spec("torchft") is not None
