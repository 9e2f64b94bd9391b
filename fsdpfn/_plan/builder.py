"""The plan builder: :func:`fsdpfn.plan` reads a model's parameters and a mesh and returns a
validated :class:`~fsdpfn.Plan` (the value types live in ``values.py``).
"""

from __future__ import annotations

import inspect

from typing import Any, Callable, Mapping, Sequence, Union

from torch import nn

from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.placements import AxisPlacement, Placement, Replicate, Shard, module_placement, rows_size
from fsdpfn._plan.values import (
    ROOT,
    ROOT_LABEL,
    STRATEGIES,
    MixedPrecision,
    ParamSpec,
    Strategy,
    Unit,
    _did_you_mean,
    _dtype_name,
    _FP8_INPUT_DTYPES,
    unit_label,
)
from fsdpfn._patterns import first_match
from fsdpfn._plan.plan_type import PipelinedPlan, Plan
from fsdpfn._plan.stages import split_stages
from fsdpfn._plan.tp_layout import check_tp_layout
from fsdpfn._plan.tp_styles import TP_FUSED_PREFIX, TP_STYLE_TABLE, style_names, style_row, tp_style
from fsdpfn.fp8 import check_te

__all__ = ["pipeline_plan", "plan"]


UnitsArg = Union[None, Sequence[str], Callable[[str, nn.Module], bool]]
StrategyArg = Union[str, Mapping[str, str]]


def _select_units(model: nn.Module, units: UnitsArg) -> list[str]:
    modules = dict(model.named_modules())
    if units is None:
        names = [
            f"{name}.{child}" if name else child
            for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList)
            for child, _ in mod.named_children()
        ]
    elif callable(units):
        names = [name for name, mod in model.named_modules() if name and units(name, mod)]
    elif isinstance(units, str):
        raise ValueError(f"units must be a list of module names, got the string {units!r}; use [{units!r}]")
    else:
        names = list(units)
        for name in names:
            if not isinstance(name, str):
                raise ValueError(f"units must be module names (str), got {name!r}")
            if name not in modules:
                raise ValueError(
                    f"unit {name!r} names no module of {type(model).__name__}{_did_you_mean(name, list(modules))}"
                )
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"units lists {dupes} more than once; name each module once")
    return [""] + [n for n in names if n != ""]


def _owner(param_name: str, unit_names: list[str]) -> str:
    best = ""
    for u in unit_names:
        if u and (param_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _strategy_for(strategy: StrategyArg, unit_names: list[str]) -> dict[str, str]:
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        return {u: strategy for u in unit_names}
    if not isinstance(strategy, Mapping):
        raise ValueError(f"strategy must be a str or a dict {{unit_name: strategy}}, got {type(strategy).__name__}")
    default = strategy.get("*", "zero3")
    labels = {ROOT_LABEL: ROOT}
    out = {u: default for u in unit_names}
    for key, value in strategy.items():
        if key == "*":
            continue
        unit = labels.get(key, key)
        if unit not in out:
            raise ValueError(
                f"strategy names unit {key!r}, which is not a unit of this plan{_did_you_mean(key, unit_names)}"
            )
        out[unit] = value
    for unit, value in out.items():
        if value not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {value!r} for unit {unit_label(unit)!r}; choose one of {', '.join(STRATEGIES)}"
            )
    return out


TPArg = Union[None, Mapping[str, str]]


def _per_unit(arg, unit_names: list[str], what: str, default, root_default) -> dict:
    """``{unit: value}`` from one value for every unit (the root gets ``root_default`` unless
    it is None, which means the same value) or a dict ``{unit name pattern: value}``."""
    out = {u: default for u in unit_names}
    if arg is None:
        return out
    if not isinstance(arg, Mapping):
        return {u: (arg if u or root_default is None else root_default) for u in unit_names}
    label_of = {unit_label(u): u for u in unit_names}
    for label, pattern in first_match(arg, list(label_of), what, "unit of this plan").items():  # [Note: pattern rule]
        out[label_of[label]] = arg[pattern]
    return out


def _axes_of(mesh, axes: Mapping[str, Any] | None) -> tuple[MeshAxes, tuple[str, ...] | None, Any]:
    """``(axes, dim names as given, live mesh or None)`` from a DeviceMesh or an abstract shape."""
    if axes is not None and not isinstance(axes, Mapping):
        raise ValueError(f"axes must be a dict {{mesh dim name: role}}, got {type(axes).__name__}")
    if isinstance(mesh, (int, tuple, list, Mapping)):
        parsed = MeshAxes.from_shape(tuple(mesh) if isinstance(mesh, list) else mesh, axes)
        names = parsed.names if isinstance(mesh, Mapping) or len(parsed.shape) != 1 else None
        return parsed, names, None
    if not hasattr(mesh, "mesh") or not hasattr(mesh, "mesh_dim_names"):
        raise ValueError(
            f"mesh must be a torch DeviceMesh, a shape tuple like (W,) or a dict like {{'dp': 2, 'tp': 2}}, got {type(mesh).__name__}"
        )
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    return MeshAxes.from_mesh(mesh, axes), names, mesh


def _check_not_parallelised(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(
                f"parameter {name!r} is already a DTensor placed {tuple(p.placements)} on mesh {p.device_mesh.mesh_dim_names or tuple(p.device_mesh.mesh.shape)} "
                "(a model parallelised by torch's parallelize_module or fully_shard). fsdpfn shards the plain model itself and "
                "would lose that split: pass the model before parallelize_module and give the tensor-parallel styles to "
                "fsdpfn.plan(model, mesh, tp={'blocks.*.attn.qkv': 'colwise', ...})."
            )


_ATTENTION_WORDS = ("attention", "attn", "softmax")


def _mentions_attention(cls: type) -> bool | None:
    """Whether ``cls``'s name or ``forward`` source mentions attention (``None``: no source)."""
    if any(w in cls.__name__.lower() for w in _ATTENTION_WORDS):
        return True
    try:
        source = inspect.getsource(getattr(cls, "forward"))
    except (OSError, TypeError):
        return None
    return any(w in source.lower() for w in _ATTENTION_WORDS)


def _check_has_attention(model: nn.Module, axes: MeshAxes) -> None:
    """[Note: cp on a model without attention]
    A cp axis splits each sequence and only attention joins the parts again; a model without
    attention would train correctly but every cp rank would just be a data-parallel rank reading
    a part of each sequence, at the cost of the cp collectives it never uses, which is a
    misconfiguration worth naming at plan time. A model has attention if one of its module
    classes is named for it or its ``forward`` mentions it (``attention``, ``attn``,
    ``softmax``); a class whose source cannot be read is given the benefit of the doubt. Whether
    the attention is cp-aware is checked at the first step ([Note: detecting attention that is
    not cp-aware] in ``fsdpfn/transforms/_cp.py``)."""
    seen: set[type] = set()
    for _, m in model.named_modules():
        cls = type(m)
        if cls in seen:
            continue
        seen.add(cls)
        if isinstance(m, nn.MultiheadAttention) or _mentions_attention(cls) is not False:
            return
    cp = axes.names[axes.roles.index(Role.CP)]
    raise ValueError(
        f"the mesh {axes.describe()} splits each sequence over {axes.cp_size} ranks (axis {cp!r}), but model "
        f"{type(model).__name__} has no attention (no module class named for it, no forward that mentions attention or "
        f"softmax), the one layer that joins the parts of a sequence; use those ranks as data-parallel ones instead "
        f"(fold {cp!r} into the shard axis)"
    )


def _tp_styles(model: nn.Module, tp: TPArg) -> dict[str, str]:
    """``{module name: style}`` from ``tp``'s fnmatch patterns, every pattern and module checked."""
    if tp is None:
        return {}
    if not isinstance(tp, Mapping):
        raise ValueError(
            f"tp must be a dict {{module name pattern: style}}, e.g. {{'blocks.*.fc': 'colwise'}}, got {type(tp).__name__}"
        )
    modules = dict(model.named_modules())
    choices = style_names() + ("replicate",)
    for pattern, style in tp.items():
        if not isinstance(pattern, str):
            raise ValueError(f"tp keys are module name patterns (str), got {pattern!r}")
        style = str(style)
        if style != "replicate" and tp_style(style) is None:
            raise ValueError(
                f"tp[{pattern!r}] = {style!r}: unknown style; choose one of {', '.join(choices)}, or {TP_FUSED_PREFIX}k for a "
                "Linear whose output is k parts side by side (q, k, v = qkv(x).chunk(3, -1): 'colwise_fused:3')"
            )
    # The first pattern that matches a module names its style ([Note: pattern rule]).
    claimed = first_match(tp, [n for n in modules if n], "tp", f"module of {type(model).__name__}")
    styles = {name: (str(tp[pattern]), pattern) for name, pattern in claimed.items()}
    out = {}
    for name, mod in modules.items():  # model order
        if name not in styles or styles[name][0] == "replicate":
            continue
        style = styles[name][0]
        row = style_row(style)
        embeds = [s.name for s in TP_STYLE_TABLE if s.module is nn.Embedding]
        if isinstance(mod, nn.EmbeddingBag) or (isinstance(mod, nn.Embedding) and row.module is not nn.Embedding):
            raise NotImplementedError(
                f"tp[{styles[name][1]!r}] = {style!r} matches the embedding {name!r} ({type(mod).__name__}): an nn.Embedding "
                f"splits over its vocabulary with the style {embeds[0]!r} (each tp rank looks up its slice of the ids, the "
                "outputs are all-reduced); other styles and nn.EmbeddingBag are not supported. Use "
                f"{embeds[0]!r}, or leave it out of tp= (it stays replicated over the tp axis)."
            )
        if isinstance(mod, nn.Embedding):
            _check_vocab_embedding(name, mod)
        elif row.module is nn.Embedding:
            raise ValueError(
                f"tp[{styles[name][1]!r}] = {style!r} matches {name!r}, a {type(mod).__name__}: {style!r} splits an "
                "nn.Embedding by its rows. The output Linear over the vocabulary is 'colwise_loss' (its logits stay split "
                "for fsdpfn.vocab_parallel_cross_entropy)"
            )
        elif not isinstance(mod, nn.Linear):
            raise ValueError(
                f"tp[{styles[name][1]!r}] = {style!r} matches {name!r}, a {type(mod).__name__}; colwise and rowwise split "
                f"nn.Linear modules. Match the Linear layers inside it (e.g. '{name}.*')."
            )
        out[name] = style
    return out


def _check_vocab_embedding(name: str, mod: nn.Embedding) -> None:
    """An Embedding split by rows looks ids up in a slice: options that read a global row or
    rewrite the weight in place do not carry over."""
    for option, off in (("padding_idx", None), ("max_norm", None), ("sparse", False)):
        if getattr(mod, option) != off:
            raise NotImplementedError(
                f"tp splits the embedding {name!r} over its vocabulary ('vocab'), but it has {option}="
                f"{getattr(mod, option)!r}, which a tp rank holding a slice of the rows cannot honour. Build it with "
                f"{option}={off!r}, or leave it out of tp="
            )


def _tp_placement(style: str | None, leaf: str) -> Placement:
    """The tp placement of parameter ``leaf`` of a module split ``style`` (style validated)."""
    row = None if style is None else tp_style(style)
    return module_placement(None if row is None else row.parts, row is not None and row.split_dim == 1, leaf)


def plan(
    model: nn.Module,
    mesh,
    units: UnitsArg = None,
    strategy: StrategyArg = "zero3",
    mp: MixedPrecision | None = None,
    *,
    tp: TPArg = None,
    axes: Mapping[str, Any] | None = None,
    remat: StrategyArg | None = None,
    offload: bool | Mapping[str, bool] | None = None,
    experts: Sequence[str] | Mapping[str, int] | None = None,
) -> Plan:
    """Builds a validated :class:`Plan` for ``model`` on ``mesh``.

    Args:
      model: the module to shard. Only its parameters' names, shapes and dtypes are read.
      mesh: a ``DeviceMesh`` whose dims are named axes with roles (see :class:`fsdpfn.Role`):
        ``shard`` (data parallel, sharded), ``replicate`` (data parallel, replicated) and
        ``tp`` (tensor parallel). 1-D: shard over it, whatever its name but ``"tp"``, ``"ep"``,
        ``"cp"`` and ``"pp"`` (refused: each needs a data-parallel axis beside it, size 1 is
        fine, and the error builds that mesh). A mesh with a ``pp`` axis is cut into pipeline
        stages by :func:`pipeline_plan`, not here. It must span
        every process of the job (its size is the world size). 2-D named
        ``("replicate", "shard")``: HSDP. ``("dp", "tp")``: FSDP x tensor parallel;
        ``("replicate", "shard", "tp")``: HSDP x tensor parallel; ``("ep", "edp")``: expert
        parallel x expert data parallel (see ``experts``); ``("replicate", "ep", "edp")``:
        the same within each replica (HSDP over experts). A shape such as ``(1024,)``,
        ``(16, 64)`` (HSDP) or ``{"dp": 64, "tp": 8}`` gives an unbound plan that can be
        printed, saved and costed but not executed; ``plan.bind(mesh)`` binds it.
      units: ``None`` (every child of every ``nn.ModuleList`` is a unit, the rest is the root
        unit), a list of module FQNs, or ``callable(module_name, module) -> bool``. A parameter
        belongs to the deepest unit that contains it; the root unit takes the rest.
      strategy: ``"replicate"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``, or a dict
        ``{unit_name: strategy}`` (``"<root>"`` or ``""`` for the root, ``"*"`` for the default,
        which is ``"zero3"``).
      mp: a :class:`MixedPrecision` policy (default: none).
      tp: tensor parallelism, ``{module name pattern: style}`` (fnmatch patterns over module
        FQNs) with the styles ``"colwise"`` (an ``nn.Linear`` split by output features; its
        output stays split), ``"colwise_gather"`` (the same, output all-gathered back),
        ``"colwise_fused:k"`` (a Linear whose output is k parts side by side, such as a
        q|k|v-major ``qkv(x).chunk(3, -1)``: each part split by output features),
        ``"rowwise"`` (split by input features; its input arrives split, its output is
        all-reduced) and ``"replicate"``. Unmatched parameters are replicated over ``tp``.
        The layout is checked (see [Note: tp layout rules] in ``fsdpfn/_plan/tp_layout.py``): a
        module's Linear layers are all split or marked ``"replicate"``, colwise layers have
        rowwise partners, and tp divides the head counts of the modules it splits. In every
        pattern argument (``tp``, ``remat``, ``offload``, ``experts``) the first pattern that
        matches a name wins, and a pattern that matches nothing or only names earlier patterns
        claim is refused (see [Note: pattern rule] in ``fsdpfn/_patterns.py``).
      axes: roles of mesh dims whose names are not conventional, ``{dim name: role}``.
      remat: activation checkpointing per unit, for every unit but the root, or a dict
        ``{unit name or fnmatch pattern: policy}``: ``"none"`` (default), ``"full"`` (keep the
        unit's inputs only, recompute its forward in backward), ``"save_dots"`` (keep matmul and
        attention outputs too, recompute the rest), ``"save_names:a,b"`` (keep the tensors the
        model tagged with :func:`fsdpfn.checkpoint_name`) or a name given to
        :func:`fsdpfn.register_remat_policy`.
      offload: keep sharded parameters, gradients and optimizer state in host memory between
        uses (:class:`fsdpfn.runtime.Runtime` copies them in and out): ``True`` for every unit
        or a dict ``{unit name or fnmatch pattern: bool}``.
      experts: on a mesh with an ``ep`` axis (expert parallelism, e.g. ``("ep", "edp")``), the
        packed expert weights (dim 0 the expert index), as fnmatch patterns over parameter
        names, or a dict ``{pattern: top_k}`` that also says how many experts each token visits
        (for the cost of the expert all-to-alls). ``None``: the parameters each module lists
        in its ``expert_params`` attribute, with its ``top_k`` (:class:`fsdpfn.models.Experts`
        lists ``w1`` and ``w2``). Experts are split over ``ep`` and
        sharded over the other data-parallel axis; each module's expert weights form their own
        unit, named after the module. Each must be a packed per-expert tensor (not a router's
        ``nn.Linear`` weight), and its module, or one around it, must dispatch tokens over
        ``ep``: have a ``set_ep_group`` method, as :class:`fsdpfn.models.MoE` does (see
        docs/tour/experts.md). Ignored on meshes without ``ep``.

    Returns:
      the plan.

    Raises:
      ValueError: a mesh with a ``pp`` axis (use :func:`pipeline_plan`), a unit naming no module,
        a parameter shared by two units (tied weights split across units), a mesh axis without a
        role, a pattern matching no name (or only names an earlier pattern claims), a dim that
        does not divide over tp, a tp layout the model cannot compute (a split Linear beside whole
        ones, a colwise layer without a rowwise partner, a head count tp does not divide), an
        unknown strategy, a live mesh with fewer ranks than the job, a 1-D mesh named ``"ep"``,
        expert weights that no module dispatches over ``ep`` (no ``set_ep_group``) or that are a
        torch layer's weight (a router).
      NotImplementedError: tensor-parallel embeddings, expert parallelism beside a tp axis or
        after a replicate axis that is not the first mesh dim, a ``colwise_fused`` weight
        sharded over a data-parallel axis of more than one rank.

    Example:
      >>> p = fsdpfn.plan(model, mesh, strategy={"*": "zero3", "<root>": "zero2"})
      >>> [(u.label, u.strategy.value) for u in p.units]
      [('<root>', 'zero2'), ('blocks.0', 'zero3'), ('blocks.1', 'zero3')]
      >>> print(fsdpfn.plan(model, (3,)))  # a shape instead of a mesh: printed and costed, not run
      Plan ...: mesh 3, param_dtype=None, reduce_dtype=None
      unit      strategy  params  elements  bytes/rank  padding/rank
      --------  --------  ------  --------  ----------  ------------
      <root>    zero3          5     4,672     6.3 KiB           194
      blocks.0  zero3         12    12,704    16.8 KiB           199
      blocks.1  zero3         12    12,704    16.8 KiB           199
      --------  --------  ------  --------  ----------  ------------
      total                   29    30,080
      >>> tp = {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
      >>> p2 = fsdpfn.plan(model, {"dp": 2, "tp": 2}, tp=tp)
      >>> p2.param("blocks.0.qkv.weight").placements, p2.param("blocks.0.qkv.weight").local_shape
      ((AxisPlacement('tp', 2, Shard(0)),), (48, 32))
    """
    return Plan(*_plan_fields(model, mesh, units, strategy, mp, tp, axes, remat, offload, experts, None, None, "plan"))


def pipeline_plan(
    model: nn.Module,
    mesh,
    units: UnitsArg = None,
    strategy: StrategyArg = "zero3",
    mp: MixedPrecision | None = None,
    *,
    stages: int | Sequence[Sequence[str]] | None = None,
    stage_costs: Mapping[str, float] | None = None,
    tp: TPArg = None,
    axes: Mapping[str, Any] | None = None,
    remat: StrategyArg | None = None,
    offload: bool | Mapping[str, bool] | None = None,
    experts: Sequence[str] | Mapping[str, int] | None = None,
) -> PipelinedPlan:
    """Builds a validated :class:`PipelinedPlan` for ``model`` on ``mesh``, a mesh with a
    ``pp`` axis (pipeline parallelism, e.g. ``("pp", "dp")``): the units of :func:`plan`, cut
    into pipeline stages.

    Args:
      model, mesh, units, strategy, mp, tp, axes, remat, offload, experts: as :func:`plan`'s;
        the mesh has a ``pp`` axis, and every other axis works within a stage as in a plan
        without pp.
      stages: how the units are cut into pipeline stages (:class:`fsdpfn.Stages`; stage ``s``
        runs on pp rank ``s % pp``). ``None``: one stage per pp rank, balanced by parameter
        count; an int: that many stages, a multiple of ``pp`` (``stages / pp`` virtual stages
        per rank, for interleaved 1F1B); a list with one list of module-name prefixes per stage
        (``[["embed", "pos", "blocks.0"], ["blocks.1", "norm", "head"]]``). A stage holds whole
        units, so the root unit must be empty or fall in one stage (list the modules at the
        model's two ends as units).
      stage_costs: ``{unit name: cost}`` to balance by instead of parameter counts (e.g. a
        profile's per-unit seconds, :func:`fsdpfn.sim.profile`).

    Returns:
      the plan; :meth:`PipelinedPlan.stage_plan` gives each stage's :class:`Plan`, and
      :class:`fsdpfn.runtime.PipelineRuntime` runs it.

    Raises:
      ValueError: a mesh without a ``pp`` axis, a split that is not whole units, a number of
        stages that is not a multiple of ``pp``, and what :func:`plan` raises.

    Example:
      >>> units = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
      >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=units)
      >>> print(pp.stages)
      stage 0 (pp rank 0): embed, pos, blocks.0; stage 1 (pp rank 1): blocks.1, norm, head
      >>> pp.stage_plan(1).axes.describe()
      'dp=2 (shard)'
    """
    return PipelinedPlan(
        *_plan_fields(
            model, mesh, units, strategy, mp, tp, axes, remat, offload, experts, stages, stage_costs, "pipeline_plan"
        )
    )


def _plan_fields(model, mesh, units, strategy, mp, tp, axes, remat, offload, experts, stages, stage_costs, what):
    """The fields of the plan ``what`` (``"plan"`` or ``"pipeline_plan"``) builds: each refuses
    a mesh of the other kind here, before the model is read."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what}() takes the nn.Module to shard, got {type(model).__name__}")
    mp = MixedPrecision() if mp is None else mp
    if not isinstance(mp, MixedPrecision):
        raise ValueError(f"mp must be fsdpfn.MixedPrecision(...), got {type(mp).__name__}")
    mesh_axes, names, mesh = _axes_of(mesh, axes)
    if what == "plan" and Role.PP in mesh_axes.roles:
        raise ValueError(
            f"the mesh {mesh_axes.describe()} has a pipeline axis: each pp rank runs its own stages, so the plan is "
            "a fsdpfn.PipelinedPlan; build it with fsdpfn.pipeline_plan(model, mesh, units=..., stages=...)"
        )
    if what == "pipeline_plan" and Role.PP not in mesh_axes.roles:
        raise ValueError(
            f"pipeline_plan() cuts a model into pipeline stages, but the mesh {mesh_axes.describe()} has no 'pp' "
            "axis; add one, e.g. init_device_mesh('cpu', (pp, dp), mesh_dim_names=('pp', 'dp')), or build a "
            "plan without stages with fsdpfn.plan(model, mesh, ...)"
        )
    _check_not_parallelised(model)
    if mesh_axes.cp_size > 1:
        _check_has_attention(model, mesh_axes)
    tp_styles = _tp_styles(model, tp)
    if tp_styles and Role.TP not in mesh_axes.roles:
        raise ValueError(
            f"tp= splits {len(tp_styles)} modules, but the mesh {mesh_axes.describe()} has no tensor-parallel axis; "
            "add one, e.g. init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    tp_size, ep_size = mesh_axes.tp_size, mesh_axes.ep_size
    modules_by_name = dict(model.named_modules())
    for name, style in tp_styles.items():
        if style_row(style).vocabulary:
            mod = modules_by_name[name]
            rows = mod.num_embeddings if isinstance(mod, nn.Embedding) else mod.out_features
            if rows % tp_size:
                raise ValueError(
                    f"tp splits {name!r} over its vocabulary of {rows} ({style!r}), which does not divide over tp={tp_size}: "
                    f"each tp rank holds an equal slice of the rows. Pad the vocabulary to a multiple of {tp_size} "
                    "(as Megatron pads it), or leave the module out of tp="
                )
    expert_of, top_k = _expert_params(model, experts, ep_size) if Role.EP in mesh_axes.roles else ({}, {})
    # A layer that pads each expert's rows to its capacity says so on its expert module.
    padded = {
        m: float(c)
        for m in top_k
        if (c := getattr(dict(model.named_modules())[m], "padded_capacity", None)) is not None
    }

    unit_names = _select_units(model, units)
    # Each module with expert weights is their unit (see [Note: expert units]); its other
    # parameters belong to the enclosing unit.
    expert_units = list(dict.fromkeys(expert_of.values()))
    dense_names = [u for u in unit_names if u not in expert_units]
    unit_names = _with_expert_units(dense_names, expert_units)
    strategies = _strategy_for(strategy, unit_names)
    # remove_duplicate=False exposes tied weights under every name they have.
    first_name: dict[int, tuple[str, str, str]] = {}
    owned: dict[str, list[ParamSpec]] = {u: [] for u in unit_names}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = expert_of[name] if name in expert_of else _owner(name, dense_names)
        module, _, leaf = name.rpartition(".")
        placement = _tp_placement(tp_styles.get(module), leaf)
        shown = repr(placement)
        if id(p) in first_name:
            other, other_owner, other_placement = first_name[id(p)]
            if other_owner != owner:
                raise ValueError(
                    f"parameter {name!r} is the same tensor as {other!r} (tied weights), but they fall in units "
                    f"{unit_label(owner)!r} and {unit_label(other_owner)!r}; a parameter is claimed by two units. "
                    "Put both modules in one unit (e.g. leave them in the root unit)."
                )
            if shown != other_placement:
                raise ValueError(
                    f"parameter {name!r} is the same tensor as {other!r} (tied weights), but tp= places them differently "
                    f"({shown} vs {other_placement}); give both modules the same style or leave both out of tp="
                )
            continue
        first_name[id(p)] = (name, owner, shown)
        # Experts are split along dim 0 over ep; everything else is replicated over it (and over
        # tp unless tp= splits its module).
        ep = AxisPlacement(Role.EP, ep_size, Shard(0) if name in expert_of else Replicate())
        owned[owner].append(
            ParamSpec(name, tuple(p.shape), p.dtype, placements=(ep, AxisPlacement(Role.TP, tp_size, placement)))
        )

    fp8 = _fp8_params(model, mp, owned, strategies, unit_names) if mp.fp8 is not None else {}
    if remat is not None and not isinstance(remat, (str, Mapping)):
        raise ValueError(
            f"remat must be a policy name or a dict {{unit name pattern: policy}}, got {type(remat).__name__}"
        )
    if offload is not None and not isinstance(offload, (bool, Mapping)):
        raise ValueError(
            f"offload must be True, False or a dict {{unit name pattern: bool}}, got {type(offload).__name__}"
        )
    remats = _per_unit(remat, dense_names, "remat", "none", "none")  # the root keeps its activations
    offloads = _per_unit(offload, unit_names, "offload", False, None)
    built = tuple(
        Unit(
            u,
            Strategy(strategies[u]),
            tuple(owned[u]),
            rows_size(owned[u], mesh_axes),
            fp8.get(u, ()),
            remats.get(u, "none"),
            offloads[u],
            u in expert_units,
            top_k.get(u, 0),
            padded.get(u),
        )
        for u in unit_names
        if owned[u]
    )
    if tp_styles:
        check_tp_layout(model, tp or {}, tp_styles, tp_size)
    roles = None if mesh_axes.legacy and axes is None else tuple(r.value for r in mesh_axes.roles)
    return (
        built,
        mesh_axes.shape,
        names,
        mp,
        mesh,
        roles,
        tuple(tp_styles.items()),
        _stages_of(built, mesh_axes, stages, stage_costs),
    )


def _stages_of(units, axes: MeshAxes, stages, stage_costs):
    if Role.PP not in axes.roles:
        return None
    if stage_costs is not None and not (stages is None or isinstance(stages, int)):
        raise ValueError(
            "stage_costs= balances a split by cost; it cannot be combined with stages=[[...], ...], a split by name"
        )
    return split_stages(
        [(u.name, [p.name for p in u.params]) for u in units],
        axes.pp_size,
        stages,
        costs=stage_costs,
        numels={u.name: sum(p.global_numel for p in u.params) for u in units},
    )


def _expert_params(model: nn.Module, experts, ep_size: int) -> tuple[dict[str, str], dict[str, int]]:
    """``({expert parameter name: its module's name}, {module: top_k})`` from ``experts``'
    patterns or, without them, from the modules' ``expert_params`` and ``top_k`` attributes;
    an ep axis with none is refused, and so is every expert weight no layer dispatches
    (:func:`_check_expert_layers`)."""
    modules = dict(model.named_modules())
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if experts is None:
        found = {
            f"{m}.{leaf}" if m else leaf: m for m, mod in modules.items() for leaf in getattr(mod, "expert_params", ())
        }
        top_k = {m: int(getattr(modules[m], "top_k", 0) or 0) for m in set(found.values())}
    else:
        if isinstance(experts, str) or not all(isinstance(e, str) for e in experts):
            raise ValueError(
                f"experts must be a list of parameter name patterns (str), e.g. ['blocks.*.moe.w1'], got {experts!r}"
            )
        found, top_k = {}, {}
        ks = experts if isinstance(experts, Mapping) else dict.fromkeys(experts, 0)
        for pattern, k in ks.items():
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ValueError(
                    f"experts[{pattern!r}] = {k!r}: give each pattern the top_k of its router (an int >= 1)"
                )
        for name, pattern in first_match(ks, names, "experts", f"parameter of {type(model).__name__}").items():
            found[name] = module = name.rpartition(".")[0]
            if top_k.setdefault(module, ks[pattern]) != ks[pattern]:
                raise ValueError(
                    f"experts gives the weights of one layer {module!r} two top_k values ({top_k[module]} and "
                    f"{ks[pattern]}, {pattern!r} for {name!r}); a layer's router has one top_k"
                )
    if not found:
        raise ValueError(
            f"the mesh has an expert-parallel axis, but {type(model).__name__} has no expert weights (no module lists "
            "expert_params, and experts= was not given); drop the ep axis, or name the packed expert weights with "
            "fsdpfn.plan(..., experts=['blocks.*.moe.w1', ...])"
        )
    for name, module in found.items():
        if not module:
            raise ValueError(
                f"expert parameter {name!r} belongs to the model itself; expert weights must live in a submodule (their unit)"
            )
        whole = getattr(modules[module], "num_experts", None)
        shape = tuple(dict(model.named_parameters(remove_duplicate=False))[name].shape)
        if whole is not None and shape[:1] != (whole,):
            raise ValueError(
                f"expert parameter {name!r} has shape {shape}, but its layer has {whole} experts: the layer was built with its "
                "experts already split. Build the whole model (e.g. MoE(cfg) without ep_group); the plan splits the experts"
            )
    _check_expert_layers(model, found, ep_size)
    return found, top_k


# [Note: expert layers]
# A plan on an ep mesh gives each rank only its experts' slices of every expert parameter, so
# two things must hold of the model, and both can be read from it on every rank before any
# collective. (1) Some layer sends each token to the rank holding its expert: the module holding
# the expert weights, or one around it, has set_ep_group (fsdpfn.shard and the runtime call it
# with the ep group). Without one, a rank applies its experts as if they were all of them, a
# silent wrong gradient. (2) Every expert parameter packs one entry per expert along dim 0: it
# is not the weight of a torch layer (a router's or gate's nn.Linear applies its whole weight
# to every token), not left out of its module's own expert_params, and the expert weights one
# layer dispatches agree on dim 0. A gate stored as a bare [experts, width] Parameter beside the
# experts passes (2) and is not caught: its shape is that of a packed weight.

# Torch layers that hold parameters only as containers: anything else in torch.nn applies its
# whole weight to every input (a router's or gate's nn.Linear), so it holds no packed experts.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _dispatcher(modules: dict[str, nn.Module], name: str) -> str | None:
    """The innermost of ``name`` and the modules around it with a ``set_ep_group`` method (the
    layer that routes tokens over ep), or ``None``."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        candidate = ".".join(parts[:i])
        if callable(getattr(modules[candidate], "set_ep_group", None)):
            return candidate
    return None


def _check_expert_layers(model: nn.Module, found: dict[str, str], ep_size: int) -> None:
    """Refuses expert weights that cannot be right once split over ep ([Note: expert layers]),
    on every rank, from the model alone."""
    modules = dict(model.named_modules())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    leading: dict[str, tuple[str, int]] = {}
    for name, module in found.items():
        mod, leaf = modules[module], name.rpartition(".")[2]
        kind = type(mod).__name__
        if not shapes[name]:
            raise ValueError(
                f"expert parameter {name!r} is 0-d; an expert weight packs its experts along dim 0. Leave it out of experts="
            )
        if (
            type(mod).__module__.startswith("torch.nn.")
            and type(mod) is not nn.Module
            and not isinstance(mod, _CONTAINERS)
        ):
            raise ValueError(
                f"experts= selects {name!r}, the {leaf} of the nn.{kind} {module!r}: an expert parameter is a packed "
                f"per-expert tensor (dim 0 the expert index, each rank given only its experts' slices), and a torch "
                f"{kind} applies its whole weight to every token, as a router or gate does. Leave it out of experts= "
                "(it stays a dense parameter, sharded over ep x edp); list only the experts' packed weights"
            )
        declared = getattr(mod, "expert_params", None)
        if declared is not None and leaf not in declared:
            raise ValueError(
                f"experts= selects {name!r}, but its module {module!r} ({kind}) lists its packed expert weights as "
                f"expert_params = {tuple(declared)}, without {leaf!r}; leave {leaf!r} out of experts="
            )
        host = _dispatcher(modules, module)
        if host is None:
            raise ValueError(
                f"expert parameter {name!r} is split over ep (each of the {ep_size} ranks keeps {shapes[name][0]}/{ep_size} of "
                f"its experts), but neither its module {module!r} ({kind}) nor a module around it dispatches tokens over ep: "
                "none has a set_ep_group(group) method. Run as is, each rank would apply its own experts as if they were all "
                "of them (wrong gradients). Give the layer that routes the tokens a set_ep_group(group) method (fsdpfn.shard "
                "and the runtime call it with the ep process group) and have its forward send each token to the rank holding "
                "its expert (fsdpfn.comm.ep_counts, fsdpfn.comm.ep_all_to_all), as fsdpfn.models.MoE does; see "
                "docs/tour/experts.md, 'Writing your own layer'. Or use fsdpfn.models.MoE, or drop the ep axis"
            )
        first = leading.setdefault(host, (name, shapes[name][0]))
        if shapes[name][0] != first[1]:
            raise ValueError(
                f"expert parameters {first[0]!r} {shapes[first[0]]} and {name!r} {shapes[name]} are both dispatched by "
                f"{host or ROOT_LABEL!r}, but pack {first[1]} and {shapes[name][0]} entries along dim 0; every expert weight of "
                "one layer packs its experts along dim 0, one entry per expert. Leave the parameter that is not a packed "
                "expert weight (a router, a gate, a shared expert) out of experts="
            )


def _with_expert_units(dense: list[str], expert_units: list[str]) -> list[str]:
    """Unit names in execution order: each expert unit right after the unit enclosing it."""
    out = list(dense)
    for e in expert_units:
        host = _owner(e + ".", dense) if e else ROOT
        pos = out.index(host) + 1
        while pos < len(out) and out[pos] in expert_units:
            pos += 1
        out.insert(pos, e)
    return out


def _fp8_params(
    model: nn.Module,
    mp: MixedPrecision,
    owned: dict[str, list[ParamSpec]],
    strategies: dict[str, str],
    unit_names: list[str],
) -> dict[str, tuple[str, ...]]:
    """Each unit's parameters gathered in FP8 under ``mp.fp8``, with every setting that cannot
    work refused here, on every rank, before any collective."""
    policy = mp.fp8
    assert policy is not None  # called only when mp.fp8 is set
    modules = dict(model.named_modules())
    all_names, embedded, by_name = [], set(), {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.append(name)
        by_name[name] = p
        if isinstance(modules[name.rpartition(".")[0]], (nn.Embedding, nn.EmbeddingBag)):
            embedded.add(id(p))  # a weight tied to an embedding stays high precision under every name
    first_match(policy.exclude, all_names, "Float8GatherPolicy(exclude=...)", "parameter")  # [Note: pattern rule]
    if policy.units is None:
        chosen = set(unit_names)
    else:
        chosen = set()
        for label in policy.units:
            unit = ROOT if label == ROOT_LABEL else label
            if unit not in unit_names:
                raise ValueError(
                    f"Float8GatherPolicy(units=...) names {label!r}, which is not a unit of this plan{_did_you_mean(label, [unit_label(u) for u in unit_names])}"
                )
            chosen.add(unit)
    out: dict[str, tuple[str, ...]] = {}
    for u in unit_names:
        if u not in chosen:
            continue
        eligible = tuple(
            p.name
            for p in owned[u]
            if len(p.shape) >= 2 and p.numel > 0 and id(by_name[p.name]) not in embedded and not policy.excludes(p.name)
        )
        if not eligible:
            if policy.units is not None:
                shapes = ", ".join(f"{p.name} {p.shape}" for p in owned[u]) or "none"
                raise ValueError(
                    f"Float8GatherPolicy(units=...) names unit {unit_label(u)!r}, which has no weight to gather in FP8 (a >= 2-D "
                    f"parameter that is not an embedding and not excluded; its parameters: {shapes}). Leave it out of units."
                )
            continue
        if strategies[u] == "replicate":
            raise ValueError(
                f"unit {unit_label(u)!r} uses strategy 'replicate', which has no all-gather to carry FP8 weights, but "
                f"MixedPrecision(fp8=...) selects {list(eligible)}. Shard it (zero1/zero2/zero3) or leave it out with "
                "fsdpfn.fp8.Float8GatherPolicy(units=[...])."
            )
        dtype = mp.param_dtype or by_name[eligible[0]].dtype
        if dtype not in _FP8_INPUT_DTYPES:
            raise ValueError(
                f"unit {unit_label(u)!r} gathers in {_dtype_name(dtype)}; FP8 recipes quantize from float32, bfloat16 or float16. "
                "Set MixedPrecision(param_dtype=torch.bfloat16)."
            )
        out[u] = eligible
    if not out:
        raise ValueError(
            "MixedPrecision(fp8=...) selects no parameter: no unit has a >= 2-D weight that is not an embedding and not "
            "excluded. Drop fp8=, or check Float8GatherPolicy(units=..., exclude=...)."
        )
    block = policy.recipe.block_size
    for u, names in out.items():
        for spec in owned[u]:
            # Blocks run along the last dim: where an axis splits it, they must not straddle its ranks.
            across = [e for e in spec.placements if spec.shape and e.placement.dim == len(spec.shape) - 1]
            if spec.name in names and across and block is not None and spec.local_shape[-1] % block:
                raise ValueError(
                    f"parameter {spec.name!r} is split by columns over {across[0].axis.value}={across[0].size}: its local width "
                    f"{spec.local_shape[-1]} is not a multiple of the {policy.recipe.name} block of {block}, so its FP8 blocks "
                    "would straddle tp ranks. Choose a tp degree that keeps local widths a multiple of "
                    f"{block}, or leave it out with Float8GatherPolicy(exclude=[{spec.name!r}])."
                )
    if policy.backend == "te":
        check_te(policy.recipe, [(n, by_name[n].shape) for names in out.values() for n in names])
    return out
