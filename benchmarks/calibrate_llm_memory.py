"""Memory, time and disk reads of `featcal merge` + `featcal calibrate` on a 1.1 B-parameter Llama
(a benchmark, not a test).

What it builds (under --work, never holding a whole model in memory): a Llama-layout causal LM with
TinyLlama's geometry by default (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 kv heads,
vocab 32000: 1,100,048,384 parameters) and random weights stored in bf16, and four experts = base +
seeded random low-rank deltas (per 2-D weight scale · A @ B with rank --rank, entries of std
--delta; 1-D norm weights get small noise). Every tensor is generated on the fly from a generator
seeded by its name (base) or by (task, name) (delta), row chunk by row chunk, and written with
`featcal_core.io.safetensors_io.write_streaming` into sharded safetensors (shards of at most --shard-mb
MB, `model.safetensors.index.json`), with config.json and the offline word tokenizer
(`featcal_core.data.synthetic.word_tokenizer`) in the base. The layout (tensor names and shapes) comes
from a `LlamaForCausalLM` built on the `meta` device. Per task a `save_to_disk` calibration set of
16 random word sequences of about 128 tokens.

What it measures, per step, each in its own process: building (this script with --build-only),
`featcal merge` (Task Arithmetic) and `featcal calibrate` on CPU (`--num-per-task 16
--max-length 128 --spill-dir`, once per --precision: float32 and bfloat16 by default, with the
time per block of each against the first). For each: wall time; peak RSS of the process tree
(summed, psutil sampled every --poll s) and of the process itself (VmHWM as recorded in build.json, merge.json,
featcal.json); ru_maxrss of the child from wait4 and of all children (RUSAGE_CHILDREN) (caveat:
Linux carries the parent's RSS across fork+exec into it, which is why this parent imports neither
torch nor featcal); bytes read from storage
(`read_bytes` of /proc/<pid>/io, summed over the tree, last sample taken while the exited process
is still a zombie) and bytes passed through read() (`read_chars`). Input files are evicted from
the page cache first (fsync + POSIX_FADV_DONTNEED) so storage reads are cold; --warm-cache skips
that.

Target: peak RSS of `featcal calibrate` below the size of one expert checkpoint (≈ 2.2 GB at the
default geometry), i.e. memory bounded by about one block, not the model.

Beside each plain calibrate run it prints the memory model's prediction
(featcal_core/method/memory_model.py, via memory_prediction.py): peak RSS with the terms live at
the predicted peak, the time per block at GEMM rates measured on the spot, the bytes written and
read through files. --geometry takes a published geometry (e.g. llama-3.1-8b: hidden 4096,
intermediate 14336, 32 heads, 8 kv heads; the vocabulary stays --vocab), --dtype float32 stores
float32 weights (bfloat16 checkpoints run their passes in float32 under --precision float32 too,
holding float32 copies of their blocks and streams), --modes spill memory runs each precision both with
`--spill-dir` and in memory.

--flow-traffic 0 default runs the resumable flow (`--results-dir`) once per memory budget and
prints each run's bytes written and read, to show what holding a block's statistics in memory
saves (budget 0: every task's statistics go to a file and are read back).

--resume-check also runs the resumable flow (`--results-dir`): an uninterrupted reference run,
a run SIGKILLed (whole process group) once --kill-after block states are committed
(`<results>/states/*/manifest.json`, the stems' state included in the count as one more), and the
same command again; it compares the final shards bitwise with the reference and prints the
per-block restored/computed flags from featcal.json.

    .venv/bin/python benchmarks/calibrate_llm_memory.py [--work DIR] [--keep] [--resume-check]
    .venv/bin/python benchmarks/calibrate_llm_memory.py --hidden 128 --intermediate 256 \\
        --layers 2 --heads 4 --kv-heads 2 --vocab 512 --shard-mb 0.2    # a small smoke run
    .venv/bin/python benchmarks/calibrate_llm_memory.py --geometry llama-3.1-8b --layers 2 \\
        --vocab 1024 --dtype float32 --rows 8 --precision float32 --modes spill memory

The default geometry needs about 16 GB of disk (base and 4 experts 5 × 2.2 GB, merged and
calibrated 2 × 2.2 GB; about 23 GB with --resume-check: two more outputs and the per-block states)
and takes long on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import memory_prediction
from llm_pool import INDEX, POOL_OPTIONS, add_pool_arguments, build, resolve_geometry
from measure import MIB, Step, evict, measure

log = logging.getLogger("calibrate_llm_memory")


# ---------------------------------------------------------------------------------------------
# the outputs (the parent: stdlib only)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) + (path / INDEX).stat().st_size


def _committed(results: Path) -> int:
    """Committed states (the stems' and each finished block's) under a results directory."""
    states = results / "states"
    if not states.is_dir():
        return 0
    return sum(1 for p in states.iterdir() if (p / "manifest.json").is_file())


def same_weights(a: Path, b: Path) -> tuple[bool, list[str]]:
    """Whether a and b hold byte-identical weight files (shards and index); the differing names."""
    names = sorted(
        {
            p.name
            for d in (a, b)
            for p in d.iterdir()
            if p.suffix == ".safetensors" or p.name == INDEX
        }
    )
    differ = [
        n
        for n in names
        if not ((a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, False))
    ]
    return not differ, differ


def _record_peak(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["peak_rss_bytes"])
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------------------------------------


def _featcal(*args: str) -> list[str]:
    return [sys.executable, "-m", "featcal_cli.main", *args]


def _calibrate_args(
    pool: Path, tasks: list[str], merged: Path, out: Path, args, precision: str | None = None
) -> list[str]:
    """`featcal calibrate`'s arguments; `precision`: --precision (None: the first of
    --precision's list)."""
    cmd = ["calibrate", "--base", str(pool / "base"), "--merged", str(merged)]
    for task in tasks:
        cmd += ["--expert", f"{task}={pool / f'expert_{task}'}"]
        cmd += ["--calib", f"{task}={pool / f'calib_{task}'}"]
    return cmd + [
        "--out",
        str(out),
        "--device",
        args.device,
        "--num-per-task",
        str(args.rows),
        "--max-length",
        str(args.tokens),
        "--no-progress",
        "--overwrite",
        "--precision",
        precision or args.precision[0],
    ]


def resume_check(args, pool, tasks, merged, work, env, plain_out) -> tuple[list[Step], list[str]]:
    """Reference flow run, a run SIGKILLed after --kill-after committed blocks, the rerun."""
    lines: list[str] = []
    env = {**env, "PREFECT_HOME": str(work / "prefect")}
    env.pop("PREFECT_API_URL", None)
    logs = work / "logs"
    ref_out, ref_results = work / "calibrated_flow_ref", work / "results_ref"
    out, results = work / "calibrated_resumed", work / "results"
    for path in (ref_results, results):
        shutil.rmtree(path, ignore_errors=True)
    base_cmd = _featcal(*_calibrate_args(pool, tasks, merged, ref_out, args))
    reference = measure(
        "calibrate flow", base_cmd + ["--results-dir", str(ref_results)], env, logs, args.poll
    )
    reference.vmhwm = _record_peak(ref_out / "featcal.json")

    cmd = _featcal(*_calibrate_args(pool, tasks, merged, out, args))
    cmd += ["--results-dir", str(results)]
    want = args.kill_after + 1  # the stems' state + kill_after blocks
    killed = measure(
        "flow killed",
        cmd,
        env,
        logs,
        min(args.poll, 0.02),
        kill_when=lambda: _committed(results) >= want,
    )
    done = _committed(results) - 1
    if not killed.killed:
        lines.append(
            f"resume check: the run finished before {args.kill_after} blocks were "
            "committed; nothing was killed (use more --layers)"
        )
    else:
        lines.append(
            f"resume check: SIGKILL after {done} committed blocks "
            f"(of {args.layers}); out exists after the kill: {out.exists()}"
        )
    evict([pool, merged])
    resumed = measure("flow resumed", cmd, env, logs, args.poll)
    resumed.vmhwm = _record_peak(out / "featcal.json")
    record = json.loads((out / "featcal.json").read_text())
    blocks = record["blocks"]
    if record.get("peak_device_bytes"):
        lines.append(f"resumed run: peak device memory {record['peak_device_bytes'] / MIB:.0f} MiB")
    flags = [f"{b['index']}:{'restored' if b['restored'] else 'computed'}" for b in blocks]
    lines.append("per block: " + ", ".join(flags))
    expected = [i < max(done, 0) for i in range(len(blocks))] if killed.killed else None
    if expected is not None:
        ok = [b["restored"] for b in blocks] == expected
        lines.append(f"restored exactly blocks 0..{done - 1}: {'yes' if ok else 'NO'}")
    same, differ = same_weights(ref_out, out)
    lines.append(
        "resumed vs uninterrupted flow run: "
        + ("bitwise identical" if same else f"DIFFERENT ({', '.join(differ)})")
    )
    if plain_out is not None:
        same, differ = same_weights(plain_out, ref_out)
        lines.append(
            "flow run vs plain `featcal calibrate`: "
            + ("bitwise identical" if same else f"different ({', '.join(differ)})")
        )
    return [reference, killed, resumed], lines


def plain_calibrate(args, pool, tasks, merged, out, work, env, logs, steps) -> list[str]:
    """`featcal calibrate` (no flow) once per --precision and --modes (spill: `--spill-dir`,
    memory: streams and statistics in memory): the memory figure and the time per block of each,
    beside the memory model's prediction; appends their Steps (`out` is the first run's
    output)."""
    lines, per_block = [], {}
    built = json.loads((pool / "build.json").read_text())
    measured = memory_prediction.baseline(env)
    baseline = measured["rss"]
    lines.append(
        f"process baseline (imports, measured): {baseline / MIB:.0f} MiB resident, "
        f"{measured['read'] / 1e6:.0f} MB read"
    )
    rates = None
    first = (args.precision[0], args.modes[0])
    for precision in args.precision:
        for mode in args.modes:
            name = f"{precision}" + ("" if mode == "spill" else " in memory")
            target = out if (precision, mode) == first else out.with_name(f"{out.name}_{mode}")
            if not args.warm_cache:
                evict([pool, merged])
            cmd = _calibrate_args(pool, tasks, merged, target, args, precision)
            if mode == "spill":
                cmd += ["--spill-dir", str(work / "spill")]
            step = measure(f"calibrate {name}", _featcal(*cmd), env, logs, args.poll)
            step.vmhwm = _record_peak(target / "featcal.json")
            steps.append(step)
            record = json.loads((target / "featcal.json").read_text())
            block_s = [b["seconds"] for b in record["blocks"]]
            per_block[(precision, mode)] = sum(block_s) / len(block_s)
            ran = record["hyperparameters"]
            lines.append(
                f"calibrate {name}: {len(block_s)} blocks, {sum(block_s):.1f} s in blocks "
                f"(mean {per_block[(precision, mode)]:.2f} s), record wall "
                f"{record['wall_seconds']} s; ran {ran.get('precision')} "
                f"({ran.get('precision_reason')}), products {ran.get('products_precision')}"
            )
            spill_left = _dir_bytes(work / "spill") if (work / "spill").exists() else 0
            lines.append(f"spill directory after the run: {spill_left} bytes")
            geometry, workload = memory_prediction.workload(
                built, args, record, mode == "spill", baseline
            )
            if rates is None:
                names = [workload.activation_dtype, workload.products, "float64"]
                rates = memory_prediction.gemm_rates(env, names)
            lines += memory_prediction.compare(
                f"calibrate {name}", step, record, geometry, workload, rates, measured["read"]
            )
            if target != out:
                shutil.rmtree(target, ignore_errors=True)
    for precision in args.precision[1:]:
        mode = args.modes[0]
        lines.append(
            f"time per block, {precision} / {first[0]}: "
            f"{per_block[(precision, mode)] / per_block[first]:.2f}"
        )
    return lines


def flow_traffic(args, pool, tasks, merged, work, env) -> tuple[list[Step], list[str]]:
    """One resumable flow run per --flow-traffic budget: the disk traffic of each, side by side."""
    env = {**env, "PREFECT_HOME": str(work / "prefect")}
    env.pop("PREFECT_API_URL", None)
    steps: list[Step] = []
    for budget in args.flow_traffic:
        out, results = work / f"calibrated_budget_{budget}", work / f"results_budget_{budget}"
        shutil.rmtree(results, ignore_errors=True)
        cmd = _featcal(*_calibrate_args(pool, tasks, merged, out, args))
        cmd += ["--results-dir", str(results)]
        if budget != "default":
            cmd += ["--memory-budget", budget]
        if not args.warm_cache:
            evict([pool, merged])
        step = measure(f"flow, memory budget {budget}", cmd, env, work / "logs", args.poll)
        step.vmhwm = _record_peak(out / "featcal.json")
        steps.append(step)
        blocks = json.loads((out / "featcal.json").read_text())["blocks"]
        held = sorted({str(b.get("statistics", {}).get("held")) for b in blocks})
        steps[-1].label += f" [{', '.join(held)}]"
        shutil.rmtree(results, ignore_errors=True)
    lines = []
    if len(steps) == 2:  # the run that moved more bytes over the one that moved fewer
        more, fewer = sorted(steps, key=lambda s: s.write_chars + s.read_chars, reverse=True)
        total = (more.write_chars + more.read_chars) / max(fewer.write_chars + fewer.read_chars, 1)
        lines.append(
            f"flow traffic, {more.label} over {fewer.label}: written "
            f"{more.write_chars / max(fewer.write_chars, 1):.1f}x, read() "
            f"{more.read_chars / max(fewer.read_chars, 1):.1f}x, both {total:.1f}x"
        )
    return steps, lines


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def report(info: dict, steps: list[Step], extra_lines: list[str]) -> None:
    expert = info["expert_bytes"]
    print()
    print(
        f"model: Llama {info['geometry']}, {info['parameters']:,} parameters "
        f"({info['parameters'] / 1e9:.3f} B), {info['dtype']}, {info['shards']} shards per "
        "checkpoint"
    )
    print(
        f"one expert checkpoint: {_gb(expert)}; {info['experts']} experts: "
        f"{_gb(expert * info['experts'])}; merged: {_gb(info['merged_bytes'])}"
    )
    print(f"page cache: {'warm' if info['warm'] else 'inputs evicted before each step'}")
    print()
    header = (
        "| step | wall (s) | peak RSS tree (MiB) | VmHWM, own record (MiB) | ru_maxrss (MiB) "
        "| read from storage (MB) | read() (MB) | written (MB) | peak RSS < one expert |"
    )
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for s in steps:
        vmhwm = f"{s.vmhwm / MIB:.0f}" if s.vmhwm is not None else "-"
        below = "yes" if s.peak_rss < expert else "no"
        note = " (killed)" if s.killed else ""
        print(
            f"| {s.label}{note} | {s.wall_s:.1f} | {s.peak_tree_rss / MIB:.0f} | {vmhwm} "
            f"| {s.ru_maxrss / MIB:.0f} | {s.read_bytes / 1e6:.1f} | {s.read_chars / 1e6:.1f} "
            f"| {s.write_chars / 1e6:.1f} | {below} |"
        )
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"\nru_maxrss of all children (RUSAGE_CHILDREN, the largest): {children / MIB:.0f} MiB")
    print(
        "storage reads from rusage (ru_inblock × 512, MB): "
        + ", ".join(f"{s.label} {s.inblock_bytes / 1e6:.1f}" for s in steps)
    )
    for line in extra_lines:
        print(line)
    for calib in (s for s in steps if s.label.startswith("calibrate ")):
        met = calib.peak_rss < expert
        print(
            f"\ntarget: peak RSS of featcal {calib.label} {calib.peak_rss / 1e9:.3f} GB < one "
            f"expert checkpoint {expert / 1e9:.3f} GB: {'MET' if met else 'NOT MET'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pool_arguments(parser, layers=22)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep what was written under --work (a kept pool with the same settings is reused)",
    )
    parser.add_argument("--poll", type=float, default=0.2, help="sampling interval (s)")
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="do not evict the inputs from the page cache before each step",
    )
    parser.add_argument(
        "--resume-check",
        action="store_true",
        help="also SIGKILL a --results-dir run mid-way, rerun, compare bitwise",
    )
    parser.add_argument(
        "--kill-after",
        type=int,
        default=2,
        help="resume check: kill once this many blocks are committed",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where `featcal calibrate` runs (peak RSS is the target on cpu)",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["auto", "float64", "float32", "bfloat16"],
        help="one plain `featcal calibrate` per precision, side by side (time per block against "
        "the first); the resume check and the flow-traffic runs use the first",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["spill"],
        choices=["spill", "memory"],
        help="plain `featcal calibrate` runs per precision: spill (--spill-dir: streams and "
        "per-task statistics on disk) and/or memory (both held in memory)",
    )
    parser.add_argument(
        "--skip-plain",
        action="store_true",
        help="with --resume-check: skip the plain `featcal calibrate --spill-dir` run",
    )
    parser.add_argument(
        "--flow-traffic",
        nargs="+",
        metavar="GIB",
        default=None,
        help="run the resumable flow once per memory budget (GiB, or 'default') and report "
        "each run's disk traffic, e.g. --flow-traffic 0 default",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="only build the pool under --work/pool (what the build step runs)",
    )
    args = parser.parse_args()
    resolve_geometry(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    created_work = args.work is None
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-llm-bench-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    pool = work / "pool"
    if args.build_only:
        build(args, pool)
        return
    if args.skip_plain and not (args.resume_check or args.flow_traffic):
        parser.error("--skip-plain leaves nothing to run without --resume-check or --flow-traffic")
    if args.resume_check and args.kill_after >= args.layers:
        parser.error(f"--kill-after {args.kill_after} needs more than that many --layers")

    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PREFECT_HOME": str(work / "prefect"),
    }
    logs = work / "logs"
    spec = {k: getattr(args, k) for k in POOL_OPTIONS}
    steps: list[Step] = []
    made = ["logs", "pool", "merged", "calibrated", "spill", "prefect"]
    try:
        try:
            existing = json.loads((pool / "build.json").read_text())
        except (OSError, ValueError):
            existing = None
        if existing is not None and existing["spec"] == spec:
            log.info("reusing the pool in %s", pool)
        else:
            shutil.rmtree(pool, ignore_errors=True)
            options = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in POOL_OPTIONS]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--build-only"]
            cmd += ["--work", str(work), *options]
            steps.append(measure("build", cmd, env, logs, args.poll))
            steps[-1].vmhwm = _record_peak(pool / "build.json")
        built = json.loads((pool / "build.json").read_text())
        tasks = built["tasks"]
        experts = [pool / f"expert_{t}" for t in tasks]

        merged = work / "merged"
        if not args.warm_cache:
            evict([pool / "base", *experts])
        cmd = [
            "merge",
            "--base",
            str(pool / "base"),
            "--method",
            "task_arithmetic",
            "--scale",
            str(args.scale),
            "--out",
            str(merged),
            "--overwrite",
            "--no-progress",
        ]
        cmd += [f"--expert={task}={path}" for task, path in zip(tasks, experts, strict=True)]
        step = measure("merge", _featcal(*cmd), env, logs, args.poll)
        step.vmhwm = _record_peak(merged / "merge.json")
        steps.append(step)

        out = None if args.skip_plain else work / "calibrated"
        lines: list[str] = []
        if out is not None:
            lines = plain_calibrate(args, pool, tasks, merged, out, work, env, logs, steps)

        if args.resume_check:
            if not args.warm_cache:
                evict([pool, merged])
            made += ["calibrated_flow_ref", "results_ref", "calibrated_resumed", "results"]
            more, resume_lines = resume_check(args, pool, tasks, merged, work, env, out)
            steps += more
            lines += resume_lines

        if args.flow_traffic:
            made += [
                f"{kind}_budget_{b}"
                for b in args.flow_traffic
                for kind in ("calibrated", "results")
            ]
            more, traffic_lines = flow_traffic(args, pool, tasks, merged, work, env)
            steps += more
            lines += traffic_lines

        geometry = (
            f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
            f"{args.heads} heads, {args.kv_heads} kv heads, vocab {args.vocab}, "
            f"{args.rows} texts of <= {args.tokens} tokens per task"
        )
        info = {
            "geometry": geometry,
            "parameters": built["parameters"],
            "shards": built["shards"],
            "experts": len(tasks),
            "expert_bytes": _weight_bytes(experts[0]),
            "merged_bytes": _weight_bytes(merged),
            "warm": args.warm_cache,
            "dtype": args.dtype,
        }
        report(info, steps, lines)
    finally:
        if created_work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:
            for name in made:
                shutil.rmtree(work / name, ignore_errors=True)
        else:
            print(f"\nkept {work}")


if __name__ == "__main__":
    main()
