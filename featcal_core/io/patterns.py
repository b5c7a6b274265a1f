"""Regular expressions from a user's file, matched in bounded time: `Patterns`.

Each pattern is checked as Python's `re` (what peft compiles) and by the `regex` package, which
matches it; all matches of one file share `BUDGET_S` seconds, so a pattern that backtracks
catastrophically (nested repetition such as `(.|.)*`) is refused in one line instead of
stalling the run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import regex

from featcal_core.errors import FeatCalError

#: seconds all pattern matches of one file may take together (a sound pattern takes microseconds)
BUDGET_S = 2.0


class Patterns:
    """The patterns of file `source`, compiled once each; `fix` (where to correct a pattern, e.g.
    "correct it in that file") ends every refusal."""

    def __init__(self, source: str | Path, fix: str, budget_s: float | None = None):
        self.source = source
        self.fix = fix
        self.budget_s = BUDGET_S if budget_s is None else budget_s
        self._left = self.budget_s
        self._compiled: dict[str, Any] = {}

    def compile(self, field: str, value: str, pattern: str | None = None) -> Any:
        """The compiled `pattern` (default: `value`), made from `value` of `field`; an invalid
        one is refused naming the file, the field, `value` and the error."""
        pattern = value if pattern is None else pattern
        found = self._compiled.get(pattern)
        if found is not None:
            return found
        try:
            re.compile(pattern)
            found = regex.compile(pattern)
        except (re.error, regex.error, OverflowError, RecursionError) as exc:
            reason = getattr(exc, "msg", None) or str(exc)
            raise FeatCalError(
                f"{self.source}: {field} {_shown(value)} is not a valid regular expression "
                f"({reason}); {self.fix}"
            ) from exc
        self._compiled[pattern] = found
        return found

    def match(
        self, field: str, value: str, text: str, *, pattern: str | None = None, full: bool = False
    ) -> Any:
        """`pattern` (default: `value`) matched at the start of `text` (all of it with `full`):
        a match object or None, refused once the file's budget is spent."""
        compiled = self.compile(field, value, pattern)
        started = time.monotonic()
        try:
            method = compiled.fullmatch if full else compiled.match
            return method(text, timeout=max(self._left, 1e-3))
        except TimeoutError as exc:
            raise FeatCalError(
                f"{self.source}: {field} {_shown(value)} takes over {self.budget_s:g} s to match "
                "module names (catastrophic backtracking, e.g. nested repetition as in (.|.)*); "
                f"{self.fix}: list the module names or write a simpler pattern"
            ) from exc
        finally:
            self._left -= time.monotonic() - started


def _shown(value: str, limit: int = 80) -> str:
    """`value` as Python writes it, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"
