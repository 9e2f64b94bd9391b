"""Figures the documentation prints from a command stay true.

A figure is a number a page quotes from a command's output: a loss, a search pick, a ratio, a
test count, a time. Each sits below a marker (an HTML comment: invisible on the site, one line in
the Markdown) naming the command and how the figure is kept true::

    <!-- figures: python examples/train_gpt.py | checked by tests/test_docs_figures.py::test_demo_first_logged_loss | measured 2026-11-26 -->

* ``checked by PATH::TEST``: a fast test runs the command (with fewer steps where the figure
  allows: the demo's loss at step 10 needs 10 steps, not 300) and compares the printed figure
  within a tolerance stated in the test;
* ``measured YYYY-MM-DD``: the command takes minutes to hours, so the page says when it ran.
  ``make docs-refresh`` (``python tests/test_docs_figures.py --refresh``) re-runs the commands
  of ``REFRESH`` below and rewrites their figures and dates; it lists the other measured markers,
  with their commands, to re-run by hand.

On the site, ``docs/hooks/figures.py`` shows each marker as a one-line note (the command, the
date, whether a test re-checks it).

The command slot may be ``the table's commands`` when each row of the table below names its own,
or ``the commands of this section`` for a marker under a heading that covers the section's
figures (benchmark pages, where the commands follow the tables).
What needs a marker (``test_every_figure_has_a_marker``): an output block (a fence without a
language) or a table with a decimal number, a ```` ```bash ```` line whose comment quotes a
number, and prose lines that quote a loss, a test count, a duration or a step time. The marker is
the nearest marker line above, within the same section (between two headings) and at most
``REACH`` non-blank lines up.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- figures: (?P<command>[^|]+?) \| (?P<how>.+?) -->$")
CLAUSE = re.compile(r"^(checked by (?P<test>tests/\w+\.py::\w+)|measured (?P<date>\d{4}-\d{2}-\d{2}))$")
REACH = 8  # non-blank lines between a marker and the figure it covers, e.g. "It printed:"
_DECIMAL = re.compile(r"\d\.\d")
_PROSE = re.compile(r"\bloss \d\.\d{3}|\b\d[\d,]* tests\b|\b\d+ min( \d+ s)?\b|\b\d+(\.\d+)? s against\b|\(\+\d\.\d+\)")


# Tables of numbers that no command prints (formulas, definitions), by their header row.
NOT_MEASURED = {"| rule | ratio | reference |"}
SECTION = "the commands of this section"


def pages() -> list[str]:
    found = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in found)


def _read(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read().splitlines()


@dataclasses.dataclass(frozen=True)
class Marker:
    page: str
    line: int  # 1-based
    command: str
    tests: tuple[str, ...]
    date: str | None


def markers(page: str) -> list[Marker]:
    out = []
    for i, line in enumerate(_read(page)):
        m = MARKER.match(line.strip())
        if not m and line.strip().startswith("<!-- figures"):
            raise ValueError(f"{page}:{i + 1}: a figures marker that does not parse: {line!r}")
        if m:
            clauses = [CLAUSE.match(c.strip()) for c in m["how"].split("|")]
            bad = [c for c, ok in zip(m["how"].split("|"), clauses) if not ok]
            if bad:
                raise ValueError(
                    f"{page}:{i + 1}: unknown clause(s) {bad}: 'checked by tests/x.py::test' or 'measured YYYY-MM-DD'"
                )
            out.append(
                Marker(
                    page,
                    i + 1,
                    m["command"].strip(),
                    tuple(c["test"] for c in clauses if c["test"]),
                    next((c["date"] for c in clauses if c["date"]), None),
                )
            )
    return out


def figure_spots(page: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every figure on the page that needs a marker (1-based line of its start)."""
    lines, spots, i = _read(page), [], 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```(\w*)", line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), len(lines))
            body = lines[i + 1 : end]
            if fence[1] in ("", "text") and any(_DECIMAL.search(b) for b in body):
                spots.append((i + 1, "an output block"))
            if fence[1] == "bash" and any(
                "#" in b and re.search(r"\d\.\d\d|\b\d+ (min|s)\b", b.split("#", 1)[1]) for b in body
            ):
                spots.append((i + 1, "a command whose comment quotes a figure"))
            i = end + 1
            continue
        if line.startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            if any(_DECIMAL.search(b) for b in lines[i:end]) and line not in NOT_MEASURED:
                spots.append((i + 1, "a table"))
            i = end
            continue
        if _PROSE.search(line) and not line.startswith("<!--"):
            spots.append((i + 1, f"prose: {_PROSE.search(line)[0]!r}"))
        i += 1
    return spots


def _headings(lines: list[str]) -> set[int]:
    """1-based lines of the Markdown headings (``#`` lines outside fences)."""
    out, fenced = set(), False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(i + 1)
    return out


def marker_for(page: str, line: int) -> Marker | None:
    """The marker covering the figure at ``line``: the nearest one above it within REACH non-blank
    lines, or one for the whole section (command slot: "the commands of this section")."""
    lines = _read(page)
    by_line = {m.line: m for m in markers(page)}
    headings = _headings(lines)
    seen = 0
    for j in range(line - 1, 0, -1):
        if j in headings:
            return None
        m = by_line.get(j)
        if m and (seen <= REACH or m.command == SECTION):
            return m
        if lines[j - 1].strip():
            seen += 1
    return None


# ---- the checks ------------------------------------------------------------------------------


def test_the_detector_sees_the_known_figures():
    # Guards the detector: if it stopped finding figures, every page would pass vacuously.
    spots = {p: [w for _, w in figure_spots(p)] for p in pages()}
    assert "an output block" in spots["docs/getting-started.md"], spots["docs/getting-started.md"]
    assert "a table" in spots["docs/benchmarks.md"]
    assert any(w.startswith("prose") for w in spots["docs/tour/fp8.md"]), spots["docs/tour/fp8.md"]
    assert "a command whose comment quotes a figure" in spots["README.md"], spots["README.md"]


@pytest.mark.parametrize("page", pages())
def test_every_figure_has_a_marker(page):
    missing = [f"{page}:{line}: {what}" for line, what in figure_spots(page) if marker_for(page, line) is None]
    assert not missing, (
        "figures without a '<!-- figures: COMMAND | checked by ... / measured DATE -->' line above "
        "them (see tests/test_docs_figures.py):\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("page", pages())
def test_markers_name_a_test_that_exists_or_a_date(page):
    today = datetime.date.today()
    for m in markers(page):
        assert m.tests or m.date, (
            f"{page}:{m.line}: a marker says how its figures stay true: checked by a test, or measured on a date"
        )
        if m.date:
            assert datetime.date.fromisoformat(m.date) <= today, f"{page}:{m.line}: measured in the future ({m.date})"
        for test in m.tests:
            path, name = test.split("::")
            assert os.path.exists(os.path.join(ROOT, path)), f"{page}:{m.line}: {path} does not exist"
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert re.search(rf"^def {name}\(", f.read(), re.M), f"{page}:{m.line}: {test} does not exist"
        if m.command not in ("the table's commands", SECTION):
            assert re.match(r"(OMP_NUM_THREADS=\d+ )?(python|torchrun|make) ", m.command), (
                f"{page}:{m.line}: {m.command!r}"
            )


def test_sim_outputs_start_with_their_command():
    # docs/sim/*.txt are outputs quoted whole; the first line says what printed them.
    for path in glob.glob(os.path.join(ROOT, "docs", "sim", "*.txt")):
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        assert re.match(r"\$ (OMP_NUM_THREADS=\d+ )?python (benchmarks|examples)/\w+\.py", first), f"{path}: {first!r}"


def _run(args: list[str], cwd, timeout=600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, args[0])  # the repository's, wherever the command runs
    proc = subprocess.run(
        [sys.executable, script, *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _quoted(page: str, pattern: str) -> re.Match:
    m = re.search(pattern, "\n".join(_read(page)), re.M)
    assert m, f"{page} no longer quotes /{pattern}/: update the check with the page"
    return m


# Tolerance of the loss checks. The runs are deterministic on one machine (two demo runs print
# the same losses); other CPU kernels (ATEN_CPU_CAPABILITY) round fp32 differently by ~1e-6,
# which 10 optimizer steps grow to ~1e-4 in the loss. The pages print 3-4 decimals; 2e-3 is
# twenty times that drift and far below what a changed model, schedule or data order moves (the
# first steps' losses move by 0.01-0.1).
LOSS_TOL = 2e-3


@pytest.mark.e2e
def test_demo_first_logged_loss(tmp_path):
    # The demo's step-10 loss needs 10 steps, with the 300-step run's learning-rate schedule.
    out = _run(
        [
            "examples/train_gpt.py",
            "--steps",
            "10",
            "--schedule-steps",
            "300",
            "--no-progress",
            "--sample-chars",
            "0",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
    )
    m = re.search(r"^step 10/10 loss (\d\.\d+)", out, re.M)
    assert m, out
    # --sample-chars 0: no sample, so no empty sample frame either.
    assert "--- sample" not in out and not (tmp_path / "run" / "sample.txt").exists(), out
    page = "docs/getting-started.md"
    quoted = _quoted(page, r"^step 10/300 loss (\d\.\d+)")
    first = _quoted(page, r"^loss (\d\.\d+) \(first logged\)")
    assert abs(float(quoted[1]) - float(m[1])) < LOSS_TOL and quoted[1] == first[1], (quoted[0], first[0], m[0])


@pytest.mark.e2e
def test_your_model_first_losses(tmp_path):
    # The walk-through's first two logged losses need 11 of its 60 steps (constant learning rate).
    out = _run(["examples/your_model.py", "--steps", "11", "--out", str(tmp_path / "run")], cwd=tmp_path)
    page = "docs/tour/your-model.md"
    for step in (0, 10):
        printed = re.search(rf"^step +{step}  loss (\d\.\d+)", out, re.M)
        quoted = _quoted(page, rf"^step +{step}  loss (\d\.\d+)")
        assert printed and abs(float(printed[1]) - float(quoted[1])) < LOSS_TOL, (step, quoted[0], out)


# ---- make docs-refresh -----------------------------------------------------------------------


def _replace(page: str, pattern: str, new: str, count: int = 1) -> None:
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text, n = re.subn(pattern, new, text, count=count, flags=re.M | re.S)
    if n == 0:
        raise SystemExit(f"{page}: /{pattern}/ not found; update REFRESH with the page")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _redate(page: str, command: str, date: str) -> None:
    _replace(
        page, rf"^(<!-- figures: {re.escape(command)} \|.*?measured )\d{{4}}-\d{{2}}-\d{{2}}", rf"\g<1>{date}", count=0
    )


def _metrics(run: str) -> dict[int, dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def demo_output_block(out: str) -> str:
    """The demo's output as getting-started.md shows it: the header, steps 10, 100 and 300, the end."""
    lines = out.rstrip("\n").splitlines()
    keep = [lines[0]]
    for step in (10, 100, 300):
        keep += [line for line in lines if line.startswith(f"step {step}/")]
        keep += ["..."] if step != 300 else []
    start = next(i for i, line in enumerate(lines) if line.startswith("--- sample"))
    return "\n".join(keep + [""] + lines[start:])


# What docs-refresh rewrites, page by page (test_refresh_patterns_match_the_pages keeps them matching).
DEMO_BLOCK = r"(\$ python examples/train_gpt.py --no-progress\n).*?(?=\n```)"
DEMO_TIME = r"The run above took \d+ s"
FP8_SENTENCE = r"loss \d\.\d{4} vs \d\.\d{4} at step 100 .*?validation \d\.\d{3} vs \d\.\d{3}\."
SEARCH_SENTENCE = r"\d+\.\d+ s against the default's\s+\d+\.\d+ s"
PATTERNS = [
    ("docs/getting-started.md", DEMO_BLOCK),
    ("docs/getting-started.md", DEMO_TIME),
    ("docs/tour/fp8.md", FP8_SENTENCE),
    ("docs/simulator.md", SEARCH_SENTENCE),
]


def refresh_demo(date: str, work: str) -> None:
    plain, fp8 = os.path.join(work, "gpt"), os.path.join(work, "fp8")
    out = _run(["examples/train_gpt.py", "--no-progress", "--out", "runs/gpt"], cwd=work, timeout=7200)
    os.rename(os.path.join(work, "runs", "gpt"), plain)
    _run(["examples/train_gpt.py", "--no-progress", "--fp8", "--out", "runs/fp8"], cwd=work, timeout=7200)
    os.rename(os.path.join(work, "runs", "fp8"), fp8)
    block = demo_output_block(out).replace("\\", "\\\\")
    _replace("docs/getting-started.md", DEMO_BLOCK, rf"\g<1>{block}")
    wall = re.search(r"^steps 0->300 of 300 in (\d+) s", out, re.M)[1]
    _replace("docs/getting-started.md", DEMO_TIME, f"The run above took {wall} s")
    _redate("docs/getting-started.md", "python examples/train_gpt.py", date)
    a, b = _metrics(plain), _metrics(fp8)
    val = [next(r["val_loss"] for r in sorted(m.values(), key=lambda r: -r["step"]) if "val_loss" in r) for m in (b, a)]
    text = (
        f"loss {b[100]['loss']:.4f} vs {a[100]['loss']:.4f} at step 100 ({b[100]['loss'] - a[100]['loss']:+.4f}) and "
        f"{b[300]['loss']:.4f} vs {a[300]['loss']:.4f}\nat step 300 ({b[300]['loss'] - a[300]['loss']:+.4f}); "
        f"validation {val[0]:.3f} vs {val[1]:.3f}."
    )
    _replace("docs/tour/fp8.md", FP8_SENTENCE, text)
    _redate("docs/tour/fp8.md", "python examples/train_gpt.py --fp8", date)
    # The two plots of these runs: the demo's loss curve, and both runs' (benchmarks/fp8_gather.py draws it).
    shutil.copyfile(os.path.join(plain, "loss.png"), os.path.join(ROOT, "docs", "loss.png"))
    _run(["benchmarks/fp8_gather.py", "--parts", "loss", "--runs", plain, fp8], cwd=ROOT)


def refresh_search(date: str, work: str) -> None:
    command = ["examples/plan_search.py", "--plot", "docs/sim/search_pick_8b_64.png"]
    out = _run(command, cwd=ROOT, timeout=7200)
    with open(os.path.join(ROOT, "docs", "sim", "search_example.txt"), "w", encoding="utf-8") as f:
        f.write("$ python " + " ".join(command) + "\n" + out)
    pick = float(re.search(r"^pick: .*step ([\d,.]+) ms", out, re.M)[1].replace(",", "")) / 1000
    default = float(re.search(r"^default: .*step ([\d,.]+) ms", out, re.M)[1].replace(",", "")) / 1000
    _replace("docs/simulator.md", SEARCH_SENTENCE, f"{pick:.2f} s against the default's {default:.2f} s")
    _redate("docs/simulator.md", "python examples/plan_search.py", date)


# The measured figures this script re-runs and rewrites: (page, command of its marker) -> how.
REFRESH = {
    ("docs/getting-started.md", "python examples/train_gpt.py"): refresh_demo,
    ("docs/tour/fp8.md", "python examples/train_gpt.py --fp8"): refresh_demo,
    ("docs/simulator.md", "python examples/plan_search.py"): refresh_search,
}


def test_refresh_patterns_match_the_pages():
    for page, pattern in PATTERNS:
        assert re.search(pattern, "\n".join(_read(page)), re.M | re.S), (
            f"{page}: docs-refresh could not find /{pattern}/"
        )


def test_refresh_covers_markers_that_exist():
    for page, command in REFRESH:
        assert any(m.command == command for m in markers(page)), (page, command)


def test_demo_output_block_keeps_the_pages_lines():
    out = "\n".join(
        [
            "GPT 0.82M parameters",
            *[f"step {s}/300 loss 1.0" for s in range(10, 310, 10)],
            "",
            "--- sample ---",
            "Once",
            "-----",
            "steps 0->300 of 300 in 9 s",
            "loss 4.0 (first logged)",
        ]
    )
    assert demo_output_block(out) == "\n".join(
        [
            "GPT 0.82M parameters",
            "step 10/300 loss 1.0",
            "...",
            "step 100/300 loss 1.0",
            "...",
            "step 300/300 loss 1.0",
            "",
            "--- sample ---",
            "Once",
            "-----",
            "steps 0->300 of 300 in 9 s",
            "loss 4.0 (first logged)",
        ]
    )


def refresh() -> None:
    date = datetime.date.today().isoformat()
    done = set()
    with tempfile.TemporaryDirectory(prefix="docs_refresh_") as work:
        for (page, command), fn in REFRESH.items():
            if fn not in done:
                print(f"re-running for {page}: {command} ...", flush=True)
                fn(date, work)
                done.add(fn)
    by_hand = [m for p in pages() for m in markers(p) if m.date and (m.page, m.command) not in REFRESH]
    print("\nmeasured figures to re-run by hand (then edit the figures and the marker's date):")
    for m in by_hand:
        print(f"  {m.page}:{m.line}  {m.command}  (measured {m.date})")


if __name__ == "__main__":
    if sys.argv[1:] != ["--refresh"]:
        raise SystemExit("usage: python tests/test_docs_figures.py --refresh   (make docs-refresh)")
    os.chdir(ROOT)
    refresh()
