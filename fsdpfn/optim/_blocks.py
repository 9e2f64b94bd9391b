"""Blocks inside a matrix: orthogonalise a weight as independent blocks (per head, per expert).

[Note: blocks]
A fused attention projection is several matrices side by side: ``qkv.weight`` (``3C x C`` in
``nn.Linear``'s ``(out, in)`` layout) stacks one ``C/H x C`` row block per query, key and value
head; an output projection (``C x C``) reads the heads' outputs as ``C/H``-wide column blocks;
a 2-D-packed expert weight (``E m x n``) stacks one ``m x n`` row block per expert. Muon can
orthogonalise each block on its own instead of the whole matrix. A spec ``(m, n)`` cuts a
matrix into ``m`` equal row blocks times ``n`` equal column blocks, numbered row-major
(``block = a * n + b``); an int ``m`` means ``(m, 1)``. Leaves with more than two dimensions are
cut the same way, matrix by matrix.

The blocks of one matrix are independent units of work: the owner layout gives each block an
owner, balancing Newton–Schulz FLOPs block by block, and a block whose rows lie on several ranks
is assembled on its owner from every rank's piece, exactly as a whole matrix is
(``fsdpfn/optim/_owner.py``). Same-shape blocks are stacked into one batched Newton–Schulz call.
The learning-rate rules of :func:`fsdpfn.optim.scale_by_muon_lr` then use the block's shape,
since each block's update is an orthogonal matrix of that shape.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from fsdpfn._patterns import first_match, matches

__all__ = ["BlockSpec", "Blocks", "block_shape", "check_blocks", "head_blocks", "merge_blocks", "split_blocks"]

BlockSpec = tuple[int, int]
"""``(row blocks, column blocks)``."""

WHOLE: BlockSpec = (1, 1)

Blocks = Union[None, Mapping[str, Any], Callable[[str, torch.Tensor], Any]]
"""What ``blocks=`` accepts: ``None`` (whole matrices), a dict ``{name or fnmatch pattern:
spec}`` (the first matching entry wins, a name with no match is whole; a pattern that matches
no Muon leaf, or only leaves an earlier pattern claims, is refused at ``init``: see [Note: pattern
rule] in ``fsdpfn/_patterns.py``), or a function
``(name, param) -> spec`` (``None`` for whole), called with each leaf's dotted name and a
tensor of the parameter's shape."""


def _spec(who: str, where: str, value: Any) -> BlockSpec:
    """``value`` (``None``, an int ``m`` or a pair ``(m, n)`` of ints >= 1) as a pair."""
    if value is None:
        return WHOLE

    def count(v: Any) -> int | None:
        return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 1 else None

    if (m := count(value)) is not None:
        return (m, 1)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and (m := count(value[0])) is not None
        and (n := count(value[1])) is not None
    ):
        return (m, n)
    raise ValueError(
        f"{who}: blocks{where}={value!r} is invalid: a block spec is an int m >= 1 (m row blocks), a pair (m, n) "
        "(m row blocks x n column blocks) or None (the whole matrix), e.g. 3 * heads for a fused qkv weight."
    )


def check_blocks(who: str, blocks: Blocks) -> Callable[[str, torch.Tensor], BlockSpec]:
    """``blocks`` as a function ``(name, param) -> (m, n)``, checked as far as it can be when
    built (a dict's specs now; a function's results when it is called, naming the parameter).
    A dict's function also has ``check_names(names)``, which refuses a pattern that matches
    none of ``names`` or only names an earlier pattern claims (call it with the leaves' names).

    Example:
      >>> spec = check_blocks("muon", {"*.qkv.weight": 12, "*.proj.weight": (1, 4)})
      >>> spec("blocks.0.qkv.weight", None), spec("blocks.0.proj.weight", None), spec("blocks.0.fc.weight", None)
      ((12, 1), (1, 4), (1, 1))
    """
    if blocks is None:
        return lambda name, param: WHOLE
    if isinstance(blocks, Mapping):
        table = [(str(k), _spec(who, f"[{k!r}]", v)) for k, v in blocks.items()]

        def from_table(name: str, param: Any) -> BlockSpec:
            for pattern, spec in table:
                if matches(name, pattern):
                    return spec
            return WHOLE

        def check_names(names: Sequence[str]) -> None:
            first_match([p for p, _ in table], names, f"{who}: blocks", "parameter Muon updates")

        from_table.check_names = check_names  # type: ignore[attr-defined]
        return from_table
    if callable(blocks):
        fn = blocks
        return lambda name, param: _spec(who, f"({name!r})", fn(name, param))
    raise ValueError(
        f"{who}: blocks must be None, a dict {{name or pattern: spec}} or a function (name, param) -> spec, "
        f"got {type(blocks).__name__}: {blocks!r:.80}"
    )


def block_shape(name: str, shape: tuple[int, ...], spec: BlockSpec) -> tuple[int, int]:
    """The shape of one block of ``shape``'s matrices under ``spec``; a ``ValueError`` naming
    the parameter when the blocks do not divide the matrix evenly.

    Example:
      >>> block_shape("blocks.0.qkv.weight", (96, 32), (12, 1))
      (8, 32)
    """
    rows, cols = shape[-2], shape[-1]
    m, n = spec
    if rows % m or cols % n:
        raise ValueError(
            f"Muon leaf {name!r} of shape {tuple(shape)} cannot be cut into {m} x {n} blocks: {rows} rows / {m} and "
            f"{cols} columns / {n} must be whole numbers. Fix its block spec (e.g. the number of heads)."
        )
    return rows // m, cols // n


def split_blocks(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """``[..., R, C]`` -> ``[B, R/m, C/n]``: every matrix's blocks, row-major, stacked (a copy).

    Example:
      >>> split_blocks(torch.arange(8.0).view(2, 4), (1, 2))
      tensor([[[0., 1.],
               [4., 5.]],
      <BLANKLINE>
              [[2., 3.],
               [6., 7.]]])
    """
    m, n = spec
    *batch, rows, cols = x.shape
    blocks = x.reshape(-1, m, rows // m, n, cols // n).transpose(2, 3)
    return blocks.reshape(-1, rows // m, cols // n)


def merge_blocks(blocks: torch.Tensor, spec: BlockSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`split_blocks`: ``[B, R/m, C/n]`` -> ``shape``.

    Example:
      >>> x = torch.randn(2, 6, 4)
      >>> torch.equal(merge_blocks(split_blocks(x, (3, 2)), (3, 2), x.shape), x)
      True
    """
    m, n = spec
    *batch, rows, cols = shape
    grid = blocks.reshape(-1, m, n, rows // m, cols // n).transpose(2, 3)
    return grid.reshape(shape)


def head_blocks(
    heads: int, qkv: tuple[str, ...] = ("*qkv.weight",), out: tuple[str, ...] = ("*proj.weight",)
) -> dict[str, BlockSpec]:
    """Per-head Muon for attention in ``nn.Linear`` layout: a ``blocks=`` table giving fused
    ``qkv`` weights ``3 * heads`` row blocks (one per query, key and value head) and output
    projections ``heads`` column blocks (their inputs are the heads' outputs).

    Args:
      heads: attention heads.
      qkv: fnmatch patterns of the fused query/key/value weights (``3C x C``).
      out: patterns of the output projections (``C x C``).

    Example:
      >>> fsdpfn.optim.head_blocks(4)
      {'*qkv.weight': (12, 1), '*proj.weight': (1, 4)}
      >>> opt = fsdpfn.optim.muon(lr=0.02, blocks=fsdpfn.optim.head_blocks(4))
    """
    if not (isinstance(heads, numbers.Integral) and not isinstance(heads, bool) and heads >= 1):
        raise ValueError(f"head_blocks: heads={heads!r} is invalid: heads must be an int >= 1.")
    return {**{p: (3 * int(heads), 1) for p in qkv}, **{p: (1, int(heads)) for p in out}}
