"""Every Python file of the repository compiles with warnings as errors.

The examples and the documented commands run in subprocesses with ``PYTHONWARNINGS=error``, where
a compile-time warning (an invalid escape sequence in a docstring, say) stops the import; in
this process the file may already be compiled to bytecode and the warning never shows.
"""

import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = subprocess.run(
    ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=False
).stdout.split()


@pytest.mark.skipif(not FILES, reason="not a git checkout: the file list comes from git ls-files")
def test_every_python_file_compiles_without_warnings():
    problems = []
    for name in FILES:
        source = (ROOT / name).read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(source, name, "exec")
            except (SyntaxError, SyntaxWarning) as e:
                problems.append(f"{name}: {e}")
    assert not problems, "\n".join(problems)
