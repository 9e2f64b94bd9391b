"""Pipeline-parallel activation transfer: a differentiable point-to-point hop.

``pp_send_recv(x, shape)`` is :func:`fsdpfn.comm.send_recv` over the pipeline group, as an
autograd Function that works under ``loss.backward()`` and ``torch.func.grad`` alike (the recipe
of [Note: TP collectives under torch.func] in ``fsdpfn/comm/_tp.py``)::

    forward : rank r sends x to rank r + shift, receives rank r - shift's into a new ``shape``
    backward: the same hop with -shift (its transpose): the gradient of what a rank received
              goes back to the rank that sent it, and arrives as the gradient of its x

A rank that sends nothing passes a zero-element ``x`` that is in its autograd graph (a view
of one of its parameters: ``p.reshape(-1)[:0]``; a plain ``torch.empty(0)`` is refused while
gradients are computed, since that rank would never run the backward hop its peer waits in),
one that receives nothing ``shape=(0,)``:
a stage passing its activation to the next is then one hop in which only two ranks move data,
and its backward carries the activation's gradient the other way. Every rank of the group calls
it, in the same order, as with every collective.

[Note: pipeline transfers are point-to-point]
The pipeline runtime (:class:`fsdpfn.runtime.PipelineRuntime`) moves activations and gradients
with :func:`pp_send` / :func:`pp_recv`, gloo's (or NCCL's) ``isend`` / ``irecv`` between two
ranks of the pp group, not with ``send_recv``. ``send_recv`` is an all-to-all that every rank of
the group must enter in the same order; in a 1F1B or interleaved schedule on more than two pp
ranks, neighbouring pairs exchange at different moments, so no common order exists, and a
2-rank group per pair would make every send wait for its recv (a send that blocks until the
peer reaches its recv can deadlock a schedule that is correct with buffered sends, e.g. two
ranks that both send before they receive). ``isend`` returns at once and its work completes in
gloo's threads whenever the peer posts the matching ``irecv``; a recv waits. That is exactly the
model :func:`fsdpfn.validate_pipeline` checks (sends do not wait, recvs do, messages between two
ranks arrive in the order they are sent: one tag, one TCP pair, FIFO), so a schedule it accepts
cannot deadlock here. Each transfer is counted and flight-recorded under the pair's ranks, and
its wait is bounded by the process group's timeout (see ``_p2p``).
"""

from __future__ import annotations

import threading

import torch

import torch.distributed as dist

from fsdpfn.comm import _groups
from fsdpfn.comm._agree import exchange_problems
from fsdpfn.comm._collectives import _SLICE, Pending, _failure, _wire_view, send_recv
from fsdpfn.comm._record import peer_failures, record

__all__ = ["pp_recv", "pp_send", "pp_send_recv"]


def _hop(x: torch.Tensor, shape: tuple[int, ...], shift: int, group, tag: str) -> torch.Tensor:
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    send_recv(out.view(-1), x.contiguous().view(-1), group, shift=shift, tag=tag).wait()
    return out


class _Hop(torch.autograd.Function):
    @staticmethod
    def forward(x, shape, shift, group, tag):
        with torch._C._DisableFuncTorch():
            return _hop(x, shape, shift, group, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, ctx.shift, ctx.group, ctx.tag = inputs
        ctx.in_shape = tuple(x.shape)  # a plain tuple: a saved torch.Size comes back as one under torch.func

    @staticmethod
    def backward(ctx, g):
        with torch._C._DisableFuncTorch():
            return _hop(g, ctx.in_shape, -ctx.shift, ctx.group, ctx.tag + "_grad"), None, None, None, None


def pp_send_recv(x: torch.Tensor, shape, group=None, *, shift: int = 1, tag: str = "pp_act") -> torch.Tensor:
    """Sends ``x`` to rank ``r + shift`` of ``group`` and returns what rank ``r - shift`` sent,
    as a tensor of ``shape`` (``(0,)``: nothing); backward sends the gradient back (``-shift``).

    Args:
      x: what this rank sends (a zero-element view of a parameter: nothing), with the dtype of
        what it receives; while gradients are computed it must be in the autograd graph.
      shape: the shape of what this rank receives.
      group: the pipeline group (``None``: the default group).
      shift: ranks ahead the data goes (``-1``: to the previous stage).
      tag: the flight recorder's name for the hop.

    Example:
      >>> x = torch.arange(3.0, requires_grad=True)
      >>> y = fsdpfn.comm.pp_send_recv(x, (3,))   # one process: to itself
      >>> (2 * y).sum().backward(); x.grad.tolist()
      [2.0, 2.0, 2.0]
    """
    shape = tuple(int(d) for d in shape)
    problem = None
    if torch.is_grad_enabled() and not x.requires_grad:
        # Its backward is a hop every rank of the group enters: a rank whose x is outside the
        # graph would never run it, and the rank that sent to it would wait there until the
        # timeout (a plain torch.empty(0) from a receiving rank is the usual way in).
        problem = (
            f"pp_send_recv(x) on rank {_groups.rank()}: x ({'empty' if x.numel() == 0 else tuple(x.shape)}) is not "
            "in the autograd graph while gradients are computed, so that rank would never run the backward hop "
            "its peer waits in. A rank that sends nothing passes a zero-element view of one of its parameters, "
            "e.g. next(iter(full.values())).reshape(-1)[:0], not torch.empty(0); for a forward without "
            "gradients, run it under torch.no_grad()"
        )
    # Every rank learns of it, through the store (see [Note: agreeing through the store]), before
    # the hop: the others would otherwise wait in it for the rank that raised.
    found = exchange_problems(f"pp_send_recv {tag}", problem, group)
    if found:
        raise ValueError(found[min(found)])
    return _Hop.apply(x, shape, shift, group, tag)


def _pair(group, peer: int) -> tuple[tuple[int, ...], int]:
    me = _groups.group_rank(group)
    ranks = _groups.group_ranks(group)
    return tuple(sorted((ranks[me], ranks[peer]))), me


def _p2p(ranks: tuple[int, ...], tensor: torch.Tensor, launch, tag: str) -> Pending:
    # Recorded under the pair's ranks: the pair's sequence numbers, not the pp group's (whose
    # ranks each make different transfers).
    rec = record("send_recv", 2, tensor.numel() * tensor.element_size(), tensor.dtype, tag, ranks)
    try:
        work = launch()
    except RuntimeError as e:  # a peer already gone fails the launch itself
        raise _failure(rec, "send_recv", tag, e) from e

    def finish() -> torch.Tensor:
        _wait_point_to_point(work, rec, tag)
        return tensor

    return Pending(tensor, None, finish, rec, "send_recv", tag)


def _wait_point_to_point(work, rec, tag: str) -> None:
    """Waits for one transfer, bounded by the process group's timeout, and fails within about a
    second once the peer announced a failure (see [Note: a point-to-point wait])."""
    if _groups.backend() != "gloo":  # NCCL: the process group's own timeout, as for collectives
        try:
            work.wait()
        except RuntimeError as e:
            raise _failure(rec, "send_recv", tag, e) from e
        return
    # [Note: a point-to-point wait]
    # A collective waits in one-second slices and looks for a peer's announced failure between
    # them. A gloo point-to-point wait cannot be sliced: one that times out closes the connection
    # to the peer ("Application timeout caused pair closure"), so a slice expiring while the
    # peer still computes would break the pair. So the one wait, bounded by the group's timeout,
    # runs on a thread of its own while this one looks for announcements once a second. A peer
    # whose process dies closes the pair and ends the wait at once; one that raised and lives on
    # (a persistent test worker, a loop that catches and logs) is seen through its announcement.
    # On a failure the waiting thread is left blocked: the pair is abandoned with the groups,
    # which a failed collective marks unhealthy (see fsdpfn.comm.healthy), as the caller must.
    done, errors = threading.Event(), []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)
        done.set()

    threading.Thread(target=wait, daemon=True, name="fsdpfn-p2p-wait").start()
    while not done.wait(_SLICE):
        failed = peer_failures(_groups.store(), rec.ranks, _groups.rank())
        if failed:
            raise _failure(rec, "send_recv", tag, "a peer failed while this rank waited", failed)
    if errors:
        raise _failure(rec, "send_recv", tag, errors[0]) from errors[0]


def pp_send(tensor: torch.Tensor, peer: int, group=None, *, tag: str = "pp_send") -> Pending:
    """Starts sending ``tensor`` to rank ``peer`` of ``group`` and returns at once (see [Note:
    pipeline transfers are point-to-point]); ``wait()`` the result before changing ``tensor``.
    The peer receives it with :func:`pp_recv` into a tensor of the same shape and dtype; between
    two ranks, messages are received in the order they are sent.

    Example (rank 0 sends, rank 1 receives):
      >>> if fsdpfn.comm.group_rank() == 0:  # needs two ranks  # doctest: +SKIP
      ...     fsdpfn.comm.pp_send(torch.ones(3), peer=1).wait()
      ... else:
      ...     fsdpfn.comm.pp_recv(torch.empty(3), peer=0).wait()
    """
    ranks, me = _pair(group, peer)
    if peer == me:
        raise ValueError(f"pp_send: peer {peer} is this rank; stages on one rank pass data in memory")
    tensor = tensor.contiguous()
    launch = lambda: dist.isend(_wire_view(tensor), group=group, group_dst=peer)  # noqa: E731
    return _p2p(ranks, tensor, launch, tag)


def pp_recv(out: torch.Tensor, peer: int, group=None, *, tag: str = "pp_recv") -> Pending:
    """Starts receiving rank ``peer``'s next :func:`pp_send` into ``out`` (contiguous, shaped and
    typed as what it sent); ``wait()`` returns ``out`` once it arrived, bounded by the process
    group's timeout.

    Example: see :func:`pp_send`.
    """
    ranks, me = _pair(group, peer)
    if peer == me:
        raise ValueError(f"pp_recv: peer {peer} is this rank; stages on one rank pass data in memory")
    if not out.is_contiguous():
        raise ValueError("pp_recv: out must be contiguous")
    launch = lambda: dist.irecv(_wire_view(out), group=group, group_src=peer)  # noqa: E731
    return _p2p(ranks, out, launch, tag)
