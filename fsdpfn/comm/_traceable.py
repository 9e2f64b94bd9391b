"""Traceable collectives: what :mod:`fsdpfn.comm` runs inside ``torch.compile``.

[Note: collectives under torch.compile]
The eager collectives (:mod:`fsdpfn.comm._collectives`) launch gloo/NCCL work asynchronously and
wait in slices so that a peer's announced failure ends the wait; each call is counted and gets a
flight record. None of that can be traced: dynamo breaks the graph at the wait loop's clock, at the
flight recorder's process id and store write, at the async work handle. Inside a compiled region
the same collectives are therefore the functional ones of ``torch.distributed`` (``_c10d_functional``
ops: a value in, a value out), which dynamo records as graph nodes and inductor emits between its
fused kernels, where its bucketing and reordering passes may move them. What changes:

- counting: a compiled graph's collectives are listed once, when it is compiled, and counted on
  every call of the graph (:func:`fsdpfn.compile` does both); plain ``torch.compile`` counts
  nothing;
- the flight recorder: no record per collective of a compiled graph (its sequence numbers stay
  those of the eager collectives);
- the timeout: the process group's own operation timeout (set from :func:`fsdpfn.comm.timeout`
  when the group was created by fsdpfn), not the sliced wait; a stuck peer fails the collective
  without naming the rank that is behind.

Every function here takes a group as ``(DeviceMesh, dim)`` (or a process group) and returns the
waited result, so eager calls outside ``torch.compile`` give the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from fsdpfn._wire import wire_bytes

__all__ = [
    "compiling",
    "count_compiled",
    "graph_collectives",
    "traced_all_gather",
    "traced_all_reduce",
    "traced_all_to_all",
    "traced_reduce_scatter",
    "traced_shift",
]


def compiling() -> bool:
    """Whether dynamo is tracing the caller (``torch.compile``, ``torch._dynamo.explain``).

    Example:
      >>> fsdpfn.comm.compiling()
      False
    """
    return torch.compiler.is_compiling()


def traced_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's flat ``x`` concatenated in rank order (functional all-gather).

    Example:
      >>> fsdpfn.comm.traced_all_gather(torch.arange(3.0), None)   # no group: one rank
      tensor([0., 1., 2.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))


def traced_reduce_scatter(x: torch.Tensor, group, accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum over ranks of flat ``x``, rank r keeping its r-th contiguous part. With a wider
    ``accum_dtype`` the parts cross the wire in ``x``'s dtype (an all-to-all) and are summed in
    ``accum_dtype``, as :func:`fsdpfn.comm.reduce_scatter` into a wider output does.

    Example:
      >>> fsdpfn.comm.traced_reduce_scatter(torch.arange(3.0), None)
      tensor([0., 1., 2.])
    """
    widen = accum_dtype is not None and accum_dtype != x.dtype
    if group is None:
        return x.to(accum_dtype) if widen else x.clone()
    if widen:
        parts = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
        return parts.view(_size(group), -1).sum(0, dtype=accum_dtype)
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))


def _size(group) -> int:
    if isinstance(group, tuple):  # (DeviceMesh, dim)
        return group[0].size(group[1])
    return group.size()


def _rank(group) -> int:
    if isinstance(group, tuple):  # (DeviceMesh, dim)
        return group[0].get_local_rank(group[1])
    return group.rank()


def traced_all_to_all(x: torch.Tensor, group, output_splits=None, input_splits=None) -> torch.Tensor:
    """Flat ``x`` cut into as many equal parts as ranks (or ``input_splits`` elements each),
    part ``j`` sent to rank ``j``; returns the parts received, by source rank (``output_splits``
    elements each), as a functional all-to-all.

    Example:
      >>> fsdpfn.comm.traced_all_to_all(torch.arange(3.0), None)
      tensor([0., 1., 2.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.all_to_all_single(x, output_splits, input_splits, group))


def traced_shift(x: torch.Tensor, group, shift: int = 1) -> torch.Tensor:
    """One ring hop, :func:`fsdpfn.comm.send_recv` traced: rank ``r`` sends flat ``x`` to rank
    ``(r + shift) % W`` and returns what rank ``(r - shift) % W`` sent (equal sizes on every
    rank). An all-to-all with one non-empty part each way, as the eager hop is; the graph's
    reader lists it as the ``send_recv`` it is.

    Example:
      >>> fsdpfn.comm.traced_shift(torch.arange(3.0), None)
      tensor([0., 1., 2.])
    """
    if group is None:
        return x.clone()
    w, r, n = _size(group), _rank(group), x.numel()
    send = [n if q == (r + shift) % w else 0 for q in range(w)]
    recv = [n if q == (r - shift) % w else 0 for q in range(w)]
    return funcol.wait_tensor(funcol.all_to_all_single(x, recv, send, group))


def traced_all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over ranks (``op``: ``"sum"``, ``"max"`` or ``"min"``), out of place.

    Example:
      >>> fsdpfn.comm.traced_all_reduce(torch.ones(2), None)
      tensor([1., 1.])
    """
    if group is None:
        return x.clone()
    return funcol.wait_tensor(funcol.all_reduce(x, op, group))


_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",  # _out: inductor's merged gathers
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
}


def graph_collectives(gm) -> list:
    """The collectives a traced graph (``torch.fx.GraphModule``) holds, in graph order, as
    :class:`~fsdpfn.comm.CollectiveCall` s tagged ``"compiled"``: what every call of the graph
    runs.

    Example:
      >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
      >>> fsdpfn.comm.graph_collectives(gm)
      []
    """
    from fsdpfn.comm._record import CollectiveCall

    calls = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "").split(".")[0]
        if getattr(node.target, "namespace", None) != "_c10d_functional" or name not in _OPS:
            continue
        kind = _OPS[name]
        if kind == "all_to_all" and _one_peer(node):
            kind = "send_recv"
        elif kind == "all_to_all" and _summed_over_ranks(node):
            kind = "reduce_scatter"
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if src is None or out is None:
            continue
        big = max(src.numel(), out.numel()) * src.element_size()
        w = _group_size_of(node.args[-1])
        calls.append(CollectiveCall(kind, w, big, wire_bytes(kind, w, big), src.dtype, "compiled"))
    return calls


# [Note: a reduce-scatter summed in a wider dtype]
# A reduce-scatter whose output is wider than its input (bf16 on the wire, an fp32 sum) is, in a
# traced graph, an all-to-all of the ranks' parts and a sum over them (the functional
# reduce-scatter sums in its input's dtype): see traced_reduce_scatter. Eager records it as the
# reduce-scatter it is, and the op list and plan.cost() name it so; the graph's reader decides by
# what the graph computes with the received parts, whoever wrote it: an all-to-all whose every
# use, through its wait and shape-only views, is a sum over the leading (source-rank) dim is a
# reduce-scatter.
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "unflatten", "alias"})


def _one_peer(node) -> bool:
    """An all-to-all that sends to one rank and receives from one (its split sizes each hold
    one non-zero entry, as :func:`traced_shift` writes them): a ring hop, which eager records
    as ``send_recv``. A split given as a traced value (not a constant) is not read as one."""
    out_splits, in_splits = node.args[1], node.args[2]

    def single(splits) -> bool:
        return (
            isinstance(splits, (list, tuple))
            and all(isinstance(s, int) for s in splits)
            and (sum(s != 0 for s in splits) == 1)
        )

    return len(node.args) > 3 and single(out_splits) and single(in_splits) and len(in_splits) > 1


def _summed_over_ranks(node) -> bool:
    def name(n) -> str:
        return getattr(n.target, "__name__", "").split(".")[0] if n.op == "call_function" else ""

    frontier, seen_sum = list(node.users), False
    while frontier:
        user = frontier.pop()
        if name(user) in ("wait_tensor", *_VIEWS):
            frontier.extend(user.users)
        elif name(user) == "sum" and list(user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", ())) == [0]:
            seen_sum = True
        else:
            return False
    return seen_sum


def _group_size_of(group_name) -> int:
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(group_name).size()
    except Exception:  # noqa: BLE001 - a graph traced without a live group: size unknown
        return 0


def count_compiled(calls) -> None:
    """Adds ``calls`` (a compiled graph's collectives) to every active
    :func:`~fsdpfn.comm.count_collectives` block of this thread: one call of the graph."""
    from fsdpfn.comm._record import _active

    for counter in _active():
        counter.calls.extend(calls)
