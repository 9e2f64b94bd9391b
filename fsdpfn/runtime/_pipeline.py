"""The pipeline runtime: runs a pipeline schedule's op lists (see [Note: pipeline ops] in
``fsdpfn/_plan/pipeline.py``), one per pp rank, with micro-batches and gradient accumulation.

[Note: the pipeline executor]
Each pp rank walks its own list, in order, op by op:

- ``stage_forward s m``: stage ``s``'s module (a ``pipeline_stage`` of a reference model, or the
  user's) on micro-batch ``m``'s input (the tokens on stage 0, else the activation received or
  computed by stage ``s - 1`` on this rank), with the stage's unsharded parameters as autograd
  leaves; the last stage also applies ``loss_fn``. The graph is kept until the backward.
- ``stage_backward s m``: ``torch.autograd.grad`` of that graph, seeded with the gradient of
  the stage's output (received, or from stage ``s + 1`` on this rank); on the last stage, of
  the micro-batch's loss divided by ``m``. So the accumulated gradient is that of
  ``sum_k loss_k / m``, which for equal micro-batches and a mean loss is the gradient of the
  whole batch's mean: one process's. The parameters' gradients join the unit's locally summed
  full gradients (the existing executor's accumulation, in the unit's reduce dtype).
- ``stage_backward_input s m`` / ``stage_backward_weight s m`` (the zero-bubble schedule's
  split): the input half is ``torch.autograd.grad`` of the same graph, seeded alike, with
  respect to the stage's input only, keeping the graph (``retain_graph``) and the seed; the
  weight half, later, with respect to the parameters only, then frees both, and its gradients
  join the accumulator exactly as ``stage_backward``'s. Each half walks the graph autograd
  prunes to what reaches its own leaves, and a node's incoming gradients come from nodes
  that reach the same leaves, summed in the engine's same order: both halves give bitwise
  ``stage_backward``'s gradients (the pp parity tests check it against 1F1B). Autograd cannot
  keep the activation gradients of the input half for the weight half, so the weight half
  walks the graph from the stage's output again: on this runtime the split reproduces the
  schedule's order and numerics, not its speed-up (a stage's backward costs up to one more
  activation-gradient pass, and a tp stage's backward collectives on that path run in both
  halves, in the same order on every tp rank).
- ``send_*`` / ``recv_*``: point-to-point transfers over the pp group (see [Note: pipeline
  transfers are point-to-point] in ``fsdpfn/comm/_pp.py``). An activation travels with a
  small header (its shape and dtype): the receiver cannot know the shape a user's stage
  returns. A gradient needs none, it is shaped as the output the receiver kept.
- ``gather``, ``wait``, ``free``, ``reduce``, ``wait_reduce``, ``copy_in``, ``copy_out``: run by
  one :class:`~fsdpfn.runtime._executor.Executor` per stage, over the stage's plan
  (``plan.stage_plan(s)``: the stage's units on the mesh without pp), exactly as the one-stage
  runtime runs them: the same gather buffers, codecs, reduce (mean over data-parallel ranks) and
  offload copies.

The schedule is validated (:func:`fsdpfn.validate_pipeline`) when the runtime is built, on every
rank, before anything is communicated: a hand-edited list that would deadlock or use data
before it exists is refused with the op named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn._plan import PipelinedPlan, Plan
from fsdpfn._plan.attention import CP_STRATEGIES
from fsdpfn._plan.axes import Role
from fsdpfn._plan.interpret import PIPELINE_ACTIONS, bind_handlers
from fsdpfn._plan.pipeline import (
    AnyOp,
    PipeKind,
    PipelineSchedule,
    PipeOp,
    forward_only,
    pipeline_schedule,
    validate_pipeline,
)
from fsdpfn._plan.schedule import Op
from fsdpfn._plan.schedule import schedule as default_schedule
from fsdpfn.comm import broadcast, count_compiled, group_ranks, pp_recv, pp_send, ranks_group, uncounted
from fsdpfn.runtime._comm import comm_for
from fsdpfn.runtime._executor import Executor
from fsdpfn.runtime._split_backward import WeightHalf, backward_input
from fsdpfn.transforms import (
    CompileUnsupportedError,
    StepChecks,
    VerifyReport,
    apply_remat,
    apply_tp,
    check_batch,
    check_params,
    context_parallel,
    context_parallel_shard,
    recording_backend,
    verify_stage,
    verify_stage_loss,
)

__all__ = ["PipelineProfile", "PipelineRuntime"]

# An activation's header: ndim, dtype code, then the dims (padded with -1).
_HEADER = 10
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


def _call_stage(module: nn.Module, params: dict, x):
    """A stage's forward on the given parameters (what :meth:`PipelineRuntime.compile_stages`
    compiles)."""
    return torch.func.functional_call(module, params, (x,))


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ValueError(
            f"a pipeline stage returned a {t.dtype} tensor of shape {tuple(t.shape)}; stages pass tensors of at "
            f"most {_HEADER - 2} dims and dtype one of {[str(d) for d in _DTYPES]}"
        )
    h = torch.full((_HEADER,), -1, dtype=torch.int64)
    h[0], h[1] = t.dim(), _DTYPES.index(t.dtype)
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


@dataclasses.dataclass(frozen=True)
class PipelineProfile:
    """One pp rank's record of a step (``PipelineRuntime(..., profile=True)``).

    Attributes:
      rank: the pp rank.
      schedule: the schedule's name.
      timeline: ``(op, start, end)`` for each op in the order it ran, in seconds from the
        step's start (a recv's time is mostly its wait for the peer).
      activations: ``(stage, micro-batch, bytes)`` per forward: the storages it saved for its
        backward (the stage's input and intermediates, not the parameters), each counted once.
      peak_activations: the most activation bytes this rank kept at once, each forward's
        counted from the forward until its backward (a split backward's weight half) ran.

    Example:
      >>> p = PipelineProfile(0, "1f1b", (("stage_forward s0 m0", 0.0, 1.0), ("recv_grad s0 m0", 1.0, 2.5),
      ...                                 ("stage_backward s0 m0", 2.5, 4.5)), ((0, 0, 1024),), 1024)
      >>> p.busy, p.makespan, round(p.bubble, 4)
      (3.0, 4.5, 0.3333)
    """

    rank: int
    schedule: str
    timeline: tuple[tuple[str, float, float], ...]
    activations: tuple[tuple[int, int, int], ...]
    peak_activations: int

    @property
    def busy(self) -> float:
        """Seconds spent in stage forwards and backwards."""
        return sum(end - start for op, start, end in self.timeline if op.startswith("stage_"))

    @property
    def makespan(self) -> float:
        """Seconds from the step's start to this rank's last op's end."""
        return max((end for _, _, end in self.timeline), default=0.0)

    @property
    def bubble(self) -> float:
        """The fraction of the step this rank did not compute (waits, transfers, FSDP ops)."""
        return 1.0 - self.busy / self.makespan if self.makespan else 0.0

    def compute_times(self) -> dict[str, list[float]]:
        """Seconds of each compute op kind (``stage_forward``, ``stage_backward``, ...), in order."""
        out: dict[str, list[float]] = {}
        for op, start, end in self.timeline:
            if op.startswith("stage_"):
                out.setdefault(op.split()[0], []).append(end - start)
        return out


@dataclasses.dataclass
class _StepState:
    """What one training or evaluation step of a :class:`PipelineRuntime` holds, as one value: a
    fresh one each call, released (its tensors dropped) when the call ends, so nothing of one
    step reaches the next. Keyed by ``(stage, micro-batch)``."""

    xs: tuple  # the micro-batches' inputs (this cp rank's part of each sequence)
    ys: tuple  # and their targets
    train: bool  # False: evaluate (no graph, nothing saved for a backward)
    acts: dict = dataclasses.field(default_factory=dict)  # a stage's input, before its forward
    grads: dict = dataclasses.field(default_factory=dict)  # a stage's output gradient, before its backward
    outbox: dict = dataclasses.field(default_factory=dict)  # computed, to be sent
    saved: dict = dataclasses.field(default_factory=dict)  # forward graphs awaiting their backward
    losses: dict = dataclasses.field(default_factory=dict)  # micro-batch -> its loss (the last stage)
    sends: dict = dataclasses.field(default_factory=dict)  # transfers in flight, by their send op
    halves: dict = dataclasses.field(default_factory=dict)  # an input half's leftovers, for its weight half
    kept: dict = dataclasses.field(default_factory=dict)  # activation bytes of each forward awaiting its backward
    peak_kept: int = 0
    kept_log: list = dataclasses.field(default_factory=list)  # (stage, micro-batch, bytes) as each forward ends

    def release(self) -> None:
        """Drops the step's tensors (what a failed step left in flight too)."""
        for held in (self.sends, self.saved, self.acts, self.grads, self.outbox, self.halves):
            held.clear()


class PipelineRuntime:
    """Trains a pipelined plan: each pp rank runs its stages' micro-batches in the order of a
    pipeline schedule (GPipe, 1F1B, interleaved 1F1B, zero bubble, or a hand-edited one), with its stages'
    FSDP gathers and reduces over the stage's data-parallel ranks (see [Note: the pipeline
    executor]).

    Args:
      model: the module the plan was made for (its parameters are never read: they come from
        the shards you pass).
      plan: a pipelined plan (a mesh with a ``pp`` axis), bound to the mesh.
      schedule: a name for :func:`fsdpfn.pipeline_schedule` (``"gpipe"``, ``"1f1b"``,
        ``"interleaved_1f1b"``, ``"zero_bubble"``) or a :class:`fsdpfn.PipelineSchedule` made for this plan (e.g.
        a printed one edited and parsed back).
      micro_batches: micro-batches per step, ``m`` (with a schedule object: its own, or ``None``).
      loss_fn: ``loss_fn(output, target)``: the last stage's output and a micro-batch's targets
        to the micro-batch's mean loss.
      stages: how to run a stage's forward. ``None``: ``model.pipeline_stage(units)`` for each
        stage's units, which fsdpfn's reference models provide (:meth:`fsdpfn.models.GPT.pipeline_stage`,
        as torchtitan splits its models); else, as torch.distributed.pipelining's
        ``PipelineStage`` takes a submodule, ``{stage index: nn.Module}`` for the stages this rank
        runs (or a callable ``stages(s, units) -> nn.Module``): the module takes the previous
        stage's output (the inputs on stage 0) and returns the next stage's input (what
        ``loss_fn`` takes on the last), and its parameters must be exactly the stage's units'
        parameters of ``model`` (the same objects: share the submodules, do not copy them).
      prefetch: the FSDP prefetch inside each stage's gathers (``pipeline_schedule``'s).
      device: where collectives run (``"cpu"``: gloo).
      cp_strategy: with a ``cp`` axis beside ``pp``: the context-parallel attention's strategy
        (one of :func:`fsdpfn.context_parallel`'s strategies). Each cp rank then
        takes its part of every sequence of the batch (:func:`fsdpfn.context_parallel_shard`,
        inputs and targets alike), and the stages run inside ``fsdpfn.context_parallel``: the
        loss is the mean over this rank's tokens, the gradients averaged over dp x cp.
      verify: on the first step, before it, check each stage against the same code unsharded,
        on its first micro-batch, stage after stage (:func:`fsdpfn.verify`'s check, over the
        stage's ranks), then ``loss_fn`` against the loss of every rank's rows (see [Note:
        checking a pipeline's stages]): a stage whose tensor-, expert- or context-parallel layout
        its code does not compute as planned, or a loss that is not the mean over the batch,
        raises :class:`fsdpfn.VerificationError` on every rank. :attr:`verified` holds the
        reports, by stage.
      profile: record each step's :class:`PipelineProfile` in :attr:`last_profile`: when each
        op ran, and the activation bytes each micro-batch's forward kept for its backward (a
        saved-tensor hook per forward, which costs a little time).

    Example (one process here, with a pp axis of size 1 and two virtual stages; on 2 pp ranks
    build the mesh ``(2, 1)`` and run the same lines on every rank):
      >>> pp_mesh = fsdpfn.testing.mesh((1, 1), ("pp", "dp"))
      >>> units = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]  # the ends as units of their own
      >>> pp_plan = fsdpfn.pipeline_plan(model, pp_mesh, units=units, stages=2)
      >>> ce = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
      >>> pipe = fsdpfn.runtime.PipelineRuntime(model, pp_plan, "gpipe", micro_batches=2, loss_fn=ce)
      >>> pp_params = pipe.shard(model)                   # this rank's stages' parameters
      >>> grads, loss = pipe.step(pp_params, x, y)        # x, y: (batch, seq), batch % 2 == 0
      >>> grads["head.weight"].shape, torch.allclose(loss, ce(model(x), y))
      (torch.Size([64, 32]), True)
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinedPlan,
        schedule: str | PipelineSchedule = "1f1b",
        micro_batches: int | None = 8,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        stages=None,
        prefetch: int = 1,
        device: str | torch.device | None = "cpu",
        cp_strategy: str = "allgather",
        profile: bool = False,
        verify: bool = True,
    ):
        if not isinstance(plan, PipelinedPlan):
            raise ValueError(
                "PipelineRuntime needs a fsdpfn.PipelinedPlan (fsdpfn.pipeline_plan(model, mesh) on a mesh with a 'pp' "
                f"axis), got {type(plan).__name__}"
                + (
                    f" (mesh {plan.axes.describe()}); for one stage use fsdpfn.runtime.Runtime"
                    if isinstance(plan, Plan)
                    else ""
                )
            )
        if plan.mesh is None:
            raise ValueError("the plan has no mesh; bind one with plan.bind(mesh) before building a PipelineRuntime")
        if cp_strategy not in CP_STRATEGIES:
            raise ValueError(f"cp_strategy must be one of {CP_STRATEGIES}, got {cp_strategy!r}")
        if not callable(loss_fn):
            raise ValueError("loss_fn must be a callable loss_fn(output, target) -> the micro-batch's mean loss")
        if isinstance(schedule, str):
            if micro_batches is None:
                raise ValueError("micro_batches: give the number of micro-batches per step (e.g. micro_batches=8)")
            ps = pipeline_schedule(plan, schedule, micro_batches, prefetch=prefetch)
        elif isinstance(schedule, PipelineSchedule):
            if micro_batches is not None and micro_batches != schedule.micro_batches:
                raise ValueError(
                    f"micro_batches={micro_batches}, but the schedule runs {schedule.micro_batches}; pass "
                    f"micro_batches=None (or {schedule.micro_batches}) with a schedule object"
                )
            ps = schedule
        else:
            raise ValueError(
                f"schedule must be a pipeline schedule name (gpipe, 1f1b, interleaved_1f1b, zero_bubble) or an "
                f"fsdpfn.PipelineSchedule, got {type(schedule).__name__}"
            )
        # Every rank checks every rank's list, before the first transfer: a deadlock is refused
        # here, naming the op, instead of leaving ranks blocked in recvs.
        validate_pipeline(ps, plan)
        self.model, self.plan, self.schedule, self.loss_fn = model, plan, ps, loss_fn
        pp_name = plan.axes.names[plan.axes.dim(Role.PP)]  # type: ignore[index]
        self.pp_rank = plan.mesh.get_local_rank(pp_name)
        self.group = plan.mesh.get_group(pp_name)
        self._global = group_ranks(self.group)
        st = plan.stages
        self.stages_here = st.stages_of(self.pp_rank)
        self.stage_plans = {s: plan.stage_plan(s) for s in self.stages_here}
        self.modules = {s: self._stage_module(stages, s) for s in self.stages_here}
        self._names = {s: self._param_names(s) for s in self.stages_here}
        apply_tp(model, plan)  # the tensor-parallel activation collectives of every stage's modules
        # Stages run the model's own unit modules: a unit the plan rematerialises keeps only its
        # inputs and recomputes (and checks the replay) in its stage's backward, as in the pure loop.
        apply_remat(model, plan)
        comm = comm_for(device)
        self._ex = {s: Executor(sp, default_schedule(sp, prefetch), comm) for s, sp in self.stage_plans.items()}
        self._stage_of_unit = {u.name: s for s, sp in self.stage_plans.items() for u in sp.units}
        self.last_ops: list[str] = []
        # Weight halves of this rank so far, and how many ran without walking their stage's graph
        # again ([Note: the weight half without a second walk]); the rest fell back to it.
        self.weight_halves = [0, 0]
        self._prefetch = prefetch
        self._forward_only: PipelineSchedule | None = None  # built on the first evaluate
        self._profile = profile
        self._cp_strategy = cp_strategy
        self.last_profile: PipelineProfile | None = None
        self._step = _StepState((), (), True)  # the step running now (none yet)
        self._handlers = bind_handlers(self, PIPELINE_ACTIONS)  # see [Note: one interpreter protocol]
        self.checks = StepChecks(verify=verify)  # see [Note: the checks of a step]
        # The loss check's process group over the last stage's ranks, made here by every rank in
        # the same order, as torch's groups must be (see fsdpfn.comm.ranks_group).
        last = plan.mesh.mesh.select(cast(int, plan.axes.dim(Role.PP)), ps.rank_of(ps.num_stages - 1))
        self._last_stage_group = ranks_group(last.flatten().tolist()) if self.checks.verify_left else None
        self.verified: dict[int, VerifyReport] = {}  # stage -> its first step's check
        self._compiled: dict[int, tuple] = {}  # stage -> (compiled forward, its graphs' collectives)

    def compile_stages(self, stages=None, *, backend: str = "inductor", fullgraph: bool = True, **options) -> list[int]:
        """Compiles each stage's forward on this rank with ``torch.compile`` and keeps the
        pipeline around them: the gathers, frees, reduces, point-to-point transfers and the op
        lists' order stay the runtime's, eager, exactly as without compile; only a stage's own
        code (its layers, on the gathered parameters) is compiled, forward and backward, as
        :meth:`fsdpfn.runtime.Runtime.compile_units` does for units. Collectives inside a stage
        (tensor-parallel activations) are traced, listed when compiled and counted on every call.

        Args:
          stages: the stage indices to compile (default: every stage on this rank).
          backend: ``"inductor"`` (generated kernels) or ``"aot_eager"`` (the traced graphs run
            op by op: compiles in seconds, for checking).
          fullgraph: refuse graph breaks inside a stage (the default).
          **options: passed to ``torch.compile``.

        Raises:
          fsdpfn.CompileUnsupportedError: the schedule splits each backward in an input half and
            a weight half (``"zero_bubble"``): the split follows autograd's graph of the stage,
            of which a compiled stage is one node.
          ValueError: a stage that does not run on this rank, or a second call.

        Returns:
          the compiled stages.

        Example:
          >>> pp_plan = fsdpfn.pipeline_plan(model, fsdpfn.testing.mesh((1, 1), ("pp", "dp")), units=["embed", "pos", "blocks.0",
          ...                       "blocks.1", "norm", "head"], stages=2)
          >>> ce = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
          >>> pipe = fsdpfn.runtime.PipelineRuntime(model, pp_plan, "gpipe", micro_batches=2, loss_fn=ce)
          >>> pipe.compile_stages(backend="aot_eager")
          [0, 1]
        """
        if self._compiled:
            raise ValueError(
                "compile_stages was already called on this PipelineRuntime; build a new one to compile others"
            )
        split = {PipeKind.STAGE_BACKWARD_INPUT, PipeKind.STAGE_BACKWARD_WEIGHT}
        if any(isinstance(op, PipeOp) and op.kind in split for ops in self.schedule.ranks for op in ops):
            raise CompileUnsupportedError(
                f"compile_stages: the {self.schedule.name!r} schedule splits each stage's backward into an input half and "
                "a weight half along autograd's graph of the stage, and a compiled stage is one node of that graph. Use "
                "the '1f1b', 'interleaved_1f1b' or 'gpipe' schedule with compiled stages, or run zero_bubble eagerly"
            )
        chosen = sorted(self.stages_here) if stages is None else [stages] if isinstance(stages, int) else list(stages)
        for s in chosen:
            if s not in self.stages_here:
                raise ValueError(
                    f"compile_stages: stage {s!r} does not run on this rank (pp rank {self.pp_rank} runs stages "
                    f"{list(self.stages_here)})"
                )
        for s in chosen:
            graphs: dict[str, list] = {}
            fn = torch.compile(_call_stage, backend=recording_backend(backend, graphs), fullgraph=fullgraph, **options)
            self._compiled[s] = (fn, graphs)
        return chosen

    @property
    def compiled_stages(self) -> list[int]:
        """The stages whose forward :meth:`compile_stages` compiled."""
        return sorted(self._compiled)

    def _run_stage(self, s: int, params: dict, x):
        """Stage ``s``'s module on ``params`` (by its own names), compiled or not; a compiled
        forward's collectives are counted per call (its backward's after each backward)."""
        compiled = self._compiled.get(s)
        if compiled is None:
            return _call_stage(self.modules[s], params, x)
        fn, graphs = compiled
        out = fn(self.modules[s], params, x)
        count_compiled(graphs.get("forward", []))  # an evaluation's graph lists the same forward exchanges
        return out

    def _count_backward(self, s: int) -> None:
        if s in self._compiled:
            count_compiled(self._compiled[s][1].get("backward", []))

    # ---- set-up --------------------------------------------------------------------------

    def _stage_module(self, stages, s: int) -> nn.Module:
        units = list(self.plan.stages.units[s])
        if stages is None:
            build = getattr(self.model, "pipeline_stage", None)
            if build is None:
                raise ValueError(
                    f"{type(self.model).__name__} has no pipeline_stage(units) method; pass stages={{stage index: "
                    "module}} (for this rank's stages) or stages=callable(s, units) -> module"
                )
            return build(units)
        if isinstance(stages, Mapping):
            if s not in stages:
                raise ValueError(
                    f"stages has no module for stage {s} (units {units}), which runs on this rank (pp rank "
                    f"{self.pp_rank}); give one for each of stages {list(self.stages_here)}"
                )
            return stages[s]
        if callable(stages):
            return stages(s, tuple(units))
        raise ValueError(
            f"stages must be None, a dict {{stage index: nn.Module}} or a callable (s, units) -> nn.Module, got {type(stages).__name__}"
        )

    def _param_names(self, s: int) -> list[tuple[str, str]]:
        """``(module-local name, plan name)`` of the stage module's parameters, matched by
        identity with the model's: a stage shares the model's parameters, so its own naming
        (a wrapper, a submodule) does not matter."""
        by_id = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        module = self.modules[s]
        pairs = [(local, by_id.get(id(p))) for local, p in module.named_parameters()]
        foreign = [local for local, name in pairs if name is None]
        expected = set(self.stage_plans[s].param_names)
        got = {name for _, name in pairs}
        if foreign or got != expected:
            missing = sorted(expected - got)
            extra = sorted(n for n in got - expected if n is not None)
            raise ValueError(
                f"stage {s}'s module must hold exactly the parameters of its units {list(self.plan.stages.units[s])}"
                f" (the model's own objects): missing {missing[:4]}, from other stages {extra[:4]}, not the "
                f"model's {foreign[:4]}; share the model's submodules (do not copy them)"
            )
        return pairs  # type: ignore[return-value]

    def shard(self, model_or_params) -> dict[str, DTensor]:
        """This rank's shards of its stages' parameters (:func:`fsdpfn.shard` over each stage's
        plan), the ``params`` :meth:`step` takes.

        Example:
          >>> pp_plan = fsdpfn.pipeline_plan(model, fsdpfn.testing.mesh((1, 1), ("pp", "dp")), units=["embed", "pos", "blocks.0",
          ...                       "blocks.1", "norm", "head"])
          >>> pipe = fsdpfn.runtime.PipelineRuntime(model, pp_plan, "1f1b", 2, loss_fn=lambda out, y: out.mean())
          >>> sorted(pipe.shard(model)) == sorted(pp_plan.param_names)  # pp=1: every stage is here
          True
        """
        from fsdpfn.transforms import shard

        full = (
            dict(model_or_params.named_parameters())
            if isinstance(model_or_params, nn.Module)
            else dict(model_or_params)
        )
        out: dict[str, DTensor] = {}
        for s, sp in self.stage_plans.items():
            out.update(shard({n: full[n] for n in sp.param_names}, sp))
        return out

    # ---- a step --------------------------------------------------------------------------

    def step(
        self, params: Mapping[str, torch.Tensor], inputs: torch.Tensor, targets: Any
    ) -> tuple[dict[str, DTensor | None], torch.Tensor]:
        """One training step: forward and backward of every micro-batch through the pipeline.

        Args:
          params: this rank's stages' sharded parameters (:meth:`shard`, or an optimizer update).
          inputs: the stage-0 input of this data-parallel rank's batch (tokens), split along dim 0
            into ``micro_batches`` equal micro-batches.
          targets: ``loss_fn``'s targets for the batch, split alike.

        Returns:
          ``(grads, loss)``: the gradients of this rank's parameters, sharded like them and
          reduced (mean over data-parallel ranks), of the batch's mean loss; ``loss``, on every
          pp rank, ``sum_k loss_fn(out_k, y_k) / m``: the batch's mean (this data-parallel
          rank's, as :meth:`fsdpfn.runtime.Runtime.value_and_grad` returns it).

        Example: see :class:`PipelineRuntime`.
        """
        return self._run(self.schedule, params, inputs, targets, train=True)

    def _run(
        self, ps: PipelineSchedule, params, inputs, targets, train: bool
    ) -> tuple[dict[str, DTensor | None], torch.Tensor]:
        m = ps.micro_batches
        what = "step" if train else "evaluate"
        rows = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() else None
        if rows is None or rows % m:
            raise ValueError(
                f"PipelineRuntime.{what}: inputs has {rows} rows (dim 0), which micro_batches={m} does not divide; "
                f"pass a batch of a multiple of {m} rows, or build the runtime with a micro_batches that divides {rows}"
            )
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or targets.shape[0] != rows:
            raise ValueError(
                f"PipelineRuntime.{what}: targets must be a tensor with the inputs' {rows} rows (dim 0), got "
                f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}"
            )
        for s, sp in self.stage_plans.items():
            missing = [n for n in sp.param_names if n not in params]
            if missing:
                raise ValueError(
                    f"PipelineRuntime.{what}: params lacks stage {s}'s {missing[:4]}; pass pipe.shard(model)'s dict"
                )
            check_params({n: params[n] for n in sp.param_names}, sp, f"PipelineRuntime.{what}(params)")
        cp_plan = next(iter(self.stage_plans.values()))
        if self.checks.batch_due():  # see [Note: checking the batch] in fsdpfn/transforms/_guards.py
            # Every pp rank is given the batch: stage 0 reads its inputs, the last stage its
            # targets; the peers of one data-parallel index must read the same ones, and the
            # data-parallel ranks batches of one size (the reduce averages per-rank means).
            reduce = "mean" if train else "custom"
            check_batch(self.plan, (inputs,), reduce=reduce, whole=True)  # the whole plan: one label on every pp rank
            check_batch(self.plan, (targets,), reduce=reduce, whole=True)
        # This cp rank's part of every sequence (the whole step then runs inside its cp axis;
        # without one, the whole sequences and a block that changes nothing).
        inputs, targets = context_parallel_shard((inputs, targets), cp_plan)
        self.reset_step()
        for s, ex in self._ex.items():
            ex.set_locals(params[p.name] for u in self.stage_plans[s].units for p in u.params)
        self._step = _StepState(inputs.chunk(m), targets.chunk(m), train)
        clock, timeline = time.perf_counter, cast(list[tuple[str, float, float]], [])
        begin = clock()
        try:
            with context_parallel(cp_plan, strategy=self._cp_strategy):
                if train and self.checks.verify_due():
                    with uncounted():  # the check's transfers are not the step's
                        self._verify_stages(ps, params)
                self._walk(ps, clock, begin, timeline)
            for pendings in self._step.sends.values():  # what was sent must stay alive until it left
                for pending in pendings:
                    pending.wait()
        except BaseException:
            for ex in self._ex.values():
                ex.abandon()
            raise
        finally:
            self._step.release()
        return self._finish(ps, timeline, train)

    def _verify_stages(self, ps: PipelineSchedule, params) -> None:
        """[Note: checking a pipeline's stages]
        The differential check (:func:`fsdpfn.verify`) of each stage on the first micro-batch,
        stage after stage, before the step: stage ``s``'s ranks check it on its input (the
        tokens, or what stage ``s - 1`` computed, received), then every rank of the mesh learns
        whether it passed (one store exchange) before stage ``s + 1`` waits for that output. So a
        stage that fails is named on every rank, and no rank is left waiting for an activation
        that will not come. Every plan runs it, for what a stage can get wrong on any mesh (its
        output not one tensor, its input written in place, a loss that is not a scalar); one
        that splits nothing over tp, ep or cp only runs each stage's forward. Costs one more
        forward of micro-batch 0 per stage, plus the checks."""
        from fsdpfn import comm as C
        from fsdpfn.transforms import VerificationError

        world = tuple(int(r) for r in self.plan.mesh.mesh.flatten().tolist())
        held: Any = None  # the previous stage's output, when it ran here too
        sends: list = []
        for s in range(ps.num_stages):
            here, out, problem = ps.rank_of(s) == self.pp_rank, None, None
            error: BaseException | None = None
            if here:
                try:
                    if s == 0:
                        x = self._step.xs[0]
                    elif ps.rank_of(s - 1) == self.pp_rank:
                        x = held
                    else:
                        peer = ps.rank_of(s - 1)
                        h = (
                            pp_recv(torch.empty(_HEADER, dtype=torch.int64), peer, self.group, tag="verify_header")
                            .wait()
                            .tolist()
                        )
                        x = pp_recv(
                            torch.empty(h[2 : 2 + h[0]], dtype=_DTYPES[h[1]]), peer, self.group, tag="verify_act"
                        ).wait()
                    sp = self.stage_plans[s]
                    version = x._version
                    self.verified[s], out = verify_stage(
                        self.model,
                        self.modules[s],
                        {name: local for local, name in self._names[s]},
                        sp,
                        {n: params[n] for n in sp.param_names},
                        x,
                    )
                    if s > 0 and x._version != version:  # written in place: the step's autograd would refuse it
                        raise ValueError(self._in_place(s))
                    out = self._stage_output(s, out).detach().contiguous()
                    if s == ps.num_stages - 1:
                        self._check_loss(self.loss_fn(out, self._step.ys[0]))
                        # The loss over the last stage's ranks (see [Note: the loss check]).
                        verify_stage_loss(
                            sp, self.loss_fn, out, self._step.ys[0], self.verified[s], self._last_stage_group
                        )
                except (VerificationError, ValueError) as e:
                    error, problem = e, f"{'V' if isinstance(e, VerificationError) else 'E'}{e}"
            found = C.exchange_problems(f"pipeline verify stage {s}", problem, world)
            if found:  # the same text on every rank; the stage's own ranks keep the comparison
                text = found[min(found)]
                message = f"stage {s} (on pp rank {ps.rank_of(s)}) failed its first step's check: {text[1:]}"
                if text[0] == "V":
                    raise VerificationError(message, getattr(error, "comparison", None)) from error
                raise ValueError(message) from error
            if here and s < ps.num_stages - 1:
                assert out is not None  # a stage that raised was named above
                if ps.rank_of(s + 1) == self.pp_rank:
                    held = out
                else:
                    sends.append(pp_send(_header(out), ps.rank_of(s + 1), self.group, tag="verify_header"))
                    sends.append(pp_send(out, ps.rank_of(s + 1), self.group, tag="verify_act"))
        for pending in sends:
            pending.wait()

    def reset_step(self) -> None:
        """Starts a step: drops what the last one held (its activations, transfers in flight,
        gradients) on this rank and on each stage's executor (see [Note: one interpreter
        protocol] in ``fsdpfn/_plan/interpret.py``). :meth:`step` and :meth:`evaluate` call it
        before they give the batch to the stages."""
        self._step.release()
        self._step = _StepState((), (), True)
        for ex in self._ex.values():
            ex.reset_step()
        self.last_ops = []

    def run(self, op: AnyOp) -> None:
        """Runs one op of this rank's list now: a stage op (``stage_forward``, ``send_act``, ...)
        here, an FSDP action (``gather``, ``reduce``, ...) on its stage's executor. :meth:`step`
        runs the schedule's list for this rank through it, in order."""
        if isinstance(op, Op):
            self._ex[self._stage_of_unit[op.unit]].run(op)
        else:
            self._handlers[op.kind](op)

    def _walk(self, ps: PipelineSchedule, clock, begin: float, timeline: list) -> None:
        """This rank's ops, in order."""
        for op in ps.ranks[self.pp_rank]:
            t0 = clock()
            self.run(op)
            self.last_ops.append(str(op))
            timeline.append((str(op), t0 - begin, clock() - begin))

    def _finish(
        self, ps: PipelineSchedule, timeline: list, train: bool
    ) -> tuple[dict[str, DTensor | None], torch.Tensor]:
        """The step's loss on every pp rank, and this rank's reduced gradients (training)."""
        m = ps.micro_batches
        if self._profile:
            self.last_profile = PipelineProfile(
                self.pp_rank, ps.name, tuple(timeline), tuple(self._step.kept_log), self._step.peak_kept
            )
        last = ps.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32)
        if not train:
            for ex in self._ex.values():
                ex.reset_grads()
        if ps.rank_of(last) == self.pp_rank:
            loss = torch.stack([self._step.losses[k].float() for k in range(m)]).sum() / m
        loss = broadcast(loss.reshape(1), src=self._global[ps.rank_of(last)], group=self.group, tag="pp_loss").reshape(
            ()
        )
        grads: dict[str, DTensor | None] = {}
        for s, ex in self._ex.items() if train else ():
            names = [p.name for u in self.stage_plans[s].units for p in u.params]
            grads.update(zip(names, ex.shard_grads()))
        return grads, loss

    @torch.no_grad()
    def evaluate(self, params: Mapping[str, torch.Tensor], inputs: torch.Tensor, targets: Any) -> torch.Tensor:
        """The batch's mean loss, forward only (validation): the micro-batches go through the
        stages in GPipe's order (the op list :attr:`eval_schedule`), each stage's units
        gathered before its first micro-batch and freed after its last; no graph is kept and
        nothing is reduced.

        Args: as :meth:`step`'s.

        Returns:
          ``sum_k loss_fn(out_k, y_k) / m`` on every pp rank (this data-parallel rank's batch),
          the loss :meth:`step` returns for the same parameters.

        Example:
          >>> pp_plan = fsdpfn.pipeline_plan(model, fsdpfn.testing.mesh((1, 1), ("pp", "dp")), units=["embed", "pos", "blocks.0",
          ...                       "blocks.1", "norm", "head"])
          >>> ce = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
          >>> pipe = fsdpfn.runtime.PipelineRuntime(model, pp_plan, "1f1b", micro_batches=2, loss_fn=ce)
          >>> loss = pipe.evaluate(pipe.shard(model), x, y)
          >>> torch.allclose(loss, ce(model(x), y)), loss.requires_grad
          (True, False)
        """
        return self._run(self.eval_schedule, params, inputs, targets, train=False)[1]

    @property
    def eval_schedule(self) -> PipelineSchedule:
        """The op lists :meth:`evaluate` runs: GPipe's forwards and activation transfers with
        the stages' gathers and frees (printable like :attr:`schedule`)."""
        if self._forward_only is None:
            self._forward_only = forward_only(self.plan, self.schedule.micro_batches, prefetch=self._prefetch)
        return self._forward_only

    def _stage_forward(self, op: PipeOp) -> None:
        s, k = op.stage, op.micro
        last = s == self.schedule.num_stages - 1
        ex = self._ex[s]
        if not self._step.train:  # evaluate: no graph, nothing saved for a backward
            x = self._step.xs[k] if s == 0 else self._step.acts.pop((s, k))
            params = {p.name: t for u in self.stage_plans[s].units for p, t in zip(u.params, ex.full_params(u.name))}
            out = self._stage_output(s, self._run_stage(s, {local: params[name] for local, name in self._names[s]}, x))
            if last:
                loss = self.loss_fn(out, self._step.ys[k])
                self._check_loss(loss)
                self._step.losses[k] = loss.detach()
            else:
                self._pass_on(s, k, out)
            return
        leaves = {
            p.name: t.detach().requires_grad_()
            for u in self.stage_plans[s].units
            for p, t in zip(u.params, ex.full_params(u.name))
        }
        if s == 0:
            x = self._step.xs[k]
        else:
            x = self._step.acts.pop((s, k)).detach()
            x.requires_grad_(x.is_floating_point())
        saved: dict[int, int] = {}
        with torch.enable_grad(), self._counting(saved, leaves.values()):
            try:
                out = self._run_stage(s, {local: leaves[name] for local, name in self._names[s]}, x)
            except RuntimeError as e:
                if "in-place operation" in str(e) and s > 0:
                    raise ValueError(self._in_place(s)) from e
                raise
            out = self._stage_output(s, out)
            if last:
                loss = self.loss_fn(out, self._step.ys[k])
                self._check_loss(loss)
                self._step.losses[k] = loss.detach()
                out = loss / self.schedule.micro_batches  # see [Note: the pipeline executor]
        self._step.saved[(s, k)] = (x if s > 0 else None, out, leaves)
        self._step.kept[(s, k)] = sum(saved.values())
        self._step.kept_log.append((s, k, self._step.kept[(s, k)]))
        self._step.peak_kept = max(self._step.peak_kept, sum(self._step.kept.values()))
        if not last:
            self._pass_on(s, k, out.detach())

    @staticmethod
    def _in_place(s: int) -> str:
        return (
            f"stage {s} modifies its input in place (e.g. `h *= 0.7` or `h.add_(...)` on the tensor it is given), which "
            "is a leaf of the stage's graph: autograd cannot differentiate through it. Write the stage out of place "
            "(`h = h * 0.7`)"
        )

    def _stage_output(self, s: int, out: Any) -> torch.Tensor:
        """A stage hands one tensor on: a 1-tuple (what Hugging Face layers return) is named."""
        if isinstance(out, torch.Tensor):
            return out
        kind = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
        hint = (
            " (Hugging Face layers return (hidden,): unpack it, `return layer(x)[0]`)"
            if isinstance(out, (tuple, list))
            else ""
        )
        raise ValueError(
            f"stage {s} ({type(self.modules[s]).__name__}) returned {kind}; a pipeline stage must return one tensor, "
            f"which the next stage takes as its input{hint}"
        )

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"PipelineRuntime: loss_fn(output, target) must return the micro-batch's mean loss, a scalar; got "
                f"{got} (a loss built with reduction='none'? take its .mean(), or use the default reduction)"
            )

    def _pass_on(self, s: int, k: int, out: torch.Tensor) -> None:
        """Stage ``s``'s output of micro-batch ``k``: to stage ``s + 1`` here, or to be sent."""
        if self.schedule.rank_of(s + 1) == self.pp_rank:
            self._step.acts[(s + 1, k)] = out
        else:
            self._step.outbox[(s, k)] = out

    def _counting(self, saved: dict[int, int], params):
        """With ``profile``: a saved-tensor hook adding to ``saved`` the bytes of each storage the
        forward keeps for its backward, once each, the stage's gathered parameters not counted."""
        if not self._profile:
            return contextlib.nullcontext()
        skip = {t.untyped_storage().data_ptr() for t in params}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _stage_backward(self, op: PipeOp) -> None:
        s, k = op.stage, op.micro
        x, out, leaves = self._step.saved.pop((s, k))
        self._step.kept.pop((s, k), None)
        names = list(leaves)
        through = x is not None and x.requires_grad
        inputs = [leaves[n] for n in names] + ([x] if through else [])
        seed = None if s == self.schedule.num_stages - 1 else self._step.grads.pop((s, k))
        got = torch.autograd.grad(out, inputs, grad_outputs=seed, allow_unused=True)
        self._count_backward(s)
        self._add_param_grads(s, dict(zip(names, got)))
        if x is not None:
            self._input_grad(s, k, x, got[-1] if through else None)

    def _stage_backward_input(self, op: PipeOp) -> None:
        """The input's gradient now; what the weights need later (see [Note: the weight half
        without a second walk] in ``fsdpfn/runtime/_split_backward.py``)."""
        s, k = op.stage, op.micro
        x, out, leaves = self._step.saved[(s, k)]  # kept for the weight half
        seed = None if s == self.schedule.num_stages - 1 else self._step.grads.pop((s, k))
        if x is None:  # stage 0's input is the tokens: no gradient to compute, the weight half is the backward
            self._step.halves[(s, k)] = WeightHalf(fallback=(out, seed), split=False)
            return
        g, self._step.halves[(s, k)] = backward_input(out, x, list(leaves.values()), seed)
        self._input_grad(s, k, x, g)

    def _stage_backward_weight(self, op: PipeOp) -> None:
        s, k = op.stage, op.micro
        _, _, leaves = self._step.saved.pop((s, k))
        self._step.kept.pop((s, k), None)
        half = self._step.halves.pop((s, k))
        self.weight_halves[0] += 1
        self.weight_halves[1] += half.split
        self._add_param_grads(s, dict(zip(leaves, half.run(list(leaves.values())))))

    def _add_param_grads(self, s: int, by_name: dict) -> None:
        ex = self._ex[s]
        for u in self.stage_plans[s].units:
            ex.add_grads(u.name, [by_name[p.name] for p in u.params])  # summed locally, in the reduce dtype

    def _input_grad(self, s: int, k: int, x: torch.Tensor, g: torch.Tensor | None) -> None:
        """Hands the gradient of stage ``s``'s input to stage ``s - 1`` (zeros where it does not reach it)."""
        g = g if g is not None else torch.zeros_like(x)
        if self.schedule.rank_of(s - 1) == self.pp_rank:
            self._step.grads[(s - 1, k)] = g
        else:
            self._step.outbox[(s, k)] = g

    def _send(self, op: PipeOp) -> None:
        # A sent tensor stays referenced until its transfer is known to be over: an activation's
        # when its gradient comes back (see _recv_grad), the rest at the end of the step. Not
        # sooner: gloo reports a send finished only inside its wait, and a wait before the peer
        # received it could block (a send that waits, which the validator does not model).
        t = self._step.outbox.pop((op.stage, op.micro)).contiguous()
        peer = self.schedule.peer(op)
        sends = self._step.sends.setdefault(op, [])
        if op.kind is PipeKind.SEND_ACT:
            sends.append(pp_send(_header(t), peer, self.group, tag=f"{op.kind.value}_header"))
        sends.append(pp_send(t, peer, self.group, tag=str(op)))

    def _recv_act(self, op: PipeOp) -> None:
        peer = self.schedule.peer(op)
        h = (
            pp_recv(torch.empty(_HEADER, dtype=torch.int64), peer, self.group, tag=f"{op.kind.value}_header")
            .wait()
            .tolist()
        )
        buf = torch.empty(h[2 : 2 + h[0]], dtype=_DTYPES[h[1]])
        self._step.acts[(op.stage, op.micro)] = pp_recv(buf, peer, self.group, tag=str(op)).wait()

    def _recv_grad(self, op: PipeOp) -> None:
        out = self._step.saved[(op.stage, op.micro)][1]
        buf = torch.empty(out.shape, dtype=out.dtype)
        self._step.grads[(op.stage, op.micro)] = pp_recv(buf, self.schedule.peer(op), self.group, tag=str(op)).wait()
        # The peer computed this gradient from the activation this rank sent it, so that send is
        # over: its wait returns at once and the activation is released (1F1B then keeps only
        # the micro-batches in flight, as its memory bound says, not every sent activation).
        for pending in self._step.sends.pop(PipeOp(PipeKind.SEND_ACT, op.stage, op.micro), ()):
            pending.wait()
