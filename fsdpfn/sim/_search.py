"""Plan search: the plan (and schedule) with the lowest predicted step time that fits a memory
budget per rank.

[Note: the search space]
For a model and a number of ranks the search tries:

- mesh shapes: ``(W,)`` and every HSDP shape ``(R, W/R)`` (``mesh_shapes=`` narrows it); with
  ``tp=(1, 2, ...)`` and a ``tp_plan``, every tensor-parallel degree ``T`` too: the same
  data-parallel shapes of ``W/T`` ranks beside a ``tp`` axis of ``T`` (``{"dp": W/T, "tp": T}``,
  ``{"replicate": R, "shard": W/(R T), "tp": T}``), each profiled with its tp-local layers (their
  matmuls run ``1/T`` of the FLOPs) and timed with its activation collectives. ``inputs`` is one
  rank's micro-batch; the ``T`` ranks of a tp group read one batch together, ``T`` ranks'
  worth (``inputs`` repeated along dim 0), so every candidate trains the same global batch;
  for a model with experts and ``ep=(1, 2, ...)``, every expert-parallel degree ``E``: the mesh
  ``{"ep": E, "edp": W/E}`` and its HSDP shapes ``{"replicate": R, "ep": E, "edp": W/(R E)}``,
  profiled once (the expert units are the same for every ``E``, and each rank routes its own
  micro-batch) and timed with the expert all-to-alls. Not beside a tp degree above 1;
  for long sequences and ``cp=(1, 2, ...)``, every context-parallel degree ``C``: the same
  data-parallel shapes of ``W/C`` ranks beside a ``cp`` axis of ``C`` (``{"dp": W/C, "cp": C}``,
  ``{"replicate": R, "shard": W/(R C), "cp": C}``). A cp group of ``C`` ranks reads one batch
  of sequences, each rank ``1/C`` of every sequence (``inputs`` cut along dim 1): to train the
  same global batch it runs ``C`` times the micro-batches, each of ``S/C`` tokens a sequence,
  so a rank's tokens per step are the same and its activations per micro-batch ``1/C``; each is
  profiled as one cp rank's (attention against the whole sequence's keys, [Note: one cp rank's
  attention] in ``fsdpfn/sim/_workload.py``) and timed with attention's exchange over cp (the
  strategy ``cp_strategy``). Not beside a tp or ep degree above 1 yet;
- unit groupings: the default (each child of every ``nn.ModuleList`` a unit), and one level
  finer (each child module of those), or the policies given in ``units=``;
- per-unit strategies: units with the same parameter shapes form a class (the blocks of a
  transformer; the root alone); each class gets a strategy, and the largest class may split:
  its last ``k`` units take another strategy (the blocks nearest the loss, which backward
  needs first);
- prefetch depths;
- with several micro-batches and ``accumulate=("reduce", "local")``: whether every micro-batch
  reduces its gradients or only the last one does (full gradients kept in between).

The product of these is far too large to simulate whole (six unit classes and four strategies
already make 4^6 assignments), so for every mesh shape and grouping the search descends:
it starts from zero3 with prefetch 1 and repeatedly takes the single move (one class to
another strategy, a split of the largest class, another prefetch depth) that lowers the
predicted step time most while fitting the budget -- or, while nothing fits yet, lowers the
peak memory most -- until no move helps by more than ``rel_tol``. Each simulation takes
milliseconds (the workload is profiled once per grouping: it does not depend on the strategy or
the mesh). The fastest fitting result over all starts wins. Ties (within ``rel_tol``) go to the
default plan (zero3 on ``(W,)``, prefetch 1, default units) when it is among them, else to the
smallest memory: the search returns the default wherever nothing is faster.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from fsdpfn._plan import ROOT, MixedPrecision, PipelinedPlan, Plan
from fsdpfn._plan import pipeline_plan as build_pipeline_plan
from fsdpfn._plan import plan as build_plan
from fsdpfn._plan.attention import CP_STRATEGIES
from fsdpfn._remat import check_policy
from fsdpfn._plan.pipeline import PIPELINE_SCHEDULES, PipelineSchedule, pipeline_schedule
from fsdpfn._plan.schedule import Schedule, schedule as make_schedule
from fsdpfn.sim._hardware import Hardware
from fsdpfn.sim._pipeline import PipelineSimResult, simulate_pipeline
from fsdpfn.sim._simulate import SimResult, simulate
from fsdpfn.sim._workload import Workload, profile

__all__ = ["Candidate", "SearchResult", "finer_units", "pipeline_units", "search"]

DEFAULT_STRATEGIES = ("zero3", "zero2", "zero1", "replicate")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One simulated configuration: how it was built and what the simulator predicts."""

    mesh_shape: tuple[int, ...]
    units: str
    strategy: tuple[tuple[str, str], ...]
    prefetch: int
    step_time: float
    peak: int
    fits: bool
    accumulate: str = "reduce"
    remat: tuple[tuple[str, str], ...] = ()  # (unit, policy) of rematerialised units
    tp: int = 1  # tensor-parallel degree (the last mesh dim when > 1)
    ep: int = 1  # expert-parallel degree (the mesh dim after a replicate dim, if any, when > 1)
    cp: int = 1  # context-parallel degree (the last mesh dim when > 1); cp times the micro-batches
    pp: int = 1  # pipeline degree (the first mesh dim when > 1); pp times the micro-batches
    pipeline: str = ""  # the pipeline schedule's name when pp > 1
    # The caching allocator's figure (peak x (1 + hardware.memory_reserve)); a candidate fits
    # only if this is within the part's memory too, the verdict SimResult.notes gives.
    reserved: int = 0

    def describe(self) -> str:
        """One line: mesh, units, prefetch and strategies, repeated units folded
        (``blocks.*: zero2``; ``blocks.2-3: zero1`` for a split), and ``accumulate local``
        where only the last micro-batch reduces."""
        strategies = sorted({s for _, s in self.strategy})
        strat = strategies[0] if len(strategies) == 1 else _fold(self.strategy)
        acc = ", accumulate local" if self.accumulate == "local" else ""
        remat = f", remat {_fold(self.remat)}" if self.remat else ""
        tp = f" (tp {self.tp})" if self.tp > 1 else ""
        tp += f" (ep {self.ep})" if self.ep > 1 else ""
        tp += f" (cp {self.cp}, {self.cp}x the micro-batches)" if self.cp > 1 else ""
        tp += f" (pp {self.pp}, {self.pipeline}, {self.pp}x the micro-batches)" if self.pp > 1 else ""
        return f"mesh {'x'.join(map(str, self.mesh_shape))}{tp}, units {self.units}, prefetch {self.prefetch}, {strat}{acc}{remat}"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One candidate mesh, as a value: the data-parallel shape (``(W,)`` or ``(replicate,
    shard)``; beside ``ep``, ``(edp,)`` or ``(replicate, edp)``) and the degree of each
    model-parallel axis beside it (1: no such axis), with a pipeline's schedule. The search
    enumerates these and prices each with one function (``_Pricer.price``)."""

    dp: tuple[int, ...]
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1
    pipeline: str = ""  # the pipeline schedule's name when pp > 1

    def mesh(self):
        """What ``fsdpfn.plan`` (``fsdpfn.pipeline_plan`` with a pp axis) takes for this mesh."""
        if self.pp > 1:
            return {"pp": self.pp, **_mesh_arg_dict(self.dp, self.tp)}
        return _mesh_arg(self.dp, self.tp, self.ep, self.cp)

    def profile_mesh(self, world: int):
        """The mesh the workload is profiled on: every rank but the model-parallel axes' on one
        data-parallel axis, pp folded into it (a profile is one stage-free rank's)."""
        return _mesh_arg((world // (self.tp * self.ep * self.cp),), self.tp, self.ep, self.cp)

    @property
    def stages(self) -> int:
        return _stage_count(self.pp, self.pipeline)

    @property
    def default(self) -> bool:
        """The default plan's mesh: every rank on one data-parallel axis."""
        return len(self.dp) == 1 and (self.tp, self.ep, self.cp, self.pp) == (1, 1, 1, 1)


def _fold(assignment: tuple[tuple[str, str], ...]) -> str:
    """``blocks.0: zero2, blocks.1: zero2`` -> ``blocks.*: zero2``; runs of indices otherwise."""
    groups: dict[tuple[str, str], list[int]] = {}
    order: list[tuple[str, str]] = []
    total: dict[str, int] = {}
    for unit, strategy in assignment:
        m = re.search(r"\.(\d+)(?=\.|$)", unit)
        pattern, index = (unit[: m.start(1)] + "*" + unit[m.end(1) :], int(m.group(1))) if m else (unit or "<root>", -1)
        total[pattern] = total.get(pattern, 0) + 1
        if (pattern, strategy) not in groups:
            order.append((pattern, strategy))
        groups.setdefault((pattern, strategy), []).append(index)
    parts = []
    for pattern, strategy in order:
        idx = sorted(groups[(pattern, strategy)])
        if len(idx) == total[pattern] or idx == [-1]:
            parts.append(f"{pattern}: {strategy}")
        else:
            if len(idx) == 1:
                span = str(idx[0])
            elif idx == list(range(idx[0], idx[-1] + 1)):
                span = f"{idx[0]}-{idx[-1]}"
            else:
                span = ",".join(map(str, idx))
            parts.append(f"{pattern.replace('*', span)}: {strategy}")
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The search's pick and how it compares.

    Attributes:
      plan, schedule, result: the winning plan, its schedule and its :class:`SimResult` (a
        pipelined pick: a :class:`fsdpfn.PipelinedPlan`, its :class:`fsdpfn.PipelineSchedule` and
        :class:`PipelineSimResult`).
      accumulate: the pick's gradient accumulation (``fsdpfn.runtime.Runtime(accumulate=...)``).
      candidate: the pick as a :class:`Candidate` (``candidate.describe()`` says what it is).
        Among candidates within ``rel_tol`` of the fastest, the pick is the default if it is
        one of them, else the one with the smallest peak, so it need not be ``candidates[0]``.
      default: the :class:`SimResult` of the default plan (zero3 on ``(W,)``, prefetch 1).
      default_fits: whether the default fits the budget.
      candidates: every configuration tried (:class:`Candidate`), fastest first.
      budget: bytes per rank.
      memory: the part's memory in bytes (``hardware.memory``): a candidate fits when its peak is
        within ``budget`` and its reserved bytes within this.
    """

    plan: Plan | PipelinedPlan
    schedule: Schedule | PipelineSchedule
    result: SimResult | PipelineSimResult
    default: SimResult
    default_fits: bool
    candidates: tuple[Candidate, ...]
    budget: float
    accumulate: str = "reduce"
    candidate: Candidate | None = None
    memory: float = float("inf")

    @property
    def tp(self) -> int:
        """The pick's tensor-parallel degree (1: none)."""
        return self.candidate.tp if self.candidate else 1

    @property
    def ep(self) -> int:
        """The pick's expert-parallel degree (1: no ``ep`` axis)."""
        return self.candidate.ep if self.candidate else 1

    @property
    def cp(self) -> int:
        """The pick's context-parallel degree (1: no ``cp`` axis); it runs ``cp`` times the
        micro-batches, each of ``1/cp`` of every sequence."""
        return self.candidate.cp if self.candidate else 1

    @property
    def pp(self) -> int:
        """The pick's pipeline degree (1: no ``pp`` axis); each pipeline runs ``pp`` times the
        micro-batches, by the schedule ``candidate.pipeline``."""
        return self.candidate.pp if self.candidate else 1

    @property
    def speedup(self) -> float:
        """Default step time / the pick's (1.0: the search found nothing faster)."""
        return self.default.step_time / self.result.step_time

    def __str__(self) -> str:
        gib = 2**30
        best = self.candidate
        part = f", reserved within the part's {self.memory / gib:,.2f} GiB" if self.memory < float("inf") else ""
        lines = [
            f"search under {self.budget / gib:,.2f} GiB per rank (peak{part}): {len(self.candidates)} candidates, "
            f"{len(self.candidates_fitting)} fit",
            f"pick:    {best.describe() if best else '-'}: step {self.result.step_time * 1e3:,.2f} ms, "
            f"peak {(best.peak if best else 0) / gib:,.2f} GiB, reserved {(best.reserved if best else 0) / gib:,.2f} GiB",
            f"default: zero3, prefetch 1: step {self.default.step_time * 1e3:,.2f} ms, peak "
            f"{self.default.memory['peak'] / gib:,.2f} GiB{'' if self.default_fits else ' (over budget)'}; "
            f"speedup {self.speedup:.3f}x",
            "fastest candidates:          peak     reserved",
        ]
        for c in self.candidates[:8]:
            lines.append(
                f"  {c.step_time * 1e3:10,.2f} ms  {c.peak / gib:8,.2f} GiB  {c.reserved / gib:8,.2f} GiB  "
                f"{'fits' if c.fits else 'over'}  {c.describe()}"
            )
        return "\n".join(lines)

    @property
    def candidates_fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]


def finer_units(model: torch.nn.Module) -> list[str]:
    """One level finer than the default units: every child module of every ``nn.ModuleList``
    child (a transformer block's attention, MLP, norms...).

    Example:
      >>> fsdpfn.sim.finer_units(model)[:3]
      ['blocks.0.norm1', 'blocks.0.qkv', 'blocks.0.proj']
    """
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList):
            for child, sub in mod.named_children():
                prefix = f"{name}.{child}" if name else child
                out += [f"{prefix}.{n}" for n, _ in sub.named_children()]
    return out


def _mesh_shapes(world: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(world,)]
    for r in range(2, world + 1):
        if world % r == 0 and world // r >= 1:
            shapes.append((r, world // r))
    return shapes


def _classes(plan: Plan) -> list[list[str]]:
    """Units grouped by the shapes of their parameters (in plan order), largest class first."""
    groups: dict[tuple, list[str]] = {}
    for u in plan.units:
        key = tuple((p.name.rsplit(".", 1)[-1], p.shape) for p in u.params) if u.name else ("<root>",)
        groups.setdefault(key, []).append(u.name)
    return sorted(groups.values(), key=len, reverse=True)


def _moves(
    state: tuple,
    classes: list[list[str]],
    strategies: Sequence[str],
    prefetch: Sequence[int],
    splits: int,
    accumulates: Sequence[str] = ("reduce",),
    remats: Sequence[str] = ("none",),
):
    """Every single change of ``state`` = ``(class strategies, (split strategy, k), prefetch,
    accumulate, class remat policies)``."""
    per_class, split, p, acc, rm = state
    for i, cls in enumerate(classes):
        if ROOT in cls:
            continue
        for r in remats:
            if r != rm[i]:
                yield (per_class, split, p, acc, rm[:i] + (r,) + rm[i + 1 :])
    for i in range(len(classes)):
        for s in strategies:
            if s != per_class[i]:
                yield (per_class[:i] + (s,) + per_class[i + 1 :], split, p, acc, rm)
    big = len(classes[0])
    if big > 1 and splits:
        ks = sorted({max(1, round(big * f / (splits + 1))) for f in range(1, splits + 1)} - {big})
        for s in strategies:
            for k in ks:
                if (s, k) != split and s != per_class[0]:
                    yield (per_class, (s, k), p, acc, rm)
        if split is not None:
            yield (per_class, None, p, acc, rm)
    for q in prefetch:
        if q != p:
            yield (per_class, split, q, acc, rm)
    for a in accumulates:
        if a != acc:
            yield (per_class, split, p, a, rm)


def _assignment(state: tuple, classes: list[list[str]]) -> dict[str, str]:
    per_class, split = state[0], state[1]
    out = {u: s for cls, s in zip(classes, per_class) for u in cls}
    if split is not None:
        s, k = split
        for u in classes[0][-k:]:
            out[u] = s
    return out


def search(
    model: torch.nn.Module,
    world: int | tuple[int, ...],
    budget: float,
    *inputs: Any,
    hardware: Hardware,
    optimizer: Any = None,
    loss_fn: Callable | None = None,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    prefetch: Sequence[int] = (0, 1, 2),
    units: Sequence[Any] | None = None,
    mesh_shapes: Sequence[tuple[int, ...]] | None = None,
    splits: int = 3,
    mp: MixedPrecision | None = None,
    micro_batches: int = 1,
    accumulate: str | Sequence[str] = "reduce",
    workloads: dict | None = None,
    rel_tol: float = 1e-3,
    remat: Sequence[str] = ("none",),
    tp: Sequence[int] = (1,),
    tp_plan: Mapping[str, str] | None = None,
    ep: Sequence[int] = (1,),
    cp: Sequence[int] = (1,),
    cp_strategy: str = "allgather",
    pp: Sequence[int] = (1,),
    pp_schedules: Sequence[str] = ("1f1b",),
) -> SearchResult:
    """The plan and schedule with the lowest predicted step time whose predicted peak memory per
    rank fits ``budget`` and whose reserved memory (the peak with the caching allocator's
    allowance, ``hardware.memory_reserve``) fits the part's memory (see [Note: the search space]).
    One verdict: a candidate listed as fitting is never one whose prediction notes that the step
    does not fit as planned.

    Args:
      model: the model (real or on the meta device).
      world: the number of ranks (HSDP shapes are searched too), or one mesh shape.
      budget: bytes per rank the step may use at its peak (``SimResult.memory["peak"]``).
      *inputs: one rank's micro-batch, to profile the model (meta tensors for a meta model).
      hardware: the :class:`Hardware` to predict on.
      optimizer: :class:`AdamW`, :class:`Muon` or ``None``.
      loss_fn: ``output -> loss`` for the profile (default: the output's mean).
      strategies, prefetch: the choices per unit class and the prefetch depths.
      units: unit policies to try (``None``: the default and :func:`finer_units`); each is
        what ``fsdpfn.plan(units=...)`` takes.
      mesh_shapes: mesh shapes to try (default: all for ``world``); beside a tp degree ``T``,
        the data-parallel shapes of ``W/T`` ranks among them (all of them when none is); with
        an ep degree ``E``, those of ``W/E`` ranks, as ``(edp,)`` or ``(replicate, edp)``.
      splits: points at which the largest unit class may split between two strategies.
      mp: the mixed-precision policy of every plan.
      micro_batches: as :func:`simulate`.
      accumulate: as :func:`simulate`, or several to search over (``("reduce", "local")``;
        with one micro-batch they are the same step and only the first is tried). The default
        plan is compared with ``"reduce"`` (the runtime's default) when it is among them.
      workloads: a dict reused across calls to cache profiles (keyed by unit names).
      rel_tol: step times this close count as equal (ties go to the default plan).
      remat: activation-checkpointing policies to try per unit class (the root keeps its
        activations), e.g. ``("none", "save_dots", "full")``; costed from the same profile as
        the runtime runs them (:meth:`Workload.with_remat`).
      tp: tensor-parallel degrees to try (each must divide ``world``); ``1`` is no tensor
        parallelism. ``SearchResult.tp`` says which won.
      tp_plan: the layers tensor parallelism splits, as ``fsdpfn.plan(tp=...)`` takes them
        (e.g. ``fsdpfn.models.GPT_TP_PLAN``); needed when ``tp`` has a degree above 1.
      ep: expert-parallel degrees to try for a model with experts (modules listing
        ``expert_params``, as :class:`fsdpfn.models.Experts` does); each must divide ``world``
        and every such layer's experts. ``1`` is no ``ep`` axis; a degree ``E`` searches the
        mesh ``("ep", "edp") = (E, W/E)`` and its HSDP shapes ``("replicate", "ep", "edp")``.
        ``SearchResult.ep`` says which won. Not with a tp degree above 1.
      cp: context-parallel degrees to try for long sequences (each must divide ``world``, and
        ``2 x C`` the length of dim 1 of every tensor input: the sequence); a degree ``C`` searches
        the mesh ``("dp", "cp") = (W/C, C)`` and its HSDP shapes, at ``C`` times the
        micro-batches of ``S/C`` tokens a sequence (the same global batch).
        ``SearchResult.cp`` says which won. Not with a tp or ep degree above 1.
      cp_strategy: how attention reaches the other cp ranks' keys (one of
        :func:`fsdpfn.context_parallel`'s strategies).
      pp: pipeline degrees to try (each must divide ``world`` with the tp degree); a degree
        ``P`` searches the mesh ``("pp", "dp") = (P, W/P)`` (beside a tp axis: ``(P, W/(P T), T)``)
        with the model's top-level modules and each block of a module list as units (see
        :func:`pipeline_units`), cut into ``P`` balanced stages (``2 P`` for
        ``"interleaved_1f1b"``), each pipeline running ``P`` times the micro-batches (the same
        global batch), priced by :func:`simulate_pipeline`. ``SearchResult.pp`` says which won.
        Not with an ep or cp degree above 1.
      pp_schedules: the pipeline schedules to try for each degree above 1
        (``fsdpfn.PIPELINE_SCHEDULES``).

    Returns:
      a :class:`SearchResult`; ``print(result)`` compares the pick with the default plan.

    Raises:
      ValueError: nothing fits the budget (the message names the smallest peak found); a tp
        degree that does not divide ``world``, or a module's attention heads (``heads``,
        ``kv_heads`` attributes) or a split layer's width; an ep degree that does not divide
        ``world`` or a layer's experts, an ep degree above 1 for a model without experts or
        beside a tp degree above 1 (all named, before anything is profiled).

    Example:
      >>> res = fsdpfn.sim.search(model, 2, 2**30, x, hardware=fsdpfn.sim.H100_SXM, prefetch=(1,), units=[None])
      >>> res.result.memory["peak"] <= 2**30, res.speedup >= 1.0
      (True, True)
    """
    accumulates = _check_search_args(world, budget, strategies, prefetch, accumulate, micro_batches, splits)
    remats = tuple(dict.fromkeys(remat)) if not isinstance(remat, str) else (remat,)
    if not remats:
        raise ValueError("search: remat must name at least one policy, e.g. ('none', 'full')")
    for r in remats:
        check_policy(r, "search(remat=...)")
    extra = tuple(r for r in remats if r not in ("none", "full"))
    eps = _check_ep(model, world, ep, tp, mp)  # first: ep beside tp is named before tp_plan is tried on the model
    tps = _check_tp(model, world, tp, tp_plan, mp)
    cps = _check_cp(model, world, cp, cp_strategy, tps, eps, inputs, mp)
    pps, pipes = _check_pp(model, world, pp, pp_schedules, tps, eps, cps, mp, tp_plan)
    if max(cps) > 1 and extra:
        raise ValueError(
            f"search: cp={cps} with the selective remat policies {extra}: the op list does not model which of "
            "attention's exchanges over cp a selective policy recomputes yet; search cp with remat 'none' and 'full'"
        )
    layouts, world_size = _layouts(world, mesh_shapes, pps, tps, eps, cps, pipes)
    pricer = _Pricer(model, mp, tp_plan, optimizer, hardware, budget, micro_batches)
    default_acc = "reduce" if "reduce" in accumulates else accumulates[0]
    unit_options = list(units) if units is not None else [None, finer_units(model)]
    finer = finer_units(model)
    cache = {} if workloads is None else workloads
    default = None
    pipe_units = pipeline_units(model) if max(pps) > 1 else None
    for u_opt in unit_options:
        label = "default" if u_opt is None else ("finer" if list(u_opt) == finer else "custom")
        for layout in layouts:
            if layout.pp > 1 and u_opt is not unit_options[0]:  # pipelined candidates have units of their own
                continue
            uo, lab = (pipe_units, "pipeline") if layout.pp > 1 else (u_opt, label)
            base = build_plan(
                model, layout.profile_mesh(world_size), units=uo, mp=mp, tp=tp_plan if layout.tp > 1 else None
            )
            wl = _workload(cache, model, base, layout, inputs, loss_fn, extra, cp_strategy)
            classes = _classes(base)
            start_p = 1 if 1 in prefetch else prefetch[0]
            state = (("zero3",) * len(classes), None, start_p, default_acc, ("none",) * len(classes))

            def price_state(st, uo=uo, lab=lab, wl=wl, layout=layout, classes=classes):
                remat_of = {u: r for cls, r in zip(classes, st[4]) for u in cls}
                return pricer.price(uo, lab, wl, layout, _assignment(st, classes), st[2], st[3], remat_of)

            current = price_state(state)
            if uo is None and layout.default and start_p == 1:
                default = current
            # A pipeline reduces once per step, after its stages' last backward: accumulate is not a choice there.
            accs = accumulates if layout.pp == 1 else (default_acc,)
            _descend(
                price_state,
                state,
                current,
                lambda st: _moves(st, classes, strategies, prefetch, splits, accs, remats),
                rel_tol,
            )
    candidates = list(pricer.seen.values())  # the searched space: the default below compares, not competes
    if default is None:  # the default was outside the given space: simulate it for comparison
        plan = build_plan(model, (world_size,), mp=mp)
        wl = _workload(cache, model, plan, _Layout((world_size,)), inputs, loss_fn, (), cp_strategy)
        default = pricer.price(
            None, "default", wl, _Layout((world_size,)), {u.name: "zero3" for u in plan.units}, 1, default_acc
        )
    return _pick(candidates, default, rel_tol, budget, hardware)


def _layouts(world, mesh_shapes, pps, tps, eps, cps, pipes) -> tuple[list[_Layout], int]:
    """Every candidate mesh of the search, and the world size: for ``world`` ranks, each degree
    of every axis that divides it with the given (else every) data-parallel shapes beside it;
    for one mesh shape, that shape alone."""
    if not isinstance(world, int):
        return [_Layout(tuple(world))], math.prod(world)
    layouts: list[_Layout] = []
    for q in pps:
        for t in tps:
            if world % (q * t):
                continue
            for e in eps:
                for c in cps:
                    d = q * t * e * c
                    if d == 1:
                        dp_shapes = [tuple(m) for m in mesh_shapes] if mesh_shapes is not None else _mesh_shapes(world)
                    else:  # the given shapes of W/T (or W/E, W/C, W/(P T)) ranks, else all of them
                        dp_shapes = [tuple(m) for m in mesh_shapes or () if math.prod(m) == world // d] or _mesh_shapes(
                            world // d
                        )
                    layouts += [_Layout(s, t, e, c, q, name) for name in (pipes if q > 1 else ("",)) for s in dp_shapes]
    return layouts, world


def _workload(cache: dict, model, base: Plan, layout: _Layout, inputs, loss_fn, extra, cp_strategy) -> Workload:
    """The profile of ``base``'s units on one rank of ``layout``, from ``cache`` or measured
    into it. It depends on the units and the tp degree (tp-local layers), not the rest; an ep
    plan's units (expert units of their own) name its workload, the same for every degree: each
    rank routes its own batch, and dropless its experts see as many pairs. A cp degree's is one
    cp rank's part of each sequence. The profile does not depend on pp: its units and tp do."""
    t, c = layout.tp, layout.cp
    key = tuple(u.name for u in base.units) if t == 1 else (*(u.name for u in base.units), ("tp", t))
    key = key if c == 1 else (*key, ("cp", c, cp_strategy))
    if key not in cache:
        cache[key] = profile(
            model,
            base,
            *_cp_part(_tp_batch(inputs, t), c),
            loss_fn=loss_fn,
            remat_policies=extra,
            cp_strategy=cp_strategy,
        )
    return cache[key]


def _descend(price_state, state, current, moves, rel_tol: float) -> None:
    """Steepest descent from ``state``: each round prices every move (``moves(state)``) and
    takes the best one that beats the current entry by more than ``rel_tol``, until none does."""
    while True:
        best_state, best = None, current
        for nxt in moves(state):
            entry = price_state(nxt)
            if _better(entry, best, rel_tol):
                best_state, best = nxt, entry
        if best_state is None:
            return
        state, current = best_state, best


def _score(entry) -> tuple[int, float]:
    """Fitting beats not fitting; then time (fitting) or memory (not yet)."""
    c = entry[0]
    return (0, c.step_time) if c.fits else (1, float(c.peak))


def _better(a, b, rel_tol: float) -> bool:
    sa, sb = _score(a), _score(b)
    return sa[0] < sb[0] or (sa[0] == sb[0] and sa[1] < sb[1] * (1 - rel_tol))


class _Pricer:
    """Prices one configuration (units, layout, strategies, prefetch, accumulation, remat):
    builds its plan, simulates it once (pipelined or not: one plan builder and one simulator
    call each) and keeps the ``(Candidate, plan, schedule, result)`` by configuration."""

    def __init__(self, model, mp, tp_plan, optimizer, hardware: Hardware, budget: float, micro_batches: int):
        self.model, self.mp, self.tp_plan = model, mp, tp_plan
        self.optimizer, self.hardware, self.budget, self.micro_batches = optimizer, hardware, budget, micro_batches
        self.seen: dict[tuple, tuple] = {}

    def reserved_of(self, peak: int) -> int:
        return int(peak * (1.0 + self.hardware.memory_reserve))  # as SimResult.memory["reserved"]

    def fits(self, peak: int) -> bool:
        return peak <= self.budget and self.reserved_of(peak) <= self.hardware.memory

    def price(self, u_opt, label, wl, layout: _Layout, assignment, p, acc, rm=None):
        rm = {u: r for u, r in (rm or {}).items() if r != "none"}
        key = (label, layout, tuple(sorted(assignment.items())), p, acc, tuple(sorted(rm.items())))
        if key in self.seen:
            return self.seen[key]
        strategy = {"*": "zero3", **{(n or "<root>"): s for n, s in assignment.items()}}
        plan: Plan | PipelinedPlan
        common = dict(
            units=u_opt, strategy=strategy, mp=self.mp, remat=rm or None, tp=self.tp_plan if layout.tp > 1 else None
        )
        if layout.pp > 1:
            plan = build_pipeline_plan(self.model, layout.mesh(), stages=layout.stages, **common)
        else:
            plan = build_plan(self.model, layout.mesh(), **common)
        work = wl.with_remat(plan) if rm else wl
        sched: Schedule | PipelineSchedule
        res: SimResult | PipelineSimResult
        if isinstance(plan, PipelinedPlan):
            psched = pipeline_schedule(plan, layout.pipeline, self.micro_batches * layout.pp, prefetch=p)
            pres = simulate_pipeline(plan, psched, work, self.optimizer, self.hardware)
            sched, res, peak = psched, pres, max(m["peak"] for m in pres.memory)
        else:
            ssched = make_schedule(plan, prefetch=p)
            sres = simulate(
                plan,
                ssched,
                work,
                self.optimizer,
                self.hardware,
                micro_batches=self.micro_batches * layout.cp,
                accumulate=acc,
            )
            sched, res, peak = ssched, sres, sres.memory["peak"]
        cand = Candidate(
            tuple(plan.mesh_shape),
            label,
            key[2],
            p,
            res.step_time,
            peak,
            self.fits(peak),
            acc,
            key[5],
            layout.tp,
            layout.ep,
            layout.cp,
            layout.pp,
            layout.pipeline,
            self.reserved_of(peak),
        )
        self.seen[key] = (cand, plan, sched, res)
        return self.seen[key]


def _pick(candidates: list, default, rel_tol: float, budget: float, hardware: Hardware) -> SearchResult:
    """The search's pick among every priced candidate: the fastest that fits, the default when
    it is within ``rel_tol`` of that, else the one with the smallest peak among those."""
    fitting = [c for c in candidates if c[0].fits]
    if not fitting:
        small = min(candidates, key=lambda c: c[0].peak)
        raise ValueError(
            f"no plan fits {budget / 2**30:,.3f} GiB per rank (peak; reserved within the "
            f"{hardware.memory / 2**30:,.3f} GiB of {hardware.name}); the smallest predicted peak is "
            f"{small[0].peak / 2**30:,.3f} GiB, reserved {small[0].reserved / 2**30:,.3f} GiB "
            f"({small[0].describe()}). Raise the budget, use more ranks, "
            "fewer tokens per micro-batch or activation checkpointing."
        )
    best_time = min(c[0].step_time for c in fitting)
    near = [c for c in fitting if c[0].step_time <= best_time * (1 + rel_tol)]
    pick = (
        default
        if default[0].fits and any(c is default for c in near)
        else min(near, key=lambda c: (c[0].peak, c[0].step_time))
    )
    ordered = tuple(c[0] for c in sorted(candidates, key=lambda c: (c[0].step_time, c[0].peak)))
    return SearchResult(
        pick[1],
        pick[2],
        pick[3],
        default[3],
        default[0].fits,
        ordered,
        budget,
        pick[0].accumulate,
        pick[0],
        float(hardware.memory),
    )


def pipeline_units(model: torch.nn.Module) -> list[str]:
    """The units a pipelined search cuts into stages: every child module with parameters, in
    order, and each module of a child ``nn.ModuleList`` (a transformer's blocks) one unit; the
    root keeps none (a balanced split cuts units in order, and the root's parameters would have
    no place in it).

    Example:
      >>> fsdpfn.sim.pipeline_units(model)
      ['embed', 'pos', 'blocks.0', 'blocks.1', 'norm', 'head']
    """
    out = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            out += [f"{name}.{i}" for i, m in enumerate(child) if any(True for _ in m.parameters())]
        elif any(True for _ in child.parameters()):
            out.append(name)
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"search: {type(model).__name__} holds parameters of its own (not in a child module), which no pipeline "
            "stage can take; search it with pp=(1,)"
        )
    return out


def _stage_count(q: int, pipe: str) -> int:
    return 2 * q if pipe == "interleaved_1f1b" else q


def _mesh_arg_dict(shape: tuple[int, ...], t: int) -> dict[str, int]:
    """A pipelined candidate's axes after ``pp``: data-parallel ``shape`` and a tp axis of ``t``."""
    names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
    return {**dict(zip(names, shape)), **({"tp": t} if t > 1 else {})}


def _check_pp(
    model: torch.nn.Module, world, pp: Sequence[int], schedules: Sequence[str], tps, eps, cps, mp, tp_plan
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The pp degrees and schedules to try, each checked against ``world``, the model's units and
    the other degrees, before anything is profiled."""
    pps = tuple(dict.fromkeys((pp,) if isinstance(pp, int) else pp))
    if not pps or any(isinstance(q, bool) or not isinstance(q, int) or q < 1 for q in pps):
        raise ValueError(f"search: pp must be pipeline degrees >= 1, e.g. (1, 2, 4), got {pp!r}")
    names = (schedules,) if isinstance(schedules, str) else tuple(dict.fromkeys(schedules))
    bad = [n for n in names if n not in PIPELINE_SCHEDULES]
    if not names or bad:
        raise ValueError(f"search: pp_schedules must be some of {PIPELINE_SCHEDULES}, got {tuple(schedules)!r}")
    if pps == (1,):
        return pps, names
    if not isinstance(world, int):
        raise ValueError(f"search: pp={pps} needs world as a number of ranks, not the mesh shape {tuple(world)!r}")
    if max(eps) > 1 or max(cps) > 1:
        raise ValueError(
            f"search: pp={pps} with ep={eps}, cp={cps}: the search does not combine a pp axis with an ep or cp "
            "axis yet; search pp with ep=(1,) and cp=(1,)"
        )
    units = pipeline_units(model)
    for q in pps:
        if world % q:
            raise ValueError(
                f"search: pp={q} does not divide world={world}; choose degrees that divide the number of ranks"
            )
        if q == 1:
            continue
        if not any((world // q) % t == 0 for t in tps):
            raise ValueError(f"search: pp={q} leaves {world // q} ranks per stage, which no tp degree of {tps} divides")
        most = max(_stage_count(q, n) for n in names)
        if most > len(units):
            raise ValueError(
                f"search: pp={q} with {', '.join(names)} needs {most} stages, but {type(model).__name__} has "
                f"{len(units)} pipeline units ({units[:4]}...); choose a smaller pp degree"
            )
        build_pipeline_plan(
            model, {"pp": q, "dp": world // q}, units=units, mp=mp, stages=q
        )  # whatever else the plan refuses: named here
    return pps, names


def _tp_batch(inputs: tuple, t: int) -> tuple:
    """One tp group's micro-batch: ``t`` ranks' batches (``inputs`` repeated along dim 0), so
    that every candidate trains the same global batch."""
    if t == 1:
        return inputs
    return tuple(torch.cat([x] * t) if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def _cp_part(inputs: tuple, c: int) -> tuple:
    """One cp rank's part of every sequence of ``inputs`` (dim 1 of each tensor cut to ``1/c``:
    the profile needs its shapes, not which tokens)."""
    if c == 1:
        return inputs
    # A copy, not a view: the profile counts an input by its storage.
    return tuple(
        x.narrow(1, 0, x.shape[1] // c).clone() if isinstance(x, torch.Tensor) and x.dim() > 1 else x for x in inputs
    )


def _mesh_arg(shape: tuple[int, ...], t: int, e: int = 1, c: int = 1):
    """What ``fsdpfn.plan`` takes for data-parallel ``shape`` beside a tp axis of ``t`` or a cp
    axis of ``c``, or with an ep axis of ``e``: ``shape`` is then ``(edp,)`` or ``(replicate, edp)``."""
    if c > 1:
        names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
        return {**dict(zip(names, shape)), "cp": c}
    if e > 1:
        return {"ep": e, "edp": shape[0]} if len(shape) == 1 else {"replicate": shape[0], "ep": e, "edp": shape[1]}
    if t == 1:
        return shape
    names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
    return {**dict(zip(names, shape)), "tp": t}


_HEAD_ATTRS = ("heads", "kv_heads", "n_heads", "n_kv_heads", "num_heads", "num_key_value_heads")


def _check_tp(model: torch.nn.Module, world, tp: Sequence[int], tp_plan, mp) -> tuple[int, ...]:
    """The tp degrees to try, each checked against ``world``, the model's head counts and the
    split layers' widths, before anything is profiled."""
    tps = tuple(dict.fromkeys((tp,) if isinstance(tp, int) else tp))
    if not tps or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
        raise ValueError(f"search: tp must be tensor-parallel degrees >= 1, e.g. (1, 2, 4), got {tp!r}")
    if tps == (1,):
        return tps
    if not isinstance(world, int):
        raise ValueError(f"search: tp={tps} needs world as a number of ranks, not the mesh shape {tuple(world)!r}")
    if tp_plan is None:
        raise ValueError(f"search: tp={tps} needs tp_plan, the layers to split, e.g. fsdpfn.models.GPT_TP_PLAN")
    for t in tps:
        if world % t:
            raise ValueError(
                f"search: tp={t} does not divide world={world}; choose degrees that divide the number of ranks"
            )
        if t == 1:
            continue
        for name, mod in model.named_modules():
            for attr in _HEAD_ATTRS:
                n = getattr(mod, attr, None)
                if isinstance(n, int) and not isinstance(n, bool) and n % t:
                    raise ValueError(
                        f"search: tp={t} does not divide {name or type(model).__name__}.{attr} = {n}: each tp rank "
                        "runs whole attention heads; choose tp degrees that divide every head count"
                    )
        build_plan(model, {"dp": world // t, "tp": t}, tp=tp_plan, mp=mp)  # a width tp does not divide: named here
    return tps


def _check_ep(model: torch.nn.Module, world, ep: Sequence[int], tp: Sequence[int], mp) -> tuple[int, ...]:
    """The ep degrees to try, each checked against ``world``, every expert layer's number of
    experts and the tp degrees, before anything is profiled."""
    eps = tuple(dict.fromkeys((ep,) if isinstance(ep, int) else ep))
    if not eps or any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in eps):
        raise ValueError(f"search: ep must be expert-parallel degrees >= 1, e.g. (1, 2, 4), got {ep!r}")
    if eps == (1,):
        return eps
    big = max(eps)
    if not isinstance(world, int):
        raise ValueError(f"search: ep={eps} needs world as a number of ranks, not the mesh shape {tuple(world)!r}")
    tps = tuple((tp,) if isinstance(tp, int) else tp)
    if any(isinstance(t, int) and t > 1 for t in tps):
        raise ValueError(
            f"search: ep={eps} with tp={tps}: plans do not put an ep axis beside a tp axis; "
            "search expert parallelism (ep) or tensor parallelism (tp), not both"
        )
    layers = {
        name or type(model).__name__: getattr(mod, "num_experts", None)
        for name, mod in model.named_modules()
        if getattr(mod, "expert_params", ())
    }
    if not layers:
        raise ValueError(
            f"search: ep={eps}, but {type(model).__name__} has no expert layers (no module lists expert_params, "
            "as fsdpfn.models.Experts does); search it with ep=(1,)"
        )
    for e in eps:
        if world % e:
            raise ValueError(
                f"search: ep={e} does not divide world={world}; choose degrees that divide the number of ranks"
            )
        for name, n in layers.items():
            if isinstance(n, int) and n % e:
                raise ValueError(
                    f"search: ep={e} does not divide {name}.num_experts = {n}: each ep rank holds whole experts; "
                    "choose ep degrees that divide every layer's number of experts"
                )
    build_plan(model, {"ep": big, "edp": world // big}, mp=mp)  # whatever else the plan refuses: named here
    return eps


def _check_cp(model: torch.nn.Module, world, cp: Sequence[int], strategy: str, tps, eps, inputs, mp) -> tuple[int, ...]:
    """The cp degrees to try, each checked against ``world``, the inputs' sequence length and
    the other degrees, before anything is profiled."""
    cps = tuple(dict.fromkeys((cp,) if isinstance(cp, int) else cp))
    if not cps or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cps):
        raise ValueError(f"search: cp must be context-parallel degrees >= 1, e.g. (1, 2, 4), got {cp!r}")
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"search: cp_strategy must be one of {CP_STRATEGIES}, got {strategy!r}")
    if cps == (1,):
        return cps
    if not isinstance(world, int):
        raise ValueError(f"search: cp={cps} needs world as a number of ranks, not the mesh shape {tuple(world)!r}")
    if max(tps) > 1 or max(eps) > 1:
        raise ValueError(
            f"search: cp={cps} with tp={tps}, ep={eps}: the search does not combine a cp axis with a tp or ep "
            "axis yet; search cp with tp=(1,) and ep=(1,)"
        )
    seqs = [x.shape[1] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 1]
    if not seqs:
        raise ValueError(
            "search: cp needs inputs of shape (batch, sequence, ...): a cp rank holds a part of each sequence (dim 1)"
        )
    for c in cps:
        if world % c:
            raise ValueError(
                f"search: cp={c} does not divide world={world}; choose degrees that divide the number of ranks"
            )
        bad = [s for s in seqs if s % (2 * c)]
        if bad:
            raise ValueError(
                f"search: cp={c} needs sequences (dim 1 of the inputs) divisible by 2 x cp = {2 * c}, got {bad[0]}: "
                "each cp rank holds a head and a tail chunk"
            )
        if c > 1:
            build_plan(model, {"dp": world // c, "cp": c}, mp=mp)  # a model without attention: named here
    return cps


def _check_search_args(world, budget, strategies, prefetch, accumulate, micro_batches, splits) -> tuple[str, ...]:
    """Every argument checked before anything is profiled; returns the accumulate modes to try."""
    if isinstance(world, int):
        if world < 1:
            raise ValueError(f"search: world must be >= 1 ranks, got {world}")
    elif not world or any(not isinstance(d, int) or d < 1 for d in world):
        raise ValueError(f"search: a mesh shape must be positive ints, got {world!r}")
    if not budget > 0:
        raise ValueError(f"search: budget is bytes per rank and must be > 0, got {budget!r}")
    bad = [s for s in strategies if s not in DEFAULT_STRATEGIES]
    if not strategies or bad:
        raise ValueError(f"search: strategies must be some of {DEFAULT_STRATEGIES}, got {tuple(strategies)!r}")
    if not prefetch or any(not isinstance(p, int) or p < 0 for p in prefetch):
        raise ValueError(f"search: prefetch must be depths >= 0 (e.g. (0, 1, 2)), got {tuple(prefetch)!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"search: micro_batches must be an int >= 1, got {micro_batches!r}")
    if not isinstance(splits, int) or splits < 0:
        raise ValueError(f"search: splits must be an int >= 0, got {splits!r}")
    accumulates = (accumulate,) if isinstance(accumulate, str) else tuple(dict.fromkeys(accumulate))
    if not accumulates or any(a not in ("reduce", "local") for a in accumulates):
        raise ValueError(f"search: accumulate must be 'reduce', 'local' or both, got {accumulate!r}")
    if micro_batches == 1:  # one micro-batch: the same step either way
        accumulates = accumulates[:1]
    return accumulates
