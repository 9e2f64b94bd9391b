"""SGD (momentum, nesterov) and AdamW, each with the arithmetic of its ``torch.optim`` twin.

Both keep ``count`` (updates done so far) as a plain int: ``update`` stays pure, the learning
rate schedule reads it, and torch.distributed.checkpoint saves it as is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsdpfn.optim._base import GradientTransformation
from fsdpfn.optim._checks import check_real, check_schedule
from fsdpfn.optim._schedules import ScalarOrSchedule
from fsdpfn.optim._tree import map_local, zeros_like_tree

__all__ = ["AdamWState", "SGDState", "adamw", "sgd"]


def _need_params(params: Any, who: str) -> None:
    if params is None:
        raise ValueError(f"{who} with weight_decay != 0 needs the parameters: call update(grads, state, params)")


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
      count: updates done so far (int).
      momentum_buffer: tree like the parameters (same dtype and placements), or ``None`` when
        ``momentum == 0``.
    """

    count: int  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    momentum_buffer: Any


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent as ``torch.optim.SGD`` (no dampening).

    ``g += weight_decay * p`` (coupled, as torch does); ``b = momentum * b + g``; the step is
    ``g + momentum * b`` with nesterov, else ``b``; the update is ``-lr * step``.

    Args:
      lr: a number >= 0 or a schedule of the step count (called at step 0 when built, and its
        value checked at every step: see ``fsdpfn/optim/_checks.py``).
      momentum: momentum factor, >= 0.
      nesterov: Nesterov momentum (needs ``momentum > 0``).
      weight_decay: L2 penalty added to the gradient, >= 0.

    Raises:
      ValueError: a setting is out of the range above (the message names it), raised here, when
        the transform is built, never inside a collective.

    Example:
      >>> opt = fsdpfn.optim.sgd(0.1, momentum=0.9)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> updates["w"]
      tensor([-0.1000, -0.1000])
    """
    schedule = check_schedule("sgd", "lr", lr)
    momentum = check_real("sgd", "momentum", momentum, lo=0.0, fix="Pass 0 for plain SGD.")
    weight_decay = check_real("sgd", "weight_decay", weight_decay, lo=0.0)
    if not isinstance(nesterov, bool):
        raise ValueError(f"sgd: nesterov={nesterov!r} is invalid: nesterov must be True or False.")
    if nesterov and momentum == 0:
        raise ValueError(
            "sgd: nesterov=True needs momentum > 0 (as torch.optim.SGD), got momentum=0. Pass momentum=0.9, or nesterov=False."
        )

    def init(params):
        return SGDState(0, zeros_like_tree(params) if momentum else None)

    def update(updates, state, params=None):
        lr = schedule(state.count)
        if weight_decay:
            _need_params(params, "sgd")
            updates = map_local(lambda g, p: g.add(p.to(g.dtype), alpha=weight_decay), updates, params)
        buf = state.momentum_buffer
        if momentum:
            buf = map_local(lambda b, g: b.mul(momentum).add(g), buf, updates)
            if nesterov:
                updates = map_local(lambda g, b: g.add(b, alpha=momentum), updates, buf)
            else:
                updates = buf
        updates = map_local(lambda g: g.mul(-lr), updates)
        return updates, SGDState(state.count + 1, buf)

    return GradientTransformation(init, update)


class AdamWState(NamedTuple):
    """State of :func:`adamw`.

    Attributes:
      count: updates done so far (int).
      mu: first moment, a tree like the parameters (same dtype and placements).
      nu: second moment, likewise.
    """

    count: int  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    mu: Any
    nu: Any


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> GradientTransformation:
    """AdamW (decoupled weight decay) with the arithmetic of ``torch.optim.AdamW``.

    The moments, bias corrections and denominator are computed with torch's operations in
    torch's order, so ``mu`` and ``nu`` match it bitwise. The update is
    ``-lr/(1-b1^t) * mu / (sqrt(nu)/sqrt(1-b2^t) + eps) - lr * weight_decay * p``; torch instead
    multiplies ``p`` by ``1 - lr * weight_decay`` and adds with a fused multiply-add, so
    parameters agree to about one ulp per step, not bitwise.

    Args:
      lr: a number >= 0 or a schedule of the step count (called at step 0 when built, and its
        value checked at every step).
      b1, b2: moment decay rates, in ``[0, 1)``.
      eps: added to the denominator, >= 0.
      weight_decay: decoupled weight decay (scaled by the learning rate, as torch does), >= 0.

    Raises:
      ValueError: a setting is out of the range above (the message names it), raised when the
        transform is built.

    Example:
      >>> opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.0)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> updates["w"]
      tensor([-0.0010, -0.0010])

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    schedule = check_schedule("adamw", "lr", lr)
    beta_fix = "Decay rates are in [0, 1): torch.optim.AdamW's betas=(0.9, 0.999) are b1=0.9, b2=0.999."
    b1 = check_real("adamw", "b1", b1, lo=0.0, hi=1.0, hi_open=True, fix=beta_fix)
    b2 = check_real("adamw", "b2", b2, lo=0.0, hi=1.0, hi_open=True, fix=beta_fix)
    eps = check_real("adamw", "eps", eps, lo=0.0, fix="Pass a small positive value such as 1e-8.")
    weight_decay = check_real("adamw", "weight_decay", weight_decay, lo=0.0)

    def init(params):
        return AdamWState(0, zeros_like_tree(params), zeros_like_tree(params))

    def update(updates, state, params=None):
        lr = schedule(state.count)
        count = state.count + 1
        bias_correction1 = 1 - b1**count
        bias_correction2_sqrt = (1 - b2**count) ** 0.5
        step_size = lr / bias_correction1
        mu = map_local(lambda m, g: m.lerp(g, 1 - b1), state.mu, updates)
        nu = map_local(lambda v, g: torch.addcmul(v.mul(b2), g, g, value=1 - b2), state.nu, updates)

        def step(m, v):
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            return (m / denom).mul_(-step_size)

        new = map_local(step, mu, nu)
        if weight_decay:
            _need_params(params, "adamw")
            new = map_local(lambda u, p: u.sub_(p.to(u.dtype), alpha=lr * weight_decay), new, params)
        return new, AdamWState(count, mu, nu)

    return GradientTransformation(init, update)
