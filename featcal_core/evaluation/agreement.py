"""Label-free scores of a model against a task's expert, on unlabeled inputs (a held-out set in
the calibration-set format: `image` or `text` column, featcal_core.data.calibration_sets).

    expert = head_outputs(expert_dir, head, "selection_sets/mnist")
    scores = agreement_scores(head_outputs(merged_dir, head, "selection_sets/mnist"), expert)

`head_outputs` runs a tower under a head (featcal_core.evaluation.head) without gradients, in
float32, and keeps the head's input features (n, d) and its logits (n, classes).
`agreement_scores` compares two such outputs on the same rows
(featcal_core.evaluation.selection.LABEL_FREE, in this order):
* `agreement`: percent of rows where the model predicts the expert's class (higher is better);
* `drift`: the mean over rows of ‖f_model − f_expert‖² / ‖f_expert‖², the relative squared
  distance of the features the head reads (unitless; lower is better);
* `kl`: the mean over rows of KL(p_expert ‖ p_model), the divergence of the model's class
  probabilities (softmax of the head's logits) from the expert's, in nats (lower is better): a
  graded form of `agreement` that also counts how sure each prediction is.
None reads a label.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.dataset import _load_split
from featcal_core.evaluation.head import Head
from featcal_core.evaluation.input_batches import InputBatches
from featcal_core.precision import autocast

__all__ = ["HeadOutputs", "agreement_scores", "head_outputs"]


@dataclass(frozen=True)
class HeadOutputs:
    """What a model gives under a head on n rows: features (n, d) and logits (n, classes),
    float32."""

    features: torch.Tensor
    logits: torch.Tensor

    @property
    def predictions(self) -> torch.Tensor:
        """The predicted class of each row (n,)."""
        return self.logits.argmax(dim=-1)


@torch.no_grad()
def head_outputs(
    model_dir: str | Path,
    head: Head,
    inputs_dir: str | Path,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    batches: InputBatches | None = None,
    precision: str = "float32",
) -> HeadOutputs:
    """The head's input features and logits of the tower in `model_dir` on every row
    of the unlabeled set `inputs_dir` (a save_to_disk Dataset with an `image` or `text` column).
    `batches`: the preprocessed batches shared with the other models scored on this set;
    `precision`: the tower's forward in "float32" or "bfloat16" (autocast), features float32."""
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
    features, logits = [], []
    batches = batches if batches is not None else InputBatches(0)
    for start in range(0, len(data), batch_size):
        key = (str(inputs_dir), len(data), column, start, batch_size)

        def make(start: int = start) -> dict[str, torch.Tensor]:
            return head.preprocess(data[start : start + batch_size][column])

        prepared = batches.get(key, make)
        with autocast(precision, target):
            found = features_of(**{k: v.to(target) for k, v in prepared.items()}).float()
        features.append(found.cpu())
        logits.append(linear(found).float().cpu())
    return HeadOutputs(torch.cat(features), torch.cat(logits))


def agreement_scores(model: HeadOutputs, expert: HeadOutputs) -> dict[str, float]:
    """{"agreement": percent, "drift": mean relative squared feature distance, "kl": mean
    KL(p_expert ‖ p_model) in nats, "examples": n} of `model` against `expert` on the same rows."""
    for what in ("features", "logits"):
        ours, theirs = getattr(model, what), getattr(expert, what)
        if ours.shape != theirs.shape:
            raise FeatCalError(
                f"model and expert {what} differ in shape ({tuple(ours.shape)} vs "
                f"{tuple(theirs.shape)}); score both on the same rows under the same head"
            )
    agree = (model.predictions == expert.predictions).double().mean()
    reference = expert.features.double()
    distance = (model.features.double() - reference).pow(2).sum(dim=1)
    scale = reference.pow(2).sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    log_expert = torch.log_softmax(expert.logits.double(), dim=-1)
    log_model = torch.log_softmax(model.logits.double(), dim=-1)
    kl = (log_expert.exp() * (log_expert - log_model)).sum(dim=-1)
    return {
        "agreement": 100.0 * float(agree),
        "drift": float((distance / scale).mean()),
        "kl": float(kl.clamp_min(0.0).mean()),
        "examples": int(model.predictions.numel()),
    }
