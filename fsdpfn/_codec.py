"""Codecs: how a unit's shards are packed into the buffer one all-gather moves and unpacked
after it (:class:`GatherCodec`), and how its full gradients are packed for the reduce-scatter
and unpacked into local gradient shards (:class:`ReduceCodec`).

A codec is pure tensor code: it packs, unpacks and states its sizes. The collectives are the
caller's (``fsdpfn/transforms/_unit_comm.py``), written once for the eager and the traced path,
so a codec works under ``loss.backward()``, ``torch.func.grad`` and ``torch.compile`` alike.

[Note: codec selection]
A plan asks the registered factories, in order, for each unit's codecs: the one named by
``MixedPrecision(codec=...)`` if any, then ``"fp8"`` (only for units with FP8 weights), then
``"plain"``. A factory ``factory(plan, unit) -> codec | None`` declines a unit with ``None``.
Codecs are named, not stored, so a plan stays plain data: its JSON carries the name, and a
process that has not registered it refuses the plan instead of running another wire format.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from fsdpfn._rows import chunk_bounds, unpack_rows

__all__ = [
    "GatherCodec",
    "PlainCodec",
    "PlainReduceCodec",
    "ReduceCodec",
    "cached",
    "codec_factories",
    "register_codec",
    "registered_codecs",
]


def cached(obj, name: str):
    """``obj.name`` of a ``functools.cached_property`` without its lock, which dynamo cannot
    enter (codecs are built and run while it traces a compiled step): the cached value if there
    is one, else, while dynamo traces, the value computed afresh (a pure function of a frozen
    value, so both are the same)."""
    value = obj.__dict__.get(name)
    if value is None:
        value = getattr(type(obj), name).func(obj) if torch.compiler.is_compiling() else getattr(obj, name)
    return value


class GatherCodec(abc.ABC):
    """Packs a unit's local shards into each rank's segment of its all-gather, and unpacks the
    gathered ``(W, numel)`` buffer into the unsharded parameters.

    Attributes:
      unit: the unit it packs.
      wire_dtype: dtype of the all-gather buffer.
      numel: elements of ``wire_dtype`` each rank contributes (0: no all-gather).
      amax_params: parameters whose scale needs their whole tensor's amax before packing: the
        caller all-reduces (max) :meth:`local_amax` over the axes
        :attr:`amax_roles` lists, then passes it to :meth:`encode` and :meth:`decode`.
    """

    unit: Any = None
    wire_dtype: torch.dtype
    numel: int
    amax_params: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes each rank contributes to the all-gather (which moves ``W`` times this)."""
        return self.numel * self.wire_dtype.itemsize

    @property
    def amax_roles(self) -> tuple:
        """The mesh axes (:class:`fsdpfn.Role` s) the amax of :attr:`amax_params` is
        all-reduced (max) over, in order: ``()`` without them; else the unit's own group
        (``shard``), then tp when one of them is split over tp too (a whole tensor's amax)."""
        # Imported here: the plan's values import this module, and a codec is asked only once a plan exists.
        from fsdpfn._plan.axes import Role
        from fsdpfn._plan.placements import split_roles

        if not self.amax_params:
            return ()
        unit = self.unit
        over_tp = unit is not None and any(Role.TP in split_roles(p) for p in unit.params if p.name in self.amax_params)
        return (Role.SHARD, Role.TP) if over_tp else (Role.SHARD,)

    def local_amax(self, locals_: list[torch.Tensor]) -> torch.Tensor | None:
        """This rank's float32 amax of each of :attr:`amax_params`, or ``None`` (no extra
        collective)."""
        return None

    @abc.abstractmethod
    def encode(self, locals_: list[torch.Tensor], amax: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's flat segment (``numel`` elements of ``wire_dtype``) from its local shards."""

    @abc.abstractmethod
    def decode(
        self,
        stacked: torch.Tensor | None,
        locals_: list[torch.Tensor],
        out: list[torch.Tensor] | None = None,
        amax: torch.Tensor | None = None,
    ) -> list:
        """The unsharded parameters in ``unit.params`` order, from every rank's segment
        (``stacked``: ``(W, numel)``, ``None`` when ``numel`` is 0), written into ``out`` if given."""


class ReduceCodec(abc.ABC):
    """Packs a unit's full gradients into the buffer of its reduce-scatter (all-reduce for a
    ``replicate`` unit), and unpacks this rank's reduced segment into local gradient shards.

    Attributes:
      unit: the unit it packs.
      wire_dtype: dtype of the reduce-scatter's input (what crosses the wire).
      accum_dtype: dtype the ranks' contributions are summed in. Equal to ``wire_dtype``: the
        collective sums. Wider: every rank's part crosses the wire in ``wire_dtype`` and is summed
        locally in ``accum_dtype`` (see :func:`fsdpfn.comm.reduce_scatter`), and under HSDP the
        replicate all-reduce runs on the sum, in ``accum_dtype``.
      numel: elements of each rank's reduced segment; the reduce-scatter's input is ``W`` of them.
    """

    unit: Any = None
    wire_dtype: torch.dtype
    accum_dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's segment on the wire (a reduce-scatter's input is ``W`` of them)."""
        return self.numel * self.wire_dtype.itemsize

    @abc.abstractmethod
    def encode(self, grads: list[torch.Tensor | None], w: int) -> torch.Tensor:
        """The flat input of the reduce (``w * numel`` elements of ``wire_dtype``, rank ``r``'s
        segment at ``[r numel, (r + 1) numel)``; ``numel`` for a ``replicate`` unit). ``None``
        gradients count as zeros."""

    @abc.abstractmethod
    def decode(self, reduced: torch.Tensor, rank: int, factor: float) -> list[torch.Tensor]:
        """This rank's local gradient shards in ``unit.params`` order, in each parameter's
        master dtype, scaled by ``factor``, from its reduced segment (in ``accum_dtype``)."""


class PlainCodec(GatherCodec):
    """A unit's sharded rows in the gather dtype, each parameter zero-padded to its chunk
    ([Note: flat-buffer layout]).

    Example:
      >>> codec = plan.gather_codec(plan.units[1])
      >>> type(codec).__name__, codec.wire_dtype, codec.nbytes == codec.numel * 4
      ('PlainCodec', torch.float32, True)
    """

    def __init__(self, unit, dtype: torch.dtype, wire_dtype: torch.dtype | None = None):
        self.unit, self.dtype = unit, dtype
        self.wire_dtype = dtype if wire_dtype is None else wire_dtype
        self.slots = cached(unit, "slots")
        self.numel = cached(unit, "shard_numel") if unit.sharded else 0

    def encode(self, locals_: list[torch.Tensor], amax=None) -> torch.Tensor:
        device = next((t.device for t in locals_), torch.device("cpu"))
        buf = torch.empty(self.numel, dtype=self.wire_dtype, device=device)
        for p, local in zip(self.unit.params, locals_):
            slot = self.slots[p.name]
            if slot.sharded:
                n = local.numel()
                buf[slot.offset : slot.offset + n].copy_(local.reshape(-1))
                buf[slot.offset + n : slot.offset + slot.size].zero_()
        return buf

    def decode(
        self, stacked: torch.Tensor | None, locals_: list[torch.Tensor], out=None, amax=None
    ) -> list[torch.Tensor]:
        fulls = []
        for i, (p, local) in enumerate(zip(self.unit.params, locals_)):
            slot = self.slots[p.name]
            if out is not None:
                full = out[i]
                unpack_rows(full.view(-1), stacked, slot.offset, slot.size) if slot.sharded else full.copy_(local)
            elif not slot.sharded:
                full = local.to(self.dtype, copy=True)
            elif stacked is None:  # nothing was gathered: the unit's sharded parameters have no elements
                full = torch.empty(p.local_shape, dtype=self.dtype, device=local.device)
            else:
                # Out of place, so that a traced gather stays recomputable in backward ([Note:
                # reshard-after-forward under torch.compile]); torch.chunk rows: every rank's
                # padding lies after the parameter's last row.
                full = stacked[:, slot.offset : slot.offset + slot.size].reshape(-1)[: p.numel].view(p.local_shape)
            fulls.append(full)
        return fulls


class PlainReduceCodec(ReduceCodec):
    """A unit's gradient rows in one dtype, each parameter zero-padded to its chunk as in the
    gather ([Note: flat-buffer layout]); replicated parameters fill the segment's tail whole.

    Example:
      >>> codec = plan.reduce_codec(plan.units[1])
      >>> type(codec).__name__, codec.wire_dtype, codec.accum_dtype
      ('PlainReduceCodec', torch.float32, torch.float32)
    """

    def __init__(self, unit, dtype: torch.dtype, accum_dtype: torch.dtype | None = None):
        self.unit, self.wire_dtype = unit, dtype
        self.accum_dtype = dtype if accum_dtype is None else accum_dtype
        self.slots = cached(unit, "slots")
        self.numel = cached(unit, "reduce_numel") if unit.sharded else unit.numel

    def encode(self, grads: list[torch.Tensor | None], w: int) -> torch.Tensor:
        unit, dtype = self.unit, self.wire_dtype
        device = next(
            (g.device for g in grads if g is not None), None
        )  # a missing gradient's zeros live beside the others
        if not unit.sharded:
            parts = [
                (g if g is not None else torch.zeros(p.local_shape, dtype=dtype, device=device)).reshape(-1).to(dtype)
                for p, g in zip(unit.params, grads)
            ]
            return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        buf = torch.zeros(w, self.numel, dtype=dtype, device=device)
        for p, g in zip(unit.params, grads):
            slot = self.slots[p.name]
            if g is None or not slot.size:
                continue
            dst = buf[:, slot.offset : slot.offset + slot.size]
            if not slot.sharded:
                dst.copy_(g.reshape(1, -1).expand(w, -1))
            else:
                _copy_rows(dst, g.reshape(-1), slot.size)
        return buf.view(-1)

    def decode(self, reduced: torch.Tensor, rank: int, factor: float) -> list[torch.Tensor]:
        shards = []
        for p in self.unit.params:
            slot = self.slots[p.name]
            start, stop = chunk_bounds(p.rows, self.unit.shard_size, rank) if slot.sharded else (0, p.rows)
            shape = (stop - start, *p.local_shape[1:]) if p.local_shape else ()
            n = (stop - start) * p.row_numel if p.local_shape else 1
            local = reduced[slot.offset : slot.offset + n].view(shape).to(p.dtype)
            shards.append(local * factor if factor != 1.0 else local.clone())
        return shards


def _copy_rows(dst: torch.Tensor, flat: torch.Tensor, size: int) -> None:
    """``flat`` (a parameter's rows) into the ``(W, size)`` column block ``dst`` of a wider
    buffer, rank ``r``'s chunk in row ``r``: with ``torch.chunk`` rows every rank's padding lies
    after the parameter's last row, so two copies at most (the inverse of ``unpack_rows``)."""
    full_ranks = flat.numel() // size
    if full_ranks:
        dst[:full_ranks].copy_(flat[: full_ranks * size].view(full_ranks, size))
    rest = flat.numel() - full_ranks * size
    if rest:
        dst[full_ranks, :rest].copy_(flat[full_ranks * size :])


# ---------------------------------------------------------------------------------------------
# Registry ([Note: codec selection])
# ---------------------------------------------------------------------------------------------

Factory = Callable[..., "GatherCodec | ReduceCodec | None"]
# Process state: the codec registry (register_codec), one per process as torch's operator
# registry is: a plan looks its codecs up by name.
_GATHER: dict[str, Factory] = {}
_REDUCE: dict[str, Factory] = {}


def register_codec(name: str, *, gather: Factory | None = None, reduce: Factory | None = None) -> None:
    """Makes ``MixedPrecision(codec=name)`` select these codecs: ``gather(plan, unit)`` returns a
    :class:`GatherCodec` for ``unit`` (or ``None``: the built-in one), ``reduce(plan, unit)`` a
    :class:`ReduceCodec` (or ``None``). Register in every process, before building the plan
    (its JSON names the codec; a process without it refuses the plan).

    Example:
      >>> fsdpfn.register_codec("bf16_wire", reduce=lambda plan, unit: PlainReduceCodec(unit, torch.bfloat16, torch.float32))
      >>> p = fsdpfn.plan(model, (1,), mp=fsdpfn.MixedPrecision(codec="bf16_wire"))
      >>> p.reduce_codec(p.units[1]).wire_dtype
      torch.bfloat16
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_codec: name must be a non-empty str, got {name!r}")
    if gather is None and reduce is None:
        raise ValueError(f"register_codec({name!r}): give a gather factory, a reduce factory, or both")
    for what, fn in (("gather", gather), ("reduce", reduce)):
        if fn is not None and not callable(fn):
            raise ValueError(f"register_codec({name!r}): {what} must be callable(plan, unit) -> codec or None")
    _GATHER.pop(name, None)
    _REDUCE.pop(name, None)
    if gather is not None:
        _GATHER[name] = gather
    if reduce is not None:
        _REDUCE[name] = reduce


def registered_codecs() -> tuple[str, ...]:
    """Names :func:`register_codec` has been given (the built-ins included)."""
    return tuple(dict.fromkeys([*_GATHER, *_REDUCE]))


def codec_factories(names, side: str) -> list[Factory]:
    """The ``side`` (``"gather"`` or ``"reduce"``) factories of ``names``, in order; a name
    without a factory on that side is skipped, an unknown name refused."""
    table = _GATHER if side == "gather" else _REDUCE
    known = registered_codecs()
    out = []
    for name in names:
        if name not in known:
            raise ValueError(
                f"codec {name!r} is not registered in this process (registered: {', '.join(known)}); "
                "call fsdpfn.register_codec(name, gather=..., reduce=...) before building or loading the plan"
            )
        if name in table:
            out.append(table[name])
    return out


def _plain_gather(plan, unit) -> PlainCodec:
    return PlainCodec(unit, plan.gather_dtype(unit))


def _plain_reduce(plan, unit) -> PlainReduceCodec:
    return PlainReduceCodec(unit, plan.reduce_dtype(unit))


register_codec("plain", gather=_plain_gather, reduce=_plain_reduce)
