"""featcal against the authors' FeatCal loop, side by side in one run (a benchmark, not a test).

For each expert count T: the reference's pool builder writes a ViT-B/32-geometry pool (random
base, experts = base + 2 % noise, Task Arithmetic 0.3, N random images per task) as checkpoints;
then, round after round, the authors' loop (its own process, its own in-memory copy of the same
pool) and `featcal calibrate` on the files (its own process, α 0.25, ρ 2.2, λ 0.05, as the
authors' defaults) run one after the other, the order alternating between rounds.

Two ratios per round. *Like for like*: the authors' `calibrate()` call (stems and blocks of models
already in memory, its inputs random tensors made before the clock) against featcal's stems and
blocks (the record's "stage_seconds"). *Whole run*: featcal's record `wall_seconds`, which adds
its setup (checks, opening the checkpoints, their digests, reading and preprocessing the
calibration images) and the checkpoint's export. The process wall of `featcal calibrate`
(imports and start-up included) is printed too. Then featcal's floor on this machine: its
counted FLOPs per phase (benchmarks/flops.py) at the float32 and float64 GEMM rates measured at
the start, as seconds and as a fraction of the authors' mean time (the fastest featcal could be
here, every product at the GEMM peak). With --authors-phases, one more run of the authors' loop
under cProfile gives its time per phase (forwards, statistics, solves), beside featcal's.

The reference (the authors' package and its two scripts) is run as separate processes and never
imported: pass its folder with --reference (default: $FEATCAL_REFERENCE, else
../shared/reference beside the repository).

    .venv/bin/python benchmarks/authors_side_by_side.py [--experts 4 8] [--images 32]
        [--rounds 2] [--layers L] [--precision float32] [--authors-phases] [--reference DIR]
        [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from flops import counted_flops, floor_seconds, gemm_rate

REPO = Path(__file__).resolve().parent.parent
PHASES = ("read", "forward", "statistics", "solve")


def reference_folder(given: Path | None) -> Path:
    """The folder holding authors_loop.py and vit_b32_pool.py (exits with a message if absent)."""
    folder = given or Path(os.environ.get("FEATCAL_REFERENCE", REPO.parent / "shared/reference"))
    for script in ("authors_loop.py", "vit_b32_pool.py"):
        if not (folder / script).is_file():
            sys.exit(f"{folder / script} not found; pass the reference folder with --reference")
    return folder


def build_pool(reference: Path, out: Path, tasks: int, images: int, layers: int | None) -> None:
    cmd = [sys.executable, str(reference / "vit_b32_pool.py"), str(out), str(tasks), str(images)]
    subprocess.run([*cmd, *([str(layers)] if layers else [])], check=True)


def run_authors(reference: Path, tasks: int, images: int, layers: int | None) -> dict:
    """{"seconds", "peak_rss_mb"} of one run of the authors' loop, in its own process."""
    cmd = [sys.executable, str(reference / "authors_loop.py"), str(tasks), str(images), "b32"]
    done = subprocess.run(
        [*cmd, *([str(layers)] if layers else [])], check=True, capture_output=True, text=True
    )
    line = [row for row in done.stdout.splitlines() if row.startswith("{")][-1]
    return json.loads(line)


def authors_phases(reference: Path, tasks: int, images: int, layers: int | None, work: Path):
    """Seconds per phase of one run of the authors' loop under cProfile (its own process; the
    profile file is read back with pstats): "forward" (every CLIP encoder layer pass),
    "statistics" (their statistics pass less its forwards), "solve" (their closed forms) and
    "total" (the `calibrate()` call). cProfile's own overhead is included."""
    profile = work / "authors.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(profile)]
    cmd += [str(reference / "authors_loop.py"), str(tasks), str(images), "b32"]
    subprocess.run([*cmd, *([str(layers)] if layers else [])], check=True, capture_output=True)
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    cumulative: dict[str, float] = {}
    layer_forward = 0.0
    for (filename, _line, function), (_cc, _nc, _tt, cum, _callers) in stats.items():
        if filename.endswith("modeling_clip.py") and function == "forward":
            layer_forward = max(layer_forward, cum)  # the encoder layer holds the others
        elif (
            function
            in (
                "collect_layer_statistics",
                "merge_layer_parameters_with_featcal_stats",
                "_forward_student_batches",
                "calibrate",
            )
            and "featcal" in filename
        ):
            cumulative[function] = cumulative.get(function, 0.0) + cum
    profile.unlink()
    stats_forward = layer_forward - cumulative.get("_forward_student_batches", 0.0)
    return {
        "forward": layer_forward,
        "statistics": cumulative.get("collect_layer_statistics", 0.0) - stats_forward,
        "solve": cumulative.get("merge_layer_parameters_with_featcal_stats", 0.0),
        "total": cumulative.get("calibrate", 0.0),
    }


def run_featcal(pool: Path, tasks: int, images: int, precision: str, work: Path) -> dict:
    """Wall, process wall, phases and peak RSS of one `featcal calibrate` on the pool's files."""
    out = work / "featcal_out"
    cmd = [sys.executable, "-m", "featcal_cli.main", "calibrate"]
    cmd += ["--base", str(pool / "base"), "--merged", str(pool / "merged"), "--out", str(out)]
    for t in range(tasks):
        cmd += [
            "--expert",
            f"t{t}={pool / f'expert_t{t}'}",
            "--calib",
            f"t{t}={pool / f'calib_t{t}'}",
        ]
    cmd += ["--alpha", "0.25", "--rho", "2.2", "--lam", "0.05", "--num-per-task", str(images)]
    cmd += ["--precision", precision, "--device", "cpu", "--overwrite", "--no-progress"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=work)
    process = time.perf_counter() - started
    record = json.loads((out / "featcal.json").read_text())
    shutil.rmtree(out)
    phases = {p: sum(b.get("phases", {}).get(p, 0.0) for b in record["blocks"]) for p in PHASES}
    stages = record.get("stage_seconds", {})
    return {
        "seconds": record["wall_seconds"],
        "stems_blocks_seconds": stages.get("stems", 0.0) + stages.get("blocks", 0.0),
        "stage_seconds": stages,
        "process_seconds": process,
        "blocks_seconds": sum(b["seconds"] for b in record["blocks"]),
        "phases": phases,
        "peak_rss_mb": record["peak_rss_bytes"] / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--images", type=int, default=32, help="calibration images per task")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 12)")
    parser.add_argument(
        "--precision", default="float32", choices=["float32", "float64", "bfloat16", "auto"]
    )
    parser.add_argument(
        "--authors-phases",
        action="store_true",
        help="one more run of the authors' loop under cProfile, for its time per phase",
    )
    parser.add_argument("--reference", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    reference = reference_folder(args.reference)
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-side-by-side-"))
    work.mkdir(parents=True, exist_ok=True)
    rates = {"float32": gemm_rate(torch.float32), "float64": gemm_rate(torch.float64)}
    rates["bfloat16"] = rates["float32"]  # unused: the floor is taken for float32 products
    print(
        f"GEMM rates: float32 {rates['float32'] / 1e9:.0f}, float64 {rates['float64'] / 1e9:.0f} "
        "GFLOP/s"
    )
    rows = []
    print(
        "| experts | round | authors (s) | featcal stems + blocks (s) | ratio | featcal whole "
        "run (s) | ratio | featcal process (s) | read / forward / statistics / solve (s) | "
        "peak RSS featcal / authors (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tasks in args.experts:
        pool = work / f"pool_{tasks}"
        build_pool(reference, pool, tasks, args.images, args.layers)
        for round_index in range(args.rounds):
            order = ["authors", "featcal"] if round_index % 2 == 0 else ["featcal", "authors"]
            got = {}
            for who in order:
                if who == "authors":
                    got[who] = run_authors(reference, tasks, args.images, args.layers)
                else:
                    got[who] = run_featcal(pool, tasks, args.images, args.precision, work)
            authors, ours = got["authors"], got["featcal"]
            ratio = ours["stems_blocks_seconds"] / authors["seconds"]
            whole = ours["seconds"] / authors["seconds"]
            phases = " / ".join(f"{ours['phases'][p]:.1f}" for p in PHASES)
            print(
                f"| {tasks} | {round_index + 1} | {authors['seconds']:.1f} | "
                f"{ours['stems_blocks_seconds']:.1f} | ×{ratio:.2f} | {ours['seconds']:.1f} | "
                f"×{whole:.2f} | {ours['process_seconds']:.1f} | {phases} | "
                f"{ours['peak_rss_mb']:.0f} / {authors['peak_rss_mb']:.0f} |",
                flush=True,
            )
            rows.append(
                {
                    "experts": tasks,
                    "round": round_index + 1,
                    "ratio": ratio,
                    "ratio_whole_run": whole,
                    **got,
                }
            )
        if args.authors_phases:
            profiled = authors_phases(reference, tasks, args.images, args.layers, work)
            mean = {
                p: sum(r["featcal"]["phases"][p] for r in rows if r["experts"] == tasks)
                / args.rounds
                for p in ("forward", "statistics", "solve")
            }
            print(
                f"phases, {tasks} experts (s): authors under cProfile forward "
                f"{profiled['forward']:.1f}, statistics {profiled['statistics']:.1f}, solve "
                f"{profiled['solve']:.1f}, calibrate() {profiled['total']:.1f}; featcal's mean "
                f"forward {mean['forward']:.1f}, statistics {mean['statistics']:.1f}, solve "
                f"{mean['solve']:.1f}",
                flush=True,
            )
            rows.append({"experts": tasks, "authors_phases": profiled, "featcal_phases": mean})
        shutil.rmtree(pool)
        flops = counted_flops(768, 3072, 50, args.layers or 12, tasks, args.images)
        floor = floor_seconds(flops, rates, "float32")
        authors_mean = sum(
            r["authors"]["seconds"] for r in rows if r["experts"] == tasks and "authors" in r
        )
        authors_mean /= args.rounds
        print(
            f"floor, {tasks} experts: forward {floor['forward']:.1f} s, statistics "
            f"{floor['statistics']:.1f} s, solve {floor['solve']:.1f} s; total "
            f"{sum(floor.values()):.1f} s = ×{sum(floor.values()) / authors_mean:.2f} of the "
            f"authors' mean; the forwards alone ×{floor['forward'] / authors_mean:.2f}",
            flush=True,
        )
    (work / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    print(f"rows: {work / 'side_by_side.json'}")


if __name__ == "__main__":
    main()
