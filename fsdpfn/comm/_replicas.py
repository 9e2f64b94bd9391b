"""Replica groups that outlive each other: the replicate dim of HSDP on torchft.

[Note: fault-tolerant replicas]
On an HSDP mesh (replicate x shard) a gradient is reduce-scattered inside a replica group and
then all-reduced across the replica groups. With one process group for the whole mesh, a rank
lost in any replica stops every rank of the job. Here each replica group is a job of its own
(its own process group: the shard dim, and tp/ep inside it) and the replicate dim is torchft's:

- a *lighthouse* (one per job, :class:`Lighthouse`) forms a quorum of the replica groups that
  are alive at the start of every step, from their heartbeats;
- each rank of a replica group has a torchft ``Manager``; the ranks with the same index in their
  groups all-reduce their gradient shards over a gloo group that torchft rebuilds whenever the
  quorum changes, and divide by the number of replicas in the quorum;
- a replica whose peer died or stopped during the all-reduce fails it (gloo reports the closed
  connection at once, a stopped peer within the collective timeout); the step is then not
  committed on any rank of that replica group, and runs again, on the same batch, with the
  replicas of the next quorum;
- a replica that starts late, or again after its ranks were restarted, is behind: at the start
  of a step (a step boundary) each of its ranks receives the current state (parameters and
  optimizer state) from the rank with the same index in a live replica, and takes part in that
  same step.

So every committed step applies the mean gradient over the replicas that were alive for the
whole step, and every replica applies the same update: from a rejoin on, training is what it
would have been with that many replicas. torchft supplies the quorum, the rebuilt group and the
state transfer (HTTP); this module gives them fsdpfn's timeout, puts the all-reduce in the
collective counter and the flight recorder (tag ``"replicas"``), keeps pytrees of DTensors
intact across the transfer, and logs every change of membership.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from typing import Any, NamedTuple

import optree
import torch

from fsdpfn.comm import _groups
from fsdpfn.comm import _record

__all__ = ["Lighthouse", "ReplicaGroup", "ReplicaStep", "require_torchft"]

log = logging.getLogger("fsdpfn.ft")

_INSTALL = "pip install 'fsdpfn[ft]' (or: pip install torchft)"


def require_torchft():
    """The ``torchft`` module, or ``ImportError`` saying how to install it."""
    try:
        import torchft
    except ImportError as e:
        raise ImportError(f"fault-tolerant replicas run on torchft, which is not installed: {_INSTALL} ({e})") from e
    return torchft


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Lighthouse:
    """torchft's lighthouse: the server that decides, step by step, which replica groups are
    alive. One per job, in any process every replica group can reach (the launching script, or
    ``torchft_lighthouse`` on a host of its own); replicas connect to :attr:`address`.

    ``min_replicas``: a quorum needs at least this many replica groups. ``join_timeout_s``: how
    long the first quorum waits for more replicas than the minimum. ``heartbeat_timeout_s``: a
    replica that sent no heartbeat for this long (dead or stopped) is left out of the next
    quorum.

    Example:
      >>> with fsdpfn.ft.Lighthouse(min_replicas=1) as lighthouse:   # a server on a free port
      ...     lighthouse.address.startswith("http://")
      True
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        bind: str = "[::]:0",
        join_timeout_s: float = 1.0,
        heartbeat_timeout_s: float = 2.0,
        quorum_tick_s: float = 0.05,
    ):
        require_torchft()
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=int(join_timeout_s * 1000),
            quorum_tick_ms=int(quorum_tick_s * 1000),
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        self.address: str = self._server.address()

    def shutdown(self) -> None:
        self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class ReplicaStep(NamedTuple):
    """One attempt at a step, as :class:`ReplicaGroup` saw it: the step number, the replica
    groups whose gradients were averaged, whether it was committed, whether this replica
    received its state from a peer first, and why it was not committed (``""`` when it was)."""

    step: int
    replicas: int
    committed: bool
    healed: bool
    error: str


def _is_dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _local(x):
    return x.to_local() if _is_dtensor(x) else x


def _like(template, local: torch.Tensor):
    """``local`` in ``template``'s form: a DTensor with its mesh, placements and global shape."""
    if not _is_dtensor(template):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


class ReplicaGroup:
    """This rank's part in the replicate dim of a fault-tolerant HSDP job (see
    [Note: fault-tolerant replicas]). Every rank of a replica group creates one, with the same
    ``replica_id`` (unique per replica group, stable across its restarts).

    Each step: :meth:`start_step` (the quorum; returns the state received from a live replica
    when this one is behind), the gradient, :meth:`mean` (over the replicas alive), then
    :meth:`commit` says whether to apply the update. :attr:`step` counts committed steps: use it
    as the data index, so that a step that runs again sees the same batch.

    ``timeout``: seconds the all-reduce waits (default :func:`timeout`); the commit waits twice
    that and 5 s more (see the comment in ``__init__``);
    ``quorum_timeout``: how long a step waits for a quorum (default the larger of that and 30 s);
    ``max_retries``: :meth:`commit` raises after this many uncommitted steps in a row (``None``:
    never), so that a replica that cannot make progress ends instead of trying forever;
    ``step``: the committed steps this replica starts from (a checkpoint's step when it resumes
    from one): the quorum's replicas behind the one furthest ahead receive its state.
    """

    def __init__(
        self,
        lighthouse: str,
        replica_id: str,
        *,
        min_replicas: int = 1,
        timeout: float | None = None,
        quorum_timeout: float | None = None,
        max_retries: int | None = 5,
        step: int = 0,
    ):
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        # Two warnings raised inside torchft's own threads and calls, harmless, that would fail
        # the quorum and every commit under PYTHONWARNINGS=error: torch's, that the state torchft
        # receives is a read-only buffer (it is copied before use, see _rebuild), and logging's,
        # that torchft calls the deprecated Logger.warn.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        warnings.filterwarnings(
            "ignore", message="The 'warn' method is deprecated", category=DeprecationWarning, module=r"torchft\."
        )

        seconds = _groups.timeout() if timeout is None else _groups._check_timeout(timeout, "timeout")
        quorum_s = (
            max(seconds, 30.0) if quorum_timeout is None else _groups._check_timeout(quorum_timeout, "quorum_timeout")
        )
        self.replica_id = str(replica_id)
        self.history: list[ReplicaStep] = []
        self._state: Any = None
        self._received: list | None = None
        self._healed = False
        self._last_replicas: int | None = None
        group_rank, group_size = _groups.rank(), _groups.world_size()
        host, port, self._store = _replica_store(group_rank)
        # The commit waits for every rank of the group to vote, and a rank whose all-reduce peer
        # stopped votes only when that all-reduce times out: with equal timeouts the live ranks'
        # commit would race it and fail the survivors too. So the commit gets twice as long.
        commit_s = 2 * seconds + 5.0
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=_td(seconds)),
            load_state_dict=self._receive,
            state_dict=self._send,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            timeout=_td(commit_s),
            quorum_timeout=_td(quorum_s),
            connect_timeout=_td(quorum_s),
            rank=group_rank,
            world_size=group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=self.replica_id,
            max_retries=max_retries,
        )
        if step:
            if not isinstance(step, int) or step < 0:
                raise ValueError(
                    f"ReplicaGroup: step must be an int >= 0 (the committed steps to start from), got {step!r}"
                )
            self._manager.load_state_dict({"step": step, "batches_committed": 0})

    # -- the state a recovering replica receives -------------------------------------------------

    def _send(self) -> dict:
        # Called on a torchft thread when a peer needs this replica's state: the state as of the
        # start of this step, copied, so that an in-place update cannot change what is sent.
        leaves = optree.tree_leaves(self._state, none_is_leaf=True)
        return {"leaves": [_local(x).detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]}

    def _receive(self, state: dict) -> None:
        self._received = list(state["leaves"])

    def _rebuild(self, state):
        leaves, spec = optree.tree_flatten(state, none_is_leaf=True)
        got = self._received
        self._received = None
        assert got is not None
        if len(got) != len(leaves):
            raise ValueError(
                f"replica {self.replica_id!r} received a state of {len(got)} leaves from a live replica, "
                f"but its own has {len(leaves)}: every replica must train the same model with the same "
                "optimizer and plan"
            )
        out = []
        for i, (mine, theirs) in enumerate(zip(leaves, got)):
            if isinstance(mine, torch.Tensor):
                local = _local(mine)
                if not isinstance(theirs, torch.Tensor) or theirs.shape != local.shape or theirs.dtype != local.dtype:
                    what = (
                        f"{tuple(theirs.shape)} {theirs.dtype}"
                        if isinstance(theirs, torch.Tensor)
                        else type(theirs).__name__
                    )
                    raise ValueError(
                        f"replica {self.replica_id!r}: leaf {i} of the received state is {what}, its own "
                        f"is {tuple(local.shape)} {local.dtype}: the replicas' plans differ"
                    )
                # a copy: what arrives may be a read-only view of the transfer's buffer
                out.append(_like(mine, theirs.to(local.device, copy=True)))
            else:
                out.append(theirs)
        return optree.tree_unflatten(spec, out)

    # -- one step --------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps committed by the job so far (the same on every live replica)."""
        return self._manager.current_step()

    @property
    def healed(self) -> bool:
        """Whether the last :meth:`start_step` returned a live replica's state instead of the
        one it was given (this replica was behind)."""
        return self._healed

    @property
    def replicas(self) -> int:
        """Replica groups taking part in the current step."""
        return self._manager.num_participants()

    def start_step(self, state):
        """Joins the quorum for the next step. Returns ``state`` (any pytree of tensors and
        DTensors, e.g. ``(params, opt_state)``), or, when this replica is behind (it started late
        or was restarted), the live replicas' state in the same form. A live replica sends its
        state as of this call to any replica that needs it."""
        self._state = state
        self._healed = False
        self._manager.start_quorum()
        if self._received is not None:
            state = self._state = self._rebuild(state)
            self._healed = True
            if self.step > 0:  # at step 0 every replica starts from one replica's state: nothing to say
                log.warning(
                    "replica %s: rejoined at step %d with the state of a live replica (%d replicas)",
                    self.replica_id,
                    self.step,
                    self.replicas,
                )
        n = self.replicas
        if self._last_replicas is not None and n != self._last_replicas:
            log.warning(
                "replica %s: step %d: %d replica group(s) alive (was %d); the gradient is their mean",
                self.replica_id,
                self.step,
                n,
                self._last_replicas,
            )
        self._last_replicas = n
        return state

    def mean(self, grads):
        """The mean of ``grads`` (a pytree of tensors or DTensors, this rank's shards) over the
        replicas of this step: one all-reduce per dtype, bounded by the collective timeout. If a
        replica fails meanwhile the values are not usable and :meth:`commit` returns ``False``."""
        leaves, spec = optree.tree_flatten(grads, none_is_leaf=True)
        n = self.replicas
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in idx:
            by_dtype.setdefault(leaves[i].dtype, []).append(i)
        out = list(leaves)
        for dtype, members in by_dtype.items():
            locals_ = [_local(leaves[i]) for i in members]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            _record.record(
                "all_reduce",
                max(n, 2),
                flat.numel() * flat.element_size(),
                dtype,
                "replicas",
                ranks=tuple(range(max(n, 2))),
                gid=_REPLICAS_GID,
            )
            self._manager.allreduce(flat).wait()
            pos = 0
            for i, t in zip(members, locals_):
                out[i] = _like(leaves[i], flat[pos : pos + t.numel()].view(t.shape).clone())
                pos += t.numel()
        return optree.tree_unflatten(spec, out)

    def commit(self) -> bool:
        """Whether every replica of this step finished it: apply the update only then. Every rank
        of this replica group gets the same answer."""
        step, n = self.step, self.replicas
        error = self._manager.errored()
        try:
            ok = self._manager.should_commit()
        except Exception as e:  # noqa: BLE001 - re-raised with what it means for this replica
            raise RuntimeError(
                f"replica {self.replica_id!r}, rank {_groups.rank()}: step {step} could not be committed "
                f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); when a rank of "
                "this replica group is dead or stopped, the other replicas go on without it: restart this replica "
                "group as a whole and it rejoins with a live replica's state"
            ) from e
        why = (
            ""
            if ok
            else (
                str(error.original_exception).strip().splitlines()[0][:300]
                if error is not None
                else "another rank of the quorum failed it"
            )
        )
        self.history.append(ReplicaStep(step, n, ok, self._healed, why))
        if not ok:
            log.warning(
                "replica %s: step %d was not committed (%s); it runs again with the replicas that are alive",
                self.replica_id,
                step,
                why,
            )
        return ok

    def reduce(self, grads):
        """:meth:`mean` then :meth:`commit`: the mean of ``grads`` over the replicas of this
        step, or ``None`` when the step was not committed (skip the update; the step runs again
        with the replicas alive, on the same batch, at the next :meth:`start_step`).

        Example (one step of a training loop; ``replicas`` as in the module's example):
          >>> state = replicas.start_step(state)  # doctest: +SKIP
          >>> grads = replicas.reduce(torch.func.grad(loss_fn)(state["params"], *batch(replicas.step)))  # doctest: +SKIP
          >>> if grads is not None:  # doctest: +SKIP
          ...     updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        """
        mean = self.mean(grads)
        return mean if self.commit() else None

    def shutdown(self) -> None:
        """Leaves the job: the other replicas go on without this one."""
        self._manager.shutdown(wait=False)


_REPLICAS_GID = int.from_bytes(b"replicas", "little")


def _replica_store(group_rank: int) -> tuple[str, int, Any]:
    """A TCP store for this replica group's torchft managers, served by its rank 0. torchft needs
    one that the other replica groups can reach; fsdpfn's own launcher uses a file store."""
    from torch.distributed import TCPStore

    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    if group_rank == 0:
        store = TCPStore(host, 0, None, True, timeout=_td(60), wait_for_workers=False)
        port = store.port
    else:
        store, port = None, 0
    if _groups.world_size() > 1:  # the port, to the group's other ranks, through the group's own store
        from fsdpfn.comm._agree import exchange_values

        port = int(exchange_values("replica store", port)[_groups.group_ranks()[0]])  # type: ignore[call-overload]
    return host, port, store
