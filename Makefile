# The two commands of the README. Each installs what it needs first (idempotent), so they work
# on a fresh machine: `make demo` runs the demo training job, `make test` runs the test suite
# (the documentation's build and code examples included, hence the docs extra). `make docs`
# builds the documentation site into site/.
PYTHON ?= python3
# The CPU build of torch. A bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test docs bench

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet "$(TORCH)"
	@$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[test,demo,hf,docs]"

demo: setup
	$(PYTHON) examples/train_gpt.py

test: setup
	$(PYTHON) -m pytest -q

# --strict: any warning (a broken link or anchor, a docstring mkdocstrings cannot read) fails it.
# NO_MKDOCS_2_WARNING silences mkdocs-material's notice about future MkDocs versions.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

bench: setup
	$(PYTHON) benchmarks/vs_fsdp2.py
	$(PYTHON) benchmarks/muon.py
