"""Training the tiny LMs of `lm_token_weighting.py`: AdamW with warmup + cosine over seeded
batches, pretraining by next-token prediction, fine-tuning on the label word's token, saving."""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from lm_settings import BATCH, FINETUNE_LR, MAX_LENGTH, PRETRAIN_LR, TEMPLATE

log = logging.getLogger("lm_token_weighting")


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def batches(count: int, steps: int, rng: np.random.Generator):
    """`steps` batches of BATCH row indices, epoch by epoch in a seeded order."""
    order: list[int] = []
    for _ in range(steps):
        if len(order) < BATCH:
            order += [int(i) for i in rng.permutation(count)]
        yield order[:BATCH]
        order = order[BATCH:]


def train(model, steps: int, peak_lr: float, loss_fn, count: int, seed: int, what: str) -> float:
    """AdamW (warmup + cosine, clip 1.0) over seeded batches; returns the mean loss of the last
    10 % of steps."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    losses, started = [], time.perf_counter()
    for step, rows in enumerate(batches(count, steps, rng)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn(rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, steps // 5) == 0:
            log.info(
                "%s: step %d/%d, loss %.4f (%.0f s)",
                what,
                step + 1,
                steps,
                float(np.mean(losses[-20:])),
                time.perf_counter() - started,
            )
    model.eval()
    return float(np.mean(losses[-max(1, steps // 10) :]))


def pretrain(model, tokenizer, texts: list[str], steps: int, seed: int) -> float:
    """Next-token prediction on the plain texts (bos text eos)."""
    sequences = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    sequences = [s[:MAX_LENGTH] for s in sequences]

    def loss_fn(rows):
        ids, mask = pad([sequences[i] for i in rows], tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    return train(model, steps, PRETRAIN_LR, loss_fn, len(sequences), seed, "pretrain")


def finetune(model, tokenizer, texts, labels, words, steps: int, seed: int, what: str) -> float:
    """Cross-entropy of the label word's token after "{text} ->" (only the answer positions go
    through the lm_head)."""
    prompts = tokenizer([TEMPLATE.format(text=t) for t in texts])["input_ids"]
    answers = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in words]

    def loss_fn(rows):
        sequences = [prompts[i] + answers[labels[i]] for i in rows]
        ids, mask = pad(sequences, tokenizer.pad_token_id)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        picks, targets = [], []
        for row, i in enumerate(rows):
            start = len(prompts[i]) - 1  # the position whose next token is the answer's first
            for k, token in enumerate(answers[labels[i]]):
                picks.append(hidden[row, start + k])
                targets.append(token)
        logits = model.lm_head(torch.stack(picks))
        return torch.nn.functional.cross_entropy(logits, torch.tensor(targets))

    return train(model, steps, FINETUNE_LR, loss_fn, len(prompts), seed, what)


def save_model(model, tokenizer, path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path
