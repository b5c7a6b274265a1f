"""Representation Surgery (Yang et al., ICML 2024): one small module per task on the features
that task's head reads from the merged model, trained on the unlabeled calibration inputs to
match the expert's (featcal_core.repair.surgery)."""

from __future__ import annotations

from featcal_core.repair import defaults
from featcal_core.repair.registry.base import CommandSpec, Option, Repair, RepairInputs


def run(inputs: RepairInputs) -> dict:
    """Surgery modules for `inputs.merged` into `inputs.out/<task>/`; its record (surgery.json)."""
    from featcal_core.repair.surgery import train_surgery

    return train_surgery(
        inputs.merged,
        inputs.experts,
        inputs.calibration_sets,
        inputs.out,
        rank=inputs.option(REPAIR, "surgery_rank"),
        steps=inputs.option(REPAIR, "surgery_steps"),
        lr=inputs.option(REPAIR, "surgery_lr"),
        batch_size=inputs.option(REPAIR, "surgery_batch_size"),
        **inputs.trained(),
    )


REPAIR = Repair(
    name="surgery",
    summary="train Representation Surgery modules for a merged model (baseline)",
    output="task_modules",
    step="surgery",
    artifact="surgery_modules",
    run=run,
    options=(
        Option(
            "surgery_rank",
            "rank",
            defaults.SURGERY_RANK,
            ge=1,
            help="Surgery module's rank r (the paper's)",
        ),
        Option(
            "surgery_steps",
            "steps",
            defaults.SURGERY_STEPS,
            ge=1,
            help="Surgery's Adam steps per task (FusionBench's)",
        ),
        Option(
            "surgery_lr",
            "lr",
            defaults.SURGERY_LR,
            gt=0.0,
            help="Surgery's learning rate (the paper's)",
        ),
        Option(
            "surgery_batch_size",
            "surgery-batch-size",
            defaults.SURGERY_BATCH,
            ge=1,
            in_params=False,
            help="calibration rows per Adam step",
        ),
    ),
    settings=("num_per_task", "batch_size", "device"),
    needs_heads=True,
    command=CommandSpec(
        merged="merged model directory (its tower is read)",
        out="output folder (one subfolder per task)",
        base="base model directory: the tokenizer of experts saved without one",
        expert="expert with its classification head (classifier.safetensors or a "
        "*ForSequenceClassification model)",
        base_required=False,
    ),
    describe=lambda record: f"surgery for {len(record['tasks'])} tasks",
)
