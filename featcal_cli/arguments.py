"""Argument types shared by the subcommands (no imports from the command modules)."""

from __future__ import annotations

import argparse

from featcal_core.errors import FeatCalError


def task_path(flag: str):
    """An argparse `type` for TASK=DIR values of `flag` (e.g. --expert)."""

    def parse(value: str) -> tuple[str, str]:
        task, sep, path = value.partition("=")
        if not sep or not task or not path:
            raise argparse.ArgumentTypeError(f"{flag} expects TASK=DIR, got {value!r}")
        return task, path

    return parse


def pairs(flag: str, values: list[tuple[str, str]] | None) -> dict[str, str]:
    """{task: dir} of repeated TASK=DIR values; each task a safe name (featcal_core.names), once."""
    from featcal_core.names import check_names

    out: dict[str, str] = {}
    for task, path in values or []:
        check_names([task], f"{flag} {task}=...: task name")
        if task in out:
            raise FeatCalError(f"{flag} {task}=... is given twice; name each task once")
        out[task] = path
    return out
