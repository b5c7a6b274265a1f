"""The report's sections beyond the accuracy table (head calibration, calibration, inputs,
merge, run details), kept abstract (`_Section`) so markdown and HTML render the same content."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from featcal_core.report.figures import summary_figures
from featcal_core.report.tables import (
    DASH,
    _block_means,
    _gap_text,
    _number,
    _pct,
)

_MIB = 1024 * 1024


def _value_text(value: Any) -> str:
    """A record value as given: floats by repr (no rounding), containers as JSON."""
    if value is None or isinstance(value, bool | int | float | str):
        return str(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest else DASH


def _duration(seconds: Any) -> str:
    value = _number(seconds)
    if value is None:
        return DASH
    text = f"{value:g} s"
    if value >= 60:
        minutes, rest = divmod(value, 60)
        hours, minutes = divmod(int(minutes), 60)
        text += (
            f" ({hours} h {minutes} min {rest:.0f} s)"
            if hours
            else f" ({minutes} min {rest:.0f} s)"
        )
    return text


def _mib(value: Any) -> str:
    number = _number(value)
    return DASH if number is None else f"{number / _MIB:.1f} MiB"


@dataclass
class _Section:
    """A report section, kept abstract so markdown and HTML render the same content."""

    title: str
    lines: list[str] = field(default_factory=list)  # paragraphs / bullet items (plain text)
    bullets: bool = True
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)


_HEAD_MODELS = ("expert", "merged", "merged_heads", "calibrated", "calibrated_heads")
_HEAD_GAPS = ("calibrated", "merged_heads", "calibrated_heads")


def _heads_section(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> _Section | None:
    """Head calibration (beyond the paper), when the evaluation has "<model>_heads" rows:
    accuracy with the refit heads beside the paper-faithful numbers, and the gap each closes."""
    if not any(
        "merged_heads" in (m or {}) or "calibrated_heads" in (m or {}) for m in evaluation.values()
    ):
        return None
    section = _Section("Head calibration (beyond the paper)")
    section.lines.append(
        "Each task's head refit in closed form on the calibration inputs to reproduce the "
        "expert's logits on the merged (or calibrated) tower; no labels. Gap closed is "
        "(model − merged) / (expert − merged) per task; its average is that of the mean "
        "accuracies, as in the headline."
    )
    header = [
        "task",
        "expert",
        "merged",
        "merged + heads",
        "calibrated",
        "calibrated + heads",
        "gap closed: calibrated",
        "gap closed: merged + heads",
        "gap closed: calibrated + heads",
    ]
    figures = summary_figures(evaluation)  # the per-task gaps and the averages
    table = []
    for task in figures.tasks:
        values = figures.per_task.get(task, {})
        table.append(
            [
                task,
                *(_pct((values.get(m) or {}).get("accuracy")) for m in _HEAD_MODELS),
                *(_gap_text((values.get(m) or {}).get("gap_closed")) for m in _HEAD_GAPS),
            ]
        )
    table.append(
        [
            "average",
            *(_pct(f.value if (f := figures.accuracy.get(m)) else None) for m in _HEAD_MODELS),
            *(_gap_text(f.value if (f := figures.gap_closed.get(m)) else None) for m in _HEAD_GAPS),
        ]
    )
    section.tables.append((header, table))
    return section


def _calibration_section(calibration: Mapping[str, Any] | None) -> _Section:
    section = _Section("Calibration")
    if calibration is None:
        section.lines = ["No calibration record: FeatCal was not run (or its record is missing)."]
        section.bullets = False
        return section
    blocks = calibration.get("blocks") or []
    restored = sum(bool(b.get("restored")) for b in blocks)
    section.lines = [
        f"architecture: {calibration.get('architecture', DASH)}",
        f"blocks: {len(blocks)} ({len(blocks) - restored} computed, {restored} restored)",
        f"wall time: {_duration(calibration.get('wall_seconds'))}",
        f"peak RSS: {_mib(calibration.get('peak_rss_bytes'))}",
    ]
    if _number(calibration.get("peak_device_bytes")):
        section.lines.append(f"peak device memory: {_mib(calibration['peak_device_bytes'])}")
    hp = calibration.get("hyperparameters") or {}
    if hp:
        section.tables.append(
            (["hyperparameter", "value"], [[str(k), _value_text(v)] for k, v in hp.items()])
        )
    means = _block_means(calibration)
    if means:
        section.tables.append(
            (
                ["block", "seconds", "restored", "mean drift before", "mean drift after"],
                [
                    [
                        str(index),
                        _value_text(block.get("seconds")),
                        "yes" if was_restored else "no",
                        DASH if before is None else f"{before:.4g}",
                        DASH if after is None else f"{after:.4g}",
                    ]
                    for (index, before, after, was_restored), block in zip(
                        means, blocks, strict=True
                    )
                ],
            )
        )
    return section


def _model_line(role: str, entry: Mapping[str, Any]) -> str:
    commit = entry.get("commit") or "local"
    files = entry.get("files") or {}
    shas = ", ".join(f"{name} {_short(sha)}" for name, sha in files.items())
    text = f"{role}: {entry.get('reference', DASH)} — commit {commit} — {len(files)} files"
    return text + (f" ({shas})" if shas else "")


def _inputs_section(lock: Mapping[str, Any] | None) -> _Section:
    section = _Section("Inputs")
    if lock is None:
        section.lines = ["No lock file."]
        section.bullets = False
        return section
    if lock.get("base"):
        section.lines.append(_model_line("base", lock["base"]))
    for task, entry in (lock.get("experts") or {}).items():
        section.lines.append(_model_line(f"expert {task}", entry))
    section.lines.append(f"lock digest: {lock.get('lock_digest') or DASH}")
    return section


def _merge_section(merge: Mapping[str, Any] | None) -> _Section:
    section = _Section("Merge")
    if merge is None:
        section.lines = ["No merge record."]
        section.bullets = False
        return section
    section.lines = [f"method: {merge.get('method', DASH)}"]
    hp = merge.get("hyperparameters") or {}
    if hp:
        section.tables.append(
            (["hyperparameter", "value"], [[str(k), _value_text(v)] for k, v in hp.items()])
        )
    return section


def _extra_section(extra: Mapping[str, Any] | None) -> _Section | None:
    if not extra:
        return None
    return _Section(
        "Run details",
        tables=[(["key", "value"], [[str(k), _value_text(v)] for k, v in extra.items()])],
    )
