"""RegMean (Jin et al., ICLR 2023) over the block Linears, from the experts' input Grams on the
calibration sets (featcal_core.repair.regmean)."""

from __future__ import annotations

from featcal_core.method.settings import RUN_SETTINGS
from featcal_core.repair import defaults
from featcal_core.repair.registry.base import CommandSpec, Option, Repair, RepairInputs


def run(inputs: RepairInputs) -> dict:
    """RegMean of `inputs.merged` into `inputs.out`; its record (regmean.json)."""
    from featcal_core.repair.regmean import regmean_checkpoint

    if inputs.base is None:
        raise ValueError("RegMean needs the base model folder")
    return regmean_checkpoint(
        inputs.base,
        inputs.merged,
        dict(inputs.experts),
        dict(inputs.calibration_sets),
        inputs.out,
        alpha=inputs.option(REPAIR, "regmean_alpha"),
        pooled_weights=inputs.option(REPAIR, "pooled_weights"),
        settings=inputs.settings,
        spill_dir=inputs.spill_dir,
        overwrite=inputs.overwrite,
        progress=inputs.progress,
    )


REPAIR = Repair(
    name="regmean",
    summary="repair a merged model's block Linears with RegMean (baseline)",
    output="checkpoint",
    step="regmean",
    artifact="calibrated_model",
    run=run,
    options=(
        Option(
            "regmean_alpha",
            "alpha",
            defaults.REGMEAN_ALPHA,
            ge=0.0,
            le=1.0,
            help="RegMean's scale of the Grams' off-diagonal entries, in [0, 1] (1: plain "
            "least squares; FusionBench's default for CLIP)",
        ),
        Option(
            "pooled_weights",
            "pooled-weights",
            False,
            in_params=False,
            help="weigh tokens in the Grams as FeatCal does (0.01 for non-pooled tokens in the "
            "last block) instead of 1 for every real token",
        ),
    ),
    settings=RUN_SETTINGS,
    command=CommandSpec(
        merged="merged model directory (every tensor outside the block Linears is kept)",
        out="output directory (save_pretrained layout)",
        base="base model directory (with its preprocessor)",
        spill_dir=True,
    ),
    describe=lambda record: f"RegMean over {len(record['blocks'])} blocks",
)
