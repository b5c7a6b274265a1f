"""The merged model's own card (`README.md` beside the weights `featcal merge` writes).

A Hugging Face model card (featcal_core.provenance.model_card) built from the merge record
(merge.json) and the base's config.json only: the recipe (method, hyperparameters, featcal
version), the base and every expert (a Hub model's id, revision and commit; a local folder's
path) with the sha256 of each weight file, the license the inputs state, and how to load the
model (the usage snippet for the class its config names). Its metadata: `base_model` (the
inputs' Hub ids) with `base_model_relation: merge`, `tags` (featcal, merge, model-merging, the
method, the architecture, the model_type) and `library_name: transformers`. Nothing in it depends
on whether the inputs came from the Hub online or from the Hugging Face cache offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.provenance.card_metadata import read_license
from featcal_core.provenance.model_card import config_facts, family_facts, render_model_card
from featcal_core.provenance.text import as_dict

__all__ = ["merge_card"]

#: what the card shows of an input, beside its sha256 and license
_SOURCE_KEYS = ("kind", "repo_id", "revision", "commit")


def _input(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An input of the merge record as the card's inputs name it: its reference (a Hub model's
    as given, else its folder), kind, Hub id, revision, commit, sha256 and stated license."""
    out: dict[str, Any] = {"reference": entry.get("reference") or entry.get("path")}
    out.update({key: entry[key] for key in _SOURCE_KEYS if entry.get(key) is not None})
    out["sha256"] = dict(as_dict(entry.get("sha256")))
    stated = read_license(entry.get("path"))
    if stated:
        out["license"] = stated
    return out


def merge_card(
    record: Mapping[str, Any], config: Mapping[str, Any], name: str, architecture: str | None
) -> str:
    """The card's text for the merge `record` (merge.json's content) of a model whose config.json
    is `config`, written to a folder called `name`; `architecture`: featcal's name for the
    family (None: unknown)."""
    inputs = as_dict(record.get("inputs"))
    experts = {str(task): _input(as_dict(e)) for task, e in as_dict(inputs.get("experts")).items()}
    method = record.get("method")
    recipe: dict[str, Any] = {
        "merge": {
            "method": method,
            "hyperparameters": dict(as_dict(record.get("hyperparameters"))),
        },
        "featcal version": record.get("featcal_version"),
    }
    count = f"{len(experts)} expert{'' if len(experts) == 1 else 's'}"
    return render_model_card(
        title=f"{name}: {method} merge of {count}",
        recipe=recipe,
        inputs={"base": _input(as_dict(inputs.get("base"))), "experts": experts},
        model={**family_facts(architecture), **config_facts(config)},
        model_name=Path(name).name,
    )
