"""Plans to and from plain data (JSON).

[Note: plan formats]
Format 1 is a plan without FP8 on a 1-D or HSDP mesh, format 2 the same with
``MixedPrecision(fp8=...)``. Those two are written exactly as before named mesh axes existed,
so their JSON and fingerprints did not change. Format 3 is any plan over named axes with roles
(tensor parallel, or a mesh that is not 1-D / ``("replicate", "shard")``) or with activation
checkpointing: the mesh carries its roles, every parameter not replicated over tp carries its
``tp`` placement, the plan lists its tensor-parallel modules and a rematerialised unit its
``remat`` policy and an offloaded one ``offload``; on a mesh with an ``ep`` axis an expert weight
carries ``expert`` and its unit ``experts``. Format 4 is format 3 with ``colwise_fused:k`` layers: their
parameters carry ``tp_stride`` (see [Note: fused colwise] in ``fsdpfn/_plan_values.py``); a plan without
them is still written as format 3. Format 5 is any of these with ``MixedPrecision(codec=...)``: ``mp``
carries the codec's name (see [Note: codec selection] in ``fsdpfn/_codec.py``). A reader refuses
formats it does not know, so an older fsdpfn never runs a tensor-parallel plan as if it were a
data-parallel one, a fused split as a plain one, nor a registered codec's wire format as the plain one.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from fsdpfn import _placements as P
from fsdpfn._mesh import MeshAxes
from fsdpfn._plan_values import MixedPrecision, ParamSpec, Plan, Unit, _dtype_from, _dtype_name, register_serialisers
from fsdpfn.fp8 import Float8GatherPolicy

__all__ = ["plan_to_dict", "plan_from_dict", "FORMATS"]

FORMAT_PLAIN = 1
FORMAT_FP8 = 2
FORMAT_AXES = 3
FORMAT_FUSED = 4
FORMAT_CODEC = 5
FORMATS = (FORMAT_PLAIN, FORMAT_FP8, FORMAT_AXES, FORMAT_FUSED, FORMAT_CODEC)


def _param_dict(p: ParamSpec) -> dict:
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


def _param_from(p: dict, axes: MeshAxes) -> ParamSpec:
    # The axes' sizes come from the mesh: JSON never repeated them per parameter.
    placements = P.from_legacy(p["name"], p.get("tp", "replicate"), axes.tp_size, bool(p.get("expert", False)), axes.ep_size,
                               int(p.get("tp_stride", 1)))
    return ParamSpec(p["name"], tuple(p["shape"]), cast(torch.dtype, _dtype_from(p["dtype"])), placements=placements)


def plan_to_dict(plan: Plan) -> dict:
    """``plan`` as plain data, in the oldest format that holds it (see [Note: plan formats]).

    Example:
      >>> plan_to_dict(plan)["format"]
      1
    """
    legacy = plan.axes.legacy and not plan.tp and plan.mesh_roles is None and all(u.remat == "none" and not u.offload for u in plan.units)
    d: dict[str, Any] = {
        "format": FORMAT_PLAIN,
        "mesh": {"shape": list(plan.mesh_shape), "dim_names": list(plan.mesh_dim_names) if plan.mesh_dim_names else None},
        "mp": {"param_dtype": _dtype_name(plan.mp.param_dtype), "reduce_dtype": _dtype_name(plan.mp.reduce_dtype)},
        "units": [
            {
                "name": u.name,
                "strategy": u.strategy.value,
                "params": [_param_dict(p) for p in u.params],
                **({"fp8": list(u.fp8)} if u.fp8 else {}),
                **({"remat": u.remat} if u.remat != "none" else {}),
                **({"offload": True} if u.offload else {}),
                **({"experts": True} if u.experts else {}),
                **({"top_k": u.top_k} if u.top_k else {}),
            }
            for u in plan.units
        ],
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
    return d


def plan_from_dict(d: dict, mesh=None) -> Plan:
    """Inverts :func:`plan_to_dict` (formats 1 to 5)."""
    fmt = d.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"plan JSON has format {fmt!r}; this fsdpfn reads formats {', '.join(map(str, FORMATS))}")
    shape = tuple(d["mesh"]["shape"])
    names = tuple(d["mesh"]["dim_names"]) if d["mesh"]["dim_names"] else None
    # format 5 may hold a plan of any earlier format beside its codec: roles only if it wrote them
    roles = tuple(d["mesh"]["roles"]) if fmt >= FORMAT_AXES and d["mesh"].get("roles") else None
    axes = MeshAxes.from_names(shape, names, None if roles is None else dict(zip(names or ("shard",), roles)))
    units = tuple(
        Unit(
            u["name"],
            u["strategy"],
            tuple(_param_from(p, axes) for p in u["params"]),
            axes.shard_size if u.get("experts") else axes.dense_shard_size,
            tuple(u.get("fp8", ())),
            u.get("remat", "none"),
            bool(u.get("offload", False)),
            bool(u.get("experts", False)),
            int(u.get("top_k", 0)),
        )
        for u in d["units"]
    )
    fp8 = d["mp"].get("fp8")
    mp = MixedPrecision(
        _dtype_from(d["mp"]["param_dtype"]),
        _dtype_from(d["mp"]["reduce_dtype"]),
        None if fp8 is None else Float8GatherPolicy.from_dict(fp8),
        d["mp"].get("codec"),
    )
    tp = tuple(tuple(t) for t in d.get("tp", ()))
    return Plan(units, shape, names, mp, mesh, roles, tp)


register_serialisers(plan_to_dict, plan_from_dict)
