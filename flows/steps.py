"""The pipeline's steps for one validated params.yaml, each reading what the earlier steps wrote
below `run.results_dir` (the layout: featcal_core.provenance.records). `featcal run` calls them
inside one Prefect flow; the per-step subcommands (`featcal download`, `calib-set`,
`merge --params`, `calibrate --params`, `heads`, `evaluate`, `report`) and the DVC stages call
them one at a time, each inside `Steps.session` (checked outputs, the run lock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import (
    check_root,
    check_target,
    prepare_root,
    sweep_tree,
    verify_file,
    verify_output,
    write_json,
)
from featcal_core.io.run_lock import run_lock
from featcal_core.memory import peak_rss_bytes
from featcal_core.params import Params
from featcal_core.provenance.identity import sources_digest
from featcal_core.provenance.records import (
    FEATCAL_RECORD,
    MERGE_RECORD,
    REPORT_CARD,
    REPORTS_ROOT,
    results_layout,
)
from featcal_core.repair import reuse
from featcal_core.repair.registry import Repair, RepairInputs
from featcal_core.repair.registry import get as get_repair

__all__ = ["Steps", "layout", "write_json"]

log = logging.getLogger(__name__)


def in_dvc_stage() -> bool:
    """Whether this step runs as a DVC stage (`dvc repro` sets DVC_STAGE): a stage writes only
    its own outputs, so the steps leave the calibrate stage's folder as that stage wrote it."""
    import os

    return bool(os.environ.get("DVC_STAGE"))


def layout(params: Params) -> dict[str, Path]:
    """The paths of this run's outputs (featcal_core.provenance.records.results_layout)."""
    return results_layout(params.run.results_dir, params.run.name)


def check_device(device: str) -> None:
    """`featcal.device: cuda` on a machine without CUDA is refused in one line, before any
    step writes (cpu and auto always run)."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise FeatCalError(
            "featcal.device: cuda, but no CUDA device is available on this machine; set "
            "featcal.device to cpu or auto (--set featcal.device=auto)"
        )


class Steps:
    """The steps of one run. `in_flow`: call the Prefect tasks (inside a flow run); otherwise
    call their bodies directly, with no Prefect server (calibration still runs as its own,
    resumable flow)."""

    def __init__(self, params: Params, in_flow: bool = False):
        self.params = params
        self.paths = layout(params)
        self.in_flow = in_flow
        zoo = params.zoo_settings
        if zoo is not None and params.models is None:
            from featcal_core.zoo.build import load_manifest

            manifest = load_manifest(zoo.path)
            if manifest is not None:
                self.params = params.with_zoo(manifest)
        #: the params as asked for (select: and all); `params` becomes the winner's once chosen
        self.requested = self.params
        #: the select step's record whose winner these steps run (None: no select: or no choice)
        self.selection: dict | None = None
        #: a reused one-go repair's computing cost as recorded when it ran ({"seconds",
        #: "peak_rss_mb"}); None: the repair ran here (or none was asked for)
        self.reused_cost: dict | None = None
        self.apply_selection()

    def apply_selection(self) -> None:
        """With select: and a record (selection.json) of the choice for these very params: the
        winner's params from now on (flows.selection_record). Without one, the steps that need the
        choice stop and ask for the select step."""
        self.params, self.selection = self.requested, None
        if self.params.select is None or self.params.models is None:
            return
        from featcal.flows.selection_record import chosen

        path = self.paths["selection"]
        record = None
        if path.is_file():
            wrong = verify_file(path)
            if wrong is None:
                record = json.loads(path.read_text(encoding="utf-8"))
            else:  # an edited record chooses nothing: the select step runs again
                log.warning("ignoring %s: %s", path, wrong)
        found = chosen(self.params, record)
        if found is not None:
            self.params, self.selection = found, record

    def _require_selection(self) -> None:
        if self.params.select is not None:
            raise FeatCalError(
                f"select: {self.paths['selection']} holds no choice made for these params (none "
                "yet, or the select: section, candidates or settings changed since); run `featcal "
                "select --params FILE` (or `featcal run`) first"
            )

    def _require_models(self) -> None:
        if self.params.models is None:
            zoo = self.params.zoo_settings
            raise FeatCalError(
                f"the zoo in {zoo.path} is not built yet; run `featcal zoo --params FILE` "
                "(or `featcal run`) first"
            )

    def inputs(self) -> list[Path]:
        """The local folders this run reads (models, data, the zoo, the Hub cache): no output
        may be one of them, lie inside one, or hold one."""
        found: list[Path] = []
        zoo = self.params.zoo_settings
        if zoo is not None:
            found.append(zoo.path)
        models = self.params.models
        if models is not None:
            refs = [models.base, *models.experts.values()]
            found += [ref.path for ref in refs if ref.path is not None]
            if models.hub_cache is not None:
                found.append(Path(models.hub_cache).expanduser())
        for spec in (self.params.tasks or {}).values():
            found += [
                Path(s.path).expanduser() for s in (spec.calibration, spec.evaluation) if s.path
            ]
        return found

    @contextlib.contextmanager
    def session(self, what: str = "featcal run") -> Iterator[None]:
        """The guarantees around every step: the results folder checked (never an input, never
        a folder of the user's), the report folder checked, the run lock held, and what killed
        runs left behind swept; the device the settings ask for checked; all before the first
        write."""
        inputs = self.check_session()
        root = prepare_root(self.paths["root"], inputs=inputs)
        with run_lock(root, what):
            sweep_tree(root, depth=3)
            yield

    def check_session(self) -> list:
        """Every check `session` makes before its first write, writing nothing (a compare makes
        them for every variant before any variant runs); returns the inputs."""
        check_device(self.params.featcal.device)
        inputs = self.inputs()
        check_target(self.paths["report"], inputs=inputs, root=REPORTS_ROOT, flag="report folder")
        check_root(self.paths["root"], inputs=inputs)
        return inputs

    def call(self, task, *args, **kwargs):
        """The Prefect task `task` (in a flow run), or its body (outside one)."""
        return task(*args, **kwargs) if self.in_flow else task.fn(*args, **kwargs)

    # ----- inputs of later steps -------------------------------------------------------------
    def lock(self) -> dict:
        from featcal_core.provenance.lock import read_lock

        if not self.paths["lock"].is_file():
            raise FeatCalError(
                f"{self.paths['lock']} does not exist; run `featcal download` (or `featcal run`)"
            )
        return read_lock(self.paths["lock"])

    def models(self) -> tuple[str, dict[str, str]]:
        """The locked base and experts, after checking every locked file still has its sha256."""
        from featcal_core.provenance.lock import models_from_lock, verify_lock

        lock = self.lock()
        problems = verify_lock(lock)  # digests memoised: free right after the download step
        if problems:
            raise FeatCalError(
                f"{self.paths['lock']} does not verify ({problems[0]}); run `featcal download` "
                "(or `featcal run`) again"
            )
        base, experts = models_from_lock(lock)
        return str(base.path), {task: str(model.path) for task, model in experts.items()}

    @staticmethod
    def verified(directory: Path, what: str, step: str) -> Path:
        """`directory` when it still holds what featcal wrote there (its marker's digests), else
        a FeatCalError naming the first mismatching file and the step that rewrites it."""
        wrong = verify_output(directory)
        if wrong is not None:
            raise FeatCalError(f"{what} does not verify ({wrong}); run `{step}` again")
        return directory

    def calibration_set_dirs(self) -> dict[str, str]:
        self._require_models()
        root = self.paths["calibration_sets"]
        dirs = {task: root / task for task in self.params.tasks}
        for task, path in dirs.items():
            if not path.is_dir():
                raise FeatCalError(
                    f"{path} (calibration set of {task!r}) does not exist; run `featcal calib-set`"
                )
            self.verified(path, f"calibration set {path}", "featcal calib-set --params FILE")
        return {task: str(path) for task, path in dirs.items()}

    # ----- the steps --------------------------------------------------------------------------
    def zoo(self) -> dict | None:
        """Build or reuse the offline zoo (when params has `zoo:`); models and tasks follow it."""
        zoo = self.params.zoo_settings
        if zoo is None:
            return None
        from featcal.tasks.zoo import build_zoo_task

        manifest = self.call(build_zoo_task, zoo)
        if self.requested.zoo:
            self.requested = self.requested.with_zoo(manifest)
        self.apply_selection()
        return manifest

    def download(self) -> dict:
        from featcal.tasks.download import download_models

        self._require_models()
        return self.call(download_models, self.params.models, self.paths["lock"])

    def calibration_sets(self, count: int | None = None) -> dict:
        """Draw every task's calibration set: `featcal.num_per_task` rows, or `count` (a compare
        whose variants ask for more; each calibration then takes its own seeded sample)."""
        from featcal.tasks.calibration_sets import build_calibration_sets
        from featcal_core.architectures import get

        modality = get(self.lock()["architecture"]).modality
        root = str(self.paths["calibration_sets"])
        params = self.params
        if count is not None and count != params.featcal.num_per_task:
            featcal = params.featcal.model_copy(update={"num_per_task": count})
            params = params.model_copy(update={"featcal": featcal})
        return self.call(build_calibration_sets, params, modality, root)

    def merge(self) -> dict:
        from featcal.tasks.merge import merge_task
        from featcal_core.provenance.lock import models_from_lock

        self._require_selection()
        base, experts = self.models()
        locked_base, locked_experts = models_from_lock(self.lock())  # where they came from
        merge = self.params.merge
        return self.call(
            merge_task,
            base,
            experts,
            str(self.paths["merged"]),
            merge.method,
            dict(merge.hyperparameters),
            self.params.run.max_shard_size,
            base_source=locked_base.source(),
            expert_sources={task: locked_experts[task].source() for task in experts},
        )

    def check_heads(self) -> None:
        """With featcal.heads: every task whose head is its expert's own has one (checked
        before the calibration starts, not after it)."""
        if not self.params.featcal.heads:
            return
        from featcal_core.architectures import get
        from featcal_core.evaluation.expert_head import ExpertHead

        if get(self.lock()["architecture"]).task_heads == "zero_shot":
            return  # bare experts: zero-shot heads from the base's text tower
        base, experts = self.models()
        for task, spec in self.params.tasks.items():
            if not spec.zero_shot:  # else: zero-shot
                ExpertHead(experts[task], tokenizer_dir=base).require_head()

    def calibration_settings(self):
        """featcal: as `featcal_core.method.settings.Settings` (what the repairs share)."""
        return self.params.featcal.core_settings(self.params.run.seed)

    def calibration_spec(self) -> dict:
        from featcal.flows.calibration import make_spec

        base, experts = self.models()
        featcal = self.params.featcal
        return make_spec(
            base,
            self.paths["merged"],
            experts,
            self.calibration_set_dirs(),
            self.paths["calibration"],
            featcal.core_params(),
            self.calibration_settings(),
            featcal.runner,
            featcal.dask_address,
            featcal.dask_workers,
            featcal.memory_budget,
            self.params.run.max_shard_size,
        )

    @property
    def repair(self) -> Repair:
        """The repair that runs (`repair.method`; featcal.enabled false: none), from the repair
        registry."""
        return get_repair(self.params.repair_method)

    def calibrate(self) -> dict:
        """The repair of the merged model (`repair.method`) into `calibrated/`, dispatched
        through the repair registry: a blockwise repair (FeatCal) runs resumable block by block,
        with its model card; any other runs its `run` on the pipeline's inputs. Returns the
        repair's record."""
        self._require_selection()
        repair = self.repair
        if repair.run is None:
            raise FeatCalError(f"repair.method {repair.name}: nothing to run")
        if repair.blockwise:
            return self._calibrate_blockwise()
        base, experts = self.models()
        if repair.classification_only:
            from featcal_core.evaluation.language_model import generation_kind

            if generation_kind(base) is not None:
                raise FeatCalError(
                    f"repair.method {repair.name} fits to classification heads; language models "
                    "are evaluated by label continuation and have none; use featcal or regmean"
                )
        options = {
            o.key: getattr(getattr(self.params, o.section), o.key)
            for o in repair.options
            if o.in_params
        }
        inputs = RepairInputs(
            base=base,
            merged=str(self.paths["merged"]),
            experts=experts,
            calibration_sets=self.calibration_set_dirs(),
            out=str(self.paths["calibrated"]),
            settings=self.calibration_settings(),
            options=options,
            heads=self._task_heads if repair.needs_heads else None,
            overwrite=True,
            progress=False,
        )
        # an output made from these very inputs (and verifying) is reused, as merges are
        caller = {"flows": sources_digest({"flows/steps.py": Path(__file__)})}
        saved = reuse.reusable(inputs.out, reuse.fingerprint(repair, inputs, caller))
        if saved is not None:
            self.reused_cost = saved.get("cost")
            log.info(
                "%s: %s was made from these inputs; reused (verified)", repair.name, inputs.out
            )
            return saved["record"]
        started = time.perf_counter()
        record = repair.run(inputs)
        cost = {"seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_bytes() / 2**20}
        # taken again: the run may have cached what a head reads (class embeddings)
        reuse.remember(inputs.out, reuse.fingerprint(repair, inputs, caller), record, cost)
        return record

    def _calibrate_blockwise(self) -> dict:
        """FeatCal through the resumable calibration flow, then its model card."""
        from featcal.flows.calibration import calibration_flow, calibration_flow_fn
        from featcal_core.provenance.lineage import trace
        from featcal_core.provenance.model_card import model_card_fields, write_model_card

        run = calibration_flow_fn if self.in_flow else calibration_flow
        record = run(self.calibration_spec(), str(self.paths["calibrated"]), overwrite=True)
        # the model card (README.md) next to the weights: recipe, inputs with hashes, provenance;
        # no results or refit heads yet (any found here are an earlier run's): `evaluate` adds them
        fields = model_card_fields(trace(self.paths["calibrated"]))
        write_model_card(self.paths["calibrated"], **{**fields, "evaluation": None, "heads": None})
        return record

    def _task_heads(self) -> dict:
        """{task: its evaluation head} (tasks.evaluate.task_head): what the trained repairs
        (Surgery, AdaMerging) fit to."""
        from featcal.tasks.evaluate import task_head

        base, experts = self.models()
        return {
            task: task_head(task, spec, Path(base), Path(experts[task]), self.paths["root"])[0]
            for task, spec in self.params.tasks.items()
        }

    def surgeries(self) -> dict[str, tuple[str, str]] | None:
        """With a repair that yields a module per task (Surgery): {"calibrated": (merged
        checkpoint, modules folder)}, the evaluation row of the merged model under each task's
        module."""
        if self.repair.output != "task_modules":
            return None
        folder = self.verified(
            self.paths["calibrated"], "the surgery modules", "featcal calibrate --params FILE"
        )
        return {"calibrated": (str(self.paths["merged"]), str(folder))}

    def _evaluated_models(self) -> dict[str, str]:
        """The merged (and calibrated) checkpoint, each verified against its marker."""
        models = {"merged": self.paths["merged"]}
        if self.repair.output == "checkpoint":  # task modules: `surgeries`
            models["calibrated"] = self.paths["calibrated"]
        step = {
            "merged": "featcal merge --params FILE",
            "calibrated": "featcal calibrate --params FILE",
        }
        for name, path in models.items():
            if path.is_dir():
                self.verified(path, f"the {name} checkpoint {path}", step[name])
        return {name: str(path) for name, path in models.items()}

    def heads(self, only: str | None = None) -> dict[str, dict[str, str]]:
        """Head calibration (featcal.heads): refit heads for the merged and calibrated models
        ({model: {task: folder}}), or for `only` one of them ({task: folder})."""
        self._require_selection()
        self.paths["refit_heads"].mkdir(parents=True, exist_ok=True)  # a DVC out
        if not self.params.featcal.heads:
            return {}  # before importing the task: off, `featcal heads` costs no torch start-up
        from featcal.tasks.heads import calibrate_heads

        base, experts = self.models()
        from featcal_core.evaluation.language_model import generation_kind

        if generation_kind(base) is not None:
            raise FeatCalError(
                "featcal.heads: head calibration refits classification heads; language models are "
                "evaluated by label continuation and have none; set featcal.heads: false"
            )
        models = self._evaluated_models()
        if only is not None:
            models = {only: models[only]}
        found = self.call(
            calibrate_heads,
            self.params,
            base,
            experts,
            models,
            self.calibration_set_dirs(),
            str(self.paths["root"]),
        )
        self._heads_into_checkpoint(found.get("calibrated"))
        return found if only is None else found[only]

    def _heads_into_checkpoint(self, folders: dict[str, str] | None) -> None:
        """The calibrated model's refit heads travel with it: heads.safetensors / heads.json in
        its folder (featcal_core.evaluation.task_heads), the marker updated. Not as a DVC stage
        (DVC_STAGE set): the calibrated folder is the calibrate stage's output."""
        if not folders or in_dvc_stage():
            return
        from featcal_core.evaluation.linear_head import load_linear_head
        from featcal_core.evaluation.task_heads import save_task_heads

        save_task_heads(
            self.paths["calibrated"],
            {task: load_linear_head(folder) for task, folder in folders.items()},
        )

    def refit_heads(self) -> dict[str, dict[str, str]] | None:
        """The refit head folders written by `heads`, or None when head calibration is off."""
        if not self.params.featcal.heads:
            return None
        root = self.paths["root"] / "refit_heads"
        found = {
            name: {t: str(root / name / t) for t in self.params.tasks if (root / name / t).is_dir()}
            for name in self._evaluated_models()
        }
        missing = [
            f"{n}/{t}" for n, heads in found.items() for t in self.params.tasks if t not in heads
        ]
        if missing:
            raise FeatCalError(
                f"{root}: no refit head for {missing[0]}; run the head calibration "
                "(`featcal heads --params FILE` or `featcal run`) or set featcal.heads: false"
            )
        from featcal.tasks.heads import FITTED_ON, weight_digests

        for name, directory in self._evaluated_models().items():
            record = root / name / FITTED_ON
            fitted = json.loads(record.read_text()).get("weights") if record.is_file() else None
            if fitted != weight_digests(directory):
                raise FeatCalError(
                    f"{root / name}: the refit heads were fit on other {name} weights than "
                    f"{directory} holds now; run `featcal heads --params FILE` again"
                )
            self.verified(
                root / name, f"the refit heads {root / name}", "featcal heads --params FILE"
            )
        return found

    def evaluate(self) -> dict:
        """evaluation.json, metrics.json (the headline figures) and metrics_per_task.json (their
        per-task values), both from featcal_core.report.figures; then the calibrated checkpoint's
        model card again, now with the results (model-index, results table, headline) and its
        refit heads. The guarded writer records the card's new sha256 in the folder's marker, so
        the checkpoint still verifies. Not as a DVC stage (DVC_STAGE set): the calibrated folder
        is the calibrate stage's output, and rewriting it there would make every `dvc repro` run
        again; the report stage writes the card with its results into the report instead."""
        from featcal.tasks.evaluate import evaluate_models
        from featcal_core.report.figures import (
            headline_metrics,
            per_task_metrics,
            summary_figures,
        )

        self._require_selection()
        base, experts = self.models()
        heads = self.refit_heads()
        table = self.call(
            evaluate_models,
            self.params,
            base,
            experts,
            self._evaluated_models(),
            str(self.paths["root"]),
            heads,
            self.surgeries(),
        )
        write_json(self.paths["evaluation"], table)
        write_json(self.paths["evaluation_datasets"], self._evaluation_datasets())
        figures = summary_figures(table)  # what `dvc metrics show` lists
        write_json(self.paths["metrics"], headline_metrics(figures))
        write_json(self.paths["metrics_per_task"], per_task_metrics(figures))
        calibrated = self.paths["calibrated"]
        if self._has_card():
            if in_dvc_stage():
                logging.getLogger(__name__).info(
                    "model card of %s left as the calibrate stage wrote it (a DVC stage writes "
                    "only its own outputs); the report stage writes it with the results to %s",
                    calibrated,
                    self.paths["report"] / REPORT_CARD,
                )
            else:
                self._write_card(table, heads)
        return table

    def _has_card(self) -> bool:
        """Whether the calibrated checkpoint has a model card: a blockwise repair's (FeatCal)."""
        return self.repair.blockwise and (self.paths["calibrated"] / FEATCAL_RECORD).is_file()

    def _evaluation_datasets(self) -> dict:
        """Each task's evaluation dataset as the evaluation read it (card_metadata's
        `evaluation_datasets`: the commit of a saved Hub split from evaluation_data/)."""
        from featcal_core.provenance.card_metadata import evaluation_datasets

        return evaluation_datasets(self.params.tasks, self.paths["evaluation_data"])

    def _write_card(self, evaluation: dict, heads: dict | None, path: Path | None = None) -> Path:
        """The calibrated checkpoint's model card with the evaluation table and its refit heads,
        into the checkpoint (README.md) or to `path`; its datasets as the evaluation recorded
        them (evaluation_datasets.json, an output of the evaluate step)."""
        from featcal_core.provenance.lineage import trace
        from featcal_core.provenance.model_card import model_card_fields, write_model_card

        calibrated = self.paths["calibrated"]
        fields = model_card_fields(trace(calibrated))
        fields.update(evaluation=evaluation, heads=(heads or {}).get("calibrated"))
        recorded = self.paths["evaluation_datasets"]
        if recorded.is_file():
            fields["datasets"] = json.loads(recorded.read_text(encoding="utf-8"))
        else:  # a results folder evaluated without the record: from evaluation_data/
            fields["datasets"] = self._evaluation_datasets()
        return write_model_card(calibrated, **fields, path=path)

    def report(self) -> dict[str, Path]:
        """reports/<run name>/: report.md, report.html, accuracy.png, drift.png, and as a DVC
        stage the calibrated checkpoint's model card with its results (model_card.md: the card in
        calibrated/ is the calibrate stage's output); and the plots' data,
        results_dir/plots/accuracy.csv and drift.csv."""
        from featcal_core.report import write_report
        from featcal_core.report.plot_data import write_plot_data

        def load(path: Path) -> dict | None:
            """A record featcal wrote, as written (its marker's sha256), or None when missing."""
            if not path.is_file():
                return None
            wrong = verify_file(path)
            if wrong is not None:
                raise FeatCalError(
                    f"{wrong}; the report shows only what featcal recorded: run the step that "
                    "writes it again (`featcal run`, or `dvc repro`)"
                )
            return json.loads(path.read_text())

        evaluation = load(self.paths["evaluation"])
        if evaluation is None:
            raise FeatCalError(
                f"{self.paths['evaluation']} does not exist; run `featcal evaluate` first"
            )
        calibration = load(self.paths["calibrated"] / FEATCAL_RECORD)
        # the figures' data for `dvc plots` (dvc.yaml): results_dir/plots/*.csv
        write_plot_data(self.paths["plots"], evaluation, calibration)
        written = write_report(
            self.paths["report"],
            run_name=self.params.run.name,
            evaluation=evaluation,
            calibration=calibration,
            merge=load(self.paths["merged"] / MERGE_RECORD),
            lock=load(self.paths["lock"]),
            selection=self.selection,
        )
        if in_dvc_stage() and self._has_card():
            path = self.paths["report"] / REPORT_CARD
            written[REPORT_CARD] = self._write_card(evaluation, self.refit_heads(), path)
        return written
