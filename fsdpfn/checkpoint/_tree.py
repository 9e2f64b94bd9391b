"""Training state as path-keyed entries.

[Note: checkpoints keyed by path]
A checkpoint stores each leaf of the state pytree under its path ("params/blocks.0.fc.weight",
"opt_state/0/mu/blocks.0.fc.weight", "step"), never by flat-buffer offsets. DCP records each
tensor's global shape and which slice every rank wrote, so a different plan or world size reads
back the slices it needs by path: resharding across plans comes free. Paths are built from
mapping keys, sequence indices and NamedTuple/dataclass field names, so they stay readable
and survive a change of optimizer-state container as long as the field names do.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["flatten_state", "is_json_leaf"]

_JSON_LEAVES = (bool, int, float, str)


def _entry_name(entry: Any) -> str:
    for attr in ("field", "name", "key", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry.entry)


def _path(accessor: Any) -> str:
    return "/".join(_entry_name(e) for e in accessor) or "<root>"


def is_json_leaf(x: Any) -> bool:
    return isinstance(x, _JSON_LEAVES)


def flatten_state(state: Any) -> tuple[dict[str, Any], optree.PyTreeSpec]:
    """``({path: leaf}, treespec)`` of a state pytree; leaves are tensors or JSON scalars.

    Example:
      >>> entries, _ = flatten_state({"params": {"w": torch.zeros(2)}, "step": 3})
      >>> sorted(entries)
      ['params/w', 'step']
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(state)
    entries: dict[str, Any] = {}
    for accessor, leaf in zip(accessors, leaves):
        path = _path(accessor)
        if not isinstance(leaf, torch.Tensor) and not is_json_leaf(leaf):
            raise ValueError(
                f"state leaf {path!r} is a {type(leaf).__name__}; checkpoints hold tensors, DTensors "
                "and bool/int/float/str values. Convert it (e.g. to a tensor) or leave it out of the state."
            )
        if path in entries:
            raise ValueError(f"two state leaves have the same path {path!r}; rename one of the keys")
        entries[path] = leaf
    return entries, spec
