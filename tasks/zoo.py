"""Prefect task "build-zoo": build (or reuse) the offline model zoo named by `zoo:` in params.

A thin wrapper over featcal_core.zoo.build; reuse is decided there from the zoo's manifest
(same spec fingerprint and every model present), so this task does not cache by itself.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from featcal_core.zoo.build import build_zoo

log = logging.getLogger(__name__)


@task(name="build-zoo", cache_policy=NO_CACHE)
def build_zoo_task(settings: Any, progress: bool = True) -> dict:
    """The zoo's manifest; `settings` is the params' ZooSettings (preset, dir, seed)."""
    spec = settings.spec()
    manifest = build_zoo(spec, settings.path, progress=progress)
    if manifest.get("skipped"):
        for task_name, reason in manifest["skipped"].items():
            log.warning("zoo %s: task %s left out: %s", spec.name, task_name, reason)
    return manifest
