"""Command-line errors: every error is one line on stderr,
`featcal: error: ...`, exit status 2, naming the flag the user typed; numbers in flags, `--hp`
and `--set` are read by params.yaml's one rule (YAML 1.2 / Python: 1e-3, 1E3, -2e-1, .5, +1.5).

All in-process (`featcal_cli.main.main`) and cheap: every check runs before any work, so the
inputs are paths that do not exist.
"""

from __future__ import annotations

import re

import pytest

from featcal_cli.main import build_parser, main
from featcal_core.errors import FeatCalError
from featcal_core.params import load_params


def _subcommands() -> dict:
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _numeric_flags() -> list[tuple[str, str, str]]:
    """(command, flag, "number" or "integer") for every flag of every command whose value is a
    number (the types `featcal_cli.arguments.number` / `integer`): a new numeric flag is covered
    automatically."""
    found = []
    for name, parser in _subcommands().items():
        for action in parser._actions:
            kind = getattr(action.type, "__name__", None)
            assert kind not in ("int", "float"), (
                f"featcal {name} {action.option_strings}: use arguments.number()/integer(), "
                "which read numbers by params.yaml's rule and refuse nan/inf"
            )
            if kind in ("number", "integer"):
                found.append((name, action.option_strings[-1], kind))
    return found


#: a value in range for the flag's type but out of its bounds ("-1" unless listed)
OUT_OF_RANGE = {"--scale": ".inf", "--top-k": "0"}

NUMERIC_FLAGS = _numeric_flags()
#: (command, flag, bad value): text, a value out of the flag's bounds, and for whole-number
#: flags a fraction
BAD_VALUES = [
    (command, flag, value)
    for command, flag, kind in NUMERIC_FLAGS
    for value in ("abc", OUT_OF_RANGE.get(flag, "-1"), *(("1.5",) if kind == "integer" else ()))
]

#: the least each command needs to reach its checks (paths that do not exist: nothing is read)
REQUIRED = {
    "merge": [
        "--base",
        "{tmp}/b",
        "--expert",
        "t={tmp}/e",
        "--method",
        "ties",
        "--out",
        "{tmp}/out",
    ],
    "calibrate": [
        "--base",
        "{tmp}/b",
        "--merged",
        "{tmp}/m",
        "--expert",
        "t={tmp}/e",
        "--calib",
        "t={tmp}/c",
        "--out",
        "{tmp}/out",
    ],
    "regmean": [
        "--base",
        "{tmp}/b",
        "--merged",
        "{tmp}/m",
        "--expert",
        "t={tmp}/e",
        "--calib",
        "t={tmp}/c",
        "--out",
        "{tmp}/out",
    ],
    "surgery": [
        "--merged",
        "{tmp}/m",
        "--expert",
        "t={tmp}/e",
        "--calib",
        "t={tmp}/c",
        "--out",
        "{tmp}/out",
    ],
    "adamerging": [
        "--base",
        "{tmp}/b",
        "--merged",
        "{tmp}/m",
        "--expert",
        "t={tmp}/e",
        "--calib",
        "t={tmp}/c",
        "--out",
        "{tmp}/out",
    ],
    "zoo": [
        "--dataset",
        "t={tmp}/d",
        "--modality",
        "text",
        "--base",
        "{tmp}/b",
        "--out",
        "{tmp}/zoo",
    ],
    "demo": ["--synthetic", "--work", "{tmp}/demo"],
    "serve": ["--params", "{tmp}/params.yaml"],
}

_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def _one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("featcal: error: "), err
    assert "usage:" not in err and "Traceback" not in err, err
    return err.strip()


def test_every_command_with_numbers_is_covered():
    commands = {command for command, _, _ in NUMERIC_FLAGS}
    assert commands == set(REQUIRED), commands ^ set(REQUIRED)
    assert len(NUMERIC_FLAGS) >= 35, NUMERIC_FLAGS


@pytest.mark.parametrize(("command", "flag", "value"), BAD_VALUES)
def test_a_bad_number_names_exactly_the_flag_given(command, flag, value, tmp_path, capsys):
    """(b) a bad value of any numeric flag of any command: one line naming that flag and no
    other (before the fix `featcal adamerging --adamerging-batch-size 0` named --batch-size,
    `--seed -1` went unchecked to the libraries, `featcal demo --tasks 0` started a run)."""
    argv = [command, *(a.format(tmp=tmp_path) for a in REQUIRED[command]), flag, value]
    code, err = _run(argv, capsys)
    line = _one_line(err)
    assert code == 2
    named = set(_FLAG.findall(line)) - {"--help"}
    assert named == {flag}, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "zoo").exists()


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        ([], ["a command is required", "see featcal --help"]),
        (["bogus"], ["unknown command 'bogus'", "see featcal --help"]),
        (
            ["merge", "--bogus"],
            ["featcal merge: unrecognized arguments: --bogus", "see featcal merge --help"],
        ),
        (["merge", "--scale"], ["featcal merge --scale: expected one argument"]),
        (["merge", "--scale", "abc"], ["featcal merge --scale: 'abc' is not a number"]),
        (["merge", "--method", "magic"], ["featcal merge --method: invalid choice: 'magic'"]),
        (["merge", "--hp", "oops"], ["featcal merge --hp:", "KEY=VALUE"]),
        (["merge", "--hp", "scale=[1"], ["featcal merge --hp:", "is not a value"]),
        (["calibrate", "--expert", "nodir"], ["featcal calibrate --expert:", "TASK=DIR"]),
        (
            ["surgery", "--expert", "t=e"],
            [
                "featcal surgery: the following arguments are required: --merged, --out",
                "see featcal surgery --help",
            ],
        ),
        (["-v", "lineage"], ["featcal lineage: the following arguments are required: PATH"]),
        (["lineage", "a", "b"], ["featcal lineage: unrecognized arguments: b"]),
        (["calibrate", "--alpha", "nan"], ["featcal calibrate --alpha: 'nan' is not a number"]),
        (["calibrate", "--alpha", ".inf"], ["featcal calibrate --alpha: '.inf' is not a finite"]),
        (["calibrate", "--num-per-task", "1e3"], ["--num-per-task: '1e3' is not a whole number"]),
        (["calibrate", "--heads", "x"], ["featcal calibrate: unrecognized arguments: x"]),
    ],
)
def test_usage_errors_are_one_line_naming_the_command(argv, needles, capsys):
    """(c) argparse's complaints: one line, `featcal: error:`, the command and the flag, and
    where the flags are listed; no usage text; exit status 2 (main returns it)."""
    code, err = _run(argv, capsys)
    line = _one_line(err)
    assert code == 2
    for needle in needles:
        assert needle in line, line


def test_the_parser_alone_still_exits_2(capsys):
    """`build_parser().parse_args` (used by tests and scripts) raises SystemExit(2), as argparse
    does, after the same one line."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["merge", "--top-k", "x"])
    assert info.value.code == 2
    assert _one_line(capsys.readouterr().err).startswith("featcal: error: featcal merge --top-k")
    with pytest.raises(SystemExit) as info:  # --help still prints the help and exits 0
        build_parser().parse_args(["merge", "--help"])
    assert info.value.code == 0 and "--hp KEY=VALUE" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- numbers (8a)
YAML_12_NUMBERS = [
    ("1e-3", 0.001),
    ("1E3", 1000.0),
    ("-2e-1", -0.2),
    (".5", 0.5),
    ("+1.5", 1.5),
    ("1.0e-3", 0.001),
    ("30", 30),
]


@pytest.mark.parametrize(("text", "number"), YAML_12_NUMBERS)
def test_numbers_read_alike_in_hp_set_flags_and_files(text, number, tmp_path):
    """(a) one rule for --hp, --set, number flags and params.yaml: `--hp scale=1e-3` was
    refused as "not a number" (PyYAML reads 1e-3 as text, YAML 1.1)."""
    from featcal_cli.merge_command import _hyperparameter

    key, value, typed = _hyperparameter(f"scale={text}")
    assert (key, value, typed) == ("scale", number, f"--hp scale={text}")
    assert type(value) is type(number)
    args = build_parser().parse_args(["merge", "--scale", text, "--hp", f"seed={text}"])
    assert args.scale == number and args.hp[0][1] == number
    assert build_parser().parse_args(["calibrate", "--lam", text]).lam == number
    params = tmp_path / "p.yaml"
    params.write_text(
        "models: {base: ./b, experts: {t: ./e}}\n"
        "tasks: {t: {calibration: {path: d, split: train}, evaluation: {path: d, split: test}}}\n"
        f"merge: {{method: ties, hyperparameters: {{scale: {text}}}}}\n"
    )
    assert load_params(params).merge.hyperparameters["scale"] == number
    in_bounds = 0 <= number <= 10  # featcal.rho's bounds
    over = load_params(
        params,
        [f"merge.hyperparameters.scale={text}"] + ([f"featcal.rho={text}"] if in_bounds else []),
    )
    assert over.merge.hyperparameters["scale"] == number
    assert over.featcal.rho == (number if in_bounds else over.featcal.rho)


def test_hp_scale_1e_3_reaches_the_merge(tmp_path, capsys):
    """The case of the issue: `featcal merge --hp scale=1e-3` passes the method's check (the
    merge then stops at the missing base, the first thing it reads)."""
    code, err = _run(
        [
            "merge",
            "--base",
            str(tmp_path / "b"),
            "--expert",
            f"t={tmp_path}/e",
            "--method",
            "task_arithmetic",
            "--hp",
            "scale=1e-3",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 2 and "base model directory" in _one_line(err), err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--hp", "scale=true"],
            "hyperparameter 'scale' (--hp scale=true) of merge method "
            "'ties' must be a number, got True",
        ),
        (
            ["--hp", "scale=nan"],
            "(--hp scale=nan) of merge method 'ties' must be a number, got 'nan'",
        ),
        (["--hp", "scale=.nan"], "(--hp scale=.nan) of merge method 'ties' must be finite"),
        (["--hp", "scale=abc"], "must be a number, got 'abc'"),
        (
            ["--hp", "top_k=1E3"],
            "hyperparameter 'top_k' (--hp top_k=1E3) of merge method 'ties' "
            "must be > 0 and <= 100, got 1000.0",
        ),
        (["--top-k", "0"], "hyperparameter 'top_k' (--top-k) of merge method 'ties' must be > 0"),
        (
            ["--hp", "density=0.5"],
            "hyperparameter 'density' (--hp density=0.5) is not used by merge method 'ties'",
        ),
        (
            ["--scale", "2", "--hp", "scale=1e-3"],
            "'scale' is given twice (--scale and --hp scale=1e-3)",
        ),
    ],
)
def test_merge_hyperparameter_errors_name_the_flag_typed(argv, needle, tmp_path, capsys):
    """(a, b) strictness kept (booleans, text and nan are not numbers) and each error names
    the flag the value came with: `--hp KEY=VALUE` or `--top-k`, not a `--<key>` flag that
    does not exist."""
    base = [
        "merge",
        "--base",
        str(tmp_path / "b"),
        "--expert",
        f"t={tmp_path}/e",
        "--method",
        "ties",
        "--out",
        str(tmp_path / "out"),
    ]
    code, err = _run([*base, *argv], capsys)
    assert code == 2 and needle in _one_line(err), err


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "merge.hyperparameters.top_k=20",
            "merge.hyperparameters.top_k: hyperparameter 'top_k' "
            "is not used by merge method 'task_arithmetic'",
        ),
        ("merge.hyperparameters.scale=true", "merge.hyperparameters"),
        ("featcal.num_per_task=1.5", "featcal.num_per_task: Input should be a valid integer"),
        ("featcal.num_per_task=1e3", "featcal.num_per_task: Input should be a valid integer"),
        ("featcal.alpha=true", "featcal.alpha: Input should be a valid number"),
        ("featcal.alpha=nan", "featcal.alpha: Input should be a valid number"),
        ("featcal.lam=.inf", "featcal.lam: Input should be a finite number"),
    ],
)
def test_set_overrides_keep_the_strict_types_and_name_the_key(override, needle, tmp_path):
    """--set: `1e3` is a number but not an integer, `true` and `nan` are not numbers; a merge
    hyperparameter's error names its key path, not a flag of `featcal merge`."""
    params = tmp_path / "p.yaml"
    params.write_text(
        "models: {base: ./b, experts: {t: ./e}}\n"
        "tasks: {t: {calibration: {path: d, split: train}, evaluation: {path: d, split: test}}}\n"
    )
    with pytest.raises(FeatCalError) as info:
        load_params(params, [override])
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    assert not _FLAG.findall(message), message


@pytest.mark.parametrize(
    "text,value",
    [
        ("010", 10),
        ("1:30", "1:30"),
        ("1_000", "1_000"),
        ("0x10", 16),
        ("1e3", 1000.0),
        ("-.5", -0.5),
    ],
)
def test_flag_values_follow_yaml_1_2(text, value):
    """What YAML 1.1 alone reads as a number (`1:30` = 90, `1_000`, `010` = 8) is read as YAML
    1.2 and Python read it."""
    from featcal_core.params.base import read_value

    assert read_value(text) == value and type(read_value(text)) is type(value)


def test_verbosity_anywhere_any_count():
    from featcal_cli.main import split_verbosity

    assert split_verbosity(["merge", "-vvv", "--out", "x", "-v"]) == (["merge", "--out", "x"], 4)
