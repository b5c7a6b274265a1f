"""Run one pipeline step (the DVC stages' commands, and `featcal merge|calibrate --params`) from
params.yaml: validated params, the run lock, and an MLflow run like the step's in `featcal run`
(featcal.flows.single_step)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: set by `dvc exp run` for its stages' commands: the commit the experiment starts from
BASELINE = "DVC_EXP_BASELINE_REV"


def run_step(step: str, args: argparse.Namespace):
    """Run `featcal.flows.steps.Steps.<step>` for `args.params` / `args.set` and return its result;
    params are validated before any heavy work. Inside `dvc exp run`, what the experiment
    changed in the params file (`-S KEY=VALUE`) counts as the user's `--set` (`experiment_set`)."""
    from featcal_core.params import load_params

    params = load_params(args.params, [*experiment_set(args.params), *args.set])
    if params.evaluation.harness is not None:  # every step of such a run needs lm-eval
        from featcal_core.evaluation.harness import require_lm_eval

        require_lm_eval()
    from featcal.flows.single_step import run_single_step

    return run_single_step(params, step, f"featcal {args.command}")


def experiment_set(params_path: str | Path) -> list[str]:
    """Inside `dvc exp run` (BASELINE set): the keys a `select:` candidate or `compare:` variant
    may set whose values in `params_path` differ from the baseline commit's, as `--set`
    overrides, so that `dvc exp run -S featcal.alpha=0.5` wins over the candidates as `featcal
    run --set featcal.alpha=0.5` does; [] outside an experiment or when git has no baseline file."""
    rev = os.environ.get(BASELINE)
    if not rev:
        return []
    import yaml

    from featcal_core.errors import FeatCalError
    from featcal_core.params.base import load_yaml
    from featcal_core.params.loading import read_params_text

    path = Path(params_path).resolve()
    try:
        shown = subprocess.run(
            ["git", "show", f"{rev}:./{path.name}"],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        before, now = load_yaml(shown.stdout), load_yaml(read_params_text(path, str(path)))
    except (OSError, ValueError, subprocess.SubprocessError, yaml.YAMLError, FeatCalError) as exc:
        log.warning("%s: cannot read the experiment's baseline params (%s)", path, exc)
        return []
    changed = changed_variant_keys(before, now)
    if changed:
        log.info(
            "dvc experiment: %s win over select: candidates and compare: variants",
            " ".join(changed),
        )
    return changed


def changed_variant_keys(before: Any, now: Any) -> list[str]:
    """`KEY=VALUE` (JSON values, which YAML reads) of each key a variant may set whose value in
    the params document `now` differs from `before` (`merge.hyperparameters` whole)."""
    from featcal_core.params.repair import is_variant_key

    def section(doc: Any, name: str) -> dict:
        value = doc.get(name) if isinstance(doc, dict) else None
        return value if isinstance(value, dict) else {}

    found = []
    for name in ("merge", "repair", "featcal"):
        old, new = section(before, name), section(now, name)
        for key in new:
            if is_variant_key(f"{name}.{key}") and (key not in old or old[key] != new[key]):
                found.append(f"{name}.{key}={json.dumps(new[key])}")
    return found
