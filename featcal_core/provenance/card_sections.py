"""Parts of the model card's body (featcal_core.provenance.model_card): markdown tables, the usage
snippet, the evaluation results and the inputs' licenses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from featcal_core.provenance.card_metadata import (
    evaluated_rows,
    index_rows,
    license_fields,
    row_label,
)
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


def _data_section(
    table: Mapping[str, Any],
    evaluation: Mapping[str, Any],
    own: str,
    datasets: Mapping[str, Mapping[str, Any]] | None,
) -> list[str]:
    """Each task's evaluation data: its dataset (`evaluation_datasets`), and the rows the card's
    own model was evaluated on out of the rows its split holds."""
    rows = []
    for task in table:
        dataset = as_dict((datasets or {}).get(task))
        counts = evaluated_rows(evaluation, task, own)
        rows.append(
            [
                _cell(task),
                _code(dataset.get("type")),
                _cell(dataset.get("config")),
                _cell(dataset.get("split")),
                _code(dataset.get("revision")),
                _cell(counts.get("rows_evaluated")),
                _cell(counts.get("rows_in_split")),
            ]
        )
    if all(row[1:] == [DASH] * 6 for row in rows):  # nothing known of any task's data
        return []
    lines = [
        "Evaluation data (the model-index's datasets; rows: those evaluated, of the rows the "
        "split holds, fewer under `evaluation.max_examples_per_task`):",
        "",
    ]
    header = ["task", "dataset", "config", "split", "revision", "rows", "of"]
    return lines + _table(header, rows)


def _results_section(
    table: Mapping[str, Mapping[str, float | None]],
    evaluation: Mapping[str, Any],
    own: str,
    datasets: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Accuracy (%) per task and evaluated model, with the average over tasks; the evaluation
    data of each task; then every metric of evaluation.json."""
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
    lines += _data_section(table, evaluation, own, datasets)
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


#: what the usage snippet feeds the model: a synthetic example the snippet runs on as it stands
_EXAMPLE_IMAGES = 'images = [Image.new("RGB", (224, 224), "gray")]  # your PIL images'
_EXAMPLE_TEXTS = 'texts = ["a first example", "and a second one"]  # your texts'
_FOLDER = 'folder = Path("path/to/this/folder")  # the folder this card is in'


def usage_kind(model: Mapping[str, Any]) -> str:
    """Which snippet loads the checkpoint, by the class its config.json names (`model_type`,
    `model_class`: its `architectures[0]`) and featcal's facts (`causal`, `modality`):
    "causal", "seq2seq" (T5 with its decoder), "t5_encoder", "clip" (a full CLIPModel),
    "clip_vision", "text", "image" or "other"."""
    model_type, model_class = model.get("model_type"), str(model.get("model_class") or "")
    if model.get("causal"):
        return "causal"
    if model_type == "t5":
        return "t5_encoder" if model_class.endswith("EncoderModel") else "seq2seq"
    if model_type == "clip":
        return "clip"
    if model_type == "clip_vision_model":
        return "clip_vision"
    modality = model.get("modality")
    return modality if modality in ("text", "image") else "other"


def _generation_code(loader: str, prompt: str) -> list[str]:
    """Loading a generative model (`loader`: its Auto class) and generating from `prompt`."""
    return [
        "from pathlib import Path",
        "",
        "import torch",
        f"from transformers import {loader}, AutoTokenizer",
        "",
        _FOLDER,
        f"model = {loader}.from_pretrained(folder).eval()",
        "tokenizer = AutoTokenizer.from_pretrained(folder)",
        f'inputs = tokenizer([{json.dumps(prompt)}], return_tensors="pt")',
        "with torch.no_grad():",
        "    output = model.generate(**inputs, max_new_tokens=20)",
        "print(tokenizer.decode(output[0], skip_special_tokens=True))",
    ]


def _feature_code(kind: str, heads: bool) -> list[str]:
    """Loading an encoder and computing `features` (batch, hidden) of a synthetic example."""
    imports = ["import json"] if heads else []
    imports += ["from pathlib import Path", "", "import torch"]
    if kind in ("clip", "clip_vision", "image"):
        imports.append("from PIL import Image")
    imports += ["from safetensors.torch import load_file"] if heads else []
    loader, reader = {
        "clip": ("CLIPModel", "AutoImageProcessor"),
        "clip_vision": ("CLIPVisionModel", "AutoImageProcessor"),
        "image": ("AutoModel", "AutoImageProcessor"),
        "t5_encoder": ("T5EncoderModel", "AutoTokenizer"),
        "text": ("AutoModel", "AutoTokenizer"),
    }.get(kind, ("AutoModel", ""))
    names = ", ".join(sorted(n for n in (loader, reader) if n))
    code = [*imports, f"from transformers import {names}", "", _FOLDER]
    code.append(f"model = {loader}.from_pretrained(folder).eval()")
    if reader == "AutoImageProcessor":
        code += [
            "processor = AutoImageProcessor.from_pretrained(folder)",
            _EXAMPLE_IMAGES,
            "with torch.no_grad():",
            '    inputs = processor(images=images, return_tensors="pt")',
        ]
    elif reader == "AutoTokenizer":
        code += [
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            _EXAMPLE_TEXTS,
            "with torch.no_grad():",
            '    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")',
        ]
    else:
        code += ["with torch.no_grad():  # inputs: what the model's processor makes"]
    if kind == "clip":
        code += [
            "    embeds = model.get_image_features(**inputs)  # transformers 4: the tensor",
            '    features = getattr(embeds, "pooler_output", embeds)  # (batch, projection)',
        ]
    elif kind == "t5_encoder":
        code += [
            "    hidden = model(**inputs).last_hidden_state  # (batch, tokens, hidden)",
            '    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)',
            "    features = (hidden * mask).sum(1) / mask.sum(1)  # (batch, hidden): token mean",
        ]
    else:
        code += ["    features = model(**inputs).pooler_output  # (batch, hidden)"]
    return code


def _features_note(kind: str, prefix: str) -> list[str]:
    """The comment on which features a refit head reads (`prefix`: how the code names its
    entry of the heads' record)."""
    if kind == "clip":
        return [
            f"# {prefix}: clip_image_embeds: `features` above, L2-normalised; pooler_output:",
            "# the vision tower's, model.vision_model(**inputs).pooler_output",
        ]
    return [
        f"# {prefix}: pooler_output (above), or clip_image_embeds: the base CLIP model's",
        "# visual_projection of pooler_output, L2-normalised",
    ]


def _usage_section(model: Mapping[str, Any], heads: Mapping[str, str] | None) -> list[str]:
    """How to load the checkpoint with transformers (the class its config names: `usage_kind`)
    on a synthetic example and, when there are refit heads, score one of them (their paths
    relative to this folder). The snippet runs as it stands once `folder` names this folder."""
    kind = usage_kind(model)
    generative = kind in ("causal", "seq2seq")
    heads = dict(heads or {}) if not generative else {}
    if kind == "causal":
        code = _generation_code("AutoModelForCausalLM", "The merged model")
    elif kind == "seq2seq":
        code = _generation_code("AutoModelForSeq2SeqLM", "a first example")
    else:
        code = _feature_code(kind, bool(heads))
    if heads and set(heads.values()) == {"heads.safetensors"}:  # in this folder (task_heads)
        first = json.dumps(next(iter(heads)))
        code += [
            "",
            "# the refit heads (head calibration), one per task, in this folder:",
            'heads = load_file(folder / "heads.safetensors")  # "<task>.weight", "<task>.bias"',
            'info = json.loads((folder / "heads.json").read_text())["tasks"]',
            f"task = {first}  # one of: {', '.join(heads)}",
            *_features_note(kind, 'info[task]["features"]'),
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
            *_features_note(kind, 'info["features"]'),
            'logits = features @ head["weight"].T + head["bias"]  # (batch, classes)',
            'predicted = [info["labels"][i] for i in logits.argmax(-1).tolist()]',
        ]
    text = "Load it with transformers"
    if heads:
        text += " and score a task with its refit classification head"
    elif generative:
        text += " and generate"
    else:
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
            "config.json in its folder, a Hub model's snapshot), so the card names none: check "
            "the base model's and the experts' own terms before sharing it.",
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
