"""Prefect task "download-experts": resolve the base and the experts, check the pool, lock it.

The work is in featcal_core.provenance.resolve and featcal_core.provenance.lock; this task only
reads the `models:` section of the params, calls them, and writes the lock file
(`data/models.lock.json` by default), which later steps and DVC use to know exactly which weights
the run used. Network retries happen inside `resolve_model`, so the Prefect task itself does not
retry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import ValidationError

from featcal_core.errors import FeatCalError
from featcal_core.params import ModelsSpec
from featcal_core.params.base import KEY_SUFFIX
from featcal_core.provenance.lock import write_lock
from featcal_core.provenance.resolve import check_pool, resolve_model

log = logging.getLogger(__name__)

DEFAULT_LOCK_PATH = "data/models.lock.json"


def models_spec(models: ModelsSpec | Mapping[str, Any]) -> ModelsSpec:
    """The `models:` section as a ModelsSpec (given as one, or as the plain mapping of the YAML)."""
    if isinstance(models, ModelsSpec):
        return models
    try:
        return ModelsSpec.model_validate(dict(models))
    except ValidationError as exc:
        first = exc.errors()[0]
        # the key below the error's location (featcal_core.params.base._error)
        at = (first.get("ctx") or {}).get(KEY_SUFFIX) or ""
        parts = ("models", *first["loc"], *(at.split(".") if at else ()))
        where = ".".join(str(part) for part in parts)
        raise FeatCalError(f"{where}: {first['msg']}; fix the models section") from None


@task(name="download-experts", retries=0, cache_policy=NO_CACHE)
def download_models(
    models: ModelsSpec | Mapping[str, Any],
    lock_path: str | Path = DEFAULT_LOCK_PATH,
    *,
    cache_dir: str | Path | None = None,
    retries: int = 3,
    import_root: str | Path | None = None,
) -> dict[str, Any]:
    """Resolve `models.base` and every `models.experts.<task>`, check they agree, write the lock.

    open_clip references (`format: open_clip`) are imported into featcal checkpoints below
    `import_root` (None: data/models/open_clip in the working directory), once; an open_clip
    expert without its own open_clip_config.json uses the base's.
    Returns the lock (also written to `lock_path`), with the architecture name under
    "architecture".
    """
    spec = models_spec(models)
    if cache_dir is None and spec.hub_cache is not None:
        cache_dir = Path(spec.hub_cache).expanduser()
    options = {
        "cache_dir": cache_dir,
        "retries": retries,
        "offline": spec.hub_offline,
        "import_root": import_root,
    }
    base = resolve_model(spec.base, "models.base", **options)
    if base.open_clip_source is not None:
        options["base_config"] = base.open_clip_source["config"]
    experts = {
        name: resolve_model(ref, f"models.experts.{name}", **options)
        for name, ref in spec.experts.items()
    }
    architecture = check_pool(base, experts)
    lock = write_lock(lock_path, base, experts, extra={"architecture": architecture})
    log.info(
        "download-experts: %s base and %d expert(s) locked in %s",
        architecture,
        len(experts),
        lock_path,
    )
    return lock
