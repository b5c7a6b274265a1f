"""Calibrate one block (method page, "Data flow", steps 1–4).

One pass of the *uncalibrated* merged block on each task's student stream and of expert t's block on
its expert stream gives every statistic; all Linear and norm parameters are then solved in closed
form, loaded into the merged block, and the calibrated block produces the next student stream.
Only one block of the base, the merged model and one expert is in memory at a time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import atomic_file
from featcal_core.io.safetensors_io import Reader, read_header, save_tensors
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.model_set import ModelSet
from featcal_core.method.solvers import Fallbacks, anchor
from featcal_core.method.statistics import LinearInputStats, NormStats, Scratch
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

log = logging.getLogger(__name__)


@dataclass
class BlockResult:
    index: int
    tensors: dict[str, torch.Tensor]  # local name → calibrated tensor, merged storage dtype
    # task → mean ‖student − expert‖² per real token (the pooled token only in a pooled last block)
    drift_before: dict[str, float] = field(default_factory=dict)
    drift_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # solver fallbacks, clamped values and tasks without tokens (see solvers.Fallbacks), in a
    # fixed order: per task (task order), then per Linear group and norm, then per task again
    fallbacks: list[dict] = field(default_factory=list)


@dataclass
class TaskStatistics:
    """Task t's contribution to block i's statistics (float64 tensors, see statistics.py), as
    `BlockRunner.task_statistics` computes it; `save`/`load` carry it between processes."""

    task: str
    index: int
    linear: dict[str, dict[str, torch.Tensor]]  # group label → `LinearInputStats` contribution
    layout: dict[str, dict]  # group label → {"d_in", "tokens", "modules": {name: (d_out, bias)}}
    norms: dict[str, dict[str, torch.Tensor]]  # norm module → `NormStats` contribution
    drift_before: float  # mean ‖merged − expert‖² of the block output (see BlockResult)
    fallbacks: list[dict] = field(default_factory=list)  # found in this task's pass (JSON-able)

    _META = "featcal_task_statistics"

    def save(self, path: Path) -> None:
        """One safetensors file, written to a temporary name and renamed."""
        tensors = {f"linear/{g}/{k}": v.contiguous() for g, c in self.linear.items()
                   for k, v in c.items()}  # fmt: skip
        tensors.update({f"norm/{n}/{k}": v.contiguous() for n, c in self.norms.items()
                        for k, v in c.items()})  # fmt: skip
        meta = {"task": self.task, "index": self.index, "layout": self.layout,
                "drift_before": self.drift_before, "fallbacks": self.fallbacks}  # fmt: skip
        with atomic_file(path, "task statistics") as tmp:
            save_tensors(tmp, tensors, {self._META: json.dumps(meta)})

    @classmethod
    def load(cls, path: Path) -> TaskStatistics:
        """Every tensor of a saved file (see `StoredStatistics` to read groups on demand)."""
        stored = StoredStatistics(path)
        linear: dict[str, dict[str, torch.Tensor]] = {}
        norms: dict[str, dict[str, torch.Tensor]] = {}
        with Reader(path, stored.entries) as reader:
            for key in stored.entries:
                kind, owner, name = key.split("/", 2)
                (linear if kind == "linear" else norms).setdefault(owner, {})[name] = reader[key]
        return cls(stored.task, stored.index, linear, stored.layout, norms, stored.drift_before,
                   stored.fallbacks)  # fmt: skip


class StoredStatistics:
    """A saved `TaskStatistics` read lazily: its metadata at once, one group's tensors on demand
    (so folding a block's tasks holds one group of one task at a time, not a whole task)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries, metadata = read_header(path)
        if TaskStatistics._META not in metadata:
            raise FeatCalError(f"{path} holds no FeatCal task statistics; recompute the block")
        meta = json.loads(metadata[TaskStatistics._META])
        self.task, self.index = meta["task"], meta["index"]
        self.drift_before = meta["drift_before"]
        self.fallbacks = meta.get("fallbacks", [])
        self.layout = {g: {**v, "modules": {m: tuple(d) for m, d in v["modules"].items()}}
                       for g, v in meta["layout"].items()}  # fmt: skip

    def group(self, kind: str, owner: str) -> Mapping[str, torch.Tensor]:
        """The contribution of one Linear group (kind "linear") or norm (kind "norm"), each
        tensor read from the file when it is looked up (folding holds one at a time)."""
        return _LazyGroup(self, f"{kind}/{owner}/")


class _LazyGroup(Mapping):
    """key → tensor of one group of a `StoredStatistics` file, read on each lookup."""

    def __init__(self, stored: StoredStatistics, prefix: str):
        self._stored, self._prefix = stored, prefix
        self._keys = [k[len(prefix) :] for k in stored.entries if k.startswith(prefix)]

    def __getitem__(self, key: str) -> torch.Tensor:
        entries = self._stored.entries
        with Reader(self._stored.path, entries) as reader:
            return reader[self._prefix + key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _Capture:
    """Forward pre-hooks that record the input of the named submodules during `run`."""

    def __init__(self, arch, module: nn.Module, names: list[str]):
        self.arch = arch
        self.inputs: dict[str, torch.Tensor] = {}
        self._active = False
        for name in names:
            module.get_submodule(name).register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(_module, args):
            if self._active:
                self.inputs[name] = args[0]

        return hook

    def run(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, context=None):
        """(block output, {module name: its input}) for one batch; the caller owns the dict."""
        self.inputs = {}
        self._active = True
        try:
            with torch.no_grad():
                out = _run(self.arch, block, hidden, mask, context)
        finally:
            self._active = False
        inputs, self.inputs = self.inputs, {}
        return out, inputs


class BlockRunner:
    """Reusable block modules (merged and expert) with capture hooks, for one architecture."""

    def __init__(self, models: ModelSet, dtype: torch.dtype, device: torch.device):
        self.models = models
        self.arch = models.arch
        self.dtype = dtype
        self.device = device
        self._kinds: dict[str | None, tuple] = {}
        self._kind: object = object()  # none selected yet
        self._use(0)

    def _use(self, index: int) -> None:
        """Select the block modules of block `index`'s kind (encoder or decoder for T5)."""
        kind = self.arch.block_kind(index)
        if kind == self._kind:
            return
        if kind not in self._kinds:
            build = (lambda: self.arch.build_block(self.dtype)) if kind is None else (
                lambda: self.arch.build_block(self.dtype, kind))  # fmt: skip
            merged = build().to(self.device).requires_grad_(False)
            expert = build().to(self.device).requires_grad_(False)
            norm_types = self.arch.norm_types + self.arch.rms_norm_types
            linears = [n for n, m in merged.named_modules() if isinstance(m, nn.Linear)]
            norms = [n for n, m in merged.named_modules() if isinstance(m, norm_types)]
            self._kinds[kind] = (merged, expert, linears, norms, list(merged.state_dict()),
                                 _Capture(self.arch, merged, linears + norms),
                                 _Capture(self.arch, expert, linears + norms))  # fmt: skip
        (self.merged_block, self.expert_block, self.linears, self.norms, self.local_names,
         self.merged_capture, self.expert_capture) = self._kinds[kind]  # fmt: skip
        self._kind = kind
        self._merged_index = None

    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        state = {name: tensors[name].to(self.device, self.dtype) for name in self.local_names}
        module.load_state_dict(state, strict=True)

    def read_block(self, checkpoint, index: int) -> dict[str, torch.Tensor]:
        keys = {name: self.arch.checkpoint_key(index, name) for name in self.local_names}
        tensors = self.models.read(checkpoint, list(keys.values()))
        return {name: tensors[key] for name, key in keys.items()}

    def forward(self, module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, context=None):
        with torch.no_grad():
            return _run(self.arch, module, hidden, mask, context)

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
        for hidden, mask in zip(streams.batches(context_kind, task, batch_size), encoder_mask,
                                strict=True):  # fmt: skip
            yield hidden.to(self.device), mask.to(self.device)

    def _write_contexts(self, task, source, target, batch_size) -> None:
        """At the first decoder block: each model's context for `task` (its encoder output in
        `source` through its bridge tensors, e.g. the final norm) → `target`, for every decoder
        block from here on."""
        for kind, context_kind, checkpoint in (
            (STUDENT, STUDENT_CONTEXT, self.models.merged),
            (EXPERT, EXPERT_CONTEXT, self.models.experts[task]),
        ):
            names = list(self.arch.bridge_names)
            tensors = {k: v.to(self.device, self.dtype)
                       for k, v in self.models.read(checkpoint, names).items()}  # fmt: skip
            with torch.no_grad():
                done = [self.arch.run_bridge(tensors, hidden.to(self.device)).to("cpu")
                        for hidden in source.batches(kind, task, batch_size)]  # fmt: skip
            target.put(context_kind, task, torch.cat(done))

    def _load_merged(self, index: int) -> dict[str, torch.Tensor]:
        """Load block `index` of the (uncalibrated) merged model; returns its tensors: views of
        the loaded module's own where they have the same dtype and device (no second copy)."""
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
    ) -> TaskStatistics:
        """One task's pass over block `index`: the uncalibrated merged block on the task's student
        stream and expert t's block on its expert stream (both read from `source`). Writes the
        expert's block output to `target` and returns the task's contribution to the block's
        statistics. Independent of the other tasks: it can run in another process."""
        last = index == self.arch.num_blocks - 1
        self._use(index)
        if self._merged_index != index:
            self._load_merged(index)
        phase = self._phase(index)
        student_kind, expert_kind = self._input_kinds(phase)
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
        new_expert, sq_sum, tok_sum = [], 0.0, 0.0
        if phase == "bridge":
            self._write_contexts(task, source, target, batch_size)
        contexts = target if phase == "bridge" else source
        batches = zip(
            source.batches(student_kind, task, batch_size),
            source.batches(expert_kind, task, batch_size),
            self._mask(masks, task, phase).split(batch_size),
            self._weight_mask(masks, task, phase).split(batch_size),
            self._contexts(phase, STUDENT, task, contexts, batch_size, masks),
            self._contexts(phase, EXPERT, task, contexts, batch_size, masks),
            strict=True,
        )
        for student, expert_hidden, mask, weighted, context_s, context_e in batches:
            student = student.to(self.device)
            expert_hidden = expert_hidden.to(self.device)
            mask, weighted = mask.to(self.device), weighted.to(self.device)
            out_m, x_s = self.merged_capture.run(self.merged_block, student, mask, context_s)
            out_e, x_e = self.expert_capture.run(self.expert_block, expert_hidden, mask, context_e)
            _check_finite(out_e, f"expert {task!r} output of block {index}")
            _check_finite(out_m, f"merged output of block {index} on task {task!r}")
            if linear_stats is None:
                tokens = min(int(m.sum()) for m in masks.values())  # a hint for the cost
                linear_stats, groups = self._linear_groups(x_s, last, tokens)
                norm_stats = self._norm_stats()
            context_mask = None if context_s is None else context_s[1]
            self._accumulate(x_s, x_e, weighted, context_mask, last, params.alpha, groups,
                             linear_stats, norm_stats, expert_params)  # fmt: skip
            del x_s, x_e
            sq, tok = _drift_sums(out_m, out_e, self._drift_mask(weighted, last))
            sq_sum, tok_sum = sq_sum + sq, tok_sum + tok
            new_expert.append(out_e.to("cpu"))
        if linear_stats is None:
            raise FeatCalError(f"task {task!r} has no calibration inputs for block {index}")
        target.put(EXPERT, task, torch.cat(new_expert))
        del new_expert
        found = Fallbacks(f"block {index}")
        linear = {}
        for label, stats in linear_stats.items():
            members = {name: expert_params[name] for name in stats.targets}
            with _tokens_needed(index, task, label):
                linear[label] = stats.task_contribution(params.eps, params.alpha, members,
                                                        fallbacks=found, task=task)  # fmt: skip
        norms = {}
        for name, stats in norm_stats.items():
            module = self.expert_block.get_submodule(name)
            with _tokens_needed(index, task, name):
                norms[name] = stats.task_contribution(module.weight, getattr(module, "bias", None))
        layout = {
            label: {"d_in": stats.d_in, "tokens": tokens, "modules": stats.modules}
            for label, stats in linear_stats.items()
        }
        drift = _mean_drift(sq_sum, tok_sum, task, "before calibration", found)
        return TaskStatistics(task, index, linear, layout, norms, drift, found.entries)

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
        one task's statistics while it runs, then two copies of the largest group); None folds
        them in memory as they come. Every way folds the contributions in task order, so all give
        the same block, bit for bit."""
        start = time.perf_counter()
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
            if precomputed is None:
                stats = self.task_statistics(index, task, source, target, masks, params, batch_size)
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
                self._fold(linear_sums, norm_sums, stats.layout, stats.linear.get,
                           stats.norms.get)  # fmt: skip
            del stats

        base_sd = self.read_block(self.models.base, index)
        if stored:
            solved = self._fold_and_solve(stored, merged_sd, base_sd, params, found)
            for done in stored:
                if scratch_dir is not None and done.path.parent == Path(scratch_dir):
                    done.path.unlink(missing_ok=True)
        else:
            solved = self._solve(linear_sums, norm_sums, merged_sd, base_sd, params, found)
        del linear_sums, norm_sums, stored
        del base_sd
        result.tensors = {name: solved[name].to(merged_sd[name].dtype) for name in solved}
        merged_sd.update(result.tensors)
        self.load(self.merged_block, merged_sd)
        self._merged_index = None  # the merged block now holds calibrated weights

        contexts = target if phase == "bridge" else source  # the bridge wrote them to target
        for task in self.models.experts:
            outputs, sq_sum, tok_sum = [], 0.0, 0.0
            batches = zip(
                source.batches(student_kind, task, batch_size),
                target.batches(EXPERT, task, batch_size),
                self._mask(masks, task, phase).split(batch_size),
                self._weight_mask(masks, task, phase).split(batch_size),
                self._contexts(phase, STUDENT, task, contexts, batch_size, masks),
                strict=True,
            )
            for student, expert_out, mask, weighted, context in batches:
                out = self.forward(self.merged_block, student.to(self.device),
                                   mask.to(self.device), context)  # fmt: skip
                _check_finite(out, f"calibrated output of block {index} on task {task!r}")
                drift_mask = self._drift_mask(weighted.to(self.device), last)
                sq, tok = _drift_sums(out, expert_out.to(self.device), drift_mask)
                sq_sum, tok_sum = sq_sum + sq, tok_sum + tok
                outputs.append(out.to("cpu"))
            result.drift_after[task] = _mean_drift(sq_sum, tok_sum, task, "after calibration",
                                                   found)  # fmt: skip
            target.put(STUDENT, task, torch.cat(outputs))
        result.fallbacks = found.entries
        result.seconds = time.perf_counter() - start
        return result

    # ----- helpers ----------------------------------------------------------------------------
    def _drift_mask(self, mask: torch.Tensor, last: bool) -> torch.Tensor:
        """Tokens the drift is measured on: all real tokens; only the pooled one in the last block
        of a pooled model (the only output that matters there)."""
        if not last or self.arch.pooled_position is None:
            return mask
        only = torch.zeros_like(mask)
        only[:, self.arch.pooled_position] = mask[:, self.arch.pooled_position]
        return only

    def _pooled(self, name: str, last: bool) -> bool:
        return last and self.arch.pooled_position is not None and self.arch.is_pooled_module(name)

    def _linear_groups(self, captured: dict[str, torch.Tensor], last: bool, tokens: int):
        """Group Linear modules that read the same tensor with the same token weights; each group
        is labelled by its first module's name (stable across processes)."""
        labels: dict[tuple[int, bool], str] = {}
        groups: dict[str, str] = {}
        members: dict[str, dict[str, tuple[int, bool]]] = {}
        for name in self.linears:
            label = labels.setdefault((id(captured[name]), self._pooled(name, last)), name)
            groups[name] = label
            module = self.merged_block.get_submodule(name)
            members.setdefault(label, {})[name] = (module.out_features, module.bias is not None)
        stats = {}
        scratch = Scratch(self.device)
        for label, modules in members.items():
            d_in = self.merged_block.get_submodule(label).in_features
            stats[label] = LinearInputStats(d_in, modules, self.device, tokens, scratch)
        return stats, groups

    def _norm_stats(self) -> dict[str, NormStats]:
        out = {}
        for name in self.norms:
            module = self.merged_block.get_submodule(name)
            eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
            rms = isinstance(module, self.arch.rms_norm_types)
            has_bias = getattr(module, "bias", None) is not None
            out[name] = NormStats(module.weight.shape[0], eps, rms, has_bias, self.device)
        return out

    def _accumulate(
        self, x_s, x_e, mask, context_mask, last, alpha, groups, linear_stats, norm_stats,
        expert_params,
    ):  # fmt: skip
        done: set[str] = set()
        for name in self.linears:
            key = groups[name]
            if key in done:
                continue
            done.add(key)
            stats = linear_stats[key]
            tokens = context_mask if self.arch.reads_context(name) else mask
            (xs, xe), w = _weighted_tokens(
                self.arch.token_weights(name, last, tokens), x_s[name], x_e[name]
            )
            params = {member: expert_params[member] for member in stats.targets}
            stats.add(xs, xe, w, alpha, params)
        for name, stats in norm_stats.items():
            (xs,), w = _weighted_tokens(self.arch.token_weights(name, last, mask), x_s[name])
            stats.add(xs, w)

    def _fold(self, linear_sums, norm_sums, layout, linear_of, norm_of, adopt=False) -> None:
        """Add one task's contribution: for each group label in `layout`, linear_of(label) into
        linear_sums[label] (created from the layout on first use); for each norm in norm_sums,
        norm_of(name) into it (norm_of None: no norms). adopt: see LinearInputStats.merge."""
        for label, lay in layout.items():
            if label not in linear_sums:
                linear_sums[label] = LinearInputStats(lay["d_in"], lay["modules"], self.device,
                                                      lay["tokens"])  # fmt: skip
            linear_sums[label].merge(linear_of(label), adopt=adopt)
        if norm_of is not None:
            for name, sums in norm_sums.items():
                sums.merge(norm_of(name))

    def _fold_and_solve(self, stored, merged_sd, base_sd, params, fallbacks=None):
        """Fold the saved statistics of every task (task order) and solve, one Linear group or
        norm at a time (fallbacks: see `_solve`)."""
        solved: dict[str, torch.Tensor] = {}
        norm_sums = self._norm_stats()
        for label in stored[0].layout:
            linear_sums: dict[str, LinearInputStats] = {}
            for stats in stored:
                self._fold(linear_sums, {}, {label: stats.layout[label]},
                           lambda g, stats=stats: stats.group("linear", g), None,
                           adopt=True)  # fmt: skip
            solved.update(self._solve(linear_sums, {}, merged_sd, base_sd, params, fallbacks))
            del linear_sums
        for stats in stored:
            self._fold({}, norm_sums, {}, None, lambda n, stats=stats: stats.group("norm", n))
        solved.update(self._solve({}, norm_sums, merged_sd, base_sd, params, fallbacks))
        return solved

    def _solve(self, linear_stats, norm_stats, merged_sd, base_sd, params, fallbacks=None):
        """Solve every Linear group, then every norm; fallbacks and clamps go to `fallbacks`
        (a `Fallbacks`; None: logged only)."""
        lam, rho, eps = params.lam, params.rho, params.eps
        solved: dict[str, torch.Tensor] = {}

        def anchored(name: str) -> torch.Tensor | None:
            if name not in merged_sd or lam == 0:
                return None
            return anchor(merged_sd[name].to(self.device), base_sd[name].to(self.device), rho)

        def keep(name: str, tensor: torch.Tensor) -> None:
            """Check the float64 solution, then keep it in the merged tensor's dtype."""
            _check_finite(tensor, f"solved parameter {name}")
            solved[name] = tensor.to("cpu", merged_sd[name].dtype)

        for stats in linear_stats.values():
            anchors = {
                name: (anchored(f"{name}.weight"), anchored(f"{name}.bias"))
                for name in stats.targets
            }
            for name, (weight, bias) in stats.solve(lam, eps, anchors, fallbacks).items():
                keep(f"{name}.weight", weight)
                if bias is not None:
                    keep(f"{name}.bias", bias)
            del anchors
        for name, stats in norm_stats.items():
            gamma, beta = stats.solve(
                lam, eps, anchored(f"{name}.weight"), anchored(f"{name}.bias"), fallbacks, name
            )
            keep(f"{name}.weight", gamma)
            if beta is not None:
                keep(f"{name}.bias", beta)
        return solved


def _run(arch, block, hidden, mask, context):
    """arch.run_block, with the decoder's context only when there is one."""
    if context is None:
        return arch.run_block(block, hidden, mask)
    return arch.run_block(block, hidden, mask, context=context)


@contextmanager
def _tokens_needed(index: int, task: str, module: str) -> Iterator[None]:
    """Turn a statistics' "no weighted tokens" ValueError into a FeatCalError naming the task,
    block and module."""
    try:
        yield
    except ValueError as exc:
        raise FeatCalError(
            f"task {task!r} gives no weighted tokens to {module} in block {index} ({exc}); check "
            "its calibration set and token weighting"
        ) from exc


def _mean_drift(sq_sum: float, tok_sum: float, task: str, when: str, found: Fallbacks) -> float:
    """sq_sum / tok_sum; 0 with a "no_tokens" entry in `found` when no token carries weight."""
    if tok_sum > 0:
        return sq_sum / tok_sum
    found.add("no_tokens", f"no weighted tokens for the drift {when}; reported as 0", task=task)
    return 0.0


def _weighted_tokens(weights: torch.Tensor, *hidden: torch.Tensor):
    """Flatten (B, S, d) inputs to their tokens of non-zero weight: ([tokens (N, d), ...], w (N))
    with w None when every kept weight is 1."""
    weights = weights.reshape(-1)
    keep = weights > 0
    flat = [h.reshape(-1, h.shape[-1]) for h in hidden]
    if not bool(keep.all()):
        weights = weights[keep]
        flat = [h[keep] for h in flat]
    w = None if bool((weights == 1).all()) else weights
    return flat, w


def _drift_sums(
    student: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    """(Σ mask·‖s − e‖², Σ mask) over tokens, in float64."""
    sq = (student.to(torch.float64) - expert.to(torch.float64)).pow(2).sum(-1)
    mask = mask.to(torch.float64)
    return float((sq * mask).sum()), float(mask.sum())


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise FeatCalError(
            f"NaN or Inf in the {what}; check that checkpoint's weights and its dtype's range "
            "(try float32 weights)"
        )
