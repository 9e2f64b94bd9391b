"""What a model computes in one step, per stretch of the runtime's schedule: a :class:`Workload`.

[Note: work between events]
The runtime runs a unit's compute between two events of its schedule (see
``fsdpfn.runtime.Schedule``): ``forward u`` .. ``forward_done u`` is u's forward,
``backward u`` .. ``backward_done u`` its backward, and the root's own compute fills the gaps
(the embedding after ``forward <root>``, the head after the last ``forward_done``, the loss
after ``forward_done <root>``, its backward after ``backward <root>``, the embedding's backward
after the last ``backward_done``). A workload therefore maps each *event* to the :class:`Work`
that runs after it, until the next event; that keying survives any edit of a schedule's
actions, since the runtime fixes the order of events (the model's own order).

:func:`profile` fills it by running the model once, forward, loss and backward, under a
dispatch mode that sees every operator: matmul-like operators (those
``torch.utils.flop_counter`` has a formula for, and the CPU flash-attention kernels) with their
FLOPs and bytes, every other operator with the bytes it reads and writes, and
``torch.utils.module_tracker.ModuleTracker`` to say which unit is running. On the meta device
nothing is computed, so an 8B or 70B model profiles in seconds.

[Note: tensor parallel]
Under a plan with a ``tp`` axis every rank runs the layers ``tp=`` splits on its own part of
their weights (the runtime hands each rank its tp-local weights and a model infers head counts
from its tensors): :func:`profile` does the same, running the model with each split weight's
tp-local shape, so the matmuls of a colwise or rowwise ``nn.Linear`` count ``1/tp`` of their
FLOPs, attention runs ``heads/tp`` heads, and the activations between a colwise and a rowwise
layer are ``1/tp`` wide, as on one rank of the step. A ``colwise_gather`` output is widened back
by a copy (the all-gather's unpacking). The activation collectives themselves are not compute:
the simulator times them from :func:`fsdpfn.step_collectives`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn._plan.attention import CP_STRATEGIES, AttentionCall, sequence_parts
from fsdpfn._flops import op_flops, rate_key, tensors_of
from fsdpfn._remat import SaveMode
from fsdpfn._plan.schedule import Op, OpKind
from fsdpfn._plan.tp_styles import one_tp_rank

__all__ = ["Work", "Workload", "count_work", "profile"]

ROOT = ""


@dataclasses.dataclass(frozen=True)
class Work:
    """Compute of one stretch of a step on one rank.

    Attributes:
      matmuls: ``(rate, flops, bytes, count)`` per distinct matmul-like operator: each takes
        ``Hardware.kernel_seconds(rate, flops, bytes)`` (without a kernel model
        ``max(flops / Hardware.flops(rate), bytes / memory bandwidth)``); ``rate`` is the dtype
        (``"bfloat16"``), or ``"attention <dtype>"`` for fused attention kernels.
      bytes: bytes read and written by every other operator (memory-bound).
      ops: operators dispatched (each pays ``Hardware.op_overhead``).
      measured: seconds this work's operators took when profiled with ``timed=True`` on the
        device being simulated; when set, :meth:`seconds` uses it (plus ``ops *
        Hardware.op_overhead``) instead of the FLOP and byte model. Only meaningful with that
        device's hardware.

    Example:
      >>> w = Work(matmuls=(("float32", 2e9, 1e6, 1),), bytes=4e8, ops=10)
      >>> round(w.seconds(fsdpfn.sim.Hardware("toy", {"float32": 1e11}, 1e10, 2**30, 1, fsdpfn.sim.Link(0, 1e9), fsdpfn.sim.Link(0, 1e9))), 3)
      0.06
    """

    matmuls: tuple[tuple[str, float, float, int], ...] = ()  # (rate key, flops, bytes, count)
    bytes: float = 0.0
    ops: int = 0
    measured: float | None = None

    @property
    def flops(self) -> float:
        return sum(f * c for _, f, _, c in self.matmuls)

    def seconds(self, hw) -> float:
        if self.measured is not None:  # the kernels' own time; the framework's per-operator cost on top
            return self.measured + self.ops * hw.op_overhead
        # Hardware prices each kernel (its kernel model, or the plain roofline without one).
        mm = sum(c * hw.kernel_seconds(d, f, b) for d, f, b, c in self.matmuls)
        return mm + hw.memory_seconds(self.bytes) + self.ops * hw.op_overhead

    def __add__(self, other: "Work") -> "Work":
        counts: collections.Counter = collections.Counter()
        for d, f, b, c in self.matmuls + other.matmuls:
            counts[(d, f, b)] += c
        measured = None if self.measured is None or other.measured is None else self.measured + other.measured
        if not self:
            measured = other.measured
        elif not other:
            measured = self.measured
        return Work(
            tuple((d, f, b, c) for (d, f, b), c in sorted(counts.items())),
            self.bytes + other.bytes,
            self.ops + other.ops,
            measured,
        )

    def minus(self, other: "Work") -> "Work":
        """This work without ``other`` (a part of it: the same operators, counted once each)."""
        counts = collections.Counter({(d, f, b): c for d, f, b, c in self.matmuls})
        for d, f, b, c in other.matmuls:
            if counts[(d, f, b)] < c:
                raise ValueError(f"Work.minus: {c} x {d} matmul of {f:g} FLOPs is not part of this work")
            counts[(d, f, b)] -= c
        if self.measured is None:
            measured = None
        elif other.measured is not None:
            measured = max(0.0, self.measured - other.measured)
        else:  # the part's own time was not measured: take its share of the FLOPs (matmuls dominate timed stretches)
            measured = self.measured * (1.0 - other.flops / self.flops) if self.flops else self.measured
        return Work(
            tuple((d, f, b, c) for (d, f, b), c in sorted(counts.items()) if c),
            max(0.0, self.bytes - other.bytes),
            max(0, self.ops - other.ops),
            measured,
        )

    def times(self, k: int) -> "Work":
        """``k`` copies of this work."""
        return Work(
            tuple((d, f, b, c * k) for d, f, b, c in self.matmuls),
            self.bytes * k,
            self.ops * k,
            None if self.measured is None else self.measured * k,
        )

    def __bool__(self) -> bool:
        return bool(self.matmuls or self.bytes or self.ops or self.measured)

    def unmeasured(self) -> "Work":
        """The same work, costed by the FLOP and byte model."""
        return dataclasses.replace(self, measured=None)


EMPTY = Work()


@dataclasses.dataclass(frozen=True)
class Workload:
    """One micro-batch's compute on one rank, keyed by schedule event (see [Note: work between
    events]), and the activation memory each unit's forward saves for its backward.

    Attributes:
      work: ``((event Op, Work), ...)``: the work that runs after each event.
      activations: ``((unit, bytes), ...)``: saved for backward during the unit's forward,
        released when its backward is done (the root's at the end).
      tokens: tokens per rank per micro-batch (informative).
      inputs: ``((unit, bytes), ...)``: each unit's tensor inputs, what a rematerialised unit
        keeps (as the runtime's ``StepRecord.kept_bytes`` counts them).
      kept: ``((unit, policy, bytes, Work), ...)``: what each selective remat policy profiled
        keeps of a unit's forward (bytes) and the work it saves the recompute.
      remat: ``((unit, policy), ...)``: the policies :meth:`with_remat` applied to ``work`` and
        ``activations`` (``profile`` applies the plan's).
      transient: ``((event Op, bytes), ...)``: the most bytes the work after each event holds at
        once besides the saved activations and the parameters' gradients (see [Note: transient
        memory]): the simulator adds it to what is live while that work runs.
      attention: every attention call the step made (:class:`fsdpfn.AttentionCall`: its unit,
        key width, mask and cp strategy), in order: under a cp plan the simulator lists their
        exchange over cp from them (:func:`fsdpfn.step_collectives` ``attention=``).

    Example:
      >>> wl = fsdpfn.sim.profile(model, plan, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten()))
      >>> [str(e) for e, _ in wl.work][:4]
      ['forward <root>', 'forward blocks.0', 'forward_done blocks.0', 'forward blocks.1']
      >>> wl.at(runtime.Op("forward", "blocks.0")).flops == wl.at(runtime.Op("forward", "blocks.1")).flops
      True
    """

    work: tuple[tuple[Op, Work], ...]
    activations: tuple[tuple[str, int], ...] = ()
    tokens: int = 0
    inputs: tuple[tuple[str, int], ...] = ()
    kept: tuple[tuple[str, str, int, Work], ...] = ()
    remat: tuple[tuple[str, str], ...] = ()
    transient: tuple[tuple[Op, int], ...] = ()
    attention: tuple[AttentionCall, ...] = ()
    base: "Workload | None" = dataclasses.field(default=None, compare=False, repr=False)

    def at(self, event: Op) -> Work:
        """The work after ``event`` (nothing for an event the workload does not list)."""
        return self._table.get(event, EMPTY)

    def activation(self, unit: str) -> int:
        return self._acts.get(unit, 0)

    def transient_at(self, event: Op) -> int:
        """The transient bytes of the work after ``event`` (see [Note: transient memory])."""
        return self._transient.get(event, 0)

    @functools.cached_property
    def _transient(self) -> dict:
        return dict(self.transient)

    @functools.cached_property
    def _acts(self) -> dict:
        return dict(self.activations)

    @functools.cached_property
    def _table(self) -> dict:
        return dict(self.work)

    @property
    def flops(self) -> float:
        return sum(w.flops for _, w in self.work)

    @property
    def total(self) -> Work:
        out = EMPTY
        for _, w in self.work:
            out = out + w
        return out

    def forward_backward(self, unit: str) -> tuple[Work, Work]:
        """``(forward, backward)`` work of a (non-root) unit."""
        return self.at(Op(OpKind.FORWARD, unit)), self.at(Op(OpKind.BACKWARD, unit))

    def with_activation_checkpointing(
        self, units: Sequence[str] | None = None, input_bytes: Mapping[str, int] | None = None
    ) -> "Workload":
        """The workload with full activation checkpointing of ``units`` (default: every non-root
        unit): each unit's forward runs again at the start of its backward, and its forward keeps
        only its inputs (as profiled; ``input_bytes[unit]`` overrides). Same as
        :meth:`with_remat` with ``"full"``."""
        names = (
            [e.unit for e, _ in self.work if e.kind is OpKind.FORWARD and e.unit != ROOT]
            if units is None
            else list(units)
        )
        wl = self.with_remat({u: "full" for u in names})
        if input_bytes:
            acts = dict(wl.activations)
            acts.update({u: b for u, b in input_bytes.items() if u in names})
            wl = dataclasses.replace(wl, activations=tuple(acts.items()))
        return wl

    def with_remat(self, policies) -> "Workload":
        """The workload with activation checkpointing per unit, as the runtime runs it: a
        rematerialised unit's backward starts with its forward again, less the work of the
        operators its policy keeps (those are not rerun), and from its forward to its backward
        it holds its inputs and the kept results instead of its activations.

        Args:
          policies: a :class:`fsdpfn.Plan` (its units' ``remat``) or ``{unit: policy}``;
            units not named keep their activations. Replaces what was applied before.

        Example:
          >>> wl = fsdpfn.sim.profile(model, plan, x)
          >>> full = wl.with_remat({"blocks.0": "full"})
          >>> full.at(runtime.Op("backward", "blocks.0")).flops == 3 * wl.at(runtime.Op("forward", "blocks.0")).flops
          True
        """
        base = self.base or self
        if isinstance(policies, (Plan, PipelinedPlan)):
            policies = {u.name: u.remat for u in policies.units}
        policies = {u: p for u, p in policies.items() if p != "none"}
        if ROOT in policies:
            raise ValueError("with_remat: the root unit cannot be rematerialised (its code wraps every other unit)")
        inputs = dict(base.inputs)
        kept = {(u, p): (b, w) for u, p, b, w in base.kept}
        table = dict(base.work)
        acts = dict(base.activations)
        transient = dict(base.transient)
        for u, policy in policies.items():
            if u not in inputs:
                raise ValueError(f"with_remat: unit {u!r} was not profiled (units: {sorted(inputs)})")
            if policy == "full":
                saved_bytes, saved_work = 0, EMPTY
            elif (u, policy) in kept:
                saved_bytes, saved_work = kept[(u, policy)]
            else:
                raise ValueError(
                    f"with_remat: policy {policy!r} of unit {u!r} was not profiled; profile with a plan that uses it"
                )
            fwd = table.get(Op(OpKind.FORWARD, u), EMPTY)
            table[Op(OpKind.BACKWARD, u)] = fwd.minus(saved_work) + table.get(Op(OpKind.BACKWARD, u), EMPTY)
            acts[u] = inputs[u] + saved_bytes
            # Its backward reruns the forward first: the activations it did not keep are live
            # again (besides the held ones) when the gradients' temporaries start.
            b, f = Op(OpKind.BACKWARD, u), Op(OpKind.FORWARD, u)
            transient[b] = max(transient.get(f, 0), max(0, base.activation(u) - saved_bytes) + transient.get(b, 0))
        work = tuple((e, table[e]) for e, _ in base.work)
        return dataclasses.replace(
            base,
            work=work,
            activations=tuple(acts.items()),
            remat=tuple(sorted(policies.items())),
            transient=tuple(transient.items()),
            base=base,
        )

    def recompute(self, unit: str) -> Work:
        """The work a rematerialised ``unit`` reruns in backward (nothing without remat)."""
        if self.base is None or unit not in dict(self.remat):
            return EMPTY
        return self.at(Op(OpKind.BACKWARD, unit)).minus(self.base.at(Op(OpKind.BACKWARD, unit)))

    def __str__(self) -> str:
        lines = [
            f"Workload: {self.flops / 1e9:,.2f} GFLOP per rank per micro-batch, {self.tokens:,} tokens",
            "after event                     GFLOP    other MB      ops  activations MB",
        ]
        acts = dict(self.activations)
        for e, w in self.work:
            act = acts.get(e.unit, 0) if e.kind is OpKind.FORWARD else 0
            lines.append(f"{str(e):<30} {w.flops / 1e9:7.3f} {w.bytes / 1e6:11.2f} {w.ops:8d} {act / 1e6:15.2f}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Counting operators
# ---------------------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_tensors = tensors_of


class _Counter(TorchDispatchMode):
    """Adds every operator's cost to ``self.sink()``'s Work accumulator (and, ``timed``, its
    wall time)."""

    def __init__(self, sink: Callable[[], dict], timed: bool = False, allocated: Callable | None = None):
        super().__init__()
        self.sink = sink
        self.timed = timed
        self.allocated = allocated  # told of every operator's outputs (transient memory)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        acc = self.sink()
        key = None if self.timed else _meta_key(func, args, kwargs)
        if key is not None and key in _META_CACHE:
            outs_meta, spec, cost = _META_CACHE[key]
            out = _rebuild(outs_meta, spec)
            acc["ops"] += 1
            if self.allocated is not None:
                self.allocated(_tensors(out))
            _charge(acc, cost)
            return out
        if self.timed:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            acc["seconds"] += time.perf_counter() - t0
        else:
            out = func(*args, **kwargs)
        acc["ops"] += 1
        if func.is_view:
            return out
        ins, outs = _tensors(args) + _tensors(kwargs), _tensors(out)
        if self.allocated is not None:
            self.allocated(outs)
        nbytes = sum(_nbytes(t) for t in ins + outs)
        counted = op_flops(func, args, kwargs, out)
        matmul = None
        if counted is not None and counted[0]:
            flops, dtype = counted
            matmul = (rate_key(func, args, kwargs, dtype), flops, float(nbytes))
        cost = (matmul, nbytes)
        _charge(acc, cost)
        if key is not None:
            _remember(key, out, cost, {t.untyped_storage()._cdata for t in ins})
        return out


def _charge(acc: dict, cost: tuple) -> None:
    """Adds one operator's ``(matmul key or None, bytes)`` to ``acc``: a matmul-like operator
    counts as its key, any other as the bytes it reads and writes."""
    matmul, nbytes = cost
    if matmul is not None:
        acc["matmuls"][matmul] += 1
    else:
        acc["bytes"] += nbytes


# [Note: meta results by signature]
# On the meta device an operator's outputs are a function of its inputs' metadata (shape, stride,
# dtype) and its other arguments, and so is what the counter adds for it. A model's blocks run
# the same operators on the same shapes, and a profile runs every block (forward, then backward,
# where the meta kernels of decomposed backwards such as layer norm's are Python): the first
# block's results stand for the others. Cached only where that holds: every tensor argument on
# meta, every other argument a plain value, every output on meta and aliasing no input and no
# other output, no mutation. Each hit returns fresh tensors of the same metadata, as the kernel would.
# Process state: a cache of pure results.
_META_CACHE: dict = {}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(func, args, kwargs):
    schema = func._schema
    if func.is_view or schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return None
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    key: list = [func, spec]
    for a in leaves:
        if isinstance(a, torch.Tensor):
            if a.device.type != "meta" or type(a) is not torch.Tensor:
                return None
            key.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype))
        elif type(a) in _PLAIN:
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def _remember(key, out, cost, inputs: set) -> None:
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    storages = set(inputs)
    metas: list[tuple] = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if type(t) is not torch.Tensor or t.device.type != "meta" or t.untyped_storage()._cdata in storages:
                return
            storages.add(t.untyped_storage()._cdata)
            # Rebuilt by empty_strided: only outputs that fill their own storage from its start.
            extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
            if t.storage_offset() or t.untyped_storage().nbytes() != extent * t.element_size():
                return
            metas.append((tuple(t.shape), t.stride(), t.dtype))
        elif type(t) in _PLAIN:
            metas.append((None, t))
        else:
            return
    if len(_META_CACHE) > 200_000:  # a bound on memory across many profiled models; refilled as it runs
        _META_CACHE.clear()
    _META_CACHE[key] = (metas, spec, cost)


def _rebuild(metas, spec):
    leaves = []
    for m in metas:
        if m[0] is None:
            leaves.append(m[1])
            continue
        shape, stride, dtype = m
        leaves.append(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _new_acc() -> dict:
    return {"matmuls": collections.Counter(), "bytes": 0.0, "ops": 0, "seconds": 0.0}


def _to_work(acc: dict, timed: bool = False) -> Work:
    return Work(
        tuple((d, f, b, c) for (d, f, b), c in sorted(acc["matmuls"].items())),
        acc["bytes"],
        acc["ops"],
        acc["seconds"] if timed else None,
    )


def count_work(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Work]:
    """``fn(*args, **kwargs)`` and the :class:`Work` of every operator it dispatched (on any
    device; on ``meta`` nothing is computed).

    Example:
      >>> out, w = fsdpfn.sim.count_work(torch.mm, torch.zeros(64, 32, device="meta"), torch.zeros(32, 16, device="meta"))
      >>> w.flops, w.ops
      (65536.0, 1)
    """
    acc = _new_acc()
    with _Counter(lambda: acc):
        out = fn(*args, **kwargs)
    return out, _to_work(acc)


# ---------------------------------------------------------------------------------------------
# Profiling a model step into a Workload
# ---------------------------------------------------------------------------------------------


class _Events:
    """Turns the running unit (as the module tracker sees it) into schedule events."""

    def __init__(self, units: Sequence[str], root_name: str):
        self.units = sorted((u for u in units if u != ROOT), key=len, reverse=True)
        self.prefix = root_name + "."
        self.current = ROOT
        self.stack: list[str] = []  # the units running now, outermost first
        self.ending = False
        self.event = Op(OpKind.FORWARD, ROOT)
        self.order: list[Op] = [self.event]
        self.acc: dict[Op, dict] = {self.event: _new_acc()}
        self.backward = False

    def unit_of(self, parents) -> str:
        names = {p[len(self.prefix) :] for p in parents if p.startswith(self.prefix)}
        for u in self.units:  # the deepest unit among the running modules
            if u in names:
                return u
        return ROOT

    def _emit(self, kind: OpKind, unit: str) -> None:
        op = Op(kind, unit)
        if op in self.acc:
            raise ValueError(
                f"profile: unit {unit or '<root>'!r} ran its {'backward' if self.backward else 'forward'} twice in one step "
                "(a module called twice, or shared weights); the runtime runs each unit once per step too"
            )
        self.order.append(op)
        self.acc[op] = _new_acc()
        self.event = op

    def _parent(self, unit: str) -> str:
        """The deepest unit that contains ``unit`` (an expert unit sits inside its block's)."""
        for u in self.units:  # deepest first
            if unit.startswith(u + "."):
                return u
        return ROOT

    def move_to(self, unit: str) -> None:
        if unit == self.current:
            return
        if self.backward and unit == ROOT and len(self.stack) > 1 and not self.ending:
            # Inside a nested unit's backward, autograd runs Functions outside any module (the
            # token exchange of experts): still that unit's work, not the root's.
            return
        done, start = (
            (OpKind.BACKWARD_DONE, OpKind.BACKWARD) if self.backward else (OpKind.FORWARD_DONE, OpKind.FORWARD)
        )
        # Units nest (a block's unit wraps its experts' unit): leave those not containing ``unit``,
        # enter those between the innermost one left and ``unit``.
        while self.stack and not (unit == self.stack[-1] or unit.startswith(self.stack[-1] + ".")):
            self._emit(done, self.stack.pop())
        path = []
        u = unit
        while u != ROOT and (not self.stack or u != self.stack[-1]):
            path.append(u)
            u = self._parent(u)
        for u in reversed(path):
            self._emit(start, u)
            self.stack.append(u)
        self.current = unit

    def sink(self, tracker: ModuleTracker) -> dict:
        if tracker.is_bw != self.backward:  # autograd began: the loss's forward is over
            self.start_backward()
        self.move_to(self.unit_of(tracker.parents))
        return self.acc[self.event]

    def end_forward(self) -> None:
        self.move_to(ROOT)
        self._emit(OpKind.FORWARD_DONE, ROOT)

    def start_backward(self) -> None:
        self.move_to(ROOT)
        self.backward = True
        self._emit(OpKind.BACKWARD, ROOT)

    def end(self) -> None:
        self.ending = True
        self.move_to(ROOT)
        self._emit(OpKind.END, ROOT)


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm, for counting on meta: forward reads ``x`` and writes the output,
    saving ``x`` and the reciprocal RMS; backward reads the gradient and ``x`` and writes
    ``dx`` (the weight's gradient is a per-feature sum, small)."""

    @staticmethod
    def forward(ctx, x, weight, dims):
        rstd = x.new_empty(x.shape[: x.dim() - dims] + (1,) * dims, dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.mul(x, 1.0)  # one read of x, one write: the fused kernel's bytes

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        return torch.add(grad, x), (None if weight is None else torch.empty_like(weight)), None


class _FusedAttentionOnMeta(TorchFunctionMode):
    """Fused kernels on meta, as a GPU runs them. RMSNorm: see below. Attention: on the meta device ``scaled_dot_product_attention`` would take its unfused math path
    (matmuls over the whole score matrix); a GPU or CPU run takes a fused kernel. Route it to
    the CPU flash kernel's meta function, so the profile counts one fused attention operator
    forward and one backward, as on real hardware.

    Every attention call, on any device, is recorded as an :class:`fsdpfn.AttentionCall` of the
    unit running it (``calls``), the step's op list's input for the exchange over cp. See
    [Note: one cp rank's attention] for what a call costs on meta under a cp plan."""

    def __init__(self, cp: int = 1, strategy: str = "allgather", unit_of=None, save=None):
        super().__init__()
        self.cp, self.strategy = cp, strategy
        self.unit_of, self.save = unit_of, save
        self.calls: list[AttentionCall] = []
        self.unsaved: set[int] = set()  # storages a kernel keeps that the real step does not (see the Note)
        self.held: list[torch.Tensor] = []  # them, alive until the transient peaks leave them out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.rms_norm and args and args[0].device.type == "meta":
            # On CUDA, rms_norm runs one fused kernel that saves its input and the reciprocal
            # RMS; on meta it would take the composite path, which saves float32 copies
            # (4x the bytes of a bf16 input) and counts a dozen memory-bound operators.
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
            weight = kwargs.get("weight", args[2] if len(args) > 2 else None)
            return _FusedRMSNorm.apply(args[0], weight, len(shape))
        if func is torch.nn.functional.scaled_dot_product_attention and args:
            q, k, v = args[:3]
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if k.dim() == 4 and self.unit_of is not None:
                width = int(k.shape[1] * k.shape[3])
                self.calls.append(
                    AttentionCall(
                        self.unit_of(), width, bool(causal), self.strategy, k.dtype, int(q.shape[1] * q.shape[3])
                    )
                )
        if func is torch.nn.functional.scaled_dot_product_attention and args and args[0].device.type == "meta":
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if mask is None and not dropout:
                own = (k, v)
                if k.shape[-3] != q.shape[-3]:  # grouped-query attention: kernels read shared heads
                    rep = q.shape[-3] // k.shape[-3]
                    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
                if self.cp > 1:
                    k, v = self._over_cp(k, v, own)
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, causal, scale=kwargs.get("scale")
                )[0]
        return func(*args, **kwargs)

    def _over_cp(self, k, v, own):
        """Keys and values of the whole sequence, as one cp rank attends to them (see [Note:
        one cp rank's attention]); ``own``: the rank's own keys and values, what the real call
        saves."""
        full_k, full_v = torch.cat([k] * self.cp, dim=-2), torch.cat([v] * self.cp, dim=-2)
        self.unsaved.update(t.untyped_storage()._cdata for t in (full_k, full_v))
        self.held += [full_k, full_v]
        if self.save is not None:
            for t in own:
                self.save(t)
        return full_k, full_v


# [Note: one cp rank's attention]
# Under a plan with a cp axis the profile runs one rank's micro-batch: ``S / cp`` tokens of each
# sequence. Everything but attention is per token and costs what it costs on those; attention
# joins every rank's keys. With head-tail balancing each rank's causal work is ``1 / cp`` of the
# sequence's, ``(S / cp) x S / 2`` query-key pairs, exactly what one fused call of the rank's
# queries against keys and values of ``S`` tokens counts under a causal mask (``attention_flops``
# halves it). So on meta the call runs against the rank's keys repeated ``cp`` times: the FLOPs
# and the kernel's shape of an all-gather. What it keeps for backward is the rank's own keys and
# values, under either strategy (fsdpfn's attention over cp is one fused Function that exchanges
# them again in backward, [Note: fused attention over cp] in ``fsdpfn/transforms/_cp.py``, as
# flash ring kernels do, torchtitan's among them), so the repeated buffers are left out of the
# saved and the transient bytes (a ring holds two blocks at a time; the all-gather's whole-sequence
# buffer, which lives only inside the call, is left out too). The
# exchange itself is communication: the op list lists it from the recorded calls.


def _default_loss(out) -> torch.Tensor:
    t = _tensors(out)[0]
    return t.float().mean()


# [Note: transient memory]
# Besides what a unit saves for its backward, its operators' results live a while: a block's
# intermediate values until the next operator has read them, a gradient until the one before it
# is computed. Most are small next to the saved activations, but the loss's are not: with a
# 128k-token vocabulary, ``F.cross_entropy(logits.float(), y)`` over ``(tokens, vocab)`` bfloat16
# logits writes a float32 copy (4 bytes an element) and its log-softmax (4, saved for backward);
# its backward writes the gradient of the log-softmax (4, dense) and from it and the saved
# output the gradient of the logits (4) before casting it to bfloat16 (2): 12 bytes an element
# live at once, of which the saved 4 are activations. ``profile`` sees every allocation:
# it follows each storage an operator writes until it is freed and, per stretch of the
# schedule, keeps the most bytes live at once among those that are neither saved for backward
# (activations, held separately) nor a parameter's gradient (the simulator holds the unit's
# gradients from its backward to their reduction). The model's output is let go before
# backward, as a training loop does that keeps only the loss (torchtitan's ``del pred``); one
# that keeps the output through backward holds its bytes besides.


class _Live:
    """Storages the profiled step allocated and has not freed yet, replayed afterwards: the peak
    bytes live per stretch, less those of storages still live at the end that are excluded
    (see [Note: transient memory])."""

    def __init__(self, events: "_Events", skip: set):
        self.events = events
        self.skip = skip  # storages allocated before (parameters, inputs)
        self.live: dict[int, int] = {}  # storage address -> allocation number (addresses are reused once freed)
        self.log: list[tuple[Op, int, int]] = []  # (stretch, allocation number, +bytes / -bytes)
        self.finalizers: list = []

    def allocated(self, outs) -> None:
        for t in outs:
            st = t.untyped_storage()
            key = st._cdata
            if key in self.live or key in self.skip:
                continue
            n, serial = st.nbytes(), len(self.log)
            self.live[key] = serial
            self.log.append((self.events.event, serial, n))
            self.finalizers.append(weakref.finalize(st, self._freed, key, serial, n))

    def _freed(self, key: int, serial: int, n: int) -> None:
        self.live.pop(key, None)
        self.log.append((self.events.event, serial, -n))

    def peaks(self, exclude: set) -> dict:
        """``{stretch: peak bytes}``, leaving out the live storages whose addresses are in ``exclude``."""
        left_out = {self.live[k] for k in exclude if k in self.live}
        out: dict[Any, int] = {}
        live = 0
        for event, serial, n in self.log:
            if serial in left_out:
                continue
            live += n
            out[event] = max(out.get(event, 0), live)
        return out

    def close(self) -> None:
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _profile_once(
    model,
    params,
    units,
    inputs,
    loss_fn,
    cast: bool,
    timed: bool,
    selective=None,
    cp: int = 1,
    cp_strategy: str = "allgather",
):
    """One forward, loss and backward under the counter: ``(event order, accumulators, saved
    activation bytes per unit, input bytes per unit, {(unit, policy): (kept bytes, kept Work)},
    transient bytes per event, attention calls)``."""
    selective = selective or {}
    param_storages = {p.untyped_storage()._cdata for p in params.values()}
    events = _Events(units, type(model).__name__)
    saved: dict[str, int] = collections.defaultdict(int)
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    modules = dict(model.named_modules())
    unit_inputs: dict[str, int] = {}
    kept: dict[tuple[str, str], tuple[int, Work]] = {}
    hooks = []
    for u in units:
        if u == ROOT or u not in modules:
            continue
        mod = modules[u]
        modes: list = []
        wanted = tuple(sorted({"save_dots", *(p for p in selective.get(u, ()))}))

        def pre(m, args, kwargs, _u=u, _modes=modes, _wanted=wanted):
            unit_inputs[_u] = _storage_bytes(_tensors([args, kwargs]))
            for policy in _wanted:
                mode = SaveMode(policy, _u, strict=False)  # policies profiled for every unit, tagged or not
                mode.__enter__()
                _modes.append((policy, mode))

        def post(m, args, kwargs, out, _u=u, _modes=modes):
            while _modes:
                policy, mode = _modes.pop()
                mode.__exit__(None, None, None)
                acc = _new_acc()
                for rate, flops, nbytes in mode.kept_costs():
                    if rate is None:
                        acc["bytes"] += nbytes
                    else:
                        acc["matmuls"][(rate, flops, nbytes)] += 1
                    acc["ops"] += 1
                kept[(_u, policy)] = (_storage_bytes(mode.tensors()), _to_work(acc))

        hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mod.register_forward_hook(post, with_kwargs=True))
        mod._fsdpfn_in_remat = True  # profile the plain forward; the plan's remat is applied to the counts after
    before = {t.untyped_storage()._cdata for t in _tensors(list(inputs))} | param_storages
    live = None if timed else _Live(events, before)
    with ModuleTracker() as tracker:

        def pack(t: torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in param_storages and key not in seen and key not in fused.unsaved:
                seen.add(key)
                keep.append(t)
                saved[events.unit_of(tracker.parents)] += t.untyped_storage().nbytes()
            return t

        fused = _FusedAttentionOnMeta(cp, cp_strategy, lambda: events.unit_of(tracker.parents), pack)
        with (
            fused,
            _Counter(lambda: events.sink(tracker), timed=timed, allocated=None if live is None else live.allocated),
        ):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = torch.func.functional_call(model, params, inputs) if cast else model(*inputs)
                events.end_forward()
                loss = (loss_fn or _default_loss)(out)
            del out  # the loss's graph keeps what its backward needs (see [Note: transient memory])
            loss.backward()
            events.end()
    transient = {}
    if live is not None:
        grads = {p.grad.untyped_storage()._cdata for p in params.values() if p.grad is not None}
        transient = live.peaks(seen | grads | fused.unsaved)
        live.close()
    fused.held.clear()
    keep.clear()
    for h in hooks:
        h.remove()
    for u in units:
        if u in modules and u != ROOT:
            modules[u]._fsdpfn_in_remat = False
    for p in params.values():
        p.grad = None
    return events.order, events.acc, saved, unit_inputs, kept, transient, tuple(fused.calls)


def profile(
    model: torch.nn.Module,
    plan: Plan,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    param_dtype: torch.dtype | None = None,
    timed: bool = False,
    repeats: int = 3,
    remat_policies: Sequence[str] = (),
    cp_strategy: str = "allgather",
) -> Workload:
    """Runs ``loss_fn(model(*inputs))`` and its backward once, on one process, and returns what
    each stretch of the runtime's schedule computes (see [Note: work between events]).

    Run it on the meta device for abstract plans: build the model under
    ``torch.device("meta")`` and pass meta inputs; shapes are all it needs.

    Args:
      model: the model the plan was made for (real or on ``meta``).
      plan: its plan (its unit names, and the layers it splits over tp: see [Note: tensor parallel]).
      *inputs: one rank's micro-batch.
      loss_fn: ``output -> scalar``; default the mean of the output.
      param_dtype: dtype the parameters are computed in (default ``plan.mp.param_dtype``, else
        their own).
      timed: also time every operator (a real device only), ``repeats`` times after a warm-up,
        keeping each stretch's fastest time: ``Work.measured``, which the simulator then uses
        instead of the FLOP and byte model, so that a prediction on this device tests the
        communication and runtime terms alone.
      repeats: timed runs (``timed`` only).
      remat_policies: selective activation-checkpointing policies to profile for every unit
        besides ``"save_dots"`` and the plan's own, so :meth:`Workload.with_remat` can cost them.
      cp_strategy: under a plan with a cp axis, how attention reaches the other ranks' keys
        (one of :func:`fsdpfn.context_parallel`'s strategies): recorded in the
        workload's attention calls, and on meta what a call keeps for backward (see [Note: one
        cp rank's attention]). ``inputs`` are then one cp rank's part of each sequence.

    Returns:
      a :class:`Workload`; its ``tokens`` is the number of elements of the first integer input.

    Example:
      >>> wl = fsdpfn.sim.profile(model, plan, x)
      >>> fwd, bwd = wl.forward_backward("blocks.0")
      >>> round(bwd.flops / fwd.flops, 2)   # backward: about twice the forward
      2.0
    """
    if cp_strategy not in CP_STRATEGIES:
        raise ValueError(f"profile: cp_strategy {cp_strategy!r} is not one of {CP_STRATEGIES}")
    units = [u.name for u in plan.units]
    dtype = param_dtype or plan.mp.param_dtype
    params: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters()}
    if dtype is not None:
        params = {n: p.detach().to(dtype).requires_grad_(p.requires_grad) for n, p in params.items()}
    cast = dtype is not None
    # Each rank runs its tp-local part of the split layers (see [Note: tensor parallel]).
    parts, hooks = one_tp_rank(model, plan, params)
    cast = cast or parts is not params
    params = parts
    selective: dict[str, set] = collections.defaultdict(
        set
    )  # the plan's selective policies, profiled besides save_dots
    for u in plan.units:
        if u.remat not in ("none", "full"):
            selective[u.name].add(u.remat)
        selective[u.name].update(p for p in remat_policies if p not in ("none", "full"))
    run = functools.partial(
        _profile_once, model, params, units, inputs, loss_fn, cast, cp=sequence_parts(plan), cp_strategy=cp_strategy
    )
    try:
        order, acc, saved, unit_inputs, kept, transient, attention = run(timed=False, selective=selective)
        measured: dict[Op, float] = {}
        if timed:
            for i in range(repeats + 1):
                t_order, t_acc, *_ = run(timed=True)
                if t_order != order:
                    raise ValueError("profile(timed=True): the model ran its units in another order on a repeat")
                if i:  # the first run warms up
                    for op in order:
                        measured[op] = min(measured.get(op, math.inf), t_acc[op]["seconds"])
    finally:
        for h in hooks:
            h.remove()
    tokens = next((t.numel() for t in _tensors(list(inputs)) if not t.is_floating_point()), 0)
    work = tuple((op, dataclasses.replace(_to_work(acc[op]), measured=measured.get(op))) for op in order)
    acts = tuple((u, saved.get(u, 0)) for u in units)
    base = Workload(
        work,
        acts,
        tokens,
        tuple(unit_inputs.items()),
        tuple((u, p, b, w) for (u, p), (b, w) in sorted(kept.items())),
        transient=tuple((op, transient.get(op, 0)) for op in order),
        attention=attention,
    )
    return base.with_remat(plan) if any(u.remat != "none" for u in plan.units) else base
