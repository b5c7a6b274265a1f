"""The model card (`README.md` beside a calibrated checkpoint): a Hugging Face style card with
the recipe, every input with its digest, the metrics and the provenance, built from `lineage.trace`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import write_file
from featcal_core.provenance.text import DASH, as_dict, metric_text, value_text

__all__ = ["CARD_NAME", "model_card_fields", "render_model_card", "write_model_card"]

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
_METRIC_ORDER = ("accuracy", "normalized", "loss", "examples")
#: what the model card shows of a calibration set
_CARD_SET_KEYS = (
    "digest", "tree_sha256", "n_rows", "rows", "rows_available", "seed", "source", "split",
)  # fmt: skip
#: what the model card shows of the base model, and under which label
_CARD_MODEL_FACTS = (("reference", "reference"), ("kind", "kind"), ("revision", "revision"),
                     ("commit", "commit"))  # fmt: skip
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: the model card written next to the weights
CARD_NAME = "README.md"


def model_card_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `write_model_card` (title, recipe, inputs, metrics, provenance)
    taken from a `trace` result."""
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
    return {
        "title": title,
        "recipe": recipe,
        "inputs": inputs,
        "metrics": chain.get("evaluation") or None,
        "provenance": dict(chain.get("provenance") or {}) or None,
    }


def _cell(value: Any) -> str:
    text = value_text(value) if not isinstance(value, str) else value
    return " ".join(text.split()).replace("|", "\\|") or DASH


def _code(value: Any) -> str:
    return f"`{value}`" if isinstance(value, str) and value and "`" not in value else _cell(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _hub_id(base: Mapping[str, Any]) -> str | None:
    """The base's Hub id (owner/name, no revision), or None for a local model."""
    kind = base.get("kind")
    if kind == "local":
        return None
    for key in ("repo_id", "reference"):
        value = base.get(key)
        if not isinstance(value, str):
            continue
        ident = value.split("@", 1)[0].strip()
        if not _HUB_ID.match(ident) or ".." in ident:
            continue
        if kind == "hub" or key == "repo_id" or not Path(value).expanduser().exists():
            return ident
    return None


def render_model_card(
    *,
    title: str,
    recipe: Mapping[str, Any],
    inputs: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> str:
    """The model card's text (see `write_model_card` for the arguments)."""
    base = as_dict(inputs.get("base"))
    experts = as_dict(inputs.get("experts"))
    sets = as_dict(inputs.get("calibration_sets"))
    merge = as_dict(recipe.get("merge"))
    featcal = as_dict(recipe.get("featcal"))
    hub_id = _hub_id(base)

    lines = ["---", "library_name: transformers", "tags: [featcal, model-merging]"]
    if hub_id:
        lines.append(f"base_model: {hub_id}")
    lines += ["---", "", f"# {' '.join(str(title).split())}", ""]
    method = merge.get("method")
    made = f"{len(experts)} fine-tuned task experts" if experts else "fine-tuned task experts"
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
    lines += ["### Calibration sets", ""]
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
                    _cell(entry.get("source")),
                    _cell(entry.get("split")),
                    _code(entry.get("digest") or entry.get("tree_sha256")),
                ]
            )
        lines += _table(["task", "rows", "of", "seed", "source", "split", "digest (sha256)"], rows)
    else:
        lines += ["None (no FeatCal calibration recorded).", ""]

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
    return "\n".join(lines).rstrip("\n") + "\n"


def _metrics_table(metrics: Mapping[str, Any]) -> list[str]:
    """{task: {model: {metric: v}}} (evaluation.json), {task: {metric: v}} or {metric: v}."""
    rows_nested = {
        task: row
        for task, row in metrics.items()
        if isinstance(row, Mapping) and row and all(isinstance(v, Mapping) for v in row.values())
    }
    if rows_nested and len(rows_nested) == len(metrics):
        names = list(
            dict.fromkeys(
                key for row in rows_nested.values() for res in row.values() for key in res
            )
        )
        names = [n for n in _METRIC_ORDER if n in names] + [
            n for n in names if n not in _METRIC_ORDER
        ]
        rows = [
            [_cell(task), _cell(model)] + [metric_text(as_dict(res).get(n)) for n in names]
            for task, row in rows_nested.items()
            for model, res in row.items()
        ]
        return _table(["task", "model", *names], rows)
    if all(isinstance(row, Mapping) for row in metrics.values()):
        names = list(dict.fromkeys(key for row in metrics.values() for key in row))
        rows = [
            [_cell(task)] + [metric_text(row.get(n)) for n in names]
            for task, row in metrics.items()
        ]
        return _table(["task", *names], rows)
    return _table(["metric", "value"], [[_cell(k), metric_text(v)] for k, v in metrics.items()])


def _write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) through the guarded writer (atomic; registered in the folder's marker)."""
    write_file(path, text)


def write_model_card(
    checkpoint_dir: str | Path,
    *,
    title: str,
    recipe: Mapping[str, Any],
    inputs: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Write a Hugging Face style model card, `README.md`, next to the weights; returns its path.

    recipe: {"merge": {"method", "hyperparameters"}, "featcal": {"alpha", "rho", "lam", "eps",
    "num_per_task", "seed", ...}} (either may be missing). inputs: {"base": {"reference", "kind",
    "repo_id", "revision", "commit", "sha256": {file: sha256}}, "experts": {task: same},
    "calibration_sets": {task: {"digest", "n_rows", "rows_available", "seed", "source",
    "split"}}}. metrics: evaluation.json's {task: {model: {"accuracy", ...}}} (or a flat
    {task: {metric: value}}). provenance: {"git_commit", "mlflow_run_id", "prefect_flow_run_id",
    "dvc_stage", ...}. `model_card_fields(trace(dir))` builds all of them from the records.

    The front matter says library_name transformers, tags featcal and model-merging, and
    base_model when the base is a Hub model. An existing README.md (e.g. the base model's card,
    copied by the merge) is replaced atomically.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FeatCalError(
            f"{directory} is not a directory; pass the checkpoint directory the model card "
            "belongs in"
        )
    text = render_model_card(
        title=title, recipe=recipe, inputs=inputs, metrics=metrics, provenance=provenance
    )
    path = directory / CARD_NAME
    _write_text(path, text)
    log.info("wrote model card %s", path)
    return path
