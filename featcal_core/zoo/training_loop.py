"""The optimisation shared by the zoo's trainers: seeded batches, the AdamW loop, evaluation.

`train_steps` runs AdamW with a 10 % linear warmup then cosine (or linear) decay and gradient-norm
clipping; `index_batches` draws seeded epochs of index batches; `fit_linear_probe` fits a Linear
head on fixed features; `evaluate` gives accuracy and mean cross-entropy; `task_vector_ratio`
measures how far fine-tuning moved a model; `torch_threads` pins torch's thread count for a run.
The same seed gives bitwise-identical results on the same CPU build and thread count.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch.nn import functional as F

from featcal_core.errors import FeatCalError
from featcal_core.io import failpoints

EVAL_BATCH = 256
_WARMUP = 0.1  # fraction of the steps with a linear learning-rate warmup


def index_batches(
    count: int, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless index batches (batch_size,) over range(count): a fresh seeded permutation per epoch,
    the incomplete last batch of an epoch dropped (a single batch of `count` when count <
    batch_size)."""
    size = min(batch_size, count)
    while True:
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - size + 1, size):
            yield order[start : start + size]


def train_steps(
    step_loss,
    parameters: Sequence[torch.Tensor],
    steps: int,
    lr: float,
    weight_decay: float,
    desc: str,
    progress: bool,
    *,
    cosine: bool = True,
) -> list[float]:
    """`steps` AdamW steps on step_loss(step) with 10% linear warmup then cosine (or linear)
    decay to 0 and gradient-norm clipping at 1; returns the loss of every step.
    `FEATCAL_FAILPOINT=train:<desc>` stops it after its first step (featcal_core.io.failpoints)."""
    from featcal_core.progress import stage_progress

    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]  # biases, norms, class/position vectors
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
    )
    warmup = max(1, int(_WARMUP * steps))

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * done)) if cosine else 1 - done

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    losses: list[float] = []
    with stage_progress(total=steps, desc=desc, unit="step", enabled=progress) as bar:
        for step in range(steps):
            loss = step_loss(step)
            if not torch.isfinite(loss):
                raise FeatCalError(
                    f"{desc}: the training loss became {loss.item()} at step {step}; lower lr "
                    f"(now {lr})"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            failpoints.hit("train", desc)  # the fault tests stop a training here
            bar.update()
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def fit_linear_probe(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, steps: int, seed: int
) -> torch.nn.Linear:
    """A Linear head (num_classes, hidden) fitted on fixed features (N, hidden) and labels (N,):
    `steps` full-batch AdamW steps (lr 1e-2, weight decay 1e-4) on the cross-entropy, seeded
    initialisation; the features are used as they are (the head reads the model's output)."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(features.shape[1], num_classes)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        loss = F.cross_entropy(linear(features), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return linear


@torch.no_grad()
def evaluate(logits_of, labels: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of logits_of(index batch) (B, C) against labels (N,)."""
    correct, loss = 0, 0.0
    for start in range(0, len(labels), EVAL_BATCH):
        index = torch.arange(start, min(start + EVAL_BATCH, len(labels)))
        logits = logits_of(index).float()
        correct += int((logits.argmax(-1) == labels[index]).sum())
        loss += float(F.cross_entropy(logits, labels[index], reduction="sum"))
    return correct / len(labels), loss / len(labels)


def task_vector_ratio(initial: dict[str, torch.Tensor], final: dict[str, torch.Tensor]) -> float:
    """‖θ − θ₀‖ / ‖θ₀‖ over the floating tensors of `initial` (float64 sums)."""
    delta = sum(float((final[k].double() - v.double()).pow(2).sum()) for k, v in initial.items())
    base = sum(float(v.double().pow(2).sum()) for v in initial.values())
    return (delta / base) ** 0.5 if base > 0 else 0.0


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch.set_num_threads(threads) for the duration (untouched when threads is None)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
