"""A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, untied embeddings) with
the shapes of Llama 3 8B and 70B, for planning and simulating at scale.

Build it on the meta device (``with torch.device("meta"): Llama(LLAMA3_8B)``): nothing is
allocated, and ``fsdpfn.plan``, ``fsdpfn.sim.profile`` and ``fsdpfn.sim.search`` work on it.
Like :class:`fsdpfn.models.GPT`, its blocks sit in an ``nn.ModuleList``, so the default unit
policy makes each block a unit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fsdpfn.transforms import context_parallel_attention

__all__ = ["LLAMA3_70B", "LLAMA3_8B", "Llama", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama-style decoder.

    Attributes:
      dim: model width.
      layers: decoder blocks.
      heads: query heads (``dim`` must divide by it).
      kv_heads: key/value heads (grouped-query attention; ``heads`` must divide by it).
      ffn: hidden width of the SwiGLU MLP.
      vocab: vocabulary size.
    """

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256

    def __post_init__(self):
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: dim ({self.dim}) must divide by heads ({self.heads}) and heads by kv_heads ({self.kv_heads})"
            )


LLAMA3_8B = LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336)
LLAMA3_70B = LlamaConfig(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts read off the tensors: under tensor parallelism a rank holds heads / tp of them.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        # Plain causal SDPA, or over a cp axis (inside `with fsdpfn.context_parallel(plan):`) the
        # attention of this rank's part of each sequence to the whole of it.
        out = context_parallel_attention(q, k, v, causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.dim)
        self.attn = Attention(c)
        self.mlp_norm = nn.RMSNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder: ``tokens (batch, seq) -> logits (batch, seq, vocab)``.

    Example:
      >>> with torch.device("meta"):
      ...     m = fsdpfn.models.Llama(fsdpfn.models.LLAMA3_8B)
      >>> round(sum(p.numel() for p in m.parameters()) / 1e9, 2)
      8.03
      >>> len(fsdpfn.plan(m, (1024,)).units)   # 32 blocks and the root
      33
    """

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def pipeline_stage(self, units) -> nn.Module:
        """The module that runs pipeline stage ``units`` (a contiguous run of ``embed``,
        ``layers.0``, ..., ``norm``, ``output``), sharing this model's parameters (see
        :meth:`fsdpfn.models.GPT.pipeline_stage`).

        Example:
          >>> m = Llama(LlamaConfig(dim=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=50))
          >>> a, b = m.pipeline_stage(["embed", "layers.0"]), m.pipeline_stage(["layers.1", "norm", "output"])
          >>> b(a(torch.zeros(2, 8, dtype=torch.long))).shape
          torch.Size([2, 8, 50])
        """
        from fsdpfn.models._stage import ModelStage, call

        parts: dict[str, tuple[nn.Module, Callable]] = {"embed": (self.embed, call)}
        parts.update({f"layers.{i}": (b, call) for i, b in enumerate(self.layers)})
        parts.update({"norm": (self.norm, call), "output": (self.output, call)})
        return ModelStage("Llama", list(parts), parts, units)
