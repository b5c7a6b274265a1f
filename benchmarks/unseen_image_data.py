"""Three small image-classification tasks the vision zoo never sees, from scikit-image's photos.

Each task is "which photo does this patch come from": square grayscale patches cut from real
photos shipped inside the installed scikit-image (read from its folder with PIL; skimage itself is
never imported), downsampled to 32x32 "L" images. Each is saved as a DatasetDict (`save_to_disk`)
with splits `train` and `test`, columns `image` (datasets.Image) and `label` (ClassLabel):

- `photos`: astronaut, coffee, chelsea, rocket, motorcycle_left (5 classes)
- `scans`: camera, coins, moon, page, text (5 classes)
- `microscopy`: retina, ihc, microaneurysms, cell, hubble_deep_field (5 classes)

Train patches come from the left 60% of each photo's width, test patches from the right 40% (no
patch crosses the border, so the splits never share pixels). Patches are 48 px (smaller only when
a photo is too small for the caps: microaneurysms, 102x102, gets 39 px), cut with the largest
stride giving enough of them, then capped with a seeded rng at 400 train / 150 test per class:
2000 train and 750 test rows per task, 5 balanced classes each, less repeated patches: every
distinct patch is kept once, and a train patch equal to a test patch is dropped (uniform
background in microscopy).

    python benchmarks/unseen_image_data.py --out DIR [--seed 0] [--overwrite]

writes DIR/photos, DIR/scans, DIR/microscopy, ready for
`featcal zoo --dataset TASK=DIR/TASK ... --modality image`.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from featcal_core.zoo.source_files import package_file

logger = logging.getLogger("unseen_image_data")

TASKS = {
    "photos": ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png"),
    "scans": ("camera.png", "coins.png", "moon.png", "page.png", "text.png"),
    "microscopy": (
        "retina.jpg",
        "ihc.png",
        "microaneurysms.png",
        "cell.png",
        "hubble_deep_field.jpg",
    ),
}
PATCH = 48  # patch side in the original photo, pixels (smaller if a region is narrower)
SIDE = 32  # stored image side, pixels
MAX_STRIDE = 24
TRAIN_FRACTION = 0.6  # train from the left 60% of the width, test from the right 40%
CAP = {"train": 400, "test": 150}  # patches per class and split


def read_gray(name: str) -> Image.Image:
    """Grayscale "L" image of skimage/data/`name`; a clear error naming the file otherwise."""
    path = package_file(name, "scikit-image", f"skimage/data/{name}")
    try:
        with Image.open(path) as image:
            return image.convert("L")
    except OSError as exc:
        raise SystemExit(f"cannot read {path} ({name}): {exc}") from None


def corners(width: int, height: int, patch: int, cap: int) -> list[tuple[int, int]]:
    """Top-left corners of patches in a width x height region: largest stride with >= cap
    (cap 0: stride 1)."""
    for stride in range(MAX_STRIDE if cap else 1, 0, -1):
        xs, ys = range(0, width - patch + 1, stride), range(0, height - patch + 1, stride)
        if len(xs) * len(ys) >= cap or stride == 1:
            return [(x, y) for y in ys for x in xs]
    raise AssertionError("unreachable")


def fits(regions: dict[str, tuple[int, int]], height: int, patch: int) -> bool:
    """Whether every split's region holds its cap of patches of side `patch` (stride 1)."""
    return patch == 1 or all(
        len(corners(right - left, height, patch, 0)) >= CAP[split]
        for split, (left, right) in regions.items()
    )


def photo_patches(name: str, rng: np.random.Generator) -> dict[str, list[Image.Image]]:
    """Train and test patches (32x32 "L") of one photo, split spatially, capped per split."""
    image = read_gray(name)
    width, height = image.size
    border = int(width * TRAIN_FRACTION)
    regions = {"train": (0, border), "test": (border, width)}
    patch = next(p for p in range(PATCH, 0, -1) if fits(regions, height, p))
    out = {}
    for split, (left, right) in regions.items():
        found = corners(right - left, height, patch, CAP[split])
        keep = (
            sorted(rng.choice(len(found), CAP[split], replace=False))
            if len(found) > CAP[split]
            else range(len(found))
        )
        out[split] = [
            image.crop((left + x, y, left + x + patch, y + patch)).resize(
                (SIDE, SIDE), Image.BILINEAR
            )
            for x, y in (found[i] for i in keep)
        ]
        if not out[split]:
            raise SystemExit(f"{name}: no {split} patch fits the photo ({width}x{height})")
    logger.info(
        "  %s: %dx%d, patch %d px, %d train, %d test patches",
        name,
        width,
        height,
        patch,
        len(out["train"]),
        len(out["test"]),
    )
    return out


def build_task(files: tuple[str, ...], seed: int):
    """DatasetDict(train, test) of one task: a class per photo, named after the file."""
    import datasets

    names = [Path(f).stem for f in files]
    features = datasets.Features(
        {"image": datasets.Image(mode="L"), "label": datasets.ClassLabel(names=names)}
    )
    rng = np.random.default_rng(seed)
    rows = {"train": {"image": [], "label": []}, "test": {"image": [], "label": []}}
    seen: set[bytes] = (
        set()
    )  # each distinct patch once: test first, so train never holds a test patch
    patches = [photo_patches(name, rng) for name in files]
    for split in ("test", "train"):
        for label, found in enumerate(patches):
            for image in found[split]:
                content = image.tobytes()
                if content not in seen:
                    seen.add(content)
                    rows[split]["image"].append(image)
                    rows[split]["label"].append(label)
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(cols, features=features) for split, cols in rows.items()}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the three datasets")
    parser.add_argument("--seed", type=int, default=0, help="subsampling seed (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing datasets")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import datasets

    datasets.disable_progress_bars()

    existing = [t for t in TASKS if (args.out / t).exists()]
    if existing and not args.overwrite:
        logger.error("%s already exist(s) in %s; pass --overwrite to replace", existing, args.out)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for task, files in TASKS.items():
        logger.info("task %s", task)
        data = build_task(files, args.seed)
        tmp = Path(tempfile.mkdtemp(prefix=f".{task}-", dir=args.out))
        try:
            data.save_to_disk(str(tmp / task))
            target = args.out / task
            if target.exists():
                shutil.rmtree(target)
            (tmp / task).rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        counts = np.bincount(data["train"]["label"]), np.bincount(data["test"]["label"])
        summary.append(
            f"{task}: {len(files)} classes {data['train'].features['label'].names}, "
            f"train {data['train'].num_rows} {counts[0].tolist()}, "
            f"test {data['test'].num_rows} {counts[1].tolist()} -> {target}"
        )
    for line in summary:
        logger.info(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
