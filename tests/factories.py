"""Tiny real checkpoints and calibration sets built on the fly (no hub access).

A zoo is: base (random init, seeded), experts = base + small seeded deltas, merged = Task
Arithmetic, all saved with `save_pretrained`, plus one `save_to_disk` calibration set per task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
)

TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
TINY_BERT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
WORDS = "the a movie film good bad great awful plot actor scene story fun dull long short".split()


@dataclass
class Zoo:
    base: Path
    merged: Path
    experts: dict[str, Path]
    calib: dict[str, Path]

    def cli_args(self, out: Path) -> list[str]:
        args = ["calibrate", "--base", str(self.base), "--merged", str(self.merged)]
        for task, path in self.experts.items():
            args += ["--expert", f"{task}={path}"]
        for task, path in self.calib.items():
            args += ["--calib", f"{task}={path}"]
        return args + ["--out", str(out), "--no-progress"]


def _perturbed(
    model: torch.nn.Module, seed: int, scale: float, blocks_only: bool
) -> dict[str, torch.Tensor]:
    """base + scale·N(0, 1) on every tensor (only on block tensors when blocks_only)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        noise = scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        out[k] = v + noise if (not blocks_only or ".layer" in k) else v.clone()
    return out


def _build(
    root: Path,
    model_cls,
    config,
    tasks: tuple[str, ...],
    dtype: torch.dtype,
    seed: int,
    delta: float,
    merge_scale: float,
    save_extra,
    blocks_only: bool = False,
) -> tuple[Path, Path, dict[str, Path]]:
    torch.manual_seed(seed)
    base = model_cls(config).eval()
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    experts = {}
    deltas_sum = {k: torch.zeros_like(v) for k, v in base_sd.items()}
    for i, task in enumerate(tasks):
        sd = _perturbed(base, seed + 100 + i, delta, blocks_only)
        for k in deltas_sum:
            deltas_sum[k] += sd[k] - base_sd[k]
        model = model_cls(config).eval()
        model.load_state_dict(sd)
        path = root / f"expert_{task}"
        model.to(dtype).save_pretrained(path)
        experts[task] = path
    merged = model_cls(config).eval()
    merged.load_state_dict({k: base_sd[k] + merge_scale * deltas_sum[k] for k in base_sd})
    merged.to(dtype).save_pretrained(root / "merged")
    base.to(dtype).save_pretrained(root / "base")
    save_extra(root / "base")
    return root / "base", root / "merged", experts


def image_set(path: Path, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    images = [
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(count)
    ]
    data = datasets.Dataset.from_dict({"image": images}).cast_column("image", datasets.Image())
    data.save_to_disk(str(path))
    return path


def text_set(path: Path, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(count)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    return path


def clip_zoo(
    root: Path,
    tasks: tuple[str, ...] = ("alpha", "beta"),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    rows: int = 12,
    delta: float = 0.05,
    blocks_only: bool = False,
) -> Zoo:
    config = CLIPVisionConfig(**TINY_CLIP)

    def save_processor(path: Path) -> None:
        CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ).save_pretrained(path)

    base, merged, experts = _build(
        root, CLIPVisionModel, config, tasks, dtype, seed, delta, 0.3, save_processor, blocks_only
    )
    calib = {t: image_set(root / f"calib_{t}", rows, seed + i) for i, t in enumerate(tasks)}
    return Zoo(base, merged, experts, calib)


def bert_zoo(
    root: Path,
    tasks: tuple[str, ...] = ("alpha", "beta"),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    rows: int = 12,
    delta: float = 0.05,
) -> Zoo:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    config = BertConfig(vocab_size=len(vocab), **TINY_BERT)

    def save_tokenizer(path: Path) -> None:
        vocab_file = path / "vocab.txt"
        vocab_file.write_text("\n".join(vocab) + "\n")
        BertTokenizer(vocab_file=str(vocab_file)).save_pretrained(path)

    base, merged, experts = _build(
        root, BertModel, config, tasks, dtype, seed, delta, 0.3, save_tokenizer
    )
    calib = {t: text_set(root / f"calib_{t}", rows, seed + i) for i, t in enumerate(tasks)}
    return Zoo(base, merged, experts, calib)


def to_transformers4_layout(directory: Path, prefix: str = "vision_model.") -> None:
    """Rewrite a 5.x CLIPVisionModel checkpoint in place with 4.x-style prefixed keys."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    save_file({prefix + k: v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def reshard(directory: Path, shards: int = 3) -> None:
    """Split model.safetensors into `shards` files with an index, as save_pretrained does."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    path.unlink()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def clip_model_with_tower(vision_dir: Path, out: Path) -> Path:
    """A full CLIPModel (tiny text tower) whose vision tower is the CLIPVisionModel in vision_dir."""
    from transformers import CLIPConfig, CLIPModel

    vision = CLIPVisionModel.from_pretrained(vision_dir)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    model = CLIPModel(CLIPConfig(vision_config=vision.config.to_dict(), text_config=text))
    state = model.state_dict()
    for key, value in vision.state_dict().items():
        state["vision_model." + key] = value
    model.load_state_dict(state)
    model.to(vision.dtype).save_pretrained(out)
    CLIPImageProcessor.from_pretrained(vision_dir).save_pretrained(out)
    return out
