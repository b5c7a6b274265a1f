"""Fine-tuning a zoo text expert: a `BertModel` directory as `BertForSequenceClassification`.

`finetune_text_expert` saves the classifier (id2label = the ClassLabel names) and its tokenizer.
Seeded and deterministic; the test split is never read; the output directory is written under a
temporary sibling name and renamed into place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import guarded_directory
from featcal_core.zoo.training_inputs import (
    ENCODE_CHUNK,
    check_out_dir,
    check_run,
    class_names,
    label_tensor,
    load_pretrained,
)
from featcal_core.zoo.training_loop import (
    evaluate,
    index_batches,
    tail_mean,
    torch_threads,
    train_steps,
)

logger = logging.getLogger(__name__)


def finetune_text_expert(
    base_dir: str | Path,
    dataset: Any,
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 5e-5,
    weight_decay: float = 0.01,
    max_length: int = 64,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the `BertModel` in base_dir (with its tokenizer files) as a
    `BertForSequenceClassification` on dataset["train"] (`text`, ClassLabel `label`).

    Texts are truncated to max_length tokens; batches are padded to their longest text. A pooler
    missing from the base is newly initialised. AdamW, 10% linear warmup then linear decay.
    Saves the model (save_pretrained, id2label = the ClassLabel names) and the tokenizer into
    out_dir. Returns {"validation_accuracy", "validation_loss", "train_loss" (mean of the last
    10% of steps), "num_classes", "steps", "seconds" (wall)}; the test split is never read.
    """
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    check_out_dir(out_dir, overwrite)
    check_run(steps, batch_size, lr)
    if max_length < 2:
        raise FeatCalError(f"finetune_text_expert: max_length {max_length} < 2; pass e.g. 64")
    what = f"dataset for {out_dir.name}"
    names = class_names(dataset, ("text", "label"), what)
    config = load_pretrained(AutoConfig, base_dir, "text base")
    if config.model_type != "bert":
        raise FeatCalError(
            f"{base_dir / 'config.json'}: model_type {config.model_type!r}, expected 'bert'; pass "
            "a BertModel directory (e.g. all-MiniLM-L6-v2)"
        )
    tokenizer = load_pretrained(AutoTokenizer, base_dir, "text base tokenizer")
    started = time.perf_counter()
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        train_x, val_x = (
            tokenize_split(tokenizer, dataset[s], max_length, what, s)
            for s in ("train", "validation")
        )
        train_y, val_y = (
            label_tensor(dataset[s], len(names), what, s) for s in ("train", "validation")
        )
        torch.manual_seed(seed)
        model = load_pretrained(
            BertForSequenceClassification,
            base_dir,
            "text base",
            num_labels=len(names),
            id2label=dict(enumerate(names)),
            label2id={name: i for i, name in enumerate(names)},
        )
        logger.info(
            "%s: fine-tuning on %d train texts, %d classes, %d steps of %d",
            out_dir.name,
            len(train_y),
            len(names),
            steps,
            batch_size,
        )
        torch.manual_seed(seed)  # dropout masks
        model.train()
        generator = torch.Generator().manual_seed(seed)
        batches = index_batches(len(train_y), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            return F.cross_entropy(model(**train_x.batch(index)).logits, train_y[index])

        losses = train_steps(
            step_loss,
            list(model.parameters()),
            steps,
            lr,
            weight_decay,
            out_dir.name,
            progress,
            cosine=False,
        )
        model.eval()
        val_accuracy, val_loss = evaluate(lambda index: model(**val_x.batch(index)).logits, val_y)
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    stats = {
        "validation_accuracy": val_accuracy,
        "validation_loss": val_loss,
        "train_loss": tail_mean(losses),
        "num_classes": len(names),
        "steps": steps,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: fine-tuned %s", out_dir.name, stats)
    return stats


@dataclass
class Tokens:
    """Token ids and attention mask (N, max_length), right-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows in index, cut to their longest text."""
        mask = self.attention_mask[index]
        length = max(1, int(mask.sum(1).max()))
        out = {"input_ids": self.input_ids[index, :length], "attention_mask": mask[:, :length]}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids[index, :length]
        return out


def tokenize_split(tokenizer: Any, split: Any, max_length: int, what: str, name: str) -> Tokens:
    """The `text` column of one split as right-padded Tokens (N, max_length), truncated to
    max_length tokens; FeatCalError naming `what` and the split for a non-string text."""
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(split), ENCODE_CHUNK):
        texts = split[start : start + ENCODE_CHUNK]["text"]
        if not all(isinstance(text, str) for text in texts):
            raise FeatCalError(
                f"{what}: split {name!r} column 'text' holds non-string entries; store strings "
                "(drop or fill the missing ones)"
            )
        encoded = tokenizer(
            texts,
            truncation=True,
            max_length=max_length,
            padding="max_length",
            return_tensors="pt",
        )
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            if key in encoded:
                parts.setdefault(key, []).append(encoded[key])
    joined = {key: torch.cat(value) for key, value in parts.items()}
    return Tokens(joined["input_ids"], joined["attention_mask"], joined.get("token_type_ids"))
