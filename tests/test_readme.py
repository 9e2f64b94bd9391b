"""The README's example is examples/quickstart.py, word for word, and it runs as the README says.

The README shows the whole file so that a reader can copy it; this test keeps the two identical
and runs the file the way a user does (``python examples/quickstart.py``: it starts its own 2
gloo ranks). Its links into ``docs/`` and the make targets it names must exist too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_readme_example_is_examples_quickstart_py():
    blocks = _python_blocks(_readme())
    assert len(blocks) == 1, f"the README has {len(blocks)} python blocks; its one example is examples/quickstart.py"
    with open(QUICKSTART, encoding="utf-8") as f:
        assert blocks[0] == f.read(), (
            "README.md's example and examples/quickstart.py differ: copy the file into the README"
        )


@pytest.mark.e2e
def test_quickstart_runs_and_the_loss_falls():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, QUICKSTART], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"^loss (\d+\.\d+) -> (\d+\.\d+) in 20 steps$", proc.stdout, re.M)
    assert m, proc.stdout
    first, last = float(m[1]), float(m[2])
    # The script asserts last < first / 2 itself; the README quotes this run's figures.
    assert last < first / 2
    # The README quotes this output. Other CPU kernels (ATEN_CPU_CAPABILITY) round differently:
    # fp32 differences of ~1e-6 that 20 AdamW steps can grow to ~1e-4 in the loss, far below the
    # 0.01 allowed here; a changed example moves the figures by far more than that.
    quoted = re.search(r"prints: loss (\d+\.\d+) -> (\d+\.\d+) in 20 steps", _readme())
    assert quoted, "the README no longer quotes the example's output"
    assert abs(float(quoted[1]) - first) < 0.01 and abs(float(quoted[2]) - last) < 0.01, (
        f"the README quotes loss {quoted[1]} -> {quoted[2]}, the example prints {m[1]} -> {m[2]}: update the README"
    )


def test_links_and_make_targets_exist():
    text = _readme()
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, target)), f"README.md links to {target}, which does not exist"
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    for target in set(re.findall(r"`make (\w+)`|^make (\w+)", text, re.M)):
        name = target[0] or target[1]
        assert re.search(rf"^{name}:", makefile, re.M), f"README.md names `make {name}`, which the Makefile lacks"


# ---- the README's shape: read in five minutes, the rest in docs/ --------------------------------

MAX_LINES = 200


def test_the_readme_fits_in_200_lines():
    n = len(_readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move the detail to a docs page and link it"


def _bash_blocks(text: str) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"^```bash\n(.*?)^```$", text, re.S | re.M)]


def test_the_command_block_installs_the_cpu_torch_before_make():
    # Copying the block as written on a machine without a GPU must not fetch PyPI's CUDA torch:
    # `make` installs torch only when it is missing, so the CPU build's line comes first.
    with open(os.path.join(ROOT, "docs", "getting-started.md"), encoding="utf-8") as f:
        started = f.read()
    for text, page in ((_readme(), "README.md"), (started, "docs/getting-started.md")):
        block = next((b for b in _bash_blocks(text) if any(line.startswith("make demo") for line in b)), None)
        assert block, f"{page}: no bash block runs `make demo`"
        cpu = [
            i
            for i, line in enumerate(block)
            if re.match(r"pip install torch==\S+ --index-url https://download\.pytorch\.org/whl/cpu", line)
        ]
        first_make = next(i for i, line in enumerate(block) if line.startswith("make "))
        assert cpu and cpu[0] < first_make, (
            f"{page}: the `make demo` block installs the CPU torch first:\n" + "\n".join(block)
        )
        with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
            pinned = re.search(r"^TORCH \?= (torch==\S+)", f.read(), re.M)[1]
        assert block[cpu[0]].split()[2] == pinned, (
            f"{page}: the CPU line installs {block[cpu[0]].split()[2]}, the Makefile {pinned}"
        )


def test_make_demo_installs_the_demo_extra_only():
    # `make demo` needs matplotlib and tqdm, not transformers, mkdocs, mypy or torchft.
    proc = subprocess.run(["make", "-n", "demo", "PYTHON=python"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    installs = re.findall(r'pip install [^;]*-e "\.\[([\w,]*)\]"', proc.stdout)
    assert installs == ["demo"], proc.stdout
    assert "'torch optree safetensors matplotlib tqdm'" in proc.stdout, proc.stdout
    test = subprocess.run(["make", "-n", "test", "PYTHON=python"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert re.findall(r'pip install [^;]*-e "\.\[([\w,]*)\]"', test.stdout) == ["test,demo,hf,docs,ft"], test.stdout


def test_every_capability_row_links_to_its_page():
    rows = [line for line in _readme().splitlines() if line.startswith("| ") and not line.startswith("| capability")]
    assert len(rows) >= 10, rows
    for row in rows:
        assert re.search(r"\]\((docs/[^)]+\.md)(#[\w-]+)?\)", row), f"a capability without a link to its page: {row}"


def test_the_suite_time_has_its_place():
    # The paragraph below this line gives `make test`'s time and slowest tests.
    assert "\n<!-- suite-time -->\n" in _readme()


_HEADLINES = [  # (the README's bold figure, the row of docs/benchmarks.md's table that holds it)
    ("0.91x", "step time, fsdpfn runtime / torch FSDP2, zero3 fp32"),
    ("0.70x", "Muon optimizer step, fsdpfn / `torch.optim.Muon` on FSDP2"),
    ("0.085x", "training stall per save, `async_save` / `save`"),
    ("0 / 0", "mistakes on tp, ep, cp, pp, remat, Muon and compile"),
    ("0 jobs lost", "the demo with `--ft`"),
    ("50 of 52", "simulator, predicted / published throughput"),
]


def test_the_headline_figures_are_the_benchmarks_pages():
    # The README quotes six figures of the full table (docs/benchmarks.md): the same numbers.
    text = _readme()
    bold = re.findall(r"\*\*([^*]+)\*\*", text.split("## Six figures", 1)[1].split("\n## ", 1)[0])
    assert [b.split(" within")[0] for b in bold] == [f for f, _ in _HEADLINES], bold
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        table = f.read()
    for figure, row in _HEADLINES:
        line = next((line for line in table.splitlines() if line.startswith(f"| {row}")), None)
        assert line, f"docs/benchmarks.md lost the row {row!r}"
        assert figure in line, f"README.md quotes {figure} for {row!r}; docs/benchmarks.md: {line}"
