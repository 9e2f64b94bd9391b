"""A pipeline stage of a reference model: a contiguous run of its top-level parts.

torchtitan splits its models for pipelining into per-stage copies that keep only a range of
layers (the embedding on the first stage, the final norm and output on the last); here a stage
is an ``nn.Module`` that *shares* the model's submodules (no copy: the parameters are the same
objects, so :class:`fsdpfn.runtime.PipelineRuntime` maps them to the plan's names by identity)
and runs the ones of its units in model order. The models build them with
``model.pipeline_stage(units)``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["ModelStage"]


class ModelStage(nn.Module):
    """Runs ``parts`` of a model in order: ``x = step(module, x)`` for each.

    Args:
      model_name: for messages.
      order: every part's name in the order the model runs them.
      parts: ``{name: (module, step)}`` for every name of ``order``.
      units: the stage's units: a contiguous run of ``order``.
    """

    def __init__(
        self, model_name: str, order: Sequence[str], parts: dict[str, tuple[nn.Module, Callable]], units: Sequence[str]
    ):
        super().__init__()
        units = list(units)
        unknown = [u for u in units if u not in parts]
        if unknown or not units:
            raise ValueError(
                f"{model_name}.pipeline_stage: units {unknown or units} are not parts this model can run as a "
                f"stage; a stage is a contiguous run of {', '.join(order[:4])}, ..., {order[-1]} (plan the model "
                f"with units=[...] naming those modules)"
            )
        at = [order.index(u) for u in units]
        if at != list(range(at[0], at[0] + len(at))):
            raise ValueError(
                f"{model_name}.pipeline_stage: units {units} are not a contiguous run in model order "
                f"({', '.join(order)}); a stage runs consecutive parts"
            )
        self.names = units
        self.parts = nn.ModuleList(parts[u][0] for u in units)
        self._steps = [parts[u][1] for u in units]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module, step in zip(self.parts, self._steps):
            x = step(module, x)
        return x

    def extra_repr(self) -> str:
        return f"units={self.names}"


def call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)
