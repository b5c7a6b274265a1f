"""Answer-token vs all-token weighting of FeatCal on Llama-class causal LMs, measured on validation
data (a benchmark, not a test).

The paper has no token-weighting rule for causal LMs; docs/featcal.md states this project's:
"padding 0; all other tokens 1 unless a measured alternative (answer tokens only) is better on
validation data — report both".
No pretrained LM is available offline, so this script builds a tiny LM zoo from the offline text
zoo's real classification data (data/zoo/text/data: rotten_tomatoes, subjectivity, polarity, hedge)
and measures both weightings.

What it builds, all under --work:
  - a word-level tokenizer (`tokenizers` WordLevel, NFKC + lowercase, `Whitespace` split into word
    and punctuation runs, at most --vocab entries of frequency >= 2 from the four train splits plus
    the label words and "->"; <pad> <unk> <s> </s>; bos prepended; right padding), wrapped in
    `PreTrainedTokenizerFast` and saved in the base directory. Every text is cut to its first
    MAX_TEXT_TOKENS tokens everywhere (training, calibration, evaluation);
  - a base `LlamaForCausalLM` (hidden 128, 4 layers, 4 heads, 2 kv heads, intermediate 256,
    max_position_embeddings 128, untied lm_head; about 1.6 M parameters at vocab 4000, seeded),
    pretrained by next-token prediction on the plain texts of the union of the four train splits
    (--steps-pretrain steps of batch 32, AdamW lr 2e-3, warmup + cosine);
  - one expert per task fine-tuned from the base on its train split (--steps-finetune steps of
    batch 32, AdamW lr 1e-3, warmup + cosine) on "{text} ->" followed by " " + the label word
    (the ClassLabel names: rotten/fresh, plot/review, negative/positive, certain/uncertain, one
    token each), the loss being the cross-entropy of the label word's token only;
  - the Task Arithmetic merge (`featcal_core.merging.run.merge_checkpoints`, the API behind
    `featcal merge --method task_arithmetic`) with the scale from --scales that has the best average
    validation accuracy;
  - per task a calibration set of --n rows drawn with --seed from the train split (`save_to_disk`;
    columns text = "{text} ->", target = " " + label word, label).

What it measures: FeatCal (`featcal_core.calibrate`, ρ = 2.2, α ∈ {0.25, 0.5, 1.0} × λ ∈ {0.05,
0.5}) with token_weighting "all" (every real token of prompt + answer weighs 1) and "answer" (only
the positions whose next token is an answer token). Accuracy is label-continuation accuracy
(`featcal_core.evaluation.language_model.label_continuation`, prompt "{text} ->", the task's two label words).
Validation (at most --max-val seeded rows per task) scores every grid point; per weighting the grid
point with the best average validation accuracy is selected (ties: the earlier grid point), and the
weighting with the better selected validation accuracy wins (ties: "all", docs/featcal.md's rule).
The test split (at most --max-test seeded rows per task; 0 = all) is scored only for the base, the
experts, the merged model, each weighting's selected setting and the paper defaults (α 0.25, λ 0.05,
ρ 2.2). Gap closed = (model − merged) / (expert − merged) on average test accuracy, where "expert"
is the average of each expert on its own task.

Defaults: --steps-pretrain 400, --steps-finetune 150, --vocab 4000, --n 32, --scales 0.3 0.5 1.0,
--max-val 300, --max-test 500, --threads 1, texts cut to 56 tokens, calibration max_length 64.
Writes <out>/lm_token_weighting.md and .csv (default benchmarks/results) and prints the table.
The whole default run took 10.3 minutes on a busy 2-core CPU (zoo build 6 of them):

    nice -n 10 .venv/bin/python benchmarks/lm_token_weighting.py
    nice -n 10 .venv/bin/python benchmarks/lm_token_weighting.py --work /tmp/lmtw --keep  # reuse zoo
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from lm_settings import ALPHAS, LAMS, MAX_LENGTH, PAPER, RHO, ROOT, TASKS, WEIGHTINGS

sys.path.insert(0, str(ROOT))

from lm_data import clip_all, eval_rows, load_tasks  # noqa: E402
from lm_report import report  # noqa: E402
from lm_scoring import Scorer, standard_error  # noqa: E402
from lm_zoo import build_zoo, zoo_settings  # noqa: E402

from featcal_core import FeatCalParams, calibrate  # noqa: E402
from featcal_core.report import gap_closed  # noqa: E402

log = logging.getLogger("lm_token_weighting")


# ----- main -------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument(
        "--keep", action="store_true", help="reuse the zoo under --work when its settings match"
    )
    parser.add_argument("--n", type=int, default=32, help="calibration rows per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-pretrain", type=int, default=400)
    parser.add_argument("--steps-finetune", type=int, default=150)
    parser.add_argument("--vocab", type=int, default=4000, help="tokenizer vocabulary limit")
    parser.add_argument(
        "--scales",
        type=float,
        nargs="+",
        default=[0.3, 0.5, 1.0],
        help="Task Arithmetic scales tried (chosen on validation)",
    )
    parser.add_argument(
        "--max-val", type=int, default=300, help="validation rows per task (seeded sample; 0 = all)"
    )
    parser.add_argument(
        "--max-test", type=int, default=500, help="test rows per task (seeded sample; 0 = all)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results"), help="results directory"
    )
    parser.add_argument("--verbose", action="store_true", help="featcal's own INFO logs too")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.verbose:
        for name in ("featcal_core", "featcal", "transformers", "datasets"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if "token_weighting" not in inspect.signature(calibrate).parameters:
        raise SystemExit("featcal_core.calibrate has no token_weighting option in this checkout")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    started = time.perf_counter()
    temporary = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="lm_token_weighting-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work, started)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path, started: float) -> int:
    from transformers import PreTrainedTokenizerFast

    tasks = load_tasks()
    record = None
    zoo_file = work / "zoo.json"
    if args.keep and zoo_file.is_file():
        saved = json.loads(zoo_file.read_text())
        if saved.get("settings") == json.loads(json.dumps(zoo_settings(args))):
            record = saved
            log.info("reusing the zoo in %s (built in %.0f s)", work, saved["build_seconds"])
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(work / "zoo" / "base"))
            clip_all(tokenizer, tasks)
        else:
            log.info("zoo in %s was built with other settings: rebuilding", work)
    if record is None:
        record = build_zoo(args, work, tasks)
    zoo = work / "zoo"
    base = zoo / "base"
    experts = {task: zoo / "experts" / task for task in TASKS}
    calib = {task: zoo / "calib" / task for task in TASKS}
    merged = zoo / f"merged_ta_{record['scale']:g}"
    scorer = Scorer(base, tasks, eval_rows(tasks, args))
    for model, task, split, value in record.get("val_cache", []):
        scorer.cache[model, task, split] = value
    log.info(
        "experts' validation accuracy: %s",
        {t: round(v["validation_accuracy"], 3) for t, v in record["experts"].items()},
    )
    log.info("merge scale %g (validation: %s)", record["scale"], record["merge_validation"])

    grid, dirs = {}, {}
    for w in WEIGHTINGS:
        for alpha in ALPHAS:
            for lam in LAMS:
                out = work / "calibrated" / f"{w}_a{alpha:g}_l{lam:g}"
                tick = time.perf_counter()
                calibrate(
                    base,
                    merged,
                    experts,
                    calib,
                    out,
                    FeatCalParams(alpha, RHO, lam),
                    num_per_task=args.n,
                    max_length=MAX_LENGTH,
                    seed=args.seed,
                    token_weighting=w,
                    overwrite=True,
                    progress=False,
                )
                grid[w, alpha, lam] = scorer.all_tasks(out, "validation")
                dirs[w, alpha, lam] = out
                log.info(
                    "featcal %s α=%g λ=%g: average validation accuracy %.4f (%.0f s)",
                    w,
                    alpha,
                    lam,
                    grid[w, alpha, lam]["avg"],
                    time.perf_counter() - tick,
                )

    order = [(a, lam) for a in ALPHAS for lam in LAMS]
    chosen = {
        w: max(order, key=lambda p, w=w: (grid[(w, *p)]["avg"], -order.index(p)))
        for w in WEIGHTINGS
    }
    winner = max(WEIGHTINGS, key=lambda w: (grid[(w, *chosen[w])]["avg"], -WEIGHTINGS.index(w)))
    log.info("validation: selected %s; prefers %s", chosen, winner)

    # test: only the chosen settings (and the paper defaults, the base, experts, merged)
    expert_test = {task: scorer.accuracy(experts[task], task, "test") for task in TASKS}
    expert_test["avg"] = float(np.mean([expert_test[t] for t in TASKS]))
    expert_val = {task: record["experts"][task]["validation_accuracy"] for task in TASKS}
    expert_val["avg"] = float(np.mean([expert_val[t] for t in TASKS]))
    merged_test = scorer.all_tasks(merged, "test")
    finals = [
        {
            "kind": "base",
            "validation": scorer.all_tasks(base, "validation"),
            "test": scorer.all_tasks(base, "test"),
        },
        {"kind": "experts", "validation": expert_val, "test": expert_test},
        {
            "kind": f"merged (TA {record['scale']:g})",
            "validation": scorer.all_tasks(merged, "validation"),
            "test": merged_test,
        },
    ]
    for label, settings in [
        ("featcal (val-selected)", chosen),
        ("featcal (paper defaults)", dict.fromkeys(WEIGHTINGS, PAPER)),
    ]:
        for w in WEIGHTINGS:
            alpha, lam = settings[w]
            finals.append(
                {
                    "kind": label,
                    "weighting": w,
                    "alpha": alpha,
                    "lam": lam,
                    "validation": grid[w, alpha, lam],
                    "test": scorer.all_tasks(dirs[w, alpha, lam], "test"),
                }
            )
    for f in finals:
        if f["kind"] not in ("base", "experts"):
            gap = gap_closed(merged_test["avg"], f["test"]["avg"], expert_test["avg"])
            f["gap"] = None if gap is None else gap + 0.0  # no "-0.0"
    counts = {task: len(scorer.rows[task, "validation"][0]) for task in TASKS}
    noise = {
        w: standard_error(grid[(w, *chosen[w])], counts) for w in WEIGHTINGS
    }  # binomial standard error of each selected average validation accuracy
    seconds = time.perf_counter() - started
    markdown = report(args, record, grid, finals, winner, seconds, noise)
    print(markdown)
    log.info("done in %.1f min", seconds / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
