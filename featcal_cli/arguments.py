"""What the subcommand modules share: the `Command` they each declare, argument types and
flag builders (no imports from the command modules)."""

from __future__ import annotations

import argparse
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from featcal_core.errors import FeatCalError

if typing.TYPE_CHECKING:
    from featcal_core.method.settings import Settings


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
    parser.add_argument(
        "--params",
        default=default,
        help="the run configuration: a params file (params.yaml), or the name of one that "
        "ships with featcal (featcal params list)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value of the params file, e.g. featcal.alpha=0.3",
    )


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


def number(*, above: float | None = None):
    """An argparse `type` for a number flag: VALUE read by params.yaml's one rule
    (`featcal_core.params.base.read_value`: `0.3`, `1e-3`, `1E3`, `.5`, `+1.5`), which must be
    a finite number (not `true`, not text, not nan or inf) and, with `above`, greater than it.
    The flag's own bounds are checked where its value is used (the params section's model, the
    method's check), so they are the same for the flag and params.yaml."""

    def parse(text: str) -> float:
        value = _read(text)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 0.3, 1e-3)")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be a number > {above:g} (got {text!r})")
        return float(value)

    parse.__name__ = "number"  # what the parser's help and tests see
    return parse


def integer(*, at_least: int | None = None):
    """An argparse `type` for a whole-number flag, read by the same rule as `number`: `1.5`,
    `1e3`, `true` and text are refused (as params.yaml's strict integers refuse them); with
    `at_least`, a smaller value too."""

    def parse(text: str) -> int:
        value = _read(text)
        if isinstance(value, bool) or not isinstance(value, int):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {at_least} (got {text!r})")
        return value

    parse.__name__ = "integer"
    return parse


def _read(text: str) -> object:
    import yaml

    from featcal_core.params.base import read_value

    try:
        return read_value(text)
    except yaml.YAMLError:  # not YAML at all (e.g. "[1"): not a number either
        return text


def task_path(flag: str):
    """An argparse `type` for TASK=DIR values of `flag` (e.g. --expert)."""

    def parse(value: str) -> tuple[str, str]:
        task, sep, path = value.partition("=")
        if not sep or not task or not path:
            raise argparse.ArgumentTypeError(f"{flag} expects TASK=DIR, got {value!r}")
        return task, path

    return parse


def hub_models(args: argparse.Namespace) -> None:
    """Hub ids wherever a model folder is taken (`--base`, each `--expert TASK=...`): a value that
    is no local folder but reads as `owner/name[@revision]` is fetched (configs, tokenizer files
    and safetensors weights, through the Hugging Face cache, as the pipeline's download step
    does: featcal_core.provenance.resolve) and replaced by its local snapshot folder, in place;
    where each came from (`ResolvedModel.source()`: Hub id, revision, commit) is kept in
    `args.model_sources` ({"base": ..., "experts": {task: ...}}) for the records. Anything else
    is left for the command to check."""
    from pathlib import Path

    sources: dict[str, dict] = {}

    def local(text: str, flag: str) -> str:
        if Path(text).expanduser().exists():
            return text
        from featcal_core.params.base import _HUB_MODEL_RE, _LOCAL_PREFIXES

        if not _HUB_MODEL_RE.match(text):
            if text.startswith(_LOCAL_PREFIXES) or "/" not in text:
                return text  # a local path: the command checks it, after its flags
            raise FeatCalError(
                f"{flag} {text!r} does not exist (looked in "
                f"{os.path.join(os.getcwd(), os.path.expanduser(text))}) "
                "and is not a Hub id owner/name[@revision]; fix the folder's path or the Hub id"
            )
        from featcal_core.params import ModelRef
        from featcal_core.provenance.resolve import resolve_model

        model = resolve_model(ModelRef.model_validate(text), flag)
        sources[flag] = model.source()
        return str(model.path)

    found: dict = {"base": None, "experts": {}}
    if isinstance(getattr(args, "base", None), str):
        args.base = local(args.base, "--base")
        found["base"] = sources.get("--base")
    if isinstance(getattr(args, "expert", None), list):
        args.expert = [(task, local(path, f"--expert {task}")) for task, path in args.expert]
        found["experts"] = {
            task: sources[f"--expert {task}"]
            for task, _ in args.expert
            if f"--expert {task}" in sources
        }
    args.model_sources = found


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


def repair_arguments(
    cmd: argparse.ArgumentParser, *, merged: str, out: str, expert: str | None = None
) -> None:
    """The inputs of a repair baseline (`featcal regmean`, `featcal surgery`): --merged DIR,
    repeated --expert TASK=DIR and --calib TASK=DIR, and --out DIR, with the command's help texts
    (--merged and --out required; checked by `repair_inputs`)."""
    cmd.add_argument("--merged", required=True, help=merged)
    cmd.add_argument(
        "--expert", action="append", type=task_path("--expert"), metavar="TASK=DIR", help=expert
    )
    cmd.add_argument("--calib", action="append", type=task_path("--calib"), metavar="TASK=DIR")
    cmd.add_argument("--out", required=True, help=out)


def repair_run_flags(
    cmd: argparse.ArgumentParser, settings: list[str], *, spill_dir: bool = False
) -> None:
    """The run flags of a repair baseline: one per `featcal:` field in `settings`, --seed, then
    --spill-dir (when `spill_dir`), --overwrite and --no-progress."""
    from featcal_core.params import FeatCalSettings, RunSettings

    setting_flags(cmd, FeatCalSettings, settings, "featcal")
    setting_flags(cmd, RunSettings, ["seed"], "run")
    if spill_dir:
        cmd.add_argument("--spill-dir", default=None, help="keep hidden-state streams on disk here")
    cmd.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")


def repair_inputs(
    args: argparse.Namespace, command: str, settings: list[str]
) -> tuple[dict[str, str], dict[str, str], Settings]:
    """(experts, calib, Settings) of a repair baseline's parsed flags: the `settings` flags
    checked by the `featcal:` section's model, {task: dir} of --expert and --calib (at least one
    expert), and the run `Settings` of those flags and --seed (the others at their defaults)."""
    from featcal_core.method.settings import Settings
    from featcal_core.params import RunSettings, featcal_from_flags, settings_from_flags

    featcal_from_flags({name: getattr(args, name) for name in settings})  # checks the values
    settings_from_flags(RunSettings, "run", {"seed": args.seed})
    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    if not experts:
        raise FeatCalError(
            f"featcal {command} needs at least one --expert TASK=DIR and --calib TASK=DIR"
        )
    return experts, calib, Settings(seed=args.seed, **{n: getattr(args, n) for n in settings})


def setting_flags(parser: argparse.ArgumentParser, model, names: list[str], section: str) -> None:
    """Add one flag per field of a params section model (e.g. FeatCalSettings): `--num-per-task`
    for `num_per_task`, with the field's default, type or choices and description, so the flags
    and params.yaml cannot drift apart. The values are checked by the model itself
    (`featcal_core.params.featcal_from_flags`)."""
    for name in names:
        info = model.model_fields[name]
        options = [a for a in _alternatives(info.annotation) if a is not type(None)]
        kwargs: dict = {"default": info.default}
        literals = [
            v for a in options if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)
        ]
        if literals:
            kwargs["choices"] = literals
        elif any(_base(a) is int for a in options):
            kwargs["type"] = integer()
        elif any(_base(a) is float for a in options):
            kwargs["type"] = number()
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
