"""The vocabulary split over tp: an Embedding split by its rows (``"vocab"``), the output Linear
split by its output features with its logits left split (``"colwise_loss"``), and the
cross-entropy computed from the split logits (:func:`fsdpfn.vocab_parallel_cross_entropy`),
against one process.

Tolerances. The loss over a split vocabulary sums each row's ``exp`` over ``tp`` parts and adds
them (float32 or float64 sums of V terms in another order: at most ``V u`` relative, u the
dtype's unit roundoff): in float64 with V = 96 that is ~1e-14, asked 1e-12. The training runs
use ``tests/test_tp.py``'s SGD (lr 0.2): its update is linear in the gradient, so a parameter
moves from one process's by lr times the gradients' rounding: every sum is a reassociation of at
most K = 64 float32 terms (2 K u ~ 8e-6 of the summed magnitudes at worst, ~1e-7 measured), and
the split embedding adds one exact sum per row (one nonzero term and zeros); asked 1e-6 of the
parameters. AdamW would not do: its first step moves an element whose true gradient is within
rounding of zero (a key weight the causal first token's softmax ignores) by up to lr whatever
its rounding, which on one CPU kernel set gave 1.2e-6 of blocks.0.qkv.weight.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import Runtime

from test_tp import _batch, _reference as tp_reference

CFG = GPTConfig(vocab_size=32, seq_len=8, width=16, depth=2, heads=4, bias=False)
VOCAB_TP = {**GPT_TP_PLAN, "embed": "vocab", "head": "colwise_loss"}
PER_RANK = 2
STEPS = 3


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---- the loss alone ------------------------------------------------------------------------------


def _loss_against_one_process(rank, world, reduction, func):
    mesh = testing.mesh((1, world), ("dp", "tp"))
    vocab = 24 * world
    # A head of `vocab` outputs split 'colwise_loss': the loss reads the plan's tp axis and that width.
    plan = fsdpfn.plan(torch.nn.Sequential(torch.nn.Linear(4, vocab)), mesh, tp={"0": "colwise_loss"})
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, vocab, dtype=torch.float64, generator=gen) * 4
    targets = torch.randint(0, vocab, (3, 5), generator=gen)
    targets[0, :2] = -100  # ignored
    cot = torch.rand(3, 5, dtype=torch.float64, generator=gen) if reduction == "none" else torch.tensor(1.7)
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction=reduction).reshape(cot.shape)
    (want * cot).sum().backward()
    rows = vocab // world
    mine = logits[..., rank * rows : (rank + 1) * rows].clone()

    def loss(x):
        return (fsdpfn.vocab_parallel_cross_entropy(x, targets, plan, reduction=reduction) * cot).sum()

    if func:
        grad = torch.func.grad(loss)(mine)
        got = fsdpfn.vocab_parallel_cross_entropy(mine, targets, plan, reduction=reduction)
    else:
        x = mine.requires_grad_()
        got = fsdpfn.vocab_parallel_cross_entropy(x, targets, plan, reduction=reduction)
        (got * cot).sum().backward()
        grad = x.grad
    with fsdpfn.count_collectives() as counter:
        fsdpfn.vocab_parallel_cross_entropy(mine, targets, plan)
    return {
        "loss": _rel(got, want.detach()),
        "grad": _rel(grad, ref.grad[..., rank * rows : (rank + 1) * rows]),
        "calls": [(c.kind, c.tag, c.nbytes) for c in counter.calls],
    }


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("func", [True, False], ids=["func.grad", "backward"])
def test_the_loss_over_a_split_vocabulary_is_one_processs(run_on_ranks, reduction, func):
    """Loss and logits gradient on 4 ranks (each a quarter of 96 columns, ignored targets
    included) against ``F.cross_entropy`` of the whole rows, float64; two all-reduces forward
    (each row's max, then its two sums), none backward."""
    for out in run_on_ranks(_loss_against_one_process, 4, reduction, func):
        assert out["loss"] < 1e-12 and out["grad"] < 1e-12, out
        assert out["calls"] == [("all_reduce", "vocab_max", 15 * 8), ("all_reduce", "vocab_sum", 2 * 15 * 8)], out


def test_the_loss_with_one_tp_rank_is_cross_entropy():
    plan = fsdpfn.plan(torch.nn.Linear(4, 4), (1,))
    logits, targets = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert torch.equal(fsdpfn.vocab_parallel_cross_entropy(logits, targets, plan), want)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 7\) and targets \(2, 4\) do not fit"):
        fsdpfn.vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), plan)


# ---- a GPT with its vocabulary split, trained ------------------------------------------------------


def _reference(dp, steps, cfg=CFG):
    return tp_reference(cfg, dp, steps, "sgd")  # tests/test_tp.py's one-process SGD loop


def _train(rank, world, shape, styles, cfg=CFG):
    mesh = testing.mesh(shape, ("dp", "tp"))
    ref = _reference(shape[0], STEPS, cfg)
    out = {}
    for style in styles:
        torch.manual_seed(0)
        model = GPT(cfg)
        plan = fsdpfn.plan(model, mesh, tp=VOCAB_TP)
        dp_rank = fsdpfn.transforms.dp_rank(plan)
        mine = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
        params = fsdpfn.shard(model, plan, requires_grad=style == "runtime")
        opt = fsdpfn.optim.sgd(0.2)  # test_tp.py's SGD: its update is linear in the gradient
        state = opt.init(params)
        rt = Runtime(model, plan) if style == "runtime" else None
        worst = 0.0
        for step in range(STEPS):
            x, y = _batch(plan.dp_size, step, cfg)
            x, y = x[mine], y[mine]
            if rt is None:
                grads = torch.func.grad(
                    lambda ps: fsdpfn.vocab_parallel_cross_entropy(
                        torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y, plan
                    )
                )(params)
            else:
                with rt.bind(params):
                    fsdpfn.vocab_parallel_cross_entropy(model(x), y, plan).backward()
                grads = rt.grads(params)
            with torch.no_grad():
                updates, state = opt.update(grads, state, params)
                params = fsdpfn.optim.apply_updates(params, updates)
            if rt is not None:
                params = {n: p.detach().requires_grad_() for n, p in params.items()}
            worst = max(worst, max(_rel(params[n].full_tensor(), ref[step][n]) for n in params))
        out[style] = worst
    local = {n: tuple(p.to_local().shape) for n, p in params.items() if n in ("embed.weight", "head.weight")}
    return out, local


def test_a_tied_head_shares_the_embeddings_split_and_trains_like_one_process(run_on_ranks):
    """``tie_embeddings=True``: the head runs the embedding's rows of the vocabulary (one
    tensor, one placement), both uses' gradients summed into it."""
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    for out, local in run_on_ranks(_train, 4, (2, 2), ("pure", "runtime"), tied):
        assert max(out.values()) < 1e-6, out
        assert list(local) == ["embed.weight"], local


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)], ids=["dp2-tp2", "tp4"])
def test_a_gpt_with_a_split_vocabulary_trains_like_one_process(run_on_ranks, shape):
    """The embedding and the head hold 1/tp of the vocabulary's rows on each rank (before dp
    shards them further), and SGD steps of the pure loop and the runtime (its first step
    checked unit by unit against the unsharded model) match one process."""
    for out, local in run_on_ranks(_train, 4, shape, ("pure", "runtime")):
        assert max(out.values()) < 1e-6, out
        rows = CFG.vocab_size // shape[1]
        assert all(s[0] <= -(-rows // shape[0]) for s in local.values()), local


# ---- the op list -----------------------------------------------------------------------------------


def _counted(rank, world):
    mesh = testing.mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, mesh, tp=VOCAB_TP)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    rt = Runtime(model, plan, verify=False)
    x, y = _batch(plan.dp_size, 0)
    mine = slice(fsdpfn.transforms.dp_rank(plan) * PER_RANK, (fsdpfn.transforms.dp_rank(plan) + 1) * PER_RANK)
    with fsdpfn.count_collectives() as fwd:
        loss = fsdpfn.vocab_parallel_cross_entropy(rt.apply(params, x[mine]), y[mine], plan)
    with fsdpfn.count_collectives() as bwd:
        loss.backward()
    key = lambda c, phase: (phase, c.kind, c.group_size, c.nbytes, str(c.dtype), c.tag)  # noqa: E731
    counted = [key(c, p) for p, ctr in (("forward", fwd), ("backward", bwd)) for c in ctr.calls]
    listed_calls = fsdpfn.step_collectives(plan, schedule=rt.schedule, tokens=PER_RANK * CFG.seq_len)
    listed = [key(c, c.phase) for c in listed_calls]
    return counted, listed


def test_the_split_vocabulary_is_on_the_op_list_the_cost_and_the_simulation(run_on_ranks):
    """A runtime step issues exactly the listed collectives, in order: the embedding's
    all-reduce, the head's input-gradient all-reduce and the loss's two; ``plan.cost()`` and the
    simulator sum the same list."""
    for counted, listed in run_on_ranks(_counted, 4):
        assert counted == listed, next((i, a, b) for i, (a, b) in enumerate(zip(counted, listed)) if a != b)
        tags = [t[-1] for t in listed]
        assert {"embed", "head", "vocab_max", "vocab_sum"} <= set(tags), tags
    model = GPT(CFG)
    plan = fsdpfn.plan(model, {"dp": 2, "tp": 2}, tp=VOCAB_TP)
    tokens = PER_RANK * CFG.seq_len
    listed = fsdpfn.step_collectives(plan, tokens=tokens)
    loss = [c for c in listed if c.tag.startswith("vocab_")]
    assert [(c.nbytes, c.phase) for c in loss] == [(tokens * 4, "forward"), (2 * tokens * 4, "forward")]
    cost = plan.cost(tokens=tokens)
    assert list(cost.calls) == list(listed)
    ids = torch.randint(0, CFG.vocab_size, (PER_RANK, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    wl = fsdpfn.sim.profile(model, plan, ids)  # ids of the whole vocabulary: each rank looks up its rows
    sched = fsdpfn.runtime.schedule(plan)
    r = fsdpfn.sim.simulate(plan, sched, wl, None, fsdpfn.sim.H100_SXM)
    with_wl = fsdpfn.step_collectives(plan, schedule=sched, tokens=wl.tokens)
    assert wl.tokens == tokens and sorted(map(str, r.calls)) == sorted(map(str, with_wl))


# ---- refusals --------------------------------------------------------------------------------------


def test_a_split_vocabulary_is_refused_where_it_cannot_hold():
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"vocabulary of 32 .* does not divide over tp=3"):
        fsdpfn.plan(model, {"dp": 1, "tp": 3}, tp={"embed": "vocab"})
    with pytest.raises(NotImplementedError, match="splits over its vocabulary with the style 'vocab'"):
        fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp={**GPT_TP_PLAN, "embed": "rowwise"})
    with pytest.raises(ValueError, match="'vocab' splits an nn.Embedding by its rows"):
        fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp={**GPT_TP_PLAN, "head": "vocab"})
    padded = GPT(CFG)
    padded.embed = torch.nn.Embedding(CFG.vocab_size, CFG.width, padding_idx=0)
    with pytest.raises(NotImplementedError, match="padding_idx=0"):
        fsdpfn.plan(padded, {"dp": 1, "tp": 2}, tp={"embed": "vocab"})


# ---- logits split for a loss that never came --------------------------------------------------------


def _wrong_losses(rank, world):
    mesh = testing.mesh((1, 2), ("dp", "tp"))
    out = {}
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, CFG.vocab_size // 2, (2, CFG.seq_len), generator=torch.Generator().manual_seed(2))
    for name, tp in (("whole_rows", VOCAB_TP), ("mid_layer", {**GPT_TP_PLAN, "blocks.*.qkv": "colwise_loss"})):
        for style in ("pure", "runtime"):
            torch.manual_seed(0)
            model = GPT(CFG)
            plan = fsdpfn.plan(model, mesh, tp=tp)
            params = fsdpfn.shard(model, plan, requires_grad=style == "runtime")
            try:
                if style == "pure":  # targets all in rank 0's half: F.cross_entropy itself would not fail
                    loss = lambda ps: F.cross_entropy(  # noqa: E731
                        torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)).flatten(0, 1), y.flatten()
                    )
                    torch.func.grad(loss)(params)
                else:
                    rt = Runtime(model, plan)
                    with rt.bind(params):
                        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                out[(name, style)] = "no error"
            except ValueError as e:
                out[(name, style)] = str(e)
    plain = fsdpfn.plan(GPT(CFG), mesh, tp=GPT_TP_PLAN)
    mid = fsdpfn.plan(GPT(CFG), mesh, tp={**GPT_TP_PLAN, "blocks.*.qkv": "colwise_loss"})
    for name, plan in (("no_split_head", plain), ("whole_logits", mid)):
        try:
            fsdpfn.vocab_parallel_cross_entropy(torch.randn(2, CFG.seq_len, CFG.vocab_size), y, plan)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_split_logits_given_to_another_loss_are_named_on_every_rank(run_on_ranks):
    """``F.cross_entropy`` on a ``colwise_loss`` head's columns (targets all in one rank's
    slice, so it would run) trained wrong without a word; ``colwise_loss`` on a layer inside the
    model, likewise. The first step's reduce now raises on every rank, in the pure loop and the
    runtime; and the loss refuses logits that are not a ``colwise_loss`` layer's columns."""
    for out in run_on_ranks(_wrong_losses, 2):
        for key in [("whole_rows", "pure"), ("whole_rows", "runtime"), ("mid_layer", "pure"), ("mid_layer", "runtime")]:
            assert "never called fsdpfn.vocab_parallel_cross_entropy" in out[key], (key, out[key])
        assert "splits no output layer 'colwise_loss'" in out["no_split_head"], out
        assert "have 32 columns" in out["whole_logits"] and "'blocks.0.qkv'" in out["whole_logits"], out
