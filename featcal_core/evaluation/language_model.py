"""Evaluation of language models: label-continuation accuracy on classification sets for causal
LMs (hf-llama) and text-to-text models (hf-t5, GLUE style: each label's tokens as the decoder's
output), and, for causal LMs, perplexity on held-out text.

Label continuation: for each example the prompt `template.format(text=...)` is scored with every
class's label words appended; the prediction is the class whose continuation has the highest total
log-probability (sum over the label's tokens, so no length normalisation); the loss is the mean
negative log-likelihood of the true label's tokens. Perplexity: exp of the mean next-token
negative log-likelihood over every real (non-padding) token after the first, in float64.

A model folder may be a peft LoRA adapter: it is applied over `tokenizer_dir`, the base model
(featcal_core.io.adapters).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from featcal_core.architectures.base import load_tokenizer
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import _device
from featcal_core.evaluation.dataset import _check_labels, _load_split
from featcal_core.progress import stage_progress

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "{text} ->"


def generation_kind(model_dir: str | Path, base: str | Path | None = None) -> str | None:
    """ "causal" (hf-llama), "seq2seq" (hf-t5 with a decoder) or None (not a generating LM); of
    a LoRA adapter folder: its `base`'s."""
    from featcal_core.architectures import detect
    from featcal_core.io.adapters import is_adapter

    if base is not None and is_adapter(model_dir):
        model_dir = base
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        arch = detect(config, str(model_dir))
    except FeatCalError:
        return None
    if arch.causal:
        return "causal"
    return "seq2seq" if getattr(arch, "decoder_start", None) is not None else None


def load_causal_lm(
    model_dir: str | Path,
    device: torch.device,
    kind: str | None = None,
    base: str | Path | None = None,
) -> torch.nn.Module:
    """A `*ForCausalLM` (or, for T5, `*ForConditionalGeneration`) from a save_pretrained
    directory, or from a LoRA adapter folder over `base`, float32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from featcal_core.io.adapters import is_adapter, load_adapter_weights

    adapter = is_adapter(model_dir)
    if adapter and base is None:
        raise FeatCalError(
            f"{model_dir} is a LoRA adapter; evaluating it needs its base model: pass the base"
        )
    source = base if adapter and base is not None else model_dir
    kind = kind or generation_kind(source)
    loader = AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM
    try:
        model: torch.nn.Module = loader.from_pretrained(str(source), dtype=torch.float32)
    except Exception as exc:
        raise FeatCalError(
            f"{model_dir}: cannot load a causal language model ({exc}); pass a save_pretrained "
            "directory of a *ForCausalLM or T5ForConditionalGeneration (config.json with weights)"
        ) from exc
    if adapter:
        load_adapter_weights(model, model_dir, source)
    return model.to(device).eval().requires_grad_(False)


def _seq2seq_scores(model, tokenizer, prompts, words, labels_count, batch_size, dev, progress):
    """(N, C) total log-probability of each class's label tokens (with eos) as the decoder's
    output for each prompt (text-to-text, GLUE style)."""
    targets = [tokenizer(" " + w)["input_ids"] for w in words]
    scores = torch.zeros(len(prompts), labels_count, dtype=torch.float64)
    pairs = [(i, c) for i in range(len(prompts)) for c in range(labels_count)]
    starts = range(0, len(pairs), batch_size)
    for start in stage_progress(starts, desc="label scoring", unit="batch", enabled=progress):
        chunk = pairs[start : start + batch_size]
        enc = tokenizer([prompts[i] for i, _ in chunk], padding=True, return_tensors="pt")
        width = max(len(targets[c]) for _, c in chunk)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (_, c) in enumerate(chunk):
            labels[row, : len(targets[c])] = torch.tensor(targets[c])
        logits = (
            model(
                input_ids=enc["input_ids"].to(dev),
                attention_mask=enc["attention_mask"].to(dev),
                labels=labels.to(dev),
            )
            .logits.to(torch.float64)
            .cpu()
        )
        log_probs = torch.log_softmax(logits, -1)
        keep = labels != -100
        picked = log_probs.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * keep
        for row, (i, c) in enumerate(chunk):
            scores[i, c] = picked[row].sum()
    return scores, torch.tensor([len(t) for t in targets], dtype=torch.float64)


def _token_log_probs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, j] | ids[:, :j]) for j ≥ 1, float64 (B, S-1); 0 where the token is padding."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].to(torch.float64)
    picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return picked * mask[:, 1:].to(torch.float64)


@torch.no_grad()
def label_continuation(
    model_dir: str | Path,
    tokenizer_dir: str | Path,
    texts: list[str],
    labels: list[int],
    label_words: list[str],
    template: str = DEFAULT_TEMPLATE,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, float]:
    """{"accuracy", "loss", "examples"} of the likeliest label continuation (see module doc)."""
    if "{text}" not in template:
        raise FeatCalError(f"prompt template {template!r} has no {{text}} placeholder")
    if len(label_words) < 2:
        raise FeatCalError("label continuation needs at least two label words (one per class)")
    target = _check_labels(labels, len(label_words), "evaluation set", "label")
    dev = _device(device)
    tokenizer = load_tokenizer(tokenizer_dir, "base model", right_padded=True)
    kind = generation_kind(model_dir, tokenizer_dir)
    model = load_causal_lm(model_dir, dev, kind, base=tokenizer_dir)
    if kind == "seq2seq":
        scores, lengths = _seq2seq_scores(
            model,
            tokenizer,
            [template.format(text=t) for t in texts],
            label_words,
            len(label_words),
            batch_size,
            dev,
            progress,
        )
        return _summary(scores, lengths, target)
    prompts = [tokenizer(template.format(text=t))["input_ids"] for t in texts]
    words = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in label_words]
    empty = [w for w, ids in zip(label_words, words, strict=True) if not ids]
    if empty:
        raise FeatCalError(f"label word {empty[0]!r} has no tokens; choose other label words")
    scores = torch.zeros(len(prompts), len(label_words), dtype=torch.float64)
    pairs = [(i, c) for i in range(len(prompts)) for c in range(len(label_words))]
    for start in stage_progress(
        range(0, len(pairs), batch_size), desc="label continuation", unit="batch", enabled=progress
    ):
        chunk = pairs[start : start + batch_size]
        sequences = [prompts[i] + words[c] for i, c in chunk]
        width = max(len(seq) for seq in sequences)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        log_probs = _token_log_probs(model, ids.to(dev), mask.to(dev)).cpu()
        for row, (i, c) in enumerate(chunk):
            # the label's tokens: positions len(prompt) … len(prompt)+len(word)-1 (shifted by one)
            scores[i, c] = log_probs[
                row, len(prompts[i]) - 1 : len(prompts[i]) - 1 + len(words[c])
            ].sum()
    lengths = torch.tensor([len(w) for w in words], dtype=torch.float64)
    return _summary(scores, lengths, target)


def _summary(scores: torch.Tensor, lengths: torch.Tensor, target: torch.Tensor) -> dict:
    """Accuracy of the best-scoring class and mean per-token NLL of the true label."""
    predicted = scores.argmax(-1)
    true_scores = scores.gather(-1, target[:, None])[:, 0]
    return {
        "accuracy": float((predicted == target).to(torch.float64).mean()),
        "loss": float((-true_scores / lengths[target]).mean()),
        "examples": int(target.shape[0]),
    }


@torch.no_grad()
def perplexity(
    model_dir: str | Path,
    tokenizer_dir: str | Path,
    texts: list[str],
    max_length: int = 512,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """{"perplexity", "nll", "tokens"} of `texts` under the model (see module doc)."""
    dev = _device(device)
    tokenizer = load_tokenizer(tokenizer_dir, "base model", right_padded=True)
    model = load_causal_lm(model_dir, dev, base=tokenizer_dir)
    total, count = 0.0, 0
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(
            [str(t) for t in texts[start : start + batch_size]],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        ids, mask = encoded["input_ids"].to(dev), encoded["attention_mask"].to(dev)
        total -= float(_token_log_probs(model, ids, mask).sum())
        count += int(mask[:, 1:].sum())
    if count == 0:
        raise FeatCalError("perplexity: the texts hold no tokens to predict")
    nll = total / count
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count}


def evaluate_lm_dataset(
    model_dir: str | Path,
    tokenizer_dir: str | Path,
    dataset_dir: str | Path,
    split: str | None,
    label_words: list[str],
    template: str = DEFAULT_TEMPLATE,
    text_column: str = "text",
    label_column: str = "label",
    max_examples: int | None = None,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Label-continuation accuracy and loss on a save_to_disk classification set, plus the
    perplexity of its texts."""
    data = _load_split(dataset_dir, split)
    for column in (text_column, label_column):
        if column not in data.column_names:
            raise FeatCalError(
                f"evaluation set {dataset_dir}: no column {column!r} (has {data.column_names})"
            )
    split_rows = len(data)
    if max_examples is not None:
        data = data.select(range(min(max_examples, len(data))))
    texts, labels = [str(t) for t in data[text_column]], list(data[label_column])
    result = label_continuation(
        model_dir, tokenizer_dir, texts, labels, label_words, template, batch_size, device
    )
    if generation_kind(model_dir, tokenizer_dir) == "causal":  # decoder-only: texts' perplexity
        result.update(
            perplexity(model_dir, tokenizer_dir, texts, batch_size=batch_size, device=device)
        )
    result["split_rows"] = split_rows
    return result
