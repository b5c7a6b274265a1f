import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    logging.getLogger("featcal_core").setLevel(logging.INFO)
    yield


#: set by the pytest-xdist controller to the API URL of the one local `prefect server` it started
#: for all its workers (see pytest_configure)
SHARED_API = "FEATCAL_TEST_PREFECT_API"

#: test files whose tests use the `prefect_api` fixture: an xdist run that selects one of them (or
#: a whole directory) starts the shared server; any other use starts a server in its worker
SERVER_FILES = {
    "test_pipeline.py",
    "test_resume.py",
    "test_dvc.py",
    "test_open_clip_pipeline.py",
    "test_faults.py",
    "test_process_lifecycle.py",
    "test_paper_run.py",
    "test_records_cover.py",
    "test_full_disks.py",
}


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One local `prefect server` (its own database) shared by the tests that start many flow
    processes (each would otherwise start Prefect's temporary server); yields its API URL. Under
    pytest-xdist all workers share the controller's; otherwise this worker starts its own."""
    from featcal.flows.prefect_server import local_server, wait_healthy

    shared = os.environ.get(SHARED_API)
    if shared:
        wait_healthy(shared, timeout_s=180)
        yield shared
        return
    with local_server(home=tmp_path_factory.mktemp("prefect-server")) as api_url:
        yield api_url


def _selects_server_tests(config) -> bool:
    if not _selects_slow_tests(config):
        return False  # every test that uses `prefect_api` is marked slow
    for arg in config.args:
        path = Path(arg.split("::")[0])
        if path.is_dir() or path.name in SERVER_FILES:
            return True
    return False


def _selects_slow_tests(config) -> bool:
    """Whether the `-m` expression can select a test marked slow (whatever its other marks)."""
    markexpr = config.option.markexpr
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression

    try:
        expression = Expression.compile(markexpr)
    except Exception:  # a malformed expression: pytest reports it
        return True

    def marks(others: bool):  # "slow", and either every other mark or none
        return lambda name, /, **kwargs: name == "slow" or others

    return expression.evaluate(marks(False)) or expression.evaluate(marks(True))


_SERVER_KEY = pytest.StashKey[tuple]()


def _share_the_cores(config) -> None:
    """A pytest-xdist worker's torch runs on its share of the cores (`OMP_NUM_THREADS`, which the
    featcal processes its tests start inherit): torch's default, a thread per core in every
    worker, oversubscribes the cores, and its threads then spin waiting for each other (two zoo
    builds side by side on 2 cores: 41 s each, against 19 s with one thread each). Unchanged
    outside xdist and where OMP_NUM_THREADS is already set."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_configure(config):
    """The xdist controller starts the workers' shared Prefect server without waiting for it:
    the workers start at once and wait in `prefect_api` (a start costs ~15 s of CPU, paid once
    per run instead of once per worker)."""
    # the persistent digest store (featcal_core/io/digests.py): one per test session, never the
    # user's ~/.cache (set before any test starts a featcal process, which inherits it)
    if "FEATCAL_DIGEST_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="featcal-digests-")
        os.environ["FEATCAL_DIGEST_CACHE"] = os.path.join(folder, "digests.sqlite")
    # the evaluation store (featcal_core/evaluation/result_cache.py): off, so that every test
    # evaluates what it checks; test_evaluation_store.py turns it on where it tests it
    os.environ.setdefault("FEATCAL_EVALUATION_CACHE", "off")
    # MLflow: a store per test process (never the checkout's mlruns/) for tests that run featcal
    # steps without naming one; tests that check the default location clear MLFLOW_* themselves
    if "MLFLOW_TRACKING_URI" not in os.environ:
        folder = os.environ.setdefault(
            "FEATCAL_TEST_MLFLOW", tempfile.mkdtemp(prefix="featcal-mlflow-")
        )
        worker = getattr(config, "workerinput", {}).get("workerid")
        if worker is not None or not config.getoption("numprocesses", None):
            os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/{worker or 'main'}.db"
    _share_the_cores(config)
    xdist_controller = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if xdist_controller and _selects_server_tests(config) and not os.environ.get(SHARED_API):
        from featcal.flows.prefect_server import start_server

        home = tempfile.mkdtemp(prefix="featcal-test-prefect-")
        server, api_url = start_server(home=home)
        config.stash[_SERVER_KEY] = (server, home)
        os.environ[SHARED_API] = api_url  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    shared = config.stash.get(_SERVER_KEY, None)
    if shared is not None:
        from featcal.flows.prefect_server import stop_server

        server, home = shared
        os.environ.pop(SHARED_API, None)
        stop_server(server)
        shutil.rmtree(home, ignore_errors=True)


#: files whose tests share no costly module fixture and each run long: pytest-xdist may send their
#: tests to different workers (test_zoo's three zoo builds, say; its toy images, made in about a
#: second, are then made once on each worker that runs one of its tests). Every other file's tests
#: stay together on one worker (`--dist loadgroup`), so its module fixtures are built once.
SPREAD = {"test_pipeline.py", "test_serve.py", "test_demo.py", "test_zoo.py"}

#: the longest subprocess tests (whole `featcal` flows, `dvc repro`), split by hand into two lanes
#: of similar length (test_resume's tests share their module fixture):
#: each lane runs on one worker, so two workers do not both end up waiting on the longest ones
LANES = {
    "test_resume.py": "lane-1",
    "test_pipeline.py::test_featcal_run_bert_with_task_heads": "lane-1",
    "test_dvc.py": "lane-2",
    "test_pipeline.py::test_featcal_run_end_to_end": "lane-2",
}


def _group(item) -> str | None:
    name = item.path.name
    lane = LANES.get(f"{name}::{item.name}") or LANES.get(name)
    if lane is not None:
        return lane
    return None if name in SPREAD else name


#: the slow lane (`-m slow`), left out by `./scripts/test --fast`: every test that uses the
#: `prefect_api` fixture, every test of SLOW_FILES and the tests named in SLOW_TESTS. The fast
#: lane runs in under 2 minutes on 2 cores; `--durations` shows what to add when it does not.
SLOW_FILES = SERVER_FILES | {
    "test_serve.py",  # `featcal serve` and local Prefect servers in subprocesses
    "test_install.py",  # installs featcal into a fresh virtual environment, runs `featcal run`
    "test_compare.py",  # `featcal compare` in a subprocess
    "test_demo.py",  # builds a synthetic pool, runs the demo on it twice
    "test_zoo_training.py",  # pretrains a base model and fine-tunes experts
    "test_surgery.py",  # trains surgery modules (its module fixture)
    "test_zoo_sources.py",  # decodes the bundled real data sets
    "test_tracking.py",  # creates MLflow SQLite stores (a schema migration each)
    "test_forward_precision.py",  # bfloat16 forwards of real experts against float32
    "test_lm_evaluation.py",  # one forward per example and class, against the batched path
    "test_report.py",  # writes the whole report, its matplotlib plots included, in each test
    "test_harness_run.py",  # `featcal run` scored by lm-eval; lm-eval's whole task registry
}

#: single tests of otherwise fast files, by `file::name` (every parametrization) or
#: `file::name[id]`
SLOW_TESTS = {
    # start the `featcal` CLI in a subprocess
    "test_end_to_end.py::test_console_script_runs",
    "test_bad_inputs.py::test_bad_input_from_the_shell_prints_no_traceback",
    "test_paper_llama.py::test_the_paper_llama_files_check_against_stand_ins_without_downloading",
    "test_paper_llama.py::test_the_paper_llama_file_names_each_planted_mistake_in_one_line",
    "test_paper_llama.py::test_the_stand_in_layouts_are_what_the_check_reads",  # their fixture
    # import the stack in a fresh Python process
    "test_checkpoint_io.py::test_featcal_core_imports_no_orchestration",
    "test_merging.py::test_merging_imports_no_orchestration",
    "test_memory_model.py::test_predicted_peak_is_the_measured_peak_rss_of_a_block",  # 2 blocks
    # build a zoo (the last one then runs `featcal run` on it in a subprocess)
    "test_zoo.py::test_featcal_zoo_on_own_datasets_then_reuse",
    "test_zoo.py::test_the_paper_regime_preset_keeps_base_fitted_heads_and_records_task_vector_sizes",
    "test_zoo.py::test_flow_builds_the_zoo_and_runs_with_head_calibration",
    # float64 accumulators of a 1600-wide Gram
    "test_precision.py::test_float32_products_match_float64_accumulators[wide-symmetric-gram]",
    "test_precision.py::test_bfloat16_products_stay_near_the_float64_accumulators[wide-symmetric-gram]",
    # calibrate a tiny pool twice (or per architecture) and compare the checkpoints
    "test_precision.py::test_float32_calibration_matches_the_float64_path",
    "test_precision.py::test_bfloat16_calibration_against_the_float64_path",
    "test_end_to_end.py::test_transformers4_layout_clipmodel_and_shards_give_the_same_result",
    "test_end_to_end.py::test_bf16_runs_without_nan_and_matches_fp32",
    "test_end_to_end.py::test_spill_dir_gives_identical_output",
    "test_llama.py::test_bare_llama_model_expert_gives_the_same_result",
    "test_llama.py::test_answer_weighting_differs_from_all_and_drift_is_measured_on_answers",
    "test_t5.py::test_transformers4_layout_checkpoints_give_the_same_blocks",
    "test_t5.py::test_t5_end_to_end_without_target_column",
    "test_regmean.py::test_checkpoint_matches_hooked_grams_and_keeps_everything_else",
    "test_regmean.py::test_pooled_weights_change_only_the_last_block_and_spilling_changes_nothing",
    "test_task_statistics.py::test_block_from_saved_task_statistics_is_bitwise_identical",
    # lm-eval on five tiny models (the expert rows of a list and of a mapping)
    "test_harness.py::test_expert_rows_of_a_list_and_of_a_mapping",
    # generate with the model card's snippet (transformers' generate loop: seconds per model)
    "test_card_snippets.py::test_the_snippet_of_a_merged_and_a_calibrated_card_runs[t5]",
    "test_card_snippets.py::test_the_snippet_of_a_merged_and_a_calibrated_card_runs[llama]",
}


def _slow(item) -> bool:
    name = item.path.name
    return (
        "prefect_api" in getattr(item, "fixturenames", ())
        or name in SLOW_FILES
        or f"{name}::{item.name}" in SLOW_TESTS
        or f"{name}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS
    )


# tryfirst: before `-m` deselects and before pytest-xdist's own hook reads the xdist_group marks
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_terminal_summary(terminalreporter):
    """Print the figures tests report (`record_property("report: ...", value)`), e.g. the
    worst relative error of the float32 statistics path (tests/test_precision.py)."""
    lines = []
    for report in terminalreporter.stats.get("passed", []):
        if report.when != "call":
            continue
        for key, value in report.user_properties:
            if str(key).startswith("report: "):
                lines.append(f"{key[len('report: ') :]}: {value}")
    if lines:
        terminalreporter.section("reported figures")
        for line in sorted(lines):
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _restore_logger_levels():
    """`featcal_cli.main.main` sets logger levels for its process (quiet by default); tests call
    it in-process, so each test starts from the levels it found."""
    names = [
        "",
        "featcal",
        "featcal.tasks",
        "featcal_core",
        "featcal_core.method.calibration",
        "httpx",
        "urllib3",
        "datasets",
        "transformers",
        "huggingface_hub",
    ]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:  # Prefect's console handlers (PREFECT_LOGGING_EXTRA_LOGGERS) hold the
        logger = logging.getLogger(name)  # stderr of the test that imported Prefect: capsys's,
        for handler in list(logger.handlers):  # closed since; a real process has one stderr
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
