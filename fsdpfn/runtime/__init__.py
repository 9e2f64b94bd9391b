"""The runtime: executes a plan with an explicit per-unit schedule (prefetch, reshard after
forward, asynchronous reduce-scatter, gradient accumulation) with the pure path's numbers."""

from fsdpfn.runtime._comm import CpuComm as CpuComm
from fsdpfn.runtime._comm import CudaComm as CudaComm
from fsdpfn.runtime._executor import RuntimeScheduleError as RuntimeScheduleError
from fsdpfn.runtime._executor import StepRecord as StepRecord
from fsdpfn.runtime._memory import MemoryTracker as MemoryTracker
from fsdpfn.runtime._pipeline import PipelineProfile as PipelineProfile
from fsdpfn.runtime._pipeline import PipelineRuntime as PipelineRuntime
from fsdpfn.runtime._runtime import Runtime as Runtime
from fsdpfn._plan.schedule import GradState as GradState
from fsdpfn._plan.schedule import Op as Op
from fsdpfn._plan.schedule import OpKind as OpKind
from fsdpfn._plan.schedule import Schedule as Schedule
from fsdpfn._plan.schedule import ScheduleError as ScheduleError
from fsdpfn._plan.schedule import UnitState as UnitState
from fsdpfn._plan.schedule import schedule as schedule
from fsdpfn._plan.schedule import validate as validate

__all__ = [
    "CpuComm",
    "CudaComm",
    "GradState",
    "MemoryTracker",
    "Op",
    "OpKind",
    "PipelineProfile",
    "PipelineRuntime",
    "Runtime",
    "RuntimeScheduleError",
    "Schedule",
    "ScheduleError",
    "StepRecord",
    "UnitState",
    "schedule",
    "validate",
]
