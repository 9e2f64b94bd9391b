"""examples/your_model.py, run as a user runs it (2 gloo ranks it starts itself), against the same
training loop in one process on the unsharded model.

The example trains a small CNN with the runtime under zero3 and AdamW, checkpoints, reloads and
exports a plain state dict; that state dict must equal the one-process loop's parameters up to
floating-point summation order (tolerance derived in ``test_trained_parameters_match_one_process``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from fsdpfn import optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "your_model.py")
STEPS, BATCH, LR, WORLD = 8, 16, 3e-3, 2


def _example():
    spec = importlib.util.spec_from_file_location("your_model_for_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error", "PYTHONPATH": ROOT}
    args = [
        "--steps",
        str(STEPS),
        "--batch",
        str(BATCH),
        "--lr",
        str(LR),
        "--world-size",
        str(WORLD),
        "--log-every",
        "4",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)


def _one_process(ex, args) -> dict[str, torch.Tensor]:
    """The example's loop without fsdpfn's sharding: the whole global batch in one process."""
    torch.manual_seed(args.seed)
    model = ex.SmallCNN(args.channels, args.depth)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(ps, images, labels):
        return ex.loss_of(torch.func.functional_call(model, ps, (images,)), labels)

    opt = optim.adamw(lr=args.lr, weight_decay=0.01)
    state = opt.init(params)
    for step in range(args.steps):
        images, labels = ex.batch(step, args.batch, args.seed)
        grads = torch.func.grad(loss_fn)(params, images, labels)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.e2e
def test_trained_parameters_match_one_process(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(reloaded: equal)" in proc.stdout and "held-out loss" in proc.stdout, proc.stdout

    ex = _example()
    args = ex.parse_args(["--steps", str(STEPS), "--batch", str(BATCH), "--lr", str(LR)])
    ref = _one_process(ex, args)
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(trained) == set(ref)

    # Tolerance. The two runs do the same arithmetic except the order of sums: the example's
    # gradient is the mean over 2 ranks of per-rank means over 8 images (reduce-scatter), the
    # reference one mean over 16; inside the convolutions' backward each weight gradient sums
    # batch x 8 x 8 products. fp32 reordering of n terms moves a sum by about sqrt(n) * eps
    # relative (eps = 1.2e-7, n <= 16 * 64 = 1024: ~4e-6). AdamW's update m / (sqrt(v) + eps) is
    # invariant to the gradient's scale, so per element it moves by about that relative amount
    # too (at most lr * 4e-6 per step), except where a gradient is itself at rounding level.
    # After STEPS = 8 steps: ~8 * 3e-3 * 4e-6 = 1e-7 per element, against parameters of
    # magnitude ~0.1 (default conv and linear init, 16 channels): ~1e-6 relative to each tensor's
    # norm. We allow 1e-5, ten times that; a wrong shard, a missing reduce or a lost step moves
    # parameters by ~lr = 3e-3 per element, i.e. ~3e-2 relative (measured here: ~5e-8).
    worst = max(((trained[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
    assert worst < 1e-5, worst
    moved = min(((trained[n] - ex_init).norm() / ex_init.norm()).item() for n, ex_init in _initial(ex, args).items())
    assert moved > 1e-3, f"training did not move the parameters ({moved:.2e}): the comparison would be vacuous"


def _initial(ex, args) -> dict[str, torch.Tensor]:
    torch.manual_seed(args.seed)
    return {n: p.detach().clone() for n, p in ex.SmallCNN(args.channels, args.depth).named_parameters()}


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--batch", "15"], "--batch 15 must be a multiple of --world-size 2"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    ],
)
def test_bad_flags_are_named_before_any_rank_starts(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        _example().parse_args(flags)  # main() parses before launch(): no rank has started
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
