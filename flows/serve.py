"""`featcal serve`: run the pipeline on a schedule (cron or interval) as a Prefect deployment.

Prefect's temporary per-process server never fires schedules, so when PREFECT_API_URL is unset this
starts a local `prefect server start` (flows.prefect_server: SQLite in PREFECT_HOME, stopped when
serving ends or `featcal serve` is killed) and points the deployment at it. With PREFECT_API_URL
set, the deployment is served against that server. Each scheduled run executes
`featcal_scheduled_run`, the same pipeline as `featcal run`, with the params file and overrides
given here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from featcal_core.errors import FeatCalError
from flows.environment import configure
from flows.prefect_server import local_server

configure()  # before prefect is imported
from prefect import flow  # noqa: E402

log = logging.getLogger(__name__)

DEPLOYMENT = "featcal-scheduled"


@flow(name="featcal-scheduled-run")
def featcal_scheduled_run(params_path: str, overrides: list[str]) -> dict:
    """One scheduled pipeline run (the deployment's flow; `featcal run` runs as its subflow)."""
    from flows.pipeline import run_from_file

    return run_from_file(params_path, overrides)


def serve(
    params_path: str,
    overrides: list[str],
    *,
    cron: str | None = None,
    interval_s: float | None = None,
) -> None:
    """Serve the pipeline with a cron or interval schedule until interrupted."""
    if (cron is None) == (interval_s is None):
        raise FeatCalError("featcal serve needs exactly one of --cron EXPR or --interval SECONDS")
    from flows.params import load_params

    load_params(params_path, overrides)  # a bad params file fails now, not at the first run
    if os.environ.get("PREFECT_API_URL"):
        _serve(params_path, overrides, cron, interval_s)
        return
    with local_server() as api_url:
        os.environ["PREFECT_API_URL"] = api_url
        _serve(params_path, overrides, cron, interval_s)


def _serve(params_path, overrides, cron, interval_s) -> None:
    parameters = {"params_path": str(Path(params_path).resolve()), "overrides": list(overrides)}
    log.info("serving %s (%s) with %s", DEPLOYMENT, cron or f"every {interval_s} s", parameters)
    featcal_scheduled_run.serve(
        name=DEPLOYMENT,
        cron=cron,
        interval=interval_s,
        parameters=parameters,
        limit=1,  # one run at a time: runs share the results directory
        print_starting_message=True,
    )
