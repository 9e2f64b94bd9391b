"""The documentation site: it builds without a warning, and its code runs.

The site is ``mkdocs.yml`` + ``docs/`` (mkdocs-material, mkdocstrings for the API reference).
``mkdocs build --strict`` turns every warning into a failure (broken links and anchors included,
see ``validation`` in ``mkdocs.yml``); we also fail on any ``WARNING`` line it prints.

Code blocks of the pages are checked by what they are:

  =================================  ============================================================
  a ```` ```pycon ```` block         a doctest (``>>>`` lines and the output they print); the
                                     blocks of one page run in order in one namespace, in one
                                     process with a 1-rank process group
  ``<!-- test: run -->``             (the line above a ```` ```python ```` block) runs it in one
                                     process with a 1-rank process group
  ``<!-- test: ranks=N -->``         runs it on N gloo ranks (``fsdpfn.testing.run_on_ranks``);
                                     the code sees ``rank`` and ``world_size``, and all ranks
                                     share a fresh working directory
  ``<!-- test: pytest -->``          a complete test file: written out under the name its first
                                     line gives (``# test_x.py``) and run with pytest
  any other ```` ```python ````      must compile: sketches that use names from their page
                                     (``model``, ``plan``, ...) are not run
  ``--8<-- "path"``                  a repository file shown in the page; the build fails if it
                                     is missing, and the file has its own test
  =================================  ============================================================

Every marked block must contain an ``assert`` (or, for pytest files, a test): a block that runs
but checks nothing would pass whatever the library does. To add a page, write it under
``docs/`` (a Tour topic: ``docs/tour/<topic>.md``), list it in ``mkdocs.yml``'s ``nav``, and mark
the blocks that should run.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PUBLIC_MODULES = [
    "fsdpfn",
    "fsdpfn.optim",
    "fsdpfn.runtime",
    "fsdpfn.checkpoint",
    "fsdpfn.comm",
    "fsdpfn.fp8",
    "fsdpfn.sim",
    "fsdpfn.testing",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(r"^<!--\s*test:\s*(?P<kind>run|pytest|ranks=(?P<n>\d+))\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int  # of the opening fence, 1-based
    lang: str
    mark: str | None  # "run", "ranks=N", "pytest" or None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def where(self) -> str:
        return f"docs/{self.page}, the block at line {self.line}"


def _pages() -> list[str]:
    out = []
    for folder, _, files in os.walk(DOCS):
        out += [os.path.relpath(os.path.join(folder, f), DOCS) for f in files if f.endswith(".md")]
    return sorted(out)


def _blocks(page: str) -> list[Block]:
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m["lang"]
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev)
        blocks.append(
            Block(page, start + 1, lang, mark["kind"] if mark else None, "\n".join(lines[start + 1 : end]) + "\n")
        )
        i = end + 1
    return blocks


BLOCKS = [b for page in _pages() for b in _blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python" and not b.code.lstrip().startswith("--8<--")]
MARKED = [b for b in PYTHON if b.mark]
PYCON_PAGES = sorted({b.page for b in BLOCKS if b.lang == "pycon"})


# ---- the build -----------------------------------------------------------------------------


def _mkdocs_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:
            return module
    return None


def _links_that_are_not_files(site) -> list[str]:
    """``"page.html -> href"`` for each relative link of the built site that is not a file there.

    404.html is left out: a web server serves it for any path, so its links are absolute.
    """
    bad = []
    for page in sorted(site.rglob("*.html")):
        rel = page.relative_to(site)
        if str(rel) == "404.html" or rel.parts[0] == "assets":
            continue
        for href in re.findall(r'href="([^"#?]*)[^"]*"', page.read_text(encoding="utf-8")):
            if href and "://" not in href and not href.startswith(("mailto:", "data:")):
                if not (page.parent / href).resolve().is_file():
                    bad.append(f"{rel} -> {href}")
    return bad


def test_links_that_are_not_files_sees_a_directory_link(tmp_path):
    # Guards the check above: a link to a directory (what use_directory_urls writes) is reported.
    (tmp_path / "tour").mkdir()
    (tmp_path / "tour" / "index.html").write_text("")
    (tmp_path / "index.html").write_text('<a href="tour/">tour</a> <a href="tour/index.html#x">ok</a>')
    assert _links_that_are_not_files(tmp_path) == ["index.html -> tour/"]


@pytest.mark.e2e
def test_site_builds_strict_without_warnings(tmp_path):
    missing = _mkdocs_missing()
    if missing:
        pytest.skip(f"{missing} is not installed: pip install -e '.[docs]' (make test installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert proc.returncode == 0 and not warnings, log[-6000:]
    site = tmp_path / "site"
    for page in ["index.html", "tour/plans.html", "design.html", "api/fsdpfn.runtime.html"]:
        assert (site / page).is_file(), page
    # The site opens from disk (file://, no web server): each link between pages names a file.
    # A link to a directory (mkdocs' default, use_directory_urls) shows the folder's listing there.
    assert _links_that_are_not_files(site) == [], "mkdocs.yml: use_directory_urls must stay false"
    # The API reference rendered the docstrings, examples included (as code, not prose).
    api = (site / "api" / "fsdpfn.runtime.html").read_text()
    assert (
        "Runs a model&#39;s training steps under a plan" in api or "Runs a model's training steps under a plan" in api
    )
    assert "value_and_grad" in api and '<span class="gp">&gt;&gt;&gt; </span>' in api  # a highlighted >>> prompt


def test_every_public_module_has_an_api_page_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    for module in PUBLIC_MODULES:
        path = os.path.join(DOCS, "api", f"{module}.md")
        with open(path, encoding="utf-8") as f:
            assert f"::: {module}\n" in f.read(), path
        assert f"api/{module}.md" in config, f"mkdocs.yml's nav lacks api/{module}.md"


# ---- the code blocks -----------------------------------------------------------------------


def test_the_pages_have_runnable_code():
    # Guards the parser: if the markers stopped matching, every block would silently be "compile only".
    kinds = {b.mark.split("=")[0] for b in MARKED}
    assert {"run", "ranks", "pytest"} <= kinds, kinds
    assert {"tour/plans.md", "tour/runtime.md"} <= set(PYCON_PAGES), PYCON_PAGES


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_blocks_compile(block):
    try:
        compile(block.code, block.where, "exec")
    except SyntaxError as e:
        pytest.fail(f"{block.where} is not valid Python: {e}")


def _exec_block(rank: int, world_size: int, code: str, where: str, workdir: str) -> None:
    """Runs a page's block on this rank, in ``workdir`` (shared by the ranks)."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__docs__", "rank": rank, "world_size": world_size})
    finally:
        os.chdir(cwd)


def _run_pycon(rank: int, world_size: int, page: str, workdir: str) -> tuple[int, str]:
    """Runs a page's ``pycon`` blocks as one doctest; ``(examples run, failure report)``."""
    text = "\n".join(b.code for b in _blocks(page) if b.lang == "pycon")
    test = doctest.DocTestParser().get_doctest(text, {"__name__": "__docs__"}, page, os.path.join(DOCS, page), 0)
    report: list[str] = []
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        doctest.DocTestRunner(optionflags=FLAGS).run(test, out=report.append, clear_globs=True)
    finally:
        os.chdir(cwd)
    return len(test.examples), "".join(report)


# A `pytest` block runs pytest in a fresh process (see conftest.py: `make test-e2e`).
@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id, marks=[pytest.mark.e2e] if b.mark == "pytest" else []) for b in MARKED]
)
def test_marked_blocks_run(run_on_ranks, tmp_path, block):
    if block.mark == "pytest":
        first = block.code.splitlines()[0]
        name = re.fullmatch(r"#\s*(test_\w+\.py)\s*", first)
        assert name, f"{block.where}: a pytest block starts with '# test_<name>.py', got {first!r}"
        (tmp_path / name[1]).write_text(block.code)
        env = {**os.environ, "PYTHONPATH": ROOT, "FSDPFN_WORKER_WARNINGS": "error"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider", name[1]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and " passed" in proc.stdout, (
            f"{block.where}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
        )
        return
    assert re.search(r"^\s*assert\b|assert_close\(", block.code, re.M), (
        f"{block.where} runs but checks nothing: add an assert"
    )
    world = 1 if block.mark == "run" else int(block.mark.split("=")[1])
    run_on_ranks(_exec_block, world, block.code, block.where, str(tmp_path))


@pytest.mark.parametrize("page", PYCON_PAGES)
def test_pycon_blocks_are_doctests(run_on_ranks, tmp_path, page):
    [(examples, report)] = run_on_ranks(_run_pycon, 1, page, str(tmp_path))
    assert examples > 0
    assert not report, (
        f"docs/{page}: the printed output differs from what the code prints now (update the page):\n{report}"
    )


# ---- what the pages point at ---------------------------------------------------------------

_REPO_PATH = re.compile(r"(?<![\w/.-])((?:examples|benchmarks|tests|docs)/[\w./*-]+\.(?:py|txt|png|md))")
_NOT_OURS = re.compile(r"BENCHMARKS\.md|DESIGN\.md|\.\./shared|the issue's|\bour machines?\b")


@pytest.mark.parametrize("path", [os.path.join("docs", p) for p in _pages()] + ["README.md"])
def test_pages_point_only_at_files_in_the_repository(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    bad = _NOT_OURS.findall(text)
    assert not bad, f"{path} mentions {bad}: user-facing text never points outside the repository"
    missing = []
    for ref in set(_REPO_PATH.findall(text)):
        if "*" in ref:
            import glob

            found = glob.glob(os.path.join(ROOT, ref))
        else:
            found = os.path.exists(os.path.join(ROOT, ref))
        if not found:
            missing.append(ref)
    assert not missing, f"{path} names files that do not exist: {sorted(missing)}"
