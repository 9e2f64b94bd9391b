"""save / load: training state <-> a DCP checkpoint directory, collectively, atomically, verified.

See [Note: checkpoints keyed by path] in ``_tree.py``, [Note: atomic checkpoints] and
[Note: falling back] in ``_atomic.py``, [Note: collective-free DCP] in ``_shards.py``,
[Note: verified checkpoints] in ``_manifest.py`` and [Note: one rank fails, every rank raises]
in ``_agree.py``.

Every collective of a save or load goes through :mod:`fsdpfn.comm` (counted, recorded, bounded
by one timeout):

* save: ``arrive`` (monitored barrier), ``broadcast_object`` of rank 0's choice of name,
  ``all_gather_object`` of every rank's local metadata, files and error, ``broadcast_object``
  of rank 0's commit outcome;
* load: ``arrive``, one ``all_gather_object`` per checkpoint tried (each rank's verdict on it),
  ``all_gather_object`` of every rank's read outcome.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import time
import uuid
import warnings
from typing import Any, cast

import optree
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdpfn import comm
from fsdpfn.checkpoint import _atomic, _inflight, _shards
from fsdpfn.checkpoint._agree import agree, decide, portable, rebuild, timeout_scope
from fsdpfn.checkpoint._manifest import INFO, METADATA, CheckpointError, describe_files, read_manifest, verify
from fsdpfn.checkpoint._tree import flatten_state

__all__ = ["save", "load", "read_info"]

_FORMAT = 2  # 2: per-rank shard directories, merged .metadata, files with checksums in the manifest


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


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


def _prepare(root: str, name: str | None, values: dict[str, Any]) -> tuple[str, str]:
    os.makedirs(root, exist_ok=True)
    _atomic.clean_partials(root)
    return name or _default_name(values, root), uuid.uuid4().hex[:8]


def _write_rank(partial: str, tensors: dict[str, torch.Tensor], rank: int) -> tuple[Metadata | None, dict]:
    """This rank's shards into ``partial/rank_<r>/``: their local metadata and checksums."""
    mine = {p: v for p, v in tensors.items() if _shards.owned(p, v, rank)}
    sub = _shards.rank_dir(rank)
    meta = _shards.write(mine, os.path.join(partial, sub))
    if meta is None:
        return None, {}
    return meta, describe_files(partial, [f"{sub}/{n}" for n in os.listdir(os.path.join(partial, sub))])


def _write_metadata(partial: str, meta: Metadata) -> None:
    path = os.path.join(partial, METADATA)
    with open(f"{path}.tmp", "wb") as f:
        pickle.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def _publish(root, partial, name, token, reports, values, tensor_info, plan, keep) -> None:
    """Rank 0, once every rank wrote its shards: merged metadata, manifest, rename, ``latest``."""
    files = {rel: d for _, rank_files in reports for rel, d in rank_files.items()}
    _write_metadata(partial, _shards.merge([m for m, _ in reports], token))
    files.update(describe_files(partial, [METADATA]))
    info = {
        "format": _FORMAT,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": comm.world_size(),
        "plan": None if plan is None else json.loads(plan.to_json()),
        "plan_fingerprint": None if plan is None else plan.fingerprint,
        "values": values,
        "tensors": tensor_info,
        "files": files,
    }
    _atomic.write_text_atomic(os.path.join(partial, INFO), json.dumps(info, indent=1))
    _atomic.commit(root, partial, name)
    if keep is not None:
        _atomic.prune(root, keep)


def save(
    path: str | os.PathLike,
    state: Any,
    plan=None,
    *,
    name: str | None = None,
    keep: int | None = None,
    timeout: float | None = None,
) -> str:
    """Saves ``state`` as a new checkpoint under the directory ``path``; every rank calls it.

    Tensor leaves (DTensors: each rank writes its own shard, a replicated shard once; plain
    tensors: must be equal on every rank, rank 0 writes them) go through
    ``torch.distributed.checkpoint``, keyed by their path in the pytree;
    ``bool``/``int``/``float``/``str`` leaves, the plan's JSON and a SHA-256 of every file go in
    ``fsdpfn.json`` beside them. The checkpoint becomes visible (``path/latest`` names it) only
    once every rank has finished writing, so a save killed half-way leaves the previous one
    loadable. An error on any rank (a full disk, an unwritable directory) is raised on every
    rank.

    Args:
      path: the checkpoint root directory (created if missing).
      state: any pytree, e.g. ``{"params": params, "opt_state": opt_state, "step": 100}``.
      plan: the :class:`fsdpfn.Plan` the state is sharded by (its JSON is saved beside).
      name: the checkpoint's directory name; default ``step_{state['step']:08d}`` if the state
        has an int ``step``, else ``ckpt_NNNNNN``.
      keep: if set, delete all but the ``keep`` newest checkpoints after this one is committed.
      timeout: seconds each collective of the save may wait, the entry check included (gloo:
        a rank that never calls the save, e.g. because the call was gated on rank 0, is named
        in a :class:`fsdpfn.comm.CollectiveError`); default ``None``: :func:`fsdpfn.comm.timeout`.

    Returns:
      The committed checkpoint directory, e.g. ``path/step_00000100``.

    Example:
      >>> fsdpfn.checkpoint.save("runs/gpt/ckpt", {"params": params, "step": 10}, plan)
      'runs/gpt/ckpt/step_00000010'
    """
    _inflight.wait()  # one save at a time: an asynchronous one in flight finishes (or raises) first
    root = os.fspath(path)
    entries, _ = flatten_state(state)
    tensors = {p: v.detach() for p, v in entries.items() if isinstance(v, torch.Tensor)}
    values = {p: v for p, v in entries.items() if not isinstance(v, torch.Tensor)}
    with timeout_scope(timeout):
        comm.arrive("fsdpfn.checkpoint.save")
        # Fused colwise weights are written whole (see [Note: fused shards in checkpoints]).
        tensors = {p: _shards.whole(cast(DTensor, v)) if _shards.fused_split(v) else v for p, v in tensors.items()}
        name, token = decide(lambda: _prepare(root, name, values), f"preparing a checkpoint in {root!r}")
        partial = _atomic.partial_dir(root, name, token)
        report, error = None, None
        try:
            report = _write_rank(partial, tensors, comm.rank())
        except Exception as e:  # noqa: BLE001 - sent to every rank by agree
            error = e
        reports = agree(error, f"writing checkpoint {name!r} into {partial!r}", report)
        info = {p: _tensor_info(v) for p, v in tensors.items()}
        decide(
            lambda: _publish(root, partial, name, token, reports, values, info, plan, keep),
            f"committing checkpoint {name!r} in {root!r}",
        )
    return os.path.join(root, name)


# ---------------------------------------------------------------------------------------------
# read_info, load
# ---------------------------------------------------------------------------------------------


def read_info(path: str | os.PathLike) -> dict:
    """The ``fsdpfn.json`` of the checkpoint at ``path`` (a root or one checkpoint directory):
    ``values`` (the non-tensor leaves, e.g. ``step``), ``tensors`` (path -> shape, dtype,
    placements at save time), ``plan`` (``Plan.from_json(json.dumps(info["plan"]))``; a
    pipelined plan's, whose JSON has ``"stages"``, with ``PipelinedPlan.from_json``),
    ``world_size``, ``name``, ``files`` (relative path -> bytes, sha256), ``dir``.

    A root resolves like :func:`fsdpfn.checkpoint.latest` (falling back past an incomplete
    checkpoint, with a warning); a checkpoint directory must be complete.

    Raises:
      FileNotFoundError: no complete checkpoint under the root ``path``.
      CheckpointError: the checkpoint directory ``path`` is incomplete or its ``fsdpfn.json``
        does not parse (the message names the file).

    Example:
      >>> _ = fsdpfn.checkpoint.save("runs/gpt/ckpt", {"params": params, "step": 200}, plan)
      >>> info = fsdpfn.checkpoint.read_info("runs/gpt/ckpt")
      >>> info["values"], info["tensors"]["params/head.weight"]["shape"]
      ({'step': 200}, [64, 32])
    """
    ckpt = _atomic.resolve(path)
    info = read_manifest(ckpt)
    info["dir"] = ckpt
    return info


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if isinstance(x, DTensor):
        local = torch.empty_like(x.to_local())
        return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride(), run_check=False)
    return torch.empty_like(x)


def _check_against(entries: dict[str, Any], meta: dict, info: dict, plan, ckpt: str) -> None:
    missing: list[str] = []
    mismatched: list[str] = []
    differing: set = set()
    for p, leaf in entries.items():
        before = len(missing) + len(mismatched)
        if isinstance(leaf, torch.Tensor):
            m = meta.get(p)
            if not isinstance(m, TensorStorageMetadata):
                what = "a value, not a tensor" if p in info["values"] else "missing"
                missing.append(f"{p!r} ({what})")
            elif tuple(m.size) != tuple(leaf.shape):
                mismatched.append(f"{p!r}: checkpoint {tuple(m.size)}, template {tuple(leaf.shape)}")
        elif p not in info["values"]:
            missing.append(f"{p!r} ({'a tensor, not a value' if p in meta else 'missing'})")
        if len(missing) + len(mismatched) > before:
            differing.add(p.split("/", 1)[0])
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
    fine = sorted({p.split("/", 1)[0] for p in entries} - differing)
    if fine and all(_is_optimizer_state(k) for k in differing):
        # The model fits; pointing at the model configuration would send the user the wrong way.
        hint = (
            f" Only the optimizer state differs: {', '.join(map(repr, sorted(differing)))} (the template's "
            f"{', '.join(map(repr, fine))} match the checkpoint). The checkpoint was saved with another optimizer "
            "or optimizer configuration (e.g. AdamW vs Muon, other parameter labels): build the template's optimizer "
            "state with the optimizer that saved it, or load without it (e.g. only "
            f"{{{', '.join(repr(k) + ': ...' for k in fine)}}}) and start a fresh optimizer state."
        )
    raise ValueError(f"checkpoint {ckpt!r} does not fit the template: {'; '.join(parts)}.{hint}")


def _is_optimizer_state(key: str) -> bool:
    """Whether the template's top-level ``key`` names optimizer state (``opt``, ``opt_state``,
    ``optim``, ``optimizer``...): the key is all the checkpoint knows of what a sub-tree is."""
    return bool(re.fullmatch(r"opt\w*", key, re.IGNORECASE))


def _read_metadata(ckpt: str) -> Metadata:
    path = os.path.join(ckpt, METADATA)
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(
            f"{path!r} of checkpoint {ckpt!r} cannot be read ({type(e).__name__}: {e}); "
            "the checkpoint is damaged. Load an older one, or delete this directory.",
            ckpt,
            METADATA,
        ) from None


def _examine(ckpt: str, entries: dict[str, Any], targets: dict[str, torch.Tensor], plan) -> dict:
    """This rank's verdict on ``ckpt``: complete, fits the template, and the files this rank
    will read are intact (see [Note: verified checkpoints]). Returns the manifest."""
    info = _atomic.check_complete(ckpt)
    verify(ckpt, info, [METADATA])
    meta = _read_metadata(ckpt)
    _check_against(entries, meta.state_dict_metadata, info, plan, ckpt)
    verify(ckpt, info, _shards.files_read(meta, targets))
    return info


def _choose(path: str, entries, targets, plan) -> tuple[str, dict]:
    """The checkpoint every rank loads: ``path`` itself if it is a checkpoint directory (raising
    if any rank finds it damaged), else the first of :func:`_atomic.candidates` that every rank
    finds intact, with a warning naming those skipped. One all-gather per checkpoint tried."""
    explicit = _atomic.is_checkpoint_dir(path)
    tries = [path] if explicit else _atomic.candidates(path)
    skipped: list[tuple[str, str]] = []
    for i in itertools.count():
        ckpt = tries[i] if i < len(tries) else None
        info, error = None, None
        if ckpt is not None:
            try:
                info = _examine(ckpt, entries, targets, plan)
            except Exception as e:  # noqa: BLE001 - every rank's verdict is gathered below
                error = e
        verdicts = comm.all_gather_object((ckpt, portable(error)), tag="fsdpfn.checkpoint.load")
        if len({c for c, _ in verdicts}) > 1:
            seen = ", ".join(f"rank {r}: {c!r}" for r, (c, _) in enumerate(verdicts))
            raise CheckpointError(
                f"the ranks see different checkpoints under {path!r} ({seen}); they must share "
                "one filesystem and load the same path",
                path,
            )
        if ckpt is None:
            if skipped:
                what = f"no intact checkpoint under {path!r}"
                raise CheckpointError(_atomic.skipped_warning(what, skipped, None), path)
            raise _atomic.no_checkpoint(path)
        failed = [(r, v) for r, (_, v) in enumerate(verdicts) if v is not None]
        if not failed:
            if skipped:
                warnings.warn(_atomic.skipped_warning("fsdpfn.checkpoint.load", skipped, ckpt), stacklevel=3)
            assert info is not None  # no rank failed, this one included
            return ckpt, info
        damaged = [(r, v) for r, v in failed if v[0] == CheckpointError.__name__]
        if explicit or not damaged:  # a template that does not fit is the caller's to fix, not ours to skip
            if error is not None:
                raise error
            raise rebuild(failed[0][1], failed[0][0], "fsdpfn.checkpoint.load")
        reasons = dict.fromkeys(v[1] for _, v in damaged)  # ranks often find the same fault
        skipped.append((ckpt, " / ".join(reasons)))
    raise AssertionError("unreachable")


def load(
    path: str | os.PathLike, template_state: Any, plan=None, *, timeout: float | None = None, return_info: bool = False
) -> Any:
    """Loads a checkpoint into the structure and placements of ``template_state``.

    Every rank calls it (it is collective when a process group is initialised; without one it
    loads in this process alone). The template may use another plan, strategy or world size
    than the save: each DTensor leaf reads back exactly its own slice, by path. Plain tensor
    leaves receive the full tensor. Leaves of the checkpoint that the template lacks are
    ignored, so ``{"params": template_params}`` loads only the parameters. The template is not
    modified.

    Before reading, each rank checks the sizes of all the checkpoint's files and the SHA-256 of
    the ones it reads, and the ranks agree on the verdict. Given a root, a checkpoint found
    missing, incomplete or damaged is skipped with a warning naming it and why, and the newest
    intact one before it is loaded (see [Note: falling back]); given a checkpoint directory, the
    load raises instead. Any error is raised on every rank.

    Args:
      path: a checkpoint root (its ``latest`` is loaded) or one checkpoint directory.
      template_state: a pytree like the saved one: tensors/DTensors of the right global shapes
        and the wanted placements (e.g. fresh ``fsdpfn.shard(model, plan)`` and
        ``opt.init(params)``), and Python values where the saved state had them.
      plan: the :class:`fsdpfn.Plan` of the template (used in error messages).
      timeout: seconds each collective of the load may wait (see :func:`save`); default
        ``None``: :func:`fsdpfn.comm.timeout`.
      return_info: also return the loaded checkpoint's :func:`read_info` dict (its ``dir`` says
        which checkpoint a root resolved to, after any fallback).

    Returns:
      A new state with the template's structure, filled from the checkpoint; with
      ``return_info``, the pair ``(state, info)``.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      CheckpointError: the checkpoint directory ``path`` is missing a file or damaged, or no
        checkpoint under the root ``path`` is intact (the message names each checkpoint and file).
      ValueError: a template path is missing from the checkpoint or has another shape (the
        message names the path and both shapes).

    Example:
      >>> saved = {"params": params, "opt_state": state, "step": 200}
      >>> _ = fsdpfn.checkpoint.save("runs/gpt/ckpt", saved, plan)
      >>> plan2 = fsdpfn.plan(model, mesh, strategy="zero2")  # another plan than the save's
      >>> fresh = fsdpfn.shard(model, plan2)
      >>> template = {"params": fresh, "opt_state": opt.init(fresh), "step": 0}
      >>> loaded = fsdpfn.checkpoint.load("runs/gpt/ckpt", template, plan2)
      >>> loaded, info = fsdpfn.checkpoint.load("runs/gpt/ckpt", template, plan2, return_info=True)
      >>> info["dir"], info["values"]["step"]
      ('runs/gpt/ckpt/step_00000200', 200)
    """
    _inflight.settled()  # never read a root that a background commit is changing
    path = os.fspath(path)
    entries, spec = flatten_state(template_state)
    with timeout_scope(timeout):
        comm.arrive("fsdpfn.checkpoint.load")
        targets = {p: _empty_like(v) for p, v in entries.items() if isinstance(v, torch.Tensor)}
        fused = {p: cast(DTensor, v) for p, v in targets.items() if _shards.fused_split(v)}  # read whole, then cut
        targets.update(
            {p: _shards.whole(v, torch.empty(v.shape, dtype=v.dtype, device=v.device)) for p, v in fused.items()}
        )
        ckpt, info = _choose(path, entries, targets, plan)
        error = None
        try:
            _shards.read(targets, ckpt)
        except Exception as e:  # noqa: BLE001 - sent to every rank by agree
            error = e
        agree(error, f"loading checkpoint {ckpt!r}")
        targets.update({p: _shards.fused_part(cast(DTensor, targets[p]), v) for p, v in fused.items()})
    leaves = [targets[p] if p in targets else info["values"][p] for p in entries]
    state = optree.tree_unflatten(spec, leaves)
    return (state, {**info, "dir": ckpt}) if return_info else state
