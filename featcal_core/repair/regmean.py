"""`regmean_checkpoint`: RegMean (Jin et al., ICLR 2023) as a repair of a merged checkpoint.

Every nn.Linear inside the architecture's blocks gets RegMean's weight (closed_form.py) from the
Grams of its inputs when expert t runs on task t's calibration inputs (grams.py); its bias the
mean of the experts' biases (as the reference code). Everything else (embeddings, norms, heads,
tensors outside the blocks) is the merged checkpoint's, bit for bit; the output has the merged
checkpoint's layout plus a `regmean.json` record.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.export import export_checkpoint
from featcal_core.io.outputs import check_output, guarded_directory, sweep, temp_path
from featcal_core.io.safetensors_io import DTYPES, save_tensors
from featcal_core.memory import peak_rss_bytes
from featcal_core.method.calibration import Calibration, calibration_inputs, check_tasks
from featcal_core.method.drift import check_finite
from featcal_core.method.settings import Settings
from featcal_core.method.solvers import Fallbacks
from featcal_core.method.streams import HiddenStreams
from featcal_core.progress import stage_progress
from featcal_core.repair import DEFAULT_ALPHA
from featcal_core.repair.closed_form import RIDGE, RegMeanSums
from featcal_core.repair.grams import ExpertPasses

log = logging.getLogger(__name__)

REGMEAN_RECORD = "regmean.json"
RECORD_VERSION = 1
#: α, the scale of the Grams' off-diagonal entries: FusionBench's RegMean for CLIP vision
#: (config/method/regmean/clip_regmean.yaml: reduce_non_diagonal_ratio 0.6). The authors' code
#: defaults to no reduction (α = 1, RoBERTa) and uses 0.1 in its T5 and DeBERTa configs.


def check_alpha(alpha: float) -> None:
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or not 0 <= alpha <= 1:
        raise FeatCalError(f"--alpha must be a number in [0, 1] (got {alpha!r})")


def regmean_block(
    passes: ExpertPasses,
    index: int,
    streams: HiddenStreams,
    masks: dict,
    alpha: float,
    batch_size: int,
) -> tuple[dict[str, torch.Tensor], dict]:
    """RegMean of block `index`: task by task, expert t's block on its stream (replaced by the
    block output), its Grams folded into float64 sums, then solved. Returns (merged checkpoint
    key → tensor in the merged dtype, the block's record entry)."""
    start = time.perf_counter()
    models, arch = passes.models, passes.arch
    linears = passes.linears(index)
    found = Fallbacks(f"block {index}")
    sums: dict[str, RegMeanSums] = {}
    tokens: dict[str, float] = {}
    groups: dict[str, str] = {}
    for task in models.experts:
        grams, groups = passes.task_grams(index, task, streams, masks, batch_size)
        params = passes.expert_params(index)
        for label, gram_sum in grams.items():
            if label not in sums:
                members = {n: linears[n][1:] for n, g in groups.items() if g == label}
                sums[label] = RegMeanSums(linears[label][0], members, passes.device)
            try:
                gram = gram_sum.mean()
            except ValueError as exc:
                raise FeatCalError(
                    f"task {task!r} gives no tokens to {label} in block {index}; check its "
                    "calibration set (rows, padding) and --token-weighting"
                ) from exc
            tokens.setdefault(task, gram_sum.weight)
            sums[label].add_task(gram, {n: params[n] for n in sums[label].modules}, alpha)
        del grams, params

    def anchor(name: str) -> torch.Tensor:  # the merged weight, read only for a ridge fallback
        canonical = arch.checkpoint_key(index, f"{name}.weight")
        return models.read(models.merged, [canonical])[canonical]

    prefix = models.prefix(models.merged)
    tensors: dict[str, torch.Tensor] = {}
    for label in list(sums):
        solved = sums.pop(label).solve(anchor, found, f"block {index}")
        for name, (weight, bias) in solved.items():
            for local, value in ((f"{name}.weight", weight), (f"{name}.bias", bias)):
                if value is None:
                    continue
                check_finite(value, f"RegMean {local} of block {index}")
                key = prefix + arch.checkpoint_key(index, local)
                dtype = DTYPES[models.merged.tensors[key].dtype]
                tensors[key] = value.to("cpu", dtype).contiguous()
    summary = {
        "index": index,
        "seconds": round(time.perf_counter() - start, 4),
        "groups": {
            label: sorted(n for n, g in groups.items() if g == label)
            for label in dict.fromkeys(groups.values())
        },
        "tokens": tokens,
        "fallbacks": found.entries,
    }
    return tensors, summary


def regmean_checkpoint(
    base: str | Path,
    merged: str | Path,
    experts: dict[str, str | Path],
    calibration_sets: dict[str, str | Path],
    out: str | Path,
    *,
    alpha: float = DEFAULT_ALPHA,
    settings: Settings = Settings(),
    pooled_weights: bool = False,
    spill_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Replace the block Linears of `merged` by RegMean's merge of `experts` (task → dir), with
    each expert's Grams on its task's calibration set (task → `save_to_disk` dir, drawn and
    tokenized as FeatCal does: `settings`). Writes a save_pretrained directory at `out` (the
    merged checkpoint's layout) plus `regmean.json`, and returns that record. Raises FeatCalError
    on bad input before any work, leaving `out` as it was.

    G_t is the per-token mean Σ ω x xᵀ / Σ ω of a Linear's input x (d_in) over task t's real
    tokens (ω = 1; FeatCal's token weights with `pooled_weights`). Linears reading the same input
    (q/k/v, gate/up) share one Gram. Memory: one expert block at a time; each task's hidden-state
    stream (n_t, S_t, d) in the model dtype (on disk with `spill_dir`); for the current block, per
    shared input, the task's Gram, Σ G̃_t (both d_in²) and Σ G̃_t W_tᵀ (d_in · Σ d_out), float64,
    plus one d_in² Cholesky factor while solving. ViT-B/32: about 0.3 GB of sums per block.
    """
    started = time.perf_counter()
    out = Path(out)
    check_tasks(experts, calibration_sets)
    check_alpha(alpha)
    inputs = calibration_inputs(base, merged, experts, calibration_sets)
    check_output(out, overwrite=overwrite, inputs=inputs)
    run = Calibration(base, merged, experts, calibration_sets, settings=settings)  # the checks
    passes = ExpertPasses(run.models, run.dtype, run.device, run.precision, pooled_weights)
    log.info(
        "RegMean (α = %g): %s, %d blocks, %d tasks, dtype %s",
        alpha,
        run.arch.name,
        run.num_blocks,
        len(run.sets),
        run.dtype,
    )
    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        if spill_dir is not None:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
            sweep(Path(spill_dir) / "regmean-spill")
            work = temp_path(Path(spill_dir) / "regmean-spill")
        else:
            work = tmp / "_work"
        work.mkdir()
        try:
            streams = HiddenStreams(work / "streams" if spill_dir is not None else None)
            masks = passes.stems(run.sets, streams, settings.batch_size, settings.max_length)
            blocks, replaced = [], {}
            for index in stage_progress(
                range(run.num_blocks), desc="RegMean blocks", unit="block", enabled=progress
            ):
                tensors, summary = regmean_block(
                    passes, index, streams, masks, alpha, settings.batch_size
                )
                path = work / f"block_{index:05d}.safetensors"
                save_tensors(path, tensors)
                replaced.update(dict.fromkeys(tensors, path))
                blocks.append(summary)
                log.info(
                    "block %d (%d of %d): %d tensors (%.1f s)",
                    index,
                    index + 1,
                    run.num_blocks,
                    len(tensors),
                    summary["seconds"],
                )
            export_checkpoint(
                run.models.merged, replaced, tmp, extra_sources=(run.models.base.directory,)
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        record = _record(run, alpha, pooled_weights, blocks, started)
        (tmp / REGMEAN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s in %.1f s", out, record["wall_seconds"])
    return record


def _record(run: Calibration, alpha: float, pooled_weights: bool, blocks: list, started: float):
    settings = asdict(run.settings)
    settings.update(device=str(run.device), precision=run.precision)  # what ran
    models = run.models
    found = [entry for block in blocks for entry in block["fallbacks"]]
    if found:
        log.warning(
            "%d RegMean solves needed a ridge (singular Gram); see %s", len(found), REGMEAN_RECORD
        )
    return {
        "regmean_record_version": RECORD_VERSION,
        "method": "regmean",
        "architecture": models.arch.name,
        "hyperparameters": {
            "alpha": alpha,
            "gram": "per-token mean of x xᵀ over each task's real tokens (expert t on task t)",
            "bias": "mean of the experts' biases",
            "pooled_weights": pooled_weights,
            "ridge_if_singular": RIDGE,
            **settings,
        },
        "inputs": {
            "base": models.base.describe(),
            "merged": models.merged.describe(),
            "experts": {task: ckpt.describe() for task, ckpt in models.experts.items()},
            "calibration": {task: s.describe() for task, s in run.sets.items()},
        },
        "blocks": blocks,
        "fallbacks": len(found),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
    }
