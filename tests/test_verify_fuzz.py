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
from hypothesis import HealthCheck, Phase, assume, given, settings

import _fuzz


@settings(max_examples=_fuzz.EXAMPLES, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate],  # no shrinking: an example is seconds of gloo work
          suppress_health_check=list(HealthCheck))
@given(d=_fuzz.describe())
def test_every_drawn_example_is_refused_by_name_or_matches_one_process(run_on_ranks, d):
    # remat around a unit with a collective (tp, cp) fails in the pure loop outside the check:
    # one rank's replay check raises, the others wait in the collective. Kept as its own cases
    # below, left out here until fixed.
    assume(not (d["remat"] and {"tp", "cp"} & set(_fuzz.MESHES[d["mesh"]][1])))
    outcome, detail = _fuzz.run(run_on_ranks, d)
    assert outcome in ("refused", "correct"), f"{outcome}: {detail}\nexample: {d}"


BASE = {"qkv": "heads", "cut": "heads_permute", "moe": False, "tied": False,
        "calls": {"qkv": "call", "proj": "call", "fc": "call", "out": "call"}, "attn": ("cp", "cp"), "mesh": "dp1_tp2",
        "tp": {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"},
        "experts": [], "remat": False, "strategy": "zero3"}


def test_the_oracle_passes_a_correct_layout_and_refuses_a_wrong_one(run_on_ranks):
    """The fuzzer's own check: a head-major qkv split colwise trains to one process's gradients,
    the same model with q | k | v side by side is named by the check."""
    outcome, detail = _fuzz.run(run_on_ranks, BASE)
    assert outcome == "correct", detail
    outcome, detail = _fuzz.run(run_on_ranks, {**BASE, "qkv": "sides", "cut": "unbind"})
    assert outcome == "refused" and "VerificationError" in detail and "blocks.0" in detail, detail


# Likely cause: fsdpfn/_remat.py fingerprints each operator's output as it is dispatched, and
# fsdpfn.comm launches its collectives asynchronously (dist.all_reduce / all_gather with
# async_op=True, waited on later), so the fingerprint of c10d's allreduce_ / allgather output
# reads a tensor gloo is still writing: forward and recompute then differ on whichever rank read
# it early. Which rank that is depends on timing, so a case may pass now and then: not strict.
@pytest.mark.xfail(strict=False, reason="remat around a tp or cp collective in the pure loop: the remat replay check "
                   "raises RematReplayError (under tp: 'aten.allreduce ... computed other values on the recompute "
                   "than in the forward') on one rank only; the others wait in the backward's collective until the timeout")
@pytest.mark.parametrize("mesh", ["dp1_tp2", "dp1_cp2"])
def test_remat_around_a_collective_in_the_pure_loop_matches_one_process(run_on_ranks, mesh):
    d = {**BASE, "remat": True, "mesh": mesh, "tp": BASE["tp"] if mesh == "dp1_tp2" else {}}
    outcome, detail = _fuzz.run(run_on_ranks, d, timeout=15)  # correct, it takes ~1 s
    assert outcome == "correct", detail
