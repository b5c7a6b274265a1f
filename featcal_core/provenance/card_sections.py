"""Parts of the model card's body (featcal_core.provenance.model_card): markdown tables, the usage
snippet, the evaluation results and the inputs' licenses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from featcal_core.provenance.card_metadata import index_rows, license_fields, row_label
from featcal_core.provenance.text import DASH, as_dict, metric_text, value_text
from featcal_core.report.figures import headline_lines, summary_figures

_METRIC_ORDER = ("accuracy", "normalized", "loss", "examples")


def _cell(value: Any) -> str:
    text = value_text(value) if not isinstance(value, str) else value
    return " ".join(text.split()).replace("|", "\\|") or DASH


def _code(value: Any) -> str:
    return f"`{value}`" if isinstance(value, str) and value and "`" not in value else _cell(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _nested(metrics: Mapping[str, Any]) -> bool:
    """True for evaluation.json's shape: {task: {model: {metric: value}}}."""
    return all(
        isinstance(row, Mapping) and row and all(isinstance(v, Mapping) for v in row.values())
        for row in metrics.values()
    )


def _metrics_table(metrics: Mapping[str, Any]) -> list[str]:
    """{task: {model: {metric: v}}} (evaluation.json), {task: {metric: v}} or {metric: v}."""
    if metrics and _nested(metrics):
        names = list(
            dict.fromkeys(key for row in metrics.values() for res in row.values() for key in res)
        )
        names = [n for n in _METRIC_ORDER if n in names] + [
            n for n in names if n not in _METRIC_ORDER
        ]
        rows = [
            [_cell(task), _cell(model)] + [metric_text(as_dict(res).get(n)) for n in names]
            for task, row in metrics.items()
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


# ------------------------------------------------------------------------------------ results


def _pct(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.1f}"


def _results_section(
    table: Mapping[str, Mapping[str, float | None]], evaluation: Mapping[str, Any], own: str
) -> list[str]:
    """Accuracy (%) per task and evaluated model, with the average over tasks; then every
    metric of evaluation.json."""
    names = list(dict.fromkeys(name for row in table.values() for name in row))
    indexed = ", ".join(f"{row_label(row)}" for row, _ in index_rows(own))
    lines = [
        "## Evaluation results",
        "",
        "Accuracy (%) on each task's evaluation split, as `featcal evaluate` recorded it "
        f"(evaluation.json). The card's `model-index` holds the accuracies of {indexed} "
        '(as fractions, where evaluated). "+ refit heads": the same tower with the task\'s '
        "head refit by head calibration (`featcal heads`).",
        "",
    ]
    figures = summary_figures(evaluation)  # the averages every surface shows
    rows = [[_cell(task)] + [_pct(row.get(n)) for n in names] for task, row in table.items()]
    average = []
    for name in names:
        found = figures.accuracy.get(name)
        value = None if found is None else found.value
        average.append(DASH if value is None else f"**{_pct(value)}**")
    rows.append(["**average**", *average])
    lines += _table(["task", *(_cell(row_label(n)) for n in names)], rows)
    headline = headline_lines(figures)
    if headline:
        lines += [
            "Summary over the tasks (the figures the run's report, metrics.json and MLflow run "
            "show; docs/pipeline.md, the summary figures):",
            "",
        ]
        lines += [f"- {_cell(line)}" for line in headline] + [""]
    lines += ["### All metrics", ""]
    lines += _metrics_table(evaluation)
    return lines


# -------------------------------------------------------------------------------------- usage


def _usage_section(model: Mapping[str, Any], heads: Mapping[str, str] | None) -> list[str]:
    """How to load the checkpoint with transformers and, when there are refit heads, one of
    them (their paths relative to this folder)."""
    causal, modality = bool(model.get("causal")), model.get("modality")
    heads = dict(heads or {}) if not causal else {}
    if causal:
        code = [
            "from pathlib import Path",
            "",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'folder = Path("path/to/this/folder")  # the folder this card is in',
            "model = AutoModelForCausalLM.from_pretrained(folder).eval()",
            "tokenizer = AutoTokenizer.from_pretrained(folder)  # or the base model's",
        ]
    else:
        reader = {"image": "AutoImageProcessor", "text": "AutoTokenizer"}.get(modality or "")
        code = ["import json"] if heads else []
        code += ["from pathlib import Path", "", "import torch"]
        code += ["from safetensors.torch import load_file"] if heads else []
        code += [f"from transformers import {reader + ', ' if reader else ''}AutoModel", ""]
        code += [
            'folder = Path("path/to/this/folder")  # the folder this card is in',
            "model = AutoModel.from_pretrained(folder).eval()",
        ]
        if modality == "image":
            code += [
                "processor = AutoImageProcessor.from_pretrained(folder)",
                "with torch.no_grad():  # images: a list of PIL images",
                '    inputs = processor(images=images, return_tensors="pt")',
            ]
        elif modality == "text":
            code += [
                "tokenizer = AutoTokenizer.from_pretrained(folder)",
                "with torch.no_grad():  # texts: a list of strings",
                '    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")',
            ]
        else:
            code += ["with torch.no_grad():  # inputs: what the model's processor makes"]
        code += ["    features = model(**inputs).pooler_output  # (batch, hidden)"]
    if heads and set(heads.values()) == {"heads.safetensors"}:  # in this folder (task_heads)
        first = json.dumps(next(iter(heads)))
        code += [
            "",
            "# the refit heads (head calibration), one per task, in this folder:",
            'heads = load_file(folder / "heads.safetensors")  # "<task>.weight", "<task>.bias"',
            'info = json.loads((folder / "heads.json").read_text())["tasks"]',
            f"task = {first}  # one of: {', '.join(heads)}",
            '# info[task]["features"]: pooler_output (above), or clip_image_embeds: the base '
            "CLIP model's",
            "# visual_projection of pooler_output, L2-normalised",
            'logits = features @ heads[f"{task}.weight"].T + heads[f"{task}.bias"]',
            'predicted = [info[task]["id2label"][str(i)] for i in logits.argmax(-1).tolist()]',
        ]
    elif heads:
        first = json.dumps(next(iter(heads)))
        code += [
            "",
            "# the refit heads (head calibration, `featcal heads`): one per task, "
            "written beside this folder",
            "heads = {",
        ]
        code += [
            f"    {json.dumps(task)}: folder / {json.dumps(path)}," for task, path in heads.items()
        ]
        code += [
            "}",
            f'head = load_file(heads[{first}] / "classifier.safetensors")  # weight, bias',
            f'info = json.loads((heads[{first}] / "classifier.json").read_text())',
            '# info["features"]: pooler_output (above), or clip_image_embeds: the base CLIP '
            "model's",
            "# visual_projection of pooler_output, L2-normalised",
            'logits = features @ head["weight"].T + head["bias"]  # (batch, classes)',
            'predicted = [info["labels"][i] for i in logits.argmax(-1).tolist()]',
        ]
    text = "Load it with transformers"
    if heads:
        text += " and score a task with its refit classification head"
    elif not causal:
        text += " (a merged tower: its features feed each task's own head)"
    return ["## Usage", "", f"{text}:", "", "```python", *code, "```", ""]


# ------------------------------------------------------------------------------------ license


def _license_text(stated: Mapping[str, str] | None) -> str:
    if not stated:
        return "not stated (none found in its folder)"
    text = f"`{stated['license']}`"
    if stated.get("license_name"):
        text += f" ({_cell(stated['license_name'])})"
    if stated.get("license_link"):
        text += f", {_cell(stated['license_link'])}"
    return text


def _license_section(inputs: Mapping[str, Any]) -> list[str]:
    """Which license the card states and why; each input's own license when they differ."""
    fields, stated = license_fields(inputs)
    if not stated:
        return []
    lines = ["## License", ""]
    if not fields:
        lines += [
            "No input states a license (read from each input's README.md front matter and "
            "config.json in its folder; a Hub model's README.md is not downloaded), so the card "
            "names none: check the base model's and the experts' own terms before sharing it.",
            "",
        ]
        return lines
    if all(lic == stated[0][1] for _, lic in stated):
        lines += [f"Every input states {_license_text(stated[0][1])}, so this card does too.", ""]
        return lines
    lines += [
        "The merged weights derive from every input below, and their licenses differ (or some "
        "state none), so this card says `other`: each input's own terms apply.",
        "",
    ]
    lines += _table(["input", "license"], [[_cell(n), _license_text(s)] for n, s in stated])
    return lines
