"""`featcal import-open-clip`: convert an open_clip checkpoint into a featcal checkpoint directory.

Usage: featcal import-open-clip SRC --out DIR [--config open_clip_config.json] [--trust-pickle]
[--overwrite]

SRC is a .safetensors or .bin/.pt/.pth state dict (a full CLIP's or its VisionTransformer's), or
with --trust-pickle a whole pickled module. The output (config.json + model.safetensors with the
vision tower's tensors) is a base, merged model or expert for `featcal calibrate`.
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SRC",
        help="open_clip checkpoint: .safetensors, or .bin/.pt/.pth (state dict, or with "
        "--trust-pickle a pickled module)",
    )
    parser.add_argument("--out", required=True, help="output directory (config.json + weights)")
    parser.add_argument(
        "--config",
        default=None,
        help="open_clip_config.json holding model_cfg.vision_cfg (default: the one next to SRC)",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle a whole pickled module (runs code from the file; only for files you trust)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    """Run `featcal import-open-clip` for parsed arguments; FeatCalError propagates."""
    from featcal_core.open_clip.importer import import_open_clip

    config = import_open_clip(
        args.source,
        args.out,
        model_cfg=args.config,
        trust_pickle=args.trust_pickle,
        overwrite=args.overwrite,
    )
    logging.getLogger("featcal").info(
        "open_clip vision tower: %s layers, width %s, quick_gelu %s -> %s",
        config["layers"],
        config["width"],
        config["quick_gelu"],
        args.out,
    )
    return 0


COMMANDS = (
    Command(
        "import-open-clip",
        "convert an open_clip checkpoint (vision tower) into a featcal checkpoint",
        add_arguments,
        run,
    ),
)
