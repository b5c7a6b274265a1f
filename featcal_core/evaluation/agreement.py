"""Label-free scores of a model against a task's expert, on unlabeled inputs (a held-out set in
the calibration-set format: `image` or `text` column, featcal_core.data.calibration_sets).

    expert = head_outputs(expert_dir, head, "selection_sets/mnist")
    scores = agreement_scores(head_outputs(merged_dir, head, "selection_sets/mnist"), expert)

`head_outputs` runs a tower under a head (featcal_core.evaluation.head) without gradients, in
float32, and keeps the head's input features (n, d) and its predicted classes (n,).
`agreement_scores` compares two such outputs on the same rows:
* `agreement`: percent of rows where the model predicts the expert's class (higher is better);
* `drift`: the mean over rows of ‖f_model − f_expert‖² / ‖f_expert‖², the relative squared
  distance of the features the head reads (unitless; lower is better).
Neither reads a label.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.dataset import _load_split
from featcal_core.evaluation.head import Head

__all__ = ["HeadOutputs", "agreement_scores", "head_outputs"]


@dataclass(frozen=True)
class HeadOutputs:
    """What a model gives under a head on n rows: features (n, d) float32, predictions (n,)."""

    features: torch.Tensor
    predictions: torch.Tensor


@torch.no_grad()
def head_outputs(
    model_dir: str | Path,
    head: Head,
    inputs_dir: str | Path,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> HeadOutputs:
    """The head's input features and predicted classes of the tower in `model_dir` on every row
    of the unlabeled set `inputs_dir` (a save_to_disk Dataset with an `image` or `text` column)."""
    data = _load_split(inputs_dir, None)
    column = head.modality
    if column not in data.column_names:
        raise FeatCalError(
            f"{inputs_dir}: no {column!r} column (has {data.column_names}); pass a held-out set "
            "written by the selection-sets step"
        )
    if len(data) == 0:
        raise FeatCalError(f"{inputs_dir} has no rows; hold out at least one input per task")
    target = torch.device(device)
    features_of, linear = head.layers(model_dir, target)
    features, predictions = [], []
    for start in range(0, len(data), batch_size):
        rows = data[start : start + batch_size][column]
        batch = {k: v.to(target) for k, v in head.preprocess(rows).items()}
        found = features_of(**batch).float()
        features.append(found.cpu())
        predictions.append(linear(found).argmax(dim=-1).cpu())
    return HeadOutputs(torch.cat(features), torch.cat(predictions))


def agreement_scores(model: HeadOutputs, expert: HeadOutputs) -> dict[str, float]:
    """{"agreement": percent, "drift": mean relative squared feature distance, "examples": n}
    of `model` against `expert` on the same rows."""
    if model.features.shape != expert.features.shape:
        raise FeatCalError(
            f"model and expert outputs differ in shape ({tuple(model.features.shape)} vs "
            f"{tuple(expert.features.shape)}); score both on the same rows under the same head"
        )
    agree = (model.predictions == expert.predictions).double().mean()
    reference = expert.features.double()
    distance = (model.features.double() - reference).pow(2).sum(dim=1)
    scale = reference.pow(2).sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    return {
        "agreement": 100.0 * float(agree),
        "drift": float((distance / scale).mean()),
        "examples": int(model.predictions.numel()),
    }
