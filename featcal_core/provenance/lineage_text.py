"""Lineage as text: a trace (featcal_core.provenance.lineage.trace), one fact a line, as
`featcal lineage PATH` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.provenance.lineage_checks import _short
from featcal_core.provenance.text import DASH, as_dict, metric_text, value_text

__all__ = ["format_trace"]

_KIND_LABELS: dict[str | None, str] = {  # looked up with a trace's kind, if any
    "calibrated": "calibrated checkpoint",
    "merged": "merged checkpoint",
    "results": "results directory",
}


def _pairs(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value_text(value)}" for key, value in values.items()) or DASH


def _row_ids(ids: Any, limit: int = 8) -> str:
    if not isinstance(ids, list):
        return DASH
    shown = ", ".join(str(i) for i in ids[:limit])
    return shown + (f", … ({len(ids)} in all)" if len(ids) > limit else "")


_STATUS: dict[str | None, str] = {"ok": "ok", "changed": "CHANGED", "missing": "MISSING"}


def format_trace(result: Mapping[str, Any]) -> str:
    """The trace as text, one fact a line (what `featcal lineage PATH` prints)."""
    chain = result.get("chain") or {}
    kind = result.get("kind")
    lines = [f"lineage of {result.get('path')} ({_KIND_LABELS.get(kind, kind)})"]
    if chain.get("results_dir"):
        lines.append(f"  results dir      {chain['results_dir']}")
    calibrated = chain.get("calibrated")
    if calibrated:
        lines.append(f"  calibrated       {calibrated['path']}")
        lines.append(f"    record         {calibrated['record']}")
        lines.append(
            f"    FeatCal        {calibrated.get('architecture') or DASH}, "
            f"{calibrated.get('blocks')} blocks ({calibrated.get('restored')} restored)"
        )
        lines.append(f"    settings       {_pairs(calibrated.get('hyperparameters') or {})}")
    merged = chain.get("merged")
    if merged:
        lines.append(f"  merged           {merged['path']}")
        if merged.get("record"):
            lines.append(f"    record         {merged['record']}")
            lines.append(
                f"    method         {merged.get('method') or DASH} "
                f"({_pairs(merged.get('hyperparameters') or {})})"
            )
        lines += _file_lines(merged.get("files") or {})
    models = [("base", chain.get("base"))] + [
        (f"expert {task}", entry) for task, entry in (chain.get("experts") or {}).items()
    ]
    for label, entry in models:
        if not entry:
            continue
        lines.append(f"  {label:<16} {entry.get('reference') or entry['path']}")
        facts = {key: entry.get(key) for key in ("kind", "revision", "commit") if entry.get(key)}
        if facts:
            lines.append(f"    {'':<14} {_pairs(facts)}")
        if entry.get("reference") and entry.get("reference") != entry["path"]:
            lines.append(f"    path           {entry['path']}")
        for other in entry.get("paths", [])[1:]:
            lines.append(f"    also recorded  {other}")
        lines += _file_lines(entry.get("files") or {})
        source = entry.get("open_clip_source")
        if source:
            lines.append(
                f"    imported from  {Path(source.get('path') or '') / (source.get('file') or '')}"
            )
            lines += _file_lines(
                {
                    "(open_clip source)": {
                        "sha256": source.get("sha256"),
                        "status": source.get("status"),
                    }
                }
            )
    lock = chain.get("lock")
    if lock:
        state = "ok" if lock.get("lock_digest_ok") else "EDITED"
        lines.append(f"  lock             {lock['path']}")
        lines.append(f"    lock_digest    {_short(lock.get('lock_digest'))} {state}")
    for task, entry in (chain.get("calibration_sets") or {}).items():
        lines.append(f"  calibration set  {task}: {entry.get('path')}")
        if "n_rows" in entry:
            lines.append(
                f"    rows           {entry.get('n_rows')} of {entry.get('rows_available')}, "
                f"seed {value_text(entry.get('seed'))}, split {value_text(entry.get('split'))}, from "
                f"{entry.get('source')}"
            )
            lines.append(f"    row ids        {_row_ids(entry.get('row_ids'))}")
        if entry.get("indices") is not None:
            lines.append(f"    calibrated on  {len(entry['indices'])} of {entry.get('rows')} rows")
        digest = entry.get("digest") or entry.get("tree_sha256")
        status = _STATUS.get(entry.get("status"), entry.get("status"))
        lines.append(f"    digest         {_short(digest)} {status}")
    evaluation = chain.get("evaluation")
    if isinstance(evaluation, Mapping) and evaluation:
        lines.append("  evaluation (accuracy)")
        for task, row in evaluation.items():
            if isinstance(row, Mapping):
                cells = ", ".join(
                    f"{model} {metric_text(as_dict(res).get('accuracy'))}"
                    for model, res in row.items()
                )
                lines.append(f"    {task:<14} {cells}")
    if chain.get("provenance"):
        lines.append(f"  provenance       {_pairs(chain['provenance'])}")
    for note in result.get("notes") or []:
        lines.append(f"  note: {note}")
    problems = result.get("problems") or []
    verified = result.get("verified") or {}
    if problems:
        lines.append(f"problems ({len(problems)}):")
        lines += [f"  - {p['message']}" for p in problems]
    else:
        lines.append(
            f"all recorded inputs verify ({verified.get('files', 0)} files, "
            f"{verified.get('calibration_sets', 0)} calibration sets)"
        )
    return "\n".join(lines)


def _file_lines(files: Mapping[str, Mapping[str, str]]) -> list[str]:
    return [
        f"    {_STATUS.get(info.get('status'), info.get('status')):<8} {name}  "
        f"sha256 {_short(info.get('sha256'))}"
        for name, info in files.items()
    ]
