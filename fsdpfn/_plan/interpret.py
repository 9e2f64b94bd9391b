"""One protocol for everything that interprets a step's ops.

[Note: one interpreter protocol]
A step is an op list (:func:`fsdpfn._plan.schedule.unit_ops` per stage, laid out per pp rank by
:func:`fsdpfn._plan.pipeline.pipeline_schedule`), and four things interpret it: the executor
(moves the bytes), the pipeline runtime (runs the stages, sends and receives, and hands each
stage's FSDP actions to that stage's executor), the simulator (prices each op as tasks on
streams) and the pipeline timing engine (a clock per pp rank). Each is a
:class:`StepInterpreter`:

- ``reset_step()`` starts a step: what a step holds lives in one value the interpreter makes
  fresh here, so nothing of one step reaches the next;
- ``run(op)`` interprets one action op (an event is not run: the model reaches it, and the
  interpreters that walk a whole list handle events in that walk).

Which method interprets which op kind is one table, :data:`HANDLERS`: an interpreter names the
vocabulary it takes (:data:`FSDP_ACTIONS`, :data:`PIPELINE_ACTIONS`, or both) and
:func:`bind_handlers` looks its methods up once, when it is built, so one that lacks a kind of
its vocabulary is refused there, naming the kind and the method it needs, not when the first
such op comes. A new op kind is one row here and one method per interpreter of its vocabulary.

The checks a step runs as it starts (its batch on the first steps, the differential check on
the first) are one value, :class:`fsdpfn.transforms.StepChecks`, that every step machine holds
(see [Note: the checks of a step] there); the replay check runs inside each recompute.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from fsdpfn._plan.pipeline import PipeKind
from fsdpfn._plan.schedule import OpKind

__all__ = ["FSDP_ACTIONS", "HANDLERS", "PIPELINE_ACTIONS", "StepInterpreter", "bind_handlers"]

# The method that interprets each action op kind, on every interpreter of its vocabulary.
HANDLERS: Mapping[Any, str] = {
    OpKind.GATHER: "_gather",
    OpKind.WAIT: "_wait",
    OpKind.FREE: "_free",
    OpKind.REDUCE: "_reduce",
    OpKind.WAIT_REDUCE: "_wait_reduce",
    OpKind.COPY_IN: "_copy_in",
    OpKind.COPY_OUT: "_copy_out",
    OpKind.ACCUMULATE: "_accumulate",
    PipeKind.STAGE_FORWARD: "_stage_forward",
    PipeKind.STAGE_BACKWARD: "_stage_backward",
    PipeKind.STAGE_BACKWARD_INPUT: "_stage_backward_input",
    PipeKind.STAGE_BACKWARD_WEIGHT: "_stage_backward_weight",
    PipeKind.SEND_ACT: "_send",
    PipeKind.SEND_GRAD: "_send",
    PipeKind.RECV_ACT: "_recv_act",
    PipeKind.RECV_GRAD: "_recv_grad",
}

FSDP_ACTIONS: tuple[OpKind, ...] = tuple(k for k in OpKind if not k.is_event)
PIPELINE_ACTIONS: tuple[PipeKind, ...] = tuple(PipeKind)


@runtime_checkable
class StepInterpreter(Protocol):
    """What interprets a step's op list (see [Note: one interpreter protocol])."""

    def reset_step(self) -> None:
        """Starts a step: the step's state is made fresh, nothing of the last step is kept."""

    def run(self, op: Any) -> None:
        """Interprets one action op of this interpreter's vocabulary now."""


def bind_handlers(interpreter: object, vocabulary: Iterable[Any]) -> dict[Any, Callable[[Any], None]]:
    """``{kind: bound method}`` of ``interpreter`` for each op kind of ``vocabulary``, looked up
    by :data:`HANDLERS`; raises ``TypeError`` naming every kind it has no method for.

    Example:
      >>> class Counter:
      ...     def __init__(self):
      ...         self.seen, self.handlers = [], bind_handlers(self, [OpKind.GATHER])
      ...     def _gather(self, op):
      ...         self.seen.append(op)
      >>> sorted(k.value for k in Counter().handlers)
      ['gather']
      >>> bind_handlers(Counter(), [OpKind.FREE])
      Traceback (most recent call last):
      ...
      TypeError: Counter cannot interpret op kind 'free': it has no method _free
    """
    handlers, missing = {}, []
    for kind in vocabulary:
        method = getattr(interpreter, HANDLERS[kind], None)
        if method is None:
            missing.append(f"op kind {kind.value!r}: it has no method {HANDLERS[kind]}")
        else:
            handlers[kind] = method
    if missing:
        raise TypeError(f"{type(interpreter).__name__} cannot interpret " + "; ".join(missing))
    return handlers
