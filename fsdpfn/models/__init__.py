"""Reference models used by the examples, tests and benchmarks: a small GPT to train, and a
Llama-style decoder with Llama 3 8B / 70B shapes to plan and simulate on the meta device."""

from fsdpfn.models._gpt import GPT as GPT
from fsdpfn.models._gpt import GPTConfig as GPTConfig
from fsdpfn.models._gpt import TP_PLAN as GPT_TP_PLAN
from fsdpfn.models._llama import LLAMA3_8B as LLAMA3_8B
from fsdpfn.models._llama import LLAMA3_70B as LLAMA3_70B
from fsdpfn.models._llama import Llama as Llama
from fsdpfn.models._llama import LlamaConfig as LlamaConfig
from fsdpfn.models._moe import Experts as Experts
from fsdpfn.models._moe import MoE as MoE
from fsdpfn.models._moe import MoEConfig as MoEConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_TP_PLAN",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "Llama",
    "LlamaConfig",
    "Experts",
    "MoE",
    "MoEConfig",
]
