"""Optax-style optimizers over (sharded) parameter pytrees: AdamW, SGD, Muon, combinators.

Every factory checks its settings when called (a ``ValueError`` naming the setting, on every
rank before any collective); :func:`apply_if_finite` skips steps with NaN or inf gradients on
every rank alike. Muon orthogonalises whole matrices or blocks of them (:func:`head_blocks`),
with its communication pipelined under Newton–Schulz (:func:`record_pipeline` shows it);
:class:`TorchOptimizer` runs any transform as a ``torch.optim.Optimizer``.

Example:
  >>> opt = fsdpfn.optim.muon(lr=0.02)
  >>> state = opt.init(params)
  >>> updates, state = opt.update(grads, state, params)
  >>> params = fsdpfn.optim.apply_updates(params, updates)
  >>> params["blocks.0.fc.weight"].placements  # still sharded
  (Shard(dim=0),)
"""

from fsdpfn.optim._base import EmptyState as EmptyState
from fsdpfn.optim._base import GradientTransformation as GradientTransformation
from fsdpfn.optim._base import PartitionState as PartitionState
from fsdpfn.optim._base import apply_updates as apply_updates
from fsdpfn.optim._base import chain as chain
from fsdpfn.optim._base import identity as identity
from fsdpfn.optim._base import partition as partition
from fsdpfn.optim._streamed import streamed as streamed
from fsdpfn.optim._blocks import block_shape as block_shape
from fsdpfn.optim._blocks import check_blocks as check_blocks
from fsdpfn.optim._blocks import head_blocks as head_blocks
from fsdpfn.optim._clip import clip_by_global_norm as clip_by_global_norm
from fsdpfn.optim._clip import global_norm as global_norm
from fsdpfn.optim._distributed_ns import LAYOUTS as LAYOUTS
from fsdpfn.optim._distributed_ns import blockwise_spec as blockwise_spec
from fsdpfn.optim._distributed_ns import blockwise_spec_on_mesh as blockwise_spec_on_mesh
from fsdpfn.optim._distributed_ns import gather_pads as gather_pads
from fsdpfn.optim._distributed_ns import orthogonalize as orthogonalize
from fsdpfn.optim._layout import Box as Box
from fsdpfn.optim._layout import leaf_holdings as leaf_holdings
from fsdpfn.optim._layout import split_mesh_dims as split_mesh_dims
from fsdpfn.optim._finite import ApplyIfFiniteState as ApplyIfFiniteState
from fsdpfn.optim._finite import apply_if_finite as apply_if_finite
from fsdpfn.optim._muon import MuonLRState as MuonLRState
from fsdpfn.optim._muon import ScaleByMuonState as ScaleByMuonState
from fsdpfn.optim._muon import muon as muon
from fsdpfn.optim._muon import muon_labels as muon_labels
from fsdpfn.optim._muon import scale_by_muon as scale_by_muon
from fsdpfn.optim._muon import scale_by_muon_lr as scale_by_muon_lr
from fsdpfn.optim._newton_schulz import newton_schulz as newton_schulz
from fsdpfn.optim._newton_schulz import newton_schulz_flops as newton_schulz_flops
from fsdpfn.optim._owner import BucketRecord as BucketRecord
from fsdpfn.optim._owner import bucket_splits as bucket_splits
from fsdpfn.optim._owner import bucket_totals as bucket_totals
from fsdpfn.optim._owner import SplitTotals as SplitTotals
from fsdpfn.optim._owner import OwnerSchedule as OwnerSchedule
from fsdpfn.optim._owner import PipelineRecord as PipelineRecord
from fsdpfn.optim._owner import owner_schedule as owner_schedule
from fsdpfn.optim._owner import record_pipeline as record_pipeline
from fsdpfn.optim._schedules import constant_schedule as constant_schedule
from fsdpfn.optim._schedules import warmup_cosine_schedule as warmup_cosine_schedule
from fsdpfn.optim._sgd_adamw import AdamWState as AdamWState
from fsdpfn.optim._sgd_adamw import SGDState as SGDState
from fsdpfn.optim._sgd_adamw import adamw as adamw
from fsdpfn.optim._sgd_adamw import sgd as sgd
from fsdpfn.optim._torch_optim import TorchOptimizer as TorchOptimizer

__all__ = [
    "LAYOUTS",
    "streamed",
    "AdamWState",
    "Box",
    "ApplyIfFiniteState",
    "BucketRecord",
    "EmptyState",
    "GradientTransformation",
    "MuonLRState",
    "OwnerSchedule",
    "PartitionState",
    "PipelineRecord",
    "SGDState",
    "ScaleByMuonState",
    "SplitTotals",
    "TorchOptimizer",
    "adamw",
    "apply_if_finite",
    "apply_updates",
    "block_shape",
    "blockwise_spec",
    "blockwise_spec_on_mesh",
    "bucket_splits",
    "bucket_totals",
    "chain",
    "check_blocks",
    "clip_by_global_norm",
    "constant_schedule",
    "gather_pads",
    "global_norm",
    "head_blocks",
    "identity",
    "leaf_holdings",
    "muon",
    "muon_labels",
    "newton_schulz",
    "newton_schulz_flops",
    "orthogonalize",
    "owner_schedule",
    "partition",
    "record_pipeline",
    "scale_by_muon",
    "scale_by_muon_lr",
    "sgd",
    "split_mesh_dims",
    "warmup_cosine_schedule",
]
