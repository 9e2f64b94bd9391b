"""A small GPT-style decoder: the model our examples, tests and benchmarks shard.

Pre-norm blocks (causal self-attention + GELU MLP) in an ``nn.ModuleList``, so fsdpfn's default
unit policy makes each block a unit and leaves the embeddings, final norm and head in the root.
:data:`TP_PLAN` splits its attention and MLP over a tensor-parallel axis (Megatron-style).
With ``GPTConfig(experts=E)`` the MLP of every ``moe_every``-th block is a top-k
mixture of experts (:class:`fsdpfn.models.MoE`), and the model returns ``(logits, aux)``.
Its attention is :func:`fsdpfn.context_parallel_attention`, so it runs on a mesh with a ``cp``
axis inside ``with fsdpfn.context_parallel(plan):`` on each rank's part of the sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

try:
    from fsdpfn._remat import checkpoint_name
    from fsdpfn.transforms import context_parallel_attention, context_parallel_positions
except ImportError:  # this file also runs on its own, without fsdpfn (exported checkpoints load into it)

    def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
        return x

    def context_parallel_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan_or_group=None,
        *,
        causal: bool = True,
        strategy: str | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def context_parallel_positions(local_len: int, plan_or_group=None, *, device=None) -> torch.Tensor:
        return torch.arange(local_len, device=device)


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
    # Causal self-attention (a decoder); False: every token attends to the whole sequence.
    causal: bool = True
    # Mixture of experts (0: dense MLPs everywhere). Block i's MLP is a top_k-of-experts MoE
    # (fsdpfn.models.MoE, each expert as wide as the dense MLP) when i % moe_every == 0: every
    # block with 1, blocks 0, 2, 4, ... with 2 (Megatron's moe_layer_freq). The model then returns
    # (logits, aux), aux the MoE layers' load-balancing losses (aux_weight each), to add to the
    # loss. capacity_factor, pad_to_capacity: MoEConfig's (None: no token dropping; padding
    # each expert's rows to its capacity, which fsdpfn.compile needs under expert parallelism).
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    aux_weight: float = 0.01
    capacity_factor: float | None = None
    pad_to_capacity: bool = False


def _moe(cfg: GPTConfig) -> nn.Module:
    try:
        from fsdpfn.models._moe import MoE, MoEConfig
    except ImportError as e:  # the dense model runs without fsdpfn; its MoE layer does not
        raise ImportError(
            f"GPTConfig(experts={cfg.experts}) needs fsdpfn's MoE layer: install fsdpfn, or use experts=0"
        ) from e
    return MoE(
        MoEConfig(
            width=cfg.width,
            hidden=cfg.mlp_ratio * cfg.width,
            experts=cfg.experts,
            top_k=cfg.top_k,
            aux_weight=cfg.aux_weight,
            capacity_factor=cfg.capacity_factor,
            pad_to_capacity=cfg.pad_to_capacity,
        )
    )


class Block(nn.Module):
    """Attention, then a dense MLP (returns ``x``), or with ``moe=True`` a mixture of experts
    over the block's ``batch * seq`` tokens (returns ``(x, load-balancing loss)``)."""

    def __init__(self, cfg: GPTConfig, moe: bool = False):
        super().__init__()
        self.heads, self.causal = cfg.heads, cfg.causal
        self.norm1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.norm2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        if moe:
            self.moe = _moe(cfg)
        else:
            self.fc = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width, bias=cfg.bias)
            self.out = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        # qkv rows are head-major (head 0's q, k, v, then head 1's, ...) and the head count is
        # read off the tensor, so a colwise split of qkv over tp ranks hands each rank whole
        # heads, and the same code runs on heads / tp of them.
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, c // self.heads).permute(3, 0, 2, 1, 4)
        # Named for remat="save_names:attention,mlp_up" (fsdpfn.checkpoint_name is a no-op otherwise).
        # Over a cp axis (inside `with fsdpfn.context_parallel(plan):`) x holds this rank's part of
        # each sequence and attention fetches the rest; elsewhere this is plain causal SDPA.
        att = checkpoint_name(context_parallel_attention(q, k, v, causal=self.causal), "attention")
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        if hasattr(self, "moe"):
            y, aux = self.moe(self.norm2(x).reshape(b * t, c))
            return x + y.view(b, t, c), aux
        return x + self.out(F.gelu(checkpoint_name(self.fc(self.norm2(x)), "mlp_up")))


class GPT(nn.Module):
    """Token + position embeddings, ``depth`` blocks, final norm, linear head.

    Returns the logits, or with ``cfg.experts`` (MoE MLPs) ``(logits, aux)``: ``aux`` the sum
    of the MoE layers' load-balancing losses, to add to the training loss.

    Example:
      >>> model = GPT(GPTConfig(vocab_size=64, width=32, depth=2))
      >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
      torch.Size([2, 8, 64])
      >>> moe = GPT(GPTConfig(vocab_size=64, width=32, depth=2, experts=4, top_k=2, moe_every=2))
      >>> logits, aux = moe(torch.zeros(2, 8, dtype=torch.long))
      >>> logits.shape, [hasattr(b, "moe") for b in moe.blocks]
      (torch.Size([2, 8, 64]), [True, False])
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        if cfg.experts < 0 or cfg.moe_every < 1:
            raise ValueError(f"GPTConfig: experts={cfg.experts} must be >= 0 and moe_every={cfg.moe_every} >= 1")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(
            Block(cfg, moe=cfg.experts > 0 and i % cfg.moe_every == 0) for i in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # positions: of each token in its sequence; by default 0..t-1, or this rank's positions
        # inside a context-parallel block (fsdpfn.context_parallel_positions).
        if positions is None:
            positions = context_parallel_positions(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        aux = None
        for block in self.blocks:
            x = block(x)
            if isinstance(x, tuple):
                x, a = x
                aux = a if aux is None else aux + a
        logits = self.head(self.norm(x))
        return logits if aux is None else (logits, aux)

    def pipeline_stage(self, units) -> nn.Module:
        """The module that runs pipeline stage ``units`` (a contiguous run of ``embed``, ``pos``,
        ``blocks.0``, ..., ``norm``, ``head``), sharing this model's parameters: the first stage
        takes tokens, the last returns logits, the others take and return hidden states.
        :class:`fsdpfn.runtime.PipelineRuntime` builds one per stage of its rank from the plan's
        stages (as torchtitan splits its models); dense blocks only.

        Example:
          >>> model = GPT(GPTConfig(vocab_size=64, width=32, depth=2))
          >>> first, last = model.pipeline_stage(["embed", "pos", "blocks.0"]), model.pipeline_stage(["blocks.1", "norm", "head"])
          >>> last(first(torch.zeros(2, 8, dtype=torch.long))).shape
          torch.Size([2, 8, 64])
        """
        from fsdpfn.models._stage import ModelStage, call

        if self.cfg.experts:
            raise NotImplementedError(
                "GPT.pipeline_stage: MoE blocks return (x, aux), which a stage cannot pass on yet; "
                "pipeline a dense GPT (experts=0)"
            )

        def add_pos(pos: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x + pos(context_parallel_positions(x.shape[1], device=x.device))

        parts: dict[str, tuple[nn.Module, Callable]] = {"embed": (self.embed, call), "pos": (self.pos, add_pos)}
        parts.update({f"blocks.{i}": (b, call) for i, b in enumerate(self.blocks)})
        parts.update({"norm": (self.norm, call), "head": (self.head, call)})
        return ModelStage("GPT", list(parts), parts, units)
