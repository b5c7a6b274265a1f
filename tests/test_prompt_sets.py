"""Named zero-shot prompt sets (featcal_core/evaluation/prompt_sets.yaml): every set well
formed, label names cleaned and renamed, numeric labels named by id, precedence, clear errors."""

from __future__ import annotations

import pytest

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.prompt_sets import (
    DEFAULT_TEMPLATES,
    available,
    clean_label,
    named_set,
    zero_shot_prompts,
)
from featcal_core.params import TaskSpec

PAPER_TASKS = ["dtd", "eurosat", "gtsrb", "mnist", "resisc45", "stanford-cars", "sun397", "svhn"]


def test_the_paper_tasks_have_sets_whose_templates_pass_the_params_check():
    assert available() == PAPER_TASKS
    for name in available():
        chosen = named_set(name)
        assert len(chosen.templates) >= 2, name
        spec = TaskSpec(
            calibration={"path": "c"},
            evaluation={"path": "e"},
            templates=list(chosen.templates),
            prompt_set=name,
        )
        assert [t.format("\0").count("\0") for t in spec.templates] == [1] * len(spec.templates)
        assert all(key == key.lower() for key in chosen.rename)
    assert len(named_set("gtsrb").names_by_id) == 43


@pytest.mark.parametrize(
    ("label", "words"),
    [
        ("/a/abbey", "abbey"),
        ("a/apartment_building/outdoor", "apartment building outdoor"),
        ("AnnualCrop", "annual crop"),
        ("SeaLake", "sea lake"),
        ("baseball_diamond", "baseball diamond"),
        ("2012 Tesla Model S", "2012 Tesla Model S"),
        ("Mercedes-Benz S-Class Sedan 2012", "Mercedes-Benz S-Class Sedan 2012"),
        ("7", "7"),
    ],
)
def test_clean_label(label, words):
    assert clean_label(label) == words


def test_eurosat_labels_are_renamed_whatever_their_spelling():
    raw = ["AnnualCrop", "Forest", "SeaLake", "annual crop land"]
    names, templates = zero_shot_prompts(raw, prompt_set="eurosat")
    assert names == ["annual crop land", "forest", "sea or lake", "annual crop land"]
    assert templates == named_set("eurosat").templates


def test_numeric_labels_take_the_sets_names_by_id_of_the_same_count():
    codes = [str(i) for i in range(43)]
    names, _ = zero_shot_prompts(codes, prompt_set="gtsrb")
    assert names[0] == "speed limit 20 km/h" and names[14] == "stop" and len(names) == 43
    names, _ = zero_shot_prompts(None, prompt_set="gtsrb", num_classes=43)
    assert len(names) == 43
    with pytest.raises(
        FeatCalError,
        match=r"tasks\.signs\.prompt_set: prompt set 'gtsrb' names "
        r"43 classes, the evaluation set has 10",
    ):
        zero_shot_prompts([str(i) for i in range(10)], prompt_set="gtsrb", key="tasks.signs")
    # digits are names for the digit sets
    assert zero_shot_prompts(codes[:10], prompt_set="mnist")[0] == codes[:10]


def test_precedence_task_fields_then_set_then_labels():
    labels = ["AnnualCrop", "SeaLake"]
    assert zero_shot_prompts(labels, class_names=["a", "b"], prompt_set="eurosat")[0] == ["a", "b"]
    names, templates = zero_shot_prompts(labels, templates=["{}!"], prompt_set="eurosat")
    assert names == ["annual crop land", "sea or lake"] and templates == ("{}!",)
    assert zero_shot_prompts(labels) == (labels, DEFAULT_TEMPLATES)


def test_errors_name_the_key_and_the_fix():
    with pytest.raises(FeatCalError, match=r"tasks\.t\.class_names: 3 names for 2 classes"):
        zero_shot_prompts(["x", "y"], class_names=["a", "b", "c"], key="tasks.t")
    with pytest.raises(
        FeatCalError,
        match=r"tasks\.t\.class_names: .* no class names; set "
        r"class_names .* or a prompt_set",
    ):
        zero_shot_prompts(None, templates=["{}"], key="tasks.t")
    with pytest.raises(
        FeatCalError,
        match=r"tasks\.t\.prompt_set: no prompt set 'cifar'; use one "
        r"of dtd, eurosat",
    ):
        zero_shot_prompts(["x"], prompt_set="cifar", key="tasks.t")


def test_params_refuse_an_unknown_set_and_know_zero_shot():
    with pytest.raises(ValueError, match="no prompt set 'cifar'; use one of dtd"):
        TaskSpec(calibration={"path": "c"}, evaluation={"path": "e"}, prompt_set="cifar")
    plain = TaskSpec(calibration={"path": "c"}, evaluation={"path": "e"})
    named = TaskSpec(calibration={"path": "c"}, evaluation={"path": "e"}, prompt_set="dtd")
    assert (plain.zero_shot, named.zero_shot) == (False, True)
