"""benchmarks/bad_inputs.py, the catalogue of mistakes on tp, ep, cp, pp, remat, Muon and compile,
run whole on 2 or 4 ranks (a minute or two): every case is a named error on every rank or computes what
one process computes; and its classifier tells the four classes apart, so a case that went silent
or lost its name would fail here."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bad_inputs.py")


@functools.cache
def _catalogue():
    spec = importlib.util.spec_from_file_location("_bad_inputs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _row(rank, world, case_id):
    # The ranks load the script by path too: a function of a module loaded that way does not pickle.
    return _catalogue()._row(rank, world, case_id)


def test_every_case_is_named_or_computes_what_one_process_computes(run_on_ranks):
    cat = _catalogue()
    rows = cat.run_cases(runner=lambda fn, world, case_id, timeout: run_on_ranks(_row, world, case_id, timeout=timeout))
    assert len(rows) == len(cat.CASES) >= 56
    bad = [f"{case.id}: {cls}: {detail}" for case, cls, detail in rows if cls not in ("named", "correct", "skipped")]
    assert not bad, "\n".join(bad)


def test_the_classifier_tells_the_classes_apart():
    cat = _catalogue()
    case = cat.Case("c", "a case", lambda rank, world: 0.0, "'blocks.0.qkv'", "apply_tp")
    named = ("raised", "ValueError: module 'blocks.0.qkv' ... Call fsdpfn.apply_tp(model, plan)", 0)
    assert cat.classify(case, [named, named])[0] == "named"
    assert cat.classify(case, [named, ("ran", 0.0, 3)]) == (
        "unnamed",
        named[1] + " (only rank(s) [0]) [0 collectives first]",
    )
    no_fix = ("raised", "ValueError: module 'blocks.0.qkv' is wrong", 0)
    assert cat.classify(case, [no_fix, no_fix])[0] == "unnamed"  # the culprit without the fix
    shape = ("raised", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x32 and 64x16)", 0)
    assert cat.classify(case, [shape, shape])[0] == "unnamed"
    assert cat.classify(case, "RankError: rank 1 did not finish within 120 s (hang?)")[0] == "unnamed"
    assert cat.classify(case, [("ran", cat.TOL, 0), ("ran", 0.0, 0)]) == (
        "correct",
        f"max relative error {cat.TOL:.3g}",
    )
    assert cat.classify(case, [("ran", 0.0, 0), ("ran", 2 * cat.TOL, 0)])[0] == "silent"


def test_each_case_names_a_test_that_exists():
    for case in _catalogue().CASES:
        path, name = case.test.split("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert re.search(rf"^def {name}\(", f.read(), re.M), f"{case.id}: {case.test}"
