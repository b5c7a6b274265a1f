"""The repairs' own commands (`featcal regmean`, `surgery`, `adamerging`), generated from the
repair registry (featcal_core.repair.registry): each takes the base, the merged model and, per
task, an expert and its calibration set, plus one flag per option of the repair and per
`featcal:` run setting it reads; it writes the repaired model (or per-task modules) at --out with
its record. FeatCal's own command is `featcal calibrate` (calibrate_command.py)."""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import (
    Command,
    integer,
    number,
    repair_arguments,
    repair_inputs,
    repair_run_flags,
)
from featcal_core.repair.registry import Repair, RepairInputs, available, get


def _add_arguments(repair: Repair):
    spec = repair.command
    assert spec is not None

    def add(cmd: argparse.ArgumentParser) -> None:
        repair_arguments(cmd, merged=spec.merged, out=spec.out, expert=spec.expert)
        cmd.add_argument("--base", required=spec.base_required, default=None, help=spec.base)
        for option in repair.options:
            flag = f"--{option.flag}"
            if option.kind is bool:
                cmd.add_argument(flag, dest=option.key, action="store_true", help=option.help)
                continue
            kind = integer() if option.kind is int else number()
            where = f"; params: {option.section}.{option.key}" if option.in_params else ""
            cmd.add_argument(
                flag,
                dest=option.key,
                type=kind,
                default=option.default,
                metavar=option.flag.upper().replace("-", "_"),
                help=f"{option.help} (default: %(default)s{where})",
            )
        repair_run_flags(cmd, list(repair.settings), spill_dir=spec.spill_dir)

    return add


def _run(repair: Repair):
    def run(args: argparse.Namespace) -> int:
        experts, calib, settings = repair_inputs(args, repair.name, list(repair.settings))
        options = repair.check(
            {o.key: getattr(args, o.key) for o in repair.options},
            where=lambda option: f"--{option.flag}",
        )
        assert repair.run is not None
        record = repair.run(
            RepairInputs(
                base=args.base,
                merged=args.merged,
                experts=experts,
                calibration_sets=calib,
                out=args.out,
                settings=settings,
                options=options,
                spill_dir=getattr(args, "spill_dir", None),
                overwrite=args.overwrite,
                progress=not args.no_progress,
            )
        )
        what = repair.describe(record) if repair.describe is not None else repair.name
        logging.getLogger("featcal").info(
            "%s in %.1f s, peak RSS %.0f MB -> %s",
            what,
            record["wall_seconds"],
            record["peak_rss_bytes"] / 1e6,
            args.out,
        )
        return 0

    return run


COMMANDS = tuple(
    Command(name, get(name).summary, _add_arguments(get(name)), _run(get(name)))
    for name in available()
    if get(name).command is not None
)
