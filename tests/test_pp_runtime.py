"""The pipeline runtime (fsdpfn.runtime.PipelineRuntime) trains a tiny GPT on gloo ranks
(pp=2; pp=4; pp=2 x dp=2; pp=2 x tp=2) with GPipe, 1F1B, interleaved 1F1B and zero bubble, 8
micro-batches, PARITY_STEPS AdamW steps (see [Note: how many steps a parity test runs] in
tests/_parity.py), and matches one process training on the whole batch, step by step;
zero bubble (backward split in input and weight halves) bitwise as 1F1B. Hand-edited
schedules: a deadlocking one is refused before anything is sent, a valid one runs bitwise alike.

[Note: the tolerance of the pipeline parity tests]
One process computes the mean cross-entropy of the whole batch (N = 64 tokens per data-parallel
rank) and its gradient in one pass. The pipeline computes m = 8 micro-batch means (8 tokens
each), scales each by 1/m (exact: a power of two) and sums the m gradients in the unit's
accumulator; with dp = 2 the reduce averages two ranks' gradients; with tp = 2 a rowwise matmul
adds 2 partial sums. Every gradient element is the same sum of the same products, added in
another order. Reordering a sum of n terms in float32 moves it by at most (n - 1) eps |terms|
with eps = 2^-24 ~= 6e-8; the reordered sums here have n <= 16 terms (8 micro-batches x 2 dp
ranks, or tp partials inside a K = 64 dot product whose other 62 terms keep their order), so a
gradient element moves by <= 15 eps ~= 9e-7 of the sum of its terms' magnitudes, and a gradient
in norm (errors of both signs, adding like a random walk) by ~sqrt(n) eps ~= 2.4e-7 relative.
AdamW (lr = 1e-3) turns a gradient's relative error into an update error of the same relative
size for elements well away from zero, and bounded by 2 lr for elements whose true gradient is
within rounding of zero (see [Note: the tolerance of the TP parity tests] in test_tp.py; biases
are off for that reason). Over n steps the parameters' relative difference is thus bounded by
n x lr x (gradient relative error) / |p| plus those few elements' lr-sized steps over |p| ~ 4:
well under the 1e-6 asked for. The loss, one number per step, is a mean of m means against one
mean: within n eps ~= 1e-6 relative of one process's too. Measured (every schedule and mesh
here, under ATEN_CPU_CAPABILITY native, default and avx2): parameters <= 6.6e-8 relative after
10 steps (the tests now run fewer), losses <= 1.4e-7. Zero bubble adds no reordering: its two backward halves compute what
stage_backward computes (autograd sums each node's incoming gradients in the same order in a pass
pruned to the input or to the parameters) and its weight halves run in micro-batch order, so its
steps are checked bitwise equal to 1F1B's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.launch import RankError
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import PipelineRuntime

from _parity import PARITY_STEPS, one_process

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=4, heads=4, bias=False)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
MICRO = 8
PER_RANK = 8  # sequences per data-parallel rank per step: one per micro-batch
STEPS = PARITY_STEPS
TOL = 1e-6  # see [Note: the tolerance of the pipeline parity tests]


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(dp, step):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (dp * PER_RANK, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@one_process
def _reference(dp, steps):
    """One process, the whole batch: per step the parameters after it and each dp rank's loss."""
    torch.manual_seed(0)
    model = GPT(CFG)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    out, losses = [], []
    for step in range(steps):
        x, y = _batch(dp, step)
        with torch.no_grad():
            logits = torch.func.functional_call(model, params, (x,))
            losses.append(
                [
                    _ce(logits[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]).item()
                    for r in range(dp)
                ]
            )
        g = torch.func.grad(lambda ps: _ce(torch.func.functional_call(model, ps, (x,)), y))(params)
        updates, state = opt.update(g, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        out.append(params)
    return out, losses


def _setup(mesh, names, schedule, num_stages):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(model, mesh, units=UNITS, stages=num_stages, tp=GPT_TP_PLAN if "tp" in names else None)
    return model, plan


def _train(model, plan, mesh, names, schedule, steps, ref=None):
    """``steps`` AdamW steps; the worst relative parameter and loss differences from one process
    (with ``ref``) and every step's loss and parameters (for bitwise comparisons)."""
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    mine = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
    pipe = PipelineRuntime(model, plan, schedule, None if not isinstance(schedule, str) else MICRO, loss_fn=_ce)
    params = pipe.shard(model)
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    worst_p = worst_l = 0.0
    trace = []
    for step in range(steps):
        x, y = _batch(dp, step)
        grads, loss = pipe.step(params, x[mine], y[mine])
        with torch.no_grad():
            updates, state = opt.update(grads, state, params)
            params = fsdpfn.optim.apply_updates(params, updates)
        full = {n: p.full_tensor() for n, p in params.items()}
        trace.append((loss.item(), full))
        if ref is not None:
            ref_params, ref_losses = ref
            worst_l = max(worst_l, abs(loss.item() - ref_losses[step][dp_rank]) / abs(ref_losses[step][dp_rank]))
            worst_p = max(worst_p, max(_rel(full[n], ref_params[step][n]) for n in full))
    return worst_p, worst_l, trace, pipe


def _parity(rank, world, shape, names, configs):
    """Per config: (schedule, stages, worst parameter and loss differences, this rank's stages,
    whether every step's loss and parameters equal 1F1B's bitwise: ``None`` but for zero bubble)."""
    mesh = testing.mesh(shape, names)
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    ref = _reference(dp, STEPS)
    out, traces = [], {}
    with fsdpfn.comm.timeout_scope(60):
        for schedule, num_stages in configs:
            model, plan = _setup(mesh, names, schedule, num_stages)
            worst_p, worst_l, trace, pipe = _train(model, plan, mesh, names, schedule, STEPS, ref)
            traces[schedule] = trace
            same = None
            if schedule == "zero_bubble" and "1f1b" in traces:
                same = all(
                    la == lb and all(torch.equal(pa[n], pb[n]) for n in pa)
                    for (la, pa), (lb, pb) in zip(traces["1f1b"], trace)
                )
            if schedule == "zero_bubble":
                # Every weight half of a stage past the first started from the input half's exits
                # (stage 0's input is the tokens: its weight half is its whole backward).
                total, split = pipe.weight_halves
                assert total > 0 and split == (0 if 0 in pipe.stages_here else total), (pipe.stages_here, total, split)
            out.append((schedule, num_stages, worst_p, worst_l, sorted(pipe.stages_here), same))
    return out


def _check(results, configs, world):
    pp_ranks = {tuple(r[0][4]) for r in results}
    assert len(results) == world and all(len(r) == len(configs) for r in results)
    assert len(pp_ranks) >= 2  # the ranks ran different stages
    worst = {}
    for r in results:
        for schedule, stages, wp, wl, _, same in r:
            # the split backward's halves sum what stage_backward sums, in its order
            assert same is None or same, (schedule, "differs from 1f1b's gradients bitwise")
            worst[(schedule, stages)] = max(worst.get((schedule, stages), (0.0, 0.0)), (wp, wl))
    print(
        "worst relative differences (params, loss):", {k: (f"{wp:.2e}", f"{wl:.2e}") for k, (wp, wl) in worst.items()}
    )
    for key, (wp, wl) in worst.items():
        assert wp < TOL and wl < TOL, (key, wp, wl)
    return worst


PP2 = [("gpipe", 2), ("1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 2)]
PP4 = [("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 8), ("zero_bubble", 4)]


def test_pp2_matches_one_process(run_on_ranks):
    """pp=2 on 2 ranks: GPipe, 1F1B, interleaved 1F1B (2 virtual stages per rank), zero bubble."""
    _check(run_on_ranks(_parity, 2, (2, 1), ("pp", "dp"), PP2), PP2, 2)


def test_pp4_matches_one_process(run_on_ranks):
    """pp=4 on 4 ranks; interleaved with 8 stages of one unit each (2 per rank)."""
    _check(run_on_ranks(_parity, 4, (4, 1), ("pp", "dp"), PP4), PP4, 4)


@pytest.mark.parametrize(
    "shape, names", [((2, 2), ("pp", "dp")), ((2, 1, 2), ("pp", "dp", "tp"))], ids=["pp2_dp2", "pp2_tp2"]
)
def test_pp2_with_dp2_or_tp2_matches_one_process(run_on_ranks, shape, names):
    """(pp=2, dp=2): each stage's units FSDP-sharded over 2 ranks, gradients reduced once per
    step; (pp=2, tp=2): each stage's blocks split Megatron-style over 2 ranks."""
    _check(run_on_ranks(_parity, 4, shape, names, PP2), PP2, 4)


# ---- hand-edited schedules -----------------------------------------------------------------


def _move_before(text: str, rank: int, line: str, before: str) -> str:
    """Moves rank ``rank``'s op ``line`` right before its op ``before`` (printed form)."""
    head, *blocks = text.split("\nrank ")
    blocks = ["rank " + b for b in blocks]
    lines = [ln for ln in blocks[rank].splitlines()]
    ops = [ln.split("#")[0].split(None, 1)[1].strip() if ln.startswith("  ") else None for ln in lines]
    src = ops.index(line)
    moved = lines.pop(src)
    ops.pop(src)
    lines.insert(ops.index(before), moved)
    blocks[rank] = "\n".join(lines)
    return "\n".join([head] + blocks)


def _edited(rank, world):
    names = ("pp", "dp")
    mesh = testing.mesh((2, 1), names)
    out = {}
    with fsdpfn.comm.timeout_scope(60):
        model, plan = _setup(mesh, names, "1f1b", 2)
        text = str(fsdpfn.pipeline_schedule(plan, "1f1b", MICRO))
        # Deadlock: rank 0 waits for micro-batch 0's gradient before it sends micro-batch 0's
        # activation, which rank 1 waits for. Refused on every rank before any transfer.
        bad = fsdpfn.PipelineSchedule.from_str(_move_before(text, 0, "recv_grad s0 m0", "send_act s0 m0"))
        with fsdpfn.comm.count_collectives() as counter:
            try:
                PipelineRuntime(model, plan, bad, None, loss_fn=_ce)
                out["deadlock"] = None
            except fsdpfn.runtime.ScheduleError as e:
                out["deadlock"] = str(e)
        out["sent_before_refusal"] = len(counter.calls)
        # Valid: rank 1 receives micro-batch 1's activation before it computes micro-batch 0
        # (rank 0 sends it before it waits for anything): another interleaving, the same
        # arithmetic. (Also moving rank 0's first recv_grad before its second forward would
        # deadlock: each rank would wait for what the other sends after its recv.)
        base = fsdpfn.PipelineSchedule.from_str(text)
        moved = _move_before(text, 1, "recv_act s1 m1", "stage_forward s1 m0")
        good = fsdpfn.PipelineSchedule.from_str(moved)
        assert good != base
        _, _, trace_base, _ = _train(model, plan, mesh, names, base, 3)
        model, plan = _setup(mesh, names, "1f1b", 2)
        _, _, trace_good, pipe = _train(model, plan, mesh, names, good, 3)
        out["ran_edited_order"] = pipe.last_ops == [str(op) for op in good.ranks[rank]]
        out["bitwise"] = all(
            lb == lg and all(torch.equal(pb[n], pg[n]) for n in pb)
            for (lb, pb), (lg, pg) in zip(trace_base, trace_good)
        )
        # A split by hand: 1F1B's micro-batch 0 backward as its input half in place and its
        # weight half moved after micro-batch 1's whole backward, on both ranks. The gradient
        # accumulator then takes micro-batch 1's before 0's: the first of its additions, and a
        # float addition of two terms commutes, so the step is still bitwise 1F1B's.
        split = text
        for r in range(2):
            split = split.replace(f"stage_backward s{r} m0\n", f"stage_backward_input s{r} m0\n")
            split = split.replace(
                f"stage_backward s{r} m1\n", f"stage_backward s{r} m1\n  stage_backward_weight s{r} m0\n"
            )
        split_ps = fsdpfn.PipelineSchedule.from_str(split)
        model, plan = _setup(mesh, names, "1f1b", 2)
        _, _, trace_split, pipe = _train(model, plan, mesh, names, split_ps, 3)
        out["ran_split"] = (
            pipe.last_ops == [str(op) for op in split_ps.ranks[rank]]
            and f"stage_backward_weight s{rank} m0" in pipe.last_ops
        )
        out["split_bitwise"] = all(
            lb == ls and all(torch.equal(pb[n], ps_[n]) for n in pb)
            for (lb, pb), (ls, ps_) in zip(trace_base, trace_split)
        )
    return out


def test_hand_edited_schedules(run_on_ranks):
    for r, out in enumerate(run_on_ranks(_edited, 2)):
        msg = out["deadlock"]
        assert msg is not None and "deadlock" in msg and "recv_grad s0 m0" in msg, msg
        assert out["sent_before_refusal"] == 0
        assert out["ran_edited_order"] and out["bitwise"], (r, out)
        assert out["ran_split"] and out["split_bitwise"], (r, out)


# ---- bad input, named before anything is sent ----------------------------------------------


def _bad_inputs(rank, world):
    mesh = testing.mesh((2, 1), ("pp", "dp"))
    model, plan = _setup(mesh, ("pp", "dp"), "1f1b", 2)
    errors = []
    with fsdpfn.comm.count_collectives() as counter:
        for args in [("zigzag", MICRO), ("1f1b", 0)]:
            try:
                PipelineRuntime(model, plan, *args, loss_fn=_ce)
            except ValueError as e:
                errors.append(str(e))
        try:
            fsdpfn.pipeline_plan(model, mesh, units=UNITS, stages=3)
        except ValueError as e:
            errors.append(str(e))
        model4, plan4 = _setup(mesh, ("pp", "dp"), "interleaved_1f1b", 4)
        try:
            PipelineRuntime(model4, plan4, "interleaved_1f1b", 3, loss_fn=_ce)
        except ValueError as e:
            errors.append(str(e))
    before = len(counter.calls)
    pipe = PipelineRuntime(model, plan, "1f1b", MICRO, loss_fn=_ce)
    params = pipe.shard(model)
    x, y = _batch(1, 0)
    with fsdpfn.comm.count_collectives() as counter:
        try:
            pipe.step(params, x[:6], y[:6])
        except ValueError as e:
            errors.append(str(e))
    return errors, before + len(counter.calls)


def test_bad_input_is_named_before_any_collective(run_on_ranks):
    for errors, calls in run_on_ranks(_bad_inputs, 2):
        assert calls == 0
        assert len(errors) == 5, errors
        assert "unknown pipeline schedule 'zigzag'" in errors[0]
        assert "micro_batches" in errors[1]
        assert "stages=3" in errors[2] and "multiple of the pp size 2" in errors[2]
        assert "micro_batches" in errors[3] and "multiple" in errors[3]
        assert "micro_batches=8" in errors[4] and "6 rows" in errors[4]


def test_stage_modules_of_the_reference_models():
    """A stage shares the model's modules; chaining every stage is the model."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, bias=True))
    x, _ = _batch(1, 0)
    h = x
    for units in (UNITS[:1], UNITS[1:3], UNITS[3:7], UNITS[7:]):
        h = model.pipeline_stage(units)(h)
    assert torch.equal(h, model(x))
    with pytest.raises(ValueError, match="contiguous"):
        model.pipeline_stage(["embed", "blocks.0"])
    with pytest.raises(ValueError, match="not parts"):
        model.pipeline_stage(["blocks"])


# ---- a user's stage modules ----------------------------------------------------------------


class _First(torch.nn.Module):
    """A user's first stage, written by hand: it shares the model's modules."""

    def __init__(self, model):
        super().__init__()
        self.embed, self.pos, self.blocks = model.embed, model.pos, model.blocks[:2]

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class _Last(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.blocks, self.norm, self.head = model.blocks[2:], model.norm, model.head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SPLIT = [["embed", "pos", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "head"]]


def _user_stages(rank, world):
    import copy

    names = ("pp", "dp")
    mesh = testing.mesh((2, 1), names)
    traces, errors = [], []
    with fsdpfn.comm.timeout_scope(60):
        for user in (False, True):
            torch.manual_seed(0)
            model = GPT(CFG)
            plan = fsdpfn.pipeline_plan(model, mesh, units=UNITS, stages=SPLIT)
            stages = {0: _First(model)} if rank == 0 else {1: _Last(model)}
            pipe = PipelineRuntime(model, plan, "1f1b", MICRO, loss_fn=_ce, stages=stages if user else None)
            params = pipe.shard(model)
            x, y = _batch(1, 0)
            grads, loss = pipe.step(params, x, y)
            traces.append((loss.item(), {n: g.full_tensor() for n, g in grads.items()}))
        for bad in ({rank: copy.deepcopy(stages[rank])}, {1 - rank: stages[rank]}):
            try:
                PipelineRuntime(model, plan, "1f1b", MICRO, loss_fn=_ce, stages=bad)
            except ValueError as e:
                errors.append(str(e))
    (la, ga), (lb, gb) = traces
    return la == lb and all(torch.equal(ga[n], gb[n]) for n in ga), errors


def test_user_stage_modules_run_like_the_reference_split(run_on_ranks):
    """Stage modules written by hand (torch.distributed.pipelining style: a module per stage
    sharing the model's submodules) give bitwise the gradients of model.pipeline_stage's."""
    for same, errors in run_on_ranks(_user_stages, 2):
        assert same
        assert "not the model's" in errors[0] and "share the model's submodules" in errors[0], errors[0]
        assert "stages has no module for stage" in errors[1], errors[1]


# ---- remat on a pipeline -------------------------------------------------------------------------


def _remat_step(rank, world, schedule, branchy=False, pp=2):
    """One step of each plan, without and with ``remat={"blocks.*": "full"}``: the loss, the
    gradients and the activation bytes each stage kept at most; or, with ``branchy``, the error a
    block whose recompute takes another branch raises."""
    out = []
    for remat in (None, {"blocks.*": "full"}):
        torch.manual_seed(0)
        model = GPT(CFG)
        if branchy:  # blocks.2 (stage 1) scales its output by how often it ran
            block = model.blocks[2]

            def forward(self, x, _orig=type(block).forward):
                self.calls = getattr(self, "calls", 0) + 1
                return _orig(self, x) * (1.0 + 0.5 * self.calls)

            block.__class__ = type("Branchy", (type(block),), {"forward": forward})
        plan = fsdpfn.pipeline_plan(model, testing.mesh((pp, 1), ("pp", "dp")), units=UNITS, stages=2, remat=remat)
        pipe = PipelineRuntime(model, plan, schedule, micro_batches=4, loss_fn=_ce, profile=True)
        params = pipe.shard(model)
        x, y = _batch(4, 0)
        try:
            grads, loss = pipe.step(params, x, y)
        except fsdpfn.RematReplayError as e:
            out.append(str(e))
            continue
        out.append((loss, {n: g.to_local() for n, g in grads.items()}, pipe.last_profile.peak_activations))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_a_pipelined_plan_rematerialises_its_units(run_on_ranks, schedule):
    """``remat=`` on a pipelined plan was accepted and silently ignored by the pipeline runtime
    (every stage kept its whole activations: 266,560 bytes on stage 0 with and without it). Now
    each rematerialised unit keeps its inputs only and recomputes in its stage's backward: the
    loss and gradients are the same bitwise (the recompute runs the same operators on the same
    values), and the activations a stage keeps at once fall by more than 4x here (the blocks'
    inputs against all their intermediates)."""
    for (loss, grads, kept), (loss_r, grads_r, kept_r) in run_on_ranks(_remat_step, 2, schedule):
        assert torch.equal(loss, loss_r)
        assert all(torch.equal(grads[n], grads_r[n]) for n in grads)
        assert kept_r * 4 < kept, (kept_r, kept)


def test_a_pipelined_unit_whose_recompute_diverges_is_named(run_on_ranks):
    """The replay check runs on the pipeline path too: a block whose recompute computes other
    values (it scales its output by a call counter, which has moved on by the recompute)
    raises ``RematReplayError`` naming it, not a wrong gradient. Both stages on one rank
    (pp 1, two virtual stages); on two ranks see
    :func:`test_a_stage_that_raises_mid_step_ends_its_peer_naming_the_error`."""
    for plain, refused in run_on_ranks(_remat_step, 1, "gpipe", True, 1):
        assert isinstance(plain, tuple)  # without remat nothing is recomputed
        assert "blocks.2" in refused and "recompute" in refused, refused


def _remat_fails_on_one_rank(rank, world):
    """As :func:`_remat_step`'s branchy case on two ranks, without catching: stage 1 (rank 1)
    raises in its backward while rank 0 waits for the gradient it would send."""
    torch.manual_seed(0)
    model = GPT(CFG)
    block = model.blocks[2]

    def forward(self, x, _orig=type(block).forward):
        self.calls = getattr(self, "calls", 0) + 1
        return _orig(self, x) * (1.0 + 0.5 * self.calls)

    block.__class__ = type("Branchy", (type(block),), {"forward": forward})
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh((2, 1), ("pp", "dp")), units=UNITS, stages=2, remat={"blocks.*": "full"}
    )
    pipe = PipelineRuntime(model, plan, "1f1b", micro_batches=4, loss_fn=_ce)
    params = pipe.shard(model)
    x, y = _batch(4, 0)
    return pipe.step(params, x, y)


def test_a_stage_that_raises_mid_step_ends_its_peer_naming_the_error(run_on_ranks):
    """The stage that raises (here a replay error in its backward) announces it, and the peer
    waiting for its gradient fails within about a second naming that error, even though the
    failing process lives on (the test's persistent ranks; a loop that catches and logs)."""
    with pytest.raises(RankError) as info:
        run_on_ranks(_remat_fails_on_one_rank, 2)
    errors = info.value.errors
    assert "RematReplayError" in errors[1] and "blocks.2" in errors[1], errors[1]
    assert "CollectiveError" in errors[0] and "failed on rank 0" in errors[0], errors[0]
    assert "Rank 1 raised: RematReplayError" in errors[0], errors[0]
