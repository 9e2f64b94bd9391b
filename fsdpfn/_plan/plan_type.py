"""The public :class:`fsdpfn.Plan`: a plan's values with the two methods that read other plan
modules.

[Note: the plan's class and its values]
``Plan.cost()`` runs the cost model, which expands the step's schedule into collectives, and
``Plan.from_json()`` runs the JSON reader, which builds plans; both of those read a plan's values.
So the values (``values.PlanValues``: fields, checks, layouts, dtypes, codecs, the JSON writer and
the fingerprint) sit at the bottom of the package, the cost model and the reader above them, and
this class on top, where it imports both. Every module's imports point down, and no registry
or import side effect connects a method to its implementation. Code inside the plan package
annotates with ``PlanValues``; everything outside it sees ``Plan``.
"""

from __future__ import annotations

import json
from typing import Any

from fsdpfn._plan.cost import PlanCost, plan_cost
from fsdpfn._plan.serialise import plan_from_dict
from fsdpfn._plan.values import PlanValues

__all__ = ["Plan"]


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
    """

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
