"""The optax-style core: a transform is a NamedTuple of two pure functions.

``init(params) -> state`` and ``update(updates, state, params) -> (updates, state)``. Updates are
what :func:`apply_updates` adds to the parameters, so learning rate, sign and weight decay all
live inside ``update``. Nothing is modified in place: the caller owns every tree it passes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Union

import optree

from fsdpfn.optim._checks import check_transform
from fsdpfn.optim._tree import like, local, named_leaves

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "PartitionState",
    "apply_updates",
    "chain",
    "identity",
    "partition",
]


class GradientTransformation(NamedTuple):
    """A pair of pure functions.

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(updates, state, params=None) -> (updates, state)``.

    Example:
      >>> opt = fsdpfn.optim.sgd(0.1)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> fsdpfn.optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 0.9000])
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """Passes updates through unchanged.

    Example:
      >>> opt = fsdpfn.optim.identity()
      >>> opt.update({"w": torch.ones(1)}, opt.init({}))[0]
      {'w': tensor([1.])}
    """
    return GradientTransformation(lambda params: EmptyState(), lambda updates, state, params=None: (updates, state))


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, in each parameter's dtype; a ``None`` update (a leaf no
    transform touched) leaves its parameter as it is. DTensor leaves are added through their
    local tensors.

    Example:
      >>> fsdpfn.optim.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
      {'w': tensor([0.5000, 0.5000])}
    """
    leaves, spec = optree.tree_flatten(params)
    ups: list[Any] = spec.flatten_up_to(updates)
    out = []
    for p, u in zip(leaves, ups):
        if u is None:
            out.append(p)
            continue
        lp = local(p)
        out.append(like(p, lp + local(u).to(lp.dtype)))
    return optree.tree_unflatten(spec, out)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Runs ``transforms`` one after another; the state is the tuple of their states.

    Raises:
      ValueError: an argument is not a transform (e.g. a list of them: unpack it with
        ``chain(*transforms)``), raised when built.

    Example:
      >>> opt = fsdpfn.optim.chain(fsdpfn.optim.clip_by_global_norm(1.0), fsdpfn.optim.sgd(0.1))
      >>> state = opt.init({"w": torch.zeros(2)})
      >>> len(state)
      2
    """
    for i, t in enumerate(transforms):
        if isinstance(t, (list, tuple)) and not hasattr(t, "init"):
            raise ValueError(
                f"chain: argument {i} is a {type(t).__name__} of transforms; pass them as separate arguments, chain(*transforms)"
            )
        check_transform("chain", f"argument {i}", t)

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain: state has {len(state)} entries for {len(transforms)} transforms; was it made by this chain's init?"
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------
# partition
# ---------------------------------------------------------------------------------------------


class PartitionState(NamedTuple):
    """State of :func:`partition`: each label's inner state, over a tree where the leaves with
    other labels are ``None``."""

    inner_states: dict[str, Any]


Labels = Union[Any, Callable[[Any], Any]]


def _leaf_labels(tree: Any, labels: Labels, known: Mapping[str, Any]) -> tuple[list[str], Any]:
    names, leaves, spec = named_leaves(tree)
    tree_labels = labels(tree) if callable(labels) else labels
    try:
        flat = spec.flatten_up_to(tree_labels)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"partition: labels do not have the structure of the parameters ({e}). Give one label per "
            f"parameter leaf, e.g. {{{names[0]!r}: {next(iter(known))!r}, ...}}"
            if names
            else f"partition: bad labels ({e})"
        ) from None
    for name, label in zip(names, flat):
        if label not in known:
            raise ValueError(
                f"partition: parameter {name!r} has label {label!r}, which names no transform; "
                f"known labels: {sorted(known)}. Add a transform for it or relabel the parameter."
            )
    return flat, spec


def _mask(spec, leaves: list[Any], flat_labels: list[str], label: str) -> Any:
    return optree.tree_unflatten(spec, [x if lab == label else None for x, lab in zip(leaves, flat_labels)])


def partition(transforms: Mapping[str, GradientTransformation], labels: Labels) -> GradientTransformation:
    """Routes each leaf to the transform its label names.

    Each inner transform sees the full tree with every other label's leaves replaced by ``None``
    (optree skips ``None``), so it can be any transform, including ones that communicate.

    Args:
      transforms: ``{label: transform}``.
      labels: a tree shaped like the parameters with a label (str) per leaf, or a function of
        the parameters returning one.

    Returns:
      A transform whose state is :class:`PartitionState`.

    Raises:
      ValueError: when built, ``transforms`` is not a non-empty mapping of transforms or
        ``labels`` is ``None``; at ``init``/``update``, a leaf has no label or a label names no
        transform (the message names it).

    Example:
      >>> opt = fsdpfn.optim.partition(
      ...     {"fast": fsdpfn.optim.sgd(1.0), "slow": fsdpfn.optim.sgd(0.1)},
      ...     {"a": "fast", "b": "slow"})
      >>> params = {"a": torch.ones(1), "b": torch.ones(1)}
      >>> updates, _ = opt.update({"a": torch.ones(1), "b": torch.ones(1)}, opt.init(params), params)
      >>> updates
      {'a': tensor([-1.]), 'b': tensor([-0.1000])}
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise ValueError(f"partition: transforms must be a non-empty dict {{label: transform}}, got {transforms!r:.80}")
    for k, t in transforms.items():
        check_transform("partition", f"transforms[{k!r}]", t)
    if labels is None:
        raise ValueError(
            "partition: labels=None is invalid: pass a tree of labels shaped like the parameters, or a function of the parameters returning one"
        )
    transforms = dict(transforms)

    def init(params):
        flat_labels, spec = _leaf_labels(params, labels, transforms)
        leaves = spec.flatten_up_to(params)
        return PartitionState({k: t.init(_mask(spec, leaves, flat_labels, k)) for k, t in transforms.items()})

    def update(updates, state, params=None):
        flat_labels, spec = _leaf_labels(updates if params is None else params, labels, transforms)
        u_leaves = spec.flatten_up_to(updates)
        p_leaves = spec.flatten_up_to(params) if params is not None else None
        out = list(u_leaves)
        new_states = {}
        for k, t in transforms.items():
            masked_p = None if p_leaves is None else _mask(spec, p_leaves, flat_labels, k)
            new_u, new_states[k] = t.update(_mask(spec, u_leaves, flat_labels, k), state.inner_states[k], masked_p)
            for i, (lab, v) in enumerate(zip(flat_labels, spec.flatten_up_to(new_u))):
                if lab == k:
                    out[i] = v
        return optree.tree_unflatten(spec, out), PartitionState(new_states)

    return GradientTransformation(init, update)
