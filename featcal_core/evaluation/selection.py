"""The choice among candidates (merge × repair × hyperparameters) from their per-task scores,
and how well a score ranks candidates the way test accuracy does.

    choice = choose({"paper": {"mnist": {"agreement": 71.9}, ...}, ...}, "agreement")
    choice["winner"], choice["ranking"], choice["why"]

Each candidate's score is its mean over tasks (each task counts once). Ties go to the candidate
listed first. `spearman` is the rank correlation (average ranks for ties) used to report which
score predicts test accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from featcal_core.errors import FeatCalError

__all__ = ["HIGHER_IS_BETTER", "LABEL_FREE", "choose", "spearman"]

#: the label-free scores (featcal_core.evaluation.agreement), in the order reports show them
LABEL_FREE = ("agreement", "drift", "kl")

#: whether a higher value of each score is better
HIGHER_IS_BETTER = {"agreement": True, "drift": False, "kl": False, "validation": True}
UNITS = {
    "agreement": "% agreement with the experts",
    "drift": "mean relative feature drift",
    "kl": "nats mean KL divergence from the experts' class probabilities",
    "validation": "% mean validation accuracy",
}


def choose(
    scores: Mapping[str, Mapping[str, Mapping[str, float]]],
    score: str,
    ineligible: Mapping[str, str] | None = None,
) -> dict:
    """{"score", "higher_is_better", "means": {candidate: mean over tasks}, "ranking": names,
    best first, "winner", "why": one sentence} from {candidate: {task: {score: value}}}.
    ineligible: {candidate: why it may not win}: ranked like the others, never the winner (the
    why says which better-ranked ones were passed over)."""
    if score not in HIGHER_IS_BETTER:
        raise FeatCalError(f"score {score!r} is not one of {', '.join(HIGHER_IS_BETTER)}")
    if not scores:
        raise FeatCalError(
            "no candidates to choose from; list at least two under select.candidates"
        )
    means = {}
    for name, tasks in scores.items():
        values = [values[score] for values in tasks.values()]
        if not values:
            raise FeatCalError(f"candidate {name!r} has no scored task")
        means[name] = sum(values) / len(values)
    sign = -1.0 if HIGHER_IS_BETTER[score] else 1.0
    order = list(scores)
    ranking = sorted(order, key=lambda n: (sign * means[n], order.index(n)))
    ineligible = dict(ineligible or {})
    eligible = [name for name in ranking if name not in ineligible]
    if not eligible:
        raise FeatCalError(
            f"no candidate may win: {'; '.join(f'{n}: {w}' for n, w in ineligible.items())}"
        )
    winner = eligible[0]
    runner_up = eligible[1] if len(eligible) > 1 else None
    why = f"{winner}: {means[winner]:.4g} {UNITS[score]} over {len(scores[winner])} task(s)"
    if runner_up is not None:
        why += f", against {means[runner_up]:.4g} for the next best ({runner_up})"
    passed = ranking[: ranking.index(winner)]
    if passed:
        why += "; ranked above it but not eligible: " + "; ".join(
            f"{name} ({means[name]:.4g}: {ineligible[name]})" for name in passed
        )
    return {
        "score": score,
        "higher_is_better": HIGHER_IS_BETTER[score],
        "means": means,
        "ranking": ranking,
        "winner": winner,
        "why": why,
    }


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2.0 + 1.0
        start = end + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of paired values (None: under 3 pairs or a constant side)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs paired values ({len(xs)} vs {len(ys)})")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else cov / (vx * vy) ** 0.5
