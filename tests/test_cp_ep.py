"""Context parallelism beside expert parallelism: the reference MoE GPT on (ep, edp, cp) =
(2, 1, 2) over 4 gloo ranks, every sequence split over cp (head-tail balanced), the experts
split over ep, dense parameters sharded over ep x edp x cp flattened and expert weights over
edp x cp, trained against one process on the whole batch; and checkpoints across cp degrees.

[Note: the one-process reference of a cp x ep run]
The two ranks of one ep position hold different parts of the same sequences (cp), the two ep
positions read different sequences (ep is data parallel). Each rank's loss is its cross-entropy
mean over its own tokens plus the MoE layers' load-balancing losses computed on the tokens it
routes (a rank routes its own part of every sequence: the aux loss and the capacity are per
rank's tokens), and the gradients are averaged over the 4 ranks (``plan.grad_ranks``). Since
every rank holds as many tokens, the mean of the ranks' cross-entropies is one process's over
the whole batch. The aux loss is not linear in the tokens, so, as the ep tests do
(tests/test_moe.py, tests/test_moe_plan.py: the reference calls the layer once per rank's
tokens), the reference computes it per rank: its MoE layers see the whole batch's tokens,
route each rank's tokens (that rank's sequences, that cp rank's head and tail chunks) in a call
of their own and average the aux losses; the outputs are put back in place. With
``capacity_factor=None`` no token is dropped, so routing a subset of the tokens changes no
output and the reference is the same function as the distributed run, term by term.

[Note: the tolerance of the cp x ep parity test]
The reasoning of [Note: the tolerance of the cp parity tests] in tests/test_cp.py and of
tests/test_moe_plan.py: the run computes the same products and adds some of them in another
order (each rank's mean over its 32 tokens, then the mean over 4 ranks; an expert's gradient
summed by source rank in the all-to-all's backward, then over edp x cp; dense gradients
reduce-scattered over 4 ranks; the ring merges partial softmaxes by log-sum-exp). The longest
such sum has 4 x 16 = 64 token terms (x top_k = 2 for an expert weight), so gradients agree
within 128 u ~= 8e-6 relative at worst (u = 2^-24), ~sqrt(128) u ~= 7e-7 typically. AdamW's
update m / sqrt(v) carries the gradient's relative error and moves a parameter by at most
lr = 1e-3 per step, so after 5 steps the parameters differ by at most 5 x lr x 8e-6 = 4e-8 per
element (biases are off, as in tests/test_cp.py, so no element's gradient is within rounding of
zero). The router sees the same inputs within ~1e-7, far from ties at this size, so no token
changes experts (a changed choice would show as a difference of ~lr, not of ~1e-8). The 1e-6
asked of the relative difference of each parameter is the cp and ep tests' own; measured:
2.6e-8 (allgather) and 6.9e-8 (ring), pure loop and runtime alike. The reference is not loose:
with the aux loss computed on the whole batch instead of per rank it differs by 7e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig, MoE

from _cp_steps import cp_adamw_worst
from _parity import one_process

SEQ = 16
CFG = GPTConfig(
    vocab_size=29,
    seq_len=SEQ,
    width=16,
    depth=2,
    heads=4,
    bias=False,
    experts=4,
    top_k=2,
    aux_weight=0.1,
    capacity_factor=None,
    causal=True,
)
PER_RANK = 2
STEPS = 5
MESH = ((2, 1, 2), ("ep", "edp", "cp"))


def _batch(dp, step, cfg=CFG):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (dp * PER_RANK, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _head_tail(seq, cp, r):
    """Positions cp rank ``r`` holds: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` (written out
    here, not taken from fsdpfn)."""
    c = seq // (2 * cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def _rank_tokens(dp, cp, seq=SEQ):
    """The flat (batch x seq) token indices each (dp position, cp position) rank routes."""
    return [
        torch.tensor([b * seq + t for b in range(d * PER_RANK, (d + 1) * PER_RANK) for t in _head_tail(seq, cp, c)])
        for d in range(dp)
        for c in range(cp)
    ]


def _per_rank_moe(model, groups):
    """Makes ``model``'s MoE layers route each rank's tokens in a call of their own and average
    the aux losses (see [Note: the one-process reference of a cp x ep run])."""
    order = torch.cat(groups)
    back = torch.argsort(order)
    for m in model.modules():
        if isinstance(m, MoE):

            def forward(x, m=m):
                outs = [MoE.forward(m, x[g]) for g in groups]
                return torch.cat([y for y, _ in outs])[back], sum(a for _, a in outs) / len(outs)

            m.forward = forward


def _loss(out, y):
    logits, aux = out
    return _ce(logits, y) + aux


@one_process
def _reference(dp, cp, steps):
    torch.manual_seed(0)
    model = GPT(CFG)
    _per_rank_moe(model, _rank_tokens(dp, cp))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    out = []
    for step in range(steps):
        x, y = _batch(dp, step)
        g = torch.func.grad(lambda ps: _loss(torch.func.functional_call(model, ps, (x,)), y))(params)
        updates, state = opt.update(g, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        out.append(params)
    return out


def _train(rank, world, mesh_shape, names, configs, steps=STEPS):
    """Each config (strategy, style) trained ``steps`` AdamW steps on the mesh; per config the
    worst relative difference of any parameter from one process over all steps, and this rank's
    (dp_rank, cp_rank)."""
    mesh = testing.mesh(mesh_shape, names)
    results = []
    for strategy, style in configs:
        torch.manual_seed(0)
        model = GPT(CFG)
        plan = fsdpfn.plan(model, mesh)
        ref = _reference(plan.dp_size, plan.axes.cp_size, steps)
        me = fsdpfn.transforms.dp_rank(plan)
        results.append(
            cp_adamw_worst(
                model, plan, style, strategy, lambda step: _batch(plan.dp_size, step), _loss, ref, PER_RANK, steps
            )
        )
    return (me, fsdpfn.transforms.cp_rank(plan), plan.dp_size, plan.grad_ranks), results


CONFIGS = [(s, style) for s in ("allgather", "ring") for style in ("pure", "eager")]


def test_ep2_cp2_adamw_5_steps_match_one_process(run_on_ranks):
    """Causal attention, both cp strategies, the pure loop and the runtime: see [Note: the
    tolerance of the cp x ep parity test]."""
    out = run_on_ranks(_train, 4, *MESH, CONFIGS)
    # cp peers read the same slice of the batch; the two ep positions different ones.
    assert [o[0] for o in out] == [(0, 0, 2, 4), (0, 1, 2, 4), (1, 0, 2, 4), (1, 1, 2, 4)]
    for _, worst in out:
        assert max(worst) < 1e-6, dict(zip(CONFIGS, worst))


def test_plan_shards_dense_over_ep_x_edp_x_cp_and_experts_over_edp_x_cp():
    from fsdpfn._plan import placements as P

    plan = fsdpfn.plan(GPT(CFG), dict(zip(MESH[1], MESH[0])))
    assert plan.dp_size == 2 and plan.grad_ranks == 4 and plan.axes.dense_shard_size == 4
    dense = [u for u in plan.units if not u.experts]
    experts = [u for u in plan.units if u.experts]
    assert dense and experts
    for u in dense:
        assert (
            P.unit_row_roles(u, plan.axes) == (fsdpfn.Role.EP, fsdpfn.Role.SHARD, fsdpfn.Role.CP) and u.shard_size == 4
        )
    for u in experts:
        assert P.unit_row_roles(u, plan.axes) == (fsdpfn.Role.SHARD, fsdpfn.Role.CP) and u.shard_size == 2
        assert P.reduce_roles(u.params[0], plan.axes) == (fsdpfn.Role.SHARD, fsdpfn.Role.CP)


def test_cp_before_the_ep_and_shard_axes_is_refused_by_name():
    for shape in ({"cp": 2, "ep": 2, "edp": 1}, {"ep": 2, "cp": 2, "edp": 1}):
        with pytest.raises(
            NotImplementedError, match=r"context parallelism \(axis 'cp'\) beside expert parallelism .* after"
        ):
            fsdpfn.MeshAxes.from_shape(shape)
    with pytest.raises(NotImplementedError, match=r"axis 'tp' \(tp\) cannot be combined"):
        fsdpfn.MeshAxes.from_shape({"ep": 2, "edp": 1, "cp": 2, "tp": 2})


# ---- checkpoints across cp degrees beside ep -----------------------------------------------------


def _ckpt_template(model, plan):
    params = {
        n: p * 0 - 1 for n, p in fsdpfn.shard(model, plan).items()
    }  # not the saved values: the load must overwrite them
    return {"params": params, "opt_state": fsdpfn.optim.adamw(1e-3).init(params), "step": 0}


def _ckpt_step(rank, world, src, dst, shape, names):
    """Loads ``src`` (or, without one, trains 2 steps) on the mesh, saves to ``dst`` if given;
    returns every tensor leaf in full."""
    from fsdpfn import checkpoint

    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh(shape, names))
    if src is None:
        params = fsdpfn.shard(model, plan)
        opt = fsdpfn.optim.adamw(1e-3)
        state = opt.init(params)
        me = fsdpfn.transforms.dp_rank(plan)
        mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
        for step in range(2):
            x, y = fsdpfn.context_parallel_shard(tuple(t[mine] for t in _batch(plan.dp_size, step)), plan)
            with fsdpfn.context_parallel(plan):
                g = torch.func.grad(
                    lambda ps: _loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)
                )(params)
            updates, state = opt.update(g, state, params)
            params = fsdpfn.optim.apply_updates(params, updates)
        full_state = {"params": params, "opt_state": state, "step": 2}
    else:
        full_state = checkpoint.load(src, _ckpt_template(model, plan), plan)
    if dst is not None:
        checkpoint.save(dst, full_state, plan)
    entries, _ = checkpoint.flatten_state(full_state)
    return {p: fsdpfn.comm.full_tensor(v) if isinstance(v, torch.Tensor) else v for p, v in entries.items()}


def test_checkpoint_ep2_cp2_to_ep2_cp1_and_to_plain_dp_bitwise(run_on_ranks, tmp_path):
    """Saved on (ep, edp, cp) = (2, 1, 2), loaded on (ep, edp, cp) = (2, 2, 1), saved again and
    loaded back on (2, 1, 2), and loaded on plain dp = 4 (no ep, no cp): every parameter and
    AdamW moment is the same, bit for bit (checkpoints are keyed by path; cp and ep only change
    which rows each rank holds)."""
    a, b = str(tmp_path / "cp2"), str(tmp_path / "cp1")
    first = run_on_ranks(_ckpt_step, 4, None, a, *MESH)[0]
    second = run_on_ranks(_ckpt_step, 4, a, b, (2, 2, 1), ("ep", "edp", "cp"))[0]
    third = run_on_ranks(_ckpt_step, 4, b, None, *MESH)[0]
    plain = run_on_ranks(_ckpt_step, 4, a, None, (4,), ("dp",))[0]
    assert first.keys() == second.keys() == third.keys() == plain.keys()
    for p, v in first.items():
        for other in (second[p], third[p], plain[p]):
            assert (torch.equal(v, other) and v.dtype == other.dtype) if isinstance(v, torch.Tensor) else v == other, p


def _compiled_refusal(rank, world, names, verify=True):
    import warnings

    import fsdpfn
    from fsdpfn import testing
    from fsdpfn.models import GPT, GPTConfig

    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=1, heads=2, experts=2 if "ep" in names else 0)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((2, 1) if "ep" in names else (1, 2), names))
    params = fsdpfn.shard(model, plan)
    x = torch.randint(0, 29, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_fn(p, x):
        with fsdpfn.context_parallel(plan):
            out = torch.func.functional_call(model, fsdpfn.unshard(p, plan), (x,))
        return (out[0] if isinstance(out, tuple) else out).float().mean()

    try:
        fsdpfn.compile(loss_fn, backend="aot_eager", verify=verify)(params, fsdpfn.context_parallel_shard(x, plan))
    except Exception as e:  # noqa: BLE001 - which error it is is the test
        return f"{type(e).__name__}: {e}"
    return "compiled"


def test_compiling_an_ep_step_with_routed_experts_is_refused_by_name(run_on_ranks):
    """Routed (not padded) expert layers' all-to-alls take split sizes the router decides at
    run time, which a compiled graph cannot hold: the compile is refused naming the axis, the
    layers, the reason, the padded layers that compile and the eager alternatives, not a
    data-dependent-guard error from inside dynamo. (Padded layers and cp compile: see
    tests/test_compile.py.)"""
    for message in run_on_ranks(_compiled_refusal, 2, ("ep", "edp"), timeout=600):
        assert message.startswith("CompileUnsupportedError"), message[:1500]
        for part in (
            "expert parallelism (ep=2",
            "blocks.0.moe.experts",
            "split sizes",
            "pad_to_capacity=True",
            "Runtime",
        ):
            assert part in message, (part, message[:1500])


def test_a_cp_step_compiled_before_any_checked_step_is_refused(run_on_ranks):
    """A compiled graph cannot count attention's calls, so the check that attention is cp-aware
    (which catches plain SDPA on a cp mesh, a silently wrong gradient) runs on an eager step:
    fsdpfn.compile's verify step. With verify=False and no eager step of the plan yet, the
    compile is refused by name, on every rank, rather than trusted unchecked."""
    for message in run_on_ranks(_compiled_refusal, 2, ("dp", "cp"), False, timeout=600):
        assert message.startswith("CompileUnsupportedError"), message[:1500]
        assert "context-parallel axis (cp=2)" in message and "verify=True" in message, message[:1500]
