"""The differential check, fuzzed: small models and plans drawn by hypothesis (tests/_fuzz.py),
each either refused by name before its first step or trained to one process's gradients.

How an example is judged, and the bound its gradients must meet (4 u (fan-in + fan-out over the
weights + tokens), ~1.5e-4 here, against ~1e-7 measured for rounding and >= 1e-2 for a layout
mistake), is in [Note: the fuzzer's oracle] and [Note: the fuzzer's bound] in tests/_fuzz.py.
``FSDPFN_FUZZ_EXAMPLES`` sets how many examples this suite draws (default 6, a fixed,
derandomised set); ``python benchmarks/fuzz.py --examples N`` draws more and counts outcomes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import _fuzz


@settings(
    max_examples=_fuzz.EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: an example is seconds of gloo work
    suppress_health_check=list(HealthCheck),
)
@given(d=_fuzz.describe())
def test_every_drawn_example_is_refused_by_name_or_matches_one_process(run_on_ranks, d):
    outcome, detail = _fuzz.run(run_on_ranks, d)
    assert outcome in ("refused", "correct"), f"{outcome}: {detail}\nexample: {d}"


BASE = {
    "qkv": "heads",
    "cut": "heads_permute",
    "moe": False,
    "tied": False,
    "calls": {"qkv": "call", "proj": "call", "fc": "call", "out": "call"},
    "attn": ("cp", "cp"),
    "mesh": "dp1_tp2",
    "tp": {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"},
    "experts": [],
    "remat": False,
    "strategy": "zero3",
}


def test_the_oracle_passes_a_correct_layout_and_refuses_a_wrong_one(run_on_ranks):
    """The fuzzer's own check: a head-major qkv split colwise trains to one process's gradients,
    the same model with q | k | v side by side is named by the check."""
    outcome, detail = _fuzz.run(run_on_ranks, BASE)
    assert outcome == "correct", detail
    outcome, detail = _fuzz.run(run_on_ranks, {**BASE, "qkv": "sides", "cut": "unbind"})
    assert outcome == "refused" and "VerificationError" in detail and "blocks.0" in detail, detail


# Found by this fuzzer: the remat replay check fingerprinted a collective's output as it was
# dispatched, while fsdpfn.comm's async gloo work was still writing it, so forward and recompute
# differed on whichever rank read it early and that rank raised while the other waited.
@pytest.mark.parametrize("mesh", ["dp1_tp2", "dp1_cp2"])
def test_remat_around_a_collective_in_the_pure_loop_matches_one_process(run_on_ranks, mesh):
    d = {**BASE, "remat": True, "mesh": mesh, "tp": BASE["tp"] if mesh == "dp1_tp2" else {}}
    outcome, detail = _fuzz.run(run_on_ranks, d, timeout=120)  # ~1 s on an idle machine
    assert outcome == "correct", detail
