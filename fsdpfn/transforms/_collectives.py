"""The collectives fsdpfn uses, each beside its transpose, with a counter.

Every function here works on flat, contiguous local tensors of one process group and is the only
place the library talks to ``torch.distributed``. Each call is recorded by any active
:func:`count_collectives` context, so tests and benchmarks can compare what ran against
:meth:`fsdpfn.Plan.cost`.

The algebra (``W`` = group size, ``x`` a rank's shard, ``y`` a full-length buffer)::

    all_gather     : R^n  -> R^(W n)     transpose: reduce_scatter
    reduce_scatter : R^(W n) -> R^n      transpose: all_gather
    all_reduce     = all_gather . reduce_scatter        (self-transpose)
    all_to_all(in_splits, out_splits)    transpose: all_to_all(out_splits, in_splits)

so that ``<all_gather(x), y> == <x, reduce_scatter(y)>`` summed over ranks.

[Note: reduce-scatter on gloo]
gloo implements ``reduce_scatter`` as a full all-reduce followed by a local slice: it moves twice
the bytes a reduce-scatter needs. An all-to-all followed by a local sum moves exactly the
reduce-scatter's bytes and measured faster on 4-16 MiB buffers (BENCHMARKS.md), so on gloo
groups :func:`reduce_scatter` uses it unless :func:`set_reduce_scatter_impl` says otherwise. The
local sum adds the ranks' contributions in rank order, so every rank's result is deterministic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "Pending",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "count_collectives",
    "reduce_scatter",
    "set_reduce_scatter_impl",
]

# torch 2.13 renamed the flat collectives and deprecated the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FLOAT8 = {d for n in dir(torch) if n.startswith("float8") for d in [getattr(torch, n)]}


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


class CollectiveCall(NamedTuple):
    """One recorded collective.

    Attributes:
      kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``.
      group_size: ranks taking part.
      nbytes: size of the larger of input and output buffer (the full-length buffer).
      wire_bytes: bytes each rank sends under a bandwidth-optimal algorithm:
        ``(W-1)/W * nbytes`` for all-gather, reduce-scatter and all-to-all,
        ``2 (W-1)/W * nbytes`` for all-reduce.
      dtype: the element type sent.
      tag: free-form label given by the caller (a unit name), or ``""``.
    """

    kind: str
    group_size: int
    nbytes: int
    wire_bytes: float
    dtype: torch.dtype
    tag: str


@dataclasses.dataclass
class CollectiveCounter:
    """What ran inside a :func:`count_collectives` block."""

    calls: list[CollectiveCall] = dataclasses.field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Number of calls per kind."""
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def wire_bytes(self) -> dict[str, float]:
        """Bytes sent per rank, per kind (see :class:`CollectiveCall`)."""
        out: dict[str, float] = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0.0) + c.wire_bytes
        return out

    def nbytes(self) -> dict[str, int]:
        """Full-buffer bytes per kind."""
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0) + c.nbytes
        return out


_counters = threading.local()


def _active() -> list[CollectiveCounter]:
    if not hasattr(_counters, "stack"):
        _counters.stack = []
    return _counters.stack


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Records every fsdpfn collective run in this thread inside the block.

    Example:
      >>> with count_collectives() as counter:  # doctest: +SKIP
      ...     full = fsdpfn.unshard(params, plan)
      >>> counter.counts()  # doctest: +SKIP
      {'all_gather': 5}
    """
    counter = CollectiveCounter()
    _active().append(counter)
    try:
        yield counter
    finally:
        _active().remove(counter)


def _record(kind: str, group_size: int, nbytes: int, dtype: torch.dtype, tag: str) -> None:
    factor = 2.0 if kind == "all_reduce" else 1.0
    wire = factor * (group_size - 1) / group_size * nbytes
    call = CollectiveCall(kind, group_size, nbytes, wire, dtype, tag)
    for counter in _active():
        counter.calls.append(call)


# ---------------------------------------------------------------------------------------------
# Work handles
# ---------------------------------------------------------------------------------------------


class Pending:
    """A collective in flight. ``wait()`` blocks until it finished and returns its output.

    On CPU this wraps gloo's async work; a ``finish`` callback runs after the wait (the local sum
    of the all-to-all reduce-scatter, a cast), so callers never see a half-done result.
    """

    def __init__(self, output: torch.Tensor, work=None, finish: Callable[[], torch.Tensor] | None = None):
        self._output = output
        self._work = work
        self._finish = finish
        self._done = work is None and finish is None

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._finish is not None:
                self._output = self._finish()
            self._done = True
            self._work = self._finish = None
        return self._output

    @property
    def done(self) -> bool:
        return self._done


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    # gloo rejects float8 dtypes; bytes are bytes for gathers and all-to-all.
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous tensor, got shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# all_gather <-> reduce_scatter
# ---------------------------------------------------------------------------------------------


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False, tag: str = "") -> Pending:
    """Concatenates every rank's ``input`` (n elements) into ``output`` (W n), in rank order.

    Transpose: :func:`reduce_scatter`. ``all_gather(x)[r n:(r+1) n] == x_r``.
    """
    _check_flat("all_gather input", input)
    _check_flat("all_gather output", output)
    w = _group_size(group)
    if output.numel() != w * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {w} x {input.numel()}")
    _record("all_gather", w, output.numel() * output.element_size(), output.dtype, tag)
    if w == 1:
        output.copy_(input)
        return Pending(output)
    work = _all_gather_flat(_wire_view(output), _wire_view(input), group=group, async_op=async_op)
    return Pending(output, work if async_op else None)


_RS_IMPL = {"impl": "auto"}


def set_reduce_scatter_impl(impl: str) -> None:
    """Chooses how :func:`reduce_scatter` runs: ``"auto"`` (all-to-all + local sum on gloo,
    native elsewhere), ``"native"`` (``reduce_scatter_single``) or ``"all_to_all"``."""
    if impl not in ("auto", "native", "all_to_all"):
        raise ValueError(f"reduce-scatter impl must be 'auto', 'native' or 'all_to_all', got {impl!r}")
    _RS_IMPL["impl"] = impl


def _use_all_to_all(group) -> bool:
    impl = _RS_IMPL["impl"]
    if impl == "auto":
        return dist.get_backend(group) == "gloo"
    return impl == "all_to_all"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False, tag: str = "") -> Pending:
    """Sums ``input`` (W n elements) over ranks; rank r keeps elements ``[r n, (r+1) n)``.

    Transpose: :func:`all_gather`. Sums in rank order on every path we control (see
    [Note: reduce-scatter on gloo]).
    """
    _check_flat("reduce_scatter input", input)
    _check_flat("reduce_scatter output", output)
    w = _group_size(group)
    if input.numel() != w * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {w} x {output.numel()}")
    _record("reduce_scatter", w, input.numel() * input.element_size(), input.dtype, tag)
    if w == 1:
        output.copy_(input)
        return Pending(output)
    if _use_all_to_all(group):
        staged = torch.empty_like(input)
        work = dist.all_to_all_single(staged, input, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            torch.sum(staged.view(w, -1), dim=0, out=output)
            return output

        if not async_op:
            return Pending(finish())
        return Pending(output, work, finish)
    work = _reduce_scatter_flat(output, input, group=group, async_op=async_op)
    return Pending(output, work if async_op else None)


# ---------------------------------------------------------------------------------------------
# all_reduce (self-transpose), all_to_all (transpose: swapped splits)
# ---------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group=None, *, async_op: bool = False, tag: str = "") -> Pending:
    """Sums ``tensor`` over ranks in place. Self-transpose; ``== all_gather . reduce_scatter``."""
    w = _group_size(group)
    _record("all_reduce", w, tensor.numel() * tensor.element_size(), tensor.dtype, tag)
    if w == 1:
        return Pending(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=async_op)
    return Pending(tensor, work if async_op else None)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    *,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Pending:
    """Rank r sends ``input``'s s-th split to rank s and receives rank s's r-th split.

    Transpose: ``all_to_all`` with ``input_splits`` and ``output_splits`` swapped. Splits count
    elements along dim 0; ``None`` means equal splits.
    """
    w = _group_size(group)
    nbytes = max(input.numel() * input.element_size(), output.numel() * output.element_size())
    _record("all_to_all", w, nbytes, input.dtype, tag)
    if w == 1:
        output.copy_(input)
        return Pending(output)
    work = dist.all_to_all_single(
        _wire_view(output),
        _wire_view(input),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=async_op,
    )
    return Pending(output, work if async_op else None)
