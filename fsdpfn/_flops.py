"""FLOPs of one ATen operator call, counted the same way by the simulator's profile and by the
runtime's count of recompute work (so the two agree to the FLOP)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["attention_flops", "is_attention", "op_flops", "rate_key", "split_key", "tensors_of"]


def is_attention(func) -> bool:
    name = str(func)
    return "_attention" in name and "attention_mask" not in name


def attention_flops(func, args, kwargs) -> tuple[float, torch.dtype] | None:
    """FLOPs of a fused attention kernel, counted the same way for every backend (torch's
    registry knows some, not the CPU flash kernels): ``4 b h s_q s_k d`` forward, twice that
    backward, half of it under a causal mask, whose masked blocks the kernels skip."""
    name = str(func)
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    backward = "backward" in name
    if len(ts) < (3 if backward else 2):
        return None
    q, k = (ts[1], ts[2]) if backward else (ts[0], ts[1])
    if q.dim() != 4:
        return None
    if "scaled_dot_product" in name:  # (batch, heads, seq, dim)
        b_h, s_q, s_k = q.shape[0] * q.shape[1], q.shape[2], k.shape[2]
    else:  # _flash_attention_* / _efficient_attention_*: (batch, seq, heads, dim)
        b_h, s_q, s_k = q.shape[0] * q.shape[2], q.shape[1], k.shape[1]
    values = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            values.setdefault(arg.name, args[i])
    causal = values.get("is_causal") is True or values.get("custom_mask_type") == 1
    flops = 4.0 * b_h * s_q * s_k * q.shape[-1]
    return flops * (2.0 if backward else 1.0) * (0.5 if causal else 1.0), q.dtype


def op_flops(func, args, kwargs, out) -> tuple[float, torch.dtype] | None:
    """``(flops, dtype)`` of a matmul-like operator call (fused attention included), else None.

    Example:
      >>> a = torch.zeros(4, 3)
      >>> op_flops(torch.ops.aten.mm.default, (a, torch.zeros(3, 2)), {}, torch.zeros(4, 2))
      (48.0, torch.float32)
    """
    counted = attention_flops(func, args, kwargs) if is_attention(func) else None
    packet = func._overloadpacket
    if counted is None and packet in flop_registry:
        ts = (tensors_of(args) + tensors_of(kwargs)) or tensors_of(out)
        counted = float(flop_registry[packet](*args, **kwargs, out_val=out)), ts[0].dtype
    return counted


def tensors_of(tree) -> list[torch.Tensor]:
    """The tensors in a tree of lists, tuples and dicts (in dispatch-argument order for the FLOP counters)."""
    out, stack = [], [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


# A kernel's efficiency depends on its shape, not only on its FLOPs (see fsdpfn/sim/_kernels.py):
# the key a matmul-like call is priced under carries it after an "@". Calls of one shape share a
# key, so a workload still aggregates them.
_MM = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}


def _shape(func, args) -> str:
    name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
    if name in _MM:
        i, j = _MM[name]
        a, b = args[i], args[j]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return ""
        rows = a.shape[0] * a.shape[1] if a.dim() == 3 else a.shape[0]  # a batch of matmuls: more rows of tiles
        return f"{rows}x{b.shape[-1]}x{a.shape[-1]}"
    if is_attention(func):
        ts = [t for t in args if isinstance(t, torch.Tensor)]
        backward = "backward" in str(func)
        if len(ts) < (3 if backward else 2):
            return ""
        q, k = (ts[1], ts[2]) if backward else (ts[0], ts[1])
        if q.dim() != 4:
            return ""
        if "scaled_dot_product" in str(func):  # (batch, heads, seq, dim)
            return f"{q.shape[2]}x{k.shape[2]}x{q.shape[-1]}"
        return f"{q.shape[1]}x{k.shape[1]}x{q.shape[-1]}"
    return ""


def rate_key(func, args, kwargs, dtype: torch.dtype) -> str:
    """The key a matmul-like call is priced under: its dtype (``"bfloat16"``), ``"attention "``
    before it for fused attention, and its shape after an ``"@"`` where one is known: ``m x n x
    k`` of a matmul (a batched one's rows counted over the batch), ``s_q x s_k x head_dim`` of
    attention.

    Example:
      >>> rate_key(torch.ops.aten.mm.default, (torch.zeros(4, 3), torch.zeros(3, 2)), {}, torch.float32)
      'float32@4x2x3'
    """
    rate = str(dtype).removeprefix("torch.")
    key = f"attention {rate}" if is_attention(func) else rate
    shape = _shape(func, args)
    return f"{key}@{shape}" if shape else key


def split_key(key: str) -> tuple[str, tuple[int, ...]]:
    """``(rate, shape)`` of a key :func:`rate_key` made (shape ``()`` where none is known).

    Example:
      >>> split_key("attention bfloat16@2048x2048x128"), split_key("float32")
      (('attention bfloat16', (2048, 2048, 128)), ('float32', ()))
    """
    rate, _, shape = key.partition("@")
    return rate, tuple(int(x) for x in shape.split("x")) if shape else ()
