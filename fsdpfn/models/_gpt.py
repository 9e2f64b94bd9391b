"""A small GPT-style decoder: the model our examples, tests and benchmarks shard.

Pre-norm blocks (causal self-attention + GELU MLP) in an ``nn.ModuleList``, so fsdpfn's default
unit policy makes each block a unit and leaves the embeddings, final norm and head in the root.
:data:`TP_PLAN` splits its attention and MLP over a tensor-parallel axis (Megatron-style).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

try:
    from fsdpfn._remat import checkpoint_name
except ImportError:  # this file also runs on its own, without fsdpfn (exported checkpoints load into it)

    def checkpoint_name(x, name):
        return x


# fsdpfn.plan(model, mesh, tp=TP_PLAN): qkv and fc split by output features, proj and out by
# input features, so each block needs one all-reduce after attention and one after the MLP.
TP_PLAN = {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    # Biases in Linear and LayerNorm layers. Without them training is as good and parity checks
    # are sharper: the key part of a qkv bias has an exactly-zero true gradient (softmax ignores
    # a per-query constant), so Adam turns its rounding noise into full-size steps.
    bias: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.norm2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.fc = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width, bias=cfg.bias)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # qkv rows are head-major (head 0's q, k, v, then head 1's, ...) and the head count is
        # read off the tensor, so a colwise split of qkv over tp ranks hands each rank whole
        # heads, and the same code runs on heads / tp of them.
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, c // self.heads).permute(3, 0, 2, 1, 4)
        # Named for remat="save_names:attention,mlp_up" (fsdpfn.checkpoint_name is a no-op otherwise).
        att = checkpoint_name(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attention")
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(checkpoint_name(self.fc(self.norm2(x)), "mlp_up")))


class GPT(nn.Module):
    """Token + position embeddings, ``depth`` blocks, final norm, linear head.

    Example:
      >>> model = GPT(GPTConfig(vocab_size=64, width=32, depth=2))
      >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
      torch.Size([2, 8, 64])
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
