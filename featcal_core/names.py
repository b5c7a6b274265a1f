"""Names that become folder names, file names and MLflow keys: task names and run names.

One rule everywhere (CLI flags, params.yaml, the library): letters, digits, '_', '-' and '.',
starting with a letter or digit, at most 100 characters, so a name can never be a path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from featcal_core.errors import FeatCalError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
RULE = "may hold only letters, digits, '_', '-' and '.', start with a letter or digit (≤ 100)"


def name_problem(name: object) -> str | None:
    """Why `name` is not a safe name (one phrase), or None when it is."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        return f"{name!r} {RULE}; it names folders and MLflow keys"
    return None


def check_names(names: Iterable[object], what: str = "task name") -> None:
    """Raise FeatCalError for the first unsafe name, naming `what` (e.g. "--expert")."""
    for name in names:
        problem = name_problem(name)
        if problem is not None:
            raise FeatCalError(f"{what} {problem}")
