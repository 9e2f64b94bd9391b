"""Small reference models used by the examples, tests and benchmarks."""

from fsdpfn.models._gpt import GPT as GPT
from fsdpfn.models._gpt import GPTConfig as GPTConfig

__all__ = ["GPT", "GPTConfig"]
