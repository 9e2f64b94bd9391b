"""FLOPs of one ATen operator call, counted the same way by the simulator's profile and by the
runtime's count of recompute work (so the two agree to the FLOP)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["attention_flops", "is_attention", "op_flops", "tensors_of"]


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
