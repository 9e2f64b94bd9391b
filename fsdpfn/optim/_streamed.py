"""An optimizer step run on the device for state kept in host memory (offload, streamed).

[Note: where an offloaded unit's optimizer steps]
With ``offload``, a unit's sharded parameters, gradients and optimizer state live in host memory.
The plain way, as FSDP2's ``CPUOffloadPolicy`` does, is to step there: no copies, but the update
runs at the host's memory bandwidth (for AdamW, about 16 bytes read and 12 written per
parameter), which is what makes offloaded steps slow. :func:`streamed` is the other way: each
step copies the parameters, gradients and state to the device, runs the update there and copies
the new state back into the same host buffers (pinned stay pinned); the parameters' updates come
back too, for ``apply_updates`` on the host. It trades host memory traffic for PCIe traffic
(AdamW: 2 state slots + gradients + parameters in, 2 slots + updates out). The arithmetic is the
same kernels' on the same values, so it is bitwise the host step wherever the device computes as
the host does (on a CPU-only machine the "device" is the CPU: the copies go between host buffers).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from fsdpfn.optim._base import GradientTransformation

__all__ = ["streamed"]


def _to(t, device: torch.device, pin: bool = False):
    if not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, DTensor):
        local = _to(t._local_tensor, device, pin)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    out = torch.empty(
        t.shape, dtype=t.dtype, device=device, pin_memory=pin and device.type == "cpu" and torch.cuda.is_available()
    )
    out.copy_(t, non_blocking=True)
    return out


def _write_back(host, dev):
    """``dev`` copied into ``host``'s buffer (in place: pinned memory stays pinned)."""
    if isinstance(host, DTensor):
        _write_back(host._local_tensor, dev._local_tensor if isinstance(dev, DTensor) else dev)
        return host
    if (
        isinstance(host, torch.Tensor)
        and isinstance(dev, torch.Tensor)
        and host.shape == dev.shape
        and host.dtype == dev.dtype
    ):
        host.copy_(dev)
        return host
    return _to(dev, host.device) if isinstance(dev, torch.Tensor) else dev


def _check_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` this process can allocate on, checked now, on every rank,
    rather than at the first update (where a CPU-only torch fails inside a copy)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"streamed: device={device!r} is not a device ({e}); pass 'cuda', 'cuda:0' or 'cpu'."
        ) from None
    try:
        torch.empty(0, device=dev)  # allocates nothing; fails as the first update's copy would
    except (AssertionError, RuntimeError) as e:
        raise ValueError(
            f"streamed: device={str(device)!r} is not available in this process ({e}). Run the update where the state "
            "lives instead (leave streamed out), or pass device='cpu', which runs the same path between host buffers."
        ) from None
    return dev


def streamed(opt: GradientTransformation, device: str | torch.device = "cuda") -> GradientTransformation:
    """``opt`` whose ``update`` runs on ``device`` for trees kept in host memory (see [Note: where
    an offloaded unit's optimizer steps]): gradients, state and parameters are copied in, the
    update runs there, the new state is written back into the host state's buffers and the
    updates are returned on the host. ``init`` is ``opt``'s (the state is made where the
    parameters are). For optimizers whose update is elementwise per leaf (SGD, AdamW); Muon's
    collectives need the device mesh's device.

    Args:
      opt: the optimizer.
      device: where the update runs (``"cuda"``; ``"cpu"`` runs the same path between host buffers).

    Raises:
      TypeError: ``opt`` is not a transform.
      ValueError: when built, ``device`` is no device name, or one this torch cannot allocate on
        (``"cuda"`` on a CPU-only build or with no GPU visible).

    Example:
      >>> opt = fsdpfn.optim.streamed(fsdpfn.optim.adamw(1e-3), device="cpu")
      >>> params = {"w": torch.ones(3)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.full((3,), 0.5)}, state, params)
      >>> updates["w"].device.type
      'cpu'
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"streamed(opt): opt must be an fsdpfn.optim GradientTransformation, got {type(opt).__name__}")
    device = _check_device(device)

    def update(updates: Any, state: Any, params: Any = None):
        none: dict[str, Any] = dict(none_is_leaf=True)
        dev_updates = optree.tree_map(lambda t: _to(t, device), updates, **none)
        dev_state = optree.tree_map(lambda t: _to(t, device), state, **none)
        dev_params = None if params is None else optree.tree_map(lambda t: _to(t, device), params, **none)
        new_updates, new_state = opt.update(dev_updates, dev_state, dev_params)
        host_updates = optree.tree_map(lambda t: _to(t, torch.device("cpu"), pin=True), new_updates, **none)
        leaves, spec = optree.tree_flatten(state, **none)
        new_leaves, new_spec = optree.tree_flatten(new_state, **none)
        if spec != new_spec:  # the state changed shape: nothing to write back into
            return host_updates, optree.tree_map(lambda t: _to(t, torch.device("cpu")), new_state, **none)
        return host_updates, optree.tree_unflatten(spec, [_write_back(h, d) for h, d in zip(leaves, new_leaves)])

    return GradientTransformation(opt.init, update)
