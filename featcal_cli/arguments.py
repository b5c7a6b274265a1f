"""What the subcommand modules share: the `Command` they each declare, argument types and
flag builders (no imports from the command modules)."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from featcal_core.errors import FeatCalError


@dataclass(frozen=True)
class Command:
    """One subcommand: `featcal <name>`. Every command module declares `COMMANDS`, a tuple of
    these; `featcal_cli.main` adds each to the parser and dispatches to its `run`, which returns
    the exit status (FeatCalError and OSError become one line and status 2 in `main`)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def params_arguments(parser: argparse.ArgumentParser, default: str | None = "params.yaml") -> None:
    """--params FILE and repeated --set KEY=VALUE: the run configuration and its overrides."""
    parser.add_argument("--params", default=default, help="the run configuration (params.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of the params file, e.g. featcal.alpha=0.3")  # fmt: skip


def refuse_with_params(command: str, args: argparse.Namespace, add_arguments) -> None:
    """`featcal <command> --params FILE` runs the pipeline step, which reads everything from the
    params file: any other flag of the command that was given (a value other than its default)
    would be silently ignored, so it is refused, naming the flags. Without --params, --set (which
    only overrides the params file) is refused too."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    given = [
        "--" + action.dest.replace("_", "-")
        for action in defaults._actions
        if action.dest not in ("params", "set", "help")
        and getattr(args, action.dest, action.default) != action.default
    ]
    if args.params is not None and given:
        raise FeatCalError(
            f"featcal {command} --params runs the pipeline step from {args.params}, so "
            f"{', '.join(given)} would have no effect; set those values in the params file or "
            "with --set KEY=VALUE (e.g. --set featcal.alpha=0.3), or drop --params"
        )
    if args.params is None and args.set:
        raise FeatCalError(
            f"featcal {command}: --set overrides values of a params file and needs --params FILE"
        )


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


def setting_flags(parser: argparse.ArgumentParser, model, names: list[str], section: str) -> None:
    """Add one flag per field of a params section model (e.g. FeatCalSettings): `--num-per-task`
    for `num_per_task`, with the field's default, type or choices and description, so the flags
    and params.yaml cannot drift apart. The values are checked by the model itself
    (`featcal_core.params.featcal_from_flags`)."""
    for name in names:
        info = model.model_fields[name]
        options = [a for a in _alternatives(info.annotation) if a is not type(None)]
        kwargs: dict = {"default": info.default}
        literals = [v for a in options if typing.get_origin(a) is typing.Literal
                    for v in typing.get_args(a)]  # fmt: skip
        if literals:
            kwargs["choices"] = literals
        elif any(_base(a) is int for a in options):
            kwargs["type"] = int
        elif any(_base(a) is float for a in options):
            kwargs["type"] = float
        flag = "--" + name.replace("_", "-")
        kwargs["help"] = f"{info.description} (default: %(default)s; params: {section}.{name})"
        parser.add_argument(flag, **kwargs)


def _alternatives(annotation) -> list:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _alternatives(arg)]
    return [annotation]


def _base(annotation):
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation
