"""`adamerge_checkpoint`: layer-wise AdaMerging (Yang et al., "AdaMerging: Adaptive Model Merging
for Multi-Task Learning", ICLR 2024) as a repair baseline.

The merged tower is θ_l(λ) = θ0_l + Σ_k λ_{k,l} τ_{k,l}, with τ_k = θ_k − θ0 (expert k minus the
base), one coefficient λ_{k,l} per task k and per tower tensor ("layer") l. The λ are learnt with
Adam by minimising Σ_k mean_b H(softmax(logits_k,b)), the Shannon entropy (nats) of task k's head
on batches b of task k's unlabeled inputs, summed over tasks; λ is clamped to [0, 1] where it is
used. The paper trains on the tasks' unlabeled *test* inputs; here, as for FeatCal and the
Representation Surgery baseline, on their calibration (train-split) inputs, drawn as FeatCal draws
them (`Settings`: num_per_task, seed).

Defaults, as the paper reports its setting: λ initialised to 0.3 (the prior), Adam lr 1e-3,
betas (0.9, 0.999), 500 steps, 16 inputs per task per step; λ clamped to [0, 1] as FusionBench's
layer-wise AdaMerging does (clamp_weights).

The output is a full checkpoint in the merged checkpoint's layout (the merge output passed as
`merged` is the template): every tower tensor the experts change is rewritten as θ0 + Σ_k λ τ
(computed in float64, stored in the template's dtype); every other tensor (a text tower,
projections, tensors no expert changes) is the template's, bit for bit; plus `adamerging.json`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from featcal_core.architectures import detect
from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.head import Head
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.export import export_checkpoint
from featcal_core.io.outputs import guarded_directory, write_json
from featcal_core.io.safetensors_io import DTYPES, save_tensors
from featcal_core.memory import peak_rss_bytes
from featcal_core.method.settings import Settings
from featcal_core.progress import stage_progress
from featcal_core.repair import defaults
from featcal_core.repair.trained_inputs import (
    check_learning_rate,
    check_positive_integers,
    load_trained_inputs,
)

log = logging.getLogger(__name__)

__all__ = [
    "ADAMERGING_RECORD",
    "DEFAULT_ADAMERGING_BATCH",
    "DEFAULT_INIT",
    "DEFAULT_LR",
    "DEFAULT_STEPS",
    "adamerge_checkpoint",
    "check_hyperparameters",
]

ADAMERGING_RECORD = "adamerging.json"
RECORD_VERSION = 1
DEFAULT_STEPS = defaults.ADAMERGING_STEPS
DEFAULT_LR = defaults.ADAMERGING_LR
DEFAULT_INIT = defaults.ADAMERGING_INIT
DEFAULT_ADAMERGING_BATCH = defaults.ADAMERGING_BATCH
BETAS = (0.9, 0.999)
OBJECTIVE = "sum over tasks of the mean Shannon entropy (nats) of the task head's softmax"


def check_hyperparameters(
    steps: int, lr: float, init: float, batch_size: int, log_every: int
) -> None:
    """FeatCalError naming the first bad value by its `featcal adamerging` flag (the batch of
    rows per Adam step is --adamerging-batch-size; --batch-size is the calibration batch)."""
    check_positive_integers(
        {"--steps": steps, "--adamerging-batch-size": batch_size, "--log-every": log_every}
    )
    check_learning_rate(lr)
    if isinstance(init, bool) or not isinstance(init, int | float) or not 0 <= init <= 1:
        raise FeatCalError(f"--init must be a number in [0, 1] (got {init!r})")


def _generator(seed: int, task: str) -> torch.Generator:
    """Task `task`'s batch order, seeded from (seed, task)."""
    digest = hashlib.sha256(f"featcal-adamerging:{seed}:{task}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy (nats) of softmax(logits) over the rows of logits (B, classes)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1).mean()


def _module_prefix(names: list[str], arch: Architecture, what: str) -> str:
    """The key prefix of the tower among a features module's parameter names."""
    probe = arch.probe_key
    found = sorted(
        {n[: len(n) - len(probe)] for n in names if n == probe or n.endswith("." + probe)}
    )
    if len(found) != 1:
        raise FeatCalError(
            f"{what}: its features module holds {len(found)} {arch.name} towers (parameters ending "
            f"in {probe!r}), AdaMerging needs exactly one; use a head that reads one tower"
        )
    return found[0]


@dataclass
class _Runner:
    """One features module shared by tasks: its parameter name → canonical tower name, and per
    task the module entries (parameters, buffers) whose values differ from the module's own."""

    module: nn.Module
    names: dict[str, str]
    overrides: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Tower:
    """The learnt tower tensors: canonical names l (in order), θ0_l (float32, on the device) and
    τ_l stacked over tasks, (T, *shape_l) float32 on the device."""

    names: list[str]
    theta0: dict[str, torch.Tensor]
    taus: dict[str, torch.Tensor]

    def weights(self, lambdas: torch.Tensor) -> dict[str, torch.Tensor]:
        """θ_l(λ) = θ0_l + Σ_k λ[k, l] τ_{k,l} for every learnt l; lambdas (T, L), clamped."""
        return {
            name: self.theta0[name] + torch.tensordot(lambdas[:, i], self.taus[name], dims=1)
            for i, name in enumerate(self.names)
        }


def _runners(
    task_heads: dict[str, Head], base: Checkpoint, arch: Architecture, device: torch.device
) -> tuple[dict[str, _Runner], dict[str, nn.Linear]]:
    """Each task's features runner and final Linear, with the base tower loaded. Tasks whose
    features modules have the same structure share one module (per-task differences outside
    the tower, e.g. a BERT expert's own pooler, are kept as overrides)."""
    base_prefix = arch.resolve_prefix(base)
    kept: list[_Runner] = []
    runners: dict[str, _Runner] = {}
    linears: dict[str, nn.Linear] = {}
    for task, head in task_heads.items():
        features, linear = head.layers(base.directory, device)
        features.eval().requires_grad_(False)
        linears[task] = linear.eval().requires_grad_(False)
        state = features.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        for runner in kept:
            own = runner.module.state_dict()
            if type(runner.module) is type(features) and shapes == {
                k: tuple(v.shape) for k, v in own.items()
            }:
                runner.overrides[task] = {
                    k: v
                    for k, v in state.items()
                    if k not in runner.names and not torch.equal(v, own[k])
                }
                runners[task] = runner
                break
        else:
            what = f"task {task!r} ({head.describe()})"
            params = [n for n, _ in features.named_parameters()]
            prefix = _module_prefix(params, arch, what)
            local = {n: n[len(prefix) :] for n in params if n.startswith(prefix)}
            names = {n: c for n, c in local.items() if base_prefix + c in base}
            if not names:
                raise FeatCalError(
                    f"{what}: no parameter of its features module is a tower "
                    f"tensor of the base model {base.directory}"
                )
            runners[task] = _Runner(features, names, {task: {}})
            kept.append(runners[task])
        del features, state
    return runners, linears


def _tower(
    runners: dict[str, _Runner],
    base: Checkpoint,
    experts: dict[str, Checkpoint],
    arch: Architecture,
    device: torch.device,
) -> tuple[_Tower, list[str]]:
    """The learnt tensors (canonical names read by some runner, float, held by every expert with
    the base's shape, changed by at least one expert) and the unchanged ones."""
    base_prefix = arch.resolve_prefix(base)
    prefixes = {task: arch.resolve_prefix(c) for task, c in experts.items()}
    params: dict[str, torch.Tensor] = {}
    for runner in {id(r): r for r in runners.values()}.values():
        module_params = dict(runner.module.named_parameters())
        for name, canonical in runner.names.items():
            params.setdefault(canonical, module_params[name])
    names, unchanged = [], []
    theta0, taus = {}, {}
    for canonical, param in params.items():
        key = base_prefix + canonical
        info = base.tensors[key]
        if not DTYPES[info.dtype].is_floating_point:
            continue
        others = [prefixes[t] + canonical for t in experts]
        for (task, ckpt), other in zip(experts.items(), others, strict=True):
            if other not in ckpt or ckpt.tensors[other].shape != info.shape:
                raise FeatCalError(
                    f"tensor {other!r} (the base's {key!r}) is missing from or has another shape "
                    f"in expert {task!r} {ckpt.directory}; an expert must be a fine-tune of the "
                    "base with the same architecture"
                )
        theta = base.read([key])[key]
        if not torch.equal(param.detach().cpu(), theta.float()):
            raise FeatCalError(
                f"tensor {key!r} of the base {base.directory} does not match the head's tower "
                f"parameter {canonical!r}; the head does not read the base's tower as loaded"
            )
        pairs = zip(experts.values(), others, strict=True)
        vectors = [ckpt.read([other])[other] for ckpt, other in pairs]
        if all(torch.equal(v, theta) for v in vectors):
            unchanged.append(canonical)
            continue
        names.append(canonical)
        theta0[canonical] = theta.to(device, torch.float32)
        taus[canonical] = torch.stack([(v.double() - theta.double()).float() for v in vectors]).to(
            device
        )
        del vectors
    if not names:
        raise FeatCalError(
            "AdaMerging: no expert changes any tower tensor the heads read; "
            "there is nothing to learn (check the experts)"
        )
    return _Tower(names, theta0, taus), unchanged


def _inputs(head: Head, rows: list[Any], task: str) -> dict[str, torch.Tensor]:
    """All of task `task`'s rows preprocessed once: name → (N, ...) on the CPU."""
    inputs = head.preprocess(rows)
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != len(rows):
            raise FeatCalError(
                f"task {task!r}: {head.describe()} preprocessing gave {name!r} of shape "
                f"{tuple(getattr(value, 'shape', ()))} for {len(rows)} rows; expected (N, ...)"
            )
    return inputs


class _Objective:
    """The tasks' entropies for a given λ: runners, final Linears and cached inputs."""

    def __init__(
        self,
        tower: _Tower,
        runners: dict[str, _Runner],
        linears: dict[str, nn.Linear],
        inputs: dict[str, dict[str, torch.Tensor]],
        device: torch.device,
    ):
        self.tower, self.runners, self.linears = tower, runners, linears
        self.inputs, self.device = inputs, device

    def logits(self, task: str, weights: dict[str, torch.Tensor], rows: torch.Tensor | slice):
        runner = self.runners[task]
        values = {name: weights[c] for name, c in runner.names.items() if c in weights}
        values.update(runner.overrides[task])
        batch = {k: v[rows].to(self.device) for k, v in self.inputs[task].items()}
        features = functional_call(runner.module, values, args=(), kwargs=batch)
        return self.linears[task](features.float())

    @torch.no_grad()
    def calibration_entropy(self, lambdas: torch.Tensor, batch_size: int) -> dict[str, float]:
        """Each task's mean entropy (nats) over all its calibration rows at `lambdas`."""
        weights = self.tower.weights(lambdas)
        out = {}
        for task, inputs in self.inputs.items():
            n = next(iter(inputs.values())).shape[0]
            total = 0.0
            for start in range(0, n, batch_size):
                logits = self.logits(task, weights, slice(start, start + batch_size))
                total += float(_entropy(logits)) * logits.shape[0]
            out[task] = total / n
        return out


def _train(
    objective: _Objective,
    tasks: list[str],
    *,
    steps: int,
    lr: float,
    init: float,
    batch_size: int,
    seed: int,
    log_every: int,
    progress: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Adam on the raw λ (T, L); returns the clamped λ (float32, CPU) and the entropy curve."""
    tower, device = objective.tower, objective.device
    raw = torch.full((len(tasks), len(tower.names)), float(init), device=device, requires_grad=True)
    optimizer = torch.optim.Adam([raw], lr=lr, betas=BETAS, weight_decay=0.0)
    sizes = {t: next(iter(objective.inputs[t].values())).shape[0] for t in tasks}
    gens = {t: _generator(seed, t) for t in tasks}
    orders = {t: torch.randperm(sizes[t], generator=gens[t]) for t in tasks}
    cursors = dict.fromkeys(tasks, 0)
    logged_steps, logged = [], []
    for step in stage_progress(
        range(1, steps + 1), desc="adamerging", unit="step", enabled=progress
    ):
        weights = tower.weights(raw.clamp(0.0, 1.0))
        loss = torch.zeros((), device=device)
        for task in tasks:
            n, size = sizes[task], min(batch_size, sizes[task])
            if cursors[task] + size > n:
                orders[task], cursors[task] = torch.randperm(n, generator=gens[task]), 0
            rows = orders[task][cursors[task] : cursors[task] + size]
            cursors[task] += size
            loss = loss + _entropy(objective.logits(task, weights, rows))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FeatCalError(
                f"AdaMerging: the entropy is NaN or Inf at step {step}; lower --lr "
                f"(got {lr}) or check the models"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        assert raw.grad is not None  # set by backward
        if not bool(torch.isfinite(raw.grad).all()):
            raise FeatCalError(
                f"AdaMerging: NaN or Inf gradient at step {step}; lower --lr "
                f"(got {lr}) or check the models"
            )
        optimizer.step()
        del weights, loss
        if step == 1 or step % log_every == 0 or step == steps:
            logged_steps.append(step)
            logged.append(value)
    lambdas = raw.detach().clamp(0.0, 1.0)
    if not bool(torch.isfinite(lambdas).all()):
        raise FeatCalError(f"AdaMerging: the coefficients diverged; lower --lr (got {lr})")
    curve = {
        "objective": OBJECTIVE,
        "first": logged[0],
        "last": logged[-1],
        "every": log_every,
        "steps": logged_steps,
        "values": logged,
    }
    return lambdas.cpu(), curve


def _merged_tensors(
    tower: _Tower,
    lambdas: dict[str, dict[str, float]],
    base: Checkpoint,
    experts: dict[str, Checkpoint],
    template: Checkpoint,
    arch: Architecture,
) -> dict[str, torch.Tensor]:
    """Template key → θ0 + Σ_k λ τ_k, from the checkpoints in float64, in the template's dtype."""
    base_prefix, out_prefix = arch.resolve_prefix(base), arch.resolve_prefix(template)
    prefixes = {t: arch.resolve_prefix(c) for t, c in experts.items()}
    out = {}
    for canonical in tower.names:
        key = out_prefix + canonical
        if (
            key not in template
            or template.tensors[key].shape != base.tensors[base_prefix + canonical].shape
        ):
            raise FeatCalError(
                f"merged model {template.directory} has no tensor {key!r} of the base's shape; "
                "pass a merge of these experts (the base's layout) as the template"
            )
        theta0 = base.read([base_prefix + canonical])[base_prefix + canonical].double()
        total = theta0.clone()
        for task, ckpt in experts.items():
            other = prefixes[task] + canonical
            tau = ckpt.read([other])[other].double() - theta0
            total.add_(tau, alpha=lambdas[task][key])
        value = total.to(DTYPES[template.tensors[key].dtype]).contiguous()
        if not bool(torch.isfinite(value).all()):
            raise FeatCalError(
                f"AdaMerging: tensor {key!r} is NaN or Inf after the merge "
                f"(in {template.tensors[key].dtype}); check the inputs"
            )
        out[key] = value
    return out


def adamerge_checkpoint(
    base: str | Path,
    merged: str | Path,
    experts: Mapping[str, str | Path],
    calibration_sets: Mapping[str, str | Path],
    out: str | Path,
    *,
    heads: Mapping[str, Head] | None = None,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    init: float = DEFAULT_INIT,
    batch_size: int = DEFAULT_ADAMERGING_BATCH,
    settings: Settings = Settings(),
    seed: int = 0,
    log_every: int = 50,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Learn layer-wise AdaMerging coefficients λ (T tasks × L tower tensors) and write the
    merged checkpoint θ0 + Σ_k λ_{k,l} τ_{k,l} to `out` (the layout, config and other files of
    `merged`, whose tensors outside the learnt tower are kept as they are) plus
    `out/adamerging.json`; returns that record. Raises FeatCalError on bad input before any work,
    leaving `out` as it was.

    base: the experts' common base θ0; merged: a merge output of the same experts (e.g. Task
    Arithmetic), the template; experts, calibration_sets: task → expert dir, task →
    `save_to_disk` dir (drawn as FeatCal draws: settings.num_per_task, settings.seed; the
    calibration (train) inputs, not test inputs as in the paper); heads: task → Head whose logits
    give the entropy (default: the expert's own, `ExpertHead(expert, tokenizer_dir=...)`);
    steps, lr, init, batch_size: Adam steps, its learning rate, the initial λ in [0, 1], inputs
    per task per step (min(batch_size, N) rows of a seeded per-task permutation, a new one each
    pass; the objective is the sum of the tasks' batch entropies); seed: the batch order. Entropy
    passes over all calibration rows use settings.batch_size on settings.device.

    Memory: every expert's task vector for the tower at once, T × (tower size) float32 on the
    device (ViT-B/32's 88 M tower parameters: 0.35 GB per task, 2.8 GB for 8 tasks), plus θ0 and
    one θ(λ) with its gradient (float32), one features module per head structure, and each task's
    preprocessed inputs (N rows, CPU; 224² images: 0.6 MB a row).
    """
    started = time.perf_counter()
    out = Path(out)
    check_hyperparameters(steps, lr, init, batch_size, log_every)
    given = load_trained_inputs(
        "AdaMerging",
        merged,
        experts,
        calibration_sets,
        out,
        heads=heads,
        tokenizer_dir=tokenizer_dir,
        settings=settings,
        seed=seed,
        overwrite=overwrite,
        more_inputs=(base,),
    )
    device, sets, inputs, task_heads = given.device, given.sets, given.inputs, given.heads
    merged_ckpt, expert_ckpts = given.merged, given.experts
    base_ckpt = Checkpoint(base, role="base model")
    arch = detect(base_ckpt.config, source=str(base_ckpt.directory / "config.json"))
    tasks = list(experts)
    hyper = {
        "granularity": "layer-wise",
        "steps": steps,
        "lr": lr,
        "betas": list(BETAS),
        "weight_decay": 0.0,
        "init": init,
        "clamp": [0.0, 1.0],
        "batch_size": batch_size,
        "seed": seed,
        "log_every": log_every,
        "objective": OBJECTIVE,
    }

    runners, linears = _runners(task_heads, base_ckpt, arch, device)
    tower, unchanged = _tower(runners, base_ckpt, expert_ckpts, arch, device)
    cached = {t: _inputs(task_heads[t], sets[t].rows, t) for t in tasks}
    objective = _Objective(tower, runners, linears, cached, device)
    log.info(
        "AdaMerging (layer-wise, %d steps, lr %g, init %g): %d tasks x %d tensors on %s",
        steps,
        lr,
        init,
        len(tasks),
        len(tower.names),
        device,
    )
    start = torch.full((len(tasks), len(tower.names)), float(init), device=device)
    before = objective.calibration_entropy(start, settings.batch_size)
    lambdas, curve = _train(
        objective,
        tasks,
        steps=steps,
        lr=lr,
        init=init,
        batch_size=batch_size,
        seed=seed,
        log_every=log_every,
        progress=progress,
    )
    after = objective.calibration_entropy(lambdas.to(device), settings.batch_size)
    out_prefix = arch.resolve_prefix(merged_ckpt)
    coefficients = {
        task: {out_prefix + c: float(lambdas[k, i]) for i, c in enumerate(tower.names)}
        for k, task in enumerate(tasks)
    }
    del objective, runners, linears, cached
    log.info(
        "AdaMerging: mean calibration entropy %.4g -> %.4g (batch objective %.4g -> %.4g)",
        sum(before.values()) / len(before),
        sum(after.values()) / len(after),
        curve["first"],
        curve["last"],
    )

    tensors = _merged_tensors(tower, coefficients, base_ckpt, expert_ckpts, merged_ckpt, arch)
    del tower
    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        work = tmp / "_work"
        work.mkdir()
        try:
            path = work / "adamerging.safetensors"
            save_tensors(path, tensors)
            export_checkpoint(
                merged_ckpt, dict.fromkeys(tensors, path), tmp, extra_sources=(base_ckpt.directory,)
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        record = {
            "adamerging_record_version": RECORD_VERSION,
            "method": "adamerging",
            "architecture": arch.name,
            "hyperparameters": {**hyper, "settings": dict(asdict(settings), device=str(device))},
            "inputs": given.describe(base=base_ckpt),
            "heads": {t: task_heads[t].describe() for t in tasks},
            "tensors": {
                "learnt": len(tensors),
                "unchanged": len(unchanged),
                "from_merged": len(merged_ckpt.tensors) - len(tensors),
            },
            "coefficients": coefficients,
            "entropy": {
                **curve,
                "calibration_init": {"mean": sum(before.values()) / len(before), "tasks": before},
                "calibration_final": {"mean": sum(after.values()) / len(after), "tasks": after},
            },
            "wall_seconds": round(time.perf_counter() - started, 3),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        write_json(tmp / ADAMERGING_RECORD, record, "AdaMerging record")
    log.info("wrote %s in %.1f s", out, record["wall_seconds"])
    return record
