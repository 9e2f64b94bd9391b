"""Name patterns: the one rule every pattern argument follows.

[Note: pattern rule]
``tp=``, ``remat=``, ``offload=``, ``experts=``, ``Float8GatherPolicy(exclude=...)`` and Muon's
``blocks=`` select names (modules, units, parameters) with ``fnmatch`` patterns (``*``, ``?``,
``[0-5]``; a pattern equal to a name matches it too). One rule, as MaxText's logical-axis rules
and regex rule lists have it:

- each name takes the value of the **first** pattern, in the order written, that matches it;
- a pattern that matches nothing, or only names earlier patterns already claimed (it can never
  take effect), is refused by name: a misspelt or shadowed pattern would otherwise be ignored
  without a word.

So ``{"blocks.[0-5]": "full", "blocks.*": "save_dots"}`` gives blocks 0-5 ``full`` and the rest
``save_dots``; written the other way round, ``"blocks.[0-5]"`` is dead and refused.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Iterable, Sequence

__all__ = ["first_match"]


def matches(name: str, pattern: str) -> bool:
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def first_match(patterns: Iterable[str], names: Sequence[str], what: str, noun: str) -> dict[str, str]:
    """``{name: the first pattern matching it}`` over ``names`` (names no pattern matches are
    left out), with every pattern checked (see [Note: pattern rule]).

    Args:
      patterns: the patterns in the order the user wrote them (a dict's keys).
      names: what they select, in model order.
      what: the argument, as the error should name it (``"remat"``, ``"muon: blocks"``).
      noun: what ``names`` are (``"unit of this plan"``, ``"parameter"``).

    Raises:
      ValueError: a pattern matches no name (with close names), or only names an earlier
        pattern already claimed (naming that pattern).

    Example:
      >>> first_match(["blocks.[0-1]", "blocks.*"], ["blocks.0", "blocks.1", "blocks.2"], "remat", "unit")
      {'blocks.0': 'blocks.[0-1]', 'blocks.1': 'blocks.[0-1]', 'blocks.2': 'blocks.*'}
    """
    out: dict[str, str] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"{what}: keys are name patterns (str), got {pattern!r}")
        hit = [n for n in names if matches(n, pattern)]
        if not hit:
            close = difflib.get_close_matches(pattern, list(names), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{what} pattern {pattern!r} matches no {noun}{hint}")
        new = [n for n in hit if n not in out]
        if not new:
            earlier = list(dict.fromkeys(out[n] for n in hit))
            raise ValueError(
                f"{what} pattern {pattern!r} matches only {_few(hit)}, which the earlier pattern(s) "
                f"{', '.join(repr(e) for e in earlier)} already claim: the first pattern that matches a name wins "
                "(in the order written), so this one never applies. Put the more specific pattern first, or drop it."
            )
        out.update(dict.fromkeys(new, pattern))
    return out


def _few(names: Sequence[str], k: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")
