"""The model card (`README.md` beside a calibrated checkpoint): a Hugging Face model card
(huggingface_hub's `ModelCard`; its metadata, a `ModelCardData`, follows the rules of
featcal_core.provenance.card_metadata) with how to load the model and its refit heads, the
evaluation results, the recipe, every input with its digest, the inputs' licenses and the
provenance, built from `lineage.trace`.

The pipeline writes it twice (flows/steps.py): after calibration (no results yet) and again once
`featcal evaluate` has the evaluation table (not when it runs as a DVC stage: the folder is the
calibrate stage's output; the report stage writes the card with its results into the report
instead, `reports/<run name>/model_card.md`). Both go through the guarded writer, which records
the card's new sha256 in the folder's marker, so the folder still verifies (`verify_output`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import sha256_file, write_file
from featcal_core.provenance.card_metadata import (
    FRONT_MATTER_ORDER,
    accuracy_table,
    card_data,
    eval_results,
    read_license,
)
from featcal_core.provenance.card_sections import (
    _cell,
    _code,
    _license_section,
    _metrics_table,
    _nested,
    _results_section,
    _table,
    _usage_section,
)
from featcal_core.provenance.records import FITTED_ON
from featcal_core.provenance.text import DASH, as_dict, value_text

__all__ = [
    "CARD_NAME",
    "config_facts",
    "family_facts",
    "model_card_fields",
    "render_model_card",
    "write_model_card",
]

log = logging.getLogger(__name__)

_PROVENANCE_LABELS = {
    "git_commit": "git commit",
    "git_dirty": "git working tree dirty",
    "mlflow_run_id": "MLflow run id",
    "prefect_flow_run_id": "Prefect flow-run id",
    "dvc_stage": "DVC stage",
}
_FEATCAL_LABELS = (
    ("alpha", "α (alpha, teacher interpolation)"),
    ("rho", "ρ (rho, anchor blend)"),
    ("lam", "λ (lam, ridge weight)"),
    ("eps", "ε (eps, jitter)"),
    ("num_per_task", "n per task (calibration inputs per task)"),
    ("seed", "seed (calibration sample)"),
)
#: what the model card shows of a calibration set
_CARD_SET_KEYS = (
    "digest",
    "tree_sha256",
    "n_rows",
    "rows",
    "rows_available",
    "seed",
    "source",
    "split",
    "source_commit",
)
#: what the model card shows of the base model, and under which label
_CARD_MODEL_FACTS = (
    ("reference", "reference"),
    ("kind", "kind"),
    ("revision", "revision"),
    ("commit", "commit"),
)


def _with_commit(source: Any, commit: Any) -> Any:
    """A Hub source with the dataset commit its rows came from (first 12 hex digits)."""
    return f"{source} (commit {str(commit)[:12]})" if source and commit else source


#: the model card written next to the weights
CARD_NAME = "README.md"


def model_card_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `write_model_card` (title, recipe, inputs, evaluation, provenance,
    model, heads, model_name) taken from a `trace` result: each input's license is read from its
    folder (card_metadata.read_license), the refit heads are those of
    `<results>/refit_heads/<checkpoint name>/` when their fitted_on.json names this checkpoint's
    weights, and the evaluation is the results directory's evaluation.json."""
    chain = result.get("chain") or {}
    calibrated, merged = chain.get("calibrated"), chain.get("merged")
    recipe: dict[str, Any] = {}
    if merged and merged.get("method"):
        recipe["merge"] = {
            "method": merged["method"],
            "hyperparameters": dict(merged.get("hyperparameters") or {}),
        }
    if calibrated:
        recipe["featcal"] = dict(calibrated.get("hyperparameters") or {})

    def model(entry: Mapping[str, Any] | None) -> dict[str, Any]:
        if not entry:
            return {}
        out = {
            key: entry.get(key)
            for key in ("reference", "kind", "repo_id", "revision", "commit")
            if entry.get(key) is not None
        }
        out.setdefault("reference", entry.get("path"))
        out["sha256"] = {name: info["sha256"] for name, info in (entry.get("files") or {}).items()}
        stated = read_license(entry.get("path"))
        if stated:
            out["license"] = stated
        return out

    inputs: dict[str, Any] = {
        "base": model(chain.get("base")),
        "experts": {task: model(e) for task, e in (chain.get("experts") or {}).items()},
        "calibration_sets": {
            task: {key: entry.get(key) for key in _CARD_SET_KEYS if entry.get(key) is not None}
            for task, entry in (chain.get("calibration_sets") or {}).items()
        },
    }
    checkpoint = Path(result.get("checkpoint") or result.get("path") or "model")
    count = len(inputs["experts"])
    if calibrated:
        how = "FeatCal-calibrated"
        if merged and merged.get("method"):
            how += f" {merged['method']}"
        title = f"{checkpoint.name}: {how} merge of {count} experts"
    elif merged and merged.get("method"):
        title = f"{checkpoint.name}: {merged['method']} merge of {count} experts"
    else:
        title = checkpoint.name
    results_dir = chain.get("results_dir")
    return {
        "title": title,
        "recipe": recipe,
        "inputs": inputs,
        "evaluation": chain.get("evaluation") or None,
        "provenance": dict(chain.get("provenance") or {}) or None,
        "model": _model_facts(chain, checkpoint),
        "heads": _refit_heads(results_dir, checkpoint),
        "model_name": f"{Path(results_dir).name}-{checkpoint.name}"
        if results_dir
        else checkpoint.name,
    }


def config_facts(config: Any) -> dict[str, Any]:
    """{"model_type", "model_class"} of a checkpoint's config.json (a mapping, or the folder
    that holds it): its transformers `model_type` and the class it was saved as
    (`architectures[0]`), those it names."""
    if isinstance(config, str | Path):
        try:
            config = json.loads((Path(config) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
    config = as_dict(config)
    classes = config.get("architectures")
    facts = {
        "model_type": config.get("model_type"),
        "model_class": classes[0] if isinstance(classes, list) and classes else None,
    }
    return {key: value for key, value in facts.items() if isinstance(value, str) and value}


def family_facts(architecture: Any, modality: Any = None) -> dict[str, Any]:
    """{"architecture", "modality", "causal"} of featcal's architecture name (those known):
    what its adapter says, `modality` first when given."""
    facts: dict[str, Any] = {"architecture": architecture, "modality": modality}
    if isinstance(architecture, str):
        from featcal_core.architectures import get  # (imports torch: only when there is one)

        try:
            family = get(architecture)
        except FeatCalError:
            family = None
        if family is not None:
            facts["modality"] = modality or family.modality or None
            facts["causal"] = bool(family.causal)
    return {key: value for key, value in facts.items() if value is not None}


def _model_facts(chain: Mapping[str, Any], checkpoint: Path) -> dict[str, Any]:
    """{"architecture", "model_type", "model_class", "modality", "causal"} of the traced
    checkpoint (those known): featcal.json's architecture, config.json's model_type and class,
    the calibration sets' modality, and what featcal's adapter for the architecture says."""
    sets = as_dict(chain.get("calibration_sets")).values()
    modality = next((as_dict(s).get("modality") for s in sets if as_dict(s).get("modality")), None)
    architecture = as_dict(chain.get("calibrated")).get("architecture")
    return {**family_facts(architecture, modality), **config_facts(checkpoint)}


def _refit_heads(results_dir: Any, checkpoint: Path) -> dict[str, str] | None:
    """{task: head folder} of `<results>/refit_heads/<checkpoint name>/`, when its fitted_on.json
    records this checkpoint's weights (else None: no heads, or heads of other weights)."""
    if not results_dir:
        return None
    folder = Path(results_dir) / "refit_heads" / checkpoint.name
    try:
        fitted = json.loads((folder / FITTED_ON).read_text(encoding="utf-8")).get("weights")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(fitted, dict) or not fitted:
        return None
    for name, digest in fitted.items():
        path = checkpoint / str(name)
        if not path.is_file() or sha256_file(path) != digest:
            return None
    heads = {
        p.name: str(p) for p in sorted(folder.iterdir()) if (p / "classifier.safetensors").is_file()
    }
    return heads or None


def render_model_card(
    *,
    title: str,
    recipe: Mapping[str, Any],
    inputs: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    heads: Mapping[str, str] | None = None,
    model_name: str | None = None,
    datasets: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """The model card's text (see `write_model_card` for the arguments)."""
    base = as_dict(inputs.get("base"))
    experts = as_dict(inputs.get("experts"))
    sets = as_dict(inputs.get("calibration_sets"))
    merge = as_dict(recipe.get("merge"))
    featcal = as_dict(recipe.get("featcal"))
    model = as_dict(model)
    if evaluation is None and metrics and _nested(metrics):  # evaluation.json passed as metrics
        evaluation, metrics = metrics, None
    table = accuracy_table(evaluation)
    own = "calibrated" if featcal else "merged"
    data = card_data(
        inputs=inputs,
        recipe=recipe,
        model=model,
        results=eval_results(table, own, model.get("modality"), datasets, evaluation)
        if table
        else [],
        model_name=" ".join(str(model_name or title).split()),
    )

    lines = [f"# {' '.join(str(title).split())}", ""]
    method = merge.get("method")
    made = (
        f"{len(experts)} fine-tuned task expert{'s' if len(experts) != 1 else ''}"
        if experts
        else "fine-tuned task experts"
    )
    made = f"This checkpoint merges {made} into one model"
    made += f" with `{method}`" if method else ""
    if featcal:
        made += (
            ", then repairs the merge with FeatCal, a closed-form, block-by-block calibration of "
            "the merged model's features towards each expert's"
        )
    lines += [f"{made}.", ""]
    lines += [
        "Every input below is listed with the sha256 recorded when the model was built; "
        "`featcal lineage <this directory>` checks them against the files on disk.",
        "",
    ]
    lines += _usage_section(model, heads)
    if table:
        assert evaluation is not None  # a table comes from an evaluation (accuracy_table)
        lines += _results_section(table, evaluation, own, datasets)

    lines += ["## How it was made", ""]
    step = 1
    if merge:
        lines.append(f"{step}. **Merge** with `{method or DASH}`.")
        lines.append("")
        hp = as_dict(merge.get("hyperparameters"))
        rows = [[_cell(k), _cell(v)] for k, v in hp.items()]
        lines += _table(["hyperparameter", "value"], rows) if rows else []
        step += 1
    if featcal:
        lines.append(f"{step}. **FeatCal calibration** of the merged model against the experts.")
        lines.append("")
        aliases = {"lambda": "lam", "n_per_task": "num_per_task"}
        values = {aliases.get(k, k): v for k, v in featcal.items()}
        rows = [[label, _cell(values.pop(key))] for key, label in _FEATCAL_LABELS if key in values]
        rows += [[_cell(k), _cell(v)] for k, v in values.items()]
        lines += _table(["setting", "value"], rows)
    else:
        lines += ["FeatCal calibration: not applied.", ""]
    other = {k: v for k, v in recipe.items() if k not in ("merge", "featcal")}
    if other:
        lines += _table(
            ["other setting", "value"], [[_cell(k), _cell(v)] for k, v in other.items()]
        )

    lines += ["## Inputs", "", "### Base model", ""]
    if base:
        facts = [
            [label, _code(base.get(key))]
            for key, label in _CARD_MODEL_FACTS
            if base.get(key) is not None
        ]
        lines += _table(["field", "value"], facts) if facts else []
        lines += _table(
            ["file", "sha256"],
            [[_cell(n), _code(s)] for n, s in as_dict(base.get("sha256")).items()],
        )
    else:
        lines += ["Not recorded.", ""]
    lines += ["### Experts", ""]
    if experts:
        lines += _table(
            ["task", "reference", "revision", "commit"],
            [
                [
                    _cell(task),
                    _code(e.get("reference")),
                    _cell(e.get("revision")),
                    _code(e.get("commit")),
                ]
                for task, e in ((t, as_dict(e)) for t, e in experts.items())
            ],
        )
        lines += _table(
            ["task", "file", "sha256"],
            [
                [_cell(task), _cell(name), _code(sha)]
                for task, e in experts.items()
                for name, sha in as_dict(as_dict(e).get("sha256")).items()
            ],
        )
    else:
        lines += ["Not recorded.", ""]
    lines += ["### Calibration sets", ""] if sets or featcal else []
    if sets:
        rows = []
        for task, entry in sets.items():
            entry = as_dict(entry)
            count = entry.get("n_rows", entry.get("rows"))
            rows.append(
                [
                    _cell(task),
                    _cell(count),
                    _cell(entry.get("rows_available")),
                    _cell(entry.get("seed")),
                    _cell(_with_commit(entry.get("source"), entry.get("source_commit"))),
                    _cell(entry.get("split")),
                    _code(entry.get("digest") or entry.get("tree_sha256")),
                ]
            )
        lines += _table(["task", "rows", "of", "seed", "source", "split", "digest (sha256)"], rows)
    elif featcal:
        lines += ["None (no FeatCal calibration recorded).", ""]

    lines += _license_section(inputs)
    if metrics:
        lines += ["## Metrics", ""]
        lines += _metrics_table(metrics)
    if provenance:
        lines += ["## Provenance", ""]
        lines += _table(
            ["field", "value"],
            [
                [_PROVENANCE_LABELS.get(k, _cell(k)), _code(value_text(v))]
                for k, v in provenance.items()
            ],
        )
    body = "\n".join(lines).rstrip("\n") + "\n"
    front = data.to_yaml(original_order=FRONT_MATTER_ORDER)
    return ModelCard(f"---\n{front}\n---\n\n{body}").content  # parsed and validated


def _write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) through the guarded writer (atomic; in the folder's marker)."""
    write_file(path, text)


def write_model_card(
    checkpoint_dir: str | Path,
    *,
    title: str,
    recipe: Mapping[str, Any],
    inputs: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    heads: Mapping[str, str] | None = None,
    model_name: str | None = None,
    path: str | Path | None = None,
    datasets: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write the Hugging Face model card, `README.md`, next to the weights; returns its path.

    recipe: {"merge": {"method", "hyperparameters"}, "featcal": {"alpha", "rho", "lam", "eps",
    "num_per_task", "seed", ...}} (either may be missing). inputs: {"base": {"reference", "kind",
    "repo_id", "revision", "commit", "sha256": {file: sha256}, "license": {"license",
    "license_name", "license_link"} or a string}, "experts": {task: same}, "calibration_sets":
    {task: {"digest", "n_rows", "rows_available", "seed", "source", "split"}}}. evaluation:
    evaluation.json's {task: {model: {"accuracy", ...}}}: the card's model-index and results
    table (another shape: none, with a warning). metrics: any other {task: {metric: value}} or
    {metric: value} table, shown as is (evaluation.json passed here counts as `evaluation`).
    provenance: {"git_commit", "mlflow_run_id", "prefect_flow_run_id", "dvc_stage", ...}.
    model: the checkpoint's {"architecture", "model_type", "model_class", "modality", "causal"}
    (`model_type` and `model_class` default to what the folder's config.json says: the usage
    snippet loads the class saved there). heads: {task: refit head folder}, shown in the usage
    snippet relative to this folder. model_name: the model-index name (default: the title).
    `model_card_fields(trace(dir))` builds all of them but `datasets` from the records.
    path: where the card goes instead of `checkpoint_dir/README.md` (the DVC report stage's copy;
    the card still describes `checkpoint_dir`, paths relative to it). datasets: {task: {"type",
    "config", "split", "revision"}} of the evaluation data (card_metadata.evaluation_datasets):
    the model-index's datasets.

    The metadata (base_model, license, tags, model-index) follows featcal_core.provenance.
    card_metadata. An existing README.md (the card of an earlier step) is replaced atomically
    through the guarded writer: a folder with a marker gets the card's new sha256 there, so
    `verify_output` still passes.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FeatCalError(
            f"{directory} is not a directory; pass the checkpoint directory the model card "
            "belongs in"
        )
    shown = {str(task): _relative(path, directory) for task, path in as_dict(heads).items()}
    from featcal_core.evaluation.task_heads import WEIGHTS_NAME, has_task_heads, load_task_heads

    if has_task_heads(directory):  # the refit heads travel in the folder: load them from there
        shown = {task: WEIGHTS_NAME for task in load_task_heads(directory)}
    text = render_model_card(
        title=title,
        recipe=recipe,
        inputs=inputs,
        metrics=metrics,
        provenance=provenance,
        evaluation=evaluation,
        model={**config_facts(directory), **as_dict(model)},
        heads=shown or None,
        model_name=model_name,
        datasets=datasets,
    )
    out = directory / CARD_NAME if path is None else Path(path)
    _write_text(out, text)
    log.info("wrote model card %s", out)
    return out


def _relative(path: Any, directory: Path) -> str:
    """`path` relative to `directory` (a card names no absolute local paths where it can)."""
    try:
        return os.path.relpath(Path(path).expanduser().resolve(), directory.resolve())
    except ValueError:  # another drive
        return str(path)
