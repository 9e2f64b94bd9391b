"""Pure transforms over parameter pytrees, and the collectives they are built from."""

from fsdpfn.transforms._collectives import CollectiveCall as CollectiveCall
from fsdpfn.transforms._collectives import CollectiveCounter as CollectiveCounter
from fsdpfn.transforms._collectives import count_collectives as count_collectives
from fsdpfn.transforms._collectives import set_reduce_scatter_impl as set_reduce_scatter_impl
from fsdpfn.transforms._sharding import placements as placements
from fsdpfn.transforms._sharding import reduce as reduce
from fsdpfn.transforms._sharding import shard as shard
from fsdpfn.transforms._sharding import unshard as unshard

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "count_collectives",
    "placements",
    "reduce",
    "set_reduce_scatter_impl",
    "shard",
    "unshard",
]
