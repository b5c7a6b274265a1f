"""Building the synthetic Llama pool of `calibrate_llm_memory.py` (in its --build-only process).

A Llama-layout causal LM (layout from a `LlamaForCausalLM` on the `meta` device) with random bf16
(or float32: --dtype) weights, experts = base + seeded low-rank deltas, every tensor generated row
chunk by row chunk and streamed into sharded safetensors, plus per-task `save_to_disk` calibration
sets. torch, transformers and featcal_core's heavy parts are imported lazily, so the measuring
parent can import this module for its constants without importing them (the geometries come from
featcal_core.method.memory_model, pure arithmetic).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("calibrate_llm_memory")

INDEX = "model.safetensors.index.json"  # featcal_core.io.checkpoint.INDEX_NAME (not imported here)
#: elements per generated float32 row chunk (16 MiB)
CHUNK = 1 << 22
#: options that define the built pool (passed to the --build-only process, recorded in build.json)
POOL_OPTIONS = (
    "hidden",
    "intermediate",
    "layers",
    "heads",
    "kv_heads",
    "vocab",
    "rank",
    "delta",
    "norm_delta",
    "shard_mb",
    "experts",
    "rows",
    "tokens",
    "seed",
    "dtype",
)
#: the geometry options and their defaults without --geometry (TinyLlama 1.1 B)
GEOMETRY_DEFAULTS = {
    "hidden": 2048,
    "intermediate": 5632,
    "heads": 32,
    "kv_heads": 4,
    "vocab": 32000,
}
#: safetensors names of the weight dtypes --dtype offers
DTYPES = {"bfloat16": "BF16", "float32": "F32"}


def add_pool_arguments(parser, layers: int) -> None:
    """The options of POOL_OPTIONS (and Task Arithmetic's --scale) on `parser`: TinyLlama's
    geometry by default, or a published one (--geometry), with `layers` blocks; call
    `resolve_geometry` on the parsed arguments."""
    from featcal_core.method.memory_model import GEOMETRIES  # pure arithmetic: no torch

    geometry = parser.add_argument_group(
        f"model geometry (default: TinyLlama 1.1 B, {layers} layers)"
    )
    geometry.add_argument(
        "--geometry",
        choices=sorted(GEOMETRIES),
        default=None,
        help="a published geometry: its hidden, intermediate, heads and kv heads (not its "
        "vocabulary: the embedding is not calibrated; --vocab, default 32000, sets it); the "
        "single options below override it",
    )
    for name in GEOMETRY_DEFAULTS:
        geometry.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    geometry.add_argument("--layers", type=int, default=layers)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="the checkpoints' weight dtype (float32: the block passes run in float32, for a "
        "CPU without native bfloat16 matmuls)",
    )
    parser.add_argument("--rank", type=int, default=16, help="rank of the expert deltas")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the delta entries")
    parser.add_argument("--norm-delta", type=float, default=0.01, help="std of the norm noise")
    parser.add_argument("--shard-mb", type=float, default=500, help="max shard size (MB)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="calibration sequences per task")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence (max)")
    parser.add_argument("--scale", type=float, default=0.3, help="Task Arithmetic scale")
    parser.add_argument("--seed", type=int, default=0)


def resolve_geometry(args) -> None:
    """Fill the geometry options left out: from --geometry, else TinyLlama's."""
    from featcal_core.method.memory_model import GEOMETRIES

    named = GEOMETRIES[args.geometry] if args.geometry else None
    for name, default in GEOMETRY_DEFAULTS.items():
        if getattr(args, name) is None:
            value = default
            if named is not None and name != "vocab":
                value = getattr(named, name)
            setattr(args, name, value)


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
        dtype=args.dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    del model
    return config, tensors, tokenizer


def _shards(
    tensors, max_bytes: int, dtype: str = "bfloat16"
) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most max_bytes (in `dtype`) each (a larger
    tensor gets a shard of its own)."""
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    itemsize = 4 if dtype == "float32" else 2
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, DTYPES[dtype], shape))
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
    """fetch(name) → the tensor (in args.dtype) of the base (task None) or of expert `task`."""
    import torch

    dtype = getattr(torch, args.dtype)

    def fetch(name: str):
        shape = shapes[name]
        out = torch.empty(shape, dtype=dtype)
        if task is None:
            for start, stop, chunk in _base_chunks(name, shape, args.seed):
                out[start:stop] = chunk
            return out
        gen = torch.Generator().manual_seed(_seed(args.seed, "delta", task, name))
        if len(shape) == 1:
            noise = torch.randn(shape, generator=gen).mul_(args.norm_delta)
            return (torch.ones(shape) + noise).to(dtype)
        rank = min(args.rank, *shape)
        a = torch.randn((shape[0], rank), generator=gen)
        b = torch.randn((rank, shape[1]), generator=gen)
        scale = args.delta / math.sqrt(rank)  # entries of scale · A @ B have std args.delta
        for start, stop, chunk in _base_chunks(name, shape, args.seed):
            out[start:stop] = chunk.addmm_(a[start:stop], b, alpha=scale)
        return out

    return fetch


def _write_checkpoint(directory: Path, config, shards, shapes, fetch, desc: str) -> None:
    """config.json, the shards (tensors fetched one at a time) and the index."""
    from tqdm.auto import tqdm

    from featcal_core.io.safetensors_io import write_streaming

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {
        entry[0]: file for file, shard in zip(names, shards, strict=True) for entry in shard
    }
    itemsize = 4 if shards[0][0][1] == "F32" else 2
    total = sum(math.prod(shape) * itemsize for shape in shapes.values())
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


def _calibration_set(path: Path, words: list[str], args, index: int) -> dict[str, int]:
    """`args.rows` sequences of tokens-16 … tokens-1 random words (+ bos: up to `tokens` tokens;
    the word tokenizer gives one token per word); returns {"padded": the longest in tokens,
    "tokens": all of them}."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(_seed(args.seed, "calib", index) % 2**32)
    low = max(1, args.tokens - 16)
    texts = [
        " ".join(rng.choice(words, size=int(rng.integers(low, max(low + 1, args.tokens)))))
        for _ in range(args.rows)
    ]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    lengths = [len(text.split()) + 1 for text in texts]
    return {"padded": max(lengths), "tokens": sum(lengths)}


def build(args, pool: Path) -> None:
    """Write base/, expert_<task>/ and calib_<task>/ under `pool`, then build.json (last: a pool
    with build.json is complete)."""
    config, tensors, tokenizer = _layout(args)
    shapes = dict(tensors)
    shards = _shards(tensors, int(args.shard_mb * 10**6), args.dtype)
    params = sum(math.prod(shape) for shape in shapes.values())
    log.info(
        "%d tensors, %d parameters (%.2f B), %d shards of <= %g MB per checkpoint",
        len(shapes),
        params,
        params / 1e9,
        len(shards),
        args.shard_mb,
    )
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
    calibration = {
        task: _calibration_set(pool / f"calib_{task}", words, args, i)
        for i, task in enumerate(tasks)
    }
    from featcal_core.memory import peak_rss_bytes

    spec = {k: getattr(args, k) for k in POOL_OPTIONS}
    record = {
        "spec": spec,
        "tasks": tasks,
        "parameters": params,
        "shards": len(shards),
        "calibration": calibration,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    (pool / "build.json").write_text(json.dumps(record, indent=2) + "\n")
