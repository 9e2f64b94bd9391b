"""Pretrained weights straight into shards: each rank reads only its part of a safetensors
checkpoint (one file, or the sharded ``model.safetensors.index.json`` layout of Hugging Face's
``save_pretrained``).

[Note: reading only this rank's rows]
``safe_open(file).get_slice(key)[a:b]`` gives rows ``a:b`` of one tensor of the memory-mapped
file; the bytes of other rows are never touched. Rows along dim 0 are contiguous in the file, so
a rank reads its ``torch.chunk`` rows (``fsdpfn._plan.chunk_bounds``) and no more. Under tensor
parallelism a rank's part is one box of the tensor (``fsdpfn/transforms/_local.py``): rows
``tp_offset + [a, b)`` of a ``shard0`` weight, still contiguous; rows ``a:b`` of columns
``c:d`` of a ``shard1`` weight, read as ``get_slice(key)[a:b, c:d]``, which copies only those
columns (the file pages holding the rest of those rows may be paged in, never the other rows). safetensors
0.8 returns a *view* of its private map of the whole file, not a copy: kept as a shard it would
tie the shard to the file (a checkpoint save of the shard's storage would write the whole tensor,
an overwritten file could change untouched pages), so the rows are copied into a tensor of the
plan's dtype on the target device at once. File pages a rank touched stay resident (and count
in its RSS) until the file is closed, so files are opened once per unit and closed after it: the
file pages in memory at any time are this rank's rows of one unit. Every check (names, shapes, collisions) reads only the headers and runs on every rank
before anything is read or communicated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Mapping, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn import comm
from fsdpfn._plan import Plan
from fsdpfn.transforms._checks import _groups, check_plan_agree
from fsdpfn.transforms._init import _target_device
from fsdpfn.transforms._local import local_index
from fsdpfn.transforms._sharding import check_plan_kind, from_local
from fsdpfn.transforms._remat import apply_remat
from fsdpfn.transforms._tp import apply_tp

__all__ = ["load_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
Rename = Union[None, Mapping[str, Union[str, None]], Callable[[str], Union[str, None]]]
_SHOWN = 8  # names listed per kind of problem


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of the checkpoint: its key, the file holding it, shape and dtype (from headers)."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str


# ---------------------------------------------------------------------------------------------
# Files and headers
# ---------------------------------------------------------------------------------------------


def _safe_open(file: str):
    try:
        from safetensors import safe_open
    except ImportError as e:  # a core dependency; only a broken environment gets here
        raise ImportError("fsdpfn.load_safetensors needs the safetensors package: pip install safetensors") from e
    return safe_open(file, framework="pt", device="cpu")


def _weight_map(path) -> dict[str, list[str]] | str:
    """``{file: [keys]}`` from an index, or the path of a single file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        listing = sorted(os.listdir(path))
        for name in (INDEX_NAME, SINGLE_NAME):
            if name in listing:
                return _weight_map(os.path.join(path, name))
        for suffix in (".safetensors.index.json", ".safetensors"):
            found = [n for n in listing if n.endswith(suffix)]
            if len(found) == 1:
                return _weight_map(os.path.join(path, found[0]))
            if len(found) > 1:
                raise ValueError(
                    f"{path} holds several {suffix} files {found[:_SHOWN]} and no {INDEX_NAME}; pass the file to load"
                )
        raise ValueError(f"{path} holds no safetensors checkpoint (no {INDEX_NAME}, no *.safetensors file)")
    if not os.path.exists(path):
        raise ValueError(
            f"no safetensors checkpoint at {path!r}: pass a .safetensors file, an index .json, or a directory holding one"
        )
    if not path.endswith(".json"):
        return path
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(
            f"{path} is not a safetensors index: expected JSON with a 'weight_map' {{tensor: file}} ({e})"
        ) from None
    root = os.path.dirname(path)
    files: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        files.setdefault(os.path.join(root, file), []).append(key)
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
        raise ValueError(f"index {path} names files that do not exist: {absent[:_SHOWN]}")
    return files


def _entries(path) -> dict[str, _Entry]:
    """Every tensor of the checkpoint at ``path``, from the headers only."""
    found = _weight_map(path)
    files = {found: None} if isinstance(found, str) else found
    out: dict[str, _Entry] = {}
    for file, wanted in files.items():
        with _safe_open(file) as f:
            keys = list(f.keys())
            if wanted is not None:
                absent = sorted(set(wanted) - set(keys))
                if absent:
                    raise ValueError(f"the index maps {absent[:_SHOWN]} to {file}, which does not hold them")
                keys = wanted
            for key in keys:
                s = f.get_slice(key)
                out[key] = _Entry(key, file, tuple(s.get_shape()), str(s.get_dtype()))
    return out


# ---------------------------------------------------------------------------------------------
# Names: checkpoint keys -> the plan's parameters, all problems found at once
# ---------------------------------------------------------------------------------------------


def _renamer(rename: Rename, entries: Mapping[str, _Entry]) -> Callable[[str], str | None]:
    if rename is None:
        return lambda key: key
    if isinstance(rename, Mapping):
        unknown = sorted(k for k in rename if k not in entries)
        if unknown:
            raise ValueError(
                f"rename names {unknown[:_SHOWN]}, which the checkpoint does not hold (rename maps checkpoint "
                "names to model names)"
            )
        return lambda key: rename.get(key, key)
    if callable(rename):
        return rename
    raise ValueError(
        f"rename must be a dict {{checkpoint name: model name or None}} or a function, got {type(rename).__name__}"
    )


def _aliases(model: nn.Module) -> dict[str, str]:
    """``{every name of every parameter: its first name}`` (tied weights have several names)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _sources(
    model: nn.Module, plan: Plan, entries: Mapping[str, _Entry], rename: Rename, where: str
) -> dict[str, list[tuple[str, _Entry]]]:
    """``{plan name: [(model name, entry), ...]}``, the first entry the one to read; the others
    are other names of the same tied parameter, compared with it. Raises one ``ValueError``
    naming every missing, unexpected, wrong-shape or doubly-mapped tensor."""
    aliases = _aliases(model)
    foreign = [n for n in plan.param_names if aliases.get(n) != n]
    if foreign:
        raise ValueError(
            f"parameters {foreign[:_SHOWN]} of the plan are not parameters of {type(model).__name__}; "
            "build the plan from this model"
        )
    to_model = _renamer(rename, entries)
    found: dict[str, list[tuple[str, _Entry]]] = {}
    unexpected, twice = [], []
    claimed: dict[str, str] = {}
    for key, entry in entries.items():
        name = to_model(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(
                f"rename({key!r}) returned {name!r}; return the model's name (str) or None to skip the tensor"
            )
        if name in claimed:
            twice.append(f"{claimed[name]!r} and {key!r} both map to {name!r}")
            continue
        claimed[name] = key
        if name not in aliases:
            unexpected.append(
                f"{key!r} (checkpoint shape {entry.shape})" + (f" renamed {name!r}" if name != key else "")
            )
            continue
        found.setdefault(aliases[name], []).append((name, entry))
    missing = [f"{n!r} (model shape {plan.param(n).shape})" for n in plan.param_names if n not in found]
    wrong = [
        f"{name!r}: checkpoint shape {entry.shape}"
        + (f" (key {entry.key!r})" if entry.key != name else "")
        + f", model shape {plan.param(n).shape}"
        for n, got in found.items()
        for name, entry in got
        if entry.shape != plan.param(n).shape
    ]
    problems = [
        (what, items)
        for what, items in (
            ("missing from the checkpoint", missing),
            ("in the checkpoint but not in the model", unexpected),
            ("wrong shape", wrong),
            ("mapped twice", twice),
        )
        if items
    ]
    if problems:
        lines = [
            f"  {what} ({len(items)}): {', '.join(items[:_SHOWN])}{' ...' if len(items) > _SHOWN else ''}"
            for what, items in problems
        ]
        raise ValueError(
            f"the safetensors checkpoint {where} does not fit the model:\n"
            + "\n".join(lines)
            + "\nMap checkpoint names to the model's with rename={checkpoint name: model name, or None to skip it} "
            "or rename=lambda name: ..."
        )
    for n, got in found.items():  # read the parameter's own name if the checkpoint has it
        got.sort(key=lambda item: item[0] != n)
    return {n: found[n] for n in plan.param_names}


def _digest(sources: Mapping[str, list[tuple[str, _Entry]]]) -> str:
    rows = [
        (n, name, e.key, os.path.basename(e.file), list(e.shape), e.dtype)
        for n, got in sources.items()
        for name, e in got
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _read_box(f, entry: _Entry, box: tuple[slice, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``box`` (one slice per leading dim, :func:`local_index`) of one tensor of the open file."""
    part = f.get_slice(entry.key)[box] if entry.shape else f.get_tensor(entry.key)
    # Always a copy into memory of our own: safetensors may return a view of its map of the file.
    out = torch.empty(part.shape, dtype=dtype, device=device)
    out.copy_(part)
    return out


def load_safetensors(
    model: nn.Module,
    plan: Plan,
    path,
    *,
    rename: Rename = None,
    device=None,
    requires_grad: bool = False,
    check: bool = True,
) -> dict[str, DTensor]:
    """This rank's shards of pretrained weights, read straight from a safetensors checkpoint.

    Each rank reads only the part it owns (``safe_open(...).get_slice(key)[a:b]``: its rows; under
    tensor parallelism, its rows of its tensor-parallel slice, ``[a:b, c:d]`` for a weight split
    by columns), one unit at a time, casts them to the plan's dtype and moves them to
    ``device``: no rank ever holds a full parameter of a sharded unit, let alone the model. A
    plan with ``tp`` also gets its activation collectives installed on ``model``
    (:func:`fsdpfn.apply_tp`), as :func:`fsdpfn.shard` does. Tied weights (one parameter under
    several names, e.g. ``lm_head.weight`` and ``transformer.wte.weight``) are read from
    whichever name the checkpoint holds; if it holds several, they must be equal. Names, shapes
    and files are checked on every rank from the headers before anything is read.

    Args:
      model: the model, normally built under ``torch.device("meta")``; only its parameters'
        names (and which of them are tied) are read.
      plan: the plan, built from ``model``.
      path: a ``.safetensors`` file, a ``model.safetensors.index.json`` (the sharded layout of
        ``save_pretrained``), or a directory holding either.
      rename: checkpoint name -> model name: a dict (names it lacks are kept) or a function;
        ``None`` as the new name skips a tensor (e.g. buffers the model does not have).
      device: where the shards live (default: the current CUDA device for a CUDA mesh, else CPU).
      requires_grad: mark the shards as leaves requiring grad (for ``loss.backward()`` loops).
      check: first verify that every rank has the same plan and sees the same checkpoint headers
        (one small all-gather per mesh dim).

    Returns:
      ``{name: DTensor}`` in the plan's order, placed like :func:`fsdpfn.shard`'s.

    Raises:
      ValueError: no checkpoint at ``path``; tensors missing from the checkpoint, unexpected, of
        the wrong shape (naming both shapes) or mapped twice, listed together; tied names with
        different values; ranks with different plans or checkpoints.

    Example:
      >>> from safetensors.torch import save_file
      >>> save_file({n: p.detach() for n, p in model.named_parameters()}, "model.safetensors")
      >>> with torch.device("meta"):  # HF: AutoModelForCausalLM.from_config(config) here
      ...     skeleton = GPT(cfg)
      >>> shards = fsdpfn.load_safetensors(skeleton, fsdpfn.plan(skeleton, mesh), "model.safetensors")
      >>> torch.equal(fsdpfn.comm.full_tensor(shards["head.weight"]), model.head.weight)
      True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be the nn.Module the plan was built from (on meta is fine), got {type(model).__name__}"
        )
    check_plan_kind(plan, "load_safetensors")
    sources = _sources(model, plan, _entries(path), rename, repr(os.fspath(path)))
    device = _target_device(plan, device)
    boxes = {n: local_index(plan, n) for n in plan.param_names}
    if check:
        check_plan_agree(
            plan,
            f"checkpoint {os.path.basename(os.fspath(path))!r} digest {_digest(sources)}",
            what="checkpoint (names, shapes, dtypes, files)",
            device=device,
        )
    out: dict[str, torch.Tensor] = {}
    untied: list[str] = []
    with torch.no_grad():
        for unit in plan.units:
            files = list(dict.fromkeys(e.file for p in unit.params for _, e in sources[p.name]))
            for file in files:  # opened once per unit and closed after it: see [Note: reading only this rank's rows]
                with _safe_open(file) as f:
                    for p in unit.params:
                        for i, (name, entry) in enumerate(sources[p.name]):
                            if entry.file != file:
                                continue
                            rows = _read_box(f, entry, boxes[p.name], p.dtype, device)
                            if i == 0:
                                out[p.name] = rows
                            else:
                                out.setdefault(f"{p.name}\0{name}", rows)
            for p in unit.params:
                for name, _ in sources[p.name][1:]:
                    if not torch.equal(out.pop(f"{p.name}\0{name}"), out[p.name]):
                        untied.append(f"{sources[p.name][0][0]!r} and {name!r}")
    if any(len(got) > 1 for got in sources.values()):  # the same on every rank: the headers agree
        _raise_if_untied(plan, untied, check)
    # The model carries the tp hooks and remat wrappers of its latest plan, as after fsdpfn.shard.
    apply_tp(model, plan)
    apply_remat(model, plan)
    return {n: from_local(plan, n, out[n], requires_grad) for n in plan.param_names}


def _raise_if_untied(plan: Plan, untied: list[str], check: bool) -> None:
    """Tied names whose values differ: every rank raises if any rank found one (each compares
    only its rows)."""
    if check:
        for group in _groups(plan):
            untied = sorted({u for seen in comm.all_gather_object(untied, group, tag="load_safetensors") for u in seen})
    if untied:
        raise ValueError(
            f"the checkpoint holds tied parameters under several names with different values: {', '.join(untied[:_SHOWN])}. "
            "The model ties them, so they must be equal; skip the one you do not want with rename={name: None}"
        )
