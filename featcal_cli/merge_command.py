"""`featcal merge`: merge fine-tuned experts of one base model into a single checkpoint.

Usage: featcal merge --base DIR --expert TASK=DIR [--expert ...] --method METHOD [--scale S]
[--top-k K] --out DIR [--overwrite] [--no-progress]
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import pairs, task_path


class _MethodNames:
    """The registered merge methods as argparse `choices`, looked up only when `--method` is
    checked or the help is printed: the registry imports torch, which every other subcommand
    (and `featcal --help`) would otherwise pay for at start-up."""

    def __iter__(self):
        from featcal_core.merging import available

        return iter(available())

    def __contains__(self, name: object) -> bool:
        return name in list(self)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the `merge` subcommand to an argparse subparsers object; returns its parser."""
    merge = sub.add_parser(
        "merge", help="merge fine-tuned experts into one model, tensor by tensor (streaming)"
    )
    merge.add_argument("--base", help="base (pre-trained) model directory")
    merge.add_argument("--expert", action="append", type=task_path("--expert"),
                       metavar="TASK=DIR", help="a fine-tuned expert (repeat per task)")  # fmt: skip
    merge.add_argument("--method", choices=_MethodNames(), metavar="METHOD",
                       help="merge method: %(choices)s")  # fmt: skip
    merge.add_argument("--scale", type=float, default=None,
                       help="task vector scale (task_arithmetic default 0.3, ties λ default 1.0)")  # fmt: skip
    merge.add_argument("--top-k", type=float, default=None,
                       help="ties: percent of each task vector's entries kept, per tensor "
                       "(default 20)")  # fmt: skip
    merge.add_argument("--out", help="output directory (save_pretrained layout)")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    merge.add_argument("--no-progress", action="store_true", help="no progress bar")
    return merge


def run(args: argparse.Namespace) -> int:
    """Run `featcal merge` for parsed arguments; FeatCalError propagates to the caller."""
    from featcal_core.merging.run import merge_checkpoints

    hyperparameters = {
        key: value
        for key, value in (("scale", args.scale), ("top_k", args.top_k))
        if value is not None
    }
    record = merge_checkpoints(
        base=args.base,
        experts=pairs("--expert", args.expert),
        out=args.out,
        method=args.method,
        hyperparameters=hyperparameters,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    logging.getLogger("featcal").info(
        "merged %d experts with %s %s in %.1f s, peak RSS %.0f MB -> %s",
        len(record["inputs"]["experts"]), record["method"], record["hyperparameters"],
        record["wall_seconds"], record["peak_rss_bytes"] / 1e6, args.out,
    )  # fmt: skip
    return 0
