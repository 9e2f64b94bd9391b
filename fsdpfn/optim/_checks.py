"""Settings checks that every optimizer factory runs when it builds its transform.

[Note: validate when built]
A bad setting found at the first ``update`` is found late (after the model is built, sharded and
maybe resumed) and, in a distributed run, possibly on some ranks only: ``ns_steps=-1`` used to
fail inside Newton–Schulz on the ranks that owned a matrix while the other ranks sat in the next
collective and died with "Connection closed by peer". So each factory checks its arguments when
it is called: plain Python, no tensor math and no collective, hence the same verdict on every
rank before any rank communicates. The ranges are the ones ``torch.optim`` enforces (``lr >= 0``,
``eps >= 0``, ``0 <= beta < 1``, ``weight_decay >= 0``, ``momentum >= 0``, nesterov needs
momentum) plus fsdpfn's own (Newton–Schulz steps, coefficients, names of layouts and methods);
every number must also be finite. Errors are ``ValueError`` naming the function, the parameter,
its value and the fix.

A learning-rate schedule cannot be checked for every step in advance, so it is called once at
build time, at step 0 (it must return a finite number >= 0 there), and its value is checked
again at each step it is used, where a bad value names the step. Both checks are host-side
arithmetic on the step count, which every rank holds alike, so they fail on every rank at the
same step.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import torch

__all__ = ["check_choice", "check_int", "check_real", "check_schedule", "check_transform"]


def _fail(who: str, name: str, value: Any, need: str, fix: str) -> ValueError:
    return ValueError(f"{who}: {name}={value!r} is invalid: {need}. {fix}".rstrip())


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a real number or a one-element tensor, else ``None``.
    ``bool`` is refused: a flag where a number belongs is a misplaced positional argument."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value)
    return None


def _interval(name: str, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"{lo:g} {'<' if lo_open else '<='} {name} {'<' if hi_open else '<='} {hi:g}"
    if lo is not None:
        return f"{name} {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{name} {'<' if hi_open else '<='} {hi:g}"
    return f"{name} finite"


def check_real(
    who: str,
    name: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    fix: str = "",
) -> float:
    """``value`` as a float, once it is a finite real number in the interval; else a
    ``ValueError`` naming ``who``, ``name`` and ``value``, ending with ``fix``.

    Example:
      >>> check_real("adamw", "b1", 0.9, lo=0.0, hi=1.0, hi_open=True)
      0.9
      >>> check_real("adamw", "b1", 1.0, lo=0.0, hi=1.0, hi_open=True, fix="Try 0.9.")
      Traceback (most recent call last):
      ValueError: adamw: b1=1.0 is invalid: b1 must be a finite number with 0 <= b1 < 1. Try 0.9.
    """
    v = _as_float(value)
    need = f"{name} must be a finite number with {_interval(name, lo, hi, lo_open, hi_open)}"
    if v is None or not math.isfinite(v):
        raise _fail(who, name, value, need, fix)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _fail(who, name, value, need, fix)
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise _fail(who, name, value, need, fix)
    return v


def check_int(who: str, name: str, value: Any, *, lo: int | None = None, fix: str = "") -> int:
    """``value`` once it is an ``int`` (not a ``bool``) ``>= lo``; else a named ``ValueError``.

    Example:
      >>> check_int("muon", "ns_steps", -1, lo=1)
      Traceback (most recent call last):
      ValueError: muon: ns_steps=-1 is invalid: ns_steps must be an int >= 1.
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and (lo is None or int(value) >= lo)
    if not ok:
        bound = f" >= {lo}" if lo is not None else ""
        raise _fail(who, name, value, f"{name} must be an int{bound}", fix)
    return int(value)


def check_choice(who: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` once it is one of ``choices``; else a named ``ValueError`` listing them.

    Example:
      >>> check_choice("muon", "layout", "owner", ("gather", "owner"))
      'owner'
    """
    if value not in tuple(choices):
        raise _fail(who, name, value, f"{name} must be one of {tuple(choices)}", "")
    return value


def check_transform(who: str, name: str, value: Any) -> Any:
    """``value`` once it has callable ``init`` and ``update`` (a transform, by duck typing, so
    that optax-like pairs from elsewhere pass too).

    Example:
      >>> check_transform("chain", "argument 0", fsdpfn.optim.identity()).init(None)
      EmptyState()
    """
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise ValueError(
            f"{who}: {name} must be a GradientTransformation (an object with init and update), got "
            f"{type(value).__name__}: {value!r:.80}. Build one with a factory such as fsdpfn.optim.sgd(0.1)."
        )
    return value


_LR_FIX = "A negative learning rate ascends the gradient (torch.optim refuses it too); pass a value >= 0."


def check_schedule(who: str, name: str, value: Any, fix: str = _LR_FIX) -> Callable[[int], Any]:
    """A schedule of the step count from a number or a schedule, checked as [Note: validate
    when built] says: a number must be finite and >= 0; a callable is called at step 0 now and
    its value is checked at every step it is used.

    Example:
      >>> lr = check_schedule("sgd", "lr", lambda count: 0.1 * (1 - count))
      >>> lr(0), lr(1)
      (0.1, 0.0)
      >>> lr(2)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: sgd: lr(2)=-0.1 is invalid: lr(2) must be a finite number with lr(2) >= 0. The schedule went out of range at step 2. ...
    """
    if not callable(value):
        number = check_real(who, name, value, lo=0.0, fix=fix)
        return lambda count: number
    schedule = value
    try:
        first = schedule(0)
    except Exception as e:  # noqa: BLE001 - any failure of a user schedule is a settings error
        raise ValueError(
            f"{who}: {name} is a schedule that fails at step 0 ({type(e).__name__}: {e}). A schedule takes "
            "the step count (an int, 0 for the first update) and returns a number."
        ) from e
    check_real(who, f"{name}(0)", first, lo=0.0, fix=fix)

    def checked(count: int) -> Any:
        lr = schedule(count)
        # A device tensor would cost a host sync per step to read; it was checked at step 0.
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            return lr
        check_real(who, f"{name}({count})", lr, lo=0.0, fix=f"The schedule went out of range at step {count}. {fix}")
        return lr

    return checked
