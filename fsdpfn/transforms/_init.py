"""Sharded initialisation of models built on the meta device, and its one-process twin.

A model built under ``torch.device("meta")`` has shapes and dtypes but no values, so
``fsdpfn.plan`` works on it (the plan reads nothing else) while no rank ever holds it whole.
:func:`init_shards` then creates the values one parameter at a time on the target device, keeps
this rank's part (its tensor-parallel slice, then its rows of that) and frees the rest;
:func:`init_full` creates the same values in one process.

[Note: seed per parameter path]
The values must not depend on the world size, the plan, the units or the order in which they
are visited, or a run could not be reproduced on another cluster and parity tests would be
meaningless. So every parameter gets its own seed, derived from the user's seed and the
parameter's path (``param_seed``), and is initialised alone: the parameter is swapped in as a
real, empty tensor while every other parameter of the model stays on the meta device, the
random generators of the CPU and of the target device are seeded, and the initialiser runs.
Operations the initialiser applies to the other (meta) parameters cost nothing and change
nothing, so the default initialiser can be the owning module's ``reset_parameters()``, which
initialises all of the module's parameters at once: called once per parameter, it fills only
that one. Each parameter therefore ends up with the values it would have if
``reset_parameters()`` ran right after ``torch.manual_seed(param_seed(seed, path))``, whoever
computes it. The same seed gives the same values on the same device type; CPU and CUDA
generators produce different streams.

Consequences, documented on the public functions:
- A tied parameter has one path, the first name ``named_parameters()`` gives it (the plan's
  name), and is initialised by the module that owns that name.
- A module's initialiser only initialises its own parameters: a ``reset_parameters()`` that
  writes a child's parameters (``nn.MultiheadAttention`` zeroes ``out_proj.bias``) does not
  reach them, the child's own initialiser decides.
- An initialiser that reads another parameter's values (copies one into another) fails with
  "Cannot copy out of meta tensor"; write it as ``param_init`` instead.

Memory: the largest transient is one full parameter (plus this rank's part of it, copied out).
Without tensor parallelism that is at most one unit; with it, the full parameter is the global
one, up to ``tp`` times the tensor-parallel-local size a unit counts.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from typing import Callable, Iterator, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn._plan import Plan
from fsdpfn.transforms._checks import check_plan_agree, check_values_agree, checksums
from fsdpfn.transforms._local import local_index, local_shape
from fsdpfn.transforms._sharding import check_plan_kind, from_local
from fsdpfn.transforms._remat import apply_remat
from fsdpfn.transforms._tp import apply_tp

__all__ = ["init_full", "init_shards", "param_seed"]

ModuleInit = Callable[[nn.Module, str], None]
ParamInit = Callable[[str, torch.Tensor], None]


def param_seed(seed: int, path: str) -> int:
    """The seed parameter ``path`` is initialised with under the user's ``seed``: 63 bits of
    SHA-256 of both, so it depends on nothing else (see [Note: seed per parameter path]).

    Example:
      >>> param_seed(0, "blocks.0.fc.weight") == param_seed(0, "blocks.0.fc.weight")
      True
      >>> param_seed(0, "blocks.0.fc.weight") != param_seed(1, "blocks.0.fc.weight")
      True
    """
    digest = hashlib.sha256(f"fsdpfn.init:{int(seed)}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------
# Validation, on every rank, before any collective
# ---------------------------------------------------------------------------------------------


def _check_init_args(seed, init, param_init) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if init is not None and param_init is not None:
        raise ValueError("pass init=(module, name) -> None or param_init=(path, tensor) -> None, not both")
    for what, fn in (("init", init), ("param_init", param_init)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{what} must be a callable, got {type(fn).__name__}")


def _owners(model: nn.Module, names) -> dict[str, tuple[nn.Module, str]]:
    """``{path: (owning module, attribute name)}`` for every path in ``names``."""
    out = {}
    for path in names:
        prefix, _, local = path.rpartition(".")
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            module = None
        if module is None or not isinstance(module._parameters.get(local), torch.Tensor):
            raise ValueError(
                f"parameter {path!r} of the plan is not a parameter of {type(model).__name__}; "
                "was the plan built for another model?"
            )
        out[path] = (module, local)
    return out


def _check_model(model: nn.Module, plan: Plan | None, names, init, param_init) -> dict[str, tuple[nn.Module, str]]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module (built under torch.device('meta')), got {type(model).__name__}")
    owners = _owners(model, names)
    for path, (module, local) in owners.items():
        param = cast(nn.Parameter, module._parameters[local])  # a registered parameter (_owners), never None
        if plan is not None:
            spec = plan.param(path)
            if tuple(param.shape) != spec.shape or param.dtype != spec.dtype:
                raise ValueError(
                    f"parameter {path!r} is {tuple(param.shape)} {param.dtype} in the model but {spec.shape} {spec.dtype} "
                    "in the plan; build the plan from this model"
                )
        if init is None and param_init is None and not callable(getattr(module, "reset_parameters", None)):
            prefix = path.rpartition(".")[0]
            raise ValueError(
                f"module {prefix or '<root>'!r} ({type(module).__name__}) owns parameter {path!r} but has no reset_parameters(); "
                "give it one, or pass init=lambda module, name: ... or param_init=lambda path, tensor: ..."
            )
    return owners


def _describe(seed: int, init, param_init) -> str:
    fn = init or param_init
    how = (
        "reset_parameters"
        if fn is None
        else f"{'init' if init else 'param_init'}={getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    )
    return f"seed={seed}, {how}"


def _target_device(plan: Plan | None, device) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device='meta' creates no values; pass the device the shards should live on")
        return device
    mesh = plan.mesh if plan is not None else None
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# One parameter at a time
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """The initialisers seed the global generators; the caller's streams are restored after."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        yield


def _seed(device: torch.device, seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _materialise(
    path: str, module: nn.Module, local: str, device: torch.device, seed: int, init, param_init
) -> torch.Tensor:
    """The values of one parameter, created and initialised alone (see [Note: seed per parameter path])."""
    old = cast(nn.Parameter, module._parameters[local])  # as in _check_model
    value = torch.empty(old.shape, dtype=old.dtype, device=device)
    live = module._parameters[local] = nn.Parameter(value, requires_grad=old.requires_grad)
    try:
        _seed(device, param_seed(seed, path))
        with torch.no_grad():
            if param_init is not None:
                param_init(path, value)
            elif init is not None:
                init(module, local)
            else:
                module.reset_parameters()  # type: ignore[operator]  # _check_model saw it is callable
        if module._parameters[local] is not live:
            raise ValueError(
                f"the initialiser replaced parameter {path!r} instead of filling it in place; "
                "write into it (torch.nn.init.*_, tensor.copy_(...), tensor.normal_(...))"
            )
    except Exception as e:
        try:  # the same exception type, with the parameter named
            named = type(e)(
                f"initialising {path!r} (alone: the model's other parameters are on the meta device) failed: {e}"
            )
        except Exception:
            raise e from None
        raise named from e
    finally:
        module._parameters[local] = old
    return value


def _meta_view(model: nn.Module) -> nn.Module:
    """``model`` itself if all its parameters are on meta, else a copy whose parameters are (so
    that an initialiser never overwrites the values of a real model)."""
    params = list(model.parameters())
    if all(p.is_meta for p in params):
        return model
    memo: dict[int, torch.Tensor] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in params
    }
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def _values(
    model: nn.Module, names, seed: int, init, param_init, device, before=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, full value)`` of each parameter in ``names``, one at a time (arguments checked);
    ``before(path)`` runs before each is created."""
    view = _meta_view(model)
    owners = _owners(view, names)
    with _forked_rng(device):
        for path in names:
            module, local = owners[path]
            if before is not None:
                before(path)
            yield path, _materialise(path, module, local, device, seed, init, param_init)


# ---------------------------------------------------------------------------------------------
# Public
# ---------------------------------------------------------------------------------------------


def init_shards(
    model: nn.Module,
    plan: Plan,
    *,
    seed: int = 0,
    init: ModuleInit | None = None,
    param_init: ParamInit | None = None,
    device=None,
    requires_grad: bool = False,
    check: bool = True,
) -> dict[str, DTensor]:
    """This rank's shards of a freshly initialised model that no rank holds whole.

    Build the model under ``torch.device("meta")`` (shapes, no memory), make its plan, and call
    this instead of :func:`fsdpfn.shard`. Each parameter is created on ``device``, initialised,
    cut to this rank's part (its tensor-parallel slice, then its ``torch.chunk`` rows of that)
    and freed, one at a time, so the peak memory is this rank's shards plus one full parameter.
    A plan with ``tp`` also gets its activation collectives installed on ``model``
    (:func:`fsdpfn.apply_tp`), as :func:`fsdpfn.shard` does. The values depend only on ``seed``,
    the initialiser and each parameter's path: not on the world size, the plan, its units or
    strategies, HSDP or the tensor-parallel degree (see [Note: seed per parameter path] in
    ``fsdpfn/transforms/_init.py``); :func:`init_full` gives the same values whole, in one process.

    With ``check`` (the default) the ranks first compare the plan fingerprint, the seed and the
    initialiser (one small all-gather per mesh dim), and afterwards float64 checksums of the full
    values each rank generated (one more): an initialiser that depends on the rank or on an
    unseeded generator is a ``ValueError`` naming the parameter, not a silently mixed model.

    Args:
      model: the model, normally built under ``torch.device("meta")`` (a real model works too:
        its values are ignored and left alone). It stays a skeleton for
        ``torch.func.functional_call``; its buffers are not touched.
      plan: the plan, built from ``model``.
      seed: the seed every parameter's own seed is derived from.
      init: ``(module, name) -> None`` filling ``getattr(module, name)`` in place, called once per
        parameter with the module that owns it (e.g. ``lambda m, n: hf_model._init_weights(m)``).
        Default: ``module.reset_parameters()``.
      param_init: ``(path, tensor) -> None`` filling the parameter ``path`` in place (e.g.
        ``lambda path, t: torch.nn.init.normal_(t, std=0.02)``). Not with ``init``.
      device: where the shards live (default: the current CUDA device for a CUDA mesh, else CPU).
      requires_grad: mark the shards as leaves requiring grad (for ``loss.backward()`` loops).
      check: verify that the ranks agree (two small all-gathers per mesh dim).

    Returns:
      ``{name: DTensor}`` in the plan's order, placed like :func:`fsdpfn.shard`'s.

    Raises:
      ValueError: a module without ``reset_parameters()`` (and no ``init``), a plan of another
        model, ranks with different plans, seeds or initialisers, values that differ by rank.

    Example:
      >>> with torch.device("meta"):  # shapes only: a 7B model costs nothing here
      ...     big = GPT(GPTConfig(vocab_size=64, width=32, depth=2))
      >>> big_plan = fsdpfn.plan(big, mesh)
      >>> shards = fsdpfn.init_shards(big, big_plan, seed=0)
      >>> shards["blocks.0.fc.weight"].to_local().shape  # this rank's part (all of it on 1 rank)
      torch.Size([128, 32])
      >>> twin = fsdpfn.init_full(big, seed=0)
      >>> torch.equal(fsdpfn.comm.full_tensor(shards["blocks.0.fc.weight"]), twin["blocks.0.fc.weight"])
      True
    """
    check_plan_kind(plan, "init_shards")
    names = plan.param_names
    device = _target_device(plan, device)
    _check_init_args(seed, init, param_init)
    _check_model(model, plan, names, init, param_init)
    boxes = {path: local_index(plan, path) for path in names}  # also: a plan without a mesh is named here
    if check:
        check_plan_agree(plan, _describe(seed, init, param_init), what="init seed and initialiser", device=device)
    out: dict[str, DTensor] = {}
    pairs = []
    kept: dict[str, torch.Tensor] = {}

    def allocate_local(path: str) -> None:
        # This rank's part is allocated before the full parameter, which then sits on top of it
        # and is freed right after: transients do not leave holes between the shards kept.
        spec = plan.param(path)
        shape = local_shape(plan, path, boxes[path])
        if tuple(shape) != spec.shape:
            kept[path] = torch.empty(shape, dtype=spec.dtype, device=device)

    with torch.no_grad():
        for path, full in _values(model, names, seed, init, param_init, device, before=allocate_local):
            if path in kept:  # its tensor-parallel slice, then its rows of that (one box of full)
                local = kept.pop(path).copy_(full[boxes[path]])
            else:
                local = full  # replicated, or all of it
            if check:
                pairs.append(checksums([full]))
            del full  # the rest: freed before the next parameter is created
            out[path] = from_local(plan, path, local, requires_grad)
    if check:
        table = torch.stack(pairs) if pairs else torch.zeros(0, 2, dtype=torch.float64)
        check_values_agree(
            plan,
            names,
            table.T.reshape(-1).to(device),
            fix=(
                "the initialiser gave different values on different ranks: it must draw only from the global generators "
                "fsdpfn seeds (torch.manual_seed per parameter path), never from the rank or an unseeded torch.Generator"
            ),
        )
    # The model carries the tp hooks and remat wrappers of its latest plan, as after fsdpfn.shard.
    apply_tp(model, plan)
    apply_remat(model, plan)
    return {n: out[n] for n in names}


def init_full(
    model: nn.Module,
    *,
    seed: int = 0,
    init: ModuleInit | None = None,
    param_init: ParamInit | None = None,
    device="cpu",
) -> dict[str, torch.Tensor]:
    """The one-process twin of :func:`init_shards`: the full parameters it would shard, bitwise.

    For tests, evaluation and export on a machine that holds the whole model. Arguments as in
    :func:`init_shards`; the result is keyed like ``model.named_parameters()`` (a tied parameter
    under its first name). ``model.load_state_dict(init_full(model), strict=False, assign=True)``
    materialises a meta model with these values. ``device`` (default CPU) must have the device
    type :func:`init_shards` used: CPU and CUDA generators give different streams for a seed.

    Example:
      >>> with torch.device("meta"):
      ...     model = torch.nn.Linear(4, 3)
      >>> full = init_full(model, seed=0)
      >>> full["weight"].shape, full["weight"].device.type
      (torch.Size([3, 4]), 'cpu')
    """
    _check_init_args(seed, init, param_init)
    names = [n for n, _ in model.named_parameters()] if isinstance(model, nn.Module) else []
    _check_model(model, None, names, init, param_init)
    device = _target_device(None, device)
    return dict(_values(model, names, seed, init, param_init, device))
