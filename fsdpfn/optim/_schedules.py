"""Learning-rate schedules: plain functions of the step count (0 for the first update)."""

from __future__ import annotations

import math
from typing import Callable, Union

from fsdpfn.optim._checks import check_int, check_real

__all__ = ["Schedule", "constant_schedule", "warmup_cosine_schedule", "resolve"]

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step.

    Raises:
      ValueError: ``value`` is not a finite number.

    Example:
      >>> fsdpfn.optim.constant_schedule(0.1)(1000)
      0.1
    """
    value = check_real("constant_schedule", "value", value)
    return lambda count: value


def warmup_cosine_schedule(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (counted from 0, warm-up included), then flat.

    Raises:
      ValueError: a value is not a finite number, a step count is not an int, or
        ``0 <= warmup_steps <= decay_steps`` does not hold (the message names the argument).

    Example:
      >>> s = fsdpfn.optim.warmup_cosine_schedule(1.0, warmup_steps=10, decay_steps=110)
      >>> s(0), s(5), s(10), s(60), s(110)
      (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    who = "warmup_cosine_schedule"
    peak_value = check_real(who, "peak_value", peak_value)
    end_value = check_real(who, "end_value", end_value)
    init_value = check_real(who, "init_value", init_value)
    warmup_steps = check_int(who, "warmup_steps", warmup_steps, lo=0)
    fix = f"decay_steps counts from 0 with the warm-up included: pass decay_steps >= warmup_steps={warmup_steps}."
    decay_steps = check_int(who, "decay_steps", decay_steps, lo=warmup_steps, fix=fix)

    def schedule(count: int) -> float:
        count = int(count)
        if count < warmup_steps:
            return init_value + (peak_value - init_value) * count / warmup_steps
        span = decay_steps - warmup_steps
        t = min(1.0, (count - warmup_steps) / span) if span > 0 else 1.0
        cos = 0.5 * (1.0 + math.cos(math.pi * t))
        return end_value + (peak_value - end_value) * cos

    return schedule


def resolve(lr: ScalarOrSchedule) -> Schedule:
    """A schedule from a number or a schedule."""
    return lr if callable(lr) else constant_schedule(lr)
