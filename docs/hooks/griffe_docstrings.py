"""A griffe extension that lets fsdpfn's docstrings render well in the API reference.

fsdpfn's docstrings are Google style with two habits Markdown does not know:

* an ``Example:`` (or ``Example (what it shows):``) header above ``>>>`` lines. griffe reads only
  ``Examples:`` as an examples section; any other word becomes an admonition whose ``>>>`` lines
  would render as prose. We rename the header (keeping the parenthesis as the first line of the
  section) so the examples render as Python console blocks.
* Sphinx roles (``:func:`fsdpfn.comm.timeout```). We render them as inline code.

The source files are not changed: this runs on the text griffe loaded.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>\s*)Example(?:\s*\((?P<what>[^)]*)\))?:\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|ref):`~?(?P<target>[^`]+)`")


def _roles(text: str) -> str:
    return _ROLE.sub(lambda m: f"``{m['target']}``", text)


def _rewrite(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        m = _EXAMPLE.match(line)
        if not m:
            out.append(_roles(line))
            continue
        out.append(f"{m['indent']}Examples:")
        if m["what"]:
            # The section's first line is its caption; it takes the indentation of the next line.
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            pad = nxt[: len(nxt) - len(nxt.lstrip())] or m["indent"] + "    "
            out.append(f"{pad}{_roles(m['what'])}:")
    return "\n".join(out)


class FsdpfnDocstrings(griffe.Extension):
    """Rewrites each docstring as described in the module docstring, before griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj.docstring.value)
