"""Calibration hygiene by content (featcal_core/data/calibration_hygiene.py, calibration_data.py): a drawn
calibration row whose input is also an evaluation row is refused however the data was copied, and
null or undecodable rows give one FeatCalError line naming the source, row and column. CPU only,
tiny datasets built on the fly."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

import factories
from factories import grey_image, grey_images, save_grey_image_splits
from featcal_core.data import calibration_hygiene
from featcal_core.data.calibration_data import CONTENT_DIGEST, input_digest, load_calibration_set
from featcal_core.data.calibration_sets import RECORD_NAME, draw_calibration_set
from featcal_core.data.source import DataSource
from featcal_core.errors import FeatCalError

N_TRAIN, N_TEST = factories.N_TRAIN, factories.N_TEST
FEATURES = datasets.Features(
    {"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
)
_image, _images = grey_image, grey_images


@pytest.fixture
def image_dir(tmp_path) -> Path:
    """A DatasetDict: train pixel values 0..11, test 100..104 (factories)."""
    return save_grey_image_splits(tmp_path / "src" / "images")


def local(path: Path, **fields) -> DataSource:
    return DataSource(path=str(path), **fields)


def draw(calibration: DataSource, evaluation: DataSource | None, out: Path, n: int = 1000):
    return draw_calibration_set(
        "mnist", calibration, evaluation, out, n, 0, "image", image_column="img"
    )


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(FeatCalError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------ overlap by content


def test_test_split_copy_with_split_null_is_refused(image_dir, tmp_path):
    """The bypass: the test split saved as its own folder (re-encoded as mode L, column renamed,
    labels dropped) and configured with `split: null` names other data but holds test rows."""
    copy = tmp_path / "elsewhere" / "my_train"
    test = datasets.load_from_disk(str(image_dir / "test"))
    grey = [img.convert("L") for img in test["img"]]
    datasets.Dataset.from_dict(
        {"picture": grey}, features=datasets.Features({"picture": datasets.Image()})
    ).save_to_disk(str(copy))
    assert (copy / "state.json").is_file()

    out = tmp_path / "sets" / "mnist"
    message = error_of(
        draw_calibration_set,
        "mnist",
        local(copy),  # split: null
        local(image_dir, split="test", image_column="img"),
        out,
        4,
        0,
        "image",
        image_column="picture",
    )
    assert message.startswith("tasks.mnist.calibration: 4 of the 4 calibration rows")
    assert str(copy) in message and str(image_dir) in message and "split test" in message
    assert "tasks.mnist.evaluation" in message and "draw calibration data from train" in message
    assert not out.exists() and not (tmp_path / "sets").exists()


def test_partial_overlap_is_refused_with_the_count(image_dir, tmp_path, monkeypatch):
    """A train split with two test rows mixed in: refused, counting exactly those two (the
    evaluation rows are streamed in batches; row numbers run across batches)."""
    monkeypatch.setattr(calibration_hygiene, "EVALUATION_BATCH", 2)
    mixed = tmp_path / "mixed"
    datasets.concatenate_datasets([_images(range(N_TRAIN)), _images([103, 101])]).save_to_disk(
        str(mixed)
    )
    message = error_of(draw, local(mixed), local(image_dir, split="test"), tmp_path / "o")
    assert f"2 of the {N_TRAIN + 2} calibration rows" in message
    assert "source row 12 = evaluation row 3" in message
    assert "source row 13 = evaluation row 1" in message
    assert not (tmp_path / "o").exists()
    # drawing only clean rows of the same source passes: the check is on the drawn rows
    record = draw(local(mixed), local(image_dir, split="test"), tmp_path / "o", n=3)
    assert all(i < N_TRAIN for i in record["row_ids"])


def test_text_overlap_is_exact_string(tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    datasets.Dataset.from_dict({"text": ["a b", "c d", "e f", "held"]}).save_to_disk(str(train))
    datasets.Dataset.from_dict({"text": ["held", "Held", "a b "]}).save_to_disk(str(test))
    message = error_of(
        draw_calibration_set, "sst2", local(train), local(test), tmp_path / "o", 10, 0, "text"
    )
    assert "1 of the 4 calibration rows" in message and "source row 3 = evaluation row 0" in message


def test_clean_pair_is_accepted_and_the_check_recorded(image_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    record = draw(local(image_dir, split="train"), local(image_dir, split="test"), out, n=4)
    check = record["evaluation_check"]
    test = datasets.load_from_disk(str(image_dir / "test"))
    expected_rows = hashlib.sha256(b"".join(input_digest(i, "image") for i in test["img"]))
    saved = datasets.load_from_disk(str(out))
    expected_drawn = hashlib.sha256(b"".join(input_digest(i, "image") for i in saved["image"]))
    assert check == {
        "source": f"path {image_dir}, split test",
        "source_identity": ["local", str(image_dir), "test"],
        "split": "test",
        "column": "img",
        "method": CONTENT_DIGEST["image"],
        "rows_checked": N_TEST,
        "rows_digest": expected_rows.hexdigest(),
        "calibration_rows_digest": expected_drawn.hexdigest(),
        "overlap": 0,
    }
    assert json.loads((out / RECORD_NAME).read_text())["evaluation_check"] == check
    # the set's data files (and so its digest) do not depend on the evaluation source
    assert (
        draw(local(image_dir, split="train"), None, tmp_path / "n", n=4)["digest"]
        == (record["digest"])
    )
    assert json.loads((tmp_path / "n" / RECORD_NAME).read_text())["evaluation_check"] is None


def test_image_digest_is_content_not_encoding():
    png = io.BytesIO()
    _image(7, "L").save(png, format="PNG", compress_level=9)
    assert input_digest(Image.open(png), "image") == input_digest(_image(7), "image")
    assert input_digest(_image(7), "image") != input_digest(_image(8), "image")
    assert input_digest("x", "text") != input_digest("x ", "text")


def test_unloadable_evaluation_source_is_refused(image_dir, tmp_path):
    message = error_of(
        draw, local(image_dir, split="train"), local(tmp_path / "nowhere"), tmp_path / "o"
    )
    assert "tasks.mnist.evaluation.path" in message and "does not exist" in message


# ------------------------------------------------------------------------------ corrupt rows


def _with_null_image(path: Path, row: int) -> Path:
    images = [_image(v) for v in range(6)]
    images[row] = None
    datasets.Dataset.from_dict({"img": images, "label": [0] * 6}, features=FEATURES).save_to_disk(
        str(path)
    )
    return path


def test_null_image_while_drawing_names_the_row(image_dir, tmp_path):
    src = _with_null_image(tmp_path / "holes", row=3)
    message = error_of(draw, local(src), local(image_dir, split="test"), tmp_path / "o")
    assert message == (
        f"tasks.mnist.calibration: path {src}: source row 3, column 'img' holds no image (null); "
        "drop or repair that row in the source (e.g. Dataset.filter) and draw again"
    )
    assert not (tmp_path / "o").exists()


def test_null_image_in_evaluation_names_the_row(image_dir, tmp_path):
    src = _with_null_image(tmp_path / "holes", row=4)
    message = error_of(draw, local(image_dir, split="train"), local(src), tmp_path / "o")
    assert f"tasks.mnist.evaluation: path {src}: row 4, column 'img' holds no image" in message


def test_undecodable_image_names_the_row(image_dir, tmp_path):
    src = tmp_path / "garbage"
    datasets.Dataset.from_dict(
        {"img": [_image(1), {"bytes": b"not an image", "path": None}]},
        features=datasets.Features({"img": datasets.Image()}),
    ).save_to_disk(str(src))
    message = error_of(draw, local(src), local(image_dir, split="test"), tmp_path / "o")
    assert "source row 1, column 'img' holds an undecodable image" in message
    assert " at 0x" not in message  # no object addresses: the same input, the same message


def test_null_image_when_loading_a_set(tmp_path):
    """A set written by hand (or edited after drawing) with a null image: one line naming the set,
    the row (and its source row) and the column, not a PIL traceback."""
    path = tmp_path / "calib"
    images = [_image(v) for v in range(4)]
    images[2] = None
    datasets.Dataset.from_dict(
        {"image": images, "source_row": [10, 11, 12, 13]},
        features=datasets.Features(
            {"image": datasets.Image(), "source_row": datasets.Value("int64")}
        ),
    ).save_to_disk(str(path))
    message = error_of(load_calibration_set, "mnist", path, "image", 10, 0)
    assert message.startswith(f"--calib mnist={path}: row 2 (source row 12), column 'image'")
    assert "holds no image (null)" in message and "Dataset.filter" in message
    # rows left out by the seeded sample are not read
    loaded = load_calibration_set("mnist", path, "image", 1, 0)
    assert loaded.indices != [2] and isinstance(loaded.rows[0], Image.Image)


@pytest.mark.parametrize(
    ("texts", "problem"), [(["a", None], "no text (null)"), ([1, 2], "a int, not a string")]
)
def test_bad_text_when_loading_a_set(tmp_path, texts, problem):
    path = tmp_path / "calib"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    message = error_of(load_calibration_set, "sst2", path, "text", 10, 0)
    assert f"--calib sst2={path}: row " in message and f"column 'text' holds {problem}" in message


def test_null_text_while_drawing(tmp_path):
    src = tmp_path / "texts"
    datasets.Dataset.from_dict(
        {"text": ["a", "b", None, "d"], "target": ["x", None, "y", "z"]}
    ).save_to_disk(str(src))
    message = error_of(draw_calibration_set, "t5", local(src), None, tmp_path / "o", 9, 0, "text")
    assert "source row 2, column 'text' holds no text (null)" in message
