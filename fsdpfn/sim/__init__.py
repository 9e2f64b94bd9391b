"""Plans at scale: a hardware model, a simulator of the runtime's schedule, and a plan search.

``simulate(plan, schedule, workload, optimizer, hardware)`` predicts a training step -- a
timeline of compute and communication streams with the overlap the schedule allows, exposed
communication, bytes per link level, memory per rank -- for plans that run here and for
abstract ones (``fsdpfn.plan(meta_model, (16, 64))``) that nobody can run. ``measure()`` fits a
:class:`Hardware` on the ranks at hand; ``H100_SXM`` & co. are presets from datasheets and
published kernel benchmarks (:class:`Kernels`), checked against published training runs;
``search()`` finds the fastest plan that fits a memory budget.

Example:
  >>> wl = fsdpfn.sim.profile(model, plan, x)
  >>> r = fsdpfn.sim.simulate(plan, runtime.schedule(plan), wl, fsdpfn.sim.Muon(), fsdpfn.sim.H100_SXM)
  >>> r.memory["unsharded_peak"] == rt.memory.high_water
  True
"""

from fsdpfn.sim._engine import Task as Task
from fsdpfn.sim._engine import run as run_tasks
from fsdpfn.sim._hardware import A100_SXM as A100_SXM
from fsdpfn.sim._hardware import A100_SXM_40GB as A100_SXM_40GB
from fsdpfn.sim._hardware import H100_96GB_500W as H100_96GB_500W
from fsdpfn.sim._hardware import H100_SXM as H100_SXM
from fsdpfn.sim._hardware import H200_SXM as H200_SXM
from fsdpfn.sim._hardware import PRESETS as PRESETS
from fsdpfn.sim._hardware import Hardware as Hardware
from fsdpfn.sim._hardware import Link as Link
from fsdpfn.sim._kernels import Kernels as Kernels
from fsdpfn.sim._hardware import collective_steps as collective_steps
from fsdpfn.sim._hardware import wire_bytes as wire_bytes
from fsdpfn.sim._measure import Timings as Timings
from fsdpfn.sim._measure import fit_hardware as fit_hardware
from fsdpfn.sim._measure import measure as measure
from fsdpfn.sim._measure import measure_timings as measure_timings
from fsdpfn.sim._optimizer import AdamW as AdamW
from fsdpfn.sim._optimizer import CommCost as CommCost
from fsdpfn.sim._optimizer import Muon as Muon
from fsdpfn.sim._optimizer import OptimizerCost as OptimizerCost
from fsdpfn.sim._optimizer import Wait as Wait
from fsdpfn.sim._optimizer import local_shapes as local_shapes
from fsdpfn.sim._optimizer import owner_loads as owner_loads
from fsdpfn.sim._search import Candidate as Candidate
from fsdpfn.sim._search import SearchResult as SearchResult
from fsdpfn.sim._search import finer_units as finer_units
from fsdpfn.sim._search import pipeline_units as pipeline_units
from fsdpfn.sim._search import search as search
from fsdpfn.sim._pipeline import PipelineSimResult as PipelineSimResult
from fsdpfn.sim._pipeline_times import PipelineTimes as PipelineTimes
from fsdpfn.sim._pipeline_times import pipeline_times as pipeline_times
from fsdpfn.sim._pipeline import simulate_pipeline as simulate_pipeline
from fsdpfn.sim._simulate import SimResult as SimResult
from fsdpfn.sim._simulate import Span as Span
from fsdpfn.sim._simulate import Traffic as Traffic
from fsdpfn.sim._simulate import simulate as simulate
from fsdpfn.sim._workload import Work as Work
from fsdpfn.sim._workload import Workload as Workload
from fsdpfn.sim._workload import count_work as count_work
from fsdpfn.sim._workload import profile as profile

__all__ = [
    "A100_SXM",
    "A100_SXM_40GB",
    "AdamW",
    "Candidate",
    "CommCost",
    "H100_96GB_500W",
    "H100_SXM",
    "H200_SXM",
    "Hardware",
    "Kernels",
    "Link",
    "Muon",
    "OptimizerCost",
    "PRESETS",
    "PipelineSimResult",
    "PipelineTimes",
    "SearchResult",
    "SimResult",
    "Span",
    "Task",
    "Timings",
    "Traffic",
    "Wait",
    "Work",
    "Workload",
    "collective_steps",
    "count_work",
    "finer_units",
    "fit_hardware",
    "local_shapes",
    "measure",
    "measure_timings",
    "owner_loads",
    "pipeline_times",
    "pipeline_units",
    "profile",
    "run_tasks",
    "search",
    "simulate",
    "simulate_pipeline",
    "wire_bytes",
]
