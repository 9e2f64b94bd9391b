"""export_full: sharded parameters -> one plain ``state_dict`` file, loadable without fsdpfn."""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdpfn.checkpoint._collective import arrive

__all__ = ["export_full"]


def _full(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if isinstance(x, DTensor):
        x = x.full_tensor()  # collective: every rank must call export_full
    return x.clone().contiguous()


def _state_dict_names(model: torch.nn.Module) -> dict[str, str | None]:
    """``{state_dict key: canonical parameter name, or None for a buffer}``. Tied weights appear
    under every name they have (``model.state_dict()`` lists each), all mapped to the one name
    ``named_parameters()`` (and so the plan) keeps."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {k: canonical.get(id(v)) for k, v in model.state_dict(keep_vars=True).items()}


def export_full(
    path: str | os.PathLike,
    params: Mapping[str, torch.Tensor],
    plan=None,
    *,
    model: torch.nn.Module | None = None,
    dtype: torch.dtype | None = None,
    timeout: float = 600.0,
) -> str | None:
    """Writes the full (unsharded) parameters as one ``torch.save`` file of plain tensors.

    Every rank calls it (the gathers are collective); rank 0 writes the file, atomically
    (a temporary file, then ``os.replace``). The file holds a ``dict[str, Tensor]`` of plain CPU
    tensors only, so ``model.load_state_dict(torch.load(path, weights_only=True))`` works in a
    process without fsdpfn.

    Args:
      path: the output file, e.g. ``runs/gpt/model.pt``.
      params: ``{name: DTensor or tensor}``, e.g. ``state["params"]``.
      plan: the plan ``params`` are sharded by (checked: the names must be the plan's).
      model: the (unsharded) module the state dict is for. If given, the file has exactly
        ``model.state_dict()``'s keys: tied weights under each of their names, and the model's
        buffers. Without it, the keys are ``params``' names.
      dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``) on export.
      timeout: seconds to wait for every rank to enter the call (gloo; see :func:`save`).

    Returns:
      ``path`` on rank 0, ``None`` on the other ranks.

    Example:
      >>> fsdpfn.checkpoint.export_full("model.pt", state["params"], plan, model=model)  # doctest: +SKIP
      >>> GPT(cfg).load_state_dict(torch.load("model.pt", weights_only=True))  # no fsdpfn needed  # doctest: +SKIP
    """
    if plan is not None:
        missing = [n for n in plan.param_names if n not in params]
        extra = [n for n in params if n not in set(plan.param_names)]
        if missing or extra:
            raise ValueError(f"export_full: params do not match the plan (missing {missing[:5]}, not in the plan {extra[:5]})")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    arrive("export_full", timeout)
    with torch.no_grad():
        full = {n: _full(x) for n, x in params.items()}  # same order on every rank
    if dtype is not None:
        full = {n: x.to(dtype) if x.is_floating_point() else x for n, x in full.items()}
    full = {n: x.cpu() for n, x in full.items()}
    if rank == 0:
        if model is None:
            sd = full
        else:
            sd = {}
            for key, name in _state_dict_names(model).items():
                if name is None:
                    sd[key] = model.state_dict()[key].detach().cpu().clone()
                elif name not in full:
                    raise ValueError(f"export_full: model parameter {name!r} (state_dict key {key!r}) is not in params")
                else:
                    sd[key] = full[name]
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(sd, tmp)
        os.replace(tmp, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return os.fspath(path) if rank == 0 else None
