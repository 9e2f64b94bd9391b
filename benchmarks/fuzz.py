"""The differential check, fuzzed at length: draws small models and plans with hypothesis (the
strategy of tests/_fuzz.py: fused and separate q/k/v, every cut of a fused output, layers called
through ``__call__``, ``.forward`` or ``F.linear``, tied weights, MoE layers with some or all
expert weights listed, attention with and without the cp call; meshes of up to 4 gloo ranks
with dp, tp, ep and cp, remat, zero2/zero3), runs each on its ranks and counts the outcomes:

  refused by name     a ValueError of fsdpfn.plan / fsdpfn.shard, or fsdpfn.VerificationError
  passed and correct  the check passed and the gradients are one process's within the bound
  silent wrong        the check passed and the gradients are not (a bug of the check)
  false alarms        the check refused, and the step run anyway gives one process's gradients
  unnamed errors      any other exception, ranks that disagree, or a rank that never answered

(see [Note: the fuzzer's oracle] in tests/_fuzz.py). Each silent or unnamed example is printed
with its description, to be replayed with ``--replay``.

Usage:
  python benchmarks/fuzz.py --examples 40            # minutes: most examples take a second, a hung one --timeout
  python benchmarks/fuzz.py --examples 10 --seed 3 --timeout 60
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "tests")):  # the suite's fuzzer is reused, not copied
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _fuzz  # noqa: E402
from fsdpfn.testing import run_on_ranks, shutdown_pools  # noqa: E402

LABELS = {
    "refused": "refused by name",
    "correct": "passed and correct",
    "silent": "silent wrong",
    "false_alarm": "false alarms",
    "unnamed": "unnamed errors",
}


def main(argv=None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (the examples drawn)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before an example's ranks count as hung")
    ap.add_argument("--replay", default=None, help="one example's description (a dict as printed) to run alone")
    args = ap.parse_args(argv)
    from hypothesis import HealthCheck, Phase, given, seed, settings

    drawn: list[dict] = []
    if args.replay:
        drawn.append(ast.literal_eval(args.replay))
    else:

        @seed(args.seed)
        @settings(
            max_examples=args.examples,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(d=_fuzz.describe())
        def collect(d):
            drawn.append(d)

        collect()
    counts: collections.Counter = collections.Counter()
    start = time.time()
    try:
        for i, d in enumerate(drawn):
            t = time.time()
            outcome, detail = _fuzz.run(run_on_ranks, d, timeout=args.timeout)
            counts[outcome] += 1
            print(
                f"[{i + 1}/{len(drawn)}] {outcome:<8} {time.time() - t:5.1f} s  {d['mesh']:<8} {detail.splitlines()[0][:110]}",
                flush=True,
            )
            if outcome in ("silent", "false_alarm", "unnamed"):
                print(
                    f"    example: {d}\n    detail: {detail if len(detail) < 2500 else detail[:800] + ' ... ' + detail[-1500:]}",
                    flush=True,
                )
    finally:
        shutdown_pools()
    print()
    print(f"$ python benchmarks/fuzz.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{len(drawn)} examples in {time.time() - start:.0f} s")
    for k, label in LABELS.items():
        print(f"  {label:<20} {counts[k]}")
    return dict(counts)


if __name__ == "__main__":
    main()
