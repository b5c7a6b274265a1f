"""FeatCal (featcal_core.method): the block-by-block closed-form feature calibration. The flows
run it block by block, resumable (featcal.flows.calibration; `blockwise`); `run` is the same
calibration in one call, for library use. Its hyperparameters α, ρ, λ, ε are the `featcal:`
section's (featcal_core.method.hyperparameters: defaults and bounds)."""

from __future__ import annotations

from dataclasses import asdict

from featcal_core.method.hyperparameters import BOUNDS, DEFAULTS
from featcal_core.repair.registry.base import Option, Repair, RepairInputs

_HELP = {
    "alpha": "teacher interpolation α",
    "rho": "anchor blend ρ",
    "lam": "ridge weight λ",
    "eps": "jitter ε",
}


def run(inputs: RepairInputs) -> dict:
    """FeatCal of `inputs.merged` into `inputs.out`; its record (featcal.json)."""
    from featcal_core.method.calibration import calibrate
    from featcal_core.method.hyperparameters import FeatCalParams

    if inputs.base is None:
        raise ValueError("FeatCal needs the base model folder")
    params = FeatCalParams(**{key: inputs.option(REPAIR, key) for key in DEFAULTS})
    return calibrate(
        inputs.base,
        inputs.merged,
        dict(inputs.experts),
        dict(inputs.calibration_sets),
        inputs.out,
        params,
        **asdict(inputs.settings),
        spill_dir=inputs.spill_dir,
        overwrite=inputs.overwrite,
        progress=inputs.progress,
    )


REPAIR = Repair(
    name="featcal",
    summary="FeatCal: calibrate the merged model's features block by block (closed form)",
    output="checkpoint",
    step="calibrate",
    artifact="calibrated_model",
    run=run,
    options=tuple(
        Option(
            key,
            key,
            DEFAULTS[key],
            ge=BOUNDS[key][0],
            le=BOUNDS[key][1],
            help=_HELP[key],
            section="featcal",
        )
        for key in DEFAULTS
    ),
    blockwise=True,
)
