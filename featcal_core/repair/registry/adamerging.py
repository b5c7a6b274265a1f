"""Layer-wise AdaMerging (Yang et al., ICLR 2024): one Task Arithmetic coefficient per task and
tower tensor, learnt by minimising the entropy of each task's predictions on the unlabeled
calibration inputs; the merged checkpoint is the template of the tensors it does not learn
(featcal_core.repair.adamerging)."""

from __future__ import annotations

from featcal_core.repair import defaults
from featcal_core.repair.registry.base import CommandSpec, Option, Repair, RepairInputs


def run(inputs: RepairInputs) -> dict:
    """AdaMerging into `inputs.out` (the merged model's layout); its record (adamerging.json)."""
    from featcal_core.repair.adamerging import adamerge_checkpoint

    if inputs.base is None:
        raise ValueError("AdaMerging needs the base model folder")
    return adamerge_checkpoint(
        inputs.base,
        inputs.merged,
        inputs.experts,
        inputs.calibration_sets,
        inputs.out,
        steps=inputs.option(REPAIR, "adamerging_steps"),
        lr=inputs.option(REPAIR, "adamerging_lr"),
        init=inputs.option(REPAIR, "adamerging_init"),
        batch_size=inputs.option(REPAIR, "adamerging_batch_size"),
        **inputs.trained(),
    )


def _describe(record: dict) -> str:
    curve = record["entropy"]
    tasks = len(record["heads"])
    return f"adamerging for {tasks} tasks: entropy {curve['first']:.4g} -> {curve['last']:.4g}"


REPAIR = Repair(
    name="adamerging",
    summary="learn merge coefficients by entropy minimisation (AdaMerging baseline)",
    output="checkpoint",
    step="adamerging",
    artifact="calibrated_model",
    run=run,
    options=(
        Option(
            "adamerging_steps",
            "steps",
            defaults.ADAMERGING_STEPS,
            ge=1,
            help="AdaMerging's Adam steps, all tasks per step (the paper's)",
        ),
        Option(
            "adamerging_lr",
            "lr",
            defaults.ADAMERGING_LR,
            gt=0.0,
            help="AdaMerging's learning rate (the paper's)",
        ),
        Option(
            "adamerging_init",
            "init",
            defaults.ADAMERGING_INIT,
            ge=0.0,
            le=1.0,
            help="AdaMerging's initial coefficients λ of every task and tensor (the paper's)",
        ),
        Option(
            "adamerging_batch_size",
            "adamerging-batch-size",
            defaults.ADAMERGING_BATCH,
            ge=1,
            in_params=False,
            help="calibration rows per task per Adam step",
        ),
    ),
    settings=("num_per_task", "batch_size", "device"),
    needs_heads=True,
    classification_only=True,
    command=CommandSpec(
        merged="merged model directory (the template of the tensors not learnt)",
        out="output checkpoint folder",
        base="base model directory (task vectors are expert − base)",
        expert="expert with its classification head (classifier.safetensors or a "
        "*ForSequenceClassification model)",
    ),
    describe=_describe,
)
