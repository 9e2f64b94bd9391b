"""The public plans: :class:`fsdpfn.Plan` (one stage) and :class:`fsdpfn.PipelinedPlan` (cut
into pipeline stages), a plan's values with the methods that read other plan modules.

[Note: the plan's class and its values]
``Plan.cost()`` runs the cost model, which expands the step's schedule into collectives, and
``Plan.from_json()`` runs the JSON reader, which builds plans; both of those read a plan's values.
So the values (``values.PlanValues``: fields, checks, layouts, dtypes, codecs, the JSON writer and
the fingerprint) sit at the bottom of the package, the cost model and the reader above them, and
this class on top, where it imports both. Every module's imports point down, and no registry
or import side effect connects a method to its implementation. Code inside the plan package
annotates with ``PlanValues``; everything outside it sees ``Plan`` or ``PipelinedPlan``.

[Note: a pipelined plan is its own type]
A pipelined plan holds every stage's units, while each pp rank runs its own stages only. So a
transform over the whole plan (``shard``, ``unshard``, ``reduce``, ``init_shards``,
``load_safetensors``, ``verify``, ``Runtime``) would hold and step every stage on every rank: a
model that trains without its pipeline. Its own class, which is not a ``Plan``, lets a type
checker catch that hand-over, and every entry point refuses it by one ``isinstance`` test
(``fsdpfn.transforms.check_plan_kind``) that names the way in: ``PipelineRuntime``, or
``stage_plan(stage)``, a ``Plan``.
"""

from __future__ import annotations

import json
from typing import Any, cast

from fsdpfn._plan.cost import PlanCost, plan_cost
from fsdpfn._plan.serialise import plan_from_dict
from fsdpfn._plan.axes import Role
from fsdpfn._plan.stage_mesh import mark_stage_mesh
from fsdpfn._plan.values import PlanValues

__all__ = ["Plan", "PipelinedPlan"]


def _kind_check(plan: PlanValues) -> None:
    """Refuses values of the other kind: stages on a ``Plan``, none on a ``PipelinedPlan``."""
    if isinstance(plan, Plan) and plan.stages is not None:
        raise ValueError(
            f"a plan cut into {plan.stages.num_stages} pipeline stages is a fsdpfn.PipelinedPlan, not a fsdpfn.Plan: "
            "build it with fsdpfn.pipeline_plan(model, mesh, ...), or read its JSON with fsdpfn.PipelinedPlan.from_json"
        )
    if isinstance(plan, PipelinedPlan):
        if plan.stages is None:
            raise ValueError(
                f"a PipelinedPlan needs stages, and the plan (mesh {plan.axes.describe()}) has none: a plan without "
                "pipeline stages is a fsdpfn.Plan (fsdpfn.plan(model, mesh, ...), fsdpfn.Plan.from_json)"
            )
        if plan.pp_stage is not None:
            raise ValueError("a PipelinedPlan holds every stage; one stage's plan (pp_stage) is a fsdpfn.Plan")


class Plan(PlanValues):
    """How a model is sharded: ordered units, the mesh's named axes, tensor-parallel modules,
    mixed precision. Immutable.

    Build one with :func:`fsdpfn.plan`. ``str(plan)`` prints a table; ``plan.to_json()`` and
    ``Plan.from_json(s, mesh)`` round-trip to an equal plan; ``plan.fingerprint`` is a stable
    hash of everything but the live mesh; ``plan.cost()`` estimates bytes and memory.

    Attributes:
      units: the units, in execution order (root first).
      mesh_shape: ranks along each mesh dim: ``(W,)``, ``(R, W)`` for HSDP, ``(W, T)`` for
        data x tensor parallel, ...
      mesh_dim_names: the mesh's dim names (``None``: an unnamed 1-D mesh).
      mp: the mixed-precision policy.
      mesh: the live ``DeviceMesh`` (not part of equality or JSON); ``None`` for a plan loaded
        from JSON without one, which can be printed and costed but not executed.
      mesh_roles: each dim's role (see :class:`fsdpfn.Role`); ``None``: derived from the names.
      tp: ``((module name, style), ...)``: the modules whose matmuls are split over the tp
        axis, with ``"colwise"``, ``"colwise_gather"``, ``"colwise_fused:k"`` or ``"rowwise"``, in
        model order.
      pp_stage: ``(stage, pp size)`` on one stage's plan (:meth:`PipelinedPlan.stage_plan`),
        else ``None``.

    A plan cut into pipeline stages is a :class:`PipelinedPlan`, not a ``Plan``.
    """

    def __post_init__(self):
        super().__post_init__()
        _kind_check(self)

    @classmethod
    def from_json(cls, s: str, mesh=None) -> "Plan":
        """Rebuilds a plan saved with :meth:`to_json` (any format this fsdpfn wrote or an older
        one did), optionally bound to ``mesh``.

        Example:
          >>> same = Plan.from_json(plan.to_json(), mesh)
          >>> same == plan, same.fingerprint == plan.fingerprint
          (True, True)
        """
        return plan_from_dict(json.loads(s), cls, mesh)

    def bind(self, mesh) -> "Plan":
        """The same plan bound to a live ``DeviceMesh`` (e.g. after :meth:`from_json`)."""
        return cast(Plan, super().bind(mesh))

    def cost(
        self,
        reshard_after_forward: bool | None = None,
        prefetch: int = 1,
        *,
        tokens: int | None = None,
        micro_batches: int = 1,
        accumulate: str = "reduce",
        schedule: Any = None,
        attention: Any = (),
    ) -> PlanCost:
        """Bytes each collective kind moves per rank per training step, and memory per rank.

        Every figure is summed from :func:`fsdpfn.step_collectives`, the list of the step's
        collectives that the simulator times and tests compare with a real step.

        Args:
          reshard_after_forward: whether ``zero3`` units are gathered a second time in backward.
            ``None`` (default): as the runtime's default schedule does, every ``zero3`` unit but
            the root. ``True``: every ``zero3`` unit (the textbook 3x the parameter bytes).
            ``False``: none, as in the pure loop (``torch.func.grad`` over ``unshard``).
          prefetch: units gathered ahead by the runtime; bounds the unsharded memory.
          tokens: tokens per rank per micro-batch (batch x sequence on one rank): the size of
            the tensor-parallel activation collectives. ``None``: they are listed with their
            calls and 0 bytes (the printout says so).
          micro_batches: micro-batches per step (each gathers again; reduces as ``accumulate``
            says).
          accumulate: ``"reduce"`` (every micro-batch reduces, except ``zero1`` units, which
            reduce once per step) or ``"local"`` (only the last micro-batch reduces), as
            :class:`fsdpfn.runtime.Runtime`'s.
          schedule: a :class:`fsdpfn.runtime.Schedule` for this plan (default or hand-edited):
            the step it runs is costed, its ops expanded as the runtime runs them;
            ``reshard_after_forward`` and ``prefetch`` are then read from it. ``None``: the
            runtime's default schedule with those two.
          attention: the step's attention calls (:class:`fsdpfn.AttentionCall`, by hand or
            ``fsdpfn.sim.profile(...).attention``): on a plan with a cp axis, their keys' and
            values' exchange over cp (sized by ``tokens``) and ``memory["attention_kv"]``.

        Returns:
          a :class:`fsdpfn.PlanCost`.

        Example:
          >>> c = plan.cost(micro_batches=4)
          >>> c.collectives["all_gather"].calls, c.collectives["reduce_scatter"].calls
          (20, 12)
          >>> cp = fsdpfn.plan(model, {"dp": 2, "cp": 4})
          >>> calls = [fsdpfn.AttentionCall(f"blocks.{i}", kv_width=64, strategy="ring") for i in range(2)]
          >>> cp.cost(tokens=2 * 256, attention=calls).collectives["send_recv"]   # per block: 3 hops forward; K/V again and dK/dV home, 6 back
          CollectiveCost(calls=18, nbytes=4718592, wire_bytes=4718592.0)
        """
        return plan_cost(
            self,
            reshard_after_forward,
            prefetch,
            tokens=tokens,
            micro_batches=micro_batches,
            accumulate=accumulate,
            schedule=schedule,
            attention=attention,
        )


class PipelinedPlan(PlanValues):
    """A plan cut into pipeline stages: the units of a model on a mesh with a ``pp`` axis, and
    :class:`fsdpfn.Stages`, which unit runs in which stage on which pp rank. Immutable.

    Build one with :func:`fsdpfn.pipeline_plan`. It is not a :class:`Plan`: each pp rank holds
    and runs its own stages only, so the transforms that take a whole plan (``shard``,
    ``unshard``, ``Runtime``, ``init_shards``, ...) refuse it. Run it with
    :class:`fsdpfn.runtime.PipelineRuntime`, or take one stage's plan, a ``Plan``, with
    :meth:`stage_plan`. It prints, saves to JSON and fingerprints as a ``Plan`` does; its step
    is a :func:`fsdpfn.pipeline_schedule`, which :func:`fsdpfn.sim.simulate_pipeline` prices.

    Attributes:
      stages: the :class:`fsdpfn.Stages`.
      units, mesh_shape, mesh_dim_names, mp, mesh, mesh_roles, tp: as a :class:`Plan`'s, over
        the whole mesh, pp axis included.

    Example:
      >>> units = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
      >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=units)
      >>> isinstance(pp, fsdpfn.Plan), pp.stages.num_stages, [u.name for u in pp.stage_plan(0).units]
      (False, 2, ['embed', 'pos', 'blocks.0'])
    """

    def __post_init__(self):
        super().__post_init__()
        _kind_check(self)

    @classmethod
    def from_json(cls, s: str, mesh=None) -> "PipelinedPlan":
        """Rebuilds a pipelined plan saved with :meth:`to_json`, optionally bound to ``mesh``.

        Example:
          >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=["embed", "pos", "blocks.0", "blocks.1", "norm", "head"])
          >>> same = fsdpfn.PipelinedPlan.from_json(pp.to_json())
          >>> same == pp, same.stages == pp.stages
          (True, True)
        """
        return plan_from_dict(json.loads(s), cls, mesh)

    def bind(self, mesh) -> "PipelinedPlan":
        """The same plan bound to a live ``DeviceMesh`` (e.g. after :meth:`from_json`)."""
        return cast(PipelinedPlan, super().bind(mesh))

    def stage_plan(self, stage: int) -> Plan:
        """The plan of one pipeline stage: its units on the mesh without the ``pp`` axis, where
        every other axis works as in a plan without pp (``fsdpfn.shard``, ``unshard`` and
        ``reduce`` take it as they are). Bound to this rank's part of the mesh when this rank
        runs ``stage``, else unbound (a shape, for printing and costing).

        Example:
          >>> units = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
          >>> p = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=units)
          >>> s1 = p.stage_plan(1)
          >>> [u.name for u in s1.units], s1.axes.describe(), s1.pp_stage
          (['blocks.1', 'norm', 'head'], 'dp=2 (shard)', (1, 2))
        """
        if not isinstance(stage, int) or not 0 <= stage < self.stages.num_stages:
            raise ValueError(
                f"stage {stage!r} is not a stage of the plan; its stages are 0..{self.stages.num_stages - 1}"
            )
        axes = self.axes
        pp_dim = axes.dim(Role.PP)
        keep = [d for d in range(len(axes.shape)) if d != pp_dim]
        names = tuple(axes.names[d] for d in keep)
        mesh = None
        if self.mesh is not None and self.mesh.get_local_rank(axes.names[cast(int, pp_dim)]) == self.stages.rank_of(
            stage
        ):
            mesh = self.mesh[names if len(names) > 1 else names[0]]
            mark_stage_mesh(
                mesh, self.mesh, axes.names[cast(int, pp_dim)]
            )  # [Note: a stage's parameters are part of one model]
        units = tuple(u for u in self.units if u.name in self.stages.units[stage])
        held = {p.name for u in units for p in u.params}
        tp = tuple((m, style) for m, style in self.tp if any(n.startswith(m + ".") for n in held))
        return Plan(
            units,
            tuple(axes.shape[d] for d in keep),
            names,
            self.mp,
            mesh,
            tuple(axes.roles[d].value for d in keep),
            tp,
            None,
            (stage, self.stages.pp_size),
        )
