"""Plans from plain data (JSON): the reader of every format ``encode.py`` writes or wrote (see
[Note: plan formats] there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

import torch

from fsdpfn._plan import placements as P
from fsdpfn._plan.axes import MeshAxes
from fsdpfn._plan.encode import FORMAT_AXES, FORMAT_PP, FORMATS, UNIT_DERIVED, UNIT_WRITTEN
from fsdpfn._plan.stages import Stages
from fsdpfn._plan.values import MixedPrecision, ParamSpec, PlanValues, Unit, _dtype_from
from fsdpfn.fp8 import Float8GatherPolicy

__all__ = ["plan_from_dict"]

PlanT = TypeVar("PlanT", bound=PlanValues)


def _param_from(p: dict, axes: MeshAxes) -> ParamSpec:
    # The placements in the words of formats 3 and 4 (P.from_legacy); the axes' sizes come from
    # the mesh, as JSON never repeated them per parameter.
    placements = P.from_legacy(
        p["name"],
        p.get("tp", "replicate"),
        axes.tp_size,
        bool(p.get("expert", False)),
        axes.ep_size,
        int(p.get("tp_stride", 1)),
    )
    return ParamSpec(p["name"], tuple(p["shape"]), cast(torch.dtype, _dtype_from(p["dtype"])), placements=placements)


def plan_from_dict(d: dict, cls: type[PlanT], mesh=None) -> PlanT:
    """Inverts :func:`fsdpfn._plan.encode.plan_to_dict` (formats 1 to 7), building a ``cls``."""
    fmt = d.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"plan JSON has format {fmt!r}; this fsdpfn reads formats {', '.join(map(str, FORMATS))}")
    shape = tuple(d["mesh"]["shape"])
    names = tuple(d["mesh"]["dim_names"]) if d["mesh"]["dim_names"] else None
    # formats 5 and 6 may hold a plan of any earlier format: roles only if it wrote them
    roles = tuple(d["mesh"]["roles"]) if fmt >= FORMAT_AXES and d["mesh"].get("roles") else None
    axes = MeshAxes.from_names(shape, names, None if roles is None else dict(zip(names or ("shard",), roles)))
    params = [tuple(_param_from(p, axes) for p in u["params"]) for u in d["units"]]
    optional = {f.name for f in dataclasses.fields(Unit)} - set(UNIT_WRITTEN + UNIT_DERIVED)
    units = tuple(
        Unit(
            u["name"],
            u["strategy"],
            specs,
            P.rows_size(specs, axes),
            **cast(
                "dict[str, Any]", {k: tuple(v) if isinstance(v, list) else v for k, v in u.items() if k in optional}
            ),
        )
        for u, specs in zip(d["units"], params)
    )
    fp8 = d["mp"].get("fp8")
    mp = MixedPrecision(
        _dtype_from(d["mp"]["param_dtype"]),
        _dtype_from(d["mp"]["reduce_dtype"]),
        None if fp8 is None else Float8GatherPolicy.from_dict(fp8),
        d["mp"].get("codec"),
    )
    tp = tuple(tuple(t) for t in d.get("tp", ()))
    stages = Stages.from_dict(d["stages"]) if fmt >= FORMAT_PP and d.get("stages") is not None else None
    pp_stage = tuple(d["pp_stage"]) if fmt >= FORMAT_PP and d.get("pp_stage") is not None else None
    return cls(units, shape, names, mp, mesh, roles, tp, stages, pp_stage)
