"""Evaluation with an expert's head and with a CLIP zero-shot head, against direct computations.

Everything is built on the fly from tiny seeded configs; nothing comes from the Hub. The CLIP
tokenizer is a real `CLIPTokenizer` (byte-level BPE, transformers 5.x, backed by `tokenizers`) built
from a tiny in-memory vocabulary (every letter, with and without the "</w>" end-of-word suffix) and
no merges, saved with save_pretrained (tokenizer.json), so AutoTokenizer loads it offline.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPTextModel,
    CLIPTokenizer,
    CLIPVisionModel,
)

from factories import TINY_BERT, TINY_CLIP, tiny_clip_model, to_transformers4_layout
from featcal_core.data.synthetic import WORDS
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import evaluate, normalized_accuracy
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.zero_shot_head import ZeroShotHead

NUM_LABELS = 3
CLASS_NAMES = ["cat", "dog", "bird"]
TEMPLATES = ["a photo of a {}.", "a blurry {} picture"]


def _perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


# ------------------------------------------------------------------------------------ BERT


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    torch.manual_seed(1)
    expert_dir = root / "expert"
    expert_dir.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab_file = root / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab=str(vocab_file)).save_pretrained(expert_dir)
    config = BertConfig(vocab_size=len(vocab), num_labels=NUM_LABELS, **TINY_BERT)
    expert = BertForSequenceClassification(config).eval()
    expert.save_pretrained(expert_dir)

    # the expert's backbone, perturbed, saved as a bare BertModel (with and without pooler)
    backbone = _perturbed(expert.bert.state_dict(), seed=7)
    bare_dir = root / "bare"
    tower = BertModel(config)
    tower.load_state_dict(backbone)
    tower.save_pretrained(bare_dir)
    no_pooler_dir = root / "bare_no_pooler"
    tower = BertModel(config, add_pooling_layer=False)
    tower.load_state_dict({k: v for k, v in backbone.items() if not k.startswith("pooler.")})
    tower.save_pretrained(no_pooler_dir)

    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(21)]
    labels = [int(x) for x in rng.integers(0, NUM_LABELS, size=len(texts))]
    data_dir = root / "data"
    datasets.DatasetDict(
        {
            "test": datasets.Dataset.from_dict({"text": texts, "label": labels}),
            "train": datasets.Dataset.from_dict({"text": texts[:4], "label": labels[:4]}),
        }
    ).save_to_disk(str(data_dir))
    bad_dir = root / "bad_labels"
    datasets.Dataset.from_dict({"text": texts[:4], "label": [0, 1, 5, 2]}).save_to_disk(
        str(bad_dir)
    )
    return {
        "expert": expert_dir,
        "bare": bare_dir,
        "bare_no_pooler": no_pooler_dir,
        "backbone": backbone,
        "data": data_dir,
        "bad_labels": bad_dir,
        "texts": texts,
        "labels": labels,
        "config": config,
        "root": root,
    }


def _direct_text(model, tokenizer, texts, labels, batch_size=8):
    """A plain loop: tokenize, run the classification model, score."""
    logits = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start : start + batch_size], padding=True, return_tensors="pt")
            logits.append(model(**enc).logits)
    logits = torch.cat(logits)
    target = torch.tensor(labels)
    accuracy = float((logits.argmax(-1) == target).float().mean())
    return accuracy, float(F.cross_entropy(logits, target))


def test_expert_own_dir_matches_direct_loop(bert):
    result = evaluate(
        bert["expert"],
        ExpertHead(bert["expert"]),
        bert["data"],
        "test",
        batch_size=8,
        progress=False,
    )
    model = BertForSequenceClassification.from_pretrained(bert["expert"]).eval()
    tokenizer = BertTokenizer.from_pretrained(bert["expert"])
    accuracy, loss = _direct_text(model, tokenizer, bert["texts"], bert["labels"])
    assert result["examples"] == len(bert["texts"])
    assert result["accuracy"] == pytest.approx(accuracy)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("which", ["bare", "bare_no_pooler"])
def test_bare_backbone_under_expert_head_matches_manual_replacement(bert, which):
    head = ExpertHead(bert["expert"])
    result = evaluate(bert[which], head, bert["data"], "test", batch_size=5, progress=False)

    model = BertForSequenceClassification.from_pretrained(bert["expert"]).eval()
    backbone = dict(bert["backbone"])
    if which == "bare_no_pooler":  # the expert's pooler stays
        backbone = {k: v for k, v in backbone.items() if not k.startswith("pooler.")}
    missing, unexpected = model.bert.load_state_dict(backbone, strict=False)
    assert not unexpected
    assert all(k.startswith("pooler.") for k in missing)
    tokenizer = BertTokenizer.from_pretrained(bert["expert"])
    accuracy, loss = _direct_text(model, tokenizer, bert["texts"], bert["labels"])
    assert result["accuracy"] == pytest.approx(accuracy)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)

    own = evaluate(bert["expert"], head, bert["data"], "test", progress=False)
    assert own["loss"] != pytest.approx(result["loss"], rel=1e-6)  # the tower was replaced


def test_max_examples_and_single_split(bert):
    result = evaluate(
        bert["expert"],
        ExpertHead(bert["expert"]),
        bert["data"],
        "test",
        max_examples=6,
        progress=False,
    )
    assert result["examples"] == 6


def test_incompatible_towers(bert, tmp_path):
    head = ExpertHead(bert["expert"])
    shallow = tmp_path / "shallow"
    BertModel(BertConfig(**{**bert["config"].to_dict(), "num_hidden_layers": 1})).save_pretrained(
        shallow
    )
    with pytest.raises(FeatCalError, match="has no tower tensor 'encoder.layer.1"):
        evaluate(shallow, head, bert["data"], "test", progress=False)
    deep = tmp_path / "deep"
    BertModel(BertConfig(**{**bert["config"].to_dict(), "num_hidden_layers": 3})).save_pretrained(
        deep
    )
    with pytest.raises(FeatCalError, match="encoder.layer.2.* that the expert head"):
        evaluate(deep, head, bert["data"], "test", progress=False)
    vision = tmp_path / "vision"
    CLIPVisionModel(CLIPVisionModel.config_class(**TINY_CLIP)).save_pretrained(vision)
    with pytest.raises(FeatCalError, match="hf-clip-vision checkpoint but .* needs a hf-bert"):
        evaluate(vision, head, bert["data"], "test", progress=False)
    with pytest.raises(FeatCalError, match="no 'architectures'|no classification head"):
        evaluate(bert["bare"], ExpertHead(bert["bare"]), bert["data"], "test", progress=False)


def test_data_errors(bert, tmp_path):
    head = ExpertHead(bert["expert"])
    with pytest.raises(FeatCalError, match="does not exist"):
        evaluate(bert["expert"], head, tmp_path / "nowhere", progress=False)
    with pytest.raises(FeatCalError, match=r"no split 'validation' \(has \['test', 'train'\]\)"):
        evaluate(bert["expert"], head, bert["data"], "validation", progress=False)
    with pytest.raises(FeatCalError, match="has splits"):
        evaluate(bert["expert"], head, bert["data"], progress=False)
    with pytest.raises(FeatCalError, match="no label column 'answer'"):
        evaluate(bert["expert"], head, bert["data"], "test", label_column="answer", progress=False)
    with pytest.raises(FeatCalError, match="no text input column 'sentence'"):
        evaluate(bert["expert"], head, bert["data"], "test", text_column="sentence", progress=False)
    with pytest.raises(FeatCalError, match="label 5 .* out of range .* 3 classes"):
        evaluate(bert["expert"], head, bert["bad_labels"], progress=False)
    with pytest.raises(FeatCalError, match="without splits"):
        evaluate(bert["expert"], head, bert["bad_labels"], "test", progress=False)


def test_normalized_accuracy():
    assert normalized_accuracy(0.45, 0.9) == pytest.approx(0.5)
    with pytest.raises(FeatCalError, match="undefined"):
        normalized_accuracy(0.5, 0.0)


# ------------------------------------------------------------------------------------ CLIP


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    base_dir = tiny_clip_model(root / "base", seed=2)
    model = CLIPModel.from_pretrained(base_dir).eval()
    config = model.config

    tower = _perturbed(model.vision_model.state_dict(), seed=11, scale=0.2)
    vision = CLIPVisionModel(config.vision_config)
    vision.load_state_dict(tower)
    vision_dir = root / "vision5"
    vision.save_pretrained(vision_dir)
    vision4_dir = root / "vision4"
    vision.save_pretrained(vision4_dir)
    to_transformers4_layout(vision4_dir)

    rng = np.random.default_rng(5)
    from PIL import Image

    images = [Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(10)]
    labels = [int(x) for x in rng.integers(0, len(CLASS_NAMES), size=len(images))]
    data_dir = root / "images"
    data = datasets.Dataset.from_dict({"img": images, "label": labels})
    data.cast_column("img", datasets.Image()).save_to_disk(str(data_dir))
    return {
        "base": base_dir,
        "vision5": vision_dir,
        "vision4": vision4_dir,
        "tower": tower,
        "data": data_dir,
        "images": images,
        "labels": labels,
    }


def _features(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _direct_zero_shot(base_dir: Path, tower: dict | None, images) -> torch.Tensor:
    """Logits with CLIPModel.get_text_features / get_image_features."""
    model = CLIPModel.from_pretrained(base_dir).eval()
    if tower is not None:
        model.vision_model.load_state_dict(tower)
    tokenizer = CLIPTokenizer.from_pretrained(base_dir)
    processor = CLIPImageProcessor.from_pretrained(base_dir)
    with torch.no_grad():
        classes = []
        for name in CLASS_NAMES:
            enc = tokenizer([t.format(name) for t in TEMPLATES], padding=True, return_tensors="pt")
            feats = F.normalize(_features(model.get_text_features(**enc)), dim=-1)
            classes.append(F.normalize(feats.mean(0), dim=-1))
        classes = torch.stack(classes)
        pixels = processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
        image = F.normalize(_features(model.get_image_features(pixels["pixel_values"])), dim=-1)
        return model.logit_scale.exp() * image @ classes.T


@pytest.mark.parametrize("layout", ["vision5", "vision4", "base"])
def test_zero_shot_matches_direct_computation(clip, tmp_path, layout):
    head = ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, cache_dir=tmp_path / "cache")
    model_dir = clip[layout]
    tower = None if layout == "base" else clip["tower"]
    expected = _direct_zero_shot(clip["base"], tower, clip["images"])

    classifier = head.classifier(model_dir, torch.device("cpu"))
    with torch.no_grad():
        logits = classifier(**head.preprocess(clip["images"]))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    result = evaluate(
        model_dir, head, clip["data"], image_column="img", batch_size=4, progress=False
    )
    target = torch.tensor(clip["labels"])
    assert result["examples"] == len(clip["images"])
    assert result["accuracy"] == pytest.approx(
        float((expected.argmax(-1) == target).float().mean())
    )
    assert result["loss"] == pytest.approx(float(F.cross_entropy(expected, target)), rel=1e-4)


def test_zero_shot_cache_is_written_and_reused(clip, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = evaluate(
        clip["vision5"],
        ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, cache),
        clip["data"],
        image_column="img",
        progress=False,
    )
    files = sorted(cache.glob("*.safetensors"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns

    def no_text_tower(*args, **kwargs):
        raise AssertionError("the text tower ran although the class embeddings are cached")

    monkeypatch.setattr(CLIPTextModel, "forward", no_text_tower)
    second = evaluate(
        clip["vision4"],
        ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, cache),
        clip["data"],
        image_column="img",
        progress=False,
    )
    assert second == pytest.approx(first)
    assert sorted(cache.glob("*.safetensors")) == files
    assert files[0].stat().st_mtime_ns == stamp

    # other templates: another key, so the text tower must run (and here it cannot)
    other = ZeroShotHead(clip["base"], CLASS_NAMES, ["{}"], cache)
    assert other.cache_path() != files[0]
    with pytest.raises(AssertionError, match="text tower ran"):
        other.class_embeddings()


def test_zero_shot_errors(clip, bert, tmp_path):
    with pytest.raises(FeatCalError, match="needs a full CLIPModel"):
        ZeroShotHead(clip["vision5"], CLASS_NAMES, TEMPLATES)
    with pytest.raises(FeatCalError, match="one \\{\\} for the class name"):
        ZeroShotHead(clip["base"], CLASS_NAMES, ["a photo"])
    head = ZeroShotHead(clip["base"], CLASS_NAMES[:2], TEMPLATES, tmp_path)
    with pytest.raises(FeatCalError, match="out of range for a head with 2 classes"):
        evaluate(clip["vision5"], head, clip["data"], image_column="img", progress=False)
    head = ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, tmp_path)
    with pytest.raises(FeatCalError, match="no image input column 'image'"):
        evaluate(clip["vision5"], head, clip["data"], progress=False)
    with pytest.raises(FeatCalError, match="hf-bert checkpoint but .* needs a hf-clip-vision"):
        evaluate(bert["bare"], head, clip["data"], image_column="img", progress=False)


def test_clip_expert_head_with_transformers4_tower(clip, tmp_path):
    from transformers import CLIPForImageClassification

    torch.manual_seed(4)
    config = CLIPConfig.from_pretrained(clip["base"])
    config.num_labels = len(CLASS_NAMES)
    expert = CLIPForImageClassification(config).eval()
    expert_dir = tmp_path / "clip_expert"
    expert.save_pretrained(expert_dir)
    CLIPImageProcessor.from_pretrained(clip["base"]).save_pretrained(expert_dir)

    result = evaluate(
        clip["vision4"],
        ExpertHead(expert_dir),
        clip["data"],
        image_column="img",
        batch_size=3,
        progress=False,
    )
    expert.vision_model.load_state_dict(clip["tower"])
    processor = CLIPImageProcessor.from_pretrained(expert_dir)
    pixels = processor(images=[i.convert("RGB") for i in clip["images"]], return_tensors="pt")
    with torch.no_grad():
        logits = expert(pixel_values=pixels["pixel_values"]).logits
    target = torch.tensor(clip["labels"])
    assert result["accuracy"] == pytest.approx(float((logits.argmax(-1) == target).float().mean()))
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, target)), rel=1e-4)


def test_expert_without_tokenizer_files_uses_the_base_tokenizer_or_fails_clearly(tmp_path):
    """transformers 5 would build an empty tokenizer from config.json alone (every word unknown);
    an expert saved without tokenizer files takes the base's, or stops with a clear error."""
    from transformers import BertConfig, BertForSequenceClassification

    import factories
    from featcal_core.architectures.base import load_tokenizer

    pool = factories.bert_zoo(tmp_path / "pool", tasks=("alpha",))
    BertForSequenceClassification(
        BertConfig.from_pretrained(pool.base, num_labels=2)
    ).save_pretrained(tmp_path / "expert")
    rows = ["the good movie", "a dull plot"]
    inputs = ExpertHead(tmp_path / "expert", tokenizer_dir=pool.base).preprocess(rows)
    expected = load_tokenizer(pool.base)(rows, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(inputs["input_ids"], expected)
    assert int((expected == load_tokenizer(pool.base).unk_token_id).sum()) == 0
    with pytest.raises(FeatCalError, match="no tokenizer files"):
        ExpertHead(tmp_path / "expert").preprocess(rows)


def test_saved_hub_evaluation_split_follows_its_source(monkeypatch, tmp_path):
    """A Hub evaluation split is saved once below the results folder and reused; naming another
    revision (or id, config, split) in the params saves it again."""
    import json

    from featcal.tasks.evaluate import EVALUATION_SOURCE, _evaluation_data
    from featcal_core.params import DataSource

    loads = []

    def fake_load_dataset(path, name=None, **kwargs):
        loads.append(kwargs.get("revision"))
        return datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = DataSource(hub="owner/data", split="test")
    folder, split = _evaluation_data("t", source, tmp_path)
    assert split is None and loads == [None]
    record = json.loads((folder / EVALUATION_SOURCE).read_text())
    assert record == {
        "source": "hub owner/data, split test",
        "identity": ["hub", "owner/data", None, "test"],
        "commit": None,
    }
    _evaluation_data("t", source, tmp_path)
    assert loads == [None]  # reused
    _evaluation_data("t", DataSource(hub="owner/data", split="test", revision="v2"), tmp_path)
    assert loads == [None, "v2"]  # another revision: saved again
    assert json.loads((folder / EVALUATION_SOURCE).read_text())["identity"][-1] == "v2"
    assert datasets.load_from_disk(str(folder))["text"] == ["a", "b"]


def test_task_head_takes_a_prompt_set_and_checks_class_names_against_the_labels(clip, tmp_path):
    """`prompt_set: eurosat` gives the set's templates and its spelled-out class names (from the
    label feature's names); the task's own class names must be one per label."""
    from featcal.tasks.evaluate import task_head
    from featcal_core.evaluation.prompt_sets import named_set
    from featcal_core.params import TaskSpec

    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=["AnnualCrop", "SeaLake"])}
    )
    rows = {"img": clip["images"][:2], "label": [0, 1]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "eval"))
    spec = TaskSpec(
        calibration={"path": str(clip["data"])},
        evaluation={"path": str(tmp_path / "eval"), "image_column": "img"},
        prompt_set="eurosat",
    )
    head, zero_shot = task_head("sat", spec, clip["base"], clip["vision5"], tmp_path / "results")
    assert zero_shot and isinstance(head, ZeroShotHead)
    assert head.class_names == ["annual crop land", "sea or lake"]
    assert head.templates == list(named_set("eurosat").templates)

    wrong = spec.model_copy(update={"prompt_set": None, "class_names": ["a", "b", "c"]})
    with pytest.raises(FeatCalError, match=r"tasks\.sat\.class_names: 3 names for 2 classes"):
        task_head("sat", wrong, clip["base"], clip["vision5"], tmp_path / "results")
