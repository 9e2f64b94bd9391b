"""Shared by the tests that check bad input is refused on every rank before any collective."""

from __future__ import annotations

from typing import Callable

import fsdpfn


def refusals(cases: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Runs each case on this rank: ``{case: "no error" | "ValueError: ..." | ...}``, plus
    ``"collectives"``: how many collectives they ran in all (0 when each refusal came first)."""
    out: dict[str, object] = {}
    with fsdpfn.count_collectives() as counter:
        for key, build in cases.items():
            try:
                build()
                out[key] = "no error"
            except (ValueError, NotImplementedError) as e:
                out[key] = f"{type(e).__name__}: {e}"
    out["collectives"] = sum(counter.counts().values())
    return out
