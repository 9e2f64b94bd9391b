"""Skipping non-finite steps, on every rank alike: :func:`apply_if_finite`.

[Note: one decision for every rank]
A NaN or inf usually shows up in one rank's gradient shard only. If each rank decided alone, the
rank holding it would skip the update while its peers applied theirs: the shards of one
parameter would come from different steps, and an inner transform that communicates (Muon's
Newton–Schulz, the global norm) would run on some ranks and not on others, a hang. So each rank
reduces one flag, "some leaf here is not finite", with a max over the ranks that hold its leaves:
one 1-element all-reduce per update, whatever the number of leaves. Every rank then takes the
same branch, skips or updates, and keeps the same counts, so after too many skips in a row all
ranks raise together.

Which ranks: those of every mesh a DTensor leaf lives on (as :func:`global_norm` finds the meshes
of its leaves), over all the mesh's dimensions, replicate dimensions included, so that replicas
agree even if their gradients somehow differ. For a pipeline stage's leaves that is the whole
pipelined mesh, pp axis included: every stage skips the same steps. A mesh spanning every process, the usual case,
HSDP included, reduces over the default group: one collective. A mesh over fewer processes
reduces over each of its dimensions in turn (one collective per dimension). Plain-tensor leaves
are this rank's alone, as in :func:`global_norm`: a run that keeps replicated plain tensors
(all-reduced gradients) gets the same verdict on every rank from the same values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor

from fsdpfn import comm as C
from fsdpfn._plan.stage_mesh import pipeline_of
from fsdpfn.optim._base import GradientTransformation
from fsdpfn.optim._checks import check_int, check_transform
from fsdpfn.optim._tree import local, map_local, named_leaves

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`: optax's fields, as host values equal on every rank.

    Attributes:
      notfinite_count: non-finite steps in a row, the last step included (0 after a finite one).
      last_finite: whether the last step's gradients were finite everywhere.
      total_notfinite: non-finite (skipped) steps since ``init``; never reset.
      inner_state: the inner transform's state, left as it was by every skipped step.
    """

    notfinite_count: int
    last_finite: bool
    total_notfinite: int
    inner_state: Any


def _flag_groups(leaves: list[Any]) -> list[Any]:
    """The process groups to reduce the flag over (see [Note: one decision for every rank])."""
    meshes: dict[int, Any] = {}
    for x in leaves:
        if isinstance(x, DTensor):
            # a stage's leaves: the whole pipelined mesh decides (see [Note: a stage's
            # parameters are part of one model])
            piped = pipeline_of(x.device_mesh)
            mesh = x.device_mesh if piped is None else piped[0]
            meshes.setdefault(id(mesh), mesh)
    groups: dict[int, Any] = {}
    for mesh in meshes.values():  # first-seen order: the same on every rank
        if mesh.size() == 1:
            continue
        if mesh.size() == C.world_size():
            return [None]  # the default group spans this mesh and every other one
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                group = mesh.get_group(d)
                groups.setdefault(id(group), group)
    return list(groups.values())


def _local_flags(leaves: list[Any]) -> torch.Tensor:
    """One bool per leaf: some element of this rank's part of it is NaN or inf."""
    if not leaves:
        return torch.zeros(0, dtype=torch.bool)
    device = local(leaves[0]).device
    return torch.stack([~torch.isfinite(local(x)).all().to(device) for x in leaves])


def all_finite(tree: Any) -> tuple[bool, torch.Tensor]:
    """Whether every leaf of ``tree`` is finite on every rank holding leaves of it, and this
    rank's per-leaf flags (``True``: not finite here). One all-reduce (max) of one element; a
    host sync to read it."""
    leaves = optree.tree_leaves(tree)
    flags = _local_flags(leaves)
    bad = flags.any().to(torch.int32).reshape(1)
    for group in _flag_groups(leaves):
        C.all_reduce(bad, group, op="max", tag="apply_if_finite")
    return not bool(bad.item()), flags


def _give_up(count: int, total: int, max_errors: int, tree: Any, flags: torch.Tensor) -> FloatingPointError:
    names, _, _ = named_leaves(tree)
    here = [n for n, bad in zip(names, flags.tolist()) if bad]
    where = (
        f"non-finite on this rank: {', '.join(repr(n) for n in here[:5])}{' ...' if len(here) > 5 else ''}"
        if here
        else ("finite on this rank, so the NaN/inf is on another rank")
    )
    return FloatingPointError(
        f"apply_if_finite: {count} step{'s' if count != 1 else ''} in a row had non-finite (NaN or inf) gradients, more than "
        f"max_consecutive_errors={max_errors}; {total} non-finite steps in all. Gradients {where}. Try a lower "
        "learning rate or a warm-up, clip_by_global_norm, an fp32 loss (bf16/fp16 overflow), or look for a bad "
        "batch; raise max_consecutive_errors to skip more steps in a row."
    )


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Wraps ``inner`` so that a step whose gradients hold a NaN or inf is skipped on every rank.

    optax's ``apply_if_finite``, distributed: the update is skipped when any leaf on any rank is
    not finite (one 1-element all-reduce per update, [Note: one decision for every rank]), and a
    skipped update is zeros with ``inner``'s state left exactly as it was (``inner`` does not
    run, so it starts no collective either). A finite step resets ``notfinite_count`` and runs
    ``inner``: it is the step ``inner`` would have taken had the skipped steps never happened.
    As in optax, ``max_consecutive_errors`` non-finite steps in a row are skipped; at the next
    one optax gives up and applies the NaNs, whereas this raises ``FloatingPointError``, on every
    rank at the same step, because a run that keeps getting NaNs is broken and a NaN parameter
    would only hide where it began.

    Put it around the whole optimizer, ``apply_if_finite(chain(clip_by_global_norm(1.0),
    adamw(1e-3)), 5)``, or after a clip to also catch finite gradients whose norm overflows (see
    :func:`clip_by_global_norm`). Reading the flag is one host sync per step.

    Args:
      inner: the transform to guard.
      max_consecutive_errors: non-finite steps in a row to skip, an int >= 0; one more raises.

    Returns:
      A transform whose state is :class:`ApplyIfFiniteState`.

    Raises:
      ValueError: when built, ``inner`` is not a transform or ``max_consecutive_errors`` is not
        an int >= 0.
      FloatingPointError: from ``update``, on every rank, at the ``max_consecutive_errors + 1``-th
        non-finite step in a row; the message says how many and what to try.

    Example:
      >>> opt = fsdpfn.optim.apply_if_finite(fsdpfn.optim.sgd(0.1), max_consecutive_errors=2)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.tensor([1.0, float("nan")])}, state, params)
      >>> updates["w"], state.notfinite_count, state.last_finite, state.total_notfinite
      (tensor([0., 0.]), 1, False, 1)
      >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> updates["w"], state.notfinite_count, state.total_notfinite
      (tensor([-0.1000, -0.1000]), 0, 1)

    References:
      optax ``apply_if_finite`` (``optax/transforms/_conditionality.py``).
    """
    check_transform("apply_if_finite", "inner", inner)
    max_errors = check_int(
        "apply_if_finite",
        "max_consecutive_errors",
        max_consecutive_errors,
        lo=0,
        fix="It is how many non-finite steps in a row are skipped before raising; 0 raises at the first.",
    )

    def init(params):
        return ApplyIfFiniteState(0, True, 0, inner.init(params))

    def update(updates, state, params=None):
        finite, flags = all_finite(updates)
        if finite:
            new_updates, inner_state = inner.update(updates, state.inner_state, params)
            return new_updates, ApplyIfFiniteState(0, True, state.total_notfinite, inner_state)
        count, total = state.notfinite_count + 1, state.total_notfinite + 1
        if count > max_errors:
            raise _give_up(count, total, max_errors, updates, flags)
        zeros = map_local(torch.zeros_like, updates)
        return zeros, ApplyIfFiniteState(count, False, total, state.inner_state)

    return GradientTransformation(init, update)
