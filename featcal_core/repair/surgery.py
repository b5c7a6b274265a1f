"""`train_surgery`: Representation Surgery (Yang et al., ICML 2024) as a repair baseline.

For each task t a small module (surgery_module.py) on the merged model's feature z, the input of
task t's head (`Head.parts` features: for CLIP vision experts with a linear head the tower's
pooler_output, post_layernorm(CLS); for CLIP zero-shot heads the L2-normalised projected image
embedding; for BERT-style classifiers the pooler output), trained so that

    ẑ = z − W_up·ReLU(W_down·z)   minimises   mean |ẑ − z_t|    (L1, unlabeled)

with z_t expert t's own feature on the same input. Inputs are task t's calibration set, drawn as
FeatCal draws it (`Settings`: num_per_task, seed). Both features are computed once (the module
acts on the final feature only), then Adam runs on the cached (N, d) float32 tensors, on the CPU.

Defaults, from the authors' code (github.com/EnnengYang/RepresentationSurgery, src/merging_model.py
and src/main_*_with_surgery.py) and FusionBench (config/method/surgery/adamerging_surgery.yaml,
fusion_bench/models/surgery/surgerymodelwrapper.py): rank 16, W_down Kaiming-uniform (a = √5),
W_up = 0, no biases, nn.L1Loss (mean), Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
batches of 16 reshuffled each pass; 1000 steps per task (FusionBench's surgery_steps; the authors
run 500 iterations of 2 batches per task). The paper trains on the tasks' unlabeled *test* inputs;
here, as for FeatCal, on the calibration (train-split) inputs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.head import Head
from featcal_core.io.outputs import guarded_directory, write_json
from featcal_core.memory import peak_rss_bytes
from featcal_core.method.settings import Settings
from featcal_core.progress import stage_progress
from featcal_core.repair import defaults
from featcal_core.repair.surgery_module import SurgeryModule, save_surgery
from featcal_core.repair.trained_inputs import (
    check_learning_rate,
    check_positive_integers,
    load_trained_inputs,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_RANK",
    "DEFAULT_STEPS",
    "DEFAULT_SURGERY_BATCH",
    "SURGERY_RECORD",
    "fit_surgery",
    "head_features",
    "train_surgery",
]

SURGERY_RECORD = "surgery.json"
RECORD_VERSION = 1
DEFAULT_RANK = defaults.SURGERY_RANK
DEFAULT_STEPS = defaults.SURGERY_STEPS
DEFAULT_LR = defaults.SURGERY_LR
DEFAULT_SURGERY_BATCH = defaults.SURGERY_BATCH
BETAS = (0.9, 0.999)


def check_hyperparameters(
    rank: int, steps: int, lr: float, batch_size: int, log_every: int
) -> None:
    """FeatCalError naming the first bad value."""
    check_positive_integers(
        {
            "--rank": rank,
            "--steps": steps,
            "--surgery-batch-size": batch_size,
            "--log-every": log_every,
        }
    )
    check_learning_rate(lr)


def task_generator(seed: int, task: str) -> torch.Generator:
    """A generator seeded from (seed, task): a task's module does not depend on the other tasks."""
    digest = hashlib.sha256(f"featcal-surgery:{seed}:{task}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@torch.no_grad()
def head_features(
    head: Head,
    model_dir: str | Path,
    rows: list[Any],
    *,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(N, d) float32 on the CPU: `head`'s input for the tower in `model_dir` on each of `rows`."""
    target = torch.device(device)
    features, _ = head.parts(model_dir, target)
    chunks = []
    for start in range(0, len(rows), batch_size):
        inputs = {
            k: v.to(target) for k, v in head.preprocess(rows[start : start + batch_size]).items()
        }
        chunks.append(features(**inputs).float().cpu())
    out = torch.cat(chunks)
    if out.ndim != 2 or not torch.isfinite(out).all():
        raise FeatCalError(
            f"{head.describe()} on {model_dir}: features of shape "
            f"{tuple(out.shape)} are not finite (N, d); check the model"
        )
    return out


def fit_surgery(
    merged: torch.Tensor,
    expert: torch.Tensor,
    *,
    rank: int = DEFAULT_RANK,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_SURGERY_BATCH,
    generator: torch.Generator,
    log_every: int = 50,
    progress: bool = False,
    desc: str = "surgery",
) -> tuple[SurgeryModule, dict[str, Any]]:
    """Train one module on cached features merged z, expert z_t: (N, d) each, same rows.

    Adam on mean |module(z_b) − z_t,b| over batches b of `batch_size` rows (a fresh permutation
    from `generator` each pass; the last batch of a pass may be smaller). Returns the module
    (eval mode) and the loss curve: {"first", "last", "every", "steps": [...], "loss": [...]}
    (step 1, every `log_every`-th, the last), plus the L1 on all N rows before and after."""
    if merged.shape != expert.shape or merged.ndim != 2 or merged.shape[0] == 0:
        raise FeatCalError(
            f"surgery: merged features {tuple(merged.shape)} and expert features "
            f"{tuple(expert.shape)} must both be (N, d) with N ≥ 1"
        )
    check_hyperparameters(rank, steps, lr, batch_size, log_every)
    z, target = merged.detach().float().cpu(), expert.detach().float().cpu()
    n, dim = z.shape
    if rank > dim:
        raise FeatCalError(
            f"surgery: rank {rank} (repair.surgery_rank, --rank) exceeds the width {dim} of the "
            f"features the head reads; give a rank of at most {dim}"
        )
    module = SurgeryModule(dim, rank).reset_parameters(generator).train()
    optimizer = torch.optim.Adam(module.parameters(), lr=lr, betas=BETAS, weight_decay=0.0)
    size = min(batch_size, n)
    order, cursor = torch.randperm(n, generator=generator), 0
    logged_steps, logged_loss = [], []
    for step in stage_progress(range(1, steps + 1), desc=desc, unit="step", enabled=progress):
        if cursor >= n:
            order, cursor = torch.randperm(n, generator=generator), 0
        batch = order[cursor : cursor + size]
        cursor += size
        loss = F.l1_loss(module(z[batch]), target[batch])
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FeatCalError(
                f"surgery: the loss is NaN or Inf at step {step}; check the "
                f"features or lower --lr (got {lr})"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == 1 or step % log_every == 0 or step == steps:
            logged_steps.append(step)
            logged_loss.append(value)
    if not all(torch.isfinite(p).all() for p in module.parameters()):
        raise FeatCalError(
            f"surgery: the module diverged (NaN or Inf weights); lower --lr (got {lr})"
        )
    module.eval()
    with torch.no_grad():
        l1_merged = float(F.l1_loss(z, target))
        l1_surgery = float(F.l1_loss(module(z), target))
    curve = {
        "first": logged_loss[0],
        "last": logged_loss[-1],
        "every": log_every,
        "steps": logged_steps,
        "loss": logged_loss,
        "l1_merged": l1_merged,
        "l1_surgery": l1_surgery,
    }
    return module, curve


def train_surgery(
    merged: str | Path,
    experts: Mapping[str, str | Path],
    calibration_sets: Mapping[str, str | Path],
    out: str | Path,
    *,
    heads: Mapping[str, Head] | None = None,
    rank: int = DEFAULT_RANK,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_SURGERY_BATCH,
    settings: Settings = Settings(),
    seed: int = 0,
    log_every: int = 50,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Train one surgery module per task for the tower in `merged`; write `out/<task>/`
    (surgery.safetensors + surgery.json, see surgery_module.py) and `out/surgery.json`, and
    return that record. Raises FeatCalError on bad input before any work, leaving `out` as it was.

    experts, calibration_sets: task → expert dir, task → `save_to_disk` dir (sampled as FeatCal
    samples: settings.num_per_task, settings.seed); heads: task → Head whose input the module acts
    on (default: the expert's own head, `ExpertHead(expert, tokenizer_dir=...)`); batch_size: rows
    per Adam step (feature passes use settings.batch_size on settings.device); seed: the modules'
    init and batch order (per task). Memory: one model at a time plus two (N, d) float32 features.
    """
    started = time.perf_counter()
    out = Path(out)
    check_hyperparameters(rank, steps, lr, batch_size, log_every)
    given = load_trained_inputs(
        "surgery",
        merged,
        experts,
        calibration_sets,
        out,
        heads=heads,
        tokenizer_dir=tokenizer_dir,
        settings=settings,
        seed=seed,
        overwrite=overwrite,
    )
    device, sets, inputs = given.device, given.sets, given.inputs
    hyper = {
        "rank": rank,
        "steps": steps,
        "lr": lr,
        "betas": list(BETAS),
        "weight_decay": 0.0,
        "batch_size": batch_size,
        "seed": seed,
        "log_every": log_every,
        "loss": "mean L1",
        "init": "W_down Kaiming-uniform (a = sqrt 5), W_up = 0",
    }
    log.info(
        "surgery (rank %d, %d steps, lr %g): %d tasks on %s", rank, steps, lr, len(sets), merged
    )
    tasks: dict[str, dict] = {}
    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        for task, data in sets.items():
            task_start = time.perf_counter()
            head = given.heads[task]
            z = head_features(
                head, merged, data.rows, batch_size=settings.batch_size, device=device
            )
            z_t = head_features(
                head, experts[task], data.rows, batch_size=settings.batch_size, device=device
            )
            module, curve = fit_surgery(
                z,
                z_t,
                rank=rank,
                steps=steps,
                lr=lr,
                batch_size=batch_size,
                generator=task_generator(seed, task),
                log_every=log_every,
                progress=progress,
                desc=f"surgery {task}",
            )
            summary = {
                "task": task,
                "feature": {
                    "head": head.describe(),
                    "modality": head.modality,
                    "rows": int(z.shape[0]),
                    "dim": int(z.shape[1]),
                },
                "hyperparameters": hyper,
                "loss": curve,
                "inputs": {
                    "merged": given.merged.describe(),
                    "expert": given.experts[task].describe(),
                    "calibration": data.describe(),
                },
                "wall_seconds": round(time.perf_counter() - task_start, 3),
                "peak_rss_bytes": peak_rss_bytes(),
            }
            save_surgery(tmp / task, module, summary)
            tasks[task] = {k: summary[k] for k in ("feature", "loss", "wall_seconds")}
            log.info(
                "surgery %s: d %d, %d rows, L1 %.4g -> %.4g (batch loss %.4g -> %.4g, %.1f s)",
                task,
                z.shape[1],
                z.shape[0],
                curve["l1_merged"],
                curve["l1_surgery"],
                curve["first"],
                curve["last"],
                summary["wall_seconds"],
            )
        record = {
            "surgery_record_version": RECORD_VERSION,
            "method": "representation_surgery",
            "hyperparameters": {**hyper, "settings": dict(asdict(settings), device=str(device))},
            "inputs": given.describe(),
            "tasks": tasks,
            "wall_seconds": round(time.perf_counter() - started, 3),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        write_json(tmp / SURGERY_RECORD, record, "surgery record")
        (tmp / "README.md").write_text(_card(merged, list(sets), rank), encoding="utf-8")
    log.info("wrote %s in %.1f s", out, record["wall_seconds"])
    return record


def _card(merged: str | Path, tasks: list[str], rank: int) -> str:
    """README.md of a surgery folder: what it is (not a checkpoint) and how to load it."""
    first = tasks[0] if tasks else "TASK"
    return f"""# Representation Surgery modules (not a checkpoint)

This folder holds one Representation Surgery module per task (Yang et al., ICML 2024) for the
merged checkpoint `{merged}`: for task t, the features z its head reads become
ẑ = z − W_up · ReLU(W_down · z) (rank {rank}) before the head's final layer. There is no single
model here: load the merged checkpoint with `from_pretrained` as usual, then apply the task's
module to the features:

```python
from featcal_core.repair.surgery_module import load_surgery

module = load_surgery("{first}")   # this folder's {first}/ (surgery.safetensors, surgery.json)
repaired = module(features)         # features: (N, d) float tensor the task's head reads
```

`featcal_core.repair.surgery_module.SurgeryHead(head, module)` does the same inside an evaluation
head. Tasks: {", ".join(tasks)}. `surgery.json` records the inputs (with their sha256), the
hyperparameters and each module's loss curve.
"""
