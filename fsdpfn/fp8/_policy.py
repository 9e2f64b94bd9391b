"""Which parameters gather in FP8, with which recipe, handed to whom."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Sequence

from fsdpfn.fp8._recipes import BY_NAME, Float8Recipe, MXFP8BlockScaling, recipe_from_dict

__all__ = ["BACKENDS", "Float8GatherPolicy", "as_gather_policy"]

BACKENDS = ("torch", "te")


@dataclasses.dataclass(frozen=True)
class Float8GatherPolicy:
    """FP8 parameter all-gather: ``fsdpfn.MixedPrecision(param_dtype, reduce_dtype, fp8=policy)``.

    Each rank quantizes its rows of every selected weight after the optimizer step, from the
    fp32 master cast to ``param_dtype`` (what a high-precision gather would have shipped), the
    unit's all-gather moves the FP8 elements plus scales, and every rank dequantizes the gathered
    weight to ``param_dtype`` (``backend="torch"``) or hands the bytes to Transformer Engine's
    quantized tensor type (``backend="te"``). Gradients flow straight through to the fp32 masters
    in ``reduce_dtype``; masters are never made from FP8 values.

    Selected: the >= 2-D parameters of the chosen units, except those of ``nn.Embedding``
    modules and those matching ``exclude``. 1-D parameters (norms, biases), 0-d parameters and
    excluded ones gather in ``param_dtype`` in the same all-gather.

    Args:
      recipe: a recipe (:class:`MXFP8BlockScaling` by default, :class:`Float8BlockScaling`,
        :class:`Float8CurrentScaling`) or its short name (``"mxfp8"``, ``"blockwise"``,
        ``"tensorwise"``).
      units: unit names (``"<root>"`` for the root) whose weights gather in FP8; ``None``: every
        unit with a selectable weight. A named unit without one is an error.
      exclude: ``fnmatch`` patterns of parameter names kept in ``param_dtype`` (e.g.
        ``("head.weight",)``). A pattern matching no parameter is an error (a typo would else
        silently quantize the layer it meant to protect).
      backend: ``"torch"`` (dequantize with torch ops, any device) or ``"te"`` (CUDA with
        Transformer Engine installed: ``pip install 'fsdpfn[te]'``; checked when the plan is
        built). ``fsdpfn.unshard`` then returns TE's ``MXFP8Tensor`` / ``Float8Tensor`` for the
        FP8 weights; :class:`fsdpfn.runtime.Runtime` still dequantizes into its own buffers.

    Example:
      >>> policy = fsdpfn.fp8.Float8GatherPolicy("mxfp8", exclude=("head.weight",))
      >>> mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, fp8=policy)
      >>> p = fsdpfn.plan(model, mesh, mp=mp)
      >>> p.units[1].fp8   # the weights of blocks.0 gathered in FP8
      ('blocks.0.qkv.weight', 'blocks.0.proj.weight', 'blocks.0.fc.weight', 'blocks.0.out.weight')
    """

    recipe: Any = dataclasses.field(default_factory=MXFP8BlockScaling)
    units: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    backend: str = "torch"

    def __post_init__(self):
        object.__setattr__(self, "recipe", _as_recipe(self.recipe))
        if self.units is not None:
            object.__setattr__(self, "units", _names(self.units, "units"))
        object.__setattr__(self, "exclude", _names(self.exclude, "exclude"))
        if self.backend not in BACKENDS:
            raise ValueError(f"Float8GatherPolicy(backend={self.backend!r}): choose one of {BACKENDS}")

    def excludes(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude)

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe.to_dict(),
            "units": None if self.units is None else list(self.units),
            "exclude": list(self.exclude),
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Float8GatherPolicy":
        return cls(
            recipe_from_dict(d["recipe"]), d.get("units"), tuple(d.get("exclude", ())), d.get("backend", "torch")
        )


def _as_recipe(value: Any) -> Float8Recipe:
    if isinstance(value, Float8Recipe):
        return value
    if isinstance(value, str) and value in BY_NAME:
        return BY_NAME[value]()
    raise ValueError(
        f"FP8 recipe must be an fsdpfn.fp8 recipe (MXFP8BlockScaling(), Float8BlockScaling(), Float8CurrentScaling()) "
        f"or one of {sorted(BY_NAME)}, got {value!r}"
    )


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"Float8GatherPolicy({what}=...) takes a list of names, got {value!r}")
    return tuple(value)


def as_gather_policy(value: Any) -> Float8GatherPolicy | None:
    """``MixedPrecision(fp8=...)``'s accepted forms: ``None``/``False`` (off), ``True`` (MXFP8
    on every eligible weight), a recipe or its short name, or a :class:`Float8GatherPolicy`."""
    if value is None or value is False:
        return None
    if value is True:
        return Float8GatherPolicy()
    if isinstance(value, Float8GatherPolicy):
        return value
    if isinstance(value, (Float8Recipe, str)):
        return Float8GatherPolicy(value)
    raise ValueError(
        f"MixedPrecision(fp8=...) takes None, True, a recipe name {sorted(BY_NAME)}, an fsdpfn.fp8 recipe or "
        f"fsdpfn.fp8.Float8GatherPolicy(...), got {value!r}"
    )
