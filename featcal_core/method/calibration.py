"""`calibrate`: the whole FeatCal run as one call (validate → stems → blocks → export → record)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from featcal_core import precision
from featcal_core.architectures.base import WEIGHT_MASK
from featcal_core.data.calibration_data import CalibrationSet, load_calibration_set
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.digests import hash_in_background
from featcal_core.io.export import export_checkpoint
from featcal_core.io.outputs import (
    check_output,
    check_target,
    guarded_directory,
    scratch_directory,
)
from featcal_core.io.safetensors_io import save_tensors
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.log_detail import DETAIL
from featcal_core.memory import peak_rss_bytes
from featcal_core.method.block import BlockResult, BlockRunner
from featcal_core.method.drift import FiniteChecks
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.model_set import ModelSet
from featcal_core.method.settings import Settings
from featcal_core.method.streams import (
    EXPERT,
    EXPERT_DECODER,
    STUDENT,
    STUDENT_DECODER,
    HiddenStreams,
    decoder_mask_key,
    weight_mask_key,
)
from featcal_core.method.task_statistics import TaskStatistics
from featcal_core.method.transfers import HostRows, to_device
from featcal_core.names import check_names
from featcal_core.progress import stage_progress
from featcal_core.provenance.records import FEATCAL_RECORD

log = logging.getLogger(__name__)

RECORD_NAME = FEATCAL_RECORD
RECORD_VERSION = 1
#: the stages of `calibrate` whose seconds the record keeps ("stage_seconds"): setup (checks,
#: opening the checkpoints, digests, loading the calibration sets), stems, blocks, export
STAGES = ("setup", "stems", "blocks", "export")
#: the default of each setting (calibrate's keyword defaults)
_DEFAULT = Settings()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise FeatCalError("--device cuda: no CUDA device is available; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise FeatCalError(f"--device {device!r} is not one of cpu, cuda, auto")
    return torch.device(device)


def calibration_inputs(base, merged, experts: dict, calib: dict) -> tuple:
    """Every folder a calibration reads (no output may be, hold or lie inside one of them)."""
    return (base, merged, *experts.values(), *calib.values())


def check_tasks(experts: Mapping[str, object], calib: Mapping[str, object]) -> None:
    """Every calibration task needs an expert and every expert a calibration set; task names
    are safe names (featcal_core.names)."""
    check_names([*experts, *calib], "task name")
    for task in calib:
        if task not in experts:
            raise FeatCalError(f"--calib {task}=...: task {task!r} has no --expert {task}=DIR")
    for task in experts:
        if task not in calib:
            raise FeatCalError(f"--expert {task}=...: task {task!r} has no --calib {task}=DIR")
    if not experts:
        raise FeatCalError("no tasks: pass at least one --expert TASK=DIR and --calib TASK=DIR")


class Calibration:
    """A validated FeatCal calibration, run in stages.

    `stems` fills the block-0 inputs of every task, `block(i)` calibrates block i (forward order)
    reading the block's input streams and writing its output streams, `export` writes the
    calibrated checkpoint. Validation (files, architectures, shapes, tasks, calibration sets) all
    happens in the constructor, before any heavy work.
    """

    def __init__(
        self,
        base: str | Path,
        merged: str | Path,
        experts: dict[str, str | Path],
        calib: dict[str, str | Path],
        params: FeatCalParams = FeatCalParams(),
        settings: Settings = Settings(),
    ):
        check_tasks(experts, calib)
        if settings.batch_size < 1:
            raise FeatCalError(f"--batch-size must be at least 1 (got {settings.batch_size})")
        if settings.precision not in precision.CHOICES:
            raise FeatCalError(
                f"--precision must be one of {', '.join(precision.CHOICES)} "
                f"(got {settings.precision!r})"
            )
        self.params = params
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.models = ModelSet.open(base, merged, experts, settings.pooling)
        self.arch = self.models.arch
        self.arch.set_token_weighting(settings.token_weighting)
        self.sets = {
            task: load_calibration_set(
                task, path, self.arch.modality, settings.num_per_task, settings.seed
            )
            for task, path in calib.items()
        }
        if settings.token_weighting == "answer":
            for task, s in self.sets.items():
                if s.targets is None:
                    raise FeatCalError(
                        f"calibration set {s.path} of task {task!r} has no 'target' column; "
                        "--token-weighting answer weighs the answer tokens, so add the answers "
                        "as a 'target' column or use --token-weighting all"
                    )
        #: the checkpoints' dtype (the calibrated weights are written in it)
        self.checkpoint_dtype = self.models.compute_dtype()
        # what runs the block passes and the token products (auto: by device and checkpoints)
        self.chosen = precision.resolve(settings.precision, self.device, self.checkpoint_dtype)
        #: the dtype of the stems, block passes and streams (precision.pass_dtype)
        self.dtype = precision.pass_dtype(self.chosen, self.checkpoint_dtype)
        self.precision = self.chosen.name
        self.products = precision.products_for(self.chosen, params.lam)  # the token products'
        if self.products != self.precision:
            log.info(
                "λ = %g < %g: the token products run in %s, the passes in %s (an "
                "unregularised solve amplifies bfloat16 rounding)",
                params.lam,
                precision.BF16_MIN_LAM,
                self.products,
                self.precision,
            )
        precision.allow_tf32(self.chosen, self.device)
        self._runner: BlockRunner | None = None

    @property
    def num_blocks(self) -> int:
        return self.arch.num_blocks

    def stems(self, target: HiddenStreams) -> dict[str, torch.Tensor]:
        """Write both streams of every task (each model's own stem); returns task → mask (n, S)."""
        return _run_stems(
            self.models,
            self.sets,
            target,
            self.dtype,
            self.device,
            self.settings.batch_size,
            self.settings.max_length,
        )

    def _block_runner(self) -> BlockRunner:
        if self._runner is None:
            self._runner = BlockRunner(
                self.models, self.dtype, self.device, self.precision, self.products
            )
        return self._runner

    def task_statistics(
        self,
        index: int,
        task: str,
        source: HiddenStreams,
        target: HiddenStreams,
        masks: dict[str, torch.Tensor],
    ) -> TaskStatistics:
        """One task's statistics of block `index` (see BlockRunner.task_statistics)."""
        if task not in self.models.experts:
            raise FeatCalError(f"task {task!r} is not one of {sorted(self.models.experts)}")
        return self._block_runner().task_statistics(
            index, task, source, target, masks, self.params, self.settings.batch_size
        )

    def block(
        self,
        index: int,
        source: HiddenStreams,
        target: HiddenStreams,
        masks: dict[str, torch.Tensor],
        precomputed: Callable[[str], TaskStatistics | Path] | None = None,
        scratch_dir: Path | None = None,
    ) -> BlockResult:
        """Calibrate block `index` (see BlockRunner.calibrate)."""
        return self._block_runner().calibrate(
            index,
            source,
            target,
            masks,
            self.params,
            self.settings.batch_size,
            precomputed,
            scratch_dir,
        )

    def statistics_bytes(self, index: int) -> int:
        """An upper bound of one task's statistics of block `index` in bytes (float64)."""
        return self._block_runner().statistics_bytes(index)

    def checkpoint_keys(self, result: BlockResult) -> dict[str, torch.Tensor]:
        """The block's calibrated tensors under the merged checkpoint's own key names."""
        prefix = self.models.prefix(self.models.merged)
        return {
            prefix + self.arch.checkpoint_key(result.index, name): tensor.contiguous()
            for name, tensor in result.tensors.items()
        }

    def export(
        self, replaced: dict[str, Path], out_dir: Path, max_shard_size: int | str | None = None
    ) -> None:
        """Write the calibrated checkpoint: the merged model's tensors, `replaced` keys read from
        their files, in files of at most `max_shard_size` (featcal_core.io.shards; None: its
        default), with the merged model's (else the base's) tokenizer and config files."""
        export_checkpoint(
            self.models.merged,
            replaced,
            out_dir,
            extra_sources=(self.models.base.directory,),
            max_shard_size=max_shard_size,
        )

    def hash_inputs_in_background(self) -> Callable[[], None]:
        """On CUDA, hash the checkpoints' weight files (the record's digests) in a thread while
        the GPU runs the blocks; returns the call that waits for it. On the CPU the hashing
        would take cores from the blocks, so the record hashes them at the end."""
        if self.device.type != "cuda":
            return lambda: None
        return hash_in_background([p for ckpt in self.models.all() for p in ckpt.weight_paths()])

    def record(
        self, blocks: list[dict], started: float, stages: dict[str, float] | None = None
    ) -> dict:
        """featcal.json's content; `stages`: seconds per stage of the run (`STAGES`), recorded
        as "stage_seconds" where given."""
        settings = asdict(self.settings)
        settings["device"] = str(self.device)
        settings.update(self.chosen.record())  # what ran, asked for, why, native or emulated
        settings["products_precision"] = self.products
        settings["pooled_position"] = self.arch.pooled_position
        record = _record(self.models, self.sets, self.params, blocks, settings, started)
        if stages is not None:
            record["stage_seconds"] = {k: round(stages.get(k, 0.0), 3) for k in STAGES}
        found = [entry for block in blocks for entry in block.get("fallbacks", [])]
        kinds: dict[str, int] = {}
        for entry in found:
            kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
        record["fallbacks"] = len(found)
        record["fallbacks_by_kind"] = dict(sorted(kinds.items()))
        if found:
            log.warning(
                '%d solver fallbacks or clamped values (%s); see the blocks\' "fallbacks" in %s',
                len(found),
                ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())),
                RECORD_NAME,
            )
        return record


def block_summary(result: BlockResult, restored: bool = False) -> dict:
    """The per-block entry of the record (JSON-able; persisted in state manifests). "fallbacks":
    the block's solver fallbacks and clamped values (see solvers.Fallbacks), in a fixed order."""
    return {
        "index": result.index,
        "seconds": round(result.seconds, 4),
        "phases": {phase: round(seconds, 4) for phase, seconds in sorted(result.phases.items())},
        "restored": restored,
        "drift_before": result.drift_before,
        "drift_after": result.drift_after,
        "fallbacks": [dict(entry) for entry in result.fallbacks],
    }


def log_block(result: BlockResult, num_blocks: int, restored: bool = False) -> None:
    before = sum(result.drift_before.values()) / len(result.drift_before)
    after = sum(result.drift_after.values()) / len(result.drift_after)
    how = "restored" if restored else f"{result.seconds:.1f} s"
    if result.fallbacks:
        how += f", {len(result.fallbacks)} fallbacks"
    log.info(  # numbered from 0, as in the record, the report and MLflow
        "block %d (%d of %d): mean drift %.6g -> %.6g (%s)",
        result.index,
        result.index + 1,
        num_blocks,
        before,
        after,
        how,
        extra=DETAIL,
    )


def calibrate(
    base: str | Path,
    merged: str | Path,
    experts: dict[str, str | Path],
    calib: dict[str, str | Path],
    out: str | Path,
    params: FeatCalParams = FeatCalParams(),
    *,
    num_per_task: int = _DEFAULT.num_per_task,
    batch_size: int = _DEFAULT.batch_size,
    seed: int = _DEFAULT.seed,
    device: str = _DEFAULT.device,
    max_length: int = _DEFAULT.max_length,
    pooling: str | None = _DEFAULT.pooling,
    token_weighting: str = _DEFAULT.token_weighting,
    precision: str = _DEFAULT.precision,
    spill_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_size: int | str | None = None,
) -> dict:
    """Calibrate `merged` against `experts` on the calibration sets; write a save_pretrained
    directory at `out` (plus featcal.json), in weight files of at most `max_shard_size` (bytes,
    or "5GB"-style; None: transformers' default, featcal_core.io.shards), and return the record.
    Raises FeatCalError on bad input, leaving `out` as it was."""
    started = time.perf_counter()
    out = Path(out)
    parse_shard_size(max_shard_size)
    check_names([*experts, *calib], "task name")
    inputs = calibration_inputs(base, merged, experts, calib)
    check_output(out, overwrite=overwrite, inputs=inputs)
    if spill_dir is not None:
        check_target(spill_dir, inputs=(*inputs, out), flag="--spill-dir", may_hold_inputs=True)
    settings = Settings(
        num_per_task, batch_size, seed, device, max_length, pooling, token_weighting, precision
    )
    run = Calibration(base, merged, experts, calib, params, settings)
    digests_done = run.hash_inputs_in_background()
    log.info(
        "%s, %d blocks, %d tasks, checkpoints in %s, passes in %s",
        run.arch.name,
        run.num_blocks,
        len(run.sets),
        run.checkpoint_dtype,
        run.dtype,
    )
    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp, ExitStack() as stack:
        if spill_dir is not None:  # a marked temporary folder there, swept if a killed run left one
            work = stack.enter_context(
                scratch_directory(
                    spill_dir, "featcal-spill", inputs=(*inputs, out), flag="--spill-dir"
                )
            )
        else:
            work = tmp / "_work"
            work.mkdir()
        try:
            streams = HiddenStreams(work / "streams" if spill_dir else None)
            stages = {"setup": time.perf_counter() - started}
            mark = time.perf_counter()
            masks = run.stems(streams)
            stages["stems"] = time.perf_counter() - mark
            mark = time.perf_counter()
            blocks, replaced = [], {}
            bar = stage_progress(
                range(run.num_blocks), desc="FeatCal blocks", unit="block", enabled=progress
            )
            for index in bar:
                result = run.block(
                    index, streams, streams, masks, scratch_dir=work if spill_dir else None
                )
                path = work / f"block_{index:05d}.safetensors"
                tensors = run.checkpoint_keys(result)
                save_tensors(path, tensors)
                replaced.update(dict.fromkeys(tensors, path))
                log_block(result, run.num_blocks)
                blocks.append(block_summary(result))
                del result, tensors  # on disk now: not held while the next block runs
            stages["blocks"] = time.perf_counter() - mark
            mark = time.perf_counter()
            run.export(replaced, tmp, max_shard_size)
            stages["export"] = time.perf_counter() - mark
        finally:
            shutil.rmtree(work, ignore_errors=True)
        digests_done()
        record = run.record(blocks, started, stages)
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s in %.1f s", out, record["wall_seconds"])
    return record


def _run_stems(models, sets, streams, dtype, device, batch_size, max_length):
    """Fill both streams of every task from each model's own stem; returns task → token mask."""
    arch = models.arch
    stem = arch.build_stem(dtype).to(device).requires_grad_(False)
    stem_names = list(stem.state_dict().keys())
    masks: dict[str, torch.Tensor] = {}

    def run(
        checkpoint: Checkpoint, inputs: dict[str, torch.Tensor], what: str, decoder: bool = False
    ) -> torch.Tensor:
        state = models.read(checkpoint, stem_names)
        stem.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
        count = inputs["attention_mask"].shape[0]
        outputs, checks = HostRows(count), FiniteChecks()
        with torch.no_grad():
            for start in range(0, count, batch_size):
                batch = {
                    k: to_device(v[start : start + batch_size], device) for k, v in inputs.items()
                }
                hidden = (arch.run_decoder_stem if decoder else arch.run_stem)(stem, batch)
                checks.add(hidden, f"{what} stem output")
                outputs.add(hidden)
        checks.raise_first()
        return outputs.tensor()

    decoder = arch.decoder_start is not None
    for task, calibration in sets.items():
        inputs = arch.prepare_inputs(
            str(models.base.directory), calibration.rows, max_length, calibration.targets
        )
        masks[task] = inputs["attention_mask"].to(torch.float32)
        if WEIGHT_MASK in inputs:
            masks[weight_mask_key(task)] = inputs.pop(WEIGHT_MASK).to(torch.float32)
        streams.put(STUDENT, task, run(models.merged, inputs, f"merged model's ({task})"))
        streams.put(EXPERT, task, run(models.experts[task], inputs, f"expert {task!r}"))
        if decoder:  # the decoder's own stem outputs, used from the first decoder block on
            dec = {
                "input_ids": inputs["decoder_input_ids"],
                "attention_mask": inputs["decoder_attention_mask"],
            }
            masks[decoder_mask_key(task)] = dec["attention_mask"].to(torch.float32)
            streams.put(
                STUDENT_DECODER,
                task,
                run(models.merged, dec, f"merged model's decoder ({task})", True),
            )
            streams.put(
                EXPERT_DECODER,
                task,
                run(models.experts[task], dec, f"expert {task!r} decoder", True),
            )
    return masks


def _record(models: ModelSet, sets: dict[str, CalibrationSet], params, blocks, settings, started):
    peak_rss = peak_rss_bytes()
    peak_device = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {
        "featcal_record_version": RECORD_VERSION,
        "architecture": models.arch.name,
        "hyperparameters": {
            "alpha": params.alpha,
            "rho": params.rho,
            "lam": params.lam,
            "eps": params.eps,
            **settings,
        },
        "inputs": {
            "base": models.base.describe(),
            "merged": models.merged.describe(),
            "experts": {task: ckpt.describe() for task, ckpt in models.experts.items()},
            "calibration": {task: s.describe() for task, s in sets.items()},
        },
        "blocks": blocks,
        "wall_seconds": round(time.perf_counter() - started, 3),
        "peak_rss_bytes": peak_rss,
        "peak_device_bytes": peak_device,
    }
