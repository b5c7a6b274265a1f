"""featcal_core: streaming FeatCal (closed-form, block-by-block feature calibration of merged
models). A plain library: no Prefect, MLflow or DVC imports.

    from featcal_core import calibrate, FeatCalParams
    record = calibrate(base_dir, merged_dir, {"mnist": expert_dir}, {"mnist": calib_dir}, out_dir)

`calibrate` and `FeatCalParams` load on first use, so `featcal_core.errors` stays import-light.

The folders are the architecture:

    method/         FeatCal itself: statistics, solvers, block, calibration loop, streams, states
    architectures/  one adapter per model family (the registry)
    merging/        one module per merge method (the registry) and the streaming merge
    io/             safetensors and checkpoints, export, the guarded writer, the run lock
    data/           dataset sources, calibration sets, synthetic pools
    evaluation/     classification heads, language-model scoring
    open_clip/      open_clip import and zero-shot heads
    provenance/     model resolution and locks, lineage and model cards
    zoo/            the offline model zoo
    report/         the run report (tables, sections, markdown, HTML, plots)
    errors.py       the one exception type; names.py, memory.py
"""

from featcal_core.errors import FeatCalError

__all__ = ["FeatCalError", "FeatCalParams", "calibrate"]


def __getattr__(name: str):
    if name == "calibrate":
        from featcal_core.method.calibration import calibrate

        return calibrate
    if name == "FeatCalParams":
        from featcal_core.method.hyperparameters import FeatCalParams

        return FeatCalParams
    raise AttributeError(f"module 'featcal_core' has no attribute {name!r}")
