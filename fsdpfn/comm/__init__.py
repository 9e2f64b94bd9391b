"""The communication layer: every distributed call fsdpfn makes goes through here.

Collectives on flat tensors, each beside its transpose (``all_gather`` / ``reduce_scatter``,
``all_reduce``, ``all_to_all``, ``broadcast``), the differentiable tensor-parallel activation
collectives (``tp_copy`` / ``tp_reduce``, ``tp_gather_last`` / ``tp_split_last``), the
context-parallel ones (``cp_all_gather``, ``cp_ring_shift``, on ``send_recv``), the pipeline's
point-to-point hop (``pp_send_recv``, on ``send_recv`` too), object and DTensor
collectives built on them, one
timeout for all of them, a counter (:func:`count_collectives`) and a flight recorder that names
the ranks which are behind when a collective fails (:class:`CollectiveError`).

Example:
  >>> with fsdpfn.comm.count_collectives() as counter, fsdpfn.comm.timeout_scope(30):
  ...     fsdpfn.comm.barrier()
  >>> counter.counts()
  {'barrier': 1}
"""

from fsdpfn.comm._collectives import CollectiveError as CollectiveError
from fsdpfn.comm._collectives import Pending as Pending
from fsdpfn.comm._collectives import all_gather as all_gather
from fsdpfn.comm._collectives import all_reduce as all_reduce
from fsdpfn.comm._collectives import all_to_all as all_to_all
from fsdpfn.comm._collectives import announce_failure as announce_failure
from fsdpfn.comm._collectives import barrier as barrier
from fsdpfn.comm._collectives import broadcast as broadcast
from fsdpfn.comm._collectives import healthy as healthy
from fsdpfn.comm._collectives import reduce_scatter as reduce_scatter
from fsdpfn.comm._collectives import reduce_scatter_impl as reduce_scatter_impl
from fsdpfn.comm._collectives import send_recv as send_recv
from fsdpfn.comm._cp import cp_all_gather as cp_all_gather
from fsdpfn.comm._cp import cp_ring_shift as cp_ring_shift
from fsdpfn.comm._pp import pp_recv as pp_recv
from fsdpfn.comm._pp import pp_send as pp_send
from fsdpfn.comm._pp import pp_send_recv as pp_send_recv
from fsdpfn.comm._collectives import set_reduce_scatter_impl as set_reduce_scatter_impl
from fsdpfn.comm._groups import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from fsdpfn.comm._groups import backend as backend
from fsdpfn.comm._lifecycle import destroy_process_group as destroy_process_group
from fsdpfn.comm._agree import exchange_problems as exchange_problems
from fsdpfn.comm._agree import exchange_values as exchange_values
from fsdpfn.comm._groups import group_rank as group_rank
from fsdpfn.comm._groups import group_ranks as group_ranks
from fsdpfn.comm._groups import group_size as group_size
from fsdpfn.comm._groups import init_process_group as init_process_group
from fsdpfn.comm._groups import is_initialized as is_initialized
from fsdpfn.comm._groups import mesh_subgroup as mesh_subgroup
from fsdpfn.comm._groups import rank as rank
from fsdpfn.comm._groups import ranks_group as ranks_group
from fsdpfn.comm._groups import set_timeout as set_timeout
from fsdpfn.comm._groups import thread_group as thread_group
from fsdpfn.comm._groups import timeout as timeout
from fsdpfn.comm._groups import timeout_scope as timeout_scope
from fsdpfn.comm._groups import world_size as world_size
from fsdpfn.comm._objects import all_gather_object as all_gather_object
from fsdpfn.comm._objects import all_gather_rows as all_gather_rows
from fsdpfn.comm._objects import arrive as arrive
from fsdpfn.comm._objects import broadcast_object as broadcast_object
from fsdpfn.comm._objects import full_tensor as full_tensor
from fsdpfn.comm._record import CollectiveCall as CollectiveCall
from fsdpfn.comm._replicas import Lighthouse as Lighthouse
from fsdpfn.comm._replicas import ReplicaGroup as ReplicaGroup
from fsdpfn.comm._replicas import ReplicaStep as ReplicaStep
from fsdpfn.comm._record import CollectiveCounter as CollectiveCounter
from fsdpfn.comm._record import FlightRecord as FlightRecord
from fsdpfn.comm._record import count_collectives as count_collectives
from fsdpfn.comm._record import uncounted as uncounted
from fsdpfn.comm._record import flight_records as flight_records
from fsdpfn.comm._record import group_info as group_info
from fsdpfn.comm._record import set_flight_dir as set_flight_dir
from fsdpfn.comm._record import set_job as set_job
from fsdpfn.comm._ep import ep_all_to_all as ep_all_to_all
from fsdpfn.comm._ep import ep_counts as ep_counts
from fsdpfn.comm._tp import tp_copy as tp_copy
from fsdpfn.comm._traceable import compiling as compiling
from fsdpfn.comm._traceable import count_compiled as count_compiled
from fsdpfn.comm._traceable import graph_collectives as graph_collectives
from fsdpfn.comm._traceable import traced_all_gather as traced_all_gather
from fsdpfn.comm._traceable import traced_all_reduce as traced_all_reduce
from fsdpfn.comm._traceable import traced_all_to_all as traced_all_to_all
from fsdpfn.comm._traceable import traced_reduce_scatter as traced_reduce_scatter
from fsdpfn.comm._traceable import traced_shift as traced_shift
from fsdpfn.comm._tp import tp_gather_last as tp_gather_last
from fsdpfn.comm._tp import tp_reduce as tp_reduce
from fsdpfn.comm._tp import tp_split_last as tp_split_last

__all__ = [
    "mesh_subgroup",
    "DEFAULT_TIMEOUT",
    "CollectiveCall",
    "CollectiveCounter",
    "CollectiveError",
    "FlightRecord",
    "Lighthouse",
    "ReplicaGroup",
    "ReplicaStep",
    "Pending",
    "all_gather",
    "all_gather_object",
    "all_gather_rows",
    "all_reduce",
    "all_to_all",
    "announce_failure",
    "arrive",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_object",
    "compiling",
    "count_collectives",
    "uncounted",
    "count_compiled",
    "destroy_process_group",
    "exchange_problems",
    "exchange_values",
    "flight_records",
    "full_tensor",
    "graph_collectives",
    "group_info",
    "group_rank",
    "group_ranks",
    "group_size",
    "healthy",
    "init_process_group",
    "is_initialized",
    "rank",
    "ranks_group",
    "reduce_scatter",
    "reduce_scatter_impl",
    "send_recv",
    "cp_all_gather",
    "cp_ring_shift",
    "pp_recv",
    "pp_send",
    "pp_send_recv",
    "set_reduce_scatter_impl",
    "set_flight_dir",
    "set_job",
    "set_timeout",
    "thread_group",
    "timeout",
    "timeout_scope",
    "tp_copy",
    "traced_all_gather",
    "traced_all_reduce",
    "traced_all_to_all",
    "traced_reduce_scatter",
    "traced_shift",
    "tp_gather_last",
    "tp_reduce",
    "tp_split_last",
    "world_size",
    "ep_all_to_all",
    "ep_counts",
]
