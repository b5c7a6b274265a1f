"""Calibrate one block (docs/featcal.md, "Data flow", steps 1–4).

One pass of the *uncalibrated* merged block on each task's student stream and of expert t's block on
its expert stream gives every statistic (`BlockRunner.task_statistics`, with the pieces of
block_statistics.py; one task's result is a `TaskStatistics`); all Linear and norm parameters are
then solved in closed form (block_solve.py), loaded into the merged block, and the calibrated block
produces the next student stream (`BlockRunner.calibrate`, with the drift of drift.py). Hidden
states are (B, S, d) batches with token masks (B, S). Only one block of the base, the merged model
and one expert is in memory at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from featcal_core import precision as precisions
from featcal_core.errors import FeatCalError
from featcal_core.memory import compact_allocator
from featcal_core.method.block_solve import fold, fold_and_solve, solve
from featcal_core.method.block_statistics import (
    Capture,
    accumulate,
    linear_groups,
    new_norm_stats,
    run_block,
    tokens_needed,
)
from featcal_core.method.drift import DriftSums, FiniteChecks, drift_token_mask, mean_drift
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.model_set import ModelSet
from featcal_core.method.norm_statistics import NormStats
from featcal_core.method.solvers import Fallbacks
from featcal_core.method.statistics import LinearInputStats
from featcal_core.method.streams import (
    EXPERT,
    EXPERT_CONTEXT,
    EXPERT_DECODER,
    STUDENT,
    STUDENT_CONTEXT,
    STUDENT_DECODER,
    HiddenStreams,
    decoder_mask_key,
    weight_mask_key,
)
from featcal_core.method.task_statistics import StoredStatistics, TaskStatistics
from featcal_core.method.token_selection import TokenPlan
from featcal_core.method.transfers import HostRows, to_device


@dataclass
class BlockResult:
    index: int
    tensors: dict[str, torch.Tensor]  # local name → calibrated tensor, merged storage dtype
    # task → mean ‖student − expert‖² per real token (the pooled token only in a pooled last block)
    drift_before: dict[str, float] = field(default_factory=dict)
    drift_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # seconds per phase in this process: "read" (weights from disk into the block modules),
    # "forward" (block passes), "statistics" (accumulating and closing the tasks' sums, folding
    # them), "solve" (the closed forms); task statistics computed in other processes not counted
    phases: dict[str, float] = field(default_factory=dict)
    # solver fallbacks, clamped values and tasks without tokens (see solvers.Fallbacks), in a
    # fixed order: per task (task order), then per Linear group and norm, then per task again
    fallbacks: list[dict] = field(default_factory=list)


class BlockRunner:
    """Reusable block modules (merged and expert) with capture hooks, for one architecture."""

    def __init__(
        self,
        models: ModelSet,
        dtype: torch.dtype,
        device: torch.device,
        precision: str = "float64",
        products: str | None = None,
    ):
        self.models = models
        self.precision = precision  # of the block passes (precision.py)
        self.products = products or precision  # of the statistics' token products
        self.phases: dict[str, float] = {}  # seconds per phase since the last block's result
        self.arch = models.arch
        self.dtype = dtype
        self.device = device
        self._kinds: dict[str | None, tuple] = {}
        self._kind: object = object()  # none selected yet
        self._reused: dict = {}  # per-task accumulators shared by one block's tasks
        self._use(0)

    def _use(self, index: int) -> None:
        """Select the block modules of block `index`'s kind (encoder or decoder for T5)."""
        kind = self.arch.block_kind(index)
        if kind == self._kind:
            return
        if kind not in self._kinds:
            build = (
                (lambda: self.arch.build_block(self.dtype))
                if kind is None
                else (
                    lambda: self.arch.build_block(  # type: ignore[call-arg]  # its arch takes a kind
                        self.dtype, kind
                    )
                )
            )
            merged = build().to(self.device).requires_grad_(False)
            expert = build().to(self.device).requires_grad_(False)
            norm_types = self.arch.norm_types + self.arch.rms_norm_types
            linears = [n for n, m in merged.named_modules() if isinstance(m, nn.Linear)]
            norms = [n for n, m in merged.named_modules() if isinstance(m, norm_types)]
            self._kinds[kind] = (
                merged,
                expert,
                linears,
                norms,
                list(merged.state_dict()),
                Capture(self.arch, merged, linears + norms),
                Capture(self.arch, expert, linears + norms),
            )
        (
            self.merged_block,
            self.expert_block,
            self.linears,
            self.norms,
            self.local_names,
            self.merged_capture,
            self.expert_capture,
        ) = self._kinds[kind]
        self._kind = kind
        self._merged_index: int | None = None

    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        state = {name: tensors[name].to(self.device, self.dtype) for name in self.local_names}
        module.load_state_dict(state, strict=True)

    def statistics_bytes(self, index: int) -> int:
        """An upper bound of one task's statistics of block `index` in bytes: per Linear a Gram
        (d_in²) and a cross term (d_in · d_out), means and target sums, as if no two Linears
        shared an input; per norm four (d,) vectors; all float64."""
        self._use(index)
        total = 0
        for name in self.linears:
            module = self.merged_block.get_submodule(name)
            d_in, d_out = module.in_features, module.out_features
            total += d_in * d_in + d_in * d_out + 2 * d_in + d_out
        for name in self.norms:
            total += 4 * self.merged_block.get_submodule(name).weight.shape[0]
        return 8 * total

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the seconds of the enclosed work to `self.phases[phase]`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - start

    def read_block(self, checkpoint, index: int) -> dict[str, torch.Tensor]:
        keys = {name: self.arch.checkpoint_key(index, name) for name in self.local_names}
        tensors = self.models.read(checkpoint, list(keys.values()))
        return {name: tensors[key] for name, key in keys.items()}

    def passes(self):
        """The context every block pass runs in: bfloat16 autocast for precision bfloat16."""
        return precisions.autocast(self.precision, self.device)

    def forward(self, module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, context=None):
        """The block's output (B, S, d) in the passes' dtype, computed in `self.precision`."""
        with torch.no_grad(), self.passes():
            return run_block(self.arch, module, hidden, mask, context).to(self.dtype)

    # ----- the streams a block reads (one stack; or T5's encoder, bridge, decoder) --------------
    def _phase(self, index: int) -> str:
        """ "single" (no decoder), "encoder", "bridge" (first decoder block) or "decoder"."""
        start = self.arch.decoder_start
        if start is None:
            return "single"
        return "encoder" if index < start else "bridge" if index == start else "decoder"

    def _input_kinds(self, phase: str) -> tuple[str, str]:
        return (STUDENT_DECODER, EXPERT_DECODER) if phase == "bridge" else (STUDENT, EXPERT)

    def _mask(self, masks: dict[str, torch.Tensor], task: str, phase: str) -> torch.Tensor:
        return masks[decoder_mask_key(task)] if phase in ("bridge", "decoder") else masks[task]

    def _weight_mask(self, masks: dict[str, torch.Tensor], task: str, phase: str) -> torch.Tensor:
        """The tokens that carry weight (statistics, drift): the token mask unless the task has
        a separate weight mask (causal LMs with answer-token weighting)."""
        if phase == "single" and weight_mask_key(task) in masks:
            return masks[weight_mask_key(task)]
        return self._mask(masks, task, phase)

    def _contexts(self, phase, kind, task, streams, batch_size, masks):
        """Batches of (context (B, Sc, d), encoder mask (B, Sc)) read from `streams` for decoder
        blocks; Nones for encoder or single-stack blocks."""
        encoder_mask = masks[task].split(batch_size)
        if phase in ("single", "encoder"):
            yield from (None for _ in encoder_mask)
            return
        context_kind = {STUDENT: STUDENT_CONTEXT, EXPERT: EXPERT_CONTEXT}[kind]
        for hidden, mask in zip(
            streams.batches(context_kind, task, batch_size), encoder_mask, strict=True
        ):
            yield to_device(hidden, self.device), to_device(mask, self.device)

    def _write_contexts(self, task, source, target, batch_size, rows: int) -> None:
        """At the first decoder block: each model's context for `task` (its encoder output in
        `source` through its bridge tensors, e.g. the final norm) → `target`, for every decoder
        block from here on; `rows`: the task's number of rows."""
        for kind, context_kind, checkpoint in (
            (STUDENT, STUDENT_CONTEXT, self.models.merged),
            (EXPERT, EXPERT_CONTEXT, self.models.experts[task]),
        ):
            names = list(self.arch.bridge_names)
            tensors = {
                k: v.to(self.device, self.dtype)
                for k, v in self.models.read(checkpoint, names).items()
            }
            done = HostRows(rows)
            with torch.no_grad():
                for hidden in source.batches(kind, task, batch_size):
                    done.add(self.arch.run_bridge(tensors, to_device(hidden, self.device)))
            target.put(context_kind, task, done.tensor())

    def _load_merged(self, index: int) -> dict[str, torch.Tensor]:
        """Load block `index` of the (uncalibrated) merged model; returns its tensors: views of
        the loaded module's own where they have the same dtype and device (no second copy)."""
        with self.timed("read"):
            merged_sd = self.read_block(self.models.merged, index)
            self.load(self.merged_block, merged_sd)
        self._merged_index = index
        loaded = self.merged_block.state_dict()
        for name, tensor in merged_sd.items():
            if loaded[name].dtype == tensor.dtype and loaded[name].device == tensor.device:
                merged_sd[name] = loaded[name]
        return merged_sd

    @torch.no_grad()
    def task_statistics(
        self,
        index: int,
        task: str,
        source: HiddenStreams,
        target: HiddenStreams,
        masks: dict[str, torch.Tensor],
        params: FeatCalParams,
        batch_size: int,
        *,
        reuse: bool = False,
    ) -> TaskStatistics:
        """One task's pass over block `index`: the uncalibrated merged block on the task's student
        stream and expert t's block on its expert stream (both read from `source`). Writes the
        expert's block output to `target` and returns the task's contribution to the block's
        statistics. Independent of the other tasks: it can run in another process.

        reuse: take the per-task buffers of the accumulators from the previous task of this
        block (the result's tensors are then views of them: fold or save it before the next
        call); `calibrate` does, and frees them before its solves."""
        last = index == self.arch.num_blocks - 1
        self._use(index)
        if self._merged_index != index:
            self._load_merged(index)
        phase = self._phase(index)
        student_kind, expert_kind = self._input_kinds(phase)
        with self.timed("read"):
            expert_sd = self.read_block(self.models.experts[task], index)
            self.load(self.expert_block, expert_sd)
        del expert_sd
        expert_params = {
            name: (mod.weight, mod.bias)
            for name in self.linears
            for mod in [self.expert_block.get_submodule(name)]
        }
        linear_stats: dict[str, LinearInputStats] | None = None
        groups: dict[str, str] = {}
        norm_stats: dict[str, NormStats] = {}
        if phase == "bridge":
            self._write_contexts(task, source, target, batch_size, masks[task].shape[0])
        contexts = target if phase == "bridge" else source
        weighted_mask = self._weight_mask(masks, task, phase)
        plan = TokenPlan(
            self.arch,
            last,
            weighted_mask,
            None if phase in ("single", "encoder") else masks[task],
            batch_size,
            self.device,
        )
        # nothing in this loop reads the device into Python: the checks, the drift and the
        # expert outputs' copies are queued, and read or awaited once after it
        checks, drift = FiniteChecks(), DriftSums()
        new_expert = HostRows(weighted_mask.shape[0])
        batches = zip(
            source.batches(student_kind, task, batch_size),
            source.batches(expert_kind, task, batch_size),
            self._mask(masks, task, phase).split(batch_size),
            weighted_mask.split(batch_size),
            self._contexts(phase, STUDENT, task, contexts, batch_size, masks),
            self._contexts(phase, EXPERT, task, contexts, batch_size, masks),
            strict=True,
        )
        for number, (student, expert_hidden, mask, weighted, context_s, context_e) in enumerate(
            batches
        ):
            student = to_device(student, self.device)
            expert_hidden = to_device(expert_hidden, self.device)
            mask, weighted = to_device(mask, self.device), to_device(weighted, self.device)
            with self.timed("forward"), self.passes():
                out_m, x_s = self.merged_capture.run(self.merged_block, student, mask, context_s)
                out_e, x_e = self.expert_capture.run(
                    self.expert_block, expert_hidden, mask, context_e
                )
            out_m, out_e = out_m.to(self.dtype), out_e.to(self.dtype)
            checks.add(out_e, f"expert {task!r} output of block {index}")
            checks.add(out_m, f"merged output of block {index} on task {task!r}")
            if linear_stats is None:
                tokens = min(int(m.sum()) for m in masks.values())  # a hint for the cost
                linear_stats, groups = linear_groups(
                    self.arch,
                    self.merged_block,
                    self.linears,
                    x_s,
                    last,
                    tokens,
                    self.device,
                    self.products,
                    self._reused if reuse else None,
                    params=params,
                )
                norm_stats = self._norm_stats()
            with self.timed("statistics"):
                accumulate(
                    self.linears,
                    x_s,
                    x_e,
                    plan,
                    number,
                    groups,
                    linear_stats,
                    norm_stats,
                    expert_params,
                )
            del x_s, x_e
            drift.add(out_m, out_e, self._drift_mask(weighted, last))
            new_expert.add(out_e)
        if linear_stats is None:
            raise FeatCalError(f"task {task!r} has no calibration inputs for block {index}")
        checks.raise_first()
        target.put(EXPERT, task, new_expert.tensor())
        del new_expert
        sq_sum, tok_sum = drift.totals()
        found = Fallbacks(f"block {index}")
        linear = {}
        norms = {}
        with self.timed("statistics"):
            for label, stats in linear_stats.items():
                members = {name: expert_params[name] for name in stats.targets}
                with tokens_needed(index, task, label):
                    linear[label] = stats.task_contribution(members, fallbacks=found, task=task)
            for name, norm in norm_stats.items():
                module = self.expert_block.get_submodule(name)
                assert isinstance(module.weight, torch.Tensor)  # a norm's own γ
                with tokens_needed(index, task, name):
                    norms[name] = norm.task_contribution(
                        module.weight, getattr(module, "bias", None)
                    )
        layout = {
            label: {"d_in": stats.d_in, "tokens": tokens, "modules": stats.modules}
            for label, stats in linear_stats.items()
        }
        before = mean_drift(sq_sum, tok_sum, task, "before calibration", found)
        return TaskStatistics(task, index, linear, layout, norms, before, found.entries)

    @torch.no_grad()
    def calibrate(
        self,
        index: int,
        source: HiddenStreams,
        target: HiddenStreams,
        masks: dict[str, torch.Tensor],
        params: FeatCalParams,
        batch_size: int,
        precomputed: Callable[[str], TaskStatistics | Path] | None = None,
        scratch_dir: Path | None = None,
    ) -> BlockResult:
        """Calibrate block `index`: reads both streams of every task from `source` (block inputs)
        and writes the block outputs to `target` (may be the same object).

        precomputed: task → its `TaskStatistics` (or the file it was saved to), computed elsewhere
        (whose expert outputs are already in `target`); None computes them here, one task after
        another. scratch_dir: where the statistics computed here are saved, one task at a time,
        and then folded group by group, each group solved before the next is read (peak memory:
        one task's statistics while it runs, then two copies of the largest group; each task's
        buffers are freed before the next, and `compact_allocator` is turned on); None folds
        them in memory as they come (one task's buffers serve every task of the block). Every
        way folds the contributions in task order, so all give the same block, bit for bit."""
        start = time.perf_counter()
        if scratch_dir is not None:  # the memory-bounded mode: no buffers kept between tasks
            compact_allocator()
        last = index == self.arch.num_blocks - 1
        self._use(index)
        phase = self._phase(index)
        student_kind, _ = self._input_kinds(phase)
        merged_sd = self._load_merged(index)
        result = BlockResult(index, {})
        found = Fallbacks(f"block {index}")
        linear_sums: dict[str, LinearInputStats] = {}
        norm_sums = self._norm_stats()
        stored: list[StoredStatistics] = []
        for number, task in enumerate(self.models.experts):
            stats: TaskStatistics | StoredStatistics | Path
            if precomputed is None:
                stats = self.task_statistics(
                    index,
                    task,
                    source,
                    target,
                    masks,
                    params,
                    batch_size,
                    reuse=scratch_dir is None,
                )
            else:
                stats = precomputed(task)
                if isinstance(stats, Path):
                    stats = StoredStatistics(stats)
            if stats.task != task or stats.index != index:
                raise FeatCalError(
                    f"statistics of task {stats.task!r}, block {stats.index} were given for "
                    f"task {task!r}, block {index}; recompute the block"
                )
            result.drift_before[task] = stats.drift_before
            found.entries.extend(stats.fallbacks)  # logged where they were found
            if isinstance(stats, TaskStatistics) and scratch_dir is not None:
                path = Path(scratch_dir) / f"statistics-{index:05d}-{number:05d}.safetensors"
                stats.save(path)
                del stats
                stats = StoredStatistics(path)
            if isinstance(stats, StoredStatistics):
                stored.append(stats)
            else:
                with self.timed("statistics"):
                    fold(
                        linear_sums,
                        norm_sums,
                        stats.layout,
                        stats.linear.get,
                        stats.norms.get,
                        self.device,
                        params,
                    )
            del stats
        self._reused.clear()  # the per-task buffers: not held through the solves

        with self.timed("read"):
            base_sd = self.read_block(self.models.base, index)
        if stored:
            with self.timed("solve"):  # folding stored statistics included
                solved = fold_and_solve(
                    stored, self._norm_stats(), merged_sd, base_sd, params, self.device, found
                )
            for done in stored:
                if scratch_dir is not None and done.path.parent == Path(scratch_dir):
                    done.path.unlink(missing_ok=True)
        else:
            with self.timed("solve"):
                solved = solve(
                    linear_sums, norm_sums, merged_sd, base_sd, params, self.device, found
                )
        del linear_sums, norm_sums, stored
        del base_sd
        result.tensors = {name: solved[name].to(merged_sd[name].dtype) for name in solved}
        merged_sd.update(result.tensors)
        self.load(self.merged_block, merged_sd)
        self._merged_index = None  # the merged block now holds calibrated weights

        contexts = target if phase == "bridge" else source  # the bridge wrote them to target
        for task in self.models.experts:
            weighted_mask = self._weight_mask(masks, task, phase)
            checks, drift = FiniteChecks(), DriftSums()
            outputs = HostRows(weighted_mask.shape[0])
            batches = zip(
                source.batches(student_kind, task, batch_size),
                target.batches(EXPERT, task, batch_size),
                self._mask(masks, task, phase).split(batch_size),
                weighted_mask.split(batch_size),
                self._contexts(phase, STUDENT, task, contexts, batch_size, masks),
                strict=True,
            )
            for student, expert_out, mask, weighted, context in batches:
                with self.timed("forward"):
                    out = self.forward(
                        self.merged_block,
                        to_device(student, self.device),
                        to_device(mask, self.device),
                        context,
                    )
                checks.add(out, f"calibrated output of block {index} on task {task!r}")
                drift_mask = self._drift_mask(to_device(weighted, self.device), last)
                drift.add(out, to_device(expert_out, self.device), drift_mask)
                outputs.add(out)
            checks.raise_first()
            sq_sum, tok_sum = drift.totals()
            result.drift_after[task] = mean_drift(sq_sum, tok_sum, task, "after calibration", found)
            target.put(STUDENT, task, outputs.tensor())
        result.fallbacks = found.entries
        result.seconds = time.perf_counter() - start
        result.phases, self.phases = self.phases, {}
        return result

    # ----- helpers ----------------------------------------------------------------------------
    def _norm_stats(self) -> dict[str, NormStats]:
        return new_norm_stats(self.merged_block, self.norms, self.arch.rms_norm_types, self.device)

    def _drift_mask(self, mask: torch.Tensor, last: bool) -> torch.Tensor:
        return drift_token_mask(mask, last, self.arch.pooled_position)
