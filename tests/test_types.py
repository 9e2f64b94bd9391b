"""fsdpfn type-checks with 0 mypy errors, under the checks pyproject.toml's [tool.mypy] sets.

The CUDA-only branches (streams, NCCL, Transformer Engine, pinned host memory) never run on a
CPU test machine, so a misspelt attribute or a wrong call there (``torch.cuda.Streem``,
``stream.wiat_stream(...)``) would pass every other test; mypy reads those branches too
(``check_untyped_defs``: the bodies of unannotated functions included). About a minute the
first time on a busy 2-core machine, 2 s with mypy's cache warm. The cache lives in the user's
cache directory (``$MYPY_CACHE_DIR``, else ``~/.cache/fsdpfn-mypy``), not in the checkout: most of
it is torch's stubs, the same for every checkout, so a fresh clone rechecks only fsdpfn's own
files (mypy compares each file's hash with the cache's, whatever the path or its mtime).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_mypy = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="needs mypy (pip install -e '.[test]')"
)


USER_CODE = """
import fsdpfn
from fsdpfn.models import GPT, GPTConfig

model = GPT(GPTConfig())
units = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=units)
stage = pp.stage_plan(0)
fsdpfn.shard(model, stage)
fsdpfn.runtime.PipelineRuntime(model, pp, "1f1b", 2, loss_fn=lambda out, y: out.mean())
fsdpfn.shard(model, pp)  # line 11: a whole pipelined plan
fsdpfn.runtime.Runtime(model, pp)  # line 12
fsdpfn.runtime.PipelineRuntime(model, stage, "1f1b", 2, loss_fn=lambda out, y: out.mean())  # line 13: a stage's
"""


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory):
    """One mypy run, in this process (mypy.api), over fsdpfn with pyproject.toml's options (as
    ``python -m mypy`` typed at the repo root) and over a user's script (:data:`USER_CODE`):
    ``(errors by file, the report)``."""
    from mypy import api

    user = tmp_path_factory.mktemp("mypy") / "a_users_script.py"
    user.write_text(USER_CODE)
    cache = os.environ.get("MYPY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fsdpfn-mypy"
    )
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        out, err, _ = api.run(["--cache-dir", cache, "fsdpfn", str(user)])
    finally:
        os.chdir(here)
    errors: dict[str, list[str]] = {}
    for line in out.splitlines():
        if ": error:" in line:
            # by name: mypy's cache replays a module's errors under the path it first had
            path = line.split(":", 1)[0]
            errors.setdefault("user" if os.path.basename(path) == user.name else "fsdpfn", []).append(line)
    return errors, out + err


@needs_mypy
def test_fsdpfn_type_checks_with_no_errors(mypy_report):
    errors, report = mypy_report
    assert not errors.get("fsdpfn"), (
        f"mypy found errors (fix the code; a narrow `# type: ignore[code]` only where torch's stubs are wrong):\n{report}"
    )
    assert "Found" in report or "Success" in report, report  # mypy ran to its summary


@needs_mypy
def test_a_type_checker_sees_a_pipelined_plan_handed_to_a_whole_plan_transform(mypy_report):
    """``PipelinedPlan`` is not a ``Plan``: user code that hands one to ``shard`` or ``Runtime``
    (or a stage's ``Plan`` to ``PipelineRuntime``) fails mypy on those lines and no other."""
    errors, report = mypy_report
    user = errors.get("user", [])
    assert sorted(int(line.split(":")[1]) for line in user) == [11, 12, 13], report
    assert all('"PipelinedPlan"' in e and 'expected "Plan"' in e for e in user[:2]), user
    assert 'type "Plan"; expected "PipelinedPlan"' in user[2], user


def test_the_mypy_config_keeps_its_checks():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)["tool"]["mypy"]
    assert config["files"] == ["fsdpfn"]
    assert config["check_untyped_defs"] is True, (
        "the CUDA branches sit in unannotated functions: their bodies must be checked"
    )
    assert config["warn_unused_ignores"] is True
    # What the check is for: a misspelt attribute or a wrong call is an error everywhere.
    assert not config.get("ignore_errors") and not config.get("disable_error_code"), config
    for override in config.get("overrides", []):
        assert set(override) <= {"module", "ignore_missing_imports"}, (
            f"an override may only excuse missing stubs: {override}"
        )
