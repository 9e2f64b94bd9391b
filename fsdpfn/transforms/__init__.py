"""Pure transforms over parameter pytrees: shard, unshard (differentiable), reduce, and the
per-unit kernels the runtime schedules.

``count_collectives``, ``CollectiveCall``, ``CollectiveCounter`` and ``set_reduce_scatter_impl``
live in :mod:`fsdpfn.comm` now; the names here are kept for code written before.
"""

from fsdpfn.comm import CollectiveCall as CollectiveCall
from fsdpfn.comm import CollectiveCounter as CollectiveCounter
from fsdpfn.comm import count_collectives as count_collectives
from fsdpfn.comm import set_reduce_scatter_impl as set_reduce_scatter_impl
from fsdpfn.transforms._init import init_full as init_full
from fsdpfn.transforms._init import init_shards as init_shards
from fsdpfn.transforms._init import param_seed as param_seed
from fsdpfn.transforms._safetensors import load_safetensors as load_safetensors
from fsdpfn.transforms._compiled import CompiledStep as CompiledStep
from fsdpfn.transforms._compiled import CompileUnsupportedError as CompileUnsupportedError
from fsdpfn.transforms._compiled import compile as compile
from fsdpfn.transforms._compiled import recording_backend as recording_backend
from fsdpfn.transforms._compiled import unshard_traced as unshard_traced
from fsdpfn.transforms._sharding import check_params as check_params
from fsdpfn.transforms._sharding import check_plan_kind as check_plan_kind
from fsdpfn.transforms._sharding import dp_rank as dp_rank
from fsdpfn.transforms._sharding import from_local as from_local
from fsdpfn.transforms._sharding import gather_unit as gather_unit
from fsdpfn.transforms._sharding import placements as placements
from fsdpfn.transforms._sharding import reduce_unit as reduce_unit
from fsdpfn.transforms._sharding import replicate_group as replicate_group
from fsdpfn.transforms._sharding import shard_group as shard_group
from fsdpfn.transforms._sharding import shard_rank as shard_rank
from fsdpfn.transforms._sharding import reduce as reduce
from fsdpfn.transforms._sharding import shard as shard
from fsdpfn.transforms._sharding import unshard as unshard
from fsdpfn.transforms._sharding import tp_group as tp_group
from fsdpfn.transforms._sharding import tp_rank as tp_rank
from fsdpfn.transforms._sharding import tp_slice as tp_slice
from fsdpfn.transforms._axes import cp_group as cp_group
from fsdpfn.transforms._cp import context_parallel as context_parallel
from fsdpfn.transforms._cp import context_parallel_attention as context_parallel_attention
from fsdpfn.transforms._cp import context_parallel_positions as context_parallel_positions
from fsdpfn.transforms._cp import context_parallel_shard as context_parallel_shard
from fsdpfn.transforms._cp import context_parallel_unshard as context_parallel_unshard
from fsdpfn.transforms._cp import ring_merge as ring_merge
from fsdpfn.transforms._axes import cp_rank as cp_rank
from fsdpfn.transforms._axes import ep_group as ep_group
from fsdpfn.transforms._axes import ep_rank as ep_rank
from fsdpfn.transforms._axes import unit_group as unit_group
from fsdpfn.transforms._axes import unit_mesh as unit_mesh
from fsdpfn.transforms._axes import unit_mesh_dim as unit_mesh_dim
from fsdpfn.transforms._axes import unit_rank as unit_rank
from fsdpfn.transforms._remat import apply_remat as apply_remat
from fsdpfn.transforms._tp import apply_tp as apply_tp
from fsdpfn.transforms._tp import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fsdpfn.transforms._verify import Comparison as Comparison
from fsdpfn.transforms._verify import VerificationError as VerificationError
from fsdpfn.transforms._verify import VerifyReport as VerifyReport
from fsdpfn.transforms._verify import verify as verify
from fsdpfn.transforms._verify import verify_stage as verify_stage
from fsdpfn.transforms._verify import verify_stage_loss as verify_stage_loss
from fsdpfn.transforms._verify import verify_step as verify_step
from fsdpfn.transforms._guards import CHECKED_STEPS as CHECKED_STEPS
from fsdpfn.transforms._guards import StepChecks as StepChecks
from fsdpfn.transforms._guards import check_batch as check_batch
from fsdpfn.transforms._guards import check_step_batch as check_step_batch
from fsdpfn.transforms._guards import note_capture as note_capture
from fsdpfn.transforms._guards import note_step as note_step
from fsdpfn.transforms._guards import cut_watch as cut_watch

__all__ = [
    "CHECKED_STEPS",
    "Comparison",
    "VerificationError",
    "VerifyReport",
    "verify",
    "verify_stage",
    "verify_stage_loss",
    "verify_step",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_positions",
    "context_parallel_shard",
    "context_parallel_unshard",
    "ring_merge",
    "cp_group",
    "cp_rank",
    "apply_remat",
    "apply_tp",
    "vocab_parallel_cross_entropy",
    "CollectiveCall",
    "CompiledStep",
    "CompileUnsupportedError",
    "CollectiveCounter",
    "count_collectives",
    "StepChecks",
    "check_batch",
    "check_step_batch",
    "check_params",
    "check_plan_kind",
    "note_capture",
    "note_step",
    "cut_watch",
    "compile",
    "recording_backend",
    "unshard_traced",
    "dp_rank",
    "from_local",
    "gather_unit",
    "init_full",
    "init_shards",
    "load_safetensors",
    "param_seed",
    "placements",
    "reduce_unit",
    "replicate_group",
    "shard_group",
    "shard_rank",
    "reduce",
    "set_reduce_scatter_impl",
    "shard",
    "tp_group",
    "tp_rank",
    "tp_slice",
    "ep_group",
    "ep_rank",
    "unit_group",
    "unit_mesh",
    "unit_mesh_dim",
    "unit_rank",
    "unshard",
]
