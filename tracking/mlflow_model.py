"""A checkpoint folder as an MLflow Model (an MLflow 3 LoggedModel of the run): the pyfunc model of
featcal.tracking.checkpoint_pyfunc, with the folder, every file unchanged, as its `checkpoint`
artifact. `mlflow.search_logged_models` lists it (with the run's params and its step-0 metrics);
`mlflow.pyfunc.load_model("models:/<model id>")` or `("runs:/<run id>/<name>")` loads it back,
`.unwrap_python_model().model` being the transformers model.

The pyfunc flavour rather than `mlflow.transformers`: every family featcal writes loads with
`from_pretrained` of its config's class (CLIP vision tower, full CLIP, BERT, T5 encoder, Llama
causal LM), while `mlflow.transformers` saves a transformers *pipeline*, which needs a pipeline
task and its tokenizer or image processor (a bare CLIP vision tower or T5 encoder has neither
task nor, often, a processor in its folder), rewrites the weights with `save_pretrained` (the
logged files then differ from the ones the lineage digests name) and reads the base model's card
from the Hub. `mlflow` is imported only when logging.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# before MLflow can be imported (every tracking module that imports it sets this); the artifact
# copy's progress bars stay out of featcal's own progress display
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

__all__ = ["log_checkpoint_model", "transformers_model_type"]

#: the pyfunc model's code (MLflow copies the file into the model; importing it would run it)
PYFUNC_CODE = Path(__file__).with_name("checkpoint_pyfunc.py")
#: the checkpoint folder's name among the model's artifacts (the same in PYFUNC_CODE)
CHECKPOINT_ARTIFACT = "checkpoint"
#: what loading the logged model needs (their installed versions are pinned)
_REQUIREMENTS = ("mlflow", "torch", "transformers", "safetensors")


def transformers_model_type(directory: str | Path) -> str | None:
    """The `model_type` of `directory`'s config.json when transformers knows it (a folder that
    `from_pretrained` loads); None for any other folder (no config.json: Surgery's task modules;
    a type transformers lacks: an imported open_clip tower)."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None
    from transformers import CONFIG_MAPPING

    return model_type if model_type in CONFIG_MAPPING else None


def log_checkpoint_model(
    directory: str | Path, *, name: str, run_id: str, experiment_id: str, model_type: str
) -> str:
    """Log the checkpoint folder `directory` as the MLflow Model `name` of run `run_id` in
    experiment `experiment_id` (the store: MLflow's current tracking URI, set by the parent
    run); returns its model id (`models:/<id>` loads it). The LoggedModel carries the run's
    params and `model_type` (the config's, e.g. `clip_vision_model`)."""
    import mlflow
    from mlflow.models import Model

    params = mlflow.MlflowClient().get_run(run_id).data.params
    model = mlflow.initialize_logged_model(
        name=name,
        source_run_id=run_id,
        params=params,
        model_type=model_type,
        experiment_id=experiment_id,
    )
    Model.log(
        artifact_path=None,
        name=name,
        flavor=mlflow.pyfunc,
        run_id=run_id,
        model_id=model.model_id,
        python_model=str(PYFUNC_CODE),
        artifacts={CHECKPOINT_ARTIFACT: str(Path(directory).resolve())},
        pip_requirements=_pinned(),
    )
    return model.model_id


def _pinned() -> list[str]:
    """`name==version` of each installed requirement (a local version label dropped)."""
    pinned = []
    for name in _REQUIREMENTS:
        try:
            pinned.append(f"{name}=={version(name).split('+', 1)[0]}")
        except PackageNotFoundError:
            continue
    return pinned
