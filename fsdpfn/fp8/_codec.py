"""The FP8 gather codec: a unit's weights packed as E4M3 bytes plus their recipe's scales for
one all-gather, and unpacked (dequantized, or handed to Transformer Engine) after it: a
:class:`fsdpfn.GatherCodec`, registered as ``"fp8"`` ([Note: codec selection] in
``fsdpfn/_codec.py``; it declines units without FP8 weights).

See [Note: FP8 gather layout] in ``fsdpfn/_plan/values.py`` for the byte layout and
[Note: FP8 gather] in ``fsdpfn/transforms/_sharding.py`` for when quantizing happens. Pure
tensor code: the per-tensor recipe's amax all-reduce is the caller's (``amax_params`` says
which parameters need it, :meth:`Float8Codec.local_amax` gives this rank's part).
"""

from __future__ import annotations

import dataclasses

import torch

from fsdpfn._codec import GatherCodec, cached, register_codec
from fsdpfn._rows import unpack_rows
from fsdpfn.fp8._recipes import Quantized
from fsdpfn.fp8._te import te_tensor

__all__ = ["ByteSlot", "Float8Codec", "Float8Layout", "float8_layout"]


@dataclasses.dataclass(frozen=True)
class ByteSlot:
    """Where one parameter sits in each rank's byte segment of an FP8 unit's all-gather (see
    [Note: FP8 gather layout]). Offsets and sizes are bytes.

    Attributes:
      fp8: ``True``: E4M3 bytes at ``offset`` and scales at ``scale_offset``; ``False``: the
        parameter's rows in ``param_dtype`` at ``offset``.
      chunk_rows: rows per rank (``ceil(rows / W)``), as in :class:`Slot`.
      size, scale_size: bytes reserved per rank.
    """

    fp8: bool
    chunk_rows: int
    offset: int
    size: int
    scale_offset: int = 0
    scale_size: int = 0


@dataclasses.dataclass(frozen=True)
class Float8Layout:
    """The byte layout of an FP8 unit's all-gather segment: ``slots`` (sharded parameters) and
    ``segment_bytes`` (what each rank contributes; the all-gather moves ``W`` of them).
    ``amax_params``: parameters whose per-tensor scale needs the all-reduced amax first."""

    slots: dict
    segment_bytes: int
    amax_params: tuple[str, ...]


def float8_layout(unit, policy, dtype: torch.dtype) -> Float8Layout:
    """The byte layout of ``unit``'s FP8 all-gather segment (see [Note: FP8 gather layout] in
    ``fsdpfn/_plan/values.py``): regions ordered by alignment, every region viewable in place."""
    recipe = policy.recipe
    fp8 = set(unit.fp8)
    unit_slots = cached(unit, "slots")
    regions = []  # (alignment, parameter, kind, bytes), stably sorted by alignment below
    for p in unit.params:
        slot = unit_slots[p.name]
        if not slot.sharded:
            continue
        if p.name in fp8:
            lines = slot.chunk_rows * (p.row_numel // p.local_shape[-1])
            regions.append((1, p.name, "data", slot.chunk_rows * p.row_numel))
            scales = lines * recipe.scales_per_line(p.local_shape[-1]) * recipe.scale_dtype.itemsize
            if scales:
                regions.append((recipe.scale_dtype.itemsize, p.name, "scale", scales))
        else:
            regions.append((dtype.itemsize, p.name, "param", slot.size * dtype.itemsize))
    regions.sort(key=lambda r: -r[0])
    offsets: dict[tuple[str, str], tuple[int, int]] = {}
    offset = 0
    for _, name, kind, nbytes in regions:
        offsets[(name, kind)] = (offset, nbytes)
        offset += nbytes
    align = max([1] + [r[0] for r in regions])  # (no default=: dynamo traces this when a compiled gather builds it)
    slots = {}
    for p in unit.params:
        slot = unit_slots[p.name]
        if not slot.sharded:
            continue
        if p.name in fp8:
            off, size = offsets[(p.name, "data")]
            s_off, s_size = offsets.get((p.name, "scale"), (0, 0))
            slots[p.name] = ByteSlot(True, slot.chunk_rows, off, size, s_off, s_size)
        else:
            off, size = offsets[(p.name, "param")]
            slots[p.name] = ByteSlot(False, slot.chunk_rows, off, size)
    amax = tuple(p.name for p in unit.params if p.name in fp8) if recipe.tensorwise else ()
    return Float8Layout(slots, -(-offset // align) * align, amax)


def _region(stacked: torch.Tensor | None, offset: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's ``[offset, offset + size)`` bytes of the gathered ``(W, segment)`` uint8
    buffer, viewed in ``dtype``: ``(W, size / itemsize)``, no copy (the layout keeps it aligned)."""
    assert stacked is not None  # a gathered slot makes the segment non-empty
    seg = stacked[:, offset : offset + size]
    return seg.view(dtype) if dtype != torch.uint8 else seg


class Float8Codec(GatherCodec):
    """A unit's FP8 weights as E4M3 bytes and scales, the rest in the gather dtype.

    Example:
      >>> mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, fp8="mxfp8")
      >>> p8 = fsdpfn.plan(model, (2,), mp=mp)
      >>> codec = p8.gather_codec(p8.units[1])
      >>> type(codec).__name__, codec.wire_dtype, codec.nbytes == codec.layout.segment_bytes
      ('Float8Codec', torch.uint8, True)
    """

    wire_dtype = torch.uint8

    def __init__(self, unit, layout: Float8Layout, policy, dtype: torch.dtype):
        self.unit, self.layout, self.policy, self.dtype = unit, layout, policy, dtype
        self.recipe = policy.recipe
        self.numel = layout.segment_bytes
        self.amax_params = layout.amax_params

    def local_amax(self, locals_: list[torch.Tensor]) -> torch.Tensor | None:
        """This rank's amax of each of ``amax_params`` (float32, NaN and inf as inf: gloo's max
        drops NaN), to be all-reduced (max) over every rank holding a piece of the tensor."""
        if not self.amax_params:
            return None
        local = {p.name: x for p, x in zip(self.unit.params, locals_)}
        vals = []
        for name in self.amax_params:
            x = local[name].to(self.dtype)
            a = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
            vals.append(torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf"))))
        return torch.stack(vals)

    def _amax(self, amax: torch.Tensor | None) -> dict:
        return {} if amax is None else dict(zip(self.amax_params, amax.unbind()))

    def encode(self, locals_: list[torch.Tensor], amax: torch.Tensor | None = None) -> torch.Tensor:
        device = next((t.device for t in locals_), torch.device("cpu"))
        amaxes = self._amax(amax)
        buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for p, local in zip(self.unit.params, locals_):
            slot = self.layout.slots.get(p.name)
            if slot is None:  # replicated (0-d): not gathered
                continue
            x = local.to(self.dtype)
            if not slot.fp8:
                buf[slot.offset : slot.offset + slot.size].view(self.dtype)[: x.numel()].copy_(x.reshape(-1))
                continue
            if not x.numel():
                continue
            q = self.recipe.quantize(x.reshape(-1, p.local_shape[-1]), amax=amaxes.get(p.name))
            data = q.data.view(torch.uint8).reshape(-1)
            buf[slot.offset : slot.offset + data.numel()].copy_(data)
            if slot.scale_size:
                scale = q.scale.reshape(-1).view(torch.uint8)
                buf[slot.scale_offset : slot.scale_offset + scale.numel()].copy_(scale)
        return buf

    def decode(
        self, stacked: torch.Tensor | None, locals_: list[torch.Tensor], out=None, amax: torch.Tensor | None = None
    ) -> list:
        device = next((t.device for t in locals_), torch.device("cpu"))
        amaxes = self._amax(amax)
        te = self.policy.backend == "te" and out is None
        fulls = []
        for i, (p, local) in enumerate(zip(self.unit.params, locals_)):
            slot = self.layout.slots.get(p.name)
            target = out[i] if out is not None else None
            if slot is None:
                full = target if target is not None else torch.empty(p.local_shape, dtype=self.dtype, device=device)
                full.copy_(local)
            elif not slot.fp8:
                full = target if target is not None else torch.empty(p.local_shape, dtype=self.dtype, device=device)
                rows = _region(stacked, slot.offset, slot.size, self.dtype)
                unpack_rows(full.view(-1), rows, 0, rows.shape[1])
            else:
                full = self._dequantize(p, slot, stacked, device, amaxes.get(p.name), target, te)
            fulls.append(full)
        return fulls

    def _dequantize(self, p, slot, stacked, device, amax, target, te: bool):
        """One FP8 parameter from the gathered bytes: its E4M3 rows and scales, in the whole
        weight's row-major order (the first ``rows`` of the ``W * chunk_rows`` gathered rows),
        dequantized into ``target`` (or a new tensor), or handed to Transformer Engine."""
        recipe, n = self.recipe, p.local_shape[-1]
        data = torch.empty(p.numel, dtype=torch.uint8, device=device)
        unpack_rows(data, _region(stacked, slot.offset, slot.size, torch.uint8), 0, slot.size)
        lines = data.view(-1, n)  # FP8 weights have elements (the plan selects numel > 0)
        if recipe.tensorwise:
            # The scale from the all-reduced amax, as every rank computed it when quantizing.
            scale = recipe.quantize(torch.zeros(1, device=device), amax=amax).scale
        else:
            item = recipe.scale_dtype.itemsize
            raw = torch.empty(lines.shape[0] * recipe.scales_per_line(n) * item, dtype=torch.uint8, device=device)
            unpack_rows(raw, _region(stacked, slot.scale_offset, slot.scale_size, torch.uint8), 0, slot.scale_size)
            scale = raw.view(recipe.scale_dtype).view(lines.shape[0], -1)
        qd = Quantized(lines.view(torch.float8_e4m3fn), scale)
        values = recipe.dequantize(qd, self.dtype).view(p.local_shape)
        if te:
            return te_tensor(recipe, qd, p.local_shape, self.dtype, values)
        if target is None:
            return values
        target.copy_(values)
        return target


def _fp8_gather(plan, unit) -> Float8Codec | None:
    if not unit.fp8:
        return None
    dtype = plan.gather_dtype(unit)
    return Float8Codec(unit, float8_layout(unit, plan.mp.fp8, dtype), plan.mp.fp8, dtype)


register_codec("fp8", gather=_fp8_gather)
