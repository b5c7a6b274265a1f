"""Validating any classification DatasetDict the zoo reads: a registered source's or a user's own.

`check_dataset` names the first problem (missing split or column, wrong feature type, missing or
out-of-range labels) together with the fix.
"""

from __future__ import annotations

from featcal_core.errors import FeatCalError
from featcal_core.zoo.splitting import SPLITS


def check_dataset(ds, where: str, modality: str) -> None:
    """Raise FeatCalError unless `ds` is a usable classification DatasetDict.

    Needs splits train and test (validation optional), none empty; column `image` (Image
    feature) or `text` (string) per `modality`; an integer or ClassLabel `label` column without
    nulls, with values in 0..num_classes-1 (ClassLabel) or 0..max(train) (integers).
    """
    import datasets
    import pyarrow.compute as pc

    if modality not in ("image", "text"):
        raise FeatCalError(f"{where}: modality must be 'image' or 'text', got {modality!r}")
    if not isinstance(ds, datasets.DatasetDict):
        raise FeatCalError(
            f"{where}: expected a DatasetDict with splits train/test, got {type(ds).__name__}; "
            "fix: save a DatasetDict({'train': ..., 'test': ...}) with save_to_disk"
        )
    missing = [s for s in ("train", "test") if s not in ds]
    if missing:
        raise FeatCalError(
            f"{where}: missing split(s) {missing} (has {sorted(ds)}); fix: save a DatasetDict "
            "with splits 'train' and 'test' (and optionally 'validation')"
        )
    column = "image" if modality == "image" else "text"
    bounds: tuple[int, int] | None = None
    reference = None
    for split in [s for s in SPLITS if s in ds]:
        data = ds[split]
        at = f"{where} [split '{split}']"
        if data.num_rows == 0:
            raise FeatCalError(f"{at}: split is empty; fix: put rows in it or drop the split")
        for name in (column, "label"):
            if name not in data.column_names:
                raise FeatCalError(
                    f"{at}: no column '{name}' (columns {data.column_names}); fix: "
                    f"ds = ds.rename_column(<your column>, '{name}') before save_to_disk"
                )
        feature = data.features[column]
        if modality == "image" and not isinstance(feature, datasets.Image):
            raise FeatCalError(
                f"{at}: column 'image' is {feature}, not an Image feature; "
                "fix: ds = ds.cast_column('image', datasets.Image())"
            )
        if modality == "text":
            if not (
                isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
            ):
                raise FeatCalError(
                    f"{at}: column 'text' is {feature}, not a string; "
                    "fix: ds = ds.cast_column('text', datasets.Value('string'))"
                )
            nulls = data.data.column("text").null_count
            if nulls:
                raise FeatCalError(
                    f"{at}: column 'text' has {nulls} missing values; "
                    "fix: ds = ds.filter(lambda r: r['text'] is not None)"
                )
        label = data.features["label"]
        if isinstance(label, datasets.ClassLabel):
            if reference is not None and isinstance(reference, datasets.ClassLabel):
                if list(label.names) != list(reference.names):
                    raise FeatCalError(
                        f"{at}: column 'label' class names {label.names} differ from train's "
                        f"{reference.names}; fix: cast every split to the same ClassLabel"
                    )
            high = label.num_classes - 1
        elif isinstance(label, datasets.Value) and label.dtype.startswith(("int", "uint")):
            high = None
        else:
            raise FeatCalError(
                f"{at}: column 'label' is {label}, not a ClassLabel or integer; "
                "fix: ds = ds.class_encode_column('label')"
            )
        values = data.data.column("label")
        if values.null_count:
            raise FeatCalError(
                f"{at}: column 'label' has {values.null_count} missing values; "
                "fix: drop those rows or give them a class"
            )
        extremes = pc.min_max(values)
        low, top = int(extremes["min"].as_py()), int(extremes["max"].as_py())
        if high is None:
            high = top if bounds is None else bounds[1]
        if low < 0 or top > high:
            bad = low if low < 0 else top
            raise FeatCalError(
                f"{at}: column 'label' has value {bad} outside 0..{high}"
                + (
                    f" (ClassLabel {label.names})"
                    if isinstance(label, datasets.ClassLabel)
                    else " (integer labels must be 0..max of the train split)"
                )
                + "; fix: relabel those rows or widen the ClassLabel names"
            )
        if split == "train":
            bounds, reference = (0, high), label
            if len(pc.unique(values)) < 2:
                raise FeatCalError(
                    f"{at}: column 'label' holds a single class; fix: a classification task "
                    "needs at least two classes in train"
                )
