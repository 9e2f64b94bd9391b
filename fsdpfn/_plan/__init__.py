"""The plan layer: frozen, validated plan values and everything derived from a plan alone.

No module here talks to a rank or imports ``fsdpfn.transforms``, ``fsdpfn.runtime``, ``fsdpfn.optim``
or ``fsdpfn.sim``; those read plans. Inside the package, imports point down:

    builder      fsdpfn.plan(), pipeline_plan(): read a model and a mesh, return a validated plan
    stages       Stages, split_stages: pipeline stages as runs of units
    tp_layout    the tensor-parallel layout checks on the model (fused and GQA projections)
    plan_type    Plan, PipelinedPlan: the values plus cost(), from_json(), stage_plan()
    cost         plan.cost(): sums of the step's collectives and static memory
    serialise    JSON -> plan, every format an fsdpfn wrote
    steps        step_collectives / step_ops: the schedule's ops expanded into collectives
    interpret    StepInterpreter: run(op), reset_step(), and the one table of op-kind handlers
    pipeline     pipeline_schedule(): every pp rank's op list (stage ops, send/recv, FSDP's actions per
                 stage from schedule.unit_ops); validate_pipeline and run_order (the order every
                 rank's ops run in together, which fsdpfn.sim's pipeline_times prices)
    schedule     schedule(): the one op list of a training step
    wire         wire_bytes: what one rank sends for one collective (the one formula)
    attention    AttentionCall: attention's key/value exchange over cp, as the op list costs it
    values       PlanValues, Unit, ParamSpec, MixedPrecision, Strategy: the data and its layouts
    encode       plan -> JSON and the fingerprint
    placements   a parameter's placement on each model-parallel axis, and everything derived from it
    axes         named mesh axes and their roles (MeshAxes, Role)

Other packages import the values from here (``from fsdpfn._plan import Plan``) and a derived
figure from its module (``from fsdpfn._plan.steps import step_collectives``).
"""

from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.builder import pipeline_plan, plan
from fsdpfn._plan.pipeline import (
    PIPELINE_SCHEDULES,
    PipeKind,
    PipelineSchedule,
    PipeOp,
    pipeline_schedule,
    run_order,
    validate_pipeline,
)
from fsdpfn._plan.plan_type import PipelinedPlan, Plan
from fsdpfn._plan.stages import Stages, split_stages
from fsdpfn._plan.values import (
    HSDP_DIM_NAMES,
    ROOT,
    ROOT_LABEL,
    STRATEGIES,
    TP_MODULE_STYLES,
    TP_STYLES,
    ByteSlot,
    Float8Layout,
    MixedPrecision,
    ParamSpec,
    Slot,
    Strategy,
    Unit,
    unit_label,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipeKind",
    "PipeOp",
    "PipelineSchedule",
    "pipeline_schedule",
    "run_order",
    "validate_pipeline",
    "ByteSlot",
    "Float8Layout",
    "HSDP_DIM_NAMES",
    "MeshAxes",
    "MixedPrecision",
    "ParamSpec",
    "PipelinedPlan",
    "Plan",
    "ROOT",
    "ROOT_LABEL",
    "Role",
    "STRATEGIES",
    "Slot",
    "Stages",
    "Strategy",
    "TP_MODULE_STYLES",
    "TP_STYLES",
    "Unit",
    "pipeline_plan",
    "plan",
    "split_stages",
    "unit_label",
]
