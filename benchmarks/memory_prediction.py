"""The memory model (featcal_core/method/memory_model.py) beside a measured `featcal calibrate`
of calibrate_llm_memory.py: predicted and measured peak RSS, time per block and bytes through
files. The measuring parent imports no torch; the process baseline and the GEMM rates the model
needs are measured in child processes.

- baseline: VmRSS (and bytes read) of a fresh process once it has imported what `featcal calibrate` imports
  (torch, transformers' Llama modules, datasets, the featcal CLI) and run one GEMM per dtype (the
  BLAS's own buffers);
- GEMM rates: `flops.gemm_rate` (1024-wide square products, about a second each) per dtype the
  run uses (forward: the passes' dtype, precision.pass_dtype; statistics: the products'; solve:
  float64).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from featcal_core.method import memory_model as mm

HERE = Path(__file__).resolve().parent
GB = 1e9
MIB = 2**20

_BASELINE = """
import json, torch, datasets, featcal_cli.main, featcal_core.method.calibration
import transformers.models.llama.modeling_llama
for dtype in (torch.float32, torch.float64):
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.mm(a, a)
    del a, b
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:")]
read = [int(l.split()[1]) for l in open("/proc/self/io") if l.startswith("rchar:")]
print(json.dumps({"rss": rss[0], "read": read[0]}))
"""

_RATES = """
import json, sys
sys.path.insert(0, {here!r})
import torch, flops
print(json.dumps({{name: flops.gemm_rate(getattr(torch, name), size=1024, seconds=1.0)
                  for name in {names!r}}}))
"""


def _child(code: str, env: dict[str, str]):
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline(env: dict[str, str]) -> dict[str, int]:
    """{"rss": resident bytes, "read": bytes through read()} of a process once it has imported
    what `featcal calibrate` does."""
    return _child(_BASELINE, env)


def gemm_rates(env: dict[str, str], names: list[str]) -> dict[str, float]:
    """FLOP/s of 1024-wide GEMMs per dtype name, on all threads of this machine."""
    return _child(_RATES.format(here=str(HERE), names=sorted(set(names))), env)


def workload(built: dict, args, record: dict, spill: bool, baseline: int):
    """(Geometry, Workload) of a finished run: the pool's geometry and calibration lengths
    (build.json), the precision it ran (its featcal.json)."""
    geometry = mm.Geometry(
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.layers, args.vocab
    )
    lengths = built.get("calibration") or {
        t: {"padded": args.tokens, "tokens": args.rows * args.tokens} for t in built["tasks"]
    }
    work = mm.Workload(
        tasks=len(built["tasks"]),
        inputs=args.rows,
        tokens=max(c["padded"] for c in lengths.values()),
        real_tokens=min(c["tokens"] for c in lengths.values()),
        precision=record["hyperparameters"]["precision"],
        weight_bytes=4 if args.dtype == "float32" else 2,
        spill=spill,
        device=args.device,
        baseline_bytes=baseline,
    )
    return geometry, work


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB ({n / MIB:.0f} MiB)"


def compare(
    label: str, step, record: dict, geometry, work, rates: dict[str, float], imports_read: int
) -> list:
    """Lines: predicted against measured peak RSS, time per block and file traffic
    (`imports_read`: what importing the stack reads, added to the prediction)."""
    estimate = mm.estimate(geometry, work)
    host = estimate["host"]
    predicted = host["peak_bytes"]
    own = step.vmhwm or 0
    ratio = own / predicted
    lines = [
        f"model vs measured, {label}: peak RSS predicted {_gb(predicted)} (at: {host['phase']}); "
        f"measured {_gb(own)} (VmHWM, own record), {_gb(step.peak_tree_rss)} (process tree); "
        f"measured / predicted {ratio:.3f} (within 15 %: {'yes' if abs(ratio - 1) <= 0.15 else 'NO'})",
        "  terms live at the predicted peak: "
        + ", ".join(f"{term} {n / GB:.3f}" for term, n in host["live"].items())
        + " (GB)",
        "  predicted high-water mark per phase (GB): "
        + ", ".join(f"{p} {n / GB:.2f}" for p, n in estimate["phases"]["host"].items()),
    ]
    blocks = record["blocks"]
    measured = sum(b["seconds"] for b in blocks) / len(blocks)
    phases = {
        p: sum(b.get("phases", {}).get(p, 0.0) for b in blocks) / len(blocks)
        for p in ("read", "forward", "statistics", "solve")
    }
    floor = mm.seconds(estimate, rates)
    lines.append(
        f"  time per block: measured {measured:.1f} s (read {phases['read']:.1f} / forward "
        f"{phases['forward']:.1f} / statistics {phases['statistics']:.1f} / solve "
        f"{phases['solve']:.1f}); model floor at the measured GEMM rates ("
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(rates.items()))
        + f" GFLOP/s): forward {floor['forward']:.1f} / statistics {floor['statistics']:.1f} / "
        f"solve {floor['solve']:.1f} = {floor['total']:.1f} s; counted TFLOP per block: "
        + " / ".join(f"{v / 1e12:.2f}" for v in estimate["flops_per_block"].values())
    )
    disk = mm.run_disk(geometry, work)
    disk["read"] += imports_read
    per = estimate["disk_per_block"]
    hashing = (work.tasks + 2) * geometry.parameters() * work.weight_bytes
    lines.append(
        f"  files: written predicted {disk['written'] / GB:.2f} GB, measured (write()) "
        f"{step.write_chars / GB:.2f} GB; read predicted {disk['read'] / GB:.2f} GB (imports included; + up to "
        f"{hashing / GB:.2f} GB hashing inputs the digest store lacks), measured (read()) "
        f"{step.read_chars / GB:.2f} GB; per block: statistics files written "
        f"{per['statistics written'] / GB:.2f} GB and read back {per['statistics read'] / GB:.2f}"
        f" GB; work directory at most {disk['work directory peak'] / GB:.2f} GB"
    )
    return lines


#: GEMM rates of one H200 (torch 2.11, float32 as TF32), measured by `benchmarks/device_check.sh`
#: at commit a6134c9 (benchmarks/results/gpu_h200_a6134c9.md)
H200_RATES = {"bfloat16": 657782e9, "float32": 305005e9, "float64": 52270e9}


def table(rates: dict[str, float], tasks: int, inputs: int, tokens: int) -> list[str]:
    """The prediction table of docs/benchmarks.md: per published geometry, one block's sizes, the
    host peak on this CPU (float32, bfloat16 checkpoints' bytes) spilled and in memory, the spill
    directory and traffic, the FLOPs and time per block at `rates` (this CPU) and on an H200
    (bfloat16, statistics in device memory)."""
    rows = [
        "| model | block: parameters, weights (bf16) | one task's statistics (float64) | host "
        "peak, CPU, `--spill-dir` | host peak, CPU, in memory | spill directory at most | "
        "statistics files per block (written = read) | TFLOP per block (forward / statistics "
        "/ solve) | s per block, this CPU (floor) | H200: device peak / host peak (in memory) "
        "| s per block, H200 (floor) | whole model: this CPU / H200 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("tinyllama-1.1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b"):
        geometry = mm.GEOMETRIES[name]
        shape = {"tasks": tasks, "inputs": inputs, "tokens": tokens, "weight_bytes": 2}
        spill = mm.Workload(**shape, precision="float32", spill=True)
        held = mm.Workload(**shape, precision="float32", spill=False)
        gpu = mm.Workload(**shape, precision="bfloat16", spill=False, device="cuda")
        on_disk, in_memory = mm.estimate(geometry, spill), mm.estimate(geometry, held)
        device = mm.estimate(geometry, gpu)
        cpu_s = mm.seconds(on_disk, {**rates, "bfloat16": rates["float32"]})["total"]
        gpu_s = mm.seconds(device, H200_RATES)["total"]
        flops = on_disk["flops_per_block"]
        terms = on_disk["terms"]
        task_bytes = terms["one task's statistics file"]
        hours = geometry.layers * cpu_s / 3600
        rows.append(
            f"| {name} | {geometry.block_parameters() / 1e6:.0f} M, "
            f"{terms['block weights (one model)'] / GB:.2f} GB | "
            f"{task_bytes / GB:.2f} GB | "
            f"{on_disk['host']['peak_bytes'] / GB:.1f} GB | "
            f"{in_memory['host']['peak_bytes'] / GB:.1f} GB | "
            f"{mm.run_disk(geometry, spill)['work directory peak'] / GB:.0f} GB | "
            f"{on_disk['disk_per_block']['statistics written'] / GB:.1f} GB | "
            + " / ".join(f"{v / 1e12:.1f}" for v in flops.values())
            + f" | {cpu_s:,.0f} | {device['device']['peak_bytes'] / GB:.1f} / "
            f"{device['host']['peak_bytes'] / GB:.1f} GB | {gpu_s:.2f} | {hours:,.0f} h / "
            f"{geometry.layers * gpu_s / 60:.1f} min |"
        )
    return rows


def main() -> None:
    import argparse
    import os

    parser = argparse.ArgumentParser(description="the memory model's table for docs/benchmarks.md")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--inputs", type=int, default=256, help="calibration inputs per task")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per input")
    parser.add_argument(
        "--rates",
        type=json.loads,
        default=None,
        help='this CPU\'s GEMM rates as JSON, e.g. \'{"float32": 17e9, "float64": 11e9}\' '
        "(default: measured now)",
    )
    args = parser.parse_args()
    rates = args.rates or gemm_rates(dict(os.environ), ["float32", "float64"])
    print(
        f"{args.tasks} tasks, {args.inputs} inputs of {args.tokens} tokens per task; this CPU: "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(rates.items()))
        + " GFLOP/s"
    )
    print("\n".join(table(rates, args.tasks, args.inputs, args.tokens)))


if __name__ == "__main__":
    main()
