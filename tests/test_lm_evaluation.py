"""Causal-LM evaluation (label-continuation accuracy, perplexity) against brute force: one
unpadded forward per (example, class) through the HF model, and the HF model's own loss."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from featcal_core.data.synthetic import WORDS, word_tokenizer
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.language_model import (
    evaluate_lm_dataset,
    label_continuation,
    perplexity,
)

TEMPLATE = "{text} ->"
LABEL_WORDS = ["good", "bad", "long story"]  # one two-token label: no length normalisation


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm")
    tokenizer = word_tokenizer()
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _texts(count: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(n),), generator=g))
        for n in torch.randint(2, 9, (count,), generator=g)
    ]


@torch.no_grad()
def _brute(lm_dir, texts, labels):
    model = LlamaForCausalLM.from_pretrained(lm_dir, dtype=torch.float64).eval()
    tokenizer = word_tokenizer()
    correct, losses = 0, []
    for text, label in zip(texts, labels, strict=True):
        prompt = tokenizer(TEMPLATE.format(text=text))["input_ids"]
        scores, counts = [], []
        for word in LABEL_WORDS:
            cont = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + cont])
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            scores.append(
                sum(float(log_probs[len(prompt) - 1 + j, tok]) for j, tok in enumerate(cont))
            )
            counts.append(len(cont))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == label)
        losses.append(-scores[label] / counts[label])
    return correct / len(texts), sum(losses) / len(losses)


def test_label_continuation_matches_brute_force(lm_dir):
    texts = _texts(12, 0)
    labels = [i % 3 for i in range(12)]
    result = label_continuation(lm_dir, lm_dir, texts, labels, LABEL_WORDS, TEMPLATE, batch_size=5)
    accuracy, loss = _brute(lm_dir, texts, labels)
    assert result["examples"] == 12
    assert result["accuracy"] == pytest.approx(accuracy)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)


def test_perplexity_matches_the_models_own_loss(lm_dir):
    texts = _texts(5, 1)
    result = perplexity(lm_dir, lm_dir, texts, batch_size=2)  # padded batches
    model = LlamaForCausalLM.from_pretrained(lm_dir).eval()
    tokenizer = word_tokenizer()
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:  # one unpadded sequence at a time: HF's mean loss over its tokens
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert result["tokens"] == count
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_dataset_evaluation_and_bad_inputs(lm_dir, tmp_path):
    texts = _texts(6, 2)
    data = datasets.DatasetDict(
        {"test": datasets.Dataset.from_dict({"text": texts, "label": [0, 1, 2, 0, 1, 2]})}
    )
    data.save_to_disk(str(tmp_path / "set"))
    result = evaluate_lm_dataset(
        lm_dir, lm_dir, tmp_path / "set", "test", LABEL_WORDS, TEMPLATE, max_examples=4
    )
    assert result["examples"] == 4 and result["perplexity"] > 1.0
    with pytest.raises(FeatCalError, match="no {text} placeholder"):
        label_continuation(lm_dir, lm_dir, texts, [0] * 6, LABEL_WORDS, "no placeholder")
    with pytest.raises(FeatCalError, match="out of range"):
        label_continuation(lm_dir, lm_dir, texts, [5] * 6, LABEL_WORDS, TEMPLATE)
    with pytest.raises(FeatCalError, match="no column 'sentence'"):
        evaluate_lm_dataset(
            lm_dir, lm_dir, tmp_path / "set", "test", LABEL_WORDS, text_column="sentence"
        )
    with pytest.raises(FeatCalError, match="cannot load a causal language model"):
        label_continuation(tmp_path / "set", lm_dir, texts, [0] * 6, LABEL_WORDS, TEMPLATE)


@torch.no_grad()
def test_t5_label_scoring_matches_the_models_own_loss(tmp_path):
    """Text-to-text (T5): each label's tokens (with eos) scored as the decoder output for the
    prompt; brute force: the HF model's mean loss on that one pair times its label length."""
    from transformers import T5Config, T5ForConditionalGeneration

    from featcal_core.data.synthetic import t5_tokenizer

    tokenizer = t5_tokenizer()
    torch.manual_seed(4)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=16,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        d_kv=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts, labels = _texts(6, 3), [0, 1, 2, 2, 1, 0]
    result = label_continuation(
        tmp_path, tmp_path, texts, labels, LABEL_WORDS, TEMPLATE, batch_size=4
    )
    model = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    correct, losses = 0, []
    for text, label in zip(texts, labels, strict=True):
        ids = tokenizer(TEMPLATE.format(text=text), return_tensors="pt")["input_ids"]
        totals, counts = [], []
        for word in LABEL_WORDS:
            target = tokenizer(" " + word, return_tensors="pt")["input_ids"]
            totals.append(-float(model(input_ids=ids, labels=target).loss) * target.shape[1])
            counts.append(target.shape[1])
        correct += int(max(range(3), key=totals.__getitem__) == label)
        losses.append(-totals[label] / counts[label])
    assert result["accuracy"] == pytest.approx(correct / 6)
    assert result["loss"] == pytest.approx(sum(losses) / 6, rel=1e-5)
