"""Mistakes only visible while a step runs: each is a ValueError on every rank, or the step
computes what one process computes.

- the tensor-parallel hooks live on one model instance: a tp-split weight run by another
  instance (or a model sharded from a dict) raises, naming the module and the fix;
- tp peers given different inputs (a batch indexed by the global rank, not ``dp_rank(plan)``);
- data-parallel ranks given batches of different sizes (the mean of per-rank means).

On the code before these checks every one of these trained silently: the second instance gave
losses 3.16486 and 3.17172 on the two tp ranks against 3.16511 in one process, the global-rank
batch mixed two batches' activations, and 3 + 2 rows gave a gradient 20% off one process
(the relative norm of the difference over all parameters, on this model and batch).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import Runtime

CFG = GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2)


def _batch(rows: int, step: int = 0):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits, y, reduction="mean"):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=reduction)


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _setup(mesh_shape, names, tp=True, **kw):
    mesh = testing.mesh(mesh_shape, names)
    model = _model()
    plan = fsdpfn.plan(model, mesh, tp=GPT_TP_PLAN, **kw) if tp else fsdpfn.plan(model, mesh, **kw)
    return model, plan


def _grad_step(runner, plan, params, x, y):
    return torch.func.grad_and_value(
        lambda ps: _ce(torch.func.functional_call(runner, fsdpfn.unshard(ps, plan), (x,)), y)
    )(params)


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# the tp hooks belong to one instance
# ---------------------------------------------------------------------------------------------


def _tp_wrong_model(rank, world, how, grad):
    model, plan = _setup((1, 2), ("dp", "tp"))
    x, y = _batch(4)
    if how == "instance":  # a second instance of the same class, same weights
        params, runner = fsdpfn.shard(model, plan), _model()
    else:  # sharded from a dict: apply_tp never saw a model
        runner = _model()
        params = fsdpfn.shard(dict(runner.named_parameters()), plan)
    if grad:
        return _error(lambda: _grad_step(runner, plan, params, x, y))
    with torch.no_grad():
        return _error(lambda: torch.func.functional_call(runner, fsdpfn.unshard(params, plan), (x,)))


@pytest.mark.parametrize("how", ["instance", "dict"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward_only"])
def test_tp_weight_without_its_hooks_raises_on_every_rank(run_on_ranks, how, grad):
    for err in run_on_ranks(_tp_wrong_model, 2, how, grad):
        assert err is not None, "the step ran without the tp all-reduces"
        assert "'blocks.0.qkv'" in err and "carries no tensor-parallel hooks" in err
        assert "fsdpfn.apply_tp(model, plan)" in err


def _tp_hooked_model(rank, world, how):
    """The fixes: the same instance, or apply_tp on the instance run."""
    model, plan = _setup((1, 2), ("dp", "tp"))
    x, y = _batch(4)
    ref = torch.func.grad_and_value(lambda ps: _ce(torch.func.functional_call(model, ps, (x,)), y))(
        {n: p.detach() for n, p in model.named_parameters()}
    )
    if how == "same":
        params, runner = fsdpfn.shard(model, plan), model
    else:
        runner = fsdpfn.apply_tp(_model(), plan)
        params = fsdpfn.shard(dict(runner.named_parameters()), plan)
    grads, loss = _grad_step(runner, plan, params, x, y)
    worst = max(((grads[n].full_tensor() - ref[0][n]).norm() / ref[0][n].norm().clamp_min(1e-30)).item() for n in grads)
    return loss.item(), ref[1].item(), worst


@pytest.mark.parametrize("how", ["same", "apply_tp"])
def test_tp_on_the_hooked_instance_matches_one_process(run_on_ranks, how):
    out = run_on_ranks(_tp_hooked_model, 2, how)
    for loss, ref, worst in out:
        # Sums reassociated over 2 tp ranks: ~(terms) x 2^-24 relative, see [Note: the tolerance
        # of the TP parity tests] in test_tp.py (measured <= 4e-7 there).
        assert loss == pytest.approx(ref, rel=1e-6)
        assert worst < 1e-6
    assert out[0][0] == out[1][0]  # both tp ranks computed the one loss


# ---------------------------------------------------------------------------------------------
# tp peers must see the same batch
# ---------------------------------------------------------------------------------------------


def _tp_batch(rank, world, index_by, runtime):
    model, plan = _setup((1, 2), ("dp", "tp"))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    i = rank if index_by == "global_rank" else fsdpfn.transforms.dp_rank(plan)
    x, y = x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]
    if runtime == "compiled":
        return _error(lambda: _compiled_step(model, plan, params, x, y, verify=False))
    if runtime:
        rt = Runtime(model, plan)
        return _error(lambda: rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x), y))(params))
    return _error(lambda: _grad_step(model, plan, params, x, y))


def _compiled_step(model, plan, params, x, y, verify, runtime=None):
    """Two steps of ``fsdpfn.compile`` (aot_eager: the graphs as traced, no code generation),
    with dynamo's own warnings silenced (they are torch's, not ours); the model run by
    ``runtime.apply`` when one is given."""

    def loss_fn(ps, x, y):
        if runtime is not None:
            return _ce(runtime.apply(ps, x), y)
        return _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)

    torch._dynamo.reset()
    step = fsdpfn.compile(loss_fn, backend="aot_eager", verify=verify)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            out = step(params, x, y)
    return out


@pytest.mark.parametrize("runtime", [False, True, "compiled"], ids=["pure", "runtime", "compiled"])
def test_tp_peers_with_different_batches_raise(run_on_ranks, runtime):
    for err in run_on_ranks(_tp_batch, 2, "global_rank", runtime):
        assert err is not None, "tp peers trained on different batches without a word"
        assert "ranks [0, 1] are tensor-parallel peers" in err and "dp_rank(plan)" in err


def test_tp_peers_indexed_by_dp_rank_pass(run_on_ranks):
    assert run_on_ranks(_tp_batch, 2, "dp_rank", False) == [None, None]
    assert run_on_ranks(_tp_batch, 2, "dp_rank", "compiled") == [None, None]


# ---------------------------------------------------------------------------------------------
# data-parallel ranks must get batches of one size
# ---------------------------------------------------------------------------------------------


def _dp_rows(rank, world, rows, mode):
    """Plain FSDP over 2 ranks: rank r reads ``rows[r]`` of the 5-row global batch."""
    model, plan = _setup((2,), ("dp",), tp=False)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(sum(rows))
    start = sum(rows[:rank])
    x, y = x[start : start + rows[rank]], y[start : start + rows[rank]]
    if mode == "eval":
        with torch.no_grad():
            return _error(lambda: torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,)))
    if mode == "runtime":
        rt = Runtime(model, plan)
        return _error(lambda: rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x), y))(params))
    if mode == "compiled-runtime":  # the runtime's apply under fsdpfn.compile, no check asked for
        rt = Runtime(model, plan, verify=False)
        return _error(lambda: _compiled_step(rt, plan, params, x, y, verify=False, runtime=rt))
    if mode.startswith("compiled"):
        return _error(lambda: _compiled_step(model, plan, params, x, y, verify=mode == "compiled-verified"))
    if mode == "sum":  # the documented way to weigh unequal batches: sum, scaled by the global rows
        tokens = sum(rows) * CFG.seq_len

        def loss(ps):
            full = fsdpfn.unshard(ps, plan, grad_op="sum", grad_scale=1 / tokens)
            return _ce(torch.func.functional_call(model, full, (x,)), y, reduction="sum")

        grads = torch.func.grad(loss)(params)
        X, Y = _batch(sum(rows))
        ref = torch.func.grad(lambda ps: _ce(torch.func.functional_call(model, ps, (X,)), Y))(
            {n: p.detach() for n, p in model.named_parameters()}
        )
        return max(((grads[n].full_tensor() - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in grads)
    return _error(lambda: _grad_step(model, plan, params, x, y))


@pytest.mark.parametrize("mode", ["pure", "runtime", "compiled", "compiled-verified", "compiled-runtime"])
def test_unequal_dp_batches_raise(run_on_ranks, mode):
    """Every step machine runs the batch check on its first steps: the compiled step too, with
    ``verify=False`` (it trained 3 + 2 rows silently, also with the model run by a runtime's
    ``apply``) and with it (where the loss check caught it first, naming the loss, not the batch
    sizes)."""
    for err in run_on_ranks(_dp_rows, 2, (3, 2), mode):
        assert err is not None, "3 + 2 rows trained silently (the mean of means is 20% off)"
        assert "rank 0: 3, rank 1: 2" in err and "drop_last=True" in err


def test_equal_dp_batches_and_unequal_eval_pass(run_on_ranks):
    assert run_on_ranks(_dp_rows, 2, (2, 2), "pure") == [None, None]
    assert run_on_ranks(_dp_rows, 2, (3, 2), "eval") == [None, None]  # no gradient, nothing to weigh


def test_unequal_dp_batches_with_a_summed_reduce_match_one_process(run_on_ranks):
    for worst in run_on_ranks(_dp_rows, 2, (3, 2), "sum"):
        assert worst < 1e-6  # fp32 sums over 2 ranks reassociated: a few 2^-24 relative


# ---------------------------------------------------------------------------------------------
# the checks run outside the collective counter, on the first steps only
# ---------------------------------------------------------------------------------------------


def _counted_steps(rank, world):
    model, plan = _setup((1, 2), ("dp", "tp"))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(2)
    counts = []
    for _ in range(fsdpfn.transforms._guards.CHECKED_STEPS + 1):
        with fsdpfn.comm.count_collectives() as counter:
            _grad_step(model, plan, params, x, y)
        counts.append(counter.counts())
    return counts


def test_checked_steps_issue_the_same_collectives_as_later_steps(run_on_ranks):
    for counts in run_on_ranks(_counted_steps, 2):
        assert counts[0] and all(c == counts[-1] for c in counts), counts


def _captures_per_step(rank, world):
    """How many times each of a verified compiled step's first three calls runs the loss
    function up to the model's forward to capture it (each run gathers the model, uncounted).
    The loss check's own runs of the loss function, under an inert capture, are not counted."""
    import contextlib

    from fsdpfn.transforms import _guards

    model, plan = _setup((2,), ("dp",), tp=False)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
    caps = []
    original = _guards.capturing

    @contextlib.contextmanager
    def counted():
        with original() as cap:
            caps.append(cap)
            yield cap

    _guards.capturing = counted
    try:
        torch._dynamo.reset()
        step = fsdpfn.compile(
            lambda ps, x, y: _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y),
            backend="aot_eager",
            verify=True,
        )
        per_step = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                before = len(caps)
                step(params, x, y)
                per_step.append(sum(not cap.inert for cap in caps[before:]))
    finally:
        _guards.capturing = original
    return per_step


def test_the_first_verified_compiled_step_captures_once_for_both_checks(run_on_ranks):
    """Step 1 checks its batch and verifies the plan, step 2 checks its batch, step 3 checks
    nothing: one capture (one uncounted gather of the model) serves step 1's two checks."""
    assert run_on_ranks(_captures_per_step, 2) == [[1, 1, 0], [1, 1, 0]]
