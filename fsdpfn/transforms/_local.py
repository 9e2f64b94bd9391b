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

from fsdpfn._plan import Plan
from fsdpfn.transforms._axes import ep_rank, unit_rank
from fsdpfn.transforms._sharding import tp_rank

__all__ = ["local_index", "local_shape"]


def local_index(plan: Plan, name: str, *, rank: int | None = None, tp: int | None = None) -> tuple[slice, ...]:
    """The box of the full parameter ``name`` that shard rank ``rank`` at tensor-parallel position
    ``tp`` holds (default: this process's), as one ``slice`` per leading dim it cuts: ``()`` for a
    0-d parameter, ``(rows,)`` or ``(rows, columns)`` otherwise. ``full[local_index(...)]`` equals
    the local tensor :func:`fsdpfn.shard` keeps.

    Example:
      >>> local_index(plan, "blocks.0.fc.weight")  # 1 rank, no tp: everything
      (slice(0, 128, None),)
    """
    spec = plan.param(name)
    if not spec.shape:
        return ()
    unit = plan.unit_of(name)
    rank = unit_rank(plan, unit) if rank is None else rank
    start, stop = unit.local_rows(name, rank)
    if spec.expert:  # rows of this rank's experts (``tp`` is its ep index here)
        e = ep_rank(plan) if tp is None else tp
        n = spec.local_shape[0]
        return (slice(e * n + start, e * n + stop),)
    d = spec.tp_dim
    if d is None:
        return (slice(start, stop),)
    if spec.tp_stride > 1:
        raise NotImplementedError(
            f"parameter {name!r} is split colwise_fused:{spec.tp_stride}: each tp rank holds {spec.tp_stride} slices of it, not "
            "one box, and building shards box by box (fsdpfn.init_shards, fsdpfn.load_safetensors) does not read those yet. "
            "Build the full model (or load it with from_pretrained) and call fsdpfn.shard(model, plan)"
        )
    t = tp_rank(plan) if tp is None else tp
    n = spec.local_shape[d]
    if d == 0:
        return (slice(t * n + start, t * n + stop),)
    return (slice(start, stop), *(slice(None),) * (d - 1), slice(t * n, (t + 1) * n))


def local_shape(plan: Plan, name: str, index: tuple[slice, ...]) -> torch.Size:
    """The shape of ``full[index]`` for parameter ``name``, without a tensor."""
    shape = list(plan.param(name).shape)
    for d, s in enumerate(index):
        start, stop, _ = s.indices(shape[d])
        shape[d] = max(stop - start, 0)
    return torch.Size(shape)
