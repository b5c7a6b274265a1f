"""How the label-free choice depends on the number of held-out inputs: re-score every variant of
a finished `featcal compare` run on N held-out unlabeled inputs per task (drawn as the select
step draws them, disjoint from the calibration sets) and print, per score, Spearman's ρ against
the variants' mean test accuracy (from the run's compare.json) and the variant it would choose.

    python benchmarks/selection_holdout.py --params params/compare-unseen.yaml --holdout 32 128
    python benchmarks/selection_holdout.py --params FILE --holdout --validation   # labelled only

`--validation` adds the labelled choice (`score: validation`: each variant's mean accuracy on the
tasks' validation splits, carved from train) for comparison.

Reads the compare run's results folder (merges, variants) and report; writes the held-out sets to
`<results>/selection_sets_<N>/`. Nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from featcal.flows.compare import compare_name, load_compare  # noqa: E402
from featcal.flows.steps import Steps  # noqa: E402
from featcal.flows.variants import merge_key  # noqa: E402
from featcal.tasks.selection import build_selection_sets, score_candidates  # noqa: E402
from featcal_core.architectures import get  # noqa: E402
from featcal_core.evaluation.selection import (  # noqa: E402
    HIGHER_IS_BETTER,
    LABEL_FREE,
    choose,
    spearman,
)
from featcal_core.provenance.records import REPORTS_ROOT  # noqa: E402

log = logging.getLogger("selection_holdout")


def checkpoints(steps: Steps, variants: dict) -> dict[str, tuple[str, str | None]]:
    """Each variant's (checkpoint, Surgery modules or None), as the compare run wrote them."""
    found = {}
    for name, params in variants.items():
        merged = str(steps.paths["merges"] / merge_key(params.merge))
        repaired = str(steps.paths["variants"] / name / "calibrated")
        found[name] = {"none": (merged, None), "surgery": (merged, repaired)}.get(
            params.repair_method, (repaired, None)
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", required=True, help="the compare run's params file")
    parser.add_argument("--holdout", type=int, nargs="*", default=[32, 128])
    parser.add_argument(
        "--validation",
        action="store_true",
        help="also score every variant on each task's labelled validation split "
        "(score: validation), as a user with labels would choose",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params, variants = load_compare(args.params, [])
    steps = Steps(params)
    report = json.loads((REPORTS_ROOT / compare_name(params) / "compare.json").read_text())
    accuracy = {row["name"]: row["mean"]["accuracy"] for row in report["variants"]}
    names = list(variants)
    base, experts = steps.models()
    modality = get(steps.lock()["architecture"]).modality
    lines = [
        "| held-out per task | score | Spearman ρ | chooses | its mean test acc |",
        "|---|---|---|---|---|",
    ]
    for n in args.holdout:
        out = steps.paths["root"] / f"selection_sets_{n}"
        build_selection_sets.fn(
            steps.params, modality, str(steps.paths["calibration_sets"]), str(out), n
        )
        scores = score_candidates.fn(
            steps.params,
            base,
            experts,
            checkpoints(steps, variants),
            {t: str(out / t) for t in steps.params.tasks},
            str(steps.paths["root"]),
        )
        for score in LABEL_FREE:
            choice = choose(scores, score)
            sign = 1.0 if HIGHER_IS_BETTER[score] else -1.0
            rho = spearman([sign * choice["means"][v] for v in names], [accuracy[v] for v in names])
            lines.append(
                f"| {n} | {score} | {rho:+.2f} | `{choice['winner']}` | "
                f"{accuracy[choice['winner']]:.1f} |"
            )
    if args.validation:
        scores = score_candidates.fn(
            steps.params,
            base,
            experts,
            checkpoints(steps, variants),
            {},
            str(steps.paths["root"]),
            "validation",
        )
        choice = choose(scores, "validation")
        rho = spearman([choice["means"][v] for v in names], [accuracy[v] for v in names])
        lines.append(
            f"| — | validation | {rho:+.2f} | `{choice['winner']}` | "
            f"{accuracy[choice['winner']]:.1f} |"
        )
    best = max(names, key=accuracy.get)
    print("\n".join(lines) + f"\n\nbest on test: `{best}` ({accuracy[best]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
