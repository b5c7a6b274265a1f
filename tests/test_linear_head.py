"""The on-disk linear classification head next to a vision tower (classifier.safetensors/json)."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    LinearHead,
    has_linear_head,
    load_linear_head,
    save_linear_head,
)

LABELS = ["cat", "dog", "bird"]


@pytest.fixture
def head_dir(tmp_path):
    weight, bias = torch.randn(3, 8), torch.randn(3)
    save_linear_head(tmp_path, weight, bias, LABELS)
    return tmp_path, weight, bias


def _config(directory):
    return json.loads((directory / CONFIG_NAME).read_text())


def _rewrite_config(directory, **changes):
    config = _config(directory)
    config.update(changes)
    (directory / CONFIG_NAME).write_text(json.dumps(config))


def test_round_trip(head_dir):
    directory, weight, bias = head_dir
    assert has_linear_head(directory)
    head = load_linear_head(directory, hidden_size=8)
    assert isinstance(head, LinearHead)
    assert torch.equal(head.weight, weight) and torch.equal(head.bias, bias)
    assert head.weight.dtype == head.bias.dtype == torch.float32
    assert head.labels == LABELS and head.features == "pooler_output"
    assert (head.num_classes, head.hidden_size) == (3, 8)
    features = torch.randn(5, 8)
    assert torch.allclose(head.logits(features), features @ weight.T + bias)
    assert _config(directory) == {
        "format": "featcal-linear-head",
        "version": 1,
        "features": "pooler_output",
        "num_classes": 3,
        "labels": LABELS,
    }
    assert sorted(os.listdir(directory)) == [CONFIG_NAME, WEIGHTS_NAME]  # no temporary files


def test_save_converts_to_float32_and_overwrites(tmp_path):
    save_linear_head(tmp_path, torch.randn(2, 4), torch.randn(2), ["a", "b"])
    weight = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    save_linear_head(tmp_path, weight, torch.zeros(2, dtype=torch.float16), ["x", "y"])
    head = load_linear_head(tmp_path)
    assert head.weight.dtype == torch.float32
    assert torch.equal(head.weight, weight.detach().float())
    assert head.labels == ["x", "y"]


def test_has_linear_head(tmp_path):
    assert not has_linear_head(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{}")
    assert has_linear_head(tmp_path)  # half-present: load_linear_head reports it


@pytest.mark.parametrize(
    ("weight", "bias", "labels", "match"),
    [
        (torch.randn(3), torch.randn(3), LABELS, "2-D"),
        (torch.randn(3, 8), torch.randn(4), LABELS, "bias must have shape"),
        (torch.randn(3, 8), torch.randn(3), ["a", "b"], "2 labels for 3 classes"),
        (torch.randn(3, 8), torch.randn(3), ["a", "a", "b"], "not distinct"),
        (torch.ones(3, 8, dtype=torch.int64), torch.ones(3, dtype=torch.int64), LABELS, "float"),
    ],
)
def test_save_rejects_bad_arguments(tmp_path, weight, bias, labels, match):
    with pytest.raises(FeatCalError, match=match):
        save_linear_head(tmp_path, weight, bias, labels)
    assert not has_linear_head(tmp_path)


@pytest.mark.parametrize("missing", [WEIGHTS_NAME, CONFIG_NAME])
def test_missing_file(head_dir, missing):
    directory, _, _ = head_dir
    (directory / missing).unlink()
    with pytest.raises(FeatCalError, match=f"{missing} is missing.*save_linear_head"):
        load_linear_head(directory)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "something-else"}, "format is 'something-else'"),
        ({"version": 2}, "version 2 is not supported"),
        ({"features": "last_hidden_state"}, "unknown features 'last_hidden_state'"),
        ({"num_classes": 4, "labels": ["a", "b", "c", "d"]}, "3 classes but classifier.json says"),
        ({"num_classes": 2}, "3 labels but num_classes 2"),
        ({"num_classes": "3"}, "num_classes must be a positive integer"),
        ({"labels": "cat dog bird"}, "labels must be a list"),
    ],
)
def test_bad_config(head_dir, changes, match):
    directory, _, _ = head_dir
    _rewrite_config(directory, **changes)
    with pytest.raises(FeatCalError, match=match) as info:
        load_linear_head(directory)
    assert "\n" not in str(info.value)
    assert CONFIG_NAME in str(info.value) or WEIGHTS_NAME in str(info.value)


def test_config_not_json(head_dir):
    directory, _, _ = head_dir
    (directory / CONFIG_NAME).write_text("{not json")
    with pytest.raises(FeatCalError, match="classifier.json is not readable JSON"):
        load_linear_head(directory)
    (directory / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(FeatCalError, match="not a JSON object"):
        load_linear_head(directory)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"weight": torch.randn(3, 8), "bias": torch.randn(3, 1)}, r"are not \(num_classes"),
        ({"weight": torch.randn(24), "bias": torch.randn(3)}, r"are not \(num_classes"),
        ({"weight": torch.randn(3, 8)}, "expected exactly 'weight' and 'bias'"),
        (
            {"weight": torch.randn(3, 8), "bias": torch.randn(3), "extra": torch.zeros(1)},
            "expected exactly 'weight' and 'bias'",
        ),
        ({"weight": torch.ones(3, 8, dtype=torch.int32), "bias": torch.ones(3)}, "float32"),
    ],
)
def test_bad_weights(head_dir, tensors, match):
    directory, _, _ = head_dir
    save_file(tensors, str(directory / WEIGHTS_NAME))
    with pytest.raises(FeatCalError, match=match) as info:
        load_linear_head(directory)
    assert WEIGHTS_NAME in str(info.value)


def test_weights_not_safetensors(head_dir):
    directory, _, _ = head_dir
    (directory / WEIGHTS_NAME).write_bytes(b"\x00garbage")
    with pytest.raises(FeatCalError, match="not a readable safetensors file"):
        load_linear_head(directory)


def test_hidden_size_mismatch(head_dir):
    directory, _, _ = head_dir
    with pytest.raises(FeatCalError, match="hidden size 16"):
        load_linear_head(directory, hidden_size=16)
