"""featcal_core: streaming FeatCal (closed-form, block-by-block feature calibration of merged
models). A plain library: no Prefect, MLflow or DVC imports.

    from featcal_core import calibrate, FeatCalParams
    record = calibrate(base_dir, merged_dir, {"mnist": expert_dir}, {"mnist": calib_dir}, out_dir)

`calibrate` and `FeatCalParams` load on first use, so `featcal_core.errors` stays import-light.
"""

from featcal_core.errors import FeatCalError

__all__ = ["FeatCalError", "FeatCalParams", "calibrate"]


def __getattr__(name: str):
    if name == "calibrate":
        from featcal_core.calibration import calibrate

        return calibrate
    if name == "FeatCalParams":
        from featcal_core.block import FeatCalParams

        return FeatCalParams
    raise AttributeError(f"module 'featcal_core' has no attribute {name!r}")
