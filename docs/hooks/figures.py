"""A MkDocs hook that shows each figures marker on the site as a one-line note.

The pages mark the figures they quote from a command with an HTML comment (see
``tests/test_docs_figures.py``)::

    <!-- figures: python examples/train_gpt.py | checked by tests/test_docs_figures.py::test_demo_first_logged_loss | measured 2026-11-26 -->

In the Markdown the comment stays out of the way; on the site the reader sees when and how the
figures below it were measured: *Figures below: `python examples/train_gpt.py`, measured
2026-11-26; re-checked by the test suite.*
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"^<!-- figures: (?P<command>[^|]+?) \| (?P<how>.+?) -->$", re.M)


def _note(m: re.Match) -> str:
    command = m["command"].strip()
    clauses = [c.strip() for c in m["how"].split("|")]
    date = next((c.split()[1] for c in clauses if c.startswith("measured ")), None)
    checked = any(c.startswith("checked by ") for c in clauses)
    if command == "the commands of this section":
        what = "Figures in this section: from the commands shown"
    elif command == "the table's commands":
        what = "Figures below: from the commands in the table"
    else:
        what = f"Figures below: `{command}`"
    parts = [what] + ([f"measured {date}"] if date else []) + (["re-checked by the test suite"] if checked else [])
    return f"*{', '.join(parts[:2])}{'; ' + parts[2] if len(parts) > 2 else ''}.*\n"


def on_page_markdown(markdown: str, **kwargs) -> str:
    """Replaces each marker line by its note (a paragraph of its own: a blank line follows)."""
    return _MARKER.sub(lambda m: _note(m) + "\n", markdown)
