"""export_full: sharded parameters -> one plain ``state_dict`` file, loadable without fsdpfn."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from fsdpfn import comm
from fsdpfn._plan import PipelinedPlan
from fsdpfn._plan.axes import Role
from fsdpfn.transforms import check_params
from fsdpfn.checkpoint._agree import agree, decide, timeout_scope

__all__ = ["export_full"]


def _full(x: torch.Tensor) -> torch.Tensor:
    return comm.full_tensor(x.detach(), tag="export_full").clone().contiguous()


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
    timeout: float | None = None,
) -> str | None:
    """Writes the full (unsharded) parameters as one ``torch.save`` file of plain tensors.

    Every rank calls it (the gathers are collective); rank 0 writes the file, atomically
    (a temporary file, then ``os.replace``). The file holds a ``dict[str, Tensor]`` of plain CPU
    tensors only, so ``model.load_state_dict(torch.load(path, weights_only=True))`` works in a
    process without fsdpfn. An error on any rank (a parameter missing, a path rank 0 cannot
    write) is raised on every rank.

    Args:
      path: the output file, e.g. ``runs/gpt/model.pt``.
      params: ``{name: DTensor or tensor}``, e.g. ``state["params"]``.
      plan: the plan ``params`` are sharded by (checked: the names must be the plan's).
      model: the (unsharded) module the state dict is for. If given, the file has exactly
        ``model.state_dict()``'s keys: tied weights under each of their names, and the model's
        buffers. Without it, the keys are ``params``' names.
        A pipelined plan (a mesh with a ``pp`` axis) takes each rank's own stages' parameters
        (``PipelineRuntime.shard``'s): every stage's full tensors travel to rank 0, which
        writes the whole model.
      dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``) on export.
      timeout: seconds each collective of the call may wait, the entry check included
        (see :func:`fsdpfn.checkpoint.save`); default ``None``: :func:`fsdpfn.comm.timeout`.

    Returns:
      ``path`` on rank 0, ``None`` on the other ranks.

    Raises:
      ValueError: ``params`` lack a parameter of the plan or the model (on every rank).
      OSError: rank 0 could not write ``path`` (raised on every rank; the message names it).

    Example:
      >>> fsdpfn.checkpoint.export_full("model.pt", params, plan, model=model)
      'model.pt'
      >>> GPT(cfg).load_state_dict(torch.load("model.pt", weights_only=True))  # no fsdpfn needed
      <All keys matched successfully>
    """
    with timeout_scope(timeout):
        comm.arrive("fsdpfn.checkpoint.export_full")
        problem = None
        try:
            keys = _check_names(params, plan, model)
        except ValueError as e:
            problem = e
        agree(problem, "fsdpfn.checkpoint.export_full")
        with torch.no_grad():
            if isinstance(plan, PipelinedPlan):
                full = _gather_stages(params, plan)
            else:
                full = {n: _full(x) for n, x in params.items()}  # same order on every rank
        if dtype is not None:
            full = {n: x.to(dtype) if x.is_floating_point() else x for n, x in full.items()}
        full = {n: x.cpu() for n, x in full.items()}
        path = os.fspath(path)
        decide(lambda: _write(path, full, keys, model), f"fsdpfn.checkpoint.export_full({path!r})")
    return path if comm.rank() == 0 else None


def _check_names(params, plan, model) -> dict[str, str | None] | None:
    """``{state_dict key: parameter name or None}`` (``None`` without a model), after checking
    that ``params`` has the plan's and the model's parameters."""
    here = plan.param_names if plan is not None else list(params)
    if isinstance(plan, PipelinedPlan):
        stage_plans = _stage_plans(plan)
        for sp in stage_plans:
            check_params({n: params.get(n) for n in sp.param_names}, sp, "export_full(params)")
        here = [n for sp in stage_plans for n in sp.param_names]
        extra = sorted(set(params) - set(here))
        if extra:
            raise ValueError(
                f"export_full: params holds {extra[:4]}, which are not in this rank's pipeline stages; pass "
                "this rank's stages' parameters (PipelineRuntime.shard's dict)"
            )
        here = plan.param_names  # every stage's, on rank 0
    elif plan is not None:
        check_params(params, plan, "export_full(params)")
    if model is None:
        return None
    keys = _state_dict_names(model)
    absent = [(k, n) for k, n in keys.items() if n is not None and n not in here]
    if absent:
        key, name = absent[0]
        raise ValueError(
            f"export_full: model parameter {name!r} (state_dict key {key!r}) is not in {'the plan' if isinstance(plan, PipelinedPlan) else 'params'} "
            f"({len(absent)} missing); pass every parameter of the model"
        )
    return keys


def _stage_plans(plan) -> list:
    """The stage plans of the stages this rank runs."""
    pp_name = plan.axes.names[plan.axes.dim(Role.PP)]
    return [plan.stage_plan(s) for s in plan.stages.stages_of(plan.mesh.get_local_rank(pp_name))]


def _gather_stages(params, plan) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor on rank 0 (the others return what they gathered).

    [Note: exporting a pipeline]
    Each stage's ranks gather its parameters as without pp (over the stage's mesh); then the pp
    rank of the stage that holds global rank 0's other coordinates (its pp group) sends them to
    rank 0, one point-to-point transfer per tensor, shaped and typed as the plan says. Every rank
    walks the plan's parameters in the same order, so each stage's gathers and each pair's
    transfers happen in one order everywhere."""
    pp_name = plan.axes.names[plan.axes.dim(Role.PP)]
    group = plan.mesh.get_group(pp_name)
    me, to_zero = plan.mesh.get_local_rank(pp_name), 0 in comm.group_ranks(group)
    full, sends = {}, []
    for name in plan.param_names:  # one order on every rank
        owner = plan.stages.rank_of(plan.stages.stage_of(plan.unit_of(name).name))
        if owner == me:
            full[name] = _full(params[name])
            if to_zero and me != 0:
                sends.append(comm.pp_send(full[name], 0, group, tag="export_full"))
        elif to_zero and me == 0:
            spec = plan.param(name)
            full[name] = comm.pp_recv(torch.empty(spec.shape, dtype=spec.dtype), owner, group, tag="export_full").wait()
    for pending in sends:
        pending.wait()
    return full


def _write(path: str, full: dict[str, torch.Tensor], keys, model) -> None:
    """Rank 0: the state dict, written atomically (a temporary file, then ``os.replace``)."""
    if keys is None:
        sd = full
    else:
        buffers = model.state_dict()
        sd = {k: full[n] if n is not None else buffers[k].detach().cpu().clone() for k, n in keys.items()}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(sd, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports an unopenable file as RuntimeError
        kind = type(e) if isinstance(e, OSError) else OSError
        raise kind(f"cannot write {path!r}: {e}. Pass a path whose directory rank 0 can create and write.") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
