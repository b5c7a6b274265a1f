"""Tiny real checkpoints and calibration sets for the tests, built with featcal_core.data.synthetic,
plus helpers that rewrite a checkpoint the way other writers lay it out."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal_core.data.synthetic import Pool as Zoo
from featcal_core.data.synthetic import build_pool

TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TINY_BERT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)

__all__ = [
    "Zoo",
    "bert_zoo",
    "clip_zoo",
    "grey_image",
    "grey_images",
    "run_featcal",
    "save_grey_image_splits",
]

#: rows of the tiny train and test splits of `save_grey_image_splits`
N_TRAIN, N_TEST = 12, 5


def run_featcal(tmp_path: Path, params_path: Path, api_url: str | None = None, *extra: str):
    """`featcal run --params params_path` in a subprocess with its own Prefect home and MLflow
    store below tmp_path (api_url: a Prefect server; None: Prefect's embedded one)."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    env.pop("PREFECT_API_URL", None)
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    command = "run"
    if extra and extra[0] in ("run", "compare"):
        command, extra = extra[0], extra[1:]
    cmd = [sys.executable, "-m", "featcal_cli.main", command, "--params", str(params_path), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)


def clip_zoo(root: Path, tasks=("alpha", "beta"), dtype=torch.float32, **kwargs) -> Zoo:
    return build_pool(root, "clip", TINY_CLIP, tasks, dtype=dtype, **kwargs)


def bert_zoo(root: Path, tasks=("alpha", "beta"), dtype=torch.float32, **kwargs) -> Zoo:
    return build_pool(root, "bert", TINY_BERT, tasks, dtype=dtype, **kwargs)


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
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = CLIPModel(CLIPConfig(vision_config=vision.config.to_dict(), text_config=text))
    state = model.state_dict()
    for key, value in vision.state_dict().items():
        state["vision_model." + key] = value
    model.load_state_dict(state)
    model.to(vision.dtype).save_pretrained(out)
    CLIPImageProcessor.from_pretrained(vision_dir).save_pretrained(out)
    return out


def tiny_clip_model(out: Path, seed: int = 2) -> Path:
    """A full tiny CLIPModel (vision TINY_CLIP, 1-layer text tower, projection 16) with a real
    CLIPTokenizer (letters only, no merges) and a CLIPImageProcessor, saved in `out`."""
    import string

    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    torch.manual_seed(seed)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in [*string.ascii_lowercase, "."]:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=len(vocab),
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config = CLIPConfig(vision_config=dict(TINY_CLIP), text_config=text, projection_dim=16)
    CLIPModel(config).eval().save_pretrained(out)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(out)
    side = TINY_CLIP["image_size"]
    CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    ).save_pretrained(out)
    return out


def vision_experts(base: Path, root: Path, tasks, delta: float = 0.05, seed: int = 100):
    """CLIPVisionModel experts (transformers 4.x layout, as published) = the base CLIPModel's vision
    tower + seeded Gaussian deltas; returns task → directory."""
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(base)
    tower = clip.vision_model.state_dict()
    out = {}
    for i, task in enumerate(tasks):
        gen = torch.Generator().manual_seed(seed + i)
        state = {k: v + delta * torch.randn(v.shape, generator=gen) for k, v in tower.items()}
        model = CLIPVisionModel(clip.config.vision_config)
        model.load_state_dict(state)
        model.save_pretrained(root / f"expert_{task}")
        to_transformers4_layout(root / f"expert_{task}")
        out[task] = root / f"expert_{task}"
    return out


def cli_fails(args: list[str], capsys, *needles: str) -> str:
    """`featcal ARGS` exits 2 with one line `featcal: error: ...` holding every needle, and a
    --out that did not exist was not written; returns that line."""
    from featcal_cli.main import main

    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    new = out is not None and not out.exists()
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (new and out.exists())
    return err


def lm_eval_tasks(
    folder: Path, label_words: list[str], rows: int = 16, seed: int = 0
) -> list[dict]:
    """Two local lm-eval tasks over one JSON-lines file of `rows` rows {"text", "label", "word"}
    (texts of WORDS; "word" the label's word), written in `folder`: `toy_choice` (multiple
    choice among `label_words` after "{text} ->", metric acc) and `toy_target` (the true label
    word's log-likelihood after it, lm-eval's `perplexity` metric averaged: its mean). Returns
    the rows."""
    import yaml

    from featcal_core.data.synthetic import WORDS

    g = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(rows):
        count = int(torch.randint(2, 9, (1,), generator=g))
        words = torch.randint(len(WORDS), (count,), generator=g)
        label = int(torch.randint(len(label_words), (1,), generator=g))
        text = " ".join(WORDS[int(i)] for i in words)
        found.append({"text": text, "label": label, "word": label_words[label]})
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in found))
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{text}} ->",
    }
    choice = {
        "task": "toy_choice",
        **common,
        "output_type": "multiple_choice",
        "doc_to_choice": list(label_words),
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    target = {
        "task": "toy_target",
        **common,
        "output_type": "loglikelihood",
        "doc_to_target": " {{word}}",  # a loglikelihood task adds no delimiter
        "metric_list": [{"metric": "perplexity", "aggregation": "mean", "higher_is_better": True}],
    }
    for config in (choice, target):
        (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return found


def grey_image(value: int, mode: str = "RGB"):
    """A 4×4 image whose pixels all equal `value` (as `mode`)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.full((4, 4, 3), value, dtype=np.uint8)).convert(mode)


def grey_images(values, mode: str = "RGB"):
    """A datasets.Dataset: `img` = grey_image(v), `label` = v % 3 (classes a, b, c)."""
    import datasets

    values = list(values)
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
    )
    return datasets.Dataset.from_dict(
        {"img": [grey_image(v, mode) for v in values], "label": [v % 3 for v in values]},
        features=features,
    )


def save_grey_image_splits(path: Path) -> Path:
    """A DatasetDict at `path`: train pixel values 0..N_TRAIN-1, test 100..100+N_TEST-1."""
    import datasets

    datasets.DatasetDict(
        {"train": grey_images(range(N_TRAIN)), "test": grey_images(range(100, 100 + N_TEST))}
    ).save_to_disk(str(path))
    return path


def hub_dataset_repo(
    root: Path, features, rows: dict, config: str, card_features=None, broken: tuple[str, ...] = ()
) -> Path:
    """A dataset repository in the Hub's layout, as a folder `datasets.load_dataset_builder` and
    `load_dataset` read like a Hub id: `<config>/<split>-00000-of-00001.parquet` per split of
    `rows` (split → column → values, written with `features`), and a README whose `configs:`
    maps each split to its files and whose `dataset_info` lists `card_features` (default:
    `features`). Each split in `broken` gets a file that is not parquet (reading it fails)."""
    import datasets
    import yaml

    (root / config).mkdir(parents=True)
    for split, columns in rows.items():
        datasets.Dataset.from_dict(columns, features=features).to_parquet(
            str(root / config / f"{split}-00000-of-00001.parquet")
        )
    for split in broken:
        (root / config / f"{split}-00000-of-00001.parquet").write_bytes(b"not parquet")
    card = {
        "configs": [
            {
                "config_name": config,
                "data_files": [{"split": s, "path": f"{config}/{s}-*"} for s in (*rows, *broken)],
            }
        ],
        "dataset_info": {
            "config_name": config,
            **datasets.DatasetInfo(features=card_features or features)._to_yaml_dict(),
        },
    }
    (root / "README.md").write_text(f"---\n{yaml.safe_dump(card, sort_keys=False)}---\n")
    return root
