"""The preflight's lines on the terminal (featcal_core.preflight): shared by `featcal check` and
`featcal run`, which runs it before any download."""

from __future__ import annotations

import sys

EXIT_PROBLEMS = 2


def preflight(
    params,
    name: str,
    notes: bool = True,
    strict: bool = False,
    unchecked: list[tuple[str, str]] | None = None,
) -> int:
    """Print the check of `params` (loaded from `name`) on stderr: its problems, one line each,
    and a count; its notes too unless `notes` is False (`featcal run`: the steps say the same
    as they go). `strict`: every item not checked is a problem too; `unchecked` receives
    (params key, why) of each such item. Returns 0, or EXIT_PROBLEMS."""
    from featcal_core.preflight import check

    problems, found = check(params)
    if unchecked is not None:
        unchecked.extend(found.unchecked)
    skipped = dict(found.unchecked) if strict else {}
    problems += [
        (key, f"{text} (--strict: every item must be checked)")
        for key, text in found
        if key in skipped
    ]
    shown = [(key, text) for key, text in found if key not in skipped] if notes else []
    for key, text in shown:
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
