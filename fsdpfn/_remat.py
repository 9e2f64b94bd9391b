"""Activation-checkpointing policies: which of a unit's forward results are kept for backward.

[Note: selective rematerialisation]
A policy is plain data in the plan (``Unit.remat``, a string) so that a plan written to JSON
runs the same elsewhere and the simulator costs exactly what runs:

- ``"none"``: keep every activation autograd saves (no recompute);
- ``"full"``: keep only the unit's inputs; its whole forward runs again in backward;
- ``"save_dots"``: keep the inputs and the outputs of matmul-like operators (``mm``, ``addmm``,
  ``bmm``, fused attention, convolution); the cheap rest (norms, activations, dropout, views)
  runs again in backward. JAX calls this ``checkpoint_dots``; torchtitan's per-op selective
  checkpointing saves the same family;
- ``"save_names:a,b"``: keep the inputs and the tensors the model tagged with
  :func:`checkpoint_name` under one of the names (JAX's ``save_only_these_names``);
- a name given to :func:`register_remat_policy`: keep the outputs of the operators a predicate
  of yours selects.

Eager PyTorch cannot skip the operators upstream of a kept tensor (their backward needs their
own inputs), so what a kept result saves is the operator that produced it: on recompute that
operator is not run again, its kept output is handed back in its place. :class:`SaveMode` runs
during the first forward and keeps the outputs; :class:`ReplayMode` runs during the recompute
and substitutes them. Both are ``TorchDispatchMode``\\ s, so they work the same inside
``torch.func.grad`` and under ``loss.backward()``. Operators are matched by (operator, n-th call
of that operator), which the recompute reproduces because it runs the same code on the same
inputs; a recompute that calls them differently (data-dependent control flow, a kept tensor
modified in place) raises :class:`RematReplayError` rather than returning wrong gradients.

[Note: replay check]
Matching kept operators is not enough: a forward that reads a call counter or makes a Python
choice runs the same operators on a recompute with other numbers, and its gradients are then
silently those of another function. So under every policy, ``"full"`` included, the forward
records each operator it dispatches with a fingerprint of its output, and the recompute checks
its own against that list in order: the same operator, the same output shapes and views, and
bitwise the same values. The first operator that differs is named in a
:class:`RematReplayError`. A value fingerprint is ``sum(w * x)`` with fixed weights
``w`` (1 to 2 along the flattened output, so a permutation changes it too); views are compared
by size, stride and offset, which with their checked base fixes their values. Cost: per
operator output, one dot product with the weights (float32/64; other dtypes a multiply and a
float64 sum), in the forward and again in the recompute: about one more elementwise operator
per operator, no matmul FLOPs; 8 bytes kept per operator, and one host synchronisation at the
end of each unit's recompute. Replays are bitwise on deterministic
kernels (dropout replays from the restored generator state); a unit with nondeterministic
kernels (atomics on CUDA) needs ``torch.use_deterministic_algorithms(True)`` or
``remat="none"``.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Callable

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fsdpfn import _ambient
from fsdpfn._flops import op_flops, rate_key

__all__ = [
    "DOT_OPS",
    "RematReplayError",
    "ReplayMode",
    "SaveMode",
    "checkpoint_name",
    "check_policy",
    "register_remat_policy",
    "remat_policies",
]

aten = torch.ops.aten

BUILTIN = ("none", "full", "save_dots")
NAMES_PREFIX = "save_names:"

# Operators whose outputs "save_dots" keeps: the FLOP-heavy ones, whose recompute dominates.
DOT_OPS = frozenset(
    op
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        getattr(aten, "_scaled_mm", None) and aten._scaled_mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        getattr(aten, "_scaled_dot_product_cudnn_attention", None) and aten._scaled_dot_product_cudnn_attention.default,
    )
    if op
)

# Process state: the remat policy registry (register_remat_policy), looked up by name.
_REGISTRY: dict[str, Callable] = {}


class RematReplayError(RuntimeError):
    """The recompute of a rematerialised unit did not call the operators its forward called,
    so the kept results cannot be handed back safely."""


def register_remat_policy(name: str, save: Callable[[torch._ops.OpOverload], bool]) -> None:
    """Registers a selective activation-checkpointing policy under ``name``, usable as
    ``fsdpfn.plan(..., remat=name)``: ``save(op)`` is called with every ATen operator a
    rematerialised unit's forward dispatches and says whether to keep its output (kept outputs
    are not recomputed in backward). Register it in every process before building or loading a
    plan that names it.

    Args:
      name: the policy's name in plans; not one of ``"none"``, ``"full"``, ``"save_dots"`` and
        not starting with ``"save_names:"``.
      save: predicate on ``torch._ops.OpOverload``.

    Example:
      >>> aten = torch.ops.aten
      >>> fsdpfn.register_remat_policy("save_attention", lambda op: op in {aten._scaled_dot_product_flash_attention_for_cpu.default})
      >>> "save_attention" in fsdpfn.remat_policies()
      True
    """
    if not isinstance(name, str) or not name or name in BUILTIN or name.startswith(NAMES_PREFIX) or "," in name:
        raise ValueError(
            f"register_remat_policy: {name!r} cannot name a policy; use a new non-empty name without commas, "
            f"not one of {', '.join(BUILTIN)} or '{NAMES_PREFIX}...'"
        )
    if not callable(save):
        raise TypeError(
            f"register_remat_policy({name!r}, save): save must be callable (op -> bool), got {type(save).__name__}"
        )
    _REGISTRY[name] = save


def remat_policies() -> tuple[str, ...]:
    """The policy names a plan may use now: the built-in ones and those registered.

    Example:
      >>> fsdpfn.remat_policies()[:3]
      ('none', 'full', 'save_dots')
    """
    return BUILTIN + tuple(_REGISTRY)


def check_policy(policy: str, where: str) -> None:
    """Raises ``ValueError`` naming ``where`` unless ``policy`` is a policy this process can run."""
    if not isinstance(policy, str):
        raise ValueError(f"{where}: a remat policy is a string, got {type(policy).__name__}")
    if policy in BUILTIN or policy in _REGISTRY:
        return
    if policy.startswith(NAMES_PREFIX):
        if _names(policy):
            return
        raise ValueError(f"{where}: remat policy {policy!r} names no tensor; write '{NAMES_PREFIX}attn_out,mlp_in'")
    raise ValueError(
        f"{where}: unknown remat policy {policy!r}; choose one of {', '.join(remat_policies())}, "
        f"'{NAMES_PREFIX}<name>,...', or register yours with fsdpfn.register_remat_policy"
    )


def _names(policy: str) -> frozenset[str]:
    return frozenset(n.strip() for n in policy[len(NAMES_PREFIX) :].split(",") if n.strip())


def selector(policy: str) -> tuple[Callable | None, frozenset[str]]:
    """``(save(op) or None, names)`` of a selective policy."""
    if policy == "save_dots":
        return DOT_OPS.__contains__, frozenset()
    if policy.startswith(NAMES_PREFIX):
        return None, _names(policy)
    if policy in _REGISTRY:
        return _REGISTRY[policy], frozenset()
    raise ValueError(
        f"remat policy {policy!r} keeps no operator output (register it with fsdpfn.register_remat_policy)"
    )


# Process state: the saving forwards now running, innermost last (a stack, as torch's dispatch
# modes are): checkpoint_name tags its tensor for each.
_ACTIVE: list["SaveMode"] = []


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tags ``x`` with ``name`` for a ``"save_names:..."`` activation-checkpointing policy and
    returns it unchanged: a unit whose plan says ``remat="save_names:name"`` keeps the output of
    the operator that produced ``x`` instead of recomputing it. Anywhere else it does nothing.

    Example:
      >>> h = fsdpfn.checkpoint_name(torch.ones(2) * 3, "scaled")
      >>> h
      tensor([3., 3.])
    """
    for mode in _ACTIVE:
        mode.tag(x, name)
    return x


def _flat_tensors(out) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, torch.Tensor)]


def _cost(func, args, kwargs, out) -> tuple:
    """``(rate key or None, FLOPs, bytes)`` of one operator call, as ``fsdpfn.sim`` counts it."""
    nbytes = float(sum(t.numel() * t.element_size() for t in _flat_tensors((args, kwargs)) + _flat_tensors(out)))
    counted = op_flops(func, args, kwargs, out)
    if counted is None or not counted[0]:
        return None, 0.0, nbytes
    flops, dtype = counted
    return rate_key(func, args, kwargs, dtype), flops, nbytes


def _signature(args) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in _flat_tensors(args))


def _is_view(op) -> bool:
    return any(a.alias_info is not None for a in op._schema.returns)


# Operators a replay may add or drop without changing the numbers: the runtime makes fresh
# autograd leaves of the recompute's inputs (detach), which its no-graph forward does not.
_UNTRACED = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh.default})
# Uninitialised allocations: no values to compare, and spelt differently under torch.func
# (empty_like in the forward, empty in the recompute's vjp): one operator for the check.
_EMPTY = frozenset(
    op
    for op in (
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.empty_strided.default,
        aten.new_empty_strided.default,
    )
)
_WEIGHTS: dict = {}  # Process state: a cache, (numel, device) -> the fingerprint weights, a few shapes per model


def _weights(n: int, device, dtype=torch.float32) -> torch.Tensor:
    key = (n, str(device), dtype)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 256:
            _WEIGHTS.clear()
        _WEIGHTS[key] = (
            torch.linspace(1.0, 2.0, n, device=device, dtype=dtype)
            if n > 1
            else torch.ones(n, device=device, dtype=dtype)
        )
    return _WEIGHTS[key]


def _canonical(func) -> str:
    """An operator's name with in-place and functional forms as one: under ``torch.func`` a
    recompute may run ``bernoulli`` where the forward ran ``bernoulli_``, with the same values."""
    return func.overloadpacket.__name__.rstrip("_")


_PURE_VIEW: dict = {}  # Process state: a cache, op -> bool: reading the schema costs more than the check


def _is_pure_view(func) -> bool:
    if func not in _PURE_VIEW:
        _PURE_VIEW[func] = _is_view(func) and not any(
            a.alias_info.is_write for a in func._schema.returns if a.alias_info is not None
        )
    return _PURE_VIEW[func]


def _fingerprint(func, out) -> tuple:
    """``(metadata, value sums or None)`` of one operator call's outputs (see [Note: replay
    check]): views by their geometry, other outputs by ``sum(w * x)``."""
    flat = [out] if isinstance(out, torch.Tensor) else _flat_tensors(out)
    if _is_pure_view(func):
        return tuple((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in flat), None
    meta = tuple((tuple(t.shape), t.dtype) for t in flat)
    if getattr(func, "namespace", None) == "c10d":
        # A collective's output is still being written when it is dispatched (fsdpfn.comm starts
        # them async and waits later): its values are checked where the next operator reads them.
        return meta, None
    sums = []
    for t in flat:
        if t.numel() == 0 or t.device.type == "meta":
            continue
        x = t.detach()
        x = torch.view_as_real(x) if x.is_complex() else x.view(torch.uint8) if x.dtype == torch.bool else x
        x = x.reshape(-1)
        if x.dtype in (torch.float32, torch.float64):  # one pass, no temporary: about one elementwise op
            sums.append(torch.dot(x, _weights(x.numel(), x.device, x.dtype)))
        else:
            sums.append(torch.sum(x * _weights(x.numel(), x.device), dtype=torch.float64))
    return meta, (tuple(sums) if sums else None)


class _Trace:
    """The operators a unit's forward ran, with their outputs' fingerprints: computing ones in
    order, views by (operator, n-th call). Allocations are left out (no values, and spelt
    differently under ``torch.func``), and so is the order of views (``torch.func`` adds
    ``expand`` calls); every value a view exposes reaches the rest through a computing operator."""

    def __init__(self):
        self.ops: list = []  # (canonical name, metadata) of the computing operators, in order
        self.sums: list = []  # their value sums (a tuple of 0-d tensors, one per output) or None
        self.views: dict = {}  # (canonical name, n) -> geometry
        self.counts: collections.Counter = collections.Counter()

    def record(self, func, out) -> None:
        if func in _UNTRACED or func in _EMPTY:
            return
        name = _canonical(func)
        meta, sums = _fingerprint(func, out)
        if _is_pure_view(func):
            self.views[(name, self.counts[name])] = meta
            self.counts[name] += 1
            return
        self.ops.append((name, meta))
        self.sums.append(sums)


def _first_value_difference(forward: _Trace, replay: list) -> int | None:
    """The index of the first operator whose recomputed values differ: the sums compared
    bitwise (NaN equal to NaN), stacked by dtype, with one host sync."""
    pairs: dict = {}  # dtype -> ([op index], [forward sums], [replay sums])
    for i, got in enumerate(replay):
        want = forward.sums[i]
        if got is None or want is None:
            continue
        for w, g in zip(want, got):
            group = pairs.setdefault(w.dtype, ([], [], []))
            group[0].append(i)
            group[1].append(w)
            group[2].append(g)
    bad = []
    for idx, want, got in pairs.values():
        w, g = torch.stack(want).cpu(), torch.stack(got).cpu()
        differ = ~((w == g) | (w.isnan() & g.isnan()))
        bad += [i for i, d in zip(idx, differ.tolist()) if d]
    return min(bad) if bad else None


class SaveMode(TorchDispatchMode):
    """Runs a rematerialised unit's first forward and keeps the outputs the policy selects
    (see [Note: selective rematerialisation]); ``saved`` maps ``(op, n)`` to the output."""

    def __init__(self, policy: str, unit: str, strict: bool = True):
        super().__init__()
        self.save, self.names = (None, frozenset()) if policy == "full" else selector(policy)
        # Every operator and its output's fingerprint, for the replay check ([Note: replay check]);
        # off for fsdpfn.sim's profiling, which never replays.
        self.trace = _Trace() if strict else None
        self.unit, self.policy, self.strict = unit, policy, strict
        self.tags_seen: set[str] = set()  # every checkpoint_name tag the forward used, kept or not
        self.counts: collections.Counter = collections.Counter()
        self.saved: dict = {}
        self.versions: dict = {}
        self.signatures: dict = {}  # (op, n) -> shapes and dtypes of its tensor arguments
        self.costs: dict = {}  # (op, n) -> (rate key or None, FLOPs, bytes read and written): what a kept op saves
        self._producer = WeakIdKeyDictionary()  # tensor -> (key, weak refs to the op's outputs)
        self.ambient = _ambient.snapshot()  # the cp axes the recompute must attend over again

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._producer = WeakIdKeyDictionary()  # drop the forward's bookkeeping, keep only what is kept
        out = super().__exit__(*exc)
        if exc[0] is None and self.strict and self.names - self.tags_seen:
            # A name nothing tags keeps nothing: the unit would run as "full" without a word. Every
            # rank runs the same forward, so every rank raises here, before the unit's backward.
            missing = sorted(self.names - self.tags_seen)
            seen = ", ".join(repr(t) for t in sorted(self.tags_seen)) or "none"
            raise ValueError(
                f"unit {self.unit!r}: remat policy {self.policy!r} keeps the tensors tagged {', '.join(map(repr, missing))}, but the "
                f"unit's forward tags no tensor so (fsdpfn.checkpoint_name); the tags it uses: {seen}. Fix the name, tag the "
                "tensor in the model, or give this unit another policy with a dict remat={unit pattern: policy}"
            )
        if exc[0] is None:
            for key, out_ in self.saved.items():
                if [t._version for t in _flat_tensors(out_)] != self.versions[key]:
                    raise RematReplayError(
                        f"unit {self.unit!r}: the output of {key[0]} (call {key[1]}) is kept for backward by its remat policy but "
                        "was modified in place later in the forward; keep another tensor, or make that operation out of place"
                    )
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.trace is not None:
            self.trace.record(func, out)
        key = (func, self.counts[func])
        self.counts[func] += 1
        if not _is_view(func) and (self.names or (self.save is not None and self.save(func))):
            self.costs[key] = _cost(func, args, kwargs, out)
        if self.save is not None and self.save(func) and not _is_view(func):
            self._keep(key, out, args)
        elif self.names:
            flat = _flat_tensors(out)
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if _is_view(func):  # a view is recomputed from its base: tagging it keeps the base's producer
                parent = self._producer.get(first) if first is not None else None
                if parent is not None:
                    for t in flat:
                        self._producer[t] = (None, (), None, None, parent)
                return out
            # Siblings of a multi-output op (attention's logsumexp) are held until the forward
            # ends, since a recompute must hand the op's outputs back whole; single outputs weakly.
            refs = [weakref.ref(t) for t in flat] if len(flat) == 1 else [lambda t=t: t for t in flat]
            # A Linear on a (batch, seq, features) input ends in _unsafe_view of its mm: tagging
            # the result keeps the mm's output as well (the same storage), which is what saves
            # the recompute.
            parent = self._producer.get(first) if func is aten._unsafe_view.default and first is not None else None
            if (
                parent is not None and parent[0] is not None
            ):  # hold the base's outputs: the view's tensor may outlive them
                held = [r() for r in parent[1]]
                if all(o is not None for o in held):
                    parent = (parent[0], [lambda t=t: t for t in held], *parent[2:])
            for t in flat:
                self._producer[t] = (key, refs, optree.tree_structure(out, none_is_leaf=True), _signature(args), parent)
        return out

    def _keep(self, key, out, args=None) -> None:
        self.saved[key] = out
        self.versions[key] = [t._version for t in _flat_tensors(out)]
        if args is not None:
            self.signatures[key] = _signature(args)

    def kept_costs(self) -> list[tuple]:
        """``(rate key or None, FLOPs, bytes)`` of every kept operator call."""
        return [self.costs[k] for k in self.saved if k in self.costs]

    def tensors(self) -> list[torch.Tensor]:
        """The kept outputs."""
        return [t for out in self.saved.values() for t in _flat_tensors(out)]

    def tag(self, x: torch.Tensor, name: str) -> None:
        self.tags_seen.add(name)
        if name not in self.names:
            return
        found = self._producer.get(x)
        if found is None:
            raise ValueError(
                f"unit {self.unit!r}: checkpoint_name(x, {name!r}) tags a tensor no operator of this unit's forward produced "
                "without aliasing (an input, a parameter, or a view such as reshape/transpose); tag the tensor before reshaping it"
            )
        while found is not None:
            key, refs, spec, sig, found = found
            if key is None:  # a view: its base's producer is what a recompute can skip
                continue
            outs = [r() for r in refs]
            if any(o is None for o in outs):
                raise ValueError(
                    f"unit {self.unit!r}: checkpoint_name(x, {name!r}): the outputs of {key[0]} are already freed; "
                    "tag the tensor right after the operation that produces it"
                )
            self._keep(key, optree.tree_unflatten(spec, outs))
            self.signatures[key] = sig


class ReplayMode(TorchDispatchMode):
    """Runs a rematerialised unit's recompute, hands back the outputs :class:`SaveMode` kept in
    place of running their operators again, and checks every other operator against the
    forward's (see [Note: replay check])."""

    def __init__(self, save: SaveMode | None, unit: str):
        super().__init__()
        self.saved = dict(save.saved) if save is not None else {}
        self.signatures = save.signatures if save is not None else {}
        self.trace = save.trace if save is not None else None
        self.sums: list = []  # the recompute's value sums, op by op, as the trace's
        self.view_counts: collections.Counter = collections.Counter()
        self.flops = 0.0  # of the operators the recompute ran (matmul-like ones, counted as the simulator counts them)
        self.unit = unit
        self.counts: collections.Counter = collections.Counter()
        self.skipped = 0
        self._ambient = contextlib.ExitStack()
        self._snap = save.ambient if save is not None else None

    def __enter__(self):
        if self._snap is not None:  # the forward's cp axes, even after its `with` block ended
            self._ambient.enter_context(_ambient.restored(self._snap))
        return super().__enter__()

    def _refuse(self, why: str):
        """The first value difference before this point is the culprit, if there is one."""
        bad = None if self.trace is None else _first_value_difference(self.trace, self.sums)
        if bad is not None and self.trace is not None:
            why = (
                f"aten.{self.trace.ops[bad][0]} (operator {bad + 1} of the forward) computed other values on the recompute than in "
                "the forward"
            )
        raise RematReplayError(
            f"unit {self.unit!r}: the recompute in backward does not replay the forward: {why}. A rematerialised unit must "
            "compute the same on a recompute: no control flow or values that depend on a call counter, on Python's random or "
            "on data; use remat='none' for this unit, or move that choice out of it (nondeterministic kernels: "
            "torch.use_deterministic_algorithms(True))"
        )

    def _check(self, func, out, kept: bool) -> None:
        if self.trace is None or func in _UNTRACED or func in _EMPTY:
            return
        name = _canonical(func)
        if _is_pure_view(func):
            key = (name, self.view_counts[name])
            self.view_counts[name] += 1
            want = self.trace.views.get(key)
            if want is not None and _fingerprint(func, out)[0] != want:
                self._refuse(
                    f"{func} (call {key[1] + 1}) returned a view {_fingerprint(func, out)[0]}, in the forward {want} "
                    "(shape, stride, offset)"
                )
            return
        i = len(self.sums)
        if i >= len(self.trace.ops):
            self._refuse(f"it calls {func} after the {i} operators the forward ran")
        want_op, want_meta = self.trace.ops[i]
        if want_op != name:
            self._refuse(f"it did not call aten.{want_op} as its operator {i + 1}, as the forward did, but {func}")
        if kept:  # the forward's own output, handed back
            self.sums.append(None)
            return
        meta, sums = _fingerprint(func, out)
        if meta != want_meta:
            self._refuse(f"{func} (operator {i + 1}) returned {meta}, in the forward {want_meta} (shapes and dtypes)")
        self.sums.append(sums)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = (func, self.counts[func])
        self.counts[func] += 1
        if key in self.saved:
            if _signature(args) != self.signatures[key]:
                raise RematReplayError(
                    f"unit {self.unit!r}: the recompute in backward called {func} (call {key[1]}) on arguments shaped "
                    f"{[s for s, _ in _signature(args)]}, the forward on {[s for s, _ in self.signatures[key]]}; the unit's forward must "
                    "run the same operators on a recompute (no data-dependent control flow) under a selective remat policy; use remat='full'"
                )
            self.skipped += 1
            out = self.saved.pop(key)
            self._check(func, out, kept=True)
            return out
        out = func(*args, **(kwargs or {}))
        self._check(func, out, kept=False)
        counted = op_flops(func, args, kwargs or {}, out)
        if counted is not None:
            self.flops += counted[0]
        return out

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._ambient.close()
        if exc[0] is None and self.trace is not None:
            if len(self.sums) < len(self.trace.ops):
                self._refuse(
                    f"it ran {len(self.sums)} operators, the forward {len(self.trace.ops)} (the next was "
                    f"aten.{self.trace.ops[len(self.sums)][0]})"
                )
            bad = _first_value_difference(self.trace, self.sums)
            if bad is not None:
                self._refuse("")
        if exc[0] is None and self.saved:
            (op, n), *_ = self.saved
            raise RematReplayError(
                f"unit {self.unit!r}: the recompute in backward did not call {op} a {n + 1}th time as the forward did; the unit's "
                "forward must run the same operators on a recompute (no data-dependent control flow) under a selective remat policy; "
                "use remat='full' for this unit"
            )
        return out
