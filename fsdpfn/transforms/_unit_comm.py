"""One unit's gather and reduce, written once: the unit's codecs pack and unpack
(``fsdpfn/_codec.py``), and a :class:`Wire` says which collectives move the buffers and over
which groups. The eager transforms and the runtime pass :class:`EagerWire` (``fsdpfn.comm``'s
counted, flight-recorded, optionally asynchronous collectives); ``torch.compile`` passes
:class:`TracedWire` (the functional collectives dynamo records as graph nodes, see [Note:
collectives under torch.compile]). Nothing else differs, so the compiled step moves the bytes
the eager one moves and computes the same numbers.
"""

from __future__ import annotations

from typing import Callable

import torch

from fsdpfn import comm as C
from fsdpfn._codec import cached
from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import uses_zeros
from fsdpfn._plan import Plan, Unit
from fsdpfn.transforms._axes import _axis_group, _axis_rank, unit_group, unit_mesh_dim, unit_rank
from fsdpfn.transforms._cp import check_reduce, note_gather
from fsdpfn.transforms._tp import check_loss_reduce, note_loss_gather

__all__ = ["EagerWire", "TracedWire", "Wire", "check_op", "gather", "reduce"]


def check_op(op: str) -> None:
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")


class Wire:
    """The collective primitives a unit's gather and reduce call, and their groups: ``role`` is
    ``Role.SHARD`` (the unit's own group), ``Role.REPLICATE`` or ``Role.TP`` (``rank``: any axis). Each collective
    returns a :class:`fsdpfn.comm.Pending` whose ``wait()`` gives its result."""

    def group(self, plan: Plan, unit: Unit, role: Role):
        raise NotImplementedError

    def rank(self, plan: Plan, unit: Unit, role: Role) -> int:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, w: int, group, tag: str) -> C.Pending:
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, w: int, accum_dtype: torch.dtype, group, tag: str) -> C.Pending:
        raise NotImplementedError

    def all_reduce(self, x: torch.Tensor, group, op: str, tag: str) -> C.Pending:
        raise NotImplementedError


class EagerWire(Wire):
    """:mod:`fsdpfn.comm`'s collectives into freshly allocated outputs, started asynchronously
    with ``async_op`` (the runtime waits later) or waited at once."""

    def __init__(self, async_op: bool = False):
        self.async_op = async_op

    def group(self, plan, unit, role):
        return unit_group(plan, unit) if role is Role.SHARD else _axis_group(plan, role)

    def rank(self, plan, unit, role):
        return unit_rank(plan, unit) if role is Role.SHARD else _axis_rank(plan, role)

    def all_gather(self, x, w, group, tag):
        out = torch.empty(w * x.numel(), dtype=x.dtype, device=x.device)
        return C.all_gather(out, x, group, async_op=self.async_op, tag=tag)

    def reduce_scatter(self, x, w, accum_dtype, group, tag):
        out = torch.empty(x.numel() // w, dtype=accum_dtype, device=x.device)
        return C.reduce_scatter(out, x, group, async_op=self.async_op, tag=tag)

    def all_reduce(self, x, group, op, tag):
        return C.all_reduce(x, group, op=op, async_op=self.async_op, tag=tag)


class TracedWire(Wire):
    """The functional collectives, each already waited (dynamo's graph orders them), over
    ``(mesh, dim)`` groups dynamo can trace."""

    def group(self, plan, unit, role):
        if role is Role.SHARD and cached(plan, "axes").dim(role) is not None:
            return unit_mesh_dim(plan, unit)  # the unit's own group: with ep or cp, flattened with shard
        d = cached(plan, "axes").dim(role)
        return None if d is None else (plan.mesh, d)

    def rank(self, plan, unit, role):
        if role is Role.SHARD and cached(plan, "axes").dim(role) is not None:
            mesh, d = unit_mesh_dim(plan, unit)
            return mesh.get_local_rank(d)
        d = cached(plan, "axes").dim(role)
        return 0 if d is None else plan.mesh.get_local_rank(d)

    def all_gather(self, x, w, group, tag):
        return C.Pending(C.traced_all_gather(x, group))

    def reduce_scatter(self, x, w, accum_dtype, group, tag):
        return C.Pending(C.traced_reduce_scatter(x, group, accum_dtype))

    def all_reduce(self, x, group, op, tag):
        return C.Pending(C.traced_all_reduce(x, group, op=op))


def gather(plan: Plan, unit: Unit, locals_: list[torch.Tensor], wire: Wire) -> tuple[C.Pending, Callable]:
    """Starts ``unit``'s all-gather from this rank's local shards: its codec's extra collective
    (the amax all-reduce of per-tensor scales, over tp too where a tensor spans it), then one
    all-gather of the packed segment.

    Returns ``(pending, finish)``; ``finish(pending.wait(), out=None)`` gives the unsharded
    parameters in ``unit.params`` order (written into ``out`` if given). A ``"partial"``
    parameter (a rowwise layer's bias) is zeros on every tp position but 0, so the all-reduce
    after the layer adds it once; its gradient, the same on every tp position, reaches it whole.
    """
    codec = plan.gather_codec(unit)
    w = unit.shard_size
    note_gather(plan)
    note_loss_gather(plan)
    amax = codec.local_amax(locals_)
    if amax is not None:
        for role in codec.amax_roles:
            amax = wire.all_reduce(amax, wire.group(plan, unit, role), "max", unit.name).wait()
    if codec.numel:
        pending = wire.all_gather(codec.encode(locals_, amax), w, wire.group(plan, unit, Role.SHARD), unit.name)
    else:
        device = next((t.device for t in locals_), torch.device("cpu"))
        pending = C.Pending(torch.empty(0, dtype=codec.wire_dtype, device=device))
    # A Partial parameter (a rowwise bias) is zeros on every position of its axis but 0.
    index = {
        role: wire.rank(plan, unit, role) for role in dict.fromkeys(e.axis for p in unit.params for e in p.placements)
    }
    partial = [i for i, p in enumerate(unit.params) if uses_zeros(p, index)]

    def finish(gathered: torch.Tensor, out: list[torch.Tensor] | None = None) -> list:
        stacked = gathered.view(w, codec.numel) if gathered.numel() else None
        fulls = codec.decode(stacked, locals_, out, amax)
        for i in partial:
            fulls[i] = fulls[i].zero_() if out is not None else torch.zeros_like(fulls[i])
        return fulls

    return pending, finish


def reduce(
    plan: Plan, unit: Unit, grads: list[torch.Tensor | None], op: str, scale: float | None, wire: Wire
) -> tuple[C.Pending, Callable[[], list[torch.Tensor]]]:
    """Starts the reduction of ``unit``'s full gradients: the codec packs them, one
    reduce-scatter sums them (an all-reduce for a ``replicate`` unit), an all-reduce over the
    replicate axis follows under HSDP; then the mean over the data-parallel ranks (or ``op`` and
    ``scale``) and the cast to the master dtype.

    Returns ``(pending, finish)``: ``finish()`` waits and gives this rank's local gradient shards
    in ``unit.params`` order. ``None`` gradients count as zeros.
    """
    codec = plan.reduce_codec(unit)
    axes = cached(plan, "axes")
    w = unit.shard_size
    check_reduce(plan)
    check_loss_reduce(plan)
    group = wire.group(plan, unit, Role.SHARD)
    factor = (1.0 / axes.grad_ranks if op == "mean" else 1.0) * (1.0 if scale is None else float(scale))
    buf = codec.encode(grads, w)
    if not codec.numel:
        first = C.Pending(buf.to(codec.accum_dtype))
    elif unit.sharded:
        first = wire.reduce_scatter(buf, w, codec.accum_dtype, group, unit.name)
    elif codec.accum_dtype == codec.wire_dtype:
        first = wire.all_reduce(buf, group, "sum", unit.name)
    else:
        raise NotImplementedError(
            f"unit {unit.label!r} uses strategy 'replicate', whose all-reduce sums in its wire dtype, but its reduce codec "
            f"{type(codec).__name__} sends {codec.wire_dtype} and accumulates in {codec.accum_dtype}; give the unit a sharded "
            "strategy or a codec whose wire and accumulation dtypes agree"
        )

    def finish() -> list[torch.Tensor]:
        reduced = first.wait()
        if axes.hsdp and reduced.numel():
            reduced = wire.all_reduce(reduced, wire.group(plan, unit, Role.REPLICATE), "sum", unit.name).wait()
        return codec.decode(reduced, wire.rank(plan, unit, Role.SHARD), factor)

    return first, finish
