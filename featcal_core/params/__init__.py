"""The run configuration (`params.yaml`): schema, loading, validation and command-line overrides.

    params = load_params("params.yaml", ["featcal.alpha=0.3", "tasks.mnist.calibration.split=train"])
    mlflow.log_params(flatten(params))
    key_material = params.calibration_settings()

Every bad input ends in one `FeatCalError` whose single line names the file, the dotted key path and
the fix. Loading is import-light: pydantic and PyYAML only, no torch.

Unknown keys are errors at every level (`extra="forbid"`). Relative paths (local models, local data,
`run.results_dir`) are relative to the working directory the pipeline runs in (the project root),
not to the params file.
"""

from featcal_core.params.export import dump, flatten
from featcal_core.params.loading import featcal_from_flags, load_params, settings_from_flags
from featcal_core.params.models import ModelRef, ModelsSpec
from featcal_core.params.schema import Params
from featcal_core.params.sections import (
    EvaluationSettings,
    FeatCalSettings,
    HarnessSettings,
    MergeSettings,
    RunSettings,
    TrackingSettings,
    ZooSettings,
)
from featcal_core.params.tasks import DataSource, TaskSpec

__all__ = [
    "DataSource",
    "EvaluationSettings",
    "FeatCalSettings",
    "HarnessSettings",
    "MergeSettings",
    "ModelRef",
    "ModelsSpec",
    "Params",
    "RunSettings",
    "TaskSpec",
    "TrackingSettings",
    "ZooSettings",
    "dump",
    "featcal_from_flags",
    "flatten",
    "load_params",
    "settings_from_flags",
]
