"""Mistakes that only show while a step runs, turned into errors on every rank.

[Note: tp collectives need the hooked instance]
A plan's tensor-parallel activation collectives are forward hooks on the modules of one model
instance (:func:`fsdpfn.apply_tp`). ``functional_call`` on another instance of the same class,
or on a model whose parameters were sharded from a dict (``fsdpfn.shard(model.state_dict(),
plan)``), runs the split weights without the all-reduces: every tp rank computes its own
partial answer, with no error. So every eager :func:`fsdpfn.unshard` of a tp plan notes which of
its output tensors are tp-split weights (by identity, held weakly), and a global module forward
pre-hook, installed the first time a tp plan is unshard, looks at the parameters of each module
about to run: a module running a noted weight must carry this plan's hooks, else every rank
raises (agreed through the store the first time, see [Note: agreeing through the store]) before
the layer runs. One dict lookup per parameter per module call; nothing at all while dynamo traces
(a compiled step builds its collectives from the same hooks, traced, so the instance it runs is
the one checked by the eager steps before it, if any).

[Note: checking the batch]
Two batch mistakes give wrong gradients with no error: tensor-parallel peers given different
rows (a batch indexed by the global rank instead of :func:`fsdpfn.transforms.dp_rank`: the tp
all-reduces then add up parts of different examples), and data-parallel ranks given different
numbers of rows (the reduce averages per-rank means, which weighs the rows of the smaller batch
more). A forward pre-hook on the root module (installed with the tp hooks, for every plan)
exchanges, on the first :data:`CHECKED_STEPS` sharded steps of that model, each rank's dp index,
the shape of the first tensor argument and two float64 sums of it, through the store: no
collective, so collective counts and the cost model are untouched. Two steps, not one: a loop
often opens with a step on a fixed batch (a warm-up, a compile, the same example everywhere);
the second is the first from the loader. Later steps are not checked (each check is a round trip
to the store for every rank), so a short last batch of an epoch is the loader's business: drop
it (``drop_last=True``) or reduce with ``grad_op="sum"``.

[Note: a fused layout split plainly]
``colwise`` hands each tp rank a contiguous block of a Linear's output features: whole heads of
a head-major ``qkv``. A fused projection whose parts lie side by side (HF GPT-2's q | k | v,
a fused gate | up) needs ``colwise_fused:k`` (each rank a slice of every part); split plainly,
rank 0 gets all of q and half of k and the step trains, wrong. The weights look the same either
way; what tells them apart is the forward: a fused layout's output is cut into its parts along
the last dimension (``chunk``, ``split``, ``tensor_split``), a head-major one is viewed into
heads. So on the first :data:`CHECKED_STEPS` forwards of a model with a ``colwise`` layer, a
torch function mode (entered by a root pre-hook, left by a root hook that runs even when the
forward raises; again inside each runtime unit's autograd Function, whose forward runs without
its caller's modes) watches the outputs of its colwise layers, noted by identity by a forward hook
on each, and raises on the first cut of one along its last dimension, naming the layer and the
``colwise_fused:k`` to use. Every rank runs the same forward, so every rank raises there; later
steps run without the mode.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Mapping, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdpfn import _ambient
from fsdpfn import comm as C
from fsdpfn._plan.axes import Role
from fsdpfn._plan.placements import split_roles
from fsdpfn._plan.tp_styles import tp_style
from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn.transforms._axes import cp_rank, dp_rank
from fsdpfn.transforms._checks import check_on_every_rank

__all__ = [
    "Captured",
    "capturing",
    "note_capture",
    "CHECKED_STEPS",
    "StepChecks",
    "TP_ATTR",
    "check_batch",
    "check_step_batch",
    "install_batch_check",
    "install_split_watch",
    "note_step",
    "note_unshard",
    "watch_output",
    "cut_watch",
]

TP_ATTR = "_fsdpfn_tp"
_BATCH_ATTR = "_fsdpfn_batch"
CHECKED_STEPS = 2

# Process state: keyed by plan (the pure path's step is a function call with no object of its own
# to carry it): id(tensor) -> (weakref to it, plan, module name), the tp-split weights of each
# plan's last unshard; and the one forward pre-hook, process-wide as torch's global hooks are.
_SPLIT: dict[int, tuple[Any, Plan, str]] = {}
_BY_PLAN: dict[str, list[int]] = {}
_GLOBAL_HOOK: list = []
# Process state: plan fingerprint -> how the step reduces ("mean", or "custom" for grad_op/grad_scale), set by
# the step's unshard and consumed by the root hook: only sharded steps are checked.
_STEPS: dict[str, str] = {}


class Captured(Exception):
    """Stops a forward whose model, plan, shards and batch :func:`capturing` was after."""


class _Capture:
    def __init__(self):
        self.plan = self.params = self.model = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.cp: tuple = ()  # the cp axes active at the forward
        self.grad_op, self.grad_scale = "mean", None  # the reduction the loss function's unshard asked for
        # While the loss check re-runs the loss function (with the model's forward replaced): the
        # root hook steps aside, neither capturing nor checking the batch.
        self.inert = False


# Process state: the capture a loss function's first call runs under (fsdpfn.verify_step): eager unshard notes the
# plan and shards, the model's root pre-hook the model and batch, and stops the forward. A list,
# not a ContextVar: the root hook is traced under torch.compile, which cannot trace ContextVar.get.
_CAPTURE: list[_Capture | None] = [None]


@contextlib.contextmanager
def capturing():
    """Inside the block, the first model forward that follows an eager :func:`fsdpfn.unshard`
    raises :class:`Captured` before it runs; the yielded value then holds the plan, the shards,
    the model and its inputs."""
    cap = _Capture()
    saved, _CAPTURE[0] = _CAPTURE[0], cap
    try:
        yield cap
    finally:
        _CAPTURE[0] = saved


def note_capture(plan: Plan, params, grad_op: str = "mean", grad_scale: float | None = None) -> None:
    """Called by eager :func:`fsdpfn.unshard`: the plan, shards and gradient reduction a capture is after."""
    cap = _CAPTURE[0]
    if cap is not None and not cap.inert:
        cap.plan, cap.params, cap.grad_op, cap.grad_scale = plan, params, grad_op, grad_scale


class StepChecks:
    """[Note: the checks of a step]
    What every step machine checks as a step starts, as one value it holds: the model's root
    hook (the pure loop's and :class:`fsdpfn.runtime.Runtime`'s step is the model's forward),
    :class:`fsdpfn.runtime.PipelineRuntime` and :func:`fsdpfn.compile`'s step each make one, so
    a new step machine gets the same checks by holding one:

    - the batch, on the first :data:`CHECKED_STEPS` steps (:meth:`batch_due`): peers that must
      read the same inputs read them, data-parallel ranks read batches of one size
      (:func:`check_batch`; see [Note: checking the batch]);
    - the plan against the same code unsharded, on the first training step (:meth:`verify_due`,
      built with ``verify=True``: :func:`fsdpfn.verify`).

    The replay check of a rematerialised unit runs inside its recompute, which every step
    machine installs with the plan's remat policy (:func:`fsdpfn.transforms.apply_remat`).

    Example:
      >>> checks = StepChecks(verify=True)
      >>> [checks.verify_due() for _ in range(2)], [checks.batch_due() for _ in range(3)]
      ([True, False], [True, True, False])
    """

    def __init__(self, *, verify: bool = True, batches: int = CHECKED_STEPS):
        self.verify_left = bool(verify)
        self.batches_left = int(batches)

    def batch_due(self) -> bool:
        """Whether this step checks its batch (the first ``batches`` calls say so)."""
        if self.batches_left <= 0:
            return False
        self.batches_left -= 1
        return True

    def verify_due(self) -> bool:
        """Whether this step is checked against the unsharded code (the first call says so)."""
        due, self.verify_left = self.verify_left, False
        return due


def check_step_batch(loss_fn, params, args=(), kwargs=None) -> None:
    """:func:`check_batch` for the step ``loss_fn(params, *args, **kwargs)`` takes, where the
    model's forward is not where the step's checks can run (a compiled step): the loss function
    runs without autograd up to its model's forward, where the plan, its gradient reduction and
    the model's inputs are found (as :func:`fsdpfn.verify_step` finds them), and the batch is
    checked as the model's root hook checks an eager step's. Its gathers are not counted. A loss
    function that reaches no model carrying a plan's hooks has nothing to check.
    :func:`fsdpfn.compile` calls it on its first :data:`CHECKED_STEPS` steps.

    Example:
      >>> def loss_fn(params, x, y):
      ...     logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
      ...     return F.cross_entropy(logits.flatten(0, 1), y.flatten())
      >>> fsdpfn.transforms.check_step_batch(loss_fn, params, (x, y))  # every rank passes
    """
    check_captured_batch(capture_step(loss_fn, params, args, kwargs))


def capture_step(loss_fn, params, args=(), kwargs=None) -> _Capture:
    """Runs ``loss_fn(params, *args, **kwargs)`` without autograd and uncounted, up to its
    model's forward, and returns what it found there: the plan, the shards and the gradient
    reduction (noted by eager :func:`fsdpfn.unshard`), the model and its inputs (noted by the
    model's root hook). Both :func:`check_step_batch` and :func:`fsdpfn.verify_step` start with
    it; a compiled step whose first call runs both captures once."""
    with capturing() as cap, C.uncounted(), torch.no_grad():
        try:
            loss_fn(params, *args, **(kwargs or {}))
        except Captured:
            pass
    if cap.plan is not None:
        _STEPS.pop(cap.plan.fingerprint, None)  # noted by the capture's unshard: not a step of the model's
    return cap


def check_captured_batch(cap: _Capture) -> None:
    """:func:`check_batch` on a :func:`capture_step`'s batch (nothing when it found no model
    carrying a plan's hooks)."""
    if cap.model is None or cap.plan is None:
        return
    reduce = "mean" if cap.grad_op == "mean" and cap.grad_scale is None else "custom"
    with _ambient.restored(cap.cp), torch.enable_grad():  # the step computes gradients
        check_batch(cap.plan, cap.args, cap.kwargs, reduce=reduce)


def note_step(plan: Plan, reduce: str = "mean") -> None:
    """Marks that a sharded step of ``plan`` starts (its parameters were just gathered), so the
    next forward of a model carrying the plan's batch check checks its batch."""
    _STEPS[plan.fingerprint] = reduce


def note_unshard(plan: Plan, full: Mapping[str, torch.Tensor], reduce: str) -> None:
    """Called by every eager :func:`fsdpfn.unshard`: notes the step, and, for a tp plan, which
    of ``full``'s tensors are tp-split weights (see [Note: tp collectives need the hooked instance])."""
    note_step(plan, reduce)
    if not plan.tp:
        return
    for key in _BY_PLAN.pop(plan.fingerprint, ()):
        _SPLIT.pop(key, None)
    modules = {name for name, _ in plan.tp}
    keys = []
    for name, t in full.items():
        module = name.rpartition(".")[0]
        if module in modules and Role.TP in split_roles(plan.param(name)):
            _SPLIT[id(t)] = (weakref.ref(t), plan, module)
            keys.append(id(t))
    _BY_PLAN[plan.fingerprint] = keys
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(nn.modules.module.register_module_forward_pre_hook(_check_module))


def _check_module(module: nn.Module, args) -> None:
    # compiling() first: under dynamo, reading _SPLIT would guard the compiled graph on its keys
    # (ids of the last eager unshard's tensors), a recompile at every step that changes them.
    if C.compiling() or not _SPLIT:
        return
    for t in module._parameters.values():
        entry = _SPLIT.get(id(t)) if t is not None else None
        if entry is not None and entry[0]() is t:
            _, plan, name = entry
            check_on_every_rank(plan, "tp collectives", None, lambda: _check_hooks(module, plan, name))
            return


def _check_hooks(module: nn.Module, plan: Plan, name: str) -> None:
    installed = getattr(module, TP_ATTR, None)
    if installed is not None and installed[0] == plan.fingerprint and installed[1] is plan.mesh:
        return
    why = (
        "carries the tensor-parallel hooks of another plan"
        if installed is not None
        else "carries no tensor-parallel hooks: it is another instance than the one the plan's hooks were installed on, "
        "or its parameters were sharded from a dict"
    )
    raise ValueError(
        f"module {name!r} ({type(module).__name__}) is running this rank's tensor-parallel part of its weight, but it {why}; "
        "without its all-reduce every tp rank computes a different, wrong result. Call fsdpfn.apply_tp(model, plan) on "
        "the model you run (fsdpfn.shard(model, plan), init_shards and load_safetensors do it when given the model)"
    )


def install_batch_check(model: nn.Module, plan: Plan | PipelinedPlan) -> None:
    """Installs (or replaces) the root forward pre-hook of [Note: checking the batch] on ``model``."""
    installed = getattr(model, _BATCH_ATTR, None)
    if installed is not None:
        if installed[0] == plan.fingerprint and installed[1] is plan.mesh:
            return
        installed[2].remove()
        delattr(model, _BATCH_ATTR)
    if plan.mesh is None:
        return
    _STEPS.pop(plan.fingerprint, None)  # a step noted before this model had its hook is not its step
    checks = StepChecks(verify=False)  # the model's steps: see [Note: the checks of a step]

    def hook(module, args, kwargs):
        cap = None if C.compiling() else _CAPTURE[0]  # compiling() first: dynamo guards on what it reads
        if cap is not None and cap.inert:
            return None
        if cap is not None and cap.plan is not None:
            cap.model, cap.args, cap.kwargs, cap.cp = module, args, kwargs, _ambient.snapshot()
            raise Captured()
        step = _STEPS.pop(plan.fingerprint, None)
        if step is not None and plan.cp_size > 1 and not _ambient.CP_STACK and not C.compiling():
            raise ValueError(
                f"a forward of the cp plan (cp={plan.cp_size}: each rank holds 1/{plan.cp_size} of every sequence) runs outside "
                "`with fsdpfn.context_parallel(plan):`, so its attention would see only this rank's tokens (a validation "
                "loss too). Run every sharded forward of the plan inside the block, with the batch split by "
                "fsdpfn.context_parallel_shard"
            )
        if step is None or C.compiling() or not checks.batch_due():
            return None
        check_batch(plan, args, kwargs, reduce=step)
        return None

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(model, _BATCH_ATTR, (plan.fingerprint, plan.mesh, handle))


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def fingerprint(x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """``x``'s shape and two sums, a float64 tensor of 2 on ``x``'s device (no sync): the plain
    sum, and one weighted by position, cycling so the sum stays exact for token ids, which
    tells a permutation apart."""
    with torch._C._DisableFuncTorch(), torch.no_grad():
        flat = C.full_tensor(x.detach()).reshape(-1).double()
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(1021).add_(1)
        sums = torch.stack([flat.sum(), flat.dot(weights)]) if flat.numel() else flat.new_zeros(2)
    return list(x.shape), sums


def _describe(x) -> list | None:
    """A tensor (or its :func:`fingerprint`) as ``[shape, sum, weighted sum]``."""
    if x is None:
        return None
    shape, sums = x if isinstance(x, tuple) else fingerprint(x)
    return [shape, *(float(v) for v in sums.tolist())]


def check_batch(plan: Plan | PipelinedPlan, args=(), kwargs=None, *, reduce: str = "mean", whole: bool = False) -> None:
    """Raises ``ValueError`` on every rank if tensor-parallel peers were given different inputs,
    or (in a step that computes gradients and averages them) data-parallel ranks were given
    batches with different numbers of rows (see [Note: checking the batch]), or the cp peers of
    one data-parallel index cut different batches with :func:`fsdpfn.context_parallel_shard`
    (see [Note: cp peers cut the same sequences]). ``whole=True``: the inputs are the whole
    sequences, which every rank of a data-parallel index must be given alike (a pipeline's).
    Every rank of the plan's mesh must call it at the same point; it runs no collective.

    Example:
      >>> fsdpfn.transforms.check_batch(plan, (x,))  # every rank passes
    """
    x = _first_tensor(args, kwargs or {})
    # cp ranks hold different parts of the same sequences: peers are the ranks at one (dp, cp)
    # index, unless the inputs are the whole sequences (a pipeline cuts them itself).
    cp = 0 if whole else cp_rank(plan)
    cut = (
        [_describe(f) for f in _ambient.LAST_CUT[0]]
        if plan.cp_size > 1 and not whole and _ambient.LAST_CUT[0]
        else None
    )
    if plan.cp_size > 1 and not whole:
        _ambient.LAST_CUT[0] = None  # each cut is checked once: never a later step's stale one
    mine = [[dp_rank(plan), cp], _describe(x), bool(torch.is_grad_enabled()) and reduce == "mean", cut]
    table = cast("dict[int, list]", C.exchange_values(f"batch of plan {plan.fingerprint}", mine, None))
    by_dp: dict[tuple, list[int]] = {}
    for r in sorted(table):
        by_dp.setdefault(tuple(table[r][0]), []).append(r)
    for (dp, cp), ranks in sorted(by_dp.items()):
        seen = [table[r][1] for r in ranks]
        if any(s != seen[0] for s in seen):
            inputs = ", ".join(f"rank {r}: {_show(table[r][1])}" for r in ranks)
            where = f"data-parallel index {dp}" + (
                f", context-parallel index {cp}" if plan.cp_size > 1 and not whole else ""
            )
            peers = "peers of one data-parallel index" if whole else "tensor-parallel peers"
            raise ValueError(
                f"ranks {ranks} are {peers} ({where}) but were given different inputs ({inputs}); "
                "the tp all-reduces would add up parts of different examples. Index the batch by "
                "fsdpfn.transforms.dp_rank(plan) (one slice of plan.dp_size), not by the global rank"
            )
    # [Note: cp peers cut the same sequences]
    # Each cp rank keeps its part of every sequence of its data-parallel slice, so what the cp
    # peers of one data-parallel index were given differs by design, and nothing computed later
    # can tell a wrong slice apart (a mix of two slices' chunks is a sequence too). What they
    # cut must agree: context_parallel_shard notes what it was given, and the peers compare.
    cuts: dict[int, list[int]] = {}
    for r in sorted(table):
        if table[r][3] is not None:
            cuts.setdefault(table[r][0][0], []).append(r)
    for dp, ranks in sorted(cuts.items()):
        if len(ranks) > 1 and any(table[r][3] != table[ranks[0]][3] for r in ranks):
            given = ", ".join(f"rank {r}: {_show(table[r][3][0] if table[r][3] else None)}" for r in ranks)
            raise ValueError(
                f"ranks {ranks} are context-parallel peers (data-parallel index {dp}): each keeps its part of the same "
                f"sequences, but fsdpfn.context_parallel_shard was given different batches ({given}), so their parts belong "
                "to different sequences. Index the batch by fsdpfn.transforms.dp_rank(plan) (one slice of plan.dp_size), "
                "not by the global rank, then cut it with context_parallel_shard on every cp rank"
            )
    rows = {r: (table[r][1][0][0] if table[r][1] and table[r][1][0] else None) for r in table}
    if all(table[r][2] for r in table) and len({rows[r] for r in table}) > 1:
        listed = ", ".join(f"rank {r}: {rows[r]}" for r in sorted(table))
        raise ValueError(
            f"the data-parallel ranks were given batches of different sizes (rows of the first input: {listed}); the "
            "gradient is the mean over ranks of each rank's mean, which weighs the rows of the smaller batches more than "
            "one process would. Give every rank the same number of rows (e.g. drop the last partial batch: "
            "DataLoader(..., drop_last=True)), or reduce with fsdpfn.unshard(..., grad_op='sum', grad_scale=1 / global rows) "
            "and a summed loss"
        )


def _show(d) -> str:
    return "no tensor" if d is None else f"shape {tuple(d[0])}, sum {d[1]:g}"


# ---- [Note: a fused layout split plainly] ------------------------------------------------------

_SPLIT_WATCH_ATTR = "_fsdpfn_split_watch"
# Process state: while a checked forward runs, id(output) -> (weakref to it, the colwise
# module's name), its outputs; and the watch itself.
_OUTPUTS: dict[int, tuple[Any, str]] = {}
_MODE: list[TorchFunctionMode] = []  # the watch while a checked forward runs
_CUTS = {
    torch.Tensor.chunk: "chunk",
    torch.chunk: "chunk",
    torch.Tensor.split: "split",
    torch.split: "split",
    torch.Tensor.tensor_split: "tensor_split",
    torch.tensor_split: "tensor_split",
}


def _parts(how: str, t: torch.Tensor, what: Any, dim: int) -> int:
    if isinstance(what, int):
        return -(-t.shape[dim] // what) if how == "split" else what
    return len(what) + (1 if how == "tensor_split" else 0)


class _CutWatch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        how = _CUTS.get(func) if _OUTPUTS else None
        if how is not None and args and isinstance(args[0], torch.Tensor):
            entry = _OUTPUTS.get(id(args[0]))
            t = args[0]
            if entry is not None and entry[0]() is t and t.dim():
                dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
                what = kwargs.get(
                    "chunks",
                    kwargs.get(
                        "split_size_or_sections", kwargs.get("indices_or_sections", args[1] if len(args) > 1 else 1)
                    ),
                )
                parts = _parts(how, t, what, dim % t.dim())
                if dim % t.dim() == t.dim() - 1 and parts > 1:
                    _refuse_fused(entry[1], how, parts)
        return func(*args, **kwargs)


def _refuse_fused(name: str, how: str, parts: int) -> None:
    from fsdpfn._plan.tp_layout import _pattern

    raise ValueError(
        f"tp splits {name!r} 'colwise', which gives each tp rank a contiguous block of its output features (whole heads of a "
        f"head-major layout), but the model cuts that output into {parts} parts along its last dimension ({how}): the "
        "layout of a fused projection whose parts lie side by side (q | k | v, gate | up). Split plainly, each rank gets "
        "whole parts instead of its slice of every part, and trains wrong with no error. Split it "
        f"tp={{{_pattern(name)!r}: 'colwise_fused:{parts}'}} (see docs/tour/tensor-parallel.md)"
    )


def watch_output(name: str):
    """A forward hook for the colwise layer ``name``: notes its output while a checked forward runs."""

    def hook(module, args, output):
        if _MODE and isinstance(output, torch.Tensor):
            _OUTPUTS[id(output)] = (weakref.ref(output), name)
        return None

    return hook


def cut_watch():
    """The watch again where the modes around it are off: an autograd Function's forward (a
    runtime unit's) runs without the torch function modes of its caller."""
    return _CutWatch() if _MODE else contextlib.nullcontext()


def _leave_watch() -> None:
    _OUTPUTS.clear()
    while _MODE:
        _MODE.pop().__exit__(None, None, None)


def install_split_watch(model: nn.Module, plan: Plan | PipelinedPlan) -> None:
    """Installs (or removes) the root hooks of [Note: a fused layout split plainly] on ``model``:
    only a plan with a plain ``colwise`` layer needs them."""
    installed = getattr(model, _SPLIT_WATCH_ATTR, None)
    if installed is not None:
        if installed[0] == plan.fingerprint and installed[1] is plan.mesh:
            return
        for handle in installed[2]:
            handle.remove()
        delattr(model, _SPLIT_WATCH_ATTR)
    # Only a plain colwise split (one part, its output left split) can cut a fused layout wrong.
    if not any(
        (row := tp_style(style)) is not None and row.gives == "split" and row.parts == 1 for _, style in plan.tp
    ):
        return
    left = [CHECKED_STEPS]

    def enter(module, args):
        _leave_watch()  # a forward that raised before its root hook ran
        if C.compiling() or not left[0]:  # compiling() first: see _check_module
            return None
        left[0] -= 1
        mode = _CutWatch()
        mode.__enter__()
        _MODE.append(mode)
        return None

    def leave(module, args, output):
        _leave_watch()
        return None

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    setattr(model, _SPLIT_WATCH_ATTR, (plan.fingerprint, plan.mesh, handles))
