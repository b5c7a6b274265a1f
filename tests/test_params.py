"""params.yaml: schema, loading, overrides, one-line errors naming the key (featcal_core/params/)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from featcal_core.errors import FeatCalError
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.params import ModelRef, Params, dump, flatten, load_params

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "flows" / "params_example.yaml"

MINIMAL = {
    "models": {"base": "openai/clip-vit-base-patch32", "experts": {"mnist": "./zoo/mnist"}},
    "tasks": {
        "mnist": {
            "calibration": {"hub": "tanganke/mnist", "split": "train"},
            "evaluation": {"hub": "tanganke/mnist", "split": "test"},
        }
    },
}


def write(tmp_path: Path, data, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return path


def minimal(**sections):
    data = yaml.safe_load(yaml.safe_dump(MINIMAL))  # deep copy
    data.update(sections)
    return data


def error_of(path: Path, overrides=()) -> str:
    with pytest.raises(FeatCalError) as info:
        load_params(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ loading


def test_example_loads():
    params = load_params(EXAMPLE)
    assert set(params.models.experts) == set(params.tasks) == {"mnist", "svhn"}
    assert params.models.base.kind == "local"
    assert params.tasks["mnist"].calibration.split == "train"
    assert params.tasks["mnist"].evaluation.split == "test"


def test_defaults_filled(tmp_path):
    params = load_params(write(tmp_path, MINIMAL))
    assert params.run.name == "featcal"
    assert params.run.results_dir == "data/results"
    assert params.run.seed == 0
    assert params.merge.method == "task_arithmetic"
    assert params.merge.hyperparameters == {"scale": 0.3}
    core = FeatCalParams()
    f = params.featcal
    assert (f.alpha, f.rho, f.lam, f.eps) == (core.alpha, core.rho, core.lam, core.eps)
    assert (f.num_per_task, f.batch_size, f.device, f.max_length) == (256, 16, "cpu", 128)
    assert (f.pooling, f.runner, f.dask_address, f.enabled) == (None, "local", None, True)
    assert params.featcal.core_params() == core
    assert params.evaluation.batch_size == 64
    assert params.evaluation.max_examples_per_task is None
    assert params.evaluation.enabled is True
    assert params.tracking.mlflow_tracking_uri is None
    assert params.tracking.experiment == "featcal"
    assert params.tracking.enabled is True
    assert params.tasks["mnist"].templates is None


def test_merge_hyperparameters_default_per_method(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert load_params(path).merge.hyperparameters == {"scale": 0.3}
    assert load_params(path, ["merge.method=average"]).merge.hyperparameters == {}
    assert load_params(path, ["merge.method=ties"]).merge.hyperparameters == {}
    ties = load_params(path, ["merge.method=ties", "merge.hyperparameters.top_k=10"])
    assert ties.merge.hyperparameters == {"top_k": 10.0}


def test_overrides(tmp_path):
    params = load_params(
        EXAMPLE,
        [
            "featcal.alpha=0.3",
            "tasks.mnist.evaluation.split=validation",
            "tracking.enabled=false",
            "featcal.eps=1e-6",
            "run.name=2024",
            "merge.hyperparameters.scale=0.5",
            "models.experts.svhn.trust_remote_code=true",
            "evaluation.max_examples_per_task=null",
        ],
    )
    assert params.featcal.alpha == 0.3 and isinstance(params.featcal.alpha, float)
    assert params.tasks["mnist"].evaluation.split == "validation"
    assert params.tracking.enabled is False
    assert params.featcal.eps == 1e-6
    assert params.run.name == "2024"
    assert params.merge.hyperparameters == {"scale": 0.5}
    svhn = params.models.experts["svhn"]
    assert svhn.trust_remote_code and svhn.ref == "./data/zoo/clip-vit-base-patch32_svhn"
    assert params.evaluation.max_examples_per_task is None


def test_override_adds_a_task(tmp_path):
    params = load_params(
        write(tmp_path, MINIMAL),
        [
            "models.experts.svhn=tanganke/clip-vit-base-patch32_svhn@v1",
            "tasks.svhn={calibration: {path: ./d/svhn, split: train}, evaluation: {path: ./d/svhn, split: test}}",
        ],
    )
    assert params.models.experts["svhn"].revision == "v1"
    assert params.tasks["svhn"].calibration.kind == "local"


def test_dump_round_trips(tmp_path):
    params = load_params(EXAMPLE, ["models.base.trust_remote_code=true", "featcal.alpha=0.5"])
    assert load_params(write(tmp_path, dump(params))) == params


def test_flatten():
    flat = flatten(load_params(EXAMPLE))
    assert flat["featcal.alpha"] == 0.25
    assert flat["featcal.enabled"] is True
    assert "featcal.pooling" not in flat  # null: not set
    assert flat["run.seed"] == 0
    assert flat["merge.hyperparameters.scale"] == 0.3
    assert flat["models.base"] == "./data/zoo/clip-vit-base-patch32"
    assert flat["models.experts.mnist.trust_remote_code"] is False
    assert flat["tasks.mnist.calibration.split"] == "train"
    assert flat["tasks.mnist.templates"] == '["a photo of the number: \\"{}\\"."]'
    assert all(isinstance(v, (str, int, float, bool)) for v in flat.values())


def test_flatten_summarises_long_lists(tmp_path):
    data = minimal()
    data["tasks"]["mnist"]["class_names"] = [f"a rather long class name {i}" for i in range(200)]
    value = flatten(load_params(write(tmp_path, data)))["tasks.mnist.class_names"]
    assert value.startswith("<200 items, sha256 ")


def test_calibration_settings(tmp_path):
    base = load_params(EXAMPLE).calibration_settings()
    assert base["featcal"]["alpha"] == 0.25 and base["seed"] == 0
    assert base["calibration_data"]["mnist"]["split"] == "train"
    assert base["models"]["experts"]["svhn"] == "./data/zoo/clip-vit-base-patch32_svhn"
    same = [
        "featcal.device=cuda",
        "featcal.batch_size=3",
        "evaluation.batch_size=1",
        "tracking.experiment=other",
        "tasks.mnist.evaluation.split=validation",
        "tasks.mnist.templates=['{}']",
        "run.name=x",
    ]
    assert load_params(EXAMPLE, same).calibration_settings() == base
    for override in [
        "featcal.alpha=0.5",
        "run.seed=1",
        "merge.hyperparameters.scale=0.4",
        "tasks.svhn.calibration.path=./other",
        "featcal.num_per_task=8",
    ]:
        assert load_params(EXAMPLE, [override]).calibration_settings() != base, override


def test_import_light():
    code = "import sys, featcal_core.params; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        (
            lambda d: d.update(colour="red"),
            "colour",
            "unknown key; known keys: compare, evaluation, featcal",
        ),
        (lambda d: d.update(featcal={"alhpa": 0.3}), "featcal.alhpa", "known keys: alpha"),
        (
            lambda d: d["tasks"]["mnist"]["calibration"].update(colum="x"),
            "tasks.mnist.calibration.colum",
            "unknown key",
        ),
        (
            lambda d: d.update(featcal={"alpha": "abc"}),
            "featcal.alpha",
            "Input should be a valid number (got 'abc')",
        ),
        (
            lambda d: d.update(featcal={"num_per_task": 0}),
            "featcal.num_per_task",
            "greater than or equal to 1",
        ),
        (lambda d: d.update(featcal={"alpha": 1.5}), "featcal.alpha", "less than or equal to 1"),
        (
            lambda d: d.update(featcal={"device": "tpu"}),
            "featcal.device",
            "'cpu', 'cuda' or 'auto'",
        ),
        (
            lambda d: d.update(merge={"method": "magic"}),
            "merge.method",
            "unknown merge method 'magic' (--method); available: average, breadcrumbs, dare_task_arithmetic",
        ),
        (lambda d: d["models"].pop("base"), "models.base", "required"),
        (lambda d: d.pop("tasks"), "tasks", "required"),
        (lambda d: d["models"].update(experts={}), "models.experts", "at least 1 item"),
        (lambda d: d["models"]["experts"].update(svhn="./zoo/svhn"), "tasks", "add tasks.svhn"),
        (
            lambda d: d["tasks"].update(svhn=d["tasks"]["mnist"]),
            "tasks.svhn",
            "add models.experts.svhn",
        ),
        (
            lambda d: d["tasks"]["mnist"]["calibration"].update(split="test"),
            "tasks.mnist.calibration",
            "calibration must come from train data",
        ),
        (
            lambda d: d["models"].update(base="not a hub id"),
            "models.base",
            "neither a local directory nor a Hub id",
        ),
        (
            lambda d: d["models"]["experts"].update(mnist="a/b/c@main"),
            "models.experts.mnist",
            "Hub id",
        ),
        (
            lambda d: d["models"].update(base={"ref": "o/n", "trust": True}),
            "models.base.trust",
            "unknown key",
        ),
        (
            lambda d: d["tasks"]["mnist"]["calibration"].update(hub="bad id!"),
            "tasks.mnist.calibration.hub",
            "not a Hub dataset id",
        ),
        (
            lambda d: d["tasks"]["mnist"]["evaluation"].update(hub="svhn"),
            "tasks.mnist.evaluation.hub",
            "legacy one-word Hub dataset id, which current huggingface_hub releases refuse (after the datasets before it have downloaded); use 'ufldl-stanford/svhn'",
        ),
        (
            lambda d: d["tasks"]["mnist"]["calibration"].update(hub="beans"),
            "tasks.mnist.calibration.hub",
            "use the dataset's namespaced id (owner/name)",
        ),
        (
            lambda d: d["tasks"]["mnist"]["calibration"].update(path="./x"),
            "tasks.mnist.calibration",
            "exactly one of hub",
        ),
        (
            lambda d: d["tasks"]["mnist"]["evaluation"].pop("split"),
            "tasks.mnist.evaluation.split",
            "needs a split",
        ),
        (
            lambda d: d["tasks"]["mnist"].update(templates=["a photo of {}", "no slot"]),
            "tasks.mnist.templates[1]",
            "has no {}",
        ),
        (
            lambda d: d.update(featcal={"dask_address": "tcp://h:8786"}),
            "featcal.dask_address",
            "runner: dask",
        ),
        (
            lambda d: d.update(featcal={"runner": "dask", "dask_workers": 0}),
            "featcal.dask_workers",
            "greater than or equal to 1",
        ),
        (
            lambda d: d["tasks"]["mnist"].update(prompt="no slot"),
            "tasks.mnist.prompt",
            "has no {text}",
        ),
        (
            lambda d: d["tasks"]["mnist"].update(prompt="{text} {label}"),
            "tasks.mnist.prompt",
            "must format with {text} only",
        ),
        (
            lambda d: d["tasks"]["mnist"].update(label_words=["yes"]),
            "tasks.mnist.label_words",
            "at least 2 items",
        ),
    ],
)
def test_invalid(tmp_path, change, key, words):
    data = minimal()
    change(data)
    message = error_of(write(tmp_path, data))
    assert message.startswith(f"{tmp_path / 'params.yaml'}: {key}: "), message
    assert words in message, message


def test_dask_address_with_dask_runner_is_fine(tmp_path):
    data = minimal(featcal={"runner": "dask", "dask_address": "tcp://h:8786"})
    assert load_params(write(tmp_path, data)).featcal.dask_address == "tcp://h:8786"


def test_bad_override_value_names_the_override(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["featcal.alpha=abc"])
    assert "featcal.alpha: Input should be a valid number" in message
    assert "(set by override 'featcal.alpha=abc')" in message


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("featcal.alhpa=0.3", "featcal.alhpa is not a key"),
        ("nope=1", "nope is not a key"),
        ("tasks.mnist.calibration.colour=red", "tasks.mnist.calibration.colour is not a key"),
        ("featcal.runner.x=1", "featcal.runner takes a value, not keys"),
        ("tasks.mnist.templates.x=1", "tasks.mnist.templates takes a value, not keys"),
        ("featcal.alpha", "expected KEY.PATH=VALUE"),
        ("featcal..alpha=1", "expected KEY.PATH=VALUE"),
    ],
)
def test_bad_override_key(tmp_path, override, words):
    message = error_of(write(tmp_path, MINIMAL), [override])
    assert message.startswith(f"override {override!r}: "), message
    assert words in message, message


def test_override_below_a_scalar_in_the_file(tmp_path):
    path = write(tmp_path, minimal(featcal=3))
    message = error_of(path, ["featcal.alpha=0.3"])
    assert f"featcal in {path} is 3, not a mapping" in message


def test_missing_file(tmp_path):
    message = error_of(tmp_path / "nope.yaml")
    assert message.startswith(f"{tmp_path / 'nope.yaml'}: file not found")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- a\n- b\n", "expected a mapping"),
        ("just a string\n", "expected a mapping"),
        ("", "is empty"),
        ("models: [unclosed\n", "not valid YAML (line"),
    ],
)
def test_not_a_mapping(tmp_path, text, words):
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'params.yaml'}: "), message
    assert words in message, message


# ------------------------------------------------------------------------------------ ModelRef


def test_model_ref_hub_with_revision():
    ref = ModelRef.model_validate("openai/clip-vit-base-patch32@main")
    assert (ref.kind, ref.repo_id, ref.revision, ref.path) == (
        "hub",
        "openai/clip-vit-base-patch32",
        "main",
        None,
    )
    assert ref.trust_remote_code is False


def test_model_ref_hub():
    ref = ModelRef.model_validate("owner/name")
    assert (ref.kind, ref.repo_id, ref.revision, ref.path) == ("hub", "owner/name", None, None)


def test_model_ref_local():
    ref = ModelRef.model_validate("./local/dir")
    assert (ref.kind, ref.repo_id, ref.revision, ref.path) == (
        "local",
        None,
        None,
        Path("local/dir"),
    )
    ref = ModelRef.model_validate("/abs/dir")
    assert (ref.kind, ref.path) == ("local", Path("/abs/dir"))
    assert ModelRef.model_validate("~/models/x").path == Path.home() / "models" / "x"


def test_model_ref_existing_directory_is_local(tmp_path, monkeypatch):
    (tmp_path / "zoo" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert ModelRef.model_validate("zoo/base").kind == "local"
    assert ModelRef.model_validate("zoo/other").kind == "hub"


def test_model_ref_mapping_form():
    ref = ModelRef.model_validate({"ref": "owner/name@v2", "trust_remote_code": True})
    assert (ref.kind, ref.repo_id, ref.revision, ref.trust_remote_code) == (
        "hub",
        "owner/name",
        "v2",
        True,
    )
    assert ref.to_yaml() == {"ref": "owner/name@v2", "trust_remote_code": True}
    assert ModelRef.model_validate("owner/name").to_yaml() == "owner/name"


def test_model_ref_mapping_form_in_params(tmp_path):
    data = minimal()
    data["models"]["base"] = {"ref": "owner/name", "trust_remote_code": True}
    params = load_params(write(tmp_path, data))
    assert isinstance(params, Params)
    assert params.models.base.trust_remote_code is True
    assert params.models.experts["mnist"].trust_remote_code is False


def test_shipped_params_files_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for path in [root / "params.yaml", *sorted((root / "params").glob("*.yaml"))]:
        params = load_params(path)
        # either models and tasks written out, or a zoo that provides them
        assert (params.models is not None and params.models.experts and params.tasks) or (
            params.zoo is not None and params.models is None and params.tasks is None
        ), path


def test_choice_compares_run_the_root_candidates():
    """params/compare-demo.yaml and compare-unseen.yaml measure the root select: choice: their
    variants are the root candidates, same names and settings, plus `ta` (the reference merge)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    main = load_params(root / "params.yaml")
    candidates = {c.name: c.set for c in main.select.candidates}
    # the demo's compare measures the zoo `./scripts/demo` builds, not another one
    demo = load_params(root / "params" / "compare-demo.yaml")
    assert demo.zoo.path == main.zoo.path
    assert demo.zoo.spec().fingerprint() == main.zoo.spec().fingerprint()
    for name in ("compare-demo.yaml", "compare-unseen.yaml"):
        variants = {v.name: v.set for v in load_params(root / "params" / name).compare.variants}
        assert variants.pop("ta") == [
            "merge.method=task_arithmetic",
            "merge.hyperparameters={scale: 0.3}",
            "repair.method=none",
        ], name
        assert variants == candidates, name


def test_calibrate_flags_and_params_yaml_agree():
    """`featcal calibrate`'s flags are the params schema's fields: same defaults, same choices,
    the description in --help; a flag whose default drifts from params.yaml's fails here."""
    import argparse

    from featcal_cli.main import build_parser
    from featcal_core.params import FeatCalSettings, RunSettings

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    calibrate = sub.choices["calibrate"]
    flags = {a.dest: a for a in calibrate._actions}
    # --results-dir of `featcal calibrate` is its resumable state folder (off by default), not
    # the pipeline's run.results_dir
    other_meaning = {"results_dir"}
    compared = 0
    for model, section in ((FeatCalSettings, "featcal"), (RunSettings, "run")):
        for name, info in model.model_fields.items():
            if name not in flags or name in other_meaning:
                continue
            action = flags[name]
            assert action.default == info.default, name
            assert f"params: {section}.{name}" in action.help, name
            compared += 1
    assert compared >= 14  # α, ρ, λ, ε, counts, device, pooling, weighting, heads λ, runner, seed
    args = parser.parse_args(["calibrate"])
    assert (args.alpha, args.rho, args.lam, args.num_per_task) == (0.25, 2.2, 0.05, 256)


def test_params_reference_page_is_generated_from_the_schema():
    """docs/params.md is `python -m featcal_core.params.reference`'s output: a field added, a
    default or a description changed without regenerating the page fails here."""
    from featcal_core.params.reference import markdown

    page = ROOT / "docs" / "params.md"
    assert page.read_text() == markdown(), (
        "docs/params.md is stale: run .venv/bin/python -m featcal_core.params.reference > "
        "docs/params.md"
    )
    assert "`featcal.precision`" in page.read_text()


def test_merge_hyperparameters_take_words_and_methods_check_them():
    """params.yaml can choose TIES's paper trim (a word) and DARE's seed (a number); the method
    refuses an unknown word with its choices."""
    from featcal_core.params.sections import MergeSettings

    ties = MergeSettings(method="ties", hyperparameters={"trim": "global", "top_k": 10})
    assert ties.hyperparameters == {"trim": "global", "top_k": 10.0}
    assert MergeSettings(method="dare_ties", hyperparameters={"seed": 3}).hyperparameters == {
        "seed": 3.0
    }
    with pytest.raises(ValueError, match="'trim'.*one of 'tensor', 'global'"):
        MergeSettings(method="ties", hyperparameters={"trim": "glob"})


def test_the_repair_section_is_built_from_the_repair_registry():
    """Every `repair:` key is a registered repair's option, with the option's default; the
    algorithms' own defaults are the same values (both read featcal_core.repair.defaults)."""
    from featcal_core.params.repair import RepairSettings
    from featcal_core.repair import DEFAULT_ALPHA, adamerging, surgery
    from featcal_core.repair.registry import available, get

    options = {o.key: o for name in available() for o in get(name).params_options()}
    fields = RepairSettings.model_fields
    assert set(fields) == {"method", *options}
    assert all(fields[key].default == option.default for key, option in options.items())
    defaults = {key: option.default for key, option in options.items()}
    assert defaults["regmean_alpha"] == DEFAULT_ALPHA
    assert (defaults["surgery_rank"], defaults["surgery_steps"], defaults["surgery_lr"]) == (
        surgery.DEFAULT_RANK,
        surgery.DEFAULT_STEPS,
        surgery.DEFAULT_LR,
    )
    assert (
        defaults["adamerging_steps"],
        defaults["adamerging_lr"],
        defaults["adamerging_init"],
    ) == (adamerging.DEFAULT_STEPS, adamerging.DEFAULT_LR, adamerging.DEFAULT_INIT)
    with pytest.raises(ValueError, match="unknown repair 'nope'; one of: featcal"):
        RepairSettings(method="nope")
