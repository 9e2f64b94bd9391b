# The two commands of the README. Each installs what it needs first, so they work on a fresh
# machine: `make demo` runs the demo training job, `make test` runs the test suite (the
# documentation's code examples included; `make test-e2e` the rest, the site's build among them,
# hence the docs extra). `make docs` builds the
# documentation site into site/; `make docs-refresh` re-runs the slow commands whose figures the
# documentation quotes and rewrites those figures (see tests/test_docs_figures.py).
PYTHON ?= python3
# torch, installed only when it is missing. From PyPI on Linux `torch==2.13.0` is the CUDA build
# (several GB of CUDA libraries): on a machine without a GPU take PyTorch's CPU index instead,
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (or install torch first, as the README says, and make leaves it alone).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# What each target installs: `make demo` only the demo's plotting and progress bar (DEMO_EXTRAS),
# `make test` everything the suite imports (transformers, mkdocs, mypy and torchft included).
DEMO_EXTRAS ?= demo
EXTRAS ?= test,demo,hf,docs,ft
# The module each extra must make importable: setup re-runs pip when one is missing.
MODULES_base := torch optree safetensors
MODULES_test := pytest hypothesis mypy ruff
MODULES_demo := matplotlib tqdm
MODULES_hf := transformers
MODULES_docs := mkdocs mkdocstrings
MODULES_ft := torchft
MODULES = $(MODULES_base) $(foreach e,$(subst $(comma), ,$(EXTRAS)),$(MODULES_$(e)))
comma := ,
# pip runs only when pyproject.toml, the extras or the interpreter changed since the last setup,
# or fsdpfn (its pytest plugin included) is not installed or a required package is not importable
# (a new virtual environment): otherwise setup costs a fraction of a second instead of pip's ~15 s.
# One stamp per extras set, so `make demo` and `make test` in turn do not re-run pip each time.
STAMP = .setup-stamp-$(subst $(comma),-,$(EXTRAS))
SETUP_KEY = $(PYTHON) -c "import hashlib, sys; print(hashlib.sha256(open('pyproject.toml', 'rb').read() + b'$(EXTRAS)' + sys.prefix.encode()).hexdigest())"
# fsdpfn must import from this checkout (an editable install of another, or a deleted, checkout
# in the same environment does not count), looked up without the current directory on the path.
SETUP_OK = $(PYTHON) -c "import sys; sys.path.pop(0); import importlib.util as u, os; f = u.find_spec('fsdpfn'); sys.exit(f is None or os.path.realpath(os.path.dirname(f.origin or '')) != os.path.realpath('fsdpfn') or any(u.find_spec(m) is None for m in '$(MODULES)'.split()))"

.PHONY: setup demo test test-e2e docs docs-refresh bench gpu-check

setup:
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" || $(PYTHON) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@key=$$($(SETUP_KEY)); \
	if [ "$$(cat $(STAMP) 2>/dev/null)" = "$$key" ] && $(SETUP_OK); then :; else \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]" && echo "$$key" > $(STAMP); fi

# Target-specific: `make demo` sets up (and stamps) only the demo's extras; a later `make test`
# sees another key and installs the rest.
demo: EXTRAS = $(DEMO_EXTRAS)
demo: setup
	$(PYTHON) examples/train_gpt.py

# --durations: the slowest tests of each run, listed at its end, to keep the suite short. The
# formatter and the linter run first (a second each): `ruff format .` fixes what the first reports.
# `make test` is every test that runs in pytest's process and its persistent gloo worker pools;
# `make test-e2e` every test that starts fresh processes (pytest's `e2e` marker: the documented
# commands and example scripts run as written, launches of ranks, exits and signals) and the real
# multi-process fault scenarios (the `faults` marker: ranks killed or stopped, replica groups
# restarted, real timeouts), and the torch.compile tests but one (the `compile` marker: dynamo's
# trace costs 10-15 CPU-seconds per step function per rank). tests/conftest.py fails a test
# outside those markers that starts a process, so the split holds. CI (.ci/run) runs both.
test: setup
	$(PYTHON) -m ruff format --check --quiet .
	$(PYTHON) -m ruff check --quiet .
	$(PYTHON) -m pytest -q --durations=25 -m "not e2e and not faults and not compile"

test-e2e: setup
	$(PYTHON) -m pytest -q --durations=25 -m "e2e or faults or compile"

# --strict: any warning (a broken link or anchor, a docstring mkdocstrings cannot read) fails it.
# NO_MKDOCS_2_WARNING silences mkdocs-material's notice about future MkDocs versions.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# Re-runs every command whose figures the pages mark as measured (<!-- figure: ... measured ... -->)
# and rewrites the figures, plots and dates; `git diff` shows what moved. About 5 min on 2 idle cores.
docs-refresh: setup
	$(PYTHON) tests/test_docs_figures.py --refresh

bench: setup
	$(PYTHON) benchmarks/vs_fsdp2.py
	$(PYTHON) benchmarks/muon.py

# The GPU check (docs/gpu.md): fsdpfn's CUDA path and the simulator's kernel rates on one GPU, in
# under 10 minutes; results under $(OUT) (default gpu-check/). It installs only what is missing
# itself (a bare GPU machine may be offline), so it does not depend on setup. Without CUDA every
# step says "skipped: no CUDA".
OUT ?= gpu-check
gpu-check:
	OUT=$(OUT) PYTHON=$(PYTHON) bash benchmarks/gpu_check.sh
