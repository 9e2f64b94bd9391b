"""A stage's backward in two halves, the input's gradient first and the weights' later, without
walking the stage's graph twice.

[Note: the weight half without a second walk]
Zero-bubble schedules run a stage's backward as two ops: ``backward_input`` (the gradient the
previous stage waits for) and, later, ``backward_weight`` (its parameters' gradients, filling a
bubble). Asking autograd for the weights' gradients from the stage's output again would run the
whole backward a second time: every node between the output and the input, which the input half
already ran. Instead, the input half notes where the weights' paths leave it:

- a node is *on the input's path* when the input's gradient edge is reachable from it (autograd
  runs exactly these for the input half);
- an *exit* is a node on the input's path with a child that is not, but leads to a weight (a
  matmul's backward, whose one child leads to the activation and the other to its weight). The
  input half runs the exit node for its input branch only; a pre-hook keeps the gradient it
  received.

The weight half then starts at each exit, with the gradient kept there, and asks only for the
weights below it: autograd runs the exit again for its weight branch, and the nodes below it
that lead to those weights, nothing on the input's path. Each weight's every path from the
output leaves the input's path at some exit; when each weight is below exactly one exit, the sum
over exits is its gradient, bitwise what one backward gives (each node's work is the same, in
the same order per weight). A weight below two exits (a weight used in two places of the stage:
shared, tied) would have paths through one exit that pass the other, so the stage falls back to
the second walk from the output; so does a stage whose input does not reach its output.
``torch.distributed.pipelining`` splits its zero-bubble backward the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightHalf", "backward_input"]


@dataclasses.dataclass
class WeightHalf:
    """What the input half leaves for the weight half: per exit node, the gradients it received
    and the weights below it (indices into the weights); or, when the graph does not split, the
    output and its seed, for a second walk."""

    exits: list[tuple[Node, tuple, list[int]]] = dataclasses.field(default_factory=list)
    fallback: tuple | None = None  # (out, seed)
    split: bool = True

    def run(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The weights' gradients (``None`` for a weight the output does not reach)."""
        if self.fallback is not None:
            out, seed = self.fallback
            self.fallback = None
            return list(torch.autograd.grad(out, list(weights), grad_outputs=seed, allow_unused=True))
        grads: list[torch.Tensor | None] = [None] * len(weights)
        for node, received, below in self.exits:
            edges = [GradientEdge(node, i) for i, g in enumerate(received) if g is not None]
            if not edges:
                continue
            got = torch.autograd.grad(
                edges,
                [weights[j] for j in below],
                grad_outputs=[g for g in received if g is not None],
                allow_unused=True,
            )
            for j, g in zip(below, got):
                grads[j] = g
        self.exits = []
        return grads


def _children(node: Node) -> list[Node]:
    return [n for n, _ in node.next_functions if n is not None]


def backward_input(
    out: torch.Tensor, x: torch.Tensor, weights: Sequence[torch.Tensor], seed: torch.Tensor | None
) -> tuple[torch.Tensor | None, WeightHalf]:
    """The gradient of ``x`` (``None`` where ``out`` does not reach it) and the
    :class:`WeightHalf` that gives the weights' gradients later (see [Note: the weight half
    without a second walk]). ``seed``: the gradient of ``out`` (``None`` for a scalar loss).

    Example:
      >>> x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
      >>> out = torch.relu(x @ w.t()).sum()
      >>> dx, half = backward_input(out, x, [w], None)
      >>> (dw,) = half.run([w])
      >>> torch.equal(dw, torch.autograd.grad(torch.relu(x @ w.t()).sum(), w)[0]), half.split
      (True, True)
    """
    root = out.grad_fn
    if root is None or not x.requires_grad:
        return None, WeightHalf(fallback=(out, seed), split=False)
    x_node = get_gradient_edge(x).node
    weight_of = {get_gradient_edge(w).node: j for j, w in enumerate(weights)}
    on_path: dict[Node, bool] = {}
    below: dict[Node, frozenset[int]] = {}  # weights reachable from a node off the input's path
    order, stack, seen = [], [root], {root}
    while stack:  # every node of the graph, children before parents in `order` (reversed DFS)
        node = stack.pop()
        order.append(node)
        for c in _children(node):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    for node in _topological(order):
        kids = _children(node)
        on_path[node] = node is x_node or any(on_path[c] for c in kids)
        below[node] = frozenset({weight_of[node]} if node in weight_of else ()).union(
            *(below[c] for c in kids if not on_path[c])
        )
    if not on_path[root]:
        return None, WeightHalf(fallback=(out, seed), split=False)
    exits = [(n, sorted(below[n])) for n in order if on_path[n] and n is not x_node and below[n]]
    claimed = [j for _, ws in exits for j in ws]
    if len(claimed) != len(set(claimed)):  # a weight below two exits: see the Note
        dx = torch.autograd.grad(out, [x], grad_outputs=seed, retain_graph=True, allow_unused=True)[0]
        return dx, WeightHalf(fallback=(out, seed), split=False)
    received: dict[Node, tuple] = {}
    handles = [n.register_prehook(lambda grads, n=n: received.__setitem__(n, grads)) for n, _ in exits]
    try:
        dx = torch.autograd.grad(out, [x], grad_outputs=seed, retain_graph=True, allow_unused=True)[0]
    finally:
        for h in handles:
            h.remove()
    return dx, WeightHalf([(n, received.get(n, ()), ws) for n, ws in exits])


def _topological(nodes: list[Node]) -> list[Node]:
    """``nodes`` ordered children first (every child of a node before it)."""
    done: set[Node] = set()
    out: list[Node] = []
    for start in nodes:
        if start in done:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in done:
                continue
            if expanded:
                done.add(node)
                out.append(node)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if c not in done)
    return out
