"""unshard and reduce inside ``torch.compile``: the same numbers as the eager transforms, written
with traceable collectives so that a whole training step is one graph.

[Note: unshard under torch.compile]
The eager :class:`~fsdpfn.transforms._sharding._UnshardUnit` leaves functorch with
``torch._C._DisableFuncTorch()``, starts asynchronous work and packs buffers in place: each of
these breaks a dynamo graph. While dynamo traces (:func:`fsdpfn.comm.compiling`), :func:`unshard`
and :func:`reduce` take this path instead: the same per-unit gather and reduce
(``fsdpfn/transforms/_unit_comm.py``: the unit's codecs pack and unpack), with the functional
collectives of :mod:`fsdpfn.comm` (see [Note: collectives under torch.compile]) as the wire. The
per-unit autograd Function keeps its meaning (backward = reduce: one reduce-scatter in
``reduce_dtype``, an all-reduce over ``replicate`` under HSDP, the mean/scale, the cast to the
master dtype), and dynamo traces both of its halves into the forward and backward graphs.

[Note: reshard-after-forward under torch.compile]
A ``zero3`` unit's gather is wrapped in ``torch.utils.checkpoint`` (non-reentrant): dynamo tags its
nodes for recomputation, and the min-cut partitioner (inductor's; ``backend="aot_eager"`` uses it
too) then saves the unit's local shards, not its full parameters, and runs the all-gather again in
the backward graph, as the eager runtime re-gathers before the unit's backward. ``zero2`` units
keep what the forward gathered. The numbers are the same either way (the gather is exact).

``torch.func.grad`` is refused here. In torch 2.13 ``torch.compile`` of a ``torch.func.grad``
silently drops a custom ``autograd.Function``'s backward (the compiled gradient is the
unreduced one), and autograd through functional collectives fails under ``torch.func``; a
silently wrong gradient is the one outcome we cannot allow, so :class:`CompileUnsupportedError`
says what to write instead (:func:`fsdpfn.compile`, or ``loss.backward()`` in the compiled
step). The check asks functorch for its current level: outside a transform dynamo traces the answer
(``None``); inside ``torch.func.grad`` it cannot, so under ``fullgraph=True`` dynamo raises its
``Unsupported`` error there, and without it the graph breaks and the step runs eagerly, with the
eager (correct) gradients.
"""

from __future__ import annotations

import ast
import warnings

import optree
import torch
from torch.distributed.tensor import DTensor

from fsdpfn import comm as C
from fsdpfn._plan import Plan
from fsdpfn._plan.axes import Role
from fsdpfn._plan.schedule import reshards_after_forward
from fsdpfn.transforms import _cp, _unit_comm
from fsdpfn.transforms._dtensor import from_local
from fsdpfn.transforms._guards import StepChecks, capture_step, check_captured_batch

__all__ = [
    "CompileUnsupportedError",
    "CompiledStep",
    "check_compilable",
    "compile",
    "recording_backend",
    "reduce_traced",
    "unshard_traced",
]


class CompileUnsupportedError(RuntimeError):
    """A compiled region asked for something fsdpfn cannot compile correctly (``torch.func.grad``
    under ``torch.compile``, a remat policy, expert parallelism); the message says what works
    instead."""


CompileUnsupportedError.__module__ = "fsdpfn"


def check_compilable(plan: Plan) -> None:
    """Raises :class:`CompileUnsupportedError` for plans whose compiled path does not exist yet."""
    check_traced_axes(plan)
    if plan.mesh is None:
        raise ValueError("this plan has no mesh; bind one with plan.bind(mesh) before compiling")
    if not _cp.checked(plan):  # see [Note: detecting attention that is not cp-aware]
        raise CompileUnsupportedError(
            f"this plan has a context-parallel axis (cp={plan.cp_size}) and no step of it has run eagerly yet: the check "
            "that the model's attention is cp-aware (calls fsdpfn.context_parallel_attention) counts calls at run time, "
            "which a compiled graph cannot. Keep fsdpfn.compile(..., verify=True) (the default: its first step runs "
            "eagerly and is checked), or run one eager step of the plan before the compiled ones"
        )
    te = [u.name for u in plan.units if u.fp8 and plan.mp.fp8 is not None and plan.mp.fp8.backend == "te"]
    if te:
        raise CompileUnsupportedError(
            f"units {te[:3]} hand FP8 weights to Transformer Engine (backend='te'), whose tensors do not trace; "
            "use backend='torch' under torch.compile, compile each unit's forward (Runtime.compile_units), or run eagerly"
        )
    remat = [(u.name, u.remat) for u in plan.units if u.remat != "none"]
    if remat:
        listed = ", ".join(f"{n!r} (remat={r!r})" for n, r in remat[:3]) + (" ..." if len(remat) > 3 else "")
        # The remat wrapper replays and checks the unit op by op ([Note: replay check]), which a
        # traced graph cannot; torch.compile's own partitioner decides what to recompute instead.
        raise CompileUnsupportedError(
            f"units {listed} rematerialise, which the compiled step does not: their recompute wraps the module's forward "
            "in an autograd Function dynamo cannot trace. Compile a plan without remat (the default remat=None), or keep "
            "remat and run the step eagerly: the pure loop (torch.func.grad over fsdpfn.unshard) or "
            "fsdpfn.runtime.Runtime, which rematerialises these units itself"
        )


def check_traced_axes(plan: Plan) -> None:
    """Raises :class:`CompileUnsupportedError` for a mesh with an ``ep`` axis whose expert
    layers route their rows as chosen. Expert units gather and reduce over ``ep`` x ``shard``
    like any unit over flattened axes, and those trace; what does not is such a layer's token
    exchange: how many rows each expert receives is data (the router's choice), read to the host
    for the all-to-all's split sizes, and dynamo stops there (a guard on a data-dependent value),
    while the compiled graph's collectives must have sizes known when it is compiled. A layer
    that pads each expert's rows to its capacity (``padded_capacity``, GShard's and Switch's
    dispatch) exchanges sizes that follow from the batch's shape alone, and compiles. Refused
    before anything is traced, by name, rather than as dynamo's error from inside the layer."""
    routed = [u.label for u in plan.units if u.experts and u.padded_capacity is None]
    if plan.axes.dim(Role.EP) is not None and routed:
        raise CompileUnsupportedError(
            f"expert parallelism (ep={plan.ep_size}, mesh {plan.axes.describe()}) compiles only with padded expert layers: "
            f"the layers of {routed[:3]} send each expert the rows its router chose, so the all-to-alls' split sizes are "
            "decided at run time (data-dependent sizes, which a compiled graph cannot hold). Build the MoE layers with "
            "fsdpfn.models.MoEConfig(capacity_factor=..., pad_to_capacity=True) (each expert's rows padded to its "
            "capacity: fixed sizes), or run the step eagerly: the pure loop (torch.func.grad over fsdpfn.unshard) or "
            "fsdpfn.runtime.Runtime"
        )


def _refuse_functorch(where: str) -> None:
    # dynamo cannot trace maybe_current_level() inside a torch.func transform; it traces
    # peek_interpreter_stack() (a functorch interpreter inside one, None outside) in both places.
    # Raised while dynamo traces, this reaches the user inside dynamo's Unsupported error under
    # fullgraph=True (its text carries this message); without fullgraph the step runs eagerly,
    # with the eager (correct) gradients.
    if isinstance(torch._C._functorch.peek_interpreter_stack(), torch._C._functorch.CInterpreter):
        raise CompileUnsupportedError(
            f"fsdpfn: {where} inside torch.func.grad/vjp under torch.compile: torch drops the backward of the "
            "gather (the gradients would come back unreduced). Compile the loss and differentiate with "
            "loss.backward() or torch.autograd.grad, e.g. step = fsdpfn.compile(loss_fn) gives "
            "(grads, loss) like torch.func.grad_and_value; or call torch.func.grad without torch.compile."
        )


def _refusal(error: BaseException | None) -> CompileUnsupportedError | None:
    """The :class:`CompileUnsupportedError` fsdpfn raised while dynamo traced, out of the
    ``Unsupported`` error dynamo turns every exception of a ``fullgraph`` trace into (the original
    is kept only as the text of an ``Observed...Error`` among its causes), or ``None``."""
    from torch._dynamo.exc import get_dynamo_observed_exception

    observed = get_dynamo_observed_exception(CompileUnsupportedError)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, observed):
            text = str(error)
            head = f"{CompileUnsupportedError.__name__}("
            if head in text:
                try:  # "raised exception CompileUnsupportedError('...')": the message, unescaped
                    args = ast.literal_eval(text[text.index(head) + len(head) - 1 :].strip())
                    text = args if isinstance(args, str) else str(args[0])
                except (ValueError, SyntaxError, IndexError):
                    pass
            return CompileUnsupportedError(text)
        error = error.__cause__ or error.__context__
    return None


_WIRE = _unit_comm.TracedWire()


class _TracedUnshardUnit(torch.autograd.Function):
    """One unit's all-gather; backward: its reduce (see [Note: unshard under torch.compile])."""

    @staticmethod
    def forward(ctx, info, *locals_):
        plan, unit, op, scale = info
        ctx.info = info
        pending, finish = _unit_comm.gather(plan, unit, list(locals_), _WIRE)
        return tuple(finish(pending.wait()))

    @staticmethod
    def backward(ctx, *grads):
        plan, unit, op, scale = ctx.info
        _, finish = _unit_comm.reduce(plan, unit, list(grads), op, scale, _WIRE)
        return (None, *finish())


def unshard_traced(params, plan: Plan, grad_op: str = "mean", grad_scale=None, reshard=None) -> dict[str, torch.Tensor]:
    """:func:`fsdpfn.unshard` while dynamo traces. ``reshard``: names of the units the backward
    graph gathers again (the runtime passes the units its schedule reshards after forward).
    Default: those the schedule's own rule reshards with ``reshard_after_forward=True``
    (:func:`fsdpfn._plan.schedule.reshards_after_forward`): every ``zero3`` unit, the root too,
    since one graph holds the whole step and a kept root would be saved from its first use to
    its last."""
    _refuse_functorch("fsdpfn.unshard")
    _unit_comm.check_op(grad_op)
    check_compilable(plan)
    out: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        locals_ = [
            params[p.name].to_local() if isinstance(params[p.name], DTensor) else params[p.name] for p in unit.params
        ]
        info = (plan, unit, grad_op, grad_scale)
        again = reshards_after_forward(plan, unit.name, True) if reshard is None else unit.name in reshard
        if again and torch.is_grad_enabled():
            # [Note: reshard-after-forward under torch.compile]
            fulls = torch.utils.checkpoint.checkpoint(_TracedUnshardUnit.apply, info, *locals_, use_reentrant=False)
        else:
            fulls = _TracedUnshardUnit.apply(info, *locals_)
        out.update(zip((p.name for p in unit.params), fulls))
    return out


def reduce_traced(full_grads, plan: Plan, op: str, scale) -> dict[str, DTensor]:
    """:func:`fsdpfn.reduce` while dynamo traces."""
    _unit_comm.check_op(op)
    check_compilable(plan)
    out: dict[str, DTensor] = {}
    for unit in plan.units:
        _, finish = _unit_comm.reduce(plan, unit, [full_grads[p.name] for p in unit.params], op, scale, _WIRE)
        for p, g in zip(unit.params, finish()):
            out[p.name] = from_local(plan, p.name, g)
    return out


class CompiledStep:
    """``(grads, loss)`` of ``loss_fn(params, *args)``, compiled as one graph per step (see
    :func:`compile`). ``collectives`` lists what one call runs, read from the compiled forward and
    backward graphs when they were compiled."""

    def __init__(
        self,
        loss_fn,
        has_aux: bool,
        fullgraph: bool,
        overlap: bool,
        options: dict,
        compiler: str = "inductor",
        bucket: bool = False,
        verify: bool = True,
    ):
        self._graphs: dict[str, list] = {}
        self.checks = StepChecks(verify=verify)  # see [Note: the checks of a step]
        backend = recording_backend(compiler, self._graphs, overlap, bucket)
        self.loss_fn, self.has_aux = loss_fn, has_aux
        self._n_outputs = 1
        self._compiled = torch.compile(loss_fn, backend=backend, fullgraph=fullgraph, **options)

    @property
    def saved_for_backward(self) -> list[tuple]:
        """``(shape, bytes)`` of each tensor the compiled forward graph keeps for the backward
        graph; 0 bytes for a tensor the step was given (a local shard), which costs nothing more.
        Under ``zero3`` no unit's full parameters are among them (see [Note: reshard-after-forward
        under torch.compile]). Empty before the first call."""
        outs = self._graphs.get("outputs", [])
        return outs[self._n_outputs :]

    @property
    def collectives(self) -> list:
        """:class:`~fsdpfn.comm.CollectiveCall` s of one step: the forward graph's, then the
        backward graph's (empty before the first call compiled them)."""
        return self._graphs.get("forward", []) + self._graphs.get("backward", [])

    def __call__(self, params, *args, **kwargs):
        batch, whole = self.checks.batch_due(), self.checks.verify_due()
        if batch or whole:  # the root hook cannot: it runs traced. One capture serves both checks.
            cap = capture_step(self.loss_fn, params, args, kwargs)
            if batch:
                check_captured_batch(cap)
            if whole:
                from fsdpfn.transforms._verify import verify_captured

                verify_captured(self.loss_fn, params, args, kwargs, cap)
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        with torch.enable_grad():
            try:
                out = self._compiled(leaves, *args, **kwargs)
            except Exception as e:
                refused = _refusal(e)  # fsdpfn's own refusal, not dynamo's wrapper of it
                if refused is None:
                    raise
                raise refused from e
            loss, aux = out if self.has_aux else (out, None)
            self._n_outputs = 1 + sum(isinstance(t, torch.Tensor) for t in optree.tree_leaves(aux, none_is_leaf=True))  # type: ignore[arg-type]  # optree's PyTree type leaves out None
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"fsdpfn.compile: loss_fn must return a scalar tensor{' (and aux)' if self.has_aux else ''}, "
                    f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}"
                )
            names = list(leaves)
            got = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        C.count_compiled(self.collectives)
        grads = {n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(names, got)}
        return ((grads, aux) if self.has_aux else grads), loss.detach()


def _output_bytes(gm) -> list[tuple]:
    """``(shape, bytes)`` of each output of an AOTAutograd forward graph (the loss and aux, then
    what the forward saves for the backward); 0 bytes for the graph's own inputs passed through
    (the caller holds them anyway)."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0]]
    return [
        (tuple(v.shape), v.numel() * v.element_size() if a.op != "placeholder" else 0)
        for a, v in zip(out.args[0], vals)
        if isinstance(v, torch.Tensor)
    ]


def recording_backend(compiler: str, graphs: dict, overlap: bool = False, bucket: bool = False):
    """A ``torch.compile`` backend that compiles with ``compiler`` (:data:`COMPILERS`) and lists
    the collectives of the forward and backward graphs AOTAutograd makes into
    ``graphs["forward"]`` / ``graphs["backward"]`` (see [Note: collectives under torch.compile]),
    so callers can count them on every call of the compiled code."""
    if compiler not in COMPILERS:
        raise ValueError(f"backend must be one of {COMPILERS}, got {compiler!r}")
    if compiler == "aot_eager":  # AOTAutograd's forward and backward graphs, run as traced (no code generation)
        from torch._dynamo.backends.common import aot_autograd

        def record(kind):
            def fn(gm, example_inputs):
                graphs[kind] = C.graph_collectives(gm)
                if kind == "forward":
                    graphs["outputs"] = _output_bytes(gm)
                return gm

            return fn

        from torch._functorch.partitioners import min_cut_rematerialization_partition

        # inductor's partitioner, so that what the forward saves (and recomputes) is what inductor's would
        return aot_autograd(
            fw_compiler=record("forward"),
            bw_compiler=record("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )
    with warnings.catch_warnings():  # importing inductor loads torch modules that warn of their own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        graphs[kind] = C.graph_collectives(gm)
        if kind == "forward":
            graphs["outputs"] = _output_bytes(gm)
        out = compile_fx_inner(gm, example_inputs, **kwargs)
        if bucket:  # the post-grad passes (bucketing among them) rewrote gm in place: list what runs
            graphs[kind] = C.graph_collectives(gm)
        return out

    patches = {**(OVERLAP_PASSES if overlap else {}), **(BUCKET_PASSES if bucket else {})} or None

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    return backend


COMPILERS = ("inductor", "aot_eager")


# inductor's FX passes that merge collectives of one kind into fewer, larger ones (the kernel
# cache is off so that the passes run, and the listed collectives are the merged ones, every time).
BUCKET_PASSES = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all", "force_disable_caches": True}


# inductor's passes that move collectives: waits sunk to their first use, collectives raised to
# where their inputs are ready, compute reordered to fill the time between a collective and its wait.
OVERLAP_PASSES = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}


def compile(
    loss_fn,
    *,
    has_aux: bool = False,
    fullgraph: bool = True,
    overlap: bool = False,
    bucket: bool = False,
    backend: str = "inductor",
    verify: bool = True,
    **options,
) -> CompiledStep:
    """``torch.func.grad_and_value(loss_fn)``, compiled: one graph for the forward and one for the
    backward, with every unit's all-gather and reduce-scatter inside them where inductor
    schedules them (see [Note: unshard under torch.compile]).

    ``loss_fn(params, *args)`` is written as for ``torch.func.grad``, with :func:`fsdpfn.unshard`
    inside. The returned step differentiates with ``torch.autograd.grad`` (``torch.compile`` of
    ``torch.func.grad`` is not safe with fsdpfn, see :class:`fsdpfn.CompileUnsupportedError`),
    returns the same sharded, reduced gradients as the eager pure loop, and counts its
    collectives (listed once, when compiled) in any :func:`fsdpfn.count_collectives` block.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (``(loss, aux)`` with ``has_aux``).
      has_aux: as in ``torch.func.grad_and_value``.
      fullgraph: refuse graph breaks (the default; a break raises instead of splitting the step).
      overlap: turn on inductor's passes that reorder collectives and compute for overlap
        (:data:`OVERLAP_PASSES`: ``sink_waits``, ``raise_comms``, ``reorder_compute_for_overlap``);
        the numbers do not change, only the order.
      bucket: turn on inductor's FX bucketing passes (:data:`BUCKET_PASSES`): the all-gathers of
        several units merged into one, and their reduce-scatters, fewer and larger collectives
        (``step.collectives`` lists the merged ones). fsdpfn already sends one collective per unit.
      backend: ``"inductor"`` (the default: generated kernels) or ``"aot_eager"`` (the same
        traced forward and backward graphs, collectives included, run op by op without code
        generation: compiles in seconds, for checking a plan compiles).
      verify: before the first step, check eagerly that the plan computes what one process
        computes (:func:`fsdpfn.verify_step`).
      **options: passed to ``torch.compile`` (``mode``, ``dynamic``, ``options``).

    Returns:
      a :class:`CompiledStep`: ``step(params, *args) -> (grads, loss)``.

    Example:
      >>> def loss_fn(params, x, y):
      ...     out = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
      ...     return F.cross_entropy(out.flatten(0, 1), y.flatten())
      >>> step = fsdpfn.compile(loss_fn)
      >>> grads, loss = step(params, x, y)  # doctest: +SKIP
    """
    if not callable(loss_fn):
        raise ValueError(f"fsdpfn.compile: loss_fn must be callable, got {type(loss_fn).__name__}")
    if backend not in COMPILERS:
        raise ValueError(f"fsdpfn.compile: backend must be one of {COMPILERS}, got {backend!r}")
    if (overlap or bucket) and backend != "inductor":
        raise ValueError("fsdpfn.compile: overlap=True and bucket=True are inductor's passes; use backend='inductor'")
    return CompiledStep(loss_fn, has_aux, fullgraph, overlap, options, backend, bucket, verify)
