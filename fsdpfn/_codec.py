"""Gather codecs: how a unit's shards are packed into the bytes one all-gather moves, and
unpacked into the unsharded parameters after it.

Each unit has one codec (:meth:`fsdpfn.Plan.gather_codec`), so the gather has one path
whatever the unit ships: :class:`PlainCodec` (rows in the gather dtype, [Note: flat-buffer
layout]) or :class:`fsdpfn.fp8.Float8Codec` (E4M3 bytes and scales, [Note: FP8 gather
layout]). A codec is pure: it packs and unpacks tensors and states its size; the collectives
(the all-gather, the per-tensor amax all-reduce a codec may ask for) are the caller's.

Every codec has: ``wire_dtype`` and ``numel`` (elements each rank contributes; ``nbytes`` in
bytes), ``amax_params`` (parameters whose scale needs an all-reduced amax first),
``local_amax(locals_)``, ``encode(locals_, amax) -> flat buffer`` and
``decode(stacked, locals_, out, amax) -> unsharded parameters``.
"""

from __future__ import annotations

import torch

from fsdpfn._rows import unpack_rows

__all__ = ["PlainCodec"]


class PlainCodec:
    """A unit's sharded rows in the gather dtype, each parameter zero-padded to its chunk.

    Example:
      >>> codec = plan.gather_codec(plan.units[1])
      >>> type(codec).__name__, codec.wire_dtype, codec.nbytes == codec.numel * 4
      ('PlainCodec', torch.float32, True)
    """

    amax_params: tuple[str, ...] = ()

    def __init__(self, unit, dtype: torch.dtype):
        self.unit, self.wire_dtype = unit, dtype
        self.numel = unit.shard_numel if unit.sharded else 0
        self.nbytes = self.numel * dtype.itemsize

    def local_amax(self, locals_):
        return None

    def encode(self, locals_: list[torch.Tensor], amax=None) -> torch.Tensor:
        device = next((t.device for t in locals_), torch.device("cpu"))
        buf = torch.empty(self.numel, dtype=self.wire_dtype, device=device)
        for p, local in zip(self.unit.params, locals_):
            slot = self.unit.slots[p.name]
            if slot.sharded:
                n = local.numel()
                buf[slot.offset : slot.offset + n].copy_(local.reshape(-1))
                buf[slot.offset + n : slot.offset + slot.size].zero_()
        return buf

    def decode(self, stacked: torch.Tensor | None, locals_: list[torch.Tensor], out=None, amax=None) -> list[torch.Tensor]:
        device = next((t.device for t in locals_), torch.device("cpu"))
        fulls = []
        for i, (p, local) in enumerate(zip(self.unit.params, locals_)):
            full = out[i] if out is not None else torch.empty(p.local_shape, dtype=self.wire_dtype, device=device)
            slot = self.unit.slots[p.name]
            if slot.sharded:
                unpack_rows(full.view(-1), stacked, slot.offset, slot.size)
            else:
                full.copy_(local)
            fulls.append(full)
        return fulls
