#!/usr/bin/env bash
# The GPU check (see benchmarks/gpu_check.py and docs/gpu.md): runs fsdpfn's CUDA path on one GPU
# and measures the simulator's compute model there, in under 10 minutes, each step under its own
# time limit. Results: summary.json, summary.md, log.txt (and the demo's metrics) under $OUT.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh --steps demo,sim_kernels   # some steps only
#
# Without CUDA every step says "skipped: no CUDA" and nothing is installed (a dry run).
set -u
cd "$(dirname "$0")/.."
if [ -z "${OUT:-}" ]; then
  echo "gpu_check.sh: set OUT to the directory the results go to, e.g. OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh" >&2
  exit 2
fi
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if [ -z "$PYTHON" ]; then
  echo "gpu_check.sh: no python3 or python on PATH; set PYTHON=/path/to/python" >&2
  exit 2
fi
mkdir -p "$OUT"
# The whole check stays under 10 minutes: the steps' own limits add up to its budget (540 s),
# and this outer limit catches the orchestrator itself should it hang.
exec timeout -k 10 590 "$PYTHON" benchmarks/gpu_check.py --out "$OUT" "$@"
