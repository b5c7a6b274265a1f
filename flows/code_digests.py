"""The code each DVC stage runs, as one sha256 per stage (`featcal code-digests`, dvc.yaml's
`code` stage): each stage depends on its digest file, so a change to the modules a stage runs
makes `dvc repro` rerun that stage (and what follows), and a change elsewhere does not. Works for
an installed featcal as for this checkout: the modules are found through the imported packages.
"""

from __future__ import annotations

from pathlib import Path

import featcal_core
from featcal_core.io.outputs import prepare_root, write_file
from featcal_core.provenance.identity import sources_digest

#: the root marker's kind of a digest folder
KIND = "code-digests"

#: what every stage runs: how params.yaml is read and the step runner
COMMON = ("featcal_core/params", "flows/steps.py", "flows/single_step.py")

#: the modules (packages or files) each stage runs, besides COMMON
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "zoo": ("featcal_core/zoo", "featcal_core/data", "tasks/zoo.py"),
    "download": ("featcal_core/provenance", "featcal_core/open_clip", "tasks/download.py"),
    "calib-set": ("featcal_core/data", "featcal_core/architectures", "tasks/calibration_sets.py"),
    "select": (
        "featcal_core",
        "tasks/selection.py",
        "tasks/evaluate.py",
        "tasks/merge.py",
        "tasks/calibration.py",
        "flows/selection.py",
        "flows/variants.py",
        "flows/calibration.py",
    ),
    "merge": (
        "featcal_core/merging",
        "featcal_core/io",
        "featcal_core/architectures",
        "tasks/merge.py",
    ),
    # calibration states depend on all of featcal_core (tasks.calibration.code_version)
    "calibrate": ("featcal_core", "tasks/calibration.py", "flows/calibration.py"),
    "evaluate": (
        "featcal_core/evaluation",
        "featcal_core/architectures",
        "featcal_core/method",
        "tasks/evaluate.py",
        "tasks/heads.py",
    ),
    "report": ("featcal_core/report", "featcal_core/provenance"),
}


def _roots() -> dict[str, Path]:
    import featcal.flows
    import featcal.tasks

    return {
        "featcal_core": Path(featcal_core.__file__).parent,
        "tasks": Path(featcal.tasks.__file__).parent,
        "flows": Path(featcal.flows.__file__).parent,
    }


def _files(name: str, roots: dict[str, Path]) -> list[tuple[str, Path]]:
    top, _, rest = name.partition("/")
    path = roots[top] / rest if rest else roots[top]
    if path.is_dir():
        return [(f"{name}/{p.relative_to(path).as_posix()}", p) for p in path.rglob("*.py")]
    return [(name, path)]


def stage_digest(stage: str) -> str:
    """sha256 over the sources `stage` runs (names relative to their package, then contents)."""
    roots = _roots()
    files = dict(item for name in (*COMMON, *STAGE_CODE[stage]) for item in _files(name, roots))
    return sources_digest(files)


def write_code_digests(folder: str | Path) -> dict[str, str]:
    """Write `<stage>.sha256` for every stage into `folder` (a file is rewritten only when its
    digest changed); returns {stage: digest}."""
    # a new, empty or featcal-marked digest folder only (never /, home, an input or a user's folder)
    folder = prepare_root(folder, kind=KIND, flag="--out")
    digests = {stage: stage_digest(stage) for stage in STAGE_CODE}
    for stage, digest in digests.items():
        path = folder / f"{stage}.sha256"
        text = digest + "\n"
        if not path.is_file() or path.read_text() != text:
            write_file(path, text, flag="--out")
    return digests
