"""Synthetic model pools for demos, benchmarks and tests (random weights; no hub access).

A pool is a base model (seeded random init), T experts = base + seeded Gaussian deltas, a Task
Arithmetic merge `base + s · Σ_t (expert_t − base)`, all written as `save_pretrained` directories,
and one `save_to_disk` calibration set per task (random images or random word sequences). It
exercises the whole calibration path at any geometry (ViT-B/32 included); it says nothing about
accuracy. Peak memory while building: about three copies of one model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

WORDS = "the a movie film good bad great awful plot actor scene story fun dull long short".split()


@dataclass
class Pool:
    base: Path
    merged: Path
    experts: dict[str, Path]
    calib: dict[str, Path]

    def cli_args(self, out: Path) -> list[str]:
        """`featcal calibrate` arguments for this pool."""
        args = ["calibrate", "--base", str(self.base), "--merged", str(self.merged)]
        for task, path in self.experts.items():
            args += ["--expert", f"{task}={path}"]
        for task, path in self.calib.items():
            args += ["--calib", f"{task}={path}"]
        return args + ["--out", str(out), "--no-progress"]


def _save_state(state: dict[str, torch.Tensor], config_dir: Path, out: Path, dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if out != config_dir:
        shutil.copy2(config_dir / "config.json", out / "config.json")
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def image_set(path: Path, count: int, seed: int, size: int = 40) -> Path:
    """`count` random RGB images (size × size) in an `image` column."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)
    ]
    data = datasets.Dataset.from_dict({"image": images}).cast_column("image", datasets.Image())
    data.save_to_disk(str(path))
    return path


def text_set(path: Path, count: int, seed: int) -> Path:
    """`count` random word sequences (2–11 words) in a `text` column."""
    import datasets

    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(count)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    return path


def text_target_set(path: Path, count: int, seed: int) -> Path:
    """`count` random word sequences (2–11 words) in a `text` column and a `target` column of one
    or two random words each (sequence-to-sequence calibration sets)."""
    import datasets

    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(count)]
    targets = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 3)))) for _ in range(count)]
    datasets.Dataset.from_dict({"text": texts, "target": targets}).save_to_disk(str(path))
    return path


def _clip(config: dict, base_dir: Path):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    model = CLIPVisionModel(CLIPVisionConfig(**config)).eval()
    side = model.config.image_size
    processor = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    model.config.save_pretrained(base_dir)
    processor.save_pretrained(base_dir)
    return model


def _bert(config: dict, base_dir: Path):
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    model = BertModel(BertConfig(vocab_size=len(vocab), **config)).eval()
    model.config.save_pretrained(base_dir)
    vocab_file = base_dir / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab=str(vocab_file)).save_pretrained(base_dir)  # transformers 5: `vocab`
    return model


def word_tokenizer(pad: bool = True):
    """A whitespace word-level tokenizer over WORDS (bos prepended), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if pad:
        special["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def _llama(config: dict, base_dir: Path):
    """A Llama-layout causal LM (`model_type` in config selects llama / mistral / qwen2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = word_tokenizer()
    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(
        config.get("model_type", "llama"),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **settings,
    )
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    model.config.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    return model


def t5_tokenizer():
    """A whitespace word-level tokenizer over WORDS with T5's conventions, built offline: <pad> = 0
    (also the decoder start token), </s> = 1 appended to every encoding, <unk> = 2, no bos."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


#: pool config keys of the "t5" family that choose the pool, not the T5Config
T5_POOL_KEYS = ("encoder_only", "no_target")


def _t5(config: dict, base_dir: Path):
    """A T5ForConditionalGeneration, or a T5EncoderModel when the pool config says
    `"encoder_only": true`; the other keys go to T5Config (d_model, d_ff, num_layers,
    num_decoder_layers, num_heads, d_kv, feed_forward_proj, relative_attention_num_buckets, ...)."""
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

    tokenizer = t5_tokenizer()
    settings = {k: v for k, v in config.items() if k not in T5_POOL_KEYS}
    hf_config = T5Config(  # type: ignore[call-arg]  # decoder_start_token_id: a **kwargs key
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **settings,
    )
    model_cls = T5EncoderModel if config.get("encoder_only") else T5ForConditionalGeneration
    model = model_cls(hf_config).eval()
    model.config.architectures = [model_cls.__name__]  # as save_pretrained writes it
    model.config.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    return model


FAMILIES = {
    "clip": (_clip, image_set),
    "bert": (_bert, text_set),
    "llama": (_llama, text_set),
    "t5": (_t5, text_target_set),
}


def _untied_state(model) -> dict[str, torch.Tensor]:
    """The model's state dict as save_pretrained writes it: tensors tied to an earlier key (T5's
    encoder/decoder embed_tokens and lm_head, tied to shared) are left out; copies, detached."""
    seen, state = set(), {}
    for key, value in model.state_dict().items():
        ident = (value.data_ptr(), tuple(value.shape), value.stride())
        if ident in seen:
            continue
        seen.add(ident)
        state[key] = value.detach().clone()
    return state


def build_pool(
    root: str | Path,
    family: str,
    config: dict,
    tasks: tuple[str, ...] = ("alpha", "beta"),
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    delta: float = 0.05,
    merge_scale: float = 0.3,
    blocks_only: bool = False,
    rows: int = 12,
) -> Pool:
    """Write a synthetic pool under `root` (base/, merged/, expert_<task>/, calib_<task>/).

    delta: standard deviation of each expert's Gaussian weight delta; blocks_only: perturb only
    the transformer blocks (stems and heads stay the base's).
    """
    root = Path(root)
    make_model, make_set = FAMILIES[family]
    if family == "t5" and config.get("no_target"):
        make_set = text_set  # T5 calibration sets without a `target` column
    base_dir = root / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    base_state = _untied_state(make_model(config, base_dir))
    delta_sum = {k: torch.zeros_like(v) for k, v in base_state.items()}
    experts = {}
    for i, task in enumerate(tasks):
        gen = torch.Generator().manual_seed(seed + 100 + i)
        state = {}
        for key, value in base_state.items():
            noise = delta * torch.randn(value.shape, generator=gen, dtype=value.dtype)
            if blocks_only and ".layer" not in key:
                noise.zero_()
            state[key] = value + noise
            delta_sum[key] += noise
        experts[task] = _save_state(state, base_dir, root / f"expert_{task}", dtype)
        del state
    merged = {k: base_state[k] + merge_scale * delta_sum[k] for k in base_state}
    del delta_sum
    merged_dir = _save_state(merged, base_dir, root / "merged", dtype)
    _save_state(base_state, base_dir, base_dir, dtype)
    calib = {t: make_set(root / f"calib_{t}", rows, seed + i) for i, t in enumerate(tasks)}
    (root / "pool.json").write_text(
        json.dumps(
            {
                "family": family,
                "config": config,
                "tasks": list(tasks),
                "seed": seed,
                "delta": delta,
                "merge_scale": merge_scale,
                "blocks_only": blocks_only,
                "rows": rows,
                "dtype": str(dtype),
            },
            indent=2,
        )
    )
    return Pool(base_dir, merged_dir, experts, calib)


def load_pool(root: str | Path) -> Pool | None:
    """The pool `build_pool` wrote under `root`, or None when there is none (or it is incomplete)."""
    root = Path(root)
    try:
        tasks = json.loads((root / "pool.json").read_text())["tasks"]
    except (OSError, ValueError, KeyError):
        return None
    pool = Pool(
        root / "base",
        root / "merged",
        {t: root / f"expert_{t}" for t in tasks},
        {t: root / f"calib_{t}" for t in tasks},
    )
    paths = [pool.base, pool.merged, *pool.experts.values(), *pool.calib.values()]
    return pool if all(p.exists() for p in paths) else None
