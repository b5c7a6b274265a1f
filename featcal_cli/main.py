"""`featcal` console entry point. Bad input ends with one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys

from featcal_cli.arguments import pairs, setting_flags, task_path
from featcal_core.errors import FeatCalError
from featcal_core.memory import tune_allocator

EXIT_BAD_INPUT = 2


STEP_HELP = {
    "download": "pipeline step: resolve the models of params.yaml and write the lock file",
    "calib-set": "pipeline step: draw the calibration sets of params.yaml",
    "heads": "pipeline step: head calibration (refit each task's head; featcal.heads)",
    "evaluate": "pipeline step: evaluate base, experts, merged and calibrated models",
    "report": "pipeline step: write reports/<run>/report.md and report.html with plots",
}


def _params_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="the run configuration")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of the params file, e.g. featcal.alpha=0.3")  # fmt: skip


def _steps(args: argparse.Namespace):
    from featcal_core.params import load_params
    from flows.steps import Steps

    return Steps(load_params(args.params, args.set))


def _step(name: str):
    def run(args: argparse.Namespace) -> int:
        steps = _steps(args)  # params validated before any heavy work
        if name == "calibrate":
            from flows.environment import configure

            configure()
        with steps.session(f"featcal {args.command}"):  # checked outputs, the run lock
            if name == "calibrate":
                steps.check_heads()
            result = getattr(steps, name)()
        logging.getLogger("featcal").info("%s: done (%s)", name, steps.paths["root"])
        if name == "evaluate":
            print(json.dumps(result, indent=2))
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="featcal", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    cal = sub.add_parser("calibrate", help="FeatCal-calibrate a merged model against its experts")
    cal.add_argument("--base", help="base model directory (with its preprocessor)")
    cal.add_argument("--merged", help="merged model directory")
    cal.add_argument("--expert", action="append", type=task_path("--expert"), metavar="TASK=DIR")
    cal.add_argument("--calib", action="append", type=task_path("--calib"), metavar="TASK=DIR")
    cal.add_argument("--out", help="output directory (save_pretrained layout)")
    from featcal_core.params import FeatCalSettings, RunSettings

    setting_flags(cal, FeatCalSettings, ["alpha", "rho", "lam", "eps", "num_per_task",
                  "batch_size", "device", "max_length", "pooling", "token_weighting"], "featcal")  # fmt: skip
    setting_flags(cal, RunSettings, ["seed"], "run")
    cal.add_argument("--spill-dir", default=None, help="keep hidden-state streams on disk here")
    cal.add_argument("--heads", action="store_true",
                     help="also refit each expert's own classification head for the calibrated "
                     "model (head calibration; written to OUT/heads/<task>/; params: featcal.heads)")  # fmt: skip
    setting_flags(cal, FeatCalSettings, ["head_lam"], "featcal")
    cal.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cal.add_argument(
        "--results-dir",
        default=None,
        help="run as the resumable Prefect flow, persisting each block's result here",
    )
    setting_flags(cal, FeatCalSettings, ["runner", "dask_address", "dask_workers"], "featcal")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    from featcal_cli import lineage_command, merge_command, open_clip_command

    lineage_command.add_parser(sub)
    open_clip_command.add_parser(sub, COMMANDS)
    merge = merge_command.add_parser(sub)
    merge.add_argument("--params", help="run the pipeline's merge step from this params.yaml")
    merge.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="with --params: override a value")  # fmt: skip

    cal.add_argument("--params", help="run the pipeline's calibrate step from this params.yaml "
                     "(instead of --base/--merged/--expert/--calib/--out)")  # fmt: skip
    cal.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="with --params: override a value")  # fmt: skip

    run = sub.add_parser("run", help="run the whole pipeline (Prefect flow) from params.yaml")
    _params_arguments(run)
    serve = sub.add_parser("serve", help="run the pipeline on a schedule (Prefect deployment)")
    _params_arguments(serve)
    serve.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    serve.add_argument("--interval", type=float, help="schedule every N seconds")
    for name, text in STEP_HELP.items():
        _params_arguments(sub.add_parser(name, help=text))

    zoo = sub.add_parser(
        "zoo", help="build the offline model zoo: a base and task experts fine-tuned here"
    )
    zoo.add_argument("--preset", choices=["vision", "text"], help="a built-in zoo")
    zoo.add_argument("--dataset", action="append", type=task_path("--dataset"),
                     metavar="TASK=DIR", help="your own task: a save_to_disk DatasetDict with "
                     "train and test splits and image or text plus label columns")  # fmt: skip
    zoo.add_argument("--modality", choices=["image", "text"], help="with --dataset")
    zoo.add_argument("--base", help="with --dataset: model to fine-tune from (text: a BertModel "
                     "folder, default all-MiniLM-L6-v2; image: a CLIPVisionModel folder, default: "
                     "pretrain one here)")  # fmt: skip
    zoo.add_argument("--name", default="custom", help="with --dataset: the zoo's name")
    zoo.add_argument("--out", help="zoo folder (default: data/zoo/<preset or name>)")
    zoo.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    zoo.add_argument("--pretrain-steps", type=int, help="vision base pretraining steps")
    zoo.add_argument("--expert-steps", type=int, help="fine-tuning steps per expert")
    zoo.add_argument("--rebuild", action="store_true", help="build even if the zoo exists")
    zoo.add_argument("--no-progress", action="store_true", help="no progress bars")
    _params_arguments(zoo)
    zoo.set_defaults(params=None)

    demo = sub.add_parser(
        "demo",
        help="the embedded default: build or reuse the offline zoo, run the whole pipeline on "
        "params.yaml and print the per-task accuracy table",
    )
    _params_arguments(demo)
    demo.add_argument("--synthetic", action="store_true",
                      help="instead: calibrate a small synthetic pool and print the per-block "
                      "drift (plumbing only, no accuracy)")  # fmt: skip
    demo.add_argument("--work", default="runs/demo", help="--synthetic: where the pool goes")
    demo.add_argument("--tasks", type=int, default=4, help="--synthetic: number of experts")
    demo.add_argument("--rebuild", action="store_true", help="--synthetic: rebuild the pool")
    return parser


def _demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        return _synthetic_demo(args)
    import time

    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from flows.pipeline import run_pipeline
    from flows.summary import accuracy_table

    started = time.perf_counter()
    summary = run_pipeline(params)
    print()
    print(accuracy_table(summary.get("evaluation") or {}))
    print()
    if summary.get("report"):
        print(f"report:      {summary['report']}")
    if summary.get("mlflow_run_id"):
        print(f"MLflow run:  {summary['mlflow_run_id']} ({summary.get('mlflow_uri')}; "
              "browse with `mlflow ui --backend-store-uri <uri>`)")  # fmt: skip
    print(f"results:     {summary['paths']['root']}")
    print(f"wall time:   {time.perf_counter() - started:.0f} s")
    return 0


def _synthetic_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from featcal_core import calibrate
    from featcal_core.data.synthetic import build_pool, load_pool

    work = Path(args.work)
    pool_dir = work / "pool"
    pool = None if args.rebuild else load_pool(pool_dir)
    if pool is None:
        logging.getLogger("featcal").info("building a synthetic pool in %s", pool_dir)
        if pool_dir.is_dir() and any(pool_dir.iterdir()) and not (pool_dir / "pool.json").is_file():
            raise FeatCalError(
                f"{pool_dir} exists and is not a synthetic pool (no pool.json); choose another "
                "--work (left untouched)"
            )
        shutil.rmtree(pool_dir, ignore_errors=True)
        config = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, image_size=64, patch_size=16)  # fmt: skip
        tasks = tuple(f"task{i}" for i in range(args.tasks))
        pool = build_pool(pool_dir, "clip", config, tasks, delta=0.01, rows=32, blocks_only=True)
    out = work / "calibrated"
    record = calibrate(pool.base, pool.merged, pool.experts, pool.calib, out, overwrite=True)
    print(f"\nFeatCal on a synthetic pool ({len(pool.experts)} experts, random weights and images)")
    print("feature drift per block, summed over tasks (last block: CLS token):\n")
    print("| block | drift before | drift after | change |")
    print("|---|---|---|---|")
    for block in record["blocks"]:
        before = sum(block["drift_before"].values())
        after = sum(block["drift_after"].values())
        print(
            f"| {block['index']} | {before:.5f} | {after:.5f} | {100 * (after / before - 1):+.1f} % |"
        )
    print(f"\ncalibrated model: {out}  (record: {out / 'featcal.json'})")
    print("accuracy needs real experts and data: see the README")
    return 0


def _zoo(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    settings = None
    if args.params is not None:
        from featcal_core.params import load_params

        settings = load_params(args.params, args.set).zoo
        if settings is None:  # models and tasks are given directly: nothing to build
            placeholder = Path(args.out or "data/zoo")
            placeholder.mkdir(parents=True, exist_ok=True)
            (placeholder / "NO_ZOO.md").write_text(
                f"{args.params} has no zoo: section, so no zoo was built (the DVC zoo stage's "
                "output is this note).\n"
            )
            print(f"{args.params}: no zoo: section; nothing to build")
            return 0
    from featcal_core.zoo.build import PRESETS, build_zoo  # imports torch: after the early exit

    out = args.out
    if settings is not None:
        spec = settings.spec()
        out = out or str(settings.path)
    elif args.dataset:
        if args.preset is not None:
            raise FeatCalError("give --preset or --dataset TASK=DIR, not both")
        if args.modality is None:
            raise FeatCalError("--dataset needs --modality image or --modality text")
        template = PRESETS["vision" if args.modality == "image" else "text"]
        spec = dataclasses.replace(
            template, name=args.name, tasks=pairs("--dataset", args.dataset), base=args.base,
            optional=(), max_train=None,
        )  # fmt: skip
    elif args.preset is not None:
        spec = PRESETS[args.preset]
    else:
        raise FeatCalError("featcal zoo needs --preset vision|text, --dataset TASK=DIR or --params")
    changes = {"seed": args.seed, "pretrain_steps": args.pretrain_steps,
               "expert_steps": args.expert_steps}  # fmt: skip
    spec = dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})
    out = Path(out or f"data/zoo/{spec.name}")
    manifest = build_zoo(spec, out, rebuild=args.rebuild, progress=not args.no_progress)
    print(f"zoo {spec.name} in {out}: base {manifest['base']['repo_id']}")
    for entry in manifest["experts"].values():
        print(
            f"  expert {entry['repo_id']}: validation accuracy {entry['validation_accuracy']:.4f}"
        )
    for task, reason in manifest["skipped"].items():
        print(f"  task {task} left out: {reason}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.params is not None:
        return _step("calibrate")(args)
    missing = [f"--{n}" for n in ("base", "merged", "out") if getattr(args, n) is None]
    if missing:
        raise FeatCalError(f"featcal calibrate needs {', '.join(missing)} (or --params FILE)")
    from featcal_core.params import FeatCalSettings, featcal_from_flags

    # the flags that are params.yaml's featcal: fields, checked by that section's own model
    featcal_from_flags({name: getattr(args, name) for name in FeatCalSettings.model_fields
                        if hasattr(args, name)})  # fmt: skip
    from featcal_core import FeatCalParams, calibrate

    if args.results_dir is not None:
        if args.spill_dir is not None:
            raise FeatCalError(
                "--spill-dir has no effect with --results-dir: the flow keeps every hidden-state "
                "stream on disk in the results directory already; drop --spill-dir"
            )
        return _calibrate_flow(args)
    if args.runner != "local" or args.dask_address is not None:
        raise FeatCalError("--runner dask / --dask-address need --results-dir (the Prefect flow)")
    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    if args.heads:  # before the calibration, not after it
        from featcal_core.method.head_calibration import check_expert_heads

        check_expert_heads(experts, tokenizer_dir=args.base)
    record = calibrate(
        base=args.base,
        merged=args.merged,
        experts=experts,
        calib=calib,
        out=args.out,
        params=FeatCalParams(alpha=args.alpha, rho=args.rho, lam=args.lam, eps=args.eps),
        num_per_task=args.num_per_task,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        max_length=args.max_length,
        pooling=args.pooling,
        token_weighting=args.token_weighting,
        spill_dir=args.spill_dir,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    logging.getLogger("featcal").info(
        "calibrated %d blocks in %.1f s, peak RSS %.0f MB -> %s",
        len(record["blocks"]), record["wall_seconds"], record["peak_rss_bytes"] / 1e6, args.out,
    )  # fmt: skip
    if args.heads:
        from pathlib import Path

        from featcal_core.method.head_calibration import refit_expert_heads

        heads = refit_expert_heads(
            args.out, experts, calib,
            Path(args.out) / "heads", num_per_task=args.num_per_task, seed=args.seed,
            lam=args.head_lam, batch_size=args.batch_size, device=args.device,
            tokenizer_dir=args.base,
        )  # fmt: skip
        logging.getLogger("featcal").info("refit heads: %s", ", ".join(heads.values()))
    return 0


def _calibrate_flow(args: argparse.Namespace) -> int:
    from flows.environment import configure

    configure()
    from featcal_core import FeatCalParams
    from featcal_core.method.calibration import Settings
    from flows.calibration import calibration_flow, make_spec

    spec = make_spec(
        args.base,
        args.merged,
        pairs("--expert", args.expert),
        pairs("--calib", args.calib),
        args.results_dir,
        FeatCalParams(alpha=args.alpha, rho=args.rho, lam=args.lam, eps=args.eps),
        Settings(args.num_per_task, args.batch_size, args.seed, args.device, args.max_length,
                 args.pooling, args.token_weighting),
        args.runner, args.dask_address, args.dask_workers,
    )  # fmt: skip
    record = calibration_flow(spec, args.out, args.overwrite)
    computed = sum(not block["restored"] for block in record["blocks"])
    logging.getLogger("featcal").info(
        "%d blocks computed, %d restored -> %s",
        computed, len(record["blocks"]) - computed, args.out,
    )  # fmt: skip
    return 0


def _merge(args: argparse.Namespace) -> int:
    from featcal_cli import merge_command

    if args.params is not None:
        return _step("merge")(args)
    missing = [f"--{n}" for n in ("base", "method", "out") if getattr(args, n) is None]
    if missing:
        raise FeatCalError(f"featcal merge needs {', '.join(missing)} (or --params FILE)")
    return merge_command.run(args)


def _serve(args: argparse.Namespace) -> int:
    from flows.serve import serve

    serve(args.params, args.set, cron=args.cron, interval_s=args.interval)
    return 0


def _lineage(args: argparse.Namespace) -> int:
    from featcal_cli import lineage_command

    return lineage_command.run(args)


def _run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from flows.pipeline import run_pipeline

    summary = run_pipeline(params)
    print(json.dumps(summary, indent=2))
    return 0


COMMANDS = {
    "calibrate": _calibrate,
    "demo": _demo,
    "zoo": _zoo,
    "merge": _merge,
    "run": _run,
    "download": _step("download"),
    "calib-set": _step("calibration_sets"),
    "heads": _step("heads"),
    "evaluate": _step("evaluate"),
    "report": _step("report"),
    "lineage": _lineage,
    "serve": _serve,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tune_allocator()
    try:
        return COMMANDS[args.command](args)
    except FeatCalError as exc:
        print(f"featcal: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # one line naming the path, never a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(f"featcal: error:{where}: {exc.strerror or exc}; check that path (space, "
              "permissions, a read-only filesystem)", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
