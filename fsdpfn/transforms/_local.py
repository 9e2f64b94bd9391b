"""Where a rank's shard of a parameter sits in the full tensor: one slice per dim.

A rank's shard is cut in two steps (see [Note: flat-buffer layout] in ``fsdpfn/_plan/values.py``):
first its tensor-parallel part (the ``tp_rank``-th of ``tp`` equal slices along the parameter's tp
dim: rows for ``shard0``, columns for ``shard1``), then its ``torch.chunk`` rows of that part over
the data-parallel shard axis. Both steps are slices, so the shard is one box of the full tensor:
rows ``tp_offset + [start, stop)`` for ``shard0``, rows ``[start, stop)`` by columns
``[tp_rank * n, (tp_rank + 1) * n)`` for ``shard1``. Code that builds shards from something it can
index (a freshly initialised full tensor, a safetensors slice) reads exactly that box and nothing
else.
"""

from __future__ import annotations

import torch

from fsdpfn._plan.placements import local_box
from fsdpfn._plan import Plan
from fsdpfn.transforms._axes import axis_index, unit_rank

__all__ = ["local_index", "local_shape"]


def local_index(plan: Plan, name: str, *, rank: int | None = None, tp: int | None = None) -> tuple[slice, ...]:
    """The box of the full parameter ``name`` that shard rank ``rank`` at tensor-parallel position
    ``tp`` holds (default: this process's), as one ``slice`` per leading dim it cuts: ``()`` for a
    0-d parameter, ``(rows,)`` or ``(rows, columns)`` otherwise. ``full[local_index(...)]`` equals
    the local tensor :func:`fsdpfn.shard` keeps. ``tp`` is the position on whichever axis
    splits the parameter (its ep index for an expert weight); the box is composed from its
    placements by :func:`fsdpfn._plan.placements.local_box`.

    Example:
      >>> local_index(plan, "blocks.0.fc.weight")  # 1 rank, no tp: everything
      (slice(0, 128, None),)
    """
    spec = plan.param(name)
    if not spec.shape:
        return ()
    unit = plan.unit_of(name)
    rank = unit_rank(plan, unit) if rank is None else rank
    box = local_box(spec, unit.local_rows(name, rank), axis_index(plan, spec, tp))
    if box is None:
        fused = next(e for e in spec.placements if e.placement.offsets(spec.shape, e.size, 0) is None)
        raise NotImplementedError(
            f"parameter {name!r} is split colwise_fused:{fused.placement.parts}: each {fused.axis.value} rank holds "
            f"{fused.placement.parts} slices of it, not one box, and building shards box by box (fsdpfn.init_shards, "
            "fsdpfn.load_safetensors) does not read those yet. Build the full model (or load it with from_pretrained) and "
            "call fsdpfn.shard(model, plan)"
        )
    return box


def local_shape(plan: Plan, name: str, index: tuple[slice, ...]) -> torch.Size:
    """The shape of ``full[index]`` for parameter ``name``, without a tensor."""
    shape = list(plan.param(name).shape)
    for d, s in enumerate(index):
        start, stop, _ = s.indices(shape[d])
        shape[d] = max(stop - start, 0)
    return torch.Size(shape)
