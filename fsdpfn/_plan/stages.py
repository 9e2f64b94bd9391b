"""Pipeline stages: which units each stage holds and which pp rank runs it.

A pipelined plan (a mesh with a ``pp`` axis) cuts its units, in model order, into ``S``
stages, ``S`` a multiple of the pp size ``p``: ``S / p`` *virtual* stages per rank. Stage ``s``
runs on pp rank ``s % p`` (the looping placement of interleaved 1F1B: with two virtual stages
per rank, rank 0 holds stages 0 and ``p``). A stage is a run of whole units, so every unit's
gather and reduce stay where they are without pp, on the ranks of one stage.

[Note: the root unit in a pipeline]
The root unit holds the parameters no other unit claims, and its code wraps the whole model;
for a GPT that is the embedding *and* the head, which run at opposite ends of a pipeline. A
stage is a run of units, so a root with parameters joins a stage only when the user's split
puts all of its parameters in that one stage; otherwise (and always in a balanced split, which
cuts the units in order and cannot know where the root's code runs) the split is refused with
the fix: make the modules at each end units of their own (``units=["embed", "pos", "blocks.0",
..., "norm", "head"]``), which leaves the root empty.

The module imports only ``values`` (for the root's label).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from fsdpfn._plan.values import ROOT, unit_label

__all__ = ["Stages", "split_stages"]


@dataclasses.dataclass(frozen=True)
class Stages:
    """The stages of a pipelined plan: each stage's units, in model order, and the pp size.

    Attributes:
      units: ``units[s]``: the names of stage ``s``'s units, in the order they run.
      pp_size: ranks on the ``pp`` axis; stage ``s`` runs on pp rank ``s % pp_size``.

    Example:
      >>> st = Stages((("blocks.0",), ("blocks.1",), ("blocks.2",), ("blocks.3",)), pp_size=2)
      >>> st.num_stages, st.virtual, st.rank_of(2), st.stages_of(1), st.stage_of("blocks.3")
      (4, 2, 0, (1, 3), 3)
    """

    units: tuple[tuple[str, ...], ...]
    pp_size: int

    def __post_init__(self):
        object.__setattr__(self, "units", tuple(tuple(str(u) for u in s) for s in self.units))
        if not isinstance(self.pp_size, int) or isinstance(self.pp_size, bool) or self.pp_size < 1:
            raise ValueError(f"Stages: pp_size must be an int >= 1, got {self.pp_size!r}")
        if not self.units or len(self.units) % self.pp_size:
            raise ValueError(
                f"Stages: {len(self.units)} stages over {self.pp_size} pp ranks; the number of stages must be a "
                f"positive multiple of the pp size (each rank the same number of virtual stages)"
            )
        seen: dict[str, int] = {}
        for s, names in enumerate(self.units):
            if not names:
                raise ValueError(f"Stages: stage {s} holds no unit; every stage needs at least one")
            for name in names:
                if name in seen:
                    raise ValueError(
                        f"Stages: unit {unit_label(name)!r} is in stage {seen[name]} and stage {s}; a unit belongs to one stage"
                    )
                seen[name] = s

    @property
    def num_stages(self) -> int:
        return len(self.units)

    @property
    def virtual(self) -> int:
        """Stages per pp rank."""
        return self.num_stages // self.pp_size

    def rank_of(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        return stage % self.pp_size

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pp rank ``rank`` runs, in order."""
        return tuple(range(rank, self.num_stages, self.pp_size))

    def stage_of(self, unit: str) -> int:
        """The stage holding ``unit``."""
        for s, names in enumerate(self.units):
            if unit in names:
                return s
        raise ValueError(
            f"unit {unit_label(unit)!r} is in no stage; stages: {[list(map(unit_label, u)) for u in self.units]}"
        )

    def to_dict(self) -> dict:
        return {"units": [list(s) for s in self.units], "pp_size": self.pp_size}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Stages":
        return cls(tuple(tuple(s) for s in d["units"]), int(d["pp_size"]))

    def __str__(self) -> str:
        return "; ".join(
            f"stage {s} (pp rank {self.rank_of(s)}): {', '.join(map(unit_label, u))}" for s, u in enumerate(self.units)
        )


def _owns(prefix: str, name: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _split_by_names(units: Sequence[tuple[str, Sequence[str]]], split: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each unit joins the one stage whose prefixes own all its parameters."""
    split = [[split_s] if isinstance(split_s, str) else list(split_s) for split_s in split]
    used = {(s, q): False for s, qs in enumerate(split) for q in qs}
    out: list[list[str]] = [[] for _ in split]
    for unit, params in units:
        homes: dict[int, str] = {}
        for p in params:
            found = [(s, q) for s, qs in enumerate(split) for q in qs if _owns(q, p)]
            if not found:
                raise ValueError(
                    f"parameter {p!r} (unit {unit_label(unit)!r}) matches no stage's module prefixes; add its "
                    f"module (or {unit_label(unit)!r}) to one stage of stages=[...]"
                )
            if len({s for s, _ in found}) > 1:
                raise ValueError(
                    f"parameter {p!r} matches prefixes of stages {sorted({s for s, _ in found})} "
                    f"({', '.join(repr(q) for _, q in found)}); name each module in one stage"
                )
            homes.setdefault(found[0][0], p)
            for key in found:
                used[key] = True
        if len(homes) > 1:
            where = ", ".join(f"{p!r} in stage {s}" for s, p in sorted(homes.items()))
            fix = (
                "make the modules at each end units of their own, e.g. fsdpfn.pipeline_plan(..., units=[...]), so the root is empty "
                "(see [Note: the root unit in a pipeline])"
                if unit == ROOT
                else f"a stage holds whole units: put all of {unit_label(unit)!r} in one stage, or split it into smaller units"
            )
            raise ValueError(f"unit {unit_label(unit)!r} has parameters in {len(homes)} stages ({where}); {fix}")
        if homes:
            out[next(iter(homes))].append(unit)
    for (s, q), hit in used.items():
        if not hit:
            raise ValueError(f"stage {s}'s prefix {q!r} names no parameter of the plan's units; check the module name")
    return out


def _split_balanced(
    units: Sequence[tuple[str, Sequence[str]]], costs: Mapping[str, float], count: int
) -> list[list[str]]:
    """Contiguous runs minimising the largest run's cost (exact, by dynamic programming: the
    unit counts are small, and a greedy cut can leave the last stage twice as heavy)."""
    names = [u for u, _ in units]
    n = len(names)
    if n < count:
        raise ValueError(
            f"{count} stages need at least {count} units, the plan has {n} ({', '.join(map(unit_label, names))}); "
            "use fewer stages or more units (fsdpfn.pipeline_plan(..., units=[...]))"
        )
    prefix = [0.0]
    for u in names:
        prefix.append(prefix[-1] + float(costs[u]))
    inf = float("inf")
    # best[k][i]: the least largest cost cutting the first i units into k non-empty runs
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:  # strict: the earliest cut wins ties, so the split is deterministic
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(count, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [names[a:b] for a, b in reversed(bounds)]


def split_stages(
    units: Sequence[tuple[str, Sequence[str]]],
    pp_size: int,
    split=None,
    *,
    costs: Mapping[str, float] | None = None,
    numels: Mapping[str, int] | None = None,
) -> Stages:
    """Cuts ``units`` (``(name, parameter names)`` in model order) into pipeline stages.

    Args:
      units: the plan's units, in the order they run.
      pp_size: ranks on the ``pp`` axis.
      split: ``None``: ``pp_size`` stages, balanced; an int: that many stages (a multiple of
        ``pp_size``: ``split / pp_size`` virtual stages per rank), balanced; a list with one
        list of module-name prefixes per stage (``[["embed", "blocks.0"], ["blocks.1", "head"]]``):
        each unit joins the stage whose prefixes own its parameters.
      costs: ``{unit: cost}`` for a balanced split (e.g. a profile's seconds); default: ``numels``.
      numels: ``{unit: parameter count}``, the default cost.

    Raises:
      ValueError: naming the unit, parameter, prefix or stage at fault and the fix.

    Example:
      >>> units = [("a", ["a.w"]), ("b", ["b.w"]), ("c", ["c.w"]), ("d", ["d.w"])]
      >>> split_stages(units, 2, numels={"a": 1, "b": 1, "c": 1, "d": 3}).units
      (('a', 'b', 'c'), ('d',))
      >>> split_stages(units, 2, [["a"], ["b", "c", "d"]]).units
      (('a',), ('b', 'c', 'd'))
    """
    if split is None or isinstance(split, int) and not isinstance(split, bool):
        count = pp_size if split is None else split
        if count < 1 or count % pp_size:
            raise ValueError(
                f"stages={split!r}: the number of stages must be a positive multiple of the pp size {pp_size} "
                f"(e.g. stages={2 * pp_size} for two virtual stages per rank)"
            )
        root = [p for u, ps in units if u == ROOT for p in ps]
        if root:
            raise ValueError(
                f"a balanced split cuts the units in order, but the root unit holds {root[:3]}"
                f"{'...' if len(root) > 3 else ''}, which have no place in that order; make their modules units "
                "of their own (fsdpfn.pipeline_plan(..., units=[...])) or split by name with stages=[[...], ...] "
                "(see [Note: the root unit in a pipeline])"
            )
        weights = dict(costs) if costs is not None else dict(numels or {})
        missing = [u for u, _ in units if u not in weights]
        if missing:
            raise ValueError(f"stage_costs has no cost for units {[unit_label(u) for u in missing]}; give one per unit")
        bad = {u: c for u, c in weights.items() if not isinstance(c, (int, float)) or c < 0}
        if bad:
            raise ValueError(f"stage_costs must be numbers >= 0, got {bad}")
        return Stages(tuple(tuple(s) for s in _split_balanced(units, weights, count)), pp_size)
    if isinstance(split, (str, bytes)) or not isinstance(split, Sequence):
        raise ValueError(
            f"stages must be None, an int or a list of lists of module-name prefixes (one per stage), got {split!r}"
        )
    if len(split) % pp_size or not split:
        raise ValueError(
            f"stages=[...] lists {len(split)} stages for {pp_size} pp ranks; give a positive multiple of {pp_size}"
        )
    out = _split_by_names(units, split)
    order = [u for u, _ in units]
    for s in range(1, len(out)):
        late = [u for u in out[s - 1] if out[s] and order.index(u) > order.index(out[s][0])]
        if late:
            raise ValueError(
                f"stage {s - 1} holds unit {unit_label(late[0])!r}, which runs after stage {s}'s unit "
                f"{unit_label(out[s][0])!r}; a stage feeds the next, so list the modules in the order they run"
            )
    for s, names in enumerate(out):
        if not names:
            raise ValueError(
                f"stage {s} ({split[s]!r}) holds no unit: its modules' parameters all belong to units of other "
                "stages; a stage holds whole units"
            )
    return Stages(tuple(tuple(s) for s in out), pp_size)
