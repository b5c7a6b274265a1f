"""`featcal merge`: merge fine-tuned experts of one base model into a single checkpoint.

Usage: featcal merge --base MODEL --expert TASK=MODEL [--expert ...] --method METHOD [--scale S]
[--top-k K] [--hp KEY=VALUE ...] --out DIR [--max-shard-size SIZE] [--overwrite] [--no-progress]
       featcal merge --params params.yaml [--set KEY=VALUE ...]   (the pipeline's merge step)

MODEL is a folder or a Hub id owner/name[@revision] (fetched through the Hugging Face cache). The
output is a model of its own: the merged weights, the files a model carries (config, tokenizer,
processor, generation config, chat template) and never the base repository's README.md or
.gitattributes, `merge.json` (the recipe, and each input's Hub id, revision and commit, or its
folder) and its own model card, README.md.

`--hp` takes any hyperparameter the chosen method declares (its `defaults`), so a method added to
featcal_core/merging/ needs no flag here; `--scale` and `--top-k` are short for `--hp scale=...`
and `--hp top_k=...`.
"""

from __future__ import annotations

import argparse
import logging

import yaml

from featcal_cli.arguments import (
    Command,
    number,
    pairs,
    refuse_with_params,
    setting_flags,
    task_path,
)
from featcal_cli.step_runner import run_step
from featcal_core.errors import FeatCalError


class _MethodNames:
    """The registered merge methods as argparse `choices`, looked up only when `--method` is
    checked or the help is printed, and read from the method modules' source
    (`featcal_core.merging.declared_names`): importing the methods imports torch, which
    `featcal merge --help` would otherwise pay for."""

    def __iter__(self):
        from featcal_core.merging import declared_names

        return iter(declared_names())

    def __contains__(self, name: object) -> bool:
        return name in list(self)


def _hyperparameter(value: str) -> tuple[str, object, str]:
    """An argparse `type` for --hp KEY=VALUE: (KEY, VALUE, the flag as typed); VALUE is read as
    params.yaml's values are (featcal_core.params.base.read_value: 0.3, 1e-3, 20, true, text)."""
    from featcal_core.params.base import read_value

    key, sep, text = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--hp expects KEY=VALUE, got {value!r}")
    try:
        return key, read_value(text), f"--hp {value}"
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"--hp {key}: {text!r} is not a value ({exc})") from None


def add_arguments(merge: argparse.ArgumentParser) -> None:
    from featcal_core.params import RunSettings

    merge.add_argument(
        "--base",
        metavar="MODEL",
        help="the base (pre-trained) model: a folder or Hub id owner/name[@revision]",
    )
    merge.add_argument(
        "--expert",
        action="append",
        type=task_path("--expert"),
        metavar="TASK=MODEL",
        help="a fine-tuned expert: a folder or Hub id owner/name[@revision] (save_pretrained "
        "layout), or a peft LoRA adapter folder (repeat per task)",
    )
    merge.add_argument(
        "--method", choices=_MethodNames(), metavar="METHOD", help="merge method: %(choices)s"
    )
    merge.add_argument(
        "--scale",
        type=number(),
        default=None,
        help="task vector scale (task_arithmetic default 0.3, ties λ default 1.0)",
    )
    merge.add_argument(
        "--top-k",
        type=number(),
        default=None,
        help="ties: percent of each task vector's entries kept, per tensor (default 20)",
    )
    merge.add_argument(
        "--hp",
        action="append",
        default=[],
        type=_hyperparameter,
        metavar="KEY=VALUE",
        help="any hyperparameter of the method, e.g. "
        "--hp top_k=30 (checked by the method; unknown keys are refused)",
    )
    merge.add_argument(
        "--out",
        help="output folder: the merged model (save_pretrained layout), merge.json and its "
        "model card README.md",
    )
    setting_flags(merge, RunSettings, ["max_shard_size"], "run")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    merge.add_argument(
        "--no-progress", action="store_true", help="no progress bar or progress lines"
    )
    merge.add_argument("--params", help="run the pipeline's merge step from this params.yaml")
    merge.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --params: override a value",
    )


def run(args: argparse.Namespace) -> int:
    """Run `featcal merge` for parsed arguments; FeatCalError propagates to the caller."""
    refuse_with_params("merge", args, add_arguments)
    if args.params is not None:
        run_step("merge", args)
        return 0
    missing = [f"--{n}" for n in ("base", "method", "out") if getattr(args, n) is None]
    if missing:
        raise FeatCalError(f"featcal merge needs {', '.join(missing)} (or --params FILE)")
    from featcal_core.merging.run import merge_checkpoints
    from featcal_core.params import RunSettings, settings_from_flags

    settings_from_flags(RunSettings, "run", {"max_shard_size": args.max_shard_size})
    hyperparameters = _hyperparameters(args)
    sources = getattr(args, "model_sources", None) or {}  # Hub ids: featcal_cli.arguments
    record = merge_checkpoints(
        base=args.base,
        experts=pairs("--expert", args.expert),
        out=args.out,
        method=args.method,
        hyperparameters=hyperparameters,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        max_shard_size=args.max_shard_size,
        base_source=sources.get("base"),
        expert_sources=sources.get("experts"),
    )
    logging.getLogger("featcal").info(
        "merged %d experts with %s %s in %.1f s, peak RSS %.0f MB -> %s",
        len(record["inputs"]["experts"]),
        record["method"],
        record["hyperparameters"],
        record["wall_seconds"],
        record["peak_rss_bytes"] / 1e6,
        args.out,
    )
    return 0


def _hyperparameters(args: argparse.Namespace) -> dict[str, object]:
    """The merge hyperparameters of --scale, --top-k and --hp, checked by the method before any
    work; a bad one is named by the flag it was given with (`--top-k`, `--hp drop_rate=2`)."""
    from featcal_core.merging import get
    from featcal_core.merging.base import HyperparameterError, flag

    given: dict[str, str] = {}  # key -> the flag as typed
    hyperparameters: dict[str, object] = {}
    flags = [
        (key, value, flag(key))
        for key, value in (("scale", args.scale), ("top_k", args.top_k))
        if value is not None
    ]
    for key, value, typed in [*flags, *args.hp]:
        if key in hyperparameters:
            raise FeatCalError(
                f"merge hyperparameter {key!r} is given twice ({given[key]} and "
                f"{typed}); give it once"
            )
        hyperparameters[key], given[key] = value, typed
    try:
        get(args.method).check(dict(hyperparameters))
    except HyperparameterError as exc:
        raise FeatCalError(exc.named(given.get(exc.key))) from None
    return hyperparameters


COMMANDS = (
    Command(
        "merge",
        "merge fine-tuned experts (folders or Hub ids) into one model with its own card and "
        "merge.json, tensor by tensor (streaming)",
        add_arguments,
        run,
    ),
)
