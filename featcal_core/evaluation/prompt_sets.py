"""Named zero-shot prompt sets (featcal_core/evaluation/prompt_sets.yaml): per dataset, the
templates a CLIP text tower reads and how the dataset's label names become class names.

    names, templates = zero_shot_prompts(["AnnualCrop", "SeaLake"], prompt_set="eurosat")
    # (["annual crop land", "sea or lake"], ("a satellite photo of {}.", ...))

Precedence, one field at a time: the task's own `class_names` / `templates`, then the named set,
then the label feature's names as they are / DEFAULT_TEMPLATES.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from featcal_core.errors import FeatCalError

__all__ = [
    "DEFAULT_TEMPLATES",
    "PromptSet",
    "available",
    "clean_label",
    "named_set",
    "zero_shot_prompts",
]

#: the template of a task that names neither templates nor a prompt set
DEFAULT_TEMPLATES = ("a photo of a {}.",)

DATA_FILE = "prompt_sets.yaml"
FORMAT = "featcal-prompt-sets"


@dataclass(frozen=True)
class PromptSet:
    """templates: each with one "{}"; rename: cleaned lower-case label → class name;
    names_by_id: class names in label order, for label features without (or with numeric) names."""

    name: str
    templates: tuple[str, ...]
    rename: Mapping[str, str] = field(default_factory=dict)
    names_by_id: tuple[str, ...] = ()

    def class_names(
        self,
        label_names: Sequence[str] | None,
        num_classes: int | None = None,
        key: str = "prompt_set",
    ) -> list[str]:
        """One class name per label id from the label feature's names (None: it has none)."""
        numeric = label_names is not None and all(str(n).strip().isdigit() for n in label_names)
        if self.names_by_id and (label_names is None or numeric):
            count = len(label_names) if label_names is not None else num_classes
            if count is not None and count != len(self.names_by_id):
                raise FeatCalError(
                    f"{key}: prompt set {self.name!r} names {len(self.names_by_id)} classes, the "
                    f"evaluation set has {count}; set class_names (one per label) instead"
                )
            return list(self.names_by_id)
        if label_names is None:
            raise FeatCalError(
                f"{key}: the evaluation set's label column has no class names and prompt set "
                f"{self.name!r} gives none; set class_names (one per label)"
            )
        names = []
        for label in label_names:
            cleaned = clean_label(str(label))
            names.append(self.rename.get(cleaned.lower(), cleaned))
        return names


def clean_label(label: str) -> str:
    """A label name as words: "/a/apartment_building/outdoor" → "apartment building outdoor",
    "AnnualCrop" → "annual crop", "Forest" → "forest", "baseball_diamond" → "baseball diamond"; names with spaces
    keep their case ("2012 Tesla Model S")."""
    text = re.sub(r"^/?[a-z]/", "", label.strip())  # SUN397's one-letter folders
    text = " ".join(text.replace("_", " ").replace("/", " ").split())
    if re.fullmatch(r"[A-Za-z]+", text) and re.search(r"[a-z]", text):  # one CamelCase word
        text = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", text).lower()
    return text


@lru_cache(maxsize=1)
def _sets() -> dict[str, PromptSet]:
    import yaml

    text = resources.files("featcal_core.evaluation").joinpath(DATA_FILE).read_text("utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FeatCalError(
            f"featcal_core/evaluation/{DATA_FILE}: not a {FORMAT} file; reinstall featcal"
        )
    sets = {}
    for name, entry in (data.get("sets") or {}).items():
        sets[str(name)] = PromptSet(
            name=str(name),
            templates=tuple(str(t) for t in entry["templates"]),
            rename={str(k).lower(): str(v) for k, v in (entry.get("rename") or {}).items()},
            names_by_id=tuple(str(n) for n in entry.get("names_by_id") or ()),
        )
    return sets


def available() -> list[str]:
    """The prompt sets' names, sorted."""
    return sorted(_sets())


def named_set(name: str, key: str = "prompt_set") -> PromptSet:
    """The set called `name`; a FeatCalError naming `key` and the sets there are otherwise."""
    sets = _sets()
    if name not in sets:
        raise FeatCalError(f"{key}: no prompt set {name!r}; use one of {', '.join(available())}")
    return sets[name]


def zero_shot_prompts(
    label_names: Sequence[str] | None,
    *,
    class_names: Sequence[str] | None = None,
    templates: Sequence[str] | None = None,
    prompt_set: str | None = None,
    num_classes: int | None = None,
    key: str = "tasks",
) -> tuple[list[str], tuple[str, ...]]:
    """(class names, templates) of a zero-shot head. label_names: the evaluation set's label
    feature names (None: it has none); num_classes: its class count where known. `key` prefixes
    the params key in errors (e.g. "tasks.eurosat")."""
    chosen = None if prompt_set is None else named_set(prompt_set, f"{key}.prompt_set")
    if class_names is not None:
        names = [str(n) for n in class_names]
    elif chosen is not None:
        names = chosen.class_names(label_names, num_classes, f"{key}.prompt_set")
    elif label_names:
        names = [str(n) for n in label_names]
    else:
        raise FeatCalError(
            f"{key}.class_names: the evaluation set's label column has no class names; set "
            "class_names (one per label) or a prompt_set for zero-shot evaluation"
        )
    count = num_classes if num_classes is not None else (len(label_names) if label_names else None)
    if class_names is not None and count is not None and len(names) != count:
        raise FeatCalError(
            f"{key}.class_names: {len(names)} names for {count} classes in the evaluation set; "
            "give one name per label, in label order"
        )
    chosen_templates = templates or (chosen.templates if chosen is not None else DEFAULT_TEMPLATES)
    return names, tuple(str(t) for t in chosen_templates)
