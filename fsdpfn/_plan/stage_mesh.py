"""Which pipelined mesh a stage's mesh was cut from.

[Note: a stage's parameters are part of one model]
A pipelined plan's stage plan (``plan.stage_plan(s)``) lives on the mesh without its ``pp``
axis, and the parameters :class:`fsdpfn.runtime.PipelineRuntime` hands out are DTensors on that
smaller mesh: each pp rank holds only its stages' parameters. A function of *all* the
parameters, the global gradient norm (and so ``clip_by_global_norm``) and the "some gradient is
not finite" decision of ``apply_if_finite``, must then also sum (or agree) over the pp ranks,
or each stage would clip by its own norm and skip a step on its own: a model whose stages train
on different steps, without an error. So ``stage_plan`` records on the stage mesh the mesh it
was cut from and the name of its pp axis, and those functions read it here: the squares of the
gradient norm are summed over the pp group too, and the finite flag is reduced over the whole
pipelined mesh. A mesh derived from a stage mesh (the flattened mesh of dense units beside cp or
ep) carries the record along.

A leaf module: it imports nothing of fsdpfn, so the plan, the transforms and the optimizers can
all use it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["copy_stage_mark", "mark_stage_mesh", "pipeline_of"]

_ATTR = "_fsdpfn_pipeline"


def mark_stage_mesh(stage_mesh: Any, mesh: Any, pp_name: str) -> None:
    """Records that ``stage_mesh`` is ``mesh`` without its pp axis ``pp_name``."""
    setattr(stage_mesh, _ATTR, (mesh, pp_name))


def copy_stage_mark(source: Any, derived: Any) -> None:
    """``derived`` (a mesh built from ``source``'s axes) belongs to the same pipeline as ``source``."""
    mark = getattr(source, _ATTR, None)
    if mark is not None:
        setattr(derived, _ATTR, mark)


def pipeline_of(mesh: Any) -> tuple[Any, str] | None:
    """``(pipelined mesh, pp axis name)`` if ``mesh`` is a pipeline stage's mesh, else ``None``.

    Example:
      >>> pipeline_of(None) is None
      True
    """
    return getattr(mesh, _ATTR, None)
