"""The preflight's lines on the terminal (featcal_core.preflight): shared by `featcal check` and
`featcal run`, which runs it before any download."""

from __future__ import annotations

import sys

EXIT_PROBLEMS = 2


def preflight(params, name: str, notes: bool = True) -> int:
    """Print the check of `params` (loaded from `name`) on stderr: its problems, one line each,
    and a count; its notes too unless `notes` is False (`featcal run`: the steps say the same
    as they go). Returns 0, or EXIT_PROBLEMS."""
    from featcal_core.preflight import check

    problems, found = check(params)
    for key, text in found if notes else ():
        print(f"featcal: note: {key}: {text}", file=sys.stderr)
    for key, text in problems:
        print(f"featcal: error: {key}: {text}", file=sys.stderr)
    if len(problems) == 1:  # one failure, one line (as every other failure of featcal)
        return EXIT_PROBLEMS
    if problems:
        count = len(problems)
        print(
            f"featcal: {name}: {count} problem{'s' if count != 1 else ''}; fix "
            f"{'them' if count != 1 else 'it'} and run again",
            file=sys.stderr,
        )
        return EXIT_PROBLEMS
    return 0
