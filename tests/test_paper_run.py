"""The shipped paper setting (params/paper-clip-vit-b32.yaml) runs first try, offline, against
stand-ins of its Hub repositories in their real layouts: `featcal check`, then `featcal run` with
only the device and the sizes changed on the command line.

Stand-ins (tiny, built here): openai/clip-vit-base-patch32 as a CLIPModel whose default branch
holds pickled weights only and whose safetensors live in refs/pr/66 (as on the Hub); the eight
tanganke experts as CLIPVisionModel checkpoints with transformers 4.x `vision_model.` keys, in a
Hugging Face hub cache; the eight datasets as parquet repositories (a README with `configs:` and
class names; train and test splits) loaded once split by split as an online run would, which
leaves them in the datasets cache the offline run reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
from PIL import Image
from test_resolve import hub_cache

import factories
from featcal_core.params import load_params

PAPER = Path(__file__).resolve().parents[1] / "params" / "paper-clip-vit-b32.yaml"

#: label names as the stand-in datasets store them (SUN397's folder names, EuroSAT's CamelCase,
#: GTSRB's sign numbers, digits): the prompt sets turn them into class names
LABELS = {
    "sun397": ["/a/abbey", "/b/bedroom", "/a/apartment_building/outdoor"],
    "stanford-cars": ["2012 Tesla Model S", "AM General Hummer SUV 2000"],
    "resisc45": ["airplane", "baseball_diamond", "forest"],
    "eurosat": ["AnnualCrop", "Forest", "SeaLake"],
    "svhn": [str(i) for i in range(10)],
    "gtsrb": [str(i) for i in range(43)],
    "mnist": [str(i) for i in range(10)],
    "dtd": ["banded", "blotchy", "braided"],
}
SIZES = [
    "featcal.device=cpu",
    "featcal.num_per_task=4",
    "featcal.batch_size=4",
    "evaluation.max_examples_per_task=6",
    "evaluation.batch_size=8",
]


def paper_model_cache(paper, root: Path, cache: Path) -> None:
    """Stand-ins of the paper file's models in a Hugging Face hub cache `cache`: the base as a
    tiny CLIPModel with pickled weights only on main and safetensors in refs/pr/66 (as on the
    Hub), each expert a CLIPVisionModel with transformers 4.x `vision_model.` keys."""
    base = factories.tiny_clip_model(root / "clip")
    pickled = root / "pickled"
    pickled.mkdir()
    shutil.copy(base / "config.json", pickled / "config.json")
    for name in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        (pickled / name).write_bytes(b"not read")
    hub_cache(cache, paper.models.base.repo_id, pickled)
    hub_cache(cache, paper.models.base.repo_id, base, ref_name="refs/pr/66", commit="e" * 40)
    experts = factories.vision_experts(base, root / "experts", tuple(paper.models.experts))
    for task, ref in paper.models.experts.items():
        hub_cache(cache, ref.repo_id, experts[task])


def _dataset_cache(cache: Path, layouts: Path, source, labels: list[str], seed: int) -> None:
    """`source`'s repository as parquet files in the Hub's layout, loaded split by split as an
    online `featcal run` does, its rows left in `cache` under the Hub id's name."""
    from datasets.naming import camelcase_to_snakecase

    from featcal_core.data.source_rows import load_hub_split

    owner, name = source.hub.split("/")
    folder_name = camelcase_to_snakecase(name)
    if (cache / f"{owner}___{folder_name}").exists():
        return
    rng = np.random.default_rng(seed)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=labels)}
    )
    rows = {
        split: {
            "image": [
                Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)) for _ in range(8)
            ],
            "label": [int(x) for x in rng.integers(0, len(labels), 8)],
        }
        for split in ("train", "test")
    }
    repo = factories.hub_dataset_repo(
        layouts / folder_name, features, rows, source.config or "default"
    )
    for split in ("train", "test"):
        load_hub_split(str(repo), source.config, split)
    (cache / folder_name).rename(cache / f"{owner}___{folder_name}")


def test_the_paper_setting_checks_and_runs_offline_against_stand_ins(
    tmp_path, monkeypatch, prefect_api
):
    paper = load_params(PAPER)
    hub, data = tmp_path / "hf", tmp_path / "datasets"
    paper_model_cache(paper, tmp_path, hub)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", data)
    for i, (task, spec) in enumerate(paper.tasks.items()):
        assert spec.calibration.hub == spec.evaluation.hub  # one repository: both splits
        _dataset_cache(data, tmp_path / "layouts", spec.calibration, LABELS[task], seed=i)

    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(data),
        "HF_DATASETS_OFFLINE": "1",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": prefect_api,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    user = tmp_path / "user"
    user.mkdir()

    def featcal(*args):
        return subprocess.run(
            [sys.executable, "-m", "featcal_cli.main", *args],
            env=env,
            cwd=user,
            capture_output=True,
            text=True,
            timeout=900,
        )

    checked = featcal("check", "--params", str(PAPER))
    assert checked.returncode == 0, checked.stderr[-3000:]
    # the stand-in datasets are checked by the run, not offline: the headline counts them
    assert "no problems found in what was checked (8 tasks); 16 items not checked" in (
        checked.stdout
    )
    # the legacy one-word id the paper file once had: one line with the id to use, exit 2
    legacy = featcal(
        "check",
        "--params",
        str(PAPER),
        "--set",
        "tasks.svhn.evaluation={hub: svhn, config: cropped_digits, split: test}",
    )
    assert legacy.returncode == 2, legacy.stderr[-2000:]
    errors = [line for line in legacy.stderr.splitlines() if line.startswith("featcal: error:")]
    assert len(errors) == 1 and "'svhn' is a legacy one-word Hub dataset id" in errors[0]
    assert "use 'ufldl-stanford/svhn'" in errors[0]
    ran = featcal(
        "run", "--params", str(PAPER), "--json", *[a for s in SIZES for a in ("--set", s)]
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    # quiet: featcal's lines only, the conversion pull request among them (once)
    lines = ran.stderr.splitlines()
    print(f"featcal run, quiet: {len(lines)} stderr lines")  # the count the docs quote (-s)
    assert all(" featcal" in line for line in lines), "\n".join(lines)
    assert sum("using the safetensors conversion refs/pr/66" in line for line in lines) == 1

    results = user / "data" / "results" / "paper-clip-vit-b32"
    lock = json.loads((results / "models.lock.json").read_text())
    assert lock["base"]["revision"] == "refs/pr/66"
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert sorted(evaluation) == sorted(paper.tasks)
    for rows in evaluation.values():
        assert set(rows) == {"base", "expert", "merged", "calibrated"}
        assert all(row["examples"] == 6 for row in rows.values())
    # the heads read the prompt sets: spelled-out class names, the set's templates
    from safetensors import safe_open

    text = ""
    for path in (results / "heads").rglob("*.safetensors"):
        with safe_open(str(path), "pt") as cached:
            meta = cached.metadata()
        text += " ".join(json.loads(meta["class_names"]) + json.loads(meta["templates"]))
    for words in (
        "annual crop land",
        "sea or lake",
        "apartment building outdoor",
        "speed limit 20 km/h",
        "a satellite photo of {}.",
    ):
        assert words in text, words
    report = (user / "reports" / "paper-clip-vit-b32" / "report.md").read_text()
    assert "The paper's numbers" in report and "evaluation cut short" in report
