"""Flattening a module's inputs and outputs into tensors and back.

[Note: mapping outputs]
optree knows ``dict``, ``OrderedDict`` and ``defaultdict`` by their exact types; any other
mapping, a ``dict`` subclass included, is one opaque leaf. Hugging Face models return
``ModelOutput`` (an ``OrderedDict`` subclass and a dataclass), so a runtime that looked for the
output's tensors with plain ``optree.tree_flatten`` found none: the loss was computed from
tensors that bypassed the runtime's root node, and the step failed with a misleading "its output
does not reach the loss". :func:`flatten` flattens every mapping, whatever its class: a mapping
type optree does not know is registered (in fsdpfn's own optree namespace, so nothing global
changes) the first time it is met, flattened by its keys in their own order, and rebuilt as
``cls(**items)`` for dataclasses (``ModelOutput``) or ``cls(items)`` otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optree

__all__ = ["NAMESPACE", "flatten", "unflatten"]

NAMESPACE = "fsdpfn"
# Process state: the types registered in optree's namespace, whose registry is the process's.
_REGISTERED: set[type] = set()


def _rebuild(cls: type):
    def unflatten(keys, values):
        items = dict(zip(keys, values))
        try:
            return cls(**items) if dataclasses.is_dataclass(cls) else cls(items)
        except Exception as e:  # noqa: BLE001 - re-raised with the fix
            raise ValueError(
                f"cannot rebuild a {cls.__module__}.{cls.__qualname__} from its items ({type(e).__name__}: {e}): a "
                "mapping a module returns or receives must be constructible as cls(items) (or cls(**items) for a "
                f"dataclass). Return a plain dict, or register {cls.__qualname__} with "
                f"optree.register_pytree_node(..., namespace={NAMESPACE!r})"
            ) from e

    return unflatten


def _register(cls: type) -> None:
    if cls in _REGISTERED:
        return
    _REGISTERED.add(cls)
    optree.register_pytree_node(
        cls,
        # cls is a Mapping subclass; optree's stub types m as a Collection
        lambda m: (list(m.values()), tuple(m.keys()), tuple(m.keys())),  # type: ignore[attr-defined]
        _rebuild(cls),
        namespace=NAMESPACE,
    )


def flatten(tree: Any, none_is_leaf: bool = False) -> tuple[list, Any]:
    """``optree.tree_flatten(tree)``, with every mapping flattened (see [Note: mapping outputs]).

    Example:
      >>> import collections
      >>> class Output(collections.OrderedDict):
      ...     pass
      >>> leaves, spec = flatten(Output(logits=torch.ones(1), loss=torch.zeros(())))
      >>> leaves
      [tensor([1.]), tensor(0.)]
      >>> type(unflatten(spec, leaves)).__name__
      'Output'
    """
    while True:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=none_is_leaf, namespace=NAMESPACE)
        unknown = {type(x) for x in leaves if isinstance(x, Mapping)} - _REGISTERED
        if not unknown:
            return leaves, spec
        for cls in unknown:
            _register(cls)


def unflatten(spec: Any, leaves: list) -> Any:
    """The inverse of :func:`flatten`.

    Example:
      >>> leaves, spec = flatten({"a": torch.ones(1)})
      >>> unflatten(spec, [torch.zeros(1)])
      {'a': tensor([0.])}
    """
    return optree.tree_unflatten(spec, leaves)
