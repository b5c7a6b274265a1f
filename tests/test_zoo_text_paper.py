"""The `text-paper` zoo: text experts fine-tuned under a head fitted on the frozen base. A tiny
word-level BERT stands in for all-MiniLM-L6-v2; the toy task (good vs bad words) is learnable in a
few steps."""

from __future__ import annotations

import dataclasses
import random

import datasets
import pytest
import torch
from safetensors.torch import load_file

import factories
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import load_linear_head, pooled
from featcal_core.zoo import text_encoder_finetuning
from featcal_core.zoo.build import PRESETS, build_zoo
from featcal_core.zoo.text_encoder_finetuning import finetune_text_encoder
from featcal_core.zoo.text_recipe import choose_recipe, compare_poolings

GOOD = ["good", "great", "fun"]
BAD = ["bad", "awful", "dull"]
FILLER = ["the", "a", "movie", "film", "plot", "actor", "scene", "story", "long", "short"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A seeded 2-block BertModel (width 32) with a word-level BertTokenizer over the toy words."""
    from transformers import BertConfig, BertModel, BertTokenizer

    out = tmp_path_factory.mktemp("text-paper") / "base"
    out.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *GOOD, *BAD, *FILLER]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab=str(out / "vocab.txt")).save_pretrained(out)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), **factories.TINY_BERT)).save_pretrained(out)
    return out


def _sentences(count: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(count):
        words = rng.sample(FILLER, 4) + [rng.choice(GOOD if i % 2 else BAD)]
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(i % 2)
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["bad", "good"])}
    )
    return datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)


def _toy(seed: int) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        train=_sentences(48, seed),
        validation=_sentences(24, seed + 1),
        test=_sentences(8, seed + 2),
    )


class _TestLocked(datasets.DatasetDict):
    """A DatasetDict whose test split cannot be read: any access to it fails the test."""

    def __getitem__(self, key):
        if key == "test":
            raise AssertionError("the test split was read")
        return super().__getitem__(key)

    def values(self):
        raise AssertionError("every split (test included) was read")

    def items(self):
        raise AssertionError("every split (test included) was read")


def _locked(seed: int) -> _TestLocked:
    return _TestLocked(_toy(seed))


OPTIONS = dict(steps=6, batch_size=16, lr=1e-3, max_length=16, probe_steps=50, progress=False)


def test_the_head_stays_frozen_while_the_encoder_trains(tiny_base, tmp_path, monkeypatch):
    """The head fitted on the base is saved bit for bit; the pooler stays the base's; the encoder
    moves (‖τ‖/‖θ₀‖ > 0); the saved expert, read through its mean-pooling head, reproduces the
    reported validation accuracy."""
    from transformers import AutoTokenizer, BertModel

    fitted = {}
    fit = text_encoder_finetuning.fit_linear_probe

    def recording_fit(*args, **kwargs):
        linear = fit(*args, **kwargs)
        fitted.update({k: v.detach().clone() for k, v in linear.state_dict().items()})
        return linear

    monkeypatch.setattr(text_encoder_finetuning, "fit_linear_probe", recording_fit)
    out = tmp_path / "expert"
    stats = finetune_text_encoder(tiny_base, _locked(0), out, **OPTIONS)

    saved = load_file(str(out / "classifier.safetensors"))
    assert torch.equal(saved["weight"], fitted["weight"])
    assert torch.equal(saved["bias"], fitted["bias"])
    head = load_linear_head(out)
    assert head.features == "mean_pooling" and head.labels == ["bad", "good"]

    base, tuned = BertModel.from_pretrained(tiny_base), BertModel.from_pretrained(out).eval()
    before, after = base.state_dict(), tuned.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("pooler."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("encoder."))
    assert 0.0 < stats["task_vector_ratio"] < 0.5
    assert 0.0 <= stats["probe_validation_accuracy"] <= 1.0 and stats["pooling"] == "mean"

    validation = _toy(0)["validation"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(list(validation["text"]), padding=True, return_tensors="pt")
    with torch.no_grad():
        features = pooled(tuned(**inputs), inputs["attention_mask"], "mean_pooling")
    predicted = head.logits(features).argmax(-1)
    accuracy = (predicted == torch.tensor(list(validation["label"]))).float().mean().item()
    assert accuracy == pytest.approx(stats["validation_accuracy"])


def test_the_expert_head_reads_the_mean_pooled_tower(tiny_base, tmp_path):
    """An evaluated checkpoint under a text-paper expert's head: logits = the frozen Linear on the
    mean of last_hidden_state over the real tokens (padding left out)."""
    from transformers import BertModel

    from featcal_core.evaluation.expert_head import ExpertHead

    out = tmp_path / "expert"
    finetune_text_encoder(tiny_base, _toy(0), out, **{**OPTIONS, "steps": 1})
    head = ExpertHead(out, max_length=16)
    inputs = head.preprocess(["the good movie", "a bad long dull film plot"])
    assert int(inputs["attention_mask"].sum()) < inputs["attention_mask"].numel()  # padded
    with torch.no_grad():
        logits = head.classifier(tiny_base, torch.device("cpu"))(**inputs)
        hidden = BertModel.from_pretrained(tiny_base).eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    expected = load_linear_head(out).logits((hidden * mask).sum(1) / mask.sum(1))
    torch.testing.assert_close(logits, expected)


def test_a_seeded_text_paper_build_is_reproducible(tiny_base, tmp_path):
    """The preset's recipe at tiny sizes: the same seed gives the same models (content-hash
    commits), another seed other experts; the manifest records base + head, expert and
    ‖τ‖/‖θ₀‖ per expert."""
    roots = {}
    for task, seed in (("left", 0), ("right", 10)):
        roots[task] = tmp_path / "data" / task
        _toy(seed).save_to_disk(str(roots[task]))
    preset = PRESETS["text-paper"]
    spec = dataclasses.replace(
        preset,
        name="tiny-text-paper",
        tasks={task: str(path) for task, path in roots.items()},
        base=str(tiny_base),
        max_train=None,
        max_length=16,
        extra={**preset.extra, "recipe": [[1e-3, 2], [3e-3, 3]]},
    )
    first = build_zoo(spec, tmp_path / "a", progress=False)
    again = build_zoo(spec, tmp_path / "b", progress=False)
    other = build_zoo(spec.with_seed(1), tmp_path / "c", progress=False)
    assert first["base"]["commit"] == again["base"]["commit"] == other["base"]["commit"]
    recipe = first["recipe"]
    chosen = (recipe["chosen"]["lr"], recipe["chosen"]["steps"])
    assert chosen in ((1e-3, 2), (3e-3, 3)) and recipe["chosen"] == again["recipe"]["chosen"]
    assert len(recipe["trials"]) == 4  # two candidates on two tasks
    for task, entry in first["experts"].items():
        assert entry["commit"] == again["experts"][task]["commit"]
        assert entry["commit"] != other["experts"][task]["commit"]
        for key in ("probe_validation_accuracy", "validation_accuracy", "task_vector_ratio"):
            assert entry[key] == again["experts"][task][key]
        assert 0.0 < entry["task_vector_ratio"] < 0.5 and entry["pooling"] == "mean"
        assert entry["steps"] == chosen[1]
        tried = [t for t in recipe["trials"] if t["task"] == task]
        assert len({t["probe_validation_accuracy"] for t in tried}) == 1  # one head per task
    assert first["spec"]["extra"]["expert"] == {"head": "probe", "pooling": "mean"}


def test_the_probe_and_the_recipe_choice_never_read_the_test_split(tiny_base, tmp_path):
    """Fitting the heads, comparing poolings and choosing lr and steps read train and
    validation only (the test split of every dataset here fails when read); the rule keeps the
    candidates within the task-vector bound."""
    finetune_text_encoder(tiny_base, _locked(0), tmp_path / "probe", **OPTIONS)
    data = {"left": _locked(0), "right": _locked(10)}
    accuracy = compare_poolings(tiny_base, data, max_length=16, probe_steps=20)
    assert set(accuracy) == {"left", "right"}
    assert all(set(row) == {"mean", "cls"} for row in accuracy.values())

    candidates = [(1e-3, 3), (1e-9, 2)]
    common = dict(work_dir=tmp_path / "trials", batch_size=16, max_length=16, min_gain=-1.0)
    chosen, trials = choose_recipe(tiny_base, data, candidates, max_ratio=1e-6, **common)
    assert len(trials) == 4 and {t.task for t in trials} == {"left", "right"}
    assert chosen == (1e-9, 2)  # the only one whose task vectors stay within the bound
    large = max(t.task_vector_ratio for t in trials if t.lr == 1e-3)
    small = max(t.task_vector_ratio for t in trials if t.lr == 1e-9)
    assert small < 1e-6 < large
    assert not list((tmp_path / "trials").glob("*/*"))  # every trial's expert is removed


def test_text_paper_bad_options_are_refused(tiny_base, tmp_path):
    with pytest.raises(FeatCalError, match="pooling 'max'"):
        finetune_text_encoder(tiny_base, _toy(0), tmp_path / "x", **OPTIONS, pooling="max")
    with pytest.raises(FeatCalError, match="no candidates"):
        choose_recipe(tiny_base, {"left": _toy(0)}, [], work_dir=tmp_path / "w")
    with pytest.raises(FeatCalError, match="no 'validation' split"):
        compare_poolings(tiny_base, {"left": datasets.DatasetDict(train=_sentences(4, 0))})
    assert not (tmp_path / "x").exists()


def test_the_text_paper_preset_and_its_params_file():
    """Five text tasks with probe heads on mean pooling; params/text-paper.yaml builds it in
    data/zoo/text-paper and calibrates with mean pooling (every real token weighs 1)."""
    from featcal_core.params import load_params
    from featcal_core.params.installed import installed_params

    spec = PRESETS["text-paper"]
    assert spec.modality == "text" and len(spec.tasks) >= 5 and spec.base is None
    assert spec.extra["expert"] == {"head": "probe", "pooling": "mean"}
    assert len(spec.extra["recipe"]) >= 2  # lr and steps are chosen on validation
    params = load_params(installed_params()["text-paper"])
    assert params.zoo is not None and params.zoo.preset == "text-paper"
    assert params.zoo.dir == "data/zoo/text-paper" and params.featcal.pooling == "mean"
