"""A stage's backward split into an input half and a weight half ([Note: the weight half without
a second walk] in ``fsdpfn/runtime/_split_backward.py``): the halves give bitwise one backward's
gradients, and together run each backward operator once (FLOPs counted by torch's
``FlopCounterMode``), where the second walk ran the whole backward again."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from fsdpfn.models import GPTConfig
from fsdpfn.models._gpt import Block
from fsdpfn.runtime._split_backward import backward_input

CFG = GPTConfig(vocab_size=32, seq_len=8, width=16, depth=1, heads=4, bias=True)


def _stage():
    """Two GPT blocks (attention, MLP, layer norms, biases) as one stage: its input, output's
    seed, and weights as fresh leaves."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Block(CFG), Block(CFG))
    weights = {n: p.detach().clone().requires_grad_() for n, p in blocks.named_parameters()}
    x = torch.randn(2, CFG.seq_len, CFG.width, requires_grad=True)
    seed = torch.randn(2, CFG.seq_len, CFG.width)

    def run(x):
        return torch.func.functional_call(blocks, weights, (x,))

    return run, x, seed, list(weights.values())


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return counter.get_total_flops(), out


def test_the_halves_give_one_backwards_gradients_running_each_operator_once():
    run, x, seed, weights = _stage()
    out = run(x)  # forwards outside the counter: only backward operators are counted
    full_flops, full = _flops(lambda: torch.autograd.grad(out, [x, *weights], seed))
    out = run(x)
    input_flops, (dx, half) = _flops(lambda: backward_input(out, x, weights, seed))
    weight_flops, dw = _flops(lambda: half.run(weights))
    assert half.split
    assert torch.equal(dx, full[0])
    assert all(torch.equal(a, b) for a, b in zip(dw, full[1:]))
    # Each matmul's backward once: dX in the input half, dW in the weight half.
    assert input_flops + weight_flops == full_flops, (input_flops, weight_flops, full_flops)
    assert 0 < weight_flops < full_flops
    # The second walk from the output ran the whole backward again.
    out = run(x)
    torch.autograd.grad(out, [x], seed, retain_graph=True)
    again, _ = _flops(lambda: torch.autograd.grad(out, weights, seed))
    assert again == full_flops


def test_a_weight_used_twice_falls_back_to_the_second_walk_with_the_same_gradients():
    """A weight below two exits (here one Linear applied twice) would be counted through both:
    the stage walks its graph again instead, and its gradients are one backward's."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)

    def run(x):
        return torch.tanh(torch.tanh(x @ w.t()) @ w.t()).sum()

    full = torch.autograd.grad(run(x), [x, w])
    dx, half = backward_input(run(x), x, [w], None)
    (dw,) = half.run([w])
    assert not half.split
    assert torch.equal(dx, full[0]) and torch.equal(dw, full[1])


def test_an_output_the_input_does_not_reach_leaves_the_whole_backward_to_the_weight_half():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    dx, half = backward_input((w * 2).sum(), x, [w], None)
    assert dx is None and not half.split
    assert torch.equal(half.run([w])[0], torch.full((4,), 2.0))
