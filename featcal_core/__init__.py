"""featcal_core: streaming FeatCal (closed-form, block-by-block feature calibration of merged
models). A plain library: no Prefect, MLflow or DVC imports.

    from featcal_core import calibrate, FeatCalParams
    record = calibrate(base_dir, merged_dir, {"mnist": expert_dir}, {"mnist": calib_dir}, out_dir)
"""

from featcal_core.block import FeatCalParams
from featcal_core.calibration import calibrate
from featcal_core.errors import FeatCalError

__all__ = ["FeatCalError", "FeatCalParams", "calibrate"]
