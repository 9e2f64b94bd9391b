"""Leaf helpers shared by the transforms: DTensor leaves are handled through their local tensors.

[Note: local math on DTensor leaves]
Optimizer math is elementwise on leaves that are sharded alike (grads, params and state share
placements), so it runs on the local tensors and the result is wrapped back into a DTensor with
the same spec (only the dtype may change). That costs nothing beyond the arithmetic, never goes
through DTensor's sharding propagation, and works the same on plain tensors (world size 1).
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def local(x: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor leaf, or the leaf itself."""
    return x._local_tensor if isinstance(x, DTensor) else x


def like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor) wrapped like ``ref``: a DTensor with ``ref``'s mesh, placements
    and global shape (in ``value``'s dtype) if ``ref`` is one, else ``value`` itself."""
    if not isinstance(ref, DTensor):
        return value
    spec = ref._spec
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != value.dtype:
        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, value.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(value, spec, requires_grad=False)


def map_local(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` of ``fn`` over local tensors; results are wrapped like ``tree``'s
    leaves. ``None`` (a masked leaf, see :func:`fsdpfn.optim.partition`) stays ``None``."""

    def leaf(x, *ys):
        return like(x, fn(local(x), *(local(y) for y in ys)))

    return optree.tree_map(leaf, tree, *rest)


def zeros_like_tree(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Zeros shaped and placed like every leaf of ``tree``."""
    return map_local(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def path_name(path: tuple) -> str:
    """``("blocks", 0, "fc", "weight")`` -> ``"blocks.0.fc.weight"``; a dict key holding dots is
    kept as is, so ``{"blocks.0.fc.weight": p}`` gives ``"blocks.0.fc.weight"``."""
    return ".".join(str(k) for k in path)


def named_leaves(tree: Any) -> tuple[list[str], list[Any], Any]:
    """``(names, leaves, treespec)`` of ``tree``; names are :func:`path_name` of each path."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return [path_name(p) for p in paths], leaves, spec


def _entry_name(entry: Any) -> str:
    for attr in ("field", "name", "key", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry.entry)


def flat_state(tree: Any) -> tuple[dict[str, Any], Any]:
    """``({path: leaf}, treespec)`` with paths of ``/``-joined NamedTuple fields, dict keys and
    indices (``"inner_states/muon/0/momentum_buffer/blocks.0.fc.weight"``), the keys
    ``fsdpfn.checkpoint`` uses too; ``None`` (masked) leaves are not entries.

    Example:
      >>> flat_state(({"w": 1}, 2))[0]
      {'0/w': 1, '1': 2}
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    return {"/".join(_entry_name(e) for e in a) or "<root>": x for a, x in zip(accessors, leaves)}, spec
