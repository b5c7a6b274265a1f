"""`featcal calibrate`: FeatCal-calibrate a merged model against its experts.

Direct (--base/--merged/--expert/--calib/--out), as the resumable Prefect flow (--results-dir), or
as the pipeline's calibrate step (--params). The FeatCal flags are derived from params.yaml's
`featcal:` fields (one definition: featcal_core.params) and checked by that section's model.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from featcal_cli.arguments import Command, pairs, refuse_with_params, setting_flags, task_path
from featcal_cli.step_runner import run_step
from featcal_core.errors import FeatCalError
from featcal_core.method.settings import RUN_SETTINGS

if TYPE_CHECKING:
    from featcal_core.params import FeatCalSettings


def add_arguments(cal: argparse.ArgumentParser) -> None:
    from featcal_core.params import FeatCalSettings, RunSettings

    cal.add_argument(
        "--base",
        metavar="MODEL",
        help="the base model (with its preprocessor): a folder or Hub id owner/name[@revision]",
    )
    cal.add_argument("--merged", help="merged model directory")
    cal.add_argument(
        "--expert",
        action="append",
        type=task_path("--expert"),
        metavar="TASK=MODEL",
        help="a fine-tuned expert: a folder or Hub id owner/name[@revision] (repeat per task)",
    )
    cal.add_argument("--calib", action="append", type=task_path("--calib"), metavar="TASK=DIR")
    cal.add_argument("--out", help="output directory (save_pretrained layout)")
    setting_flags(
        cal,
        FeatCalSettings,
        ["alpha", "rho", "lam", "eps", *RUN_SETTINGS],
        "featcal",
    )
    setting_flags(cal, RunSettings, ["seed", "max_shard_size"], "run")
    cal.add_argument("--spill-dir", default=None, help="keep hidden-state streams on disk here")
    cal.add_argument(
        "--heads",
        action="store_true",
        help="also refit each expert's own classification head for the calibrated "
        "model (head calibration; written to OUT/heads/<task>/; params: featcal.heads)",
    )
    setting_flags(cal, FeatCalSettings, ["head_lam"], "featcal")
    cal.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cal.add_argument(
        "--results-dir",
        default=None,
        help="run as the resumable Prefect flow, persisting each block's result here",
    )
    setting_flags(
        cal, FeatCalSettings, ["runner", "dask_address", "dask_workers", "memory_budget"], "featcal"
    )
    cal.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    cal.add_argument(
        "--params",
        help="run the pipeline's calibrate step from this params.yaml "
        "(instead of --base/--merged/--expert/--calib/--out)",
    )
    cal.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --params: override a value",
    )


def run(args: argparse.Namespace) -> int:
    refuse_with_params("calibrate", args, add_arguments)
    if args.params is not None:
        run_step("calibrate", args)
        return 0
    missing = [f"--{n}" for n in ("base", "merged", "out") if getattr(args, n) is None]
    if missing:
        raise FeatCalError(f"featcal calibrate needs {', '.join(missing)} (or --params FILE)")
    from featcal_core.params import (
        FeatCalSettings,
        RunSettings,
        featcal_from_flags,
        settings_from_flags,
    )

    # the flags that are params.yaml's featcal: and run: fields, checked by those sections' models
    featcal = featcal_from_flags(
        {name: getattr(args, name) for name in FeatCalSettings.model_fields if hasattr(args, name)}
    )
    settings_from_flags(
        RunSettings, "run", {"seed": args.seed, "max_shard_size": args.max_shard_size}
    )
    if args.results_dir is not None:
        if args.spill_dir is not None:
            raise FeatCalError(
                "--spill-dir has no effect with --results-dir: the flow keeps every hidden-state "
                "stream on disk in the results directory already; drop --spill-dir"
            )
        return _flow(args, featcal)
    if args.runner != "local" or args.dask_address is not None:
        raise FeatCalError("--runner dask / --dask-address need --results-dir (the Prefect flow)")
    if args.memory_budget is not None:
        raise FeatCalError(
            "--memory-budget applies to the resumable flow (--results-dir); without it the "
            "statistics are folded in memory already (--spill-dir writes the streams to disk)"
        )
    from featcal_core import calibrate

    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    _check_heads(args, experts)
    record = calibrate(
        base=args.base,
        merged=args.merged,
        experts=experts,
        calib=calib,
        out=args.out,
        params=featcal.core_params(),
        **asdict(featcal.core_settings(args.seed)),
        spill_dir=args.spill_dir,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        max_shard_size=args.max_shard_size,
    )
    logging.getLogger("featcal").info(
        "calibrated %d blocks in %.1f s, peak RSS %.0f MB -> %s",
        len(record["blocks"]),
        record["wall_seconds"],
        record["peak_rss_bytes"] / 1e6,
        args.out,
    )
    _refit_heads(args, experts, calib)
    return 0


def _check_heads(args: argparse.Namespace, experts: dict[str, str]) -> None:
    """With --heads: every expert has a head that can be refit (before any calibration)."""
    if args.heads:
        from featcal_core.method.head_calibration import check_expert_heads

        check_expert_heads(experts, tokenizer_dir=args.base)


def _refit_heads(args: argparse.Namespace, experts: dict[str, str], calib: dict[str, str]):
    """With --heads: refit each expert's head for the calibrated model into OUT/heads/<task>/."""
    if not args.heads:
        return
    from featcal_core.evaluation.accuracy import _device
    from featcal_core.io.checkpoint import Checkpoint
    from featcal_core.method.head_calibration import refit_expert_heads
    from featcal_core.precision import resolve_forwards

    dtype = Checkpoint(args.out, role="calibrated model").float_dtype()
    chosen = resolve_forwards(args.precision, _device(args.device), dtype)
    heads = refit_expert_heads(
        args.out,
        experts,
        calib,
        Path(args.out) / "heads",
        num_per_task=args.num_per_task,
        seed=args.seed,
        lam=args.head_lam,
        batch_size=args.batch_size,
        device=args.device,
        tokenizer_dir=args.base,
        precision=chosen.name,
    )
    logging.getLogger("featcal").info("refit heads: %s", ", ".join(heads.values()))


def _flow(args: argparse.Namespace, featcal: FeatCalSettings) -> int:
    """`--results-dir`: the resumable Prefect flow (one cached task per block), with the
    validated `featcal:` flags."""
    from featcal.flows.environment import configure

    configure()
    from featcal.flows.calibration import calibration_flow, make_spec

    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    from featcal_core.io.outputs import check_root
    from featcal_core.method.calibration import calibration_inputs

    # before Prefect starts: a folder of the user's is refused with nothing written into it
    inputs = calibration_inputs(args.base, args.merged, experts, calib)
    check_root(args.results_dir, inputs=inputs, flag="--results-dir")
    _check_heads(args, experts)
    spec = make_spec(
        args.base,
        args.merged,
        experts,
        calib,
        args.results_dir,
        featcal.core_params(),
        featcal.core_settings(args.seed),
        args.runner,
        args.dask_address,
        args.dask_workers,
        args.memory_budget,
        args.max_shard_size,
    )
    record = calibration_flow(spec, args.out, args.overwrite)
    computed = sum(not block["restored"] for block in record["blocks"])
    logging.getLogger("featcal").info(
        "%d blocks computed, %d restored -> %s",
        computed,
        len(record["blocks"]) - computed,
        args.out,
    )
    _refit_heads(args, experts, calib)
    return 0


COMMANDS = (
    Command(
        "calibrate", "FeatCal-calibrate a merged model against its experts", add_arguments, run
    ),
)
