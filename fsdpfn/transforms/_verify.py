"""The differential check: a sharded step compared, unit by unit, with the unsharded computation.

[Note: the differential check]
Guards that recognise one spelling of a mistake (a ``chunk`` of a colwise output, a step that
never called the cp attention) miss the next spelling. What every mistake of a model-parallel
layout has in common is its effect: the unit computes something other than the same code on the
whole weights and the whole sequence. So :func:`verify` runs the model twice, without autograd:

1. **sharded**: as the step runs it, each unit on this rank's tensor- and expert-parallel part
   of its weights (gathered over the data-parallel axes, through the unit's codec), with the
   plan's activation collectives (tp hooks, expert dispatch, cp attention) on this rank's part
   of each sequence. Every unit's inputs and outputs are kept.
2. **reference**: the same module code with every axis switched off: the unit's *global*
   weights (its parts gathered over tp and ep and put together as the placements say; a
   ``Partial`` bias taken once), every expert local, no tp collective, plain attention outside
   any ``context_parallel`` block, on the whole sequences (the inputs gathered over cp).

At each unit (the outermost units below the root, in call order) the reference's input must
equal the sharded one (else the root's code between units differs, e.g. a tp-split embedding),
the unit run on the sharded input must give the sharded output, and its vector-Jacobian product
for a cotangent drawn at random (the same on the peers that must agree) must give the same input
cotangent and parameter gradients: the reference's gradient of a parameter, cut to this rank's
part, against the sharded one, summed over cp (each cp rank holds the gradient of its own
tokens). Last, the model outputs are compared. Both sides compute in float32 from the same
gathered values, so what differs is structure (splits and collectives), not the compute
dtype's rounding.

**The bound.** A dot product of ``K`` float32 terms summed in another order (partial sums per tp
rank, then an all-reduce; chunks of keys merged by log-sum-exp) differs by at most ``2 K u``
relative to ``sum |a_i b_i|`` (``u = 2**-24``; Higham, *Accuracy and Stability of Numerical
Algorithms*, 3.1). A unit's forward and backward sum over each weight's fan-in and fan-out and,
for the weight gradients and attention, over the tokens, so the check allows, norm-wise,
``4 u (sum over the unit's weights of fan-in + fan-out, + tokens)``: twice the dot-product
bound, for the normalisations and softmaxes between the sums. For the demo model (width 256,
1k tokens per rank) that is about 1e-3, while every layout mistake seen so far is off by 1e-2
to 1; rounding alone stays near 1e-7.

**Memory.** One unit's weights at a time are gathered (and freed after it), plus its global
copy; the unit boundaries' activations of this rank are kept (what a step keeps for backward
anyway), and under cp one unit's input and output for the whole sequences.

**Units with nothing to compare.** A unit none of whose parameters is split over a model-parallel
axis, on a mesh without ``cp``, runs the same arithmetic on both sides: it is not recomputed.
When no unit has anything to compare (a plain data-parallel plan) the check returns at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn import _ambient
from fsdpfn import comm as C
from fsdpfn._plan import ROOT, Plan, Unit, unit_label
from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import local_part, split_roles, uses_zeros
from fsdpfn._plan.tp_styles import tp_style
from fsdpfn._tree import flatten, unflatten
from fsdpfn.transforms._axes import _axis_group, _axis_rank, axis_index, cp_group, dp_rank
from fsdpfn.transforms._gather import check_params, gather_unit
from fsdpfn.transforms._guards import capture_step
from fsdpfn.transforms._intercept import intercept as _intercept
from fsdpfn.transforms._tp import reference_mode

__all__ = [
    "Comparison",
    "VerificationError",
    "VerifyReport",
    "verify",
    "verify_stage",
    "verify_stage_loss",
    "verify_step",
]

_U32 = 2.0**-24  # float32 unit roundoff


class VerificationError(ValueError):
    """The sharded computation of a unit differs from the unsharded one beyond the rounding
    bound (see [Note: the differential check]). Raised on every rank, with the same text.

    Attributes:
      comparison: the first :class:`Comparison` that failed (on the first rank that found one).
    """

    def __init__(self, message: str, comparison: "Comparison | None" = None):
        super().__init__(message)
        self.comparison = comparison


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One value compared: ``what`` of ``unit`` (an output, an input cotangent, a parameter's
    gradient), its norm-wise relative ``error`` and the ``bound`` it must stay within."""

    unit: str
    what: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` compared on this rank, in order.

    Example:
      >>> report = fsdpfn.verify(model, plan, params, x)
      >>> report.ok, report.comparisons   # a data-parallel plan splits nothing: nothing to compare
      (True, [])
    """

    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    units: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # checks skipped, and why

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def worst(self) -> Comparison | None:
        """The comparison closest to its bound (largest ``error / bound``)."""
        return max(self.comparisons, key=lambda c: c.error / c.bound, default=None)

    def __str__(self) -> str:
        lines = [f"{'unit':<24} {'compared':<36} {'error':>10} {'bound':>10}"]
        for c in self.comparisons:
            lines.append(f"{unit_label(c.unit):<24} {c.what:<36} {c.error:>10.2e} {c.bound:>10.2e}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Weights: this rank's part, and the global tensor put together from every rank's part
# ---------------------------------------------------------------------------------------------


def _plain(t: torch.Tensor) -> torch.Tensor:
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _gathered(plan: Plan, unit: Unit, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``unit``'s parameters as the step gathers them (this rank's model-parallel part, through the
    unit's codec), in float32."""
    locals_ = []
    for p in unit.params:
        x = _plain(params[p.name])
        locals_.append(x._local_tensor if isinstance(x, DTensor) else x)
    pending, finish = gather_unit(plan, unit, locals_)
    return {p.name: t.detach().float() for p, t in zip(unit.params, finish(pending.wait()))}


def _global(plan: Plan, name: str, part: torch.Tensor) -> torch.Tensor:
    """The global tensor of parameter ``name`` from every rank's ``part``: one all-gather per axis
    that places it, then each part written where :func:`local_part` takes it from (so any
    placement that selects elements works, a strided fused split included); a ``Partial``
    parameter is taken from the position that does not use zeros."""
    spec = plan.param(name)
    placed = [e for e in spec.placements if e.size > 1]
    if not placed:
        return part
    stack, keys = part.unsqueeze(0), cast("list[dict[Role, int]]", [{}])
    for e in placed:
        rows = C.all_gather_rows(stack.contiguous(), _axis_group(plan, e.axis), tag="verify")
        keys = [{**k, e.axis: r} for r in range(e.size) for k in keys]
        stack = rows.reshape(-1, *part.shape)
    out = torch.zeros(spec.shape, dtype=part.dtype, device=part.device)
    index = torch.arange(out.numel(), device=part.device).view(spec.shape)
    for key, t in zip(keys, stack):
        if uses_zeros(spec, key):
            continue
        out.view(-1)[local_part(spec, index, key).reshape(-1)] = t.reshape(-1)
    return out


def _split(plan: Plan, name: str) -> bool:
    return any(e.size > 1 for e in plan.param(name).placements)


# ---------------------------------------------------------------------------------------------
# The two passes
# ---------------------------------------------------------------------------------------------


class _Modes:
    """The model's axes, switched on (as the step runs) or off (the reference): the tp hooks
    (:func:`reference_mode`), the expert layers' ep group, the active cp axes."""

    def __init__(self, model: nn.Module):
        self.routed = [m for m in model.modules() if hasattr(m, "set_ep_group") and getattr(m, "ep", 1) > 1]
        self.groups = [m.ep_group for m in self.routed]
        self.cp = list(_ambient.CP_STACK)

    @contextlib.contextmanager
    def _set(self, on: bool) -> Iterator[None]:
        saved = list(_ambient.CP_STACK)
        _ambient.CP_STACK[:] = self.cp if on else []
        try:
            for m, g in zip(self.routed, self.groups):
                m.set_ep_group(g if on else None)  # type: ignore[operator]  # found by hasattr; nn.Module's __getattr__ stub says Tensor | Module
            with reference_mode(not on):
                yield
        finally:
            for m, g in zip(self.routed, self.groups):
                m.set_ep_group(g)  # type: ignore[operator]  # as above
            _ambient.CP_STACK[:] = saved

    def sharded(self):
        return self._set(True)

    def unsharded(self):
        return self._set(False)


def _outer_units(plan: Plan, modules: Mapping[str, nn.Module]) -> list[Unit]:
    """The units the check intercepts: below the root, inside no other unit."""
    names = [u.name for u in plan.units if u.name != ROOT]
    return [plan.unit(n) for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _members(plan: Plan, outer: Unit) -> list[Unit]:
    return [u for u in plan.units if u.name == outer.name or u.name.startswith(outer.name + ".")]


def _run(module: nn.Module, weights: Mapping[str, torch.Tensor], prefix: str, args, kwargs):
    named = {n[len(prefix) + 1 :] if prefix else n: t for n, t in weights.items()}
    setattr(module, "_fsdpfn_in_remat", True)  # a pure-loop remat wrapper passes straight through
    try:
        return torch.func.functional_call(module, named, tuple(args), kwargs, strict=False)
    finally:
        setattr(module, "_fsdpfn_in_remat", False)


class _Seq:
    """How the whole sequences are made from this rank's part over cp and cut back (identity
    without cp): tensors with a sequence dim of this rank's length, at ``dim``."""

    def __init__(self, plan: Plan, local_len: int | None, dim: int = 1):
        self.size, self.dim, self.local = plan.cp_size, dim, local_len
        self.group = cp_group(plan) if plan.cp_size > 1 else None

    def _seq_dim(self, x) -> int | None:
        """Where ``x`` holds this rank's tokens: ``dim`` (batch-first activations), or 0 for a
        1-d tensor of the local length (positions from :func:`fsdpfn.context_parallel_positions`)."""
        if self.size == 1 or not isinstance(x, torch.Tensor):
            return None
        if x.dim() > self.dim and x.shape[self.dim] == self.local:
            return self.dim
        return 0 if x.dim() == 1 and x.shape[0] == self.local else None

    def _has(self, x) -> bool:
        return self._seq_dim(x) is not None

    def whole(self, x):
        from fsdpfn.transforms._cp import context_parallel_unshard

        d = self._seq_dim(x)
        return context_parallel_unshard(x, self.group, seq_dim=d) if d is not None else x

    def part(self, x, like=None):
        from fsdpfn.transforms._cp import context_parallel_shard

        d = self._seq_dim(like) if like is not None else None
        if d is None or not isinstance(x, torch.Tensor):
            return x
        return context_parallel_shard(x, self.group, seq_dim=d)


def _vocab_part(plan: Plan, ref, sharded):
    """The reference's columns of this tp rank when the model's output is logits split over the
    vocabulary (a ``colwise_loss`` head, see [Note: the loss over a split vocabulary]): the
    sharded side keeps them split, by design."""
    t = plan.axes.size(Role.TP)
    split_logits = any((row := tp_style(style)) is not None and row.gives == "logits" for _, style in plan.tp)
    if not split_logits or not isinstance(ref, torch.Tensor):
        return ref
    if ref.shape[:-1] != sharded.shape[:-1] or ref.shape[-1] != t * sharded.shape[-1]:
        return ref
    rows = sharded.shape[-1]
    return ref.narrow(-1, _axis_rank(plan, Role.TP) * rows, rows)


def _floats(tree):
    leaves, spec = flatten(tree, none_is_leaf=True)
    return [x.detach().float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in leaves], spec


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.norm())
    diff = float((a - b).norm())
    if not math.isfinite(diff):
        return (
            math.inf
            if torch.isfinite(a).all() != torch.isfinite(b).all() or not torch.equal(a.isnan(), b.isnan())
            else 0.0
        )
    return diff / scale if scale > 0 else diff


def _worst(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.detach().double() - b.detach().double()).abs()
    i = int(d.reshape(-1).argmax()) if d.numel() else 0
    where = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), d.shape)) if d.dim() else ()
    return f"at index {list(where)}: sharded {float(a.reshape(-1)[i]):.6g}, unsharded {float(b.reshape(-1)[i]):.6g}"


def _bound(weights: Mapping[str, torch.Tensor], tokens: int) -> float:
    terms = tokens
    for t in weights.values():
        if t.dim() >= 2:
            terms += t.shape[0] + t[0].numel()  # fan-out + fan-in
    return 4 * _U32 * max(terms, 1)


class _Checker:
    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        params: Mapping[str, torch.Tensor],
        seed: int,
        stage: tuple[nn.Module, Mapping[str, str]] | None = None,
    ):
        self.plan, self.model, self.params, self.seed = plan, model, params, seed
        # A pipeline stage: its module runs the forward (its parameters named as the module
        # names them), and only the stage's ranks take part; the units are still the model's
        # modules (a stage shares them), so the same interception finds them.
        self.runner, self.rename = stage if stage is not None else (model, {})
        self.group = tuple(int(r) for r in plan.mesh.mesh.flatten().tolist()) if stage is not None else None
        modules = dict(model.named_modules())
        for u in plan.units:
            if u.name not in modules:
                raise ValueError(
                    f"unit {u.label!r} of the plan is not a module of {type(model).__name__}; was the plan built for another model?"
                )
        self.outer = _outer_units(plan, modules)
        self.modules = {u.name: modules[u.name] for u in self.outer}
        self.modes = _Modes(model)
        self.report = VerifyReport()
        self.keep_output, self.output = False, None  # a pipeline stage hands its sharded output on
        self.problem: str | None = None
        self.first: Comparison | None = None

    # ---- what to say ---------------------------------------------------------------------

    def _axes_of(self, unit_names: Sequence[str]) -> list[str]:
        roles: set[Role] = set()
        for u in unit_names:
            for p in self.plan.unit(u).params:
                roles.update(r for r in split_roles(p) if r in (Role.TP, Role.EP))
        sizes = {Role.TP: self.plan.tp_size, Role.EP: self.plan.ep_size}
        found = [f"{r.value}={sizes[r]}" for r in (Role.TP, Role.EP) if r in roles]
        if self.plan.cp_size > 1:
            found.append(f"cp={self.plan.cp_size}")
        return found

    def _hint(self, axes: Sequence[str], names: Sequence[str]) -> str:
        hints = []
        axes = [a.split("=")[0] for a in axes]
        if "tp" in axes:
            tp = [
                f"{n} ({s})" for n, s in self.plan.tp if any(n == m or n.startswith(m + ".") for m in names if m)
            ] or [f"{n} ({s})" for n, s in self.plan.tp]
            hints.append(
                f"tp: the unit runs tensor-parallel layers {tp[:6]}; a split the model's code does not compute as planned: a fused "
                "projection whose parts lie side by side (q | k | v, gate | up) cut after a plain 'colwise' split needs "
                "'colwise_fused:k' (and a head-major one plain 'colwise'), and a split layer called around its module "
                "(F.linear(x, m.weight), m.forward(x)) skips its collective: call the module itself"
            )
        if "ep" in axes:
            hints.append(
                "ep: expert weights are split over the ep axis; every packed expert weight of a layer must be listed (all of "
                "w1, w2, ... in experts=[...]) and the layer must dispatch with the ep group it is given"
            )
        if "cp" in axes:
            hints.append(
                "cp: each rank holds part of every sequence; every attention of the model must call "
                "fsdpfn.context_parallel_attention (not F.scaled_dot_product_attention), and the forward must run inside "
                "`with fsdpfn.context_parallel(plan):`"
            )
        return ("; likely cause, by axis: " + " | ".join(hints)) if hints else ""

    def compare(
        self,
        unit: str,
        what: str,
        sharded: torch.Tensor,
        reference: torch.Tensor,
        bound: float,
        axes_units: Sequence[str],
    ) -> None:
        if self.problem is not None:
            return
        if sharded.shape != reference.shape:
            err = math.inf
            detail = f"shape {tuple(sharded.shape)} sharded, {tuple(reference.shape)} unsharded"
        else:
            err = _relative(sharded, reference)
            detail = _worst(sharded, reference) if err > bound else ""
        c = Comparison(unit, what, err, bound)
        self.report.comparisons.append(c)
        if err > bound:
            axes = self._axes_of(axes_units)
            self.first = c
            self.problem = (
                f"unit {unit_label(unit)!r}: {what} differs from the same computation unsharded (whole weights, every expert, "
                f"the whole sequence): relative error {err:.3g} > bound {bound:.3g}; {detail}. "
                f"Axes this unit is split over: {', '.join(axes) or 'none'}" + self._hint(axes, axes_units)
            )

    # ---- the agreement: every rank stops at the same place ----------------------------------

    def settle(self, where: str) -> None:
        found = C.exchange_problems(f"verify {self.plan.fingerprint} {where}", self.problem, self.group)
        if found:
            first = min(found)
            others = "" if len(found) == 1 else f" (also on ranks {sorted(set(found) - {first})})"
            raise VerificationError(
                f"fsdpfn.verify: the sharded step does not compute what one process computes. On rank {first}{others}: "
                f"{found[first]}. (Pass verify=False to skip this check.)",
                self.first,
            )

    def call(self, root: Mapping[str, torch.Tensor], args, kwargs):
        """The model's (or the stage's) forward with ``root``'s weights."""
        named = {self.rename.get(n, n): t for n, t in root.items()}
        return torch.func.functional_call(self.runner, named, tuple(args), kwargs, strict=False)

    # ---- the random cotangent --------------------------------------------------------------

    def cotangent(self, like: torch.Tensor, unit: str, call: int, k: int, seq: _Seq) -> torch.Tensor:
        # The same on tp peers (one dp index); drawn for the whole sequences and cut, so cp peers
        # hold parts of one cotangent.
        key = zlib.crc32(f"{self.seed}/{unit}/{call}/{k}/{dp_rank(self.plan)}".encode())
        gen = torch.Generator(device="cpu").manual_seed(key)
        shape = list(like.shape)
        d = seq._seq_dim(like)
        if d is not None:
            shape[d] *= seq.size
        full = torch.randn(shape, generator=gen, dtype=torch.float32).to(like.device)
        return seq.part(full, like) if seq._has(like) else full


def _raised(e: BaseException) -> str:
    """``Type: message (at file:line)``, the line the deepest frame of the traceback ran."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _grads(out_flat, ct, wrt):
    pairs = [(o, g) for o, g in zip(out_flat, ct) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if not pairs:
        return [None] * len(wrt)
    return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def verify(
    model: nn.Module, plan: Plan, params: Mapping[str, torch.Tensor], *args: Any, seed: int = 0, **kwargs: Any
) -> VerifyReport:
    """Checks that ``plan`` computes, on ``model`` and this batch, what one process computes:
    every unit's forward and vector-Jacobian product, sharded as the step runs it, against the
    same module code on the whole weights, every expert and the whole sequence (see
    [Note: the differential check] in ``fsdpfn/transforms/_verify.py``).

    Every rank of the plan's mesh calls it with its own batch, at the same point of its program
    (the runtimes and :func:`fsdpfn.compile` call it on their first step). Raises
    :class:`VerificationError` on every rank, naming the first unit and value that differ, the
    axes the unit is split over, both values and the bound. Nothing is trained or changed.

    Args:
      model: the module the plan was built for (the instance the step runs).
      plan: a plan bound to a mesh.
      params: the sharded parameters (:func:`fsdpfn.shard`'s dict).
      *args, **kwargs: the model's inputs, as the step passes them (this rank's part of the
        batch, and of each sequence under cp).
      seed: seeds the random cotangents.

    Returns:
      a :class:`VerifyReport` of what was compared on this rank.

    Example:
      >>> report = fsdpfn.verify(model, plan, params, x)   # before the training loop
      >>> report.ok
      True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"verify takes the nn.Module the plan was built for, got {type(model).__name__}")
    check_params(params, plan, "verify(params)")
    if plan.mesh is None:
        raise ValueError("verify: the plan has no mesh; bind one with plan.bind(mesh)")
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    # Called from inside torch.func.grad (a runtime's first step): the check is no part of that
    # transform, so it runs with the transforms set aside and on the plain tensors under them.
    with temporarily_clear_interpreter_stack(), torch._C._DisableFuncTorch(), C.uncounted():
        leaves, spec = flatten((list(args), kwargs), none_is_leaf=True)
        plain_args, kwargs = unflatten(spec, [_plain(x) if isinstance(x, torch.Tensor) else x for x in leaves])
        return _verify(
            _Checker(plan, model, {n: _plain(t) for n, t in params.items()}, seed), tuple(plain_args), kwargs
        )


def verify_stage(
    model: nn.Module,
    module: nn.Module,
    names: Mapping[str, str],
    plan: Plan,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    *,
    seed: int = 0,
) -> tuple[VerifyReport, Any]:
    """:func:`verify` of one pipeline stage: ``module`` (sharing ``model``'s submodules, its
    parameters named ``names[plan name]``) on its input ``x``, over the stage's plan
    (``plan.stage_plan(s)``) and its ranks only. Returns the report and the stage's output as the
    step computes it (sharded), for the next stage's check.
    :class:`fsdpfn.runtime.PipelineRuntime` calls it on its first step, stage after stage."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack(), torch._C._DisableFuncTorch(), C.uncounted(), torch.no_grad():
        ck = _Checker(plan, model, {n: _plain(t) for n, t in params.items()}, seed, stage=(module, names))
        ck.keep_output = True
        report = _verify(ck, (_plain(x.detach()),), {})
        return report, ck.output


class _Passthrough(nn.Module):
    """Stands for the model in a pipeline's loss check: its output is the last stage's."""

    def forward(self, x):
        return x


def verify_stage_loss(
    plan: Plan, loss_fn: Callable[[Any, Any], Any], output: torch.Tensor, target: Any, report: VerifyReport, group
) -> None:
    """The loss check ([Note: the loss check] in ``fsdpfn/transforms/_verify_loss.py``) of a
    pipeline's ``loss_fn(output, target)`` on the last stage's first micro-batch, over the last
    stage's ranks (``group``, the process group of ``plan``'s mesh): the mean over the ranks
    that read different data of each rank's loss against the loss of every rank's rows and
    tokens. Comparisons go to ``report``; raises :class:`VerificationError` on every rank of
    ``group``."""
    from fsdpfn.transforms._guards import _Capture

    model = _Passthrough()
    cap = _Capture()
    cap.plan, cap.model, cap.args = plan, model, (output.detach(),)

    def staged(params, out, y):
        return loss_fn(model(out), y)

    with torch.no_grad():
        _loss_check(staged, {}, (output.detach(), target), {}, cap, report, group)


def _verify(ck: _Checker, args, kwargs) -> VerifyReport:
    from fsdpfn.transforms._guards import _STEPS

    from fsdpfn.transforms._guards import check_batch

    plan = ck.plan
    _STEPS.pop(plan.fingerprint, None)  # the check's forwards are not the step the batch check looks at
    if ck.group is None:  # a pipeline checked the whole plan's batch before its first step
        # Peers given different batches would differ below too; the batch check names it better.
        check_batch(plan, args, kwargs, reduce="custom")
    root = plan.unit(ROOT) if any(u.name == ROOT for u in plan.units) else None
    leaves, _ = flatten((list(args), kwargs), none_is_leaf=True)
    first = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 1), None)
    seq = _Seq(plan, first.shape[1] if first is not None else None)
    checked = {
        u.name
        for u in ck.outer
        if plan.cp_size > 1 or any(_split(plan, p.name) for m in _members(plan, u) for p in m.params)
    }
    root_split = root is not None and any(_split(plan, p.name) for p in root.params)
    nothing = not checked and not root_split  # the same arithmetic on both sides: nothing can differ
    if nothing and not ck.keep_output:
        return ck.report

    # ---- 1. sharded: record every unit call's inputs and outputs -------------------------------
    records: list[tuple[str, list, Any, list, Any]] = []
    root_local = _gathered(plan, root, ck.params) if root is not None else {}

    def sharded_call(name, module, orig, a, kw):
        weights: dict[str, torch.Tensor] = {}
        for u in _members(plan, plan.unit(name)):
            weights.update(_gathered(plan, u, ck.params))
        with torch.no_grad():
            out = _run(module, weights, name, a, kw)
        if not nothing:
            ins, in_spec = _floats((list(a), kw))
            outs, out_spec = _floats(out)
            records.append((name, ins, in_spec, outs, out_spec))
        return out

    try:
        with torch.no_grad(), ck.modes.sharded(), _intercept(ck.modules, sharded_call):
            out_sharded = ck.call(root_local, args, kwargs)
    except Exception as e:  # a model that fails under the plan: named on every rank
        ck.problem = f"the model's sharded forward raised {_raised(e)}"
    ck.settle("sharded forward")
    ck.output = out_sharded if ck.keep_output else None
    if nothing:  # a pipeline stage that splits nothing: its output is all that was asked for
        return ck.report
    sharded_outs, _ = _floats(out_sharded)
    del out_sharded

    # ---- 2. reference: the same code with every axis off, checked unit by unit -----------------
    root_global = {n: _global(plan, n, t) for n, t in root_local.items()}
    del root_local
    calls = iter(records)
    counts: dict[str, int] = {}

    def reference_call(name, module, orig, a, kw):
        rec = next(calls, None)
        if rec is None or rec[0] != name:
            ck.problem = (
                f"the model called unit {unit_label(name)!r} where its sharded forward called "
                f"{unit_label(rec[0]) if rec else 'no more units'!r}: its control flow depends on the axis"
            )
            ck.settle(f"unit order {name}")
        assert rec is not None  # settle raised otherwise
        _, ins, in_spec, outs, out_spec = rec
        call = counts[name] = counts.get(name, -1) + 1
        members = [u.name for u in _members(plan, plan.unit(name))]
        here = f"{name}#{call}"
        # The reference's own input (root code between units, unsharded) against the sharded one.
        ref_in, _ = _floats((list(a), kw))
        tokens = max(
            [x.numel() // max(x.shape[-1], 1) for x in ins if isinstance(x, torch.Tensor) and x.dim() > 1] or [1]
        )
        root_bound = _bound(root_global, tokens * seq.size)
        for k, (r, s) in enumerate(zip(ref_in, ins)):
            if isinstance(s, torch.Tensor) and s.is_floating_point():
                ck.compare(
                    ROOT, f"input {k} of unit {unit_label(name)!r} (call {call})", s, seq.part(r, s), root_bound, [ROOT]
                )
        ck.settle(f"{here} input")
        if name not in checked:  # the same arithmetic on both sides: its sharded output stands
            result = unflatten(out_spec, [seq.whole(o) for o in outs])
            return result
        weights_local: dict[str, torch.Tensor] = {}
        for u in members:
            weights_local.update(_gathered(plan, plan.unit(u), ck.params))
        weights_global = {n: _global(plan, n, t) for n, t in weights_local.items()}
        bound = _bound(weights_global, tokens * seq.size)
        problem = None
        try:
            result = _check_unit(
                ck, name, call, module, ins, in_spec, outs, weights_local, weights_global, bound, members, seq
            )
        except VerificationError:
            raise
        except Exception as e:
            problem = f"unit {unit_label(name)!r} raised {_raised(e)} while checked"
            result = None
        if problem is not None and ck.problem is None:
            ck.problem = problem
        ck.settle(f"{here} unit")
        ck.report.units.append(name)
        return result

    try:
        whole_args, whole_kwargs = unflatten(
            flatten((list(args), kwargs), none_is_leaf=True)[1], [seq.whole(x) for x in leaves]
        )
        with torch.no_grad(), ck.modes.unsharded(), _intercept(ck.modules, reference_call):
            out_ref = ck.call(root_global, whole_args, whole_kwargs)
    except VerificationError:
        raise
    except Exception as e:
        if ck.problem is None:
            ck.problem = f"the model's unsharded forward raised {_raised(e)}"
        out_ref = None
    ck.settle("reference forward")
    ref_outs, _ = _floats(out_ref)
    tokens = first.numel() if first is not None else 1
    # The root's own sums, after (at most) the largest unit's.
    bound = _bound(root_global, tokens * seq.size) + max((c.bound for c in ck.report.comparisons), default=0.0)
    if root_split or checked:
        for k, (s, r) in enumerate(zip(sharded_outs, ref_outs)):
            if isinstance(s, torch.Tensor) and s.is_floating_point() and (seq.size == 1 or seq._has(s)):
                ck.compare(
                    ROOT, f"model output {k}", s, _vocab_part(ck.plan, seq.part(r, s), s), bound, [ROOT, *checked]
                )
    ck.settle("outputs")
    return ck.report


def _check_unit(
    ck: _Checker, name, call, module, ins, in_spec, outs, weights_local, weights_global, bound, members, seq: _Seq
):
    """Unit ``name`` on the sharded input: the sharded forward again (with autograd) and the
    reference on the whole weights and sequences; outputs, input cotangents, parameter gradients."""
    plan = ck.plan
    # sharded, with autograd
    xs = [_leaf(x) if isinstance(x, torch.Tensor) else x for x in ins]
    wl = {n: _leaf(t) for n, t in weights_local.items()}
    with torch.enable_grad(), ck.modes.sharded():
        a, kw = unflatten(in_spec, xs)
        got = flatten(_run(module, wl, name, a, kw))[0]
    # reference
    xr = [_leaf(seq.whole(x)) if isinstance(x, torch.Tensor) else x for x in ins]
    wg = {n: _leaf(t) for n, t in weights_global.items()}
    with torch.enable_grad(), ck.modes.unsharded():
        a, kw = unflatten(in_spec, xr)
        want, want_spec = flatten(_run(module, wg, name, a, kw))
    # Under cp an output without the sequence dim (a loss over this rank's tokens, an MoE layer's
    # load-balancing loss) is what the model defines per rank: the whole sequence's differs by
    # design, so it is neither compared nor differentiated.
    compared = [isinstance(s, torch.Tensor) and s.is_floating_point() and (seq.size == 1 or seq._has(s)) for s in got]
    for k, (s, r) in enumerate(zip(got, want)):
        if compared[k]:
            ck.compare(name, f"output {k} (call {call})", s.float(), seq.part(r.float(), s), bound, members)
    # the VJP for one random cotangent, the same on the peers that must agree
    ct = [ck.cotangent(s, name, call, k, seq) if compared[k] else None for k, s in enumerate(got)]
    ct_whole = [seq.whole(c) if c is not None else None for c in ct]
    x_sh = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    x_ref = [x for x in xr if isinstance(x, torch.Tensor) and x.requires_grad]
    names = list(wl)
    with torch.enable_grad(), ck.modes.sharded():
        g_sh = _grads(got, ct, [*(wl[n] for n in names), *x_sh])
    with torch.enable_grad(), ck.modes.unsharded():
        g_ref = _grads(want, ct_whole, [*(wg[n] for n in names), *x_ref])
    n = len(names)
    for k, (s, r) in enumerate(zip(g_sh[n:], g_ref[n:])):
        if s is not None or r is not None:
            s = torch.zeros_like(x_sh[k]) if s is None else s
            r = torch.zeros_like(x_ref[k]) if r is None else r
            ck.compare(name, f"cotangent of input {k} (call {call})", s, seq.part(r, s), bound, members)
    cp = cp_group(plan) if plan.cp_size > 1 else None
    for p, s, r in zip(names, g_sh[:n], g_ref[:n]):
        s = torch.zeros_like(wl[p]) if s is None else s.detach()
        r = torch.zeros_like(wg[p]) if r is None else r.detach()
        if cp is not None:  # each cp rank holds its own tokens' part of the gradient
            s = s.contiguous()
            C.all_reduce(s, cp, tag="verify")
        spec = plan.param(p)
        if Role.EP in split_roles(spec) and plan.ep_size > 1:
            # ep ranks are data-parallel too: an expert's weight gradient on the rank holding it
            # sums every ep rank's tokens routed to it, one process's gradient over their batches.
            r = r.contiguous()
            C.all_reduce(r, _axis_group(plan, Role.EP), tag="verify")
        ck.compare(
            name, f"gradient of {p!r} (call {call})", s, local_part(spec, r, axis_index(plan, spec)), bound, members
        )
    # The reference goes on from here with its own (whole-sequence) outputs.
    return unflatten(want_spec, [w.detach() if isinstance(w, torch.Tensor) else w for w in want])


def verify_step(
    loss_fn: Callable[..., Any], params: Mapping[str, torch.Tensor], *args: Any, seed: int = 0, **kwargs: Any
) -> VerifyReport | None:
    """:func:`verify` for the step ``loss_fn(params, *args, **kwargs)`` takes, and the step's loss
    against the loss function on the whole batch. The loss function runs (without autograd) up
    to its model's forward, which is where the model, the plan, the shards and the batch are
    found (:func:`fsdpfn.unshard` notes the plan, the shards and the gradient reduction, the
    model's root hook from :func:`fsdpfn.shard` the model and its inputs); :func:`verify` runs
    on them. Then the loss the step trains (each rank's loss, reduced over the ranks that read
    different data as ``unshard``'s ``grad_op`` says) and its gradient for the model's outputs
    are compared with the loss function on every rank's rows and tokens gathered
    ([Note: the loss check] in ``fsdpfn/transforms/_verify_loss.py``): a loss that is a mean
    over each rank's counted tokens is named here. :func:`fsdpfn.compile` calls it on its
    first step.

    Returns:
      the :class:`VerifyReport`, or ``None`` when the loss function reached no model carrying a
      plan's hooks (nothing could be compared).

    Example:
      >>> def loss_fn(params, x, y):
      ...     logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
      ...     return F.cross_entropy(logits.flatten(0, 1), y.flatten())
      >>> fsdpfn.verify_step(loss_fn, params, x, y).ok
      True
    """
    return verify_captured(loss_fn, params, args, kwargs, capture_step(loss_fn, params, args, kwargs), seed=seed)


def verify_captured(loss_fn, params, args, kwargs, cap, *, seed: int = 0) -> VerifyReport | None:
    """:func:`verify_step`'s checks on what :func:`capture_step` found for that step."""
    if cap.model is None or cap.plan is None:
        return None
    with _ambient.restored(cap.cp):  # the loss function's own context_parallel block, if any
        report = verify(cap.model, cap.plan, cap.params, *cap.args, seed=seed, **cap.kwargs)
        _loss_check(loss_fn, params, args, kwargs, cap, report)
    return report


def _loss_check(loss_fn, params, args, kwargs, cap, report: VerifyReport, group=None) -> None:
    from fsdpfn.transforms._verify_loss import check_loss, describe_mismatch

    problem: list = []

    def compare(what, step, one, bound):
        err = _relative(step, one) if step.shape == one.shape else math.inf
        c = Comparison("loss", what, err, bound)
        report.comparisons.append(c)
        if err > bound and not problem:
            values = (float(step), float(one)) if step.dim() == 0 else (math.nan, math.nan)
            detail = "" if step.dim() == 0 or step.shape != one.shape else f"; {_worst(step, one)}"
            problem.append((describe_mismatch(cap.plan, cap.grad_op, what, *values, err, bound) + detail, c))

    from fsdpfn.transforms._guards import _STEPS

    with C.uncounted():
        try:
            check_loss(loss_fn, params, args, kwargs, cap, compare, report.notes.append, group)
        except Exception as e:  # named on every rank, like the unit check's failures
            problem.append((f"the loss check raised {_raised(e)}", None))
        finally:
            # The loss function's unshard noted a step that its (replaced) model never ran: no
            # later forward may take it for its own (nor a compiled one guard on it).
            _STEPS.pop(cap.plan.fingerprint, None)
    found = C.exchange_problems(f"verify loss {cap.plan.fingerprint}", problem[0][0] if problem else None, group)
    if found:
        first = min(found)
        raise VerificationError(
            f"fsdpfn.verify: the sharded step does not train what one process trains. On rank {first}: {found[first]}. "
            "(Pass verify=False to skip this check.)",
            problem[0][1] if problem else None,
        )
