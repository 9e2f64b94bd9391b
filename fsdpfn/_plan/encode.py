"""Plans to plain data (JSON): the writer and the fingerprint. The reader is ``serialise.py``.

[Note: plan formats]
Format 1 is a plan without FP8 on a 1-D or HSDP mesh, format 2 the same with
``MixedPrecision(fp8=...)``. Those two are written exactly as before named mesh axes existed,
so their JSON and fingerprints did not change. Format 3 is any plan over named axes with roles
(tensor parallel, or a mesh that is not 1-D / ``("replicate", "shard")``) or with activation
checkpointing: the mesh carries its roles, every parameter not replicated over tp carries its
``tp`` placement, the plan lists its tensor-parallel modules and a rematerialised unit its
``remat`` policy and an offloaded one ``offload``; on a mesh with an ``ep`` axis an expert weight
carries ``expert`` and its unit ``experts``. Format 4 is format 3 with ``colwise_fused:k`` layers: their
parameters carry ``tp_stride`` (see [Note: fused colwise] in ``fsdpfn/_plan/values.py``); a plan without
them is still written as format 3. Format 5 is any of these with ``MixedPrecision(codec=...)``: ``mp``
carries the codec's name (see [Note: codec selection] in ``fsdpfn/_codec.py``). Format 6 is any of these on
a mesh with a context-parallel axis: ``mesh.roles`` holds ``"cp"`` (nothing else changes: parameters are
not placed over cp, and the units' ``shard_size`` is read back from the mesh). Format 7 is any of these with
pipeline stages: ``mesh.roles`` holds ``"pp"`` and ``stages`` lists each stage's units and the pp size; or the plan
of one stage (``Plan.stage_plan``), whose ``pp_stage`` is ``[stage, pp size]``. A reader refuses
formats it does not know, so an older fsdpfn never runs a tensor-parallel plan as if it were a
data-parallel one, a fused split as a plain one, a registered codec's wire format as the plain one, nor a
plan sharded over shard x cp as one over shard alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from fsdpfn._plan import placements as P
from fsdpfn._plan.axes import Role

__all__ = ["plan_to_dict", "plan_fingerprint", "FORMATS"]

FORMAT_PLAIN = 1
FORMAT_FP8 = 2
FORMAT_AXES = 3
FORMAT_FUSED = 4
FORMAT_CODEC = 5
FORMAT_CP = 6
FORMAT_PP = 7
FORMATS = (FORMAT_PLAIN, FORMAT_FP8, FORMAT_AXES, FORMAT_FUSED, FORMAT_CODEC, FORMAT_CP, FORMAT_PP)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _param_dict(p: Any) -> dict:
    # Placements are written in the words formats 3 and 4 used (P.legacy_fields), only where they
    # differ from the default, so a plan's JSON and fingerprint are what earlier versions wrote.
    d: dict[str, Any] = {"name": p.name, "shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
    fields = P.legacy_fields(p)
    if fields["tp"] != "replicate":
        d["tp"] = fields["tp"]
    if fields["tp_stride"] != 1:
        d["tp_stride"] = fields["tp_stride"]
    if fields["expert"]:
        d["expert"] = True
    return d


# Unit fields every unit writes; shard_size is derived from the params and the mesh.
UNIT_WRITTEN = ("name", "strategy", "params")
UNIT_DERIVED = ("shard_size",)


def _unit_dict(u: Any) -> dict:
    """A unit as plain data: its name, strategy and params, then each other field in field
    order, only where it is not its default (so a plan that uses none of them reads as an
    older fsdpfn wrote it). A new field of ``Unit`` is written, and read back by
    ``plan_from_dict``, with nothing added here."""
    d: dict[str, Any] = {"name": u.name, "strategy": u.strategy.value, "params": [_param_dict(p) for p in u.params]}
    for f in dataclasses.fields(u):
        if f.name in UNIT_WRITTEN + UNIT_DERIVED:
            continue
        value = getattr(u, f.name)
        if value != f.default:
            d[f.name] = list(value) if isinstance(value, tuple) else value
    return d


def plan_to_dict(plan: Any) -> dict:
    """``plan`` as plain data, in the oldest format that holds it (see [Note: plan formats]).

    Example:
      >>> plan_to_dict(plan)["format"]
      1
    """
    legacy = (
        plan.axes.legacy
        and not plan.tp
        and plan.mesh_roles is None
        and all(u.remat == "none" and not u.offload for u in plan.units)
    )
    d: dict[str, Any] = {
        "format": FORMAT_PLAIN,
        "mesh": {
            "shape": list(plan.mesh_shape),
            "dim_names": list(plan.mesh_dim_names) if plan.mesh_dim_names else None,
        },
        "mp": {"param_dtype": _dtype_name(plan.mp.param_dtype), "reduce_dtype": _dtype_name(plan.mp.reduce_dtype)},
        "units": [_unit_dict(u) for u in plan.units],
    }
    if plan.mp.fp8 is not None:
        d["format"] = FORMAT_FP8
        d["mp"]["fp8"] = plan.mp.fp8.to_dict()
    if not legacy:
        d["format"] = FORMAT_AXES
        d["mesh"]["roles"] = list(plan.mesh_roles) if plan.mesh_roles is not None else None
        d["tp"] = [list(t) for t in plan.tp]
        if any(_param_dict(p).get("tp_stride", 1) != 1 for u in plan.units for p in u.params):
            d["format"] = FORMAT_FUSED
    if plan.mp.codec is not None:
        d["format"] = FORMAT_CODEC
        d["mp"]["codec"] = plan.mp.codec
    if Role.CP in plan.axes.roles:
        d["format"] = FORMAT_CP
    if plan.stages is not None:
        d["format"] = FORMAT_PP
        d["stages"] = plan.stages.to_dict()
    if plan.pp_stage is not None:
        d["format"] = FORMAT_PP
        d["pp_stage"] = list(plan.pp_stage)
    return d


def plan_fingerprint(plan: Any) -> str:
    """A stable 16-hex-digit hash of ``plan_to_dict(plan)`` (not of the live mesh)."""
    canonical = json.dumps(plan_to_dict(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
