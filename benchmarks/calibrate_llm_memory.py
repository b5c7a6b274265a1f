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
--max-length 128 --spill-dir`). For each: wall time; peak RSS of the process tree (summed, psutil
sampled every --poll s) and of the process itself (VmHWM as recorded in build.json, merge.json,
featcal.json); ru_maxrss of the child from wait4 and of all children (RUSAGE_CHILDREN) (caveat:
Linux carries the parent's RSS across fork+exec into it, which is why this parent imports neither
torch nor featcal); bytes read from storage
(`read_bytes` of /proc/<pid>/io, summed over the tree, last sample taken while the exited process
is still a zombie) and bytes passed through read() (`read_chars`). Input files are evicted from
the page cache first (fsync + POSIX_FADV_DONTNEED) so storage reads are cold; --warm-cache skips
that.

Target: peak RSS of `featcal calibrate` below the size of one expert checkpoint (≈ 2.2 GB at the
default geometry), i.e. memory bounded by about one block, not the model.

--resume-check also runs the resumable flow (`--results-dir`): an uninterrupted reference run,
a run SIGKILLed (whole process group) once --kill-after block states are committed
(`<results>/states/*/manifest.json`, the stems' state included in the count as one more), and the
same command again; it compares the final shards bitwise with the reference and prints the
per-block restored/computed flags from featcal.json.

    .venv/bin/python benchmarks/calibrate_llm_memory.py [--work DIR] [--keep] [--resume-check]
    .venv/bin/python benchmarks/calibrate_llm_memory.py --hidden 128 --intermediate 256 \\
        --layers 2 --heads 4 --kv-heads 2 --vocab 512 --shard-mb 0.2    # a small smoke run

The default geometry needs about 16 GB of disk (base and 4 experts 5 × 2.2 GB, merged and
calibrated 2 × 2.2 GB; about 23 GB with --resume-check: two more outputs and the per-block states)
and takes long on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger("calibrate_llm_memory")

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"  # featcal_core.io.checkpoint.INDEX_NAME (not imported here)
MIB = 2**20
#: elements per generated float32 row chunk (16 MiB)
CHUNK = 1 << 22
#: options that define the built pool (passed to the --build-only process, recorded in build.json)
POOL_OPTIONS = (
    "hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "rank", "delta",
    "norm_delta", "shard_mb", "experts", "rows", "tokens", "seed",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# building (runs in the --build-only process; imports torch lazily)


def _seed(*parts: object) -> int:
    """A 63-bit generator seed from its parts (stable across processes and runs)."""
    digest = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _layout(args) -> tuple[object, list[tuple[str, tuple[int, ...]]], object]:
    """(LlamaConfig, [(name, shape)] in state_dict order, tokenizer); allocates no weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from featcal_core.data.synthetic import word_tokenizer

    tokenizer = word_tokenizer()
    if args.vocab < len(tokenizer):
        raise SystemExit(f"--vocab {args.vocab} is smaller than the tokenizer's {len(tokenizer)}")
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.tokens),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    del model
    return config, tensors, tokenizer


def _shards(tensors, max_bytes: int) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most max_bytes (bf16) each (a larger tensor
    gets a shard of its own)."""
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, "BF16", shape))
        size += nbytes
    return shards


def _base_chunks(name: str, shape: tuple[int, ...], seed: int):
    """The base tensor `name` as float32 row chunks (start, stop, chunk): N(0, 0.02²) weights,
    norm weights 1. The same chunks every call."""
    import torch

    if len(shape) == 1:
        yield 0, shape[0], torch.ones(shape)
        return
    gen = torch.Generator().manual_seed(_seed(seed, "base", name))
    rows = max(1, CHUNK // shape[1])
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        yield start, stop, torch.randn((stop - start, shape[1]), generator=gen).mul_(0.02)


def _fetcher(shapes: dict[str, tuple[int, ...]], args, task: str | None) -> Callable:
    """fetch(name) → the bf16 tensor of the base (task None) or of expert `task`."""
    import torch

    def fetch(name: str):
        shape = shapes[name]
        out = torch.empty(shape, dtype=torch.bfloat16)
        if task is None:
            for start, stop, chunk in _base_chunks(name, shape, args.seed):
                out[start:stop] = chunk
            return out
        gen = torch.Generator().manual_seed(_seed(args.seed, "delta", task, name))
        if len(shape) == 1:
            noise = torch.randn(shape, generator=gen).mul_(args.norm_delta)
            return (torch.ones(shape) + noise).to(torch.bfloat16)
        rank = min(args.rank, *shape)
        a = torch.randn((shape[0], rank), generator=gen)
        b = torch.randn((rank, shape[1]), generator=gen)
        scale = args.delta / math.sqrt(rank)  # entries of scale · A @ B have std args.delta
        for start, stop, chunk in _base_chunks(name, shape, args.seed):
            out[start:stop] = chunk.addmm_(a[start:stop], b, alpha=scale)
        return out

    return fetch


def _write_checkpoint(directory: Path, config, shards, shapes, fetch, desc: str) -> None:
    from tqdm.auto import tqdm

    from featcal_core.io.safetensors_io import write_streaming

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {entry[0]: file for file, shard in zip(names, shards, strict=True)
                  for entry in shard}  # fmt: skip
    total = sum(math.prod(shape) * 2 for shape in shapes.values())
    bar = tqdm(total=len(shapes), desc=desc, unit="tensor", leave=False)

    def counted(name: str):
        tensor = fetch(name)
        bar.update(1)
        return tensor

    try:
        for file, shard in zip(names, shards, strict=True):
            write_streaming(directory / file, shard, counted, {"format": "pt"})
    finally:
        bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _calibration_set(path: Path, words: list[str], args, index: int) -> None:
    """`args.rows` sequences of tokens-16 … tokens-1 random words (+ bos: up to `tokens` tokens)."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(_seed(args.seed, "calib", index) % 2**32)
    low = max(1, args.tokens - 16)
    texts = [
        " ".join(rng.choice(words, size=int(rng.integers(low, max(low + 1, args.tokens)))))
        for _ in range(args.rows)
    ]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))


def build(args, pool: Path) -> None:
    """Write base/, expert_<task>/ and calib_<task>/ under `pool`, then build.json (last: a pool
    with build.json is complete)."""
    config, tensors, tokenizer = _layout(args)
    shapes = dict(tensors)
    shards = _shards(tensors, int(args.shard_mb * 10**6))
    params = sum(math.prod(shape) for shape in shapes.values())
    log.info(
        "%d tensors, %d parameters (%.2f B), %d shards of <= %g MB per checkpoint",
        len(shapes), params, params / 1e9, len(shards), args.shard_mb,
    )  # fmt: skip
    tasks = [f"task{i}" for i in range(args.experts)]
    base = pool / "base"
    _write_checkpoint(base, config, shards, shapes, _fetcher(shapes, args, None), "base")
    tokenizer.save_pretrained(base)
    for task in tasks:
        fetch = _fetcher(shapes, args, task)
        _write_checkpoint(pool / f"expert_{task}", config, shards, shapes, fetch, task)
        log.info("wrote expert %s", task)
    special = set(tokenizer.all_special_tokens)
    words = sorted(w for w in tokenizer.get_vocab() if w not in special)
    for i, task in enumerate(tasks):
        _calibration_set(pool / f"calib_{task}", words, args, i)
    from featcal_core.memory import peak_rss_bytes

    spec = {k: getattr(args, k) for k in POOL_OPTIONS}
    record = {"spec": spec, "tasks": tasks, "parameters": params, "shards": len(shards),
              "peak_rss_bytes": peak_rss_bytes()}  # fmt: skip
    (pool / "build.json").write_text(json.dumps(record, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# measuring (the parent: stdlib + psutil only)


@dataclass
class Step:
    label: str
    returncode: int = 0
    wall_s: float = 0.0
    peak_tree_rss: int = 0  # max over samples of the summed RSS of the process tree
    ru_maxrss: int = 0  # wait4 rusage of the child (includes waited descendants)
    vmhwm: int | None = None  # the process's own peak (build.json, merge.json, featcal.json)
    read_bytes: int = 0  # from storage, summed over the tree
    read_chars: int = 0  # through read() and friends, summed over the tree
    write_chars: int = 0
    inblock_bytes: int = 0  # ru_inblock × 512 from wait4 (storage reads, cross-check)
    killed: bool = False
    samples: int = 0

    @property
    def peak_rss(self) -> int:
        return max(self.peak_tree_rss, self.vmhwm or 0)


def _sample(root: psutil.Process, io: dict[int, tuple[int, int, int]]) -> int:
    """Summed RSS of root and its descendants; updates io (pid → last io counters)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    rss = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                counters = proc.io_counters()
        except psutil.Error:
            continue
        io[proc.pid] = (counters.read_bytes, counters.read_chars, counters.write_chars)
    return rss


def measure(
    label: str,
    cmd: list[str],
    env: dict[str, str],
    log_dir: Path,
    poll: float,
    kill_when: Callable[[], bool] | None = None,
) -> Step:
    """Run cmd in its own session, sampling its process tree every `poll` s until it exits (or
    SIGKILL its process group once kill_when() is true)."""
    step = Step(label)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{label.replace(' ', '_')}.log"
    log.info("%s: %s", label, " ".join(cmd))
    io: dict[int, tuple[int, int, int]] = {}
    with open(log_path, "w") as log_file:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        root = psutil.Process(proc.pid)
        while True:
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            # one more sample either way: an exited child is a zombie until reaped, its io readable
            step.peak_tree_rss = max(step.peak_tree_rss, _sample(root, io))
            step.samples += 1
            if exited is not None:
                break
            if kill_when is not None and not step.killed and kill_when():
                os.killpg(proc.pid, signal.SIGKILL)
                step.killed = True
            time.sleep(poll)
        _, status, usage = os.wait4(proc.pid, 0)
        step.wall_s = time.perf_counter() - started
        proc.returncode = step.returncode = os.waitstatus_to_exitcode(status)
    if step.killed:
        try:  # the rest of the group (e.g. a Prefect server subprocess)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    step.ru_maxrss = usage.ru_maxrss * 1024
    step.inblock_bytes = usage.ru_inblock * 512
    step.read_bytes = sum(v[0] for v in io.values())
    step.read_chars = sum(v[1] for v in io.values())
    step.write_chars = sum(v[2] for v in io.values())
    if step.returncode != 0 and not step.killed:
        tail = log_path.read_text()[-4000:]
        raise SystemExit(f"{label} failed with exit status {step.returncode}:\n{tail}")
    log.info("%s: %.1f s, peak RSS %.0f MiB", label, step.wall_s, step.peak_tree_rss / MIB)
    return step


def evict(paths: list[Path]) -> None:
    """Drop these files (directories: every file below) from the page cache (needs no root)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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
    names = sorted({p.name for d in (a, b) for p in d.iterdir()
                    if p.suffix == ".safetensors" or p.name == INDEX})  # fmt: skip
    differ = [
        n for n in names
        if not ((a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, False))
    ]  # fmt: skip
    return not differ, differ


def _record_peak(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["peak_rss_bytes"])
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------------------------------------


def _featcal(*args: str) -> list[str]:
    return [sys.executable, "-m", "featcal_cli.main", *args]


def _calibrate_args(pool: Path, tasks: list[str], merged: Path, out: Path, args) -> list[str]:
    cmd = ["calibrate", "--base", str(pool / "base"), "--merged", str(merged)]
    for task in tasks:
        cmd += ["--expert", f"{task}={pool / f'expert_{task}'}"]
        cmd += ["--calib", f"{task}={pool / f'calib_{task}'}"]
    return cmd + [
        "--out", str(out), "--device", args.device, "--num-per-task", str(args.rows),
        "--max-length", str(args.tokens), "--no-progress", "--overwrite",
    ]  # fmt: skip


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
    reference = measure("calibrate flow", base_cmd + ["--results-dir", str(ref_results)],
                        env, logs, args.poll)  # fmt: skip
    reference.vmhwm = _record_peak(ref_out / "featcal.json")

    cmd = _featcal(*_calibrate_args(pool, tasks, merged, out, args))
    cmd += ["--results-dir", str(results)]
    want = args.kill_after + 1  # the stems' state + kill_after blocks
    killed = measure("flow killed", cmd, env, logs, min(args.poll, 0.02),
                     kill_when=lambda: _committed(results) >= want)  # fmt: skip
    done = _committed(results) - 1
    if not killed.killed:
        lines.append(f"resume check: the run finished before {args.kill_after} blocks were "
                     "committed; nothing was killed (use more --layers)")  # fmt: skip
    else:
        lines.append(f"resume check: SIGKILL after {done} committed blocks "
                     f"(of {args.layers}); out exists after the kill: {out.exists()}")  # fmt: skip
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
    """`featcal calibrate --spill-dir` (no flow): the memory figure; appends its Step."""
    if not args.warm_cache:
        evict([pool, merged])
    cmd = _calibrate_args(pool, tasks, merged, out, args)
    cmd += ["--spill-dir", str(work / "spill")]
    step = measure("calibrate", _featcal(*cmd), env, logs, args.poll)
    step.vmhwm = _record_peak(out / "featcal.json")
    steps.append(step)
    record = json.loads((out / "featcal.json").read_text())
    block_s = [b["seconds"] for b in record["blocks"]]
    lines = [
        f"calibrate: {len(block_s)} blocks, {sum(block_s):.1f} s in blocks "
        f"(mean {sum(block_s) / len(block_s):.2f} s), record wall {record['wall_seconds']} s",
    ]
    spill_left = _dir_bytes(work / "spill") if (work / "spill").exists() else 0
    lines.append(f"spill directory after the run: {spill_left} bytes")
    return lines


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def report(info: dict, steps: list[Step], extra_lines: list[str]) -> None:
    expert = info["expert_bytes"]
    print()
    print(
        f"model: Llama {info['geometry']}, {info['parameters']:,} parameters "
        f"({info['parameters'] / 1e9:.3f} B), bf16, {info['shards']} shards per checkpoint"
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
    calib = next((s for s in steps if s.label == "calibrate"), None)
    if calib is not None:
        met = calib.peak_rss < expert
        print(
            f"\ntarget: peak RSS of featcal calibrate {calib.peak_rss / 1e9:.3f} GB < one expert "
            f"checkpoint {expert / 1e9:.3f} GB: {'MET' if met else 'NOT MET'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    geometry = parser.add_argument_group("model geometry (default: TinyLlama 1.1 B)")
    geometry.add_argument("--hidden", type=int, default=2048)
    geometry.add_argument("--intermediate", type=int, default=5632)
    geometry.add_argument("--layers", type=int, default=22)
    geometry.add_argument("--heads", type=int, default=32)
    geometry.add_argument("--kv-heads", type=int, default=4)
    geometry.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16, help="rank of the expert deltas")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the delta entries")
    parser.add_argument("--norm-delta", type=float, default=0.01, help="std of the norm noise")
    parser.add_argument("--shard-mb", type=float, default=500, help="max shard size (MB)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="calibration sequences per task")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence (max)")
    parser.add_argument("--scale", type=float, default=0.3, help="Task Arithmetic scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    parser.add_argument("--keep", action="store_true", help="keep what was written under --work "
                        "(a kept pool with the same settings is reused)")  # fmt: skip
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
        "--skip-plain",
        action="store_true",
        help="with --resume-check: skip the plain `featcal calibrate --spill-dir` run",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="only build the pool under --work/pool (what the build step runs)",
    )
    args = parser.parse_args()
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
    if args.skip_plain and not args.resume_check:
        parser.error("--skip-plain leaves nothing to run without --resume-check")
    if args.resume_check and args.kill_after >= args.layers:
        parser.error(f"--kill-after {args.kill_after} needs more than that many --layers")

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PREFECT_HOME": str(work / "prefect")}  # fmt: skip
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
        cmd = ["merge", "--base", str(pool / "base"), "--method", "task_arithmetic",
               "--scale", str(args.scale), "--out", str(merged),
               "--overwrite", "--no-progress"]  # fmt: skip
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

        geometry = (
            f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
            f"{args.heads} heads, {args.kv_heads} kv heads, vocab {args.vocab}"
        )
        info = {
            "geometry": geometry,
            "parameters": built["parameters"],
            "shards": built["shards"],
            "experts": len(tasks),
            "expert_bytes": _weight_bytes(experts[0]),
            "merged_bytes": _weight_bytes(merged),
            "warm": args.warm_cache,
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
