"""Fold the tasks' statistics of one block and solve its modules (docs/featcal.md, "Data flow",
step 3).

`fold` adds one task's contribution (see task_statistics.py) to the block's accumulators, in task
order; `solve` turns the folded accumulators into calibrated parameters with the closed forms of
statistics.py / solvers.py: every Linear (weight (d_out, d_in), bias (d_out,)), then every norm
(γ, β (d,)), anchored on `anchor(merged, base, ρ)` of the block's pre-calibration tensors; the
result is local name → tensor on the CPU in the merged tensor's dtype. `fold_and_solve` does both
for statistics saved to files, one Linear group at a time.
"""

from __future__ import annotations

import torch

from featcal_core.method.drift import check_finite
from featcal_core.method.solvers import anchor
from featcal_core.method.statistics import LinearInputStats


def fold(linear_sums, norm_sums, layout, linear_of, norm_of, device, params, adopt=False) -> None:
    """Add one task's contribution: for each group label in `layout`, linear_of(label) into
    linear_sums[label] (created from the layout on `device` with FeatCal's `params` on first
    use); for each norm in norm_sums, norm_of(name) into it (norm_of None: no norms). adopt: see
    LinearInputStats.merge."""
    for label, lay in layout.items():
        if label not in linear_sums:
            linear_sums[label] = LinearInputStats(
                lay["d_in"], lay["modules"], device, lay["tokens"], params=params
            )
        linear_sums[label].merge(linear_of(label), adopt=adopt)
    if norm_of is not None:
        for name, sums in norm_sums.items():
            sums.merge(norm_of(name))


def fold_and_solve(stored, norm_sums, merged_sd, base_sd, params, device, fallbacks=None):
    """Fold the saved statistics (`StoredStatistics`) of every task (task order) and solve, one
    Linear group or norm at a time; norm_sums: the block's empty norm accumulators (fallbacks:
    see `solve`)."""
    solved: dict[str, torch.Tensor] = {}
    for label in stored[0].layout:
        linear_sums: dict[str, LinearInputStats] = {}
        for stats in stored:
            fold(
                linear_sums,
                {},
                {label: stats.layout[label]},
                lambda g, stats=stats: stats.group("linear", g),
                None,
                device,
                params,
                adopt=True,
            )
        solved.update(solve(linear_sums, {}, merged_sd, base_sd, params, device, fallbacks))
        del linear_sums
    for stats in stored:
        fold({}, norm_sums, {}, None, lambda n, stats=stats: stats.group("norm", n), device, params)
    solved.update(solve({}, norm_sums, merged_sd, base_sd, params, device, fallbacks))
    return solved


def solve(linear_stats, norm_stats, merged_sd, base_sd, params, device, fallbacks=None):
    """Solve every Linear group (with the λ and ε its accumulator holds), then every norm (with
    `params`' λ and ε); fallbacks and clamps go to `fallbacks` (a `Fallbacks`; None: logged
    only)."""
    lam, rho, eps = params.lam, params.rho, params.eps
    solved: dict[str, torch.Tensor] = {}

    def anchored(name: str) -> torch.Tensor | None:
        if name not in merged_sd or lam == 0:
            return None
        return anchor(merged_sd[name].to(device), base_sd[name].to(device), rho)

    def keep(name: str, tensor: torch.Tensor) -> None:
        """Check the float64 solution, then keep it in the merged tensor's dtype."""
        check_finite(tensor, f"solved parameter {name}")
        solved[name] = tensor.to("cpu", merged_sd[name].dtype)

    for stats in linear_stats.values():
        anchors = {
            name: (anchored(f"{name}.weight"), anchored(f"{name}.bias")) for name in stats.targets
        }
        for name, (weight, bias) in stats.solve(anchors, fallbacks).items():
            keep(f"{name}.weight", weight)
            if bias is not None:
                keep(f"{name}.bias", bias)
        del anchors
    for name, stats in norm_stats.items():
        gamma, beta = stats.solve(
            lam, eps, anchored(f"{name}.weight"), anchored(f"{name}.bias"), fallbacks, name
        )
        keep(f"{name}.weight", gamma)
        if beta is not None:
            keep(f"{name}.bias", beta)
    return solved
