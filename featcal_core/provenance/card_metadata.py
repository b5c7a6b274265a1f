"""The model card's metadata (its YAML front matter), built with huggingface_hub's
`ModelCardData` and `EvalResult` (the YAML is theirs, never written by hand).

The rules, each applied to what the records say (`model_card.model_card_fields`):

- **base_model**: the Hub id of the base and of every expert, base first, no duplicates. A model
  is a Hub model when the lock records it as kind "hub" (its `repo_id`, else its reference
  without "@revision"), or when no kind is recorded and its reference reads owner/name and is no
  local path. Local models (kind "local": a folder, an open_clip file) are left out: the Hub
  takes only model ids there; the card's Inputs section still lists them with their sha256.
  `base_model_relation: merge` whenever base_model is set (the Hub's relation for a merge).
- **license**: the merged weights derive from every input, so the license comes from the inputs:
  each one's `license` (with `license_name` / `license_link`), read from the front matter of a
  README.md in its folder, else a `license` key of its config.json. All inputs state the same
  one: that one. None states one: no license field (the body says so). Any other case (they
  differ, or some state none): `other`, and the body lists each input's license. A Hub
  model's README.md is fetched with its files (featcal_core.provenance.hub.ALLOW_PATTERNS), so
  its license is read from the same snapshot online and offline.
- **tags**: featcal, merge (a merged model's own card), model-merging, the merge method,
  featcal's architecture name and the checkpoint's transformers `model_type` (when known).
- **library_name**: transformers.
- **model-index** (from an evaluation table, evaluation.json's {task: {row: {"accuracy", ...}}}):
  one result per task (task type image- or text-classification by the checkpoint's modality)
  whose metrics are accuracies: the card's own model (calibrated), the same with the refit heads
  (`calibrated_heads`) when evaluated, and the merged model before FeatCal, each named in
  `metric_name`. In huggingface_hub's terms that is one `EvalResult` per task and row. Its
  dataset (`evaluation_datasets`, from the params' `tasks.<task>.evaluation`): `name` the task,
  `type` the Hub dataset id (a local dataset: its folder's name), `config`, `split`, `revision`
  (the commit the rows came from when known, else the revision asked for), and `args`
  {"rows_evaluated", "rows_in_split"} from the evaluation row (`examples`, `split_rows`): e.g. 48
  of 397 under `evaluation.max_examples_per_task`. A table of any other shape gives no
  model-index.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

__all__ = [
    "FRONT_MATTER_ORDER",
    "ROW_ORDER",
    "accuracy_table",
    "base_models",
    "card_data",
    "card_tags",
    "eval_results",
    "evaluated_rows",
    "evaluation_datasets",
    "hub_id",
    "index_rows",
    "license_fields",
    "read_license",
    "row_label",
]

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LICENSE_KEYS = ("license", "license_name", "license_link")
#: evaluation rows in display order; any other row follows in the order it first appears
ROW_ORDER = ("base", "expert", "merged", "calibrated", "merged_heads", "calibrated_heads")
_TASK_TYPES = {"image": "image-classification", "text": "text-classification"}
#: the front matter's key order (`ModelCardData.to_yaml(original_order=...)`)
FRONT_MATTER_ORDER = [
    "library_name",
    "license",
    "license_name",
    "license_link",
    "base_model",
    "base_model_relation",
    "tags",
]


def hub_id(entry: Mapping[str, Any]) -> str | None:
    """A model's Hub id (owner/name, no revision), or None for a local model."""
    kind = entry.get("kind")
    if kind == "local":
        return None
    for key in ("repo_id", "reference"):
        value = entry.get(key)
        if not isinstance(value, str):
            continue
        ident = value.split("@", 1)[0].strip()
        if not _HUB_ID.match(ident) or ".." in ident:
            continue
        if kind == "hub" or key == "repo_id" or not Path(value).expanduser().exists():
            return ident
    return None


def _models(inputs: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(label, entry) of the base, then of each expert."""
    out = []
    if isinstance(inputs.get("base"), Mapping) and inputs["base"]:
        out.append(("base", inputs["base"]))
    experts = inputs.get("experts")
    for task, entry in experts.items() if isinstance(experts, Mapping) else ():
        if isinstance(entry, Mapping):
            out.append((f"expert {task}", entry))
    return out


def base_models(inputs: Mapping[str, Any]) -> list[str]:
    """The Hub ids of the base and every expert (base first, no duplicates)."""
    found = [hub_id(entry) for _, entry in _models(inputs)]
    return list(dict.fromkeys(ident for ident in found if ident))


# ------------------------------------------------------------------------------------- license


def _has_front_matter(readme: Path) -> bool:
    """Whether a README.md opens with YAML front matter (a card without any holds no license)."""
    try:
        with readme.open("rb") as handle:
            return handle.read(256).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"---")
    except OSError:
        return False


def read_license(directory: str | Path | None) -> dict[str, str] | None:
    """{"license", "license_name"?, "license_link"?} a model folder states: its README.md front
    matter, else config.json's "license"; None when neither does (or the folder is missing)."""
    if not directory:
        return None
    folder = Path(directory)
    readme = folder / "README.md"
    if readme.is_file() and _has_front_matter(readme):
        try:  # a file path: huggingface_hub reads it, no download
            data = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
        except Exception as exc:  # someone else's card: any parse failure means "not stated"
            log.debug("%s: no readable front matter (%s)", readme, exc)
            data = {}
        found = {k: str(data[k]) for k in _LICENSE_KEYS if isinstance(data.get(k), str | int)}
        if found.get("license"):
            return found
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("license") if isinstance(config, dict) else None
    return {"license": value} if isinstance(value, str) and value.strip() else None


def _license_of(entry: Mapping[str, Any]) -> dict[str, str] | None:
    value = entry.get("license")
    if isinstance(value, str) and value.strip():
        return {"license": value.strip()}
    if isinstance(value, Mapping) and value.get("license"):
        return {k: str(value[k]) for k in _LICENSE_KEYS if value.get(k)}
    return None


def license_fields(
    inputs: Mapping[str, Any],
) -> tuple[dict[str, str], list[tuple[str, dict[str, str] | None]]]:
    """(the card's license fields, [(input label, its license or None)]) by the rule above."""
    stated = [(label, _license_of(entry)) for label, entry in _models(inputs)]
    known = [lic for _, lic in stated if lic]
    if not known:
        return {}, stated
    if len(known) == len(stated) and all(lic == known[0] for lic in known):
        return dict(known[0]), stated
    return {"license": "other"}, stated


# ---------------------------------------------------------------------------------------- tags


def _tag(text: Any) -> str:
    return "-".join(str(text).strip().lower().split())


def card_tags(recipe: Mapping[str, Any], model: Mapping[str, Any]) -> list[str]:
    """featcal, merge (a merged model's card: no FeatCal in the recipe), model-merging, the merge
    method, the architecture, the model_type."""
    merge = recipe.get("merge")
    if not isinstance(merge, Mapping):
        merge = {}
    tags = ["featcal", "model-merging"]
    if not recipe.get("featcal"):
        tags.insert(1, "merge")
    for value in (merge.get("method"), model.get("architecture"), model.get("model_type")):
        if isinstance(value, str) and value.strip():
            tags.append(_tag(value))
    return list(dict.fromkeys(tags))


# ---------------------------------------------------------------------------------- evaluation


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def accuracy_table(evaluation: Any) -> dict[str, dict[str, float | None]] | None:
    """{task: {row: accuracy or None}} of an evaluation table ({task: {row: {"accuracy", ...}}}),
    rows in display order; None (with a warning) when `evaluation` has another shape."""
    if evaluation is None:
        return None
    shaped = (
        isinstance(evaluation, Mapping)
        and evaluation
        and all(
            isinstance(row, Mapping) and row and all(isinstance(r, Mapping) for r in row.values())
            for row in evaluation.values()
        )
    )
    if not shaped:
        log.warning(
            "model card: the evaluation table is not {task: {model: {metric: value}}} "
            "(evaluation.json); the card gets no results"
        )
        return None
    names = list(dict.fromkeys(str(m) for row in evaluation.values() for m in row))
    names = [m for m in ROW_ORDER if m in names] + [m for m in names if m not in ROW_ORDER]
    table = {}
    for task, row in evaluation.items():
        by_name = {str(m): r for m, r in row.items()}
        table[str(task)] = {m: _finite((by_name.get(m) or {}).get("accuracy")) for m in names}
    return table


def row_label(row: str) -> str:
    """How the card names an evaluation row ("calibrated_heads": "calibrated + refit heads")."""
    return f"{row[: -len('_heads')]} + refit heads" if row.endswith("_heads") else row


def index_rows(own: str) -> list[tuple[str, str]]:
    """(row, metric name) of the model-index: the card's model, with refit heads, and for a
    calibrated model the merged one before FeatCal."""
    rows = [(own, f"accuracy ({own})"), (f"{own}_heads", f"accuracy ({row_label(own + '_heads')})")]
    if own == "calibrated":
        rows.append(("merged", "accuracy (merged, before FeatCal)"))
    return rows


def _count(value: Any) -> int | None:
    return (
        int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None
    )


def evaluated_rows(evaluation: Any, task: str, row: str) -> dict[str, int]:
    """{"rows_evaluated", "rows_in_split"} of one evaluation row (its `examples` and
    `split_rows`, those recorded)."""
    entry = evaluation.get(task, {}).get(row) if isinstance(evaluation, Mapping) else None
    if not isinstance(entry, Mapping):
        return {}
    counts = {
        "rows_evaluated": _count(entry.get("examples")),
        "rows_in_split": _count(entry.get("split_rows", entry.get("task_rows"))),
    }
    return {key: value for key, value in counts.items() if value is not None}


def _harness_metric(evaluation: Any, task: str, row: str) -> str | None:
    """The lm-eval metric name of an evaluation row scored by lm-evaluation-harness (its
    "evaluator" is "lm-eval <version>"); None for featcal's own evaluations."""
    entry = evaluation.get(task, {}).get(row) if isinstance(evaluation, Mapping) else None
    if not isinstance(entry, Mapping) or not str(entry.get("evaluator", "")).startswith("lm-eval"):
        return None
    return str(entry.get("metric") or "accuracy")


def eval_results(
    table: Mapping[str, Mapping[str, float | None]],
    own: str,
    modality: str | None,
    datasets: Mapping[str, Mapping[str, Any]] | None = None,
    evaluation: Mapping[str, Any] | None = None,
) -> list[EvalResult]:
    """One EvalResult per task and model-index row with a finite accuracy (see `index_rows`);
    its dataset from `datasets` ({task: `evaluation_datasets`' entry}; none: the task's name),
    with the rows of `evaluation`'s row (`evaluated_rows`) as its args."""
    task_type = _TASK_TYPES.get(modality or "", "other")
    results = []
    for task, row in table.items():
        dataset = (datasets or {}).get(task) or {}
        for name, metric in index_rows(own):
            value = row.get(name)
            if value is None:
                continue
            harness = _harness_metric(evaluation, task, name)
            if harness is not None:  # an lm-eval task: named by itself, scored by its metric
                results.append(
                    EvalResult(
                        task_type=task_type,
                        dataset_type=task,
                        dataset_name=task,
                        dataset_args=evaluated_rows(evaluation, task, name) or None,
                        metric_type=harness,
                        metric_value=round(value, 6),
                        metric_name=metric.replace("accuracy", harness, 1),
                    )
                )
                continue
            results.append(
                EvalResult(
                    task_type=task_type,
                    dataset_type=str(dataset.get("type") or task),
                    dataset_name=task,
                    dataset_config=dataset.get("config"),
                    dataset_split=dataset.get("split"),
                    dataset_revision=dataset.get("revision"),
                    dataset_args=evaluated_rows(evaluation, task, name) or None,
                    metric_type="accuracy",
                    metric_value=round(value, 6),
                    metric_name=metric,
                )
            )
    return results


def evaluation_datasets(
    tasks: Mapping[str, Any], data_root: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """{task: {"type", "config", "split", "revision", "source"}} of each task's evaluation source
    (`tasks.<task>.evaluation`, a params DataSource or a mapping): a Hub dataset's id, config,
    split and revision (the commit its saved rows came from, `<data_root>/<task>/`
    EVALUATION_SOURCE, when recorded for this very source; else the revision asked for); a local
    one's folder name and split. Values not known are left out."""
    from featcal_core.data.source import as_data_source
    from featcal_core.provenance.records import EVALUATION_SOURCE

    found: dict[str, dict[str, Any]] = {}
    for task, spec in tasks.items():
        given = spec.get("evaluation") if isinstance(spec, Mapping) else spec.evaluation
        source = as_data_source(given, f"tasks.{task}.evaluation")
        if source.hub is not None:
            entry = {
                "type": source.hub,
                "config": source.config,
                "split": source.split,
                "revision": source.revision,
                "source": source.describe(),
            }
            record = Path(data_root) / str(task) / EVALUATION_SOURCE if data_root else None
            try:
                saved = json.loads(record.read_text(encoding="utf-8")) if record else {}
            except (OSError, ValueError):
                saved = {}
            if (
                isinstance(saved, Mapping)
                and saved.get("identity") == list(source.identity())
                and isinstance(saved.get("commit"), str)
            ):
                entry["revision"] = saved["commit"]
        else:
            assert source.path is not None  # a local source (as_data_source checks it)
            folder = Path(source.path).expanduser()
            entry = {
                "type": folder.name or str(folder),
                "split": source.split,
                "source": source.describe(),
            }
        found[str(task)] = {key: value for key, value in entry.items() if value is not None}
    return found


def card_data(
    *,
    inputs: Mapping[str, Any],
    recipe: Mapping[str, Any],
    model: Mapping[str, Any],
    results: list[EvalResult],
    model_name: str,
) -> ModelCardData:
    """The card's metadata by the rules above (results: `eval_results`; model: the checkpoint's
    {"architecture", "model_type", "modality"})."""
    bases = base_models(inputs)
    licensing: dict[str, Any] = license_fields(inputs)[0]
    extra: dict[str, Any] = {"base_model_relation": "merge"} if bases else {}
    return ModelCardData(
        library_name="transformers",
        base_model=bases or None,
        tags=card_tags(recipe, model),
        eval_results=results or None,
        model_name=model_name if results else None,
        **licensing,
        **extra,
    )
