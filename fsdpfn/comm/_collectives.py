"""The collectives fsdpfn uses, each beside its transpose.

Every function here works on flat, contiguous local tensors of one process group; with
:mod:`fsdpfn.comm._objects` this is the only place the library talks to ``torch.distributed``.
Each call is counted by any active :func:`~fsdpfn.comm.count_collectives` block, gets a flight
record, and waits at most :func:`~fsdpfn.comm.timeout` seconds (see [Note: the flight recorder]
and [Note: one timeout]); a failure raises :class:`CollectiveError` naming the ranks that are
behind.

The algebra (``W`` = group size, ``x`` a rank's shard, ``y`` a full-length buffer)::

    all_gather     : R^n  -> R^(W n)     transpose: reduce_scatter
    reduce_scatter : R^(W n) -> R^n      transpose: all_gather
    all_reduce     = all_gather . reduce_scatter        (self-transpose)
    all_to_all(in_splits, out_splits)    transpose: all_to_all(out_splits, in_splits)
    send_recv(shift)                     transpose: send_recv(-shift)

so that ``<all_gather(x), y> == <x, reduce_scatter(y)>`` summed over ranks.

[Note: reduce-scatter on gloo]
gloo implements ``reduce_scatter`` as a full all-reduce followed by a local slice: it moves twice
the bytes a reduce-scatter needs. An all-to-all followed by a local sum moves exactly the
reduce-scatter's bytes and measured faster on 4-16 MiB buffers (docs/benchmarks.md), so on gloo
groups :func:`reduce_scatter` uses it unless its ``impl`` argument or a
:func:`reduce_scatter_impl` block says otherwise. The local sum adds the ranks' contributions in
rank order, so every rank's result is deterministic.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from fsdpfn.comm import _groups
from fsdpfn.comm import _record
from fsdpfn.comm._record import FlightRecord, group_info, peer_failures, peer_report, record

__all__ = [
    "CollectiveError",
    "Pending",
    "announce_failure",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "healthy",
    "reduce_scatter",
    "reduce_scatter_impl",
    "send_recv",
    "set_reduce_scatter_impl",
]


# torch 2.13 renamed the flat collectives and deprecated the old names. Looked up per call, so
# that a wrapper installed around torch.distributed (tests, profilers) sees our calls too.
def _all_gather_flat(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


_FLOAT8 = {d for n in dir(torch) if n.startswith("float8") for d in [getattr(torch, n)]}


class CollectiveError(RuntimeError):
    """A collective failed or timed out. The message names the collective (kind, tag, bytes),
    where every rank of its group last was, and which ranks are behind (``behind``).

    After one, this process's groups are out of step with their peers (gloo may still hold the
    failed operation), so :func:`healthy` turns ``False`` and nothing should run on them again.
    """

    def __init__(self, message: str, behind: list[int]):
        super().__init__(message)
        self.behind = behind
        _health["ok"] = False


CollectiveError.__module__ = "fsdpfn.comm"  # where users import it from


_health = {"ok": True}


def healthy() -> bool:
    """``False`` once a collective of this process has failed (see :class:`CollectiveError`):
    the process groups can no longer be trusted and the process should exit.

    Example:
      >>> fsdpfn.comm.healthy()
      True
    """
    return _health["ok"]


def announce_failure(error: BaseException | str) -> None:
    """Tells this rank's peers that it failed outside a collective: a peer waiting in a collective
    then fails within a second with this error, instead of waiting out the timeout. The launchers
    call it for every exception that escapes a rank's function.

    Example:
      >>> fsdpfn.comm.announce_failure(ValueError("bad batch"))   # no process group: nothing to tell
    """
    store = _groups.store()
    if store is not None:
        _record.announce_failure(store, _groups.rank(), error)


def _failure(
    rec: FlightRecord | None, kind: str, tag: str, cause: BaseException | str, failed: dict[int, str] | None = None
) -> CollectiveError:
    me = _groups.rank()
    if failed is None:  # a peer that raised, announced it and exited closes its connections: say what it raised
        failed = peer_failures(_groups.store(), rec.ranks if rec else (), me) or None
    lines, behind, stuck = peer_report(_groups.store(), rec, me)
    what = rec.describe() if rec else f"{kind}" + (f" of {tag!r}" if tag else "")
    size = f", {rec.nbytes / 2**20:.2f} MiB over ranks {list(rec.ranks)}" if rec else ""
    head = f"collective {what}{size} failed on rank {me} (timeout {_groups.timeout():g} s): {str(cause).strip().splitlines()[0][:300]}"
    verdict = (
        (
            f"\nRank(s) {behind} are behind: they never reached this collective (stopped, dead, or "
            "taking another code path)."
        )
        if behind
        else ""
    )
    if stuck:
        verdict += (
            f"\nRank(s) {stuck} are stopped or dead: they started this collective, or a later one, but "
            "will not finish it."
        )
        behind = sorted(behind + stuck)
    if failed:
        behind = sorted(set(behind) | set(failed))
        verdict += "".join(f"\nRank {r} raised: {err}" for r, err in sorted(failed.items()))
    hint = (
        "\nThe timeout is fsdpfn.comm.set_timeout(seconds), the FSDPFN_TIMEOUT environment variable "
        "or the demo's --timeout."
    )
    return CollectiveError(f"{head}\n{lines}{verdict}{hint}" if lines else f"{head}{hint}", behind)


class Pending:
    """A collective in flight. ``wait()`` blocks until it finished and returns its output.

    On CPU this wraps gloo's async work, waited for with the collective timeout; a ``finish``
    callback runs after the wait (the local sum of the all-to-all reduce-scatter, a cast), so
    callers never see a half-done result.
    """

    def __init__(
        self,
        output: torch.Tensor,
        work=None,
        finish: Callable[[], torch.Tensor] | None = None,
        rec: FlightRecord | None = None,
        kind: str = "",
        tag: str = "",
    ):
        self._output = output
        self._work = work
        self._finish = finish
        self._rec, self._kind, self._tag = rec, kind, tag
        self._done = work is None and finish is None

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                _wait(self._work, self._rec, self._kind, self._tag)
            if self._finish is not None:
                self._output = self._finish()
            self._done = True
            self._work = self._finish = None
        return self._output

    @property
    def done(self) -> bool:
        return self._done


_SLICE = 1.0  # seconds between looks for a peer's announced failure

# [Note: the last gloo work]
# gloo's worker thread drops its reference to a collective right after marking it finished. When
# that reference is the last one, the work's tensors are freed on the worker thread, which takes
# the GIL to release their Python objects; if the interpreter is exiting by then, CPython ends
# the thread inside a C++ destructor and the process aborts ("terminate called without an active
# exception", exit code -6) after its job is done: 1 run in about 10 of a 4-rank torchrun job
# whose last call is a barrier. So the most recent finished gloo work stays referenced here: the
# worker thread's reference is never the last, and the work is freed on this thread, when the
# next collective finishes or at exit. Process state: the gloo work is the process's.
_last_gloo_work: list = []


def _wait(work, rec, kind: str, tag: str) -> None:
    """Waits at most the collective timeout, in slices, so that a peer's announced failure ends
    the wait early (see [Note: failures reach the waiting ranks])."""
    if _groups.backend() != "gloo":  # NCCL: the process group's own timeout (set from the same value)
        try:
            work.wait()
        except RuntimeError as e:
            raise _failure(rec, kind, tag, e) from e
        return
    deadline = time.monotonic() + _groups.timeout()
    while True:
        left = deadline - time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(min(left, _SLICE), 0.001)))
            _last_gloo_work[:] = [work]  # see [Note: the last gloo work]
            return
        except RuntimeError as e:
            if left <= _SLICE or "timed out" not in str(e).lower():
                raise _failure(rec, kind, tag, e) from e
            failed = peer_failures(_groups.store(), rec.ranks if rec else (), _groups.rank())
            if failed:
                raise _failure(rec, kind, tag, "a peer failed while this rank waited", failed) from e


def _start(
    kind: str,
    group,
    nbytes: int,
    dtype: torch.dtype,
    tag: str,
    launch: Callable,
    output: torch.Tensor,
    async_op: bool,
    finish: Callable | None = None,
) -> Pending:
    """Records, launches asynchronously (so every wait is bounded) and, unless ``async_op``,
    waits."""
    ranks, gid = group_info(group)
    rec = record(kind, len(ranks), nbytes, dtype, tag, ranks, gid)
    try:
        work = launch()
    except RuntimeError as e:  # a peer already gone fails the launch itself
        raise _failure(rec, kind, tag, e) from e
    pending = Pending(output, work, finish, rec, kind, tag)
    if not async_op:
        pending.wait()
    return pending


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    # gloo rejects float8 dtypes; bytes are bytes for gathers and all-to-all.
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous tensor, got shape {tuple(t.shape)}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# all_gather <-> reduce_scatter
# ---------------------------------------------------------------------------------------------


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False, tag: str = ""
) -> Pending:
    """Concatenates every rank's ``input`` (n elements) into ``output`` (W n), in rank order.

    Transpose: :func:`reduce_scatter`. ``all_gather(x)[r n:(r+1) n] == x_r``.

    Example:
      >>> out = torch.empty(3)
      >>> fsdpfn.comm.all_gather(out, torch.arange(3.0)).wait()   # one process: W = 1
      tensor([0., 1., 2.])
    """
    _check_flat("all_gather input", input)
    _check_flat("all_gather output", output)
    w = _groups.group_size(group)
    if output.numel() != w * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {w} x {input.numel()}")
    if w == 1:
        record("all_gather", 1, _nbytes(output), output.dtype, tag)
        output.copy_(input)
        return Pending(output)
    launch = lambda: _all_gather_flat(_wire_view(output), _wire_view(input), group=group, async_op=True)  # noqa: E731
    return _start("all_gather", group, _nbytes(output), output.dtype, tag, launch, output, async_op)


_IMPLS = ("auto", "native", "all_to_all")
_rs_impl: list[str] = ["auto"]  # Process state: set_reduce_scatter_impl's choice, for every collective


def _check_impl(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"reduce-scatter impl must be 'auto', 'native' or 'all_to_all', got {impl!r}")
    return impl


@contextlib.contextmanager
def reduce_scatter_impl(impl: str) -> Iterator[None]:
    """How :func:`reduce_scatter` runs inside the block: ``"auto"`` (all-to-all + local sum on
    gloo, native elsewhere), ``"native"`` (``reduce_scatter_single``) or ``"all_to_all"``.

    Example:
      >>> with fsdpfn.comm.reduce_scatter_impl("native"):
      ...     pass   # every reduce-scatter in here uses torch's own
    """
    _rs_impl.append(_check_impl(impl))
    try:
        yield
    finally:
        _rs_impl.pop()


def set_reduce_scatter_impl(impl: str) -> None:
    """Deprecated: use ``with fsdpfn.comm.reduce_scatter_impl(impl):`` or the ``impl`` argument of
    :func:`reduce_scatter`. Sets the process-wide default."""
    warnings.warn(
        "set_reduce_scatter_impl is deprecated; use `with fsdpfn.comm.reduce_scatter_impl(impl):`",
        DeprecationWarning,
        stacklevel=2,
    )
    _rs_impl[0] = _check_impl(impl)


def _use_all_to_all(group, impl: str | None) -> bool:
    impl = _check_impl(impl) if impl is not None else _rs_impl[-1]
    if impl == "auto":
        return _groups.backend(group) == "gloo"
    return impl == "all_to_all"


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    *,
    async_op: bool = False,
    tag: str = "",
    impl: str | None = None,
) -> Pending:
    """Sums ``input`` (W n elements) over ranks; rank r keeps elements ``[r n, (r+1) n)``.

    Transpose: :func:`all_gather`. Sums in rank order on every path we control (see
    [Note: reduce-scatter on gloo]); ``impl`` overrides :func:`reduce_scatter_impl`. An
    ``output`` of a wider dtype than ``input`` sums in the output's dtype: the ranks' parts cross
    the wire in the input's dtype (an all-to-all, whatever ``impl`` says) and are added here.

    Example:
      >>> out = torch.empty(2)
      >>> fsdpfn.comm.reduce_scatter(out, torch.tensor([1.0, 2.0])).wait()
      tensor([1., 2.])
    """
    _check_flat("reduce_scatter input", input)
    _check_flat("reduce_scatter output", output)
    w = _groups.group_size(group)
    if input.numel() != w * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {w} x {output.numel()}")
    if w == 1:
        record("reduce_scatter", 1, _nbytes(input), input.dtype, tag)
        output.copy_(input)
        return Pending(output)
    widen = output.dtype != input.dtype
    if widen or _use_all_to_all(group, impl):
        staged = torch.empty_like(input)

        def finish() -> torch.Tensor:
            torch.sum(staged.view(w, -1), dim=0, dtype=output.dtype if widen else None, out=output)
            return output

        launch = lambda: dist.all_to_all_single(staged, input, group=group, async_op=True)  # noqa: E731
        return _start("reduce_scatter", group, _nbytes(input), input.dtype, tag, launch, output, async_op, finish)
    launch = lambda: _reduce_scatter_flat(output, input, group=group, async_op=True)  # noqa: E731
    return _start("reduce_scatter", group, _nbytes(input), input.dtype, tag, launch, output, async_op)


# ---------------------------------------------------------------------------------------------
# all_reduce (self-transpose), all_to_all (transpose: swapped splits), broadcast, barrier
# ---------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group=None, *, async_op: bool = False, tag: str = "", op: str = "sum") -> Pending:
    """Reduces ``tensor`` over ranks in place (``op``: ``"sum"``, ``"max"`` or ``"min"``).
    Self-transpose (sum); ``== all_gather . reduce_scatter``.

    Example:
      >>> fsdpfn.comm.all_reduce(torch.tensor([1.0, 2.0])).wait()
      tensor([1., 2.])
    """
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    w = _groups.group_size(group)
    if w == 1:
        record("all_reduce", 1, _nbytes(tensor), tensor.dtype, tag)
        return Pending(tensor)
    launch = lambda: dist.all_reduce(tensor, op=ops[op], group=group, async_op=True)  # noqa: E731
    return _start("all_reduce", group, _nbytes(tensor), tensor.dtype, tag, launch, tensor, async_op)


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

    Example:
      >>> out = torch.empty(2)
      >>> fsdpfn.comm.all_to_all(out, torch.tensor([5.0, 6.0])).wait()
      tensor([5., 6.])
    """
    w = _groups.group_size(group)
    nbytes = max(_nbytes(input), _nbytes(output))
    if w == 1:
        record("all_to_all", 1, nbytes, input.dtype, tag)
        output.copy_(input)
        return Pending(output)
    launch = lambda: dist.all_to_all_single(  # noqa: E731
        _wire_view(output),
        _wire_view(input),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=True,
    )
    return _start("all_to_all", group, nbytes, input.dtype, tag, launch, output, async_op)


def send_recv(
    output: torch.Tensor, input: torch.Tensor, group=None, *, shift: int = 1, async_op: bool = False, tag: str = ""
) -> Pending:
    """One hop of a ring: rank ``r`` of the group sends ``input`` to rank ``(r + shift) % W``
    and receives rank ``(r - shift) % W``'s into ``output``. ``output`` has as many elements as
    that rank's ``input`` (every rank's, on a ring of equal buffers); a rank whose ``input`` or
    ``output`` is empty sends or receives nothing, so the same call is a point-to-point hop in
    which one stage of a pipeline passes its activation to the next while the others idle.

    Transpose: ``send_recv`` with ``-shift`` (what went forward comes back). It is one
    all-to-all with one non-empty split each way, so it is counted, flight-recorded and bounded
    by the timeout like every collective, on gloo and NCCL alike; its wire bytes are the
    buffer's (:func:`fsdpfn._wire.wire_bytes`, ``"send_recv"``).

    Example:
      >>> out = torch.empty(2)
      >>> fsdpfn.comm.send_recv(out, torch.tensor([5.0, 6.0])).wait()   # one process: to itself
      tensor([5., 6.])
    """
    w = _groups.group_size(group)
    if w == 1 and output.numel() != input.numel():
        raise ValueError(
            f"send_recv: output has {output.numel()} elements, input {input.numel()}; on one rank the hop sends "
            "the buffer to itself, so they must be equal"
        )
    if w == 1:
        record("send_recv", 1, _nbytes(input), input.dtype, tag)
        output.copy_(input)
        return Pending(output)
    r, n = _groups.group_rank(group), input.numel()
    dst, src = (r + shift) % w, (r - shift) % w
    send = [n if q == dst else 0 for q in range(w)]
    # What src sends: the output's size (a mismatch with src's input fails in the all-to-all,
    # which names the collective and the ranks through the flight recorder).
    recv = [output.numel() if q == src else 0 for q in range(w)]
    launch = lambda: dist.all_to_all_single(  # noqa: E731
        _wire_view(output),
        _wire_view(input),
        output_split_sizes=recv,
        input_split_sizes=send,
        group=group,
        async_op=True,
    )
    return _start("send_recv", group, _nbytes(input), input.dtype, tag, launch, output, async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, *, tag: str = "") -> torch.Tensor:
    """Copies global rank ``src``'s ``tensor`` into ``tensor`` on every rank of ``group``.

    Transpose: a reduce to ``src`` (sum of every rank's cotangent).

    Example:
      >>> fsdpfn.comm.broadcast(torch.tensor([3.0]))
      tensor([3.])
    """
    w = _groups.group_size(group)
    if w == 1:
        record("broadcast", 1, _nbytes(tensor), tensor.dtype, tag)
        return tensor
    launch = lambda: dist.broadcast(_wire_view(tensor), src=src, group=group, async_op=True)  # noqa: E731
    return _start("broadcast", group, _nbytes(tensor), tensor.dtype, tag, launch, tensor, False).wait()


def barrier(group=None, *, tag: str = "") -> None:
    """Returns once every rank of ``group`` has called it (bounded by the collective timeout).

    Built on a one-element all-reduce so that it is recorded, bounded and named like every other
    collective.

    Example:
      >>> fsdpfn.comm.barrier()
    """
    w = _groups.group_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if _groups.backend(group) == "nccl" else None
    token = torch.zeros(1, dtype=torch.int32, device=device)
    if w == 1:
        record("barrier", 1, _nbytes(token), token.dtype, tag)
        return
    launch = lambda: dist.all_reduce(token, group=group, async_op=True)  # noqa: E731
    _start("barrier", group, _nbytes(token), token.dtype, tag, launch, token, False)
