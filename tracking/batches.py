"""What MLflow accepts, and logging it in batches: keys and values cleaned to MLflow's limits
(long values cut, with their length and digest, never an error), params, tags and metrics sent with
`MlflowClient.log_batch` in batches of MLflow's sizes. `mlflow` is imported only when logging;
MLFLOW_DISABLE_TELEMETRY is set to true (unless set) when this module is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping

# before MLflow can be imported (every tracking module that imports it sets this)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

__all__ = [
    "MAX_TAG_VALUE",
    "batch_metric_steps",
    "batch_metrics",
    "batch_params",
    "batch_tags",
    "clean",
    "now_ms",
]

# MLflow's limits (mlflow.utils.validation); fixed here so that importing stays light.
_MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
_MAX_KEY = 250
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- ]")  # names MLflow accepts on every platform


def now_ms() -> int:
    return int(time.time() * 1000)


def clean(values: Mapping[str, object], limit: int) -> dict[str, str]:
    """Keys MLflow accepts and string values within `limit` characters."""
    return {_key(key): _value(value, limit) for key, value in values.items()}


def _key(key: str) -> str:
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/") or "_"
    key = re.sub(r"/+", "/", key)
    if len(key) > _MAX_KEY:
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        key = f"{key[: _MAX_KEY - 13]}~{digest}"
    return key


def _value(value: object, limit: int) -> str:
    """The value as text (None: "null"); longer than `limit`: cut, with its length and digest."""
    if value is None:
        text = "null"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    suffix = f"...<{len(text)} chars, sha256 {digest}>"
    return text[: limit - len(suffix)] + suffix


def batch_params(client, run_id: str, params: Mapping[str, object]) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in clean(params, _MAX_PARAM_VALUE).items()]
    for start in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + _PARAMS_PER_BATCH])


def batch_tags(client, run_id: str, tags: Mapping[str, object]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(key, value) for key, value in clean(tags, MAX_TAG_VALUE).items()]
    for start in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[start : start + _PARAMS_PER_BATCH])


def batch_metrics(client, run_id: str, metrics: Mapping[str, float]) -> None:
    batch_metric_steps(client, run_id, [(k, v, 0) for k, v in metrics.items()], now_ms())


def batch_metric_steps(
    client, run_id: str, metrics: list[tuple[str, float, int]], now: int
) -> None:
    from mlflow.entities import Metric

    items = [Metric(_key(key), float(value), now, step) for key, value, step in metrics]
    for start in range(0, len(items), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=items[start : start + _METRICS_PER_BATCH])
