"""save / load: training state <-> a DCP checkpoint directory, collectively, atomically.

See [Note: checkpoints keyed by path] in ``_tree.py`` and [Note: atomic checkpoints] in
``_atomic.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
import warnings
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdpfn.checkpoint import _atomic
from fsdpfn.checkpoint._collective import arrive, broadcast, dist_on, rank
from fsdpfn.checkpoint._tree import flatten_state

__all__ = ["save", "load", "read_info"]

_FORMAT = 1
# Test hook (see tests/test_checkpoint.py, test_killed_save_*): "<stage>:<rank>" makes that rank exit abruptly
# at that stage of a save, as if killed. Stages: "write" (after writing its DCP data, before the
# metadata exists), "commit" (everything written, before the rename that publishes it).
_DIE_AT_ENV = "FSDPFN_CHECKPOINT_TEST_DIE_AT"


def _maybe_die(stage: str) -> None:
    spec = os.environ.get(_DIE_AT_ENV)
    if spec and spec == f"{stage}:{rank()}":
        os._exit(137)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, plus the kill hook between writing data and the metadata gather."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if os.environ.get(_DIE_AT_ENV):
            fut.wait()
            _maybe_die("write")
        return fut


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns whenever it runs without a process group, even when asked to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _tensor_info(x: torch.Tensor) -> dict:
    out = {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
    if isinstance(x, DTensor):
        out["placements"] = [str(p) for p in x.placements]
    return out


def _default_name(values: dict[str, Any], root: str) -> str:
    step = values.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return f"step_{step:08d}"
    n = sum(1 for e in os.listdir(root) if e.startswith("ckpt_")) if os.path.isdir(root) else 0
    return f"ckpt_{n + 1:06d}"


def _plan_summary(plan) -> str:
    if plan is None:
        return "no plan"
    strategies = sorted({u.strategy for u in plan.units})
    return f"plan {plan.fingerprint[:12]} ({'/'.join(strategies)} on mesh {tuple(plan.mesh_shape)})"


def save(
    path: str | os.PathLike,
    state: Any,
    plan=None,
    *,
    name: str | None = None,
    keep: int | None = None,
    timeout: float = 600.0,
) -> str:
    """Saves ``state`` as a new checkpoint under the directory ``path``; every rank calls it.

    Tensor leaves (DTensors: each rank writes its own shard; plain tensors: must be equal on
    every rank, one copy is written) go through ``torch.distributed.checkpoint``, keyed by their
    path in the pytree; ``bool``/``int``/``float``/``str`` leaves and the plan's JSON go in
    ``fsdpfn.json`` beside them. The checkpoint becomes visible (``path/latest`` names it) only
    once every rank has finished writing, so a save killed half-way leaves the previous one
    loadable.

    Args:
      path: the checkpoint root directory (created if missing).
      state: any pytree, e.g. ``{"params": params, "opt_state": opt_state, "step": 100}``.
      plan: the :class:`fsdpfn.Plan` the state is sharded by (its JSON is saved beside).
      name: the checkpoint's directory name; default ``step_{state['step']:08d}`` if the state
        has an int ``step``, else ``ckpt_NNNNNN``.
      keep: if set, delete all but the ``keep`` newest checkpoints after this one is committed.
      timeout: seconds to wait for every rank to enter the save (gloo: then a ``RuntimeError``
        naming the missing ranks, e.g. when the call was gated on rank 0).

    Returns:
      The committed checkpoint directory, e.g. ``path/step_00000100``.

    Example:
      >>> fsdpfn.checkpoint.save("runs/gpt/ckpt", {"params": params, "step": 10}, plan)  # doctest: +SKIP
      'runs/gpt/ckpt/step_00000010'
    """
    root = os.fspath(path)
    entries, _ = flatten_state(state)
    tensors = {p: v.detach() for p, v in entries.items() if isinstance(v, torch.Tensor)}
    values = {p: v for p, v in entries.items() if not isinstance(v, torch.Tensor)}
    me = rank()
    arrive("save", timeout)

    decision = None
    if me == 0:  # every rank learns the outcome, so an error here cannot leave the others waiting
        try:
            os.makedirs(root, exist_ok=True)
            _atomic.clean_partials(root)
            decision = (name or _default_name(values, root), uuid.uuid4().hex[:8])
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            decision = f"{type(e).__name__}: {e}"
    decision = broadcast(decision)
    if isinstance(decision, str):
        raise RuntimeError(f"preparing a checkpoint in {root!r} failed on rank 0: {decision}")
    name, token = decision
    partial = _atomic.partial_dir(root, name, token)

    with _quiet_no_dist():
        dcp.save(tensors, storage_writer=_Writer(partial), no_dist=not dist_on())

    _maybe_die("commit")
    if dist_on():
        dist.barrier()
    error = None
    if me == 0:
        try:
            info = {
                "format": _FORMAT,
                "name": name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "world_size": dist.get_world_size() if dist_on() else 1,
                "plan": None if plan is None else json.loads(plan.to_json()),
                "plan_fingerprint": None if plan is None else plan.fingerprint,
                "values": values,
                "tensors": {p: _tensor_info(v) for p, v in tensors.items()},
            }
            _atomic.write_text_atomic(os.path.join(partial, _atomic.INFO), json.dumps(info, indent=1))
            _atomic.commit(root, partial, name)
            if keep is not None:
                _atomic.prune(root, keep)
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            error = f"{type(e).__name__}: {e}"
    error = broadcast(error)
    if error is not None:
        raise RuntimeError(f"committing checkpoint {name!r} in {root!r} failed on rank 0: {error}")
    return os.path.join(root, name)


def read_info(path: str | os.PathLike) -> dict:
    """The ``fsdpfn.json`` of the checkpoint at ``path`` (a root or one checkpoint directory):
    ``values`` (the non-tensor leaves, e.g. ``step``), ``tensors`` (path -> shape, dtype,
    placements at save time), ``plan`` (``Plan.from_json(json.dumps(info["plan"]))``),
    ``world_size``, ``name``, ``dir``.

    Example:
      >>> fsdpfn.checkpoint.read_info("runs/gpt/ckpt")["values"]["step"]  # doctest: +SKIP
      200
    """
    ckpt = _atomic.resolve(path)
    with open(os.path.join(ckpt, _atomic.INFO)) as f:
        info = json.load(f)
    info["dir"] = ckpt
    return info


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if isinstance(x, DTensor):
        local = torch.empty_like(x.to_local())
        return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride(), run_check=False)
    return torch.empty_like(x)


def _check_against(entries: dict[str, Any], meta: dict, info: dict, plan, ckpt: str) -> None:
    missing, mismatched = [], []
    for p, leaf in entries.items():
        if isinstance(leaf, torch.Tensor):
            m = meta.get(p)
            if not isinstance(m, TensorStorageMetadata):
                what = "a value, not a tensor" if p in info["values"] else "missing"
                missing.append(f"{p!r} ({what})")
            elif tuple(m.size) != tuple(leaf.shape):
                mismatched.append(f"{p!r}: checkpoint {tuple(m.size)}, template {tuple(leaf.shape)}")
        elif p not in info["values"]:
            missing.append(f"{p!r} ({'a tensor, not a value' if p in meta else 'missing'})")
    if not (missing or mismatched):
        return
    parts = []
    if missing:
        more = f" ... ({len(missing)} of {len(entries)} template leaves)" if len(missing) > 8 else ""
        parts.append(f"template paths not in the checkpoint: {', '.join(missing[:8])}{more}")
    if mismatched:
        more = f" ... ({len(mismatched)} of {len(entries)} template leaves)" if len(mismatched) > 8 else ""
        parts.append(f"shape mismatches: {'; '.join(mismatched[:8])}{more}")
    saved = info.get("plan_fingerprint")
    hint = (
        f" The checkpoint was saved with plan {saved[:12] if saved else None} on {info.get('world_size')} rank(s); "
        f"the template is for {_plan_summary(plan)}. Build the template from the same model configuration "
        "(the plan and world size may differ), or load a sub-tree (e.g. only {'params': ...})."
    )
    raise ValueError(f"checkpoint {ckpt!r} does not fit the template: {'; '.join(parts)}.{hint}")


def load(path: str | os.PathLike, template_state: Any, plan=None, *, timeout: float = 600.0) -> Any:
    """Loads a checkpoint into the structure and placements of ``template_state``.

    Every rank calls it (it is collective when a process group is initialised; without one it
    loads in this process alone). The template may use another plan, strategy or world size
    than the save: each DTensor leaf reads back exactly its own slice, by path. Plain tensor
    leaves receive the full tensor. Leaves of the checkpoint that the template lacks are
    ignored, so ``{"params": template_params}`` loads only the parameters. The template is not
    modified.

    Args:
      path: a checkpoint root (its ``latest`` is loaded) or one checkpoint directory.
      template_state: a pytree like the saved one: tensors/DTensors of the right global shapes
        and the wanted placements (e.g. fresh ``fsdpfn.shard(model, plan)`` and
        ``opt.init(params)``), and Python values where the saved state had them.
      plan: the :class:`fsdpfn.Plan` of the template (used in error messages).
      timeout: seconds to wait for every rank to enter the load (gloo; see :func:`save`).

    Returns:
      A new state with the template's structure, filled from the checkpoint.

    Raises:
      FileNotFoundError: no complete checkpoint at ``path``.
      ValueError: a template path is missing from the checkpoint or has another shape (the
        message names the path and both shapes).

    Example:
      >>> template = {"params": fsdpfn.shard(model, plan3), "opt_state": opt.init(...), "step": 0}  # doctest: +SKIP
      >>> state = fsdpfn.checkpoint.load("runs/gpt/ckpt", template, plan3)  # doctest: +SKIP
    """
    arrive("load", timeout)
    ckpt = _atomic.resolve(path)
    info = read_info(ckpt)
    entries, spec = flatten_state(template_state)
    reader = dcp.FileSystemReader(ckpt)
    meta = reader.read_metadata().state_dict_metadata
    _check_against(entries, meta, info, plan, ckpt)
    targets = {p: _empty_like(v) for p, v in entries.items() if isinstance(v, torch.Tensor)}
    with _quiet_no_dist():
        dcp.load(targets, storage_reader=reader, no_dist=not dist_on())
    leaves = [targets[p] if p in targets else info["values"][p] for p in entries]
    return optree.tree_unflatten(spec, leaves)
