"""fsdpfn: functional fully sharded data parallelism (FSDP / ZeRO / HSDP) and Muon for PyTorch.

Subpackages: ``fsdpfn.comm`` (every collective, the timeout, the counter), ``fsdpfn.optim``,
``fsdpfn.runtime``, ``fsdpfn.checkpoint``, ``fsdpfn.fp8`` (FP8 recipes and the FP8 parameter
all-gather policy), ``fsdpfn.testing`` (run your tests on N gloo ranks), ``fsdpfn.launch`` (start
a job on N ranks).

Example:
  >>> plan = fsdpfn.plan(model, mesh, strategy="zero3")
  >>> params = fsdpfn.shard(model, plan)
  >>> full = fsdpfn.unshard(params, plan)  # differentiable; its VJP is fsdpfn.reduce
  >>> [type(u).__name__ for u in plan.units][:2], type(plan.units[0].params[0]).__name__
  (['Unit', 'Unit'], 'ParamSpec')
"""

from fsdpfn._codec import GatherCodec as GatherCodec
from fsdpfn._codec import PlainCodec as PlainCodec
from fsdpfn._codec import PlainReduceCodec as PlainReduceCodec
from fsdpfn._codec import ReduceCodec as ReduceCodec
from fsdpfn._codec import register_codec as register_codec
from fsdpfn._codec import registered_codecs as registered_codecs
from fsdpfn._plan.cost import PlanCost as PlanCost
from fsdpfn._plan.axes import MeshAxes as MeshAxes
from fsdpfn._plan.axes import Role as Role
from fsdpfn._plan import MixedPrecision as MixedPrecision
from fsdpfn._plan import ParamSpec as ParamSpec
from fsdpfn._plan import PipelinedPlan as PipelinedPlan
from fsdpfn._plan import Plan as Plan
from fsdpfn._plan import Stages as Stages
from fsdpfn._plan import PipeOp as PipeOp
from fsdpfn._plan import PIPELINE_SCHEDULES as PIPELINE_SCHEDULES
from fsdpfn._plan import PipelineSchedule as PipelineSchedule
from fsdpfn._plan import pipeline_schedule as pipeline_schedule
from fsdpfn._plan import validate_pipeline as validate_pipeline
from fsdpfn._plan import Strategy as Strategy
from fsdpfn._plan import Unit as Unit
from fsdpfn._plan import pipeline_plan as pipeline_plan
from fsdpfn._plan import plan as plan
from fsdpfn._remat import RematReplayError as RematReplayError
from fsdpfn._remat import checkpoint_name as checkpoint_name
from fsdpfn._remat import register_remat_policy as register_remat_policy
from fsdpfn._remat import remat_policies as remat_policies
from fsdpfn._plan.attention import AttentionCall as AttentionCall
from fsdpfn._plan.steps import Collective as Collective
from fsdpfn._plan.steps import step_collectives as step_collectives
from fsdpfn.comm import count_collectives as count_collectives
from fsdpfn.transforms import CompileUnsupportedError as CompileUnsupportedError
from fsdpfn.transforms import apply_tp as apply_tp
from fsdpfn.transforms import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fsdpfn.transforms import compile as compile
from fsdpfn.transforms import context_parallel as context_parallel
from fsdpfn.transforms import context_parallel_attention as context_parallel_attention
from fsdpfn.transforms import context_parallel_positions as context_parallel_positions
from fsdpfn.transforms import context_parallel_shard as context_parallel_shard
from fsdpfn.transforms import context_parallel_unshard as context_parallel_unshard
from fsdpfn.transforms import init_full as init_full
from fsdpfn.transforms import init_shards as init_shards
from fsdpfn.transforms import load_safetensors as load_safetensors
from fsdpfn.transforms import reduce as reduce
from fsdpfn.transforms import shard as shard
from fsdpfn.transforms import unshard as unshard
from fsdpfn.transforms import VerificationError as VerificationError
from fsdpfn.transforms import VerifyReport as VerifyReport
from fsdpfn.transforms import verify as verify
from fsdpfn.transforms import verify_step as verify_step

# Subpackages users reach as fsdpfn.comm, fsdpfn.optim, fsdpfn.runtime, fsdpfn.checkpoint, ...
from fsdpfn import checkpoint as checkpoint
from fsdpfn import comm as comm
from fsdpfn import fp8 as fp8
from fsdpfn import ft as ft
from fsdpfn import optim as optim
from fsdpfn import runtime as runtime
from fsdpfn import sim as sim
from fsdpfn.sim import pipeline_times as pipeline_times
from fsdpfn import testing as testing

__version__ = "0.1.0"

__all__ = [
    "GatherCodec",
    "PlainCodec",
    "PlainReduceCodec",
    "ReduceCodec",
    "register_codec",
    "registered_codecs",
    "RematReplayError",
    "checkpoint_name",
    "register_remat_policy",
    "remat_policies",
    "AttentionCall",
    "Collective",
    "CompileUnsupportedError",
    "MeshAxes",
    "MixedPrecision",
    "ParamSpec",
    "PipelinedPlan",
    "Plan",
    "PlanCost",
    "Role",
    "Stages",
    "PipeOp",
    "PIPELINE_SCHEDULES",
    "PipelineSchedule",
    "pipeline_schedule",
    "pipeline_times",
    "validate_pipeline",
    "Strategy",
    "Unit",
    "apply_tp",
    "vocab_parallel_cross_entropy",
    "checkpoint",
    "comm",
    "compile",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_positions",
    "context_parallel_shard",
    "context_parallel_unshard",
    "count_collectives",
    "fp8",
    "ft",
    "init_full",
    "init_shards",
    "load_safetensors",
    "optim",
    "pipeline_plan",
    "plan",
    "reduce",
    "runtime",
    "shard",
    "sim",
    "step_collectives",
    "testing",
    "unshard",
    "VerificationError",
    "VerifyReport",
    "verify",
    "verify_step",
]
