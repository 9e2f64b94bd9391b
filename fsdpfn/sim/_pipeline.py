"""A pipelined step, priced from its pipeline schedule (see [Note: pricing a pipeline schedule]).

[Note: pricing a pipeline schedule]
The step of a pipelined plan is its :class:`fsdpfn.PipelineSchedule`: every pp rank's op list,
with FSDP's gathers and reduces of each stage's units inside it. The simulator reads that list
once, through :func:`fsdpfn.pipeline_times`, which runs every rank's ops together, and prices
what the list names:

- ``stage_forward s m`` / ``stage_backward s m``: stage ``s``'s part of the profiled workload
  (the work after each event of its units, as :func:`fsdpfn.sim.profile` keys it; the root's
  forward event, before any unit, belongs to the first stage, its other events, the loss
  among them, to the last), each operator priced as :meth:`Work.seconds` prices it, plus the
  stage's activation collectives (tp, cp) from :func:`fsdpfn.step_collectives` of
  ``plan.stage_plan(s)``, blocking as the one-stage simulator runs them;
- ``stage_backward_input s m`` / ``stage_backward_weight s m`` (a split backward: the
  zero-bubble schedule): the profile records each backward operator's FLOPs, not which
  operand's gradient it computes, so the stage's backward compute is split half and half (a
  matmul's two gradients, ``dX = dY W^T`` and ``dW = X^T dY``, cost the same FLOPs; the
  elementwise rest, mostly on the activations' path, is the smaller part), and the backward's
  activation collectives go to the input half: they carry activation gradients;
- ``send_act`` / ``recv_act`` and ``send_grad`` / ``recv_grad``: the first unit of stage
  ``s + 1``'s tensor inputs as profiled, sent point to point over the pp axis's link (within a
  node or across, by the ranks' placement); a send does not wait, a recv waits for the data;
- ``gather`` / ``wait`` before a stage's first forward and ``reduce`` / ``wait_reduce`` after
  its last backward: the stage plan's all-gathers and reduce-scatters (and HSDP's all-reduce),
  once per step, as the generated policy runs them (parameters stay unsharded through the step's
  micro-batches): time before each rank's first op and after its last;
- accumulation: a stage's parameter gradients are reduced once, after its last micro-batch,
  so each of its backwards (or weight halves) but the first adds the micro-batch's full
  gradients to those kept, priced as the one-stage simulator prices an ``accumulate`` of the
  same units;
- the optimizer: each rank steps its own stages' shards after its last reduce, priced by
  :func:`fsdpfn.sim.simulate` on the stage plan.

Memory per rank: its stages' sharded parameters, gradients and optimizer state, their unsharded
parameters (held through the step), the full gradients kept over the micro-batches (with more
than one), and the activations of the micro-batches in flight at the worst moment of its list
(each stage's profiled activations per micro-batch).

Not modelled: communication beside compute slowing it, tensor-parallel collectives overlapped
with compute (async tp), and two transfers queuing on one link.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from fsdpfn._plan import ROOT, PipelinedPlan
from fsdpfn._plan.axes import Role
from fsdpfn._plan.schedule import Op, OpKind, schedule
from fsdpfn._plan.steps import step_collectives
from fsdpfn._plan.pipeline import PipelineSchedule
from fsdpfn.sim._hardware import Hardware
from fsdpfn.sim._pipeline_times import PipelineTimes, pipeline_times
from fsdpfn.sim._simulate import _mesh_groups, accumulate_work, kept_grad_bytes, over_memory, simulate
from fsdpfn.sim._workload import EMPTY, Workload

__all__ = ["PipelineSimResult", "simulate_pipeline"]

_FORWARD = (OpKind.FORWARD, OpKind.FORWARD_DONE)


@dataclasses.dataclass(frozen=True)
class PipelineSimResult:
    """A predicted pipelined training step.

    Attributes:
      step_time: seconds from the first op of any rank to the end of the last optimizer step.
      times: :func:`fsdpfn.pipeline_times` of the schedule with the priced stages: each rank's
        finish and compute time, the bubble, the peak activations per rank.
      forward, backward: seconds of one micro-batch's forward and backward of each stage.
      backward_input, backward_weight: the two halves of each stage's backward, as a split
        backward (``stage_backward_input`` / ``stage_backward_weight``) is priced.
      transfer: seconds of one hop across each stage boundary, and ``p2p_bytes`` its bytes.
      gather, reduce: seconds of each pp rank's stages' FSDP gathers (before its first op) and
        reduces (after its last).
      optimizer: seconds of each pp rank's optimizer step.
      accumulate: seconds each stage takes to add one micro-batch's gradients to those kept
        from its earlier ones (after every backward of the stage but the first).
      memory: bytes per pp rank: ``params``, ``grads``, ``optimizer_state`` (sharded),
        ``unsharded`` (its stages' parameters, held through the step), ``accumulated`` (its
        stages' full gradients, kept over the micro-batches; 0 with one), ``activations``
        (peak), ``peak`` (their sum).
      tokens: tokens of the whole step: every micro-batch of every data-parallel pipeline.
      world_size: the plan's ranks.
      notes: what the model assumed.

    Example:
      >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 4}, units=["embed", "pos", "blocks.0", "blocks.1", "norm", "head"])
      >>> wl = fsdpfn.sim.profile(model, pp, x)
      >>> r = fsdpfn.sim.simulate_pipeline(pp, fsdpfn.pipeline_schedule(pp, "1f1b", 8), wl, fsdpfn.sim.AdamW(), fsdpfn.sim.H100_SXM)
      >>> 0 < r.times.bubble < 1, r.step_time > r.times.makespan   # the optimizer runs after the schedule
      (True, True)
    """

    step_time: float
    times: PipelineTimes
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: tuple[float, ...]
    p2p_bytes: tuple[int, ...]
    gather: tuple[float, ...]
    reduce: tuple[float, ...]
    optimizer: tuple[float, ...]
    memory: tuple[dict, ...]
    tokens: int
    world_size: int
    schedule: PipelineSchedule = dataclasses.field(repr=False, compare=False)
    hardware: Hardware | None = dataclasses.field(default=None, repr=False, compare=False)
    notes: tuple[str, ...] = ()
    backward_input: tuple[float, ...] = ()
    backward_weight: tuple[float, ...] = ()
    accumulate: tuple[float, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second per GPU: the step's tokens over the step time and every rank."""
        return self.tokens / self.step_time / self.world_size if self.step_time > 0 else 0.0

    def __str__(self) -> str:
        gib = 2**30
        ps = self.schedule
        lines = [
            f"pipelined step {self.step_time * 1e3:,.1f} ms on {self.hardware.name if self.hardware else '?'}: "
            f"{ps.name}, pp={ps.pp_size}, {ps.num_stages} stages, {ps.micro_batches} micro-batches, "
            f"bubble {self.times.bubble:.1%}",
            "stage  forward ms  backward ms   hop ms   hop MiB",
        ]
        for s in range(ps.num_stages):
            hop = f"{self.transfer[s] * 1e3:8.3f} {self.p2p_bytes[s] / 2**20:9.2f}" if s < ps.num_stages - 1 else ""
            lines.append(f"{s:5d} {self.forward[s] * 1e3:11.3f} {self.backward[s] * 1e3:12.3f} {hop}")
        lines.append("rank  finish ms  compute ms  gather ms  reduce ms  optimizer ms  peak GiB (activations)")
        for r in range(ps.pp_size):
            m = self.memory[r]
            lines.append(
                f"{r:4d} {self.times.finish[r] * 1e3:10.1f} {self.times.busy[r] * 1e3:11.1f} {self.gather[r] * 1e3:10.2f} "
                f"{self.reduce[r] * 1e3:10.2f} {self.optimizer[r] * 1e3:13.2f} {m['peak'] / gib:9.2f} ({m['activations'] / gib:.2f})"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _stage_of_event(e: Op, owner: dict[str, int], last: int) -> int | None:
    if e.unit == ROOT:
        return 0 if e.kind is OpKind.FORWARD else last
    return owner.get(e.unit)


def _stage_workload(wl: Workload, stage: int, owner: dict[str, int], last: int) -> Workload:
    """The part of ``wl`` a stage runs (its units' events; the root's as [Note: pricing a pipeline
    schedule] assigns them), other events kept with no work so the stage plan's schedule finds them."""
    units = {u for u, s in owner.items() if s == stage}
    work = tuple(
        (e, w if _stage_of_event(e, owner, last) == stage else EMPTY)
        for e, w in wl.work
        if e.unit == ROOT or e.unit in units or e.kind is OpKind.END
    )
    keep = lambda pairs: tuple(x for x in pairs if x[0] in units)  # noqa: E731
    return dataclasses.replace(
        wl,
        work=work,
        activations=keep(wl.activations),
        inputs=keep(wl.inputs),
        kept=keep(wl.kept),
        transient=tuple((e, b) for e, b in wl.transient if e.unit in units),
        attention=tuple(a for a in wl.attention if a.unit in units),
        base=None,
    )


def _coords(shape: tuple[int, ...], rank: int) -> list[int]:
    out = []
    for size in reversed(shape):
        rank, c = divmod(rank, size)
        out.append(c)
    return out[::-1]


def _rank_at(shape: tuple[int, ...], coords: list[int]) -> int:
    r = 0
    for size, c in zip(shape, coords):
        r = r * size + c
    return r


def simulate_pipeline(
    plan: PipelinedPlan,
    schedule_: PipelineSchedule,
    workload: Workload,
    optimizer: Any = None,
    hardware: Hardware | None = None,
    *,
    rank: int = 0,
) -> PipelineSimResult:
    """Predicts one training step of a pipelined ``plan`` run by the pipeline schedule
    ``schedule_`` (see [Note: pricing a pipeline schedule]).

    Args:
      plan: a pipelined plan (a mesh with a ``pp`` axis), bound or abstract.
      schedule_: its :func:`fsdpfn.pipeline_schedule`, possibly edited (it is validated).
      workload: one micro-batch's compute on one rank, :func:`fsdpfn.sim.profile` of the model
        under ``plan`` (every unit, on meta).
      optimizer: :class:`fsdpfn.sim.AdamW`, :class:`fsdpfn.sim.Muon` or ``None``.
      hardware: a :class:`fsdpfn.sim.Hardware`.
      rank: a global rank whose data-parallel and tp coordinates place the groups (every
        pp rank at those coordinates is priced).

    Example:
      >>> pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 4}, units=["embed", "pos", "blocks.0", "blocks.1", "norm", "head"])
      >>> wl = fsdpfn.sim.profile(model, pp, x)
      >>> r = fsdpfn.sim.simulate_pipeline(pp, fsdpfn.pipeline_schedule(pp, "gpipe", 4), wl, fsdpfn.sim.AdamW(), fsdpfn.sim.H100_SXM)
      >>> print(r)   # per stage forward/backward and hop; per rank finish, FSDP time, memory  # doctest: +ELLIPSIS
      pipelined step ... ms on H100 SXM (DGX H100): gpipe, pp=2, 2 stages, 4 micro-batches, bubble ...
      >>> r.memory[1]["activations"] == 4 * sum(b for u, b in wl.activations if u in pp.stages.units[1])   # GPipe: m in flight
      True
    """
    if not isinstance(plan, PipelinedPlan):
        raise ValueError(
            "simulate_pipeline needs a pipelined plan (a mesh with a 'pp' axis and stages); "
            "for a plan without pp use fsdpfn.sim.simulate"
        )
    if not isinstance(schedule_, PipelineSchedule):
        raise TypeError(
            f"simulate_pipeline needs a fsdpfn.PipelineSchedule (fsdpfn.pipeline_schedule(plan, '1f1b', m)), "
            f"got {type(schedule_).__name__}"
        )
    if workload is None or hardware is None:
        raise ValueError(
            "simulate_pipeline needs a workload (fsdpfn.sim.profile(model, plan, micro_batch)) and a hardware"
        )
    shape = tuple(plan.mesh_shape)
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be a global rank of the plan's {plan.world_size} ranks, got {rank!r}")
    stages = plan.stages
    profiled = {e.unit for e, _ in workload.work}
    missing = [u for names in stages.units for u in names if u not in profiled]
    if missing:  # their stages would be priced without their work
        raise ValueError(
            f"simulate_pipeline: the workload has no work for units {missing[:4]}{' ...' if len(missing) > 4 else ''} "
            "of the plan; profile the model with this plan (fsdpfn.sim.profile(model, plan, micro_batch))"
        )
    S, p, last = stages.num_stages, stages.pp_size, stages.num_stages - 1
    owner = {u: s for s, names in enumerate(stages.units) for u in names}
    pp_dim = cast(int, plan.axes.dim(Role.PP))  # a pipelined plan has a pp axis
    coords = _coords(shape, rank)

    def global_rank(pp_rank: int) -> int:
        c = list(coords)
        c[pp_dim] = pp_rank
        return _rank_at(shape, c)

    fwd, bwd, acts, unsharded, in_bytes, adds, kept = [], [], [], [], [], [], []
    bwd_in, bwd_w = [], []  # a split backward's halves (see [Note: pricing a pipeline schedule])
    static: list[dict] = []
    opt_s: list[float] = []
    gather_s, reduce_s = [0.0] * S, [0.0] * S
    for s in range(S):
        sp = plan.stage_plan(s)
        ws = _stage_workload(workload, s, owner, last)
        groups = _mesh_groups(plan, global_rank(stages.rank_of(s)))

        def seconds(c) -> float:
            key = c.role.value
            if key == "shard" and "dense" in groups and c.group_size == len(groups["dense"]):
                key = "dense"
            return hardware.collective_seconds(c.kind, groups[key], c.nbytes)

        f = sum(w.seconds(hardware) for e, w in ws.work if e.kind in _FORWARD)
        b = sum(w.seconds(hardware) for e, w in ws.work if e.kind not in _FORWARD)
        b_act = 0.0  # the backward's activation collectives: the input half's
        # The generated policy: a stage's units stay unsharded from their gather to the step's end.
        held = schedule(sp, reshard_after_forward=False)
        calls = step_collectives(sp, schedule=held, tokens=ws.tokens, attention=ws.attention)
        for c in calls:
            if c.activation:  # blocking after its unit's compute, as the one-stage simulator runs them
                if c.phase == "forward":
                    f += seconds(c)
                else:
                    b_act += seconds(c)
            elif c.purpose == "gather" and c.phase == "forward":
                gather_s[s] += seconds(c)
            elif c.phase == "backward":
                reduce_s[s] += seconds(c)
        fwd.append(f)
        bwd.append(b + b_act)
        bwd_in.append(b / 2 + b_act)
        bwd_w.append(b / 2)
        acts.append(sum(b_ for _, b_ in ws.activations))
        first = stages.units[s][0]
        in_bytes.append(dict(workload.inputs).get(first, 0))
        one = simulate(sp, held, ws, optimizer, hardware)
        opt_s.append(one.optimizer_time)
        static.append({k: one.memory[k] for k in ("params", "grads", "optimizer_state")})
        unsharded.append(one.memory["unsharded_peak"])  # reshard_after_forward=False: every unit of the stage at once
        adds.append(sum(accumulate_work(sp, u).seconds(hardware) for u in sp.units))
        kept.append(sum(kept_grad_bytes(sp, u) for u in sp.units) if schedule_.micro_batches > 1 else 0)

    hops, p2p = [], []
    for s in range(S - 1):
        nbytes = in_bytes[s + 1]
        ends = [global_rank(stages.rank_of(s)), global_rank(stages.rank_of(s + 1))]
        hops.append(hardware.collective_seconds("send_recv", ends, nbytes, sent=nbytes) if ends[0] != ends[1] else 0.0)
        p2p.append(nbytes)
    per_rank = [stages.stages_of(r) for r in range(p)]
    start = [sum(gather_s[s] for s in ss) for ss in per_rank]
    after = [sum(reduce_s[s] for s in ss) for ss in per_rank]
    times = pipeline_times(
        schedule_,
        fwd,
        bwd,
        transfer=hops,
        start=start,
        after=after,
        activations=acts,
        plan=plan,
        backward_input=bwd_in,
        backward_weight=bwd_w,
        accumulate=adds,
    )
    optimizer_r = [sum(opt_s[s] for s in ss) for ss in per_rank]
    step = max(t + o for t, o in zip(times.finish, optimizer_r))
    memory = []
    for r, ss in enumerate(per_rank):
        m = {k: sum(static[s][k] for s in ss) for k in ("params", "grads", "optimizer_state")}
        m["unsharded"] = sum(unsharded[s] for s in ss)
        m["accumulated"] = sum(kept[s] for s in ss)
        m["activations"] = times.peak_activations[r]
        m["peak"] = sum(m.values())
        memory.append(m)
    # A micro-batch's tokens reach every tp rank of its pipeline; the ranks gradients average
    # over (dp, and cp, whose ranks each hold a part) hold distinct ones.
    tokens = workload.tokens * schedule_.micro_batches * plan.grad_ranks
    notes: tuple[str, ...] = (
        "tp/cp collectives block after their unit's compute; FSDP gathers before a rank's first op and reduces after "
        "its last (parameters stay unsharded through the step)",
    )
    notes += tuple(
        n
        for r, m in enumerate(memory)
        if (n := over_memory(int(m["peak"] * (1.0 + hardware.memory_reserve)), hardware, f" on pp rank {r}"))
    )
    return PipelineSimResult(
        step,
        times,
        tuple(fwd),
        tuple(bwd),
        tuple(hops),
        tuple(p2p),
        tuple(start),
        tuple(after),
        tuple(optimizer_r),
        tuple(memory),
        tokens,
        plan.world_size,
        schedule_,
        hardware,
        notes,
        tuple(bwd_in),
        tuple(bwd_w),
        tuple(adds),
    )
