"""The command line's output: quiet by default (featcal's steps, blocks and results at INFO; other
modules from WARNING; the libraries' progress bars off), -v / -vv anywhere on the line."""

from __future__ import annotations

import logging
import os
import sys

from featcal_cli.main import ConsoleThreshold, build_parser, configure_logging, split_verbosity


def test_verbose_flags_anywhere_on_the_line():
    assert split_verbosity(["lineage", "p", "-v"]) == (["lineage", "p"], 1)
    assert split_verbosity(["-v", "calibrate", "--verbose"]) == (["calibrate"], 2)
    assert split_verbosity(["report", "-vv"]) == (["report"], 2)
    args = build_parser().parse_args(split_verbosity(["lineage", "somewhere", "-v"])[0])
    assert args.command == "lineage" and args.path == "somewhere"


def test_quiet_by_default_loud_on_request(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    configure_logging(0)
    console = ConsoleThreshold(logging.WARNING)  # the console's filter, quiet
    record = logging.LogRecord(
        "featcal_core.evaluation.accuracy", logging.INFO, "", 0, "", (), None
    )
    assert logging.getLogger(record.name).isEnabledFor(logging.INFO)  # for the Prefect UI
    assert not console.filter(record)  # recorded (the Prefect UI gets it), not shown
    assert logging.getLogger("featcal.tasks.evaluate").isEnabledFor(logging.INFO)
    assert not logging.getLogger("transformers").isEnabledFor(logging.INFO)
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    configure_logging(1)
    console.level = logging.INFO  # -v
    assert console.filter(record)
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    # quiet on a terminal: the Hub's download bars stay on (bytes of a multi-GB download)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    configure_logging(0)
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"


def test_run_ends_with_a_table_and_where_the_record_is():
    from featcal.flows.summary import run_summary

    row = {
        "expert": {"accuracy": 0.9},
        "merged": {"accuracy": 0.5},
        "calibrated": {"accuracy": 0.7},
    }
    text = run_summary(
        {
            "evaluation": {"mnist": row},
            "report": "reports/x/report.html",
            "mlflow_run_id": "abc",
            "mlflow_uri": "sqlite:///m.db",
            "paths": {"root": "data/results"},
        }
    )
    lines = text.splitlines()
    assert any(line.startswith("mnist") and "90.0" in line and "70.0" in line for line in lines)
    assert "report:      reports/x/report.html" in lines and "results:     data/results" in lines
    assert build_parser().parse_args(["run", "--json"]).json
    assert build_parser().parse_args(["evaluate", "--json"]).json


def test_help_imports_neither_torch_nor_the_orchestration():
    """`featcal --help` and every `featcal <command> --help` build their parsers without torch,
    transformers, Prefect, MLflow or DVC (what made each take 3-4 s); `featcal merge --help`
    lists the registered methods from their modules' source, and the same names as the registry,
    which imports torch, finds."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from featcal_cli.main import build_parser\n"
        "parser = build_parser()\n"
        "commands = parser._subparsers._group_actions[0].choices\n"
        "for name, sub in commands.items():\n"
        "    sub.format_help()\n"
        "parser.format_help()\n"
        "methods = commands['merge']._actions[3].choices\n"
        "assert 'ties' in list(methods) and 'ties' in methods and 'nope' not in methods\n"
        "heavy = ('torch', 'transformers', 'prefect', 'mlflow', 'dvc', 'datasets')\n"
        "print(len(commands), sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, loaded = done.stdout.split(" ", 1)
    assert int(count) >= 10 and loaded.strip() == "[]", done.stdout
    from featcal_core.merging import available, declared_names

    assert declared_names() == available()


def test_zoo_step_without_a_zoo_section_writes_its_note_atomically(tmp_path, capsys):
    """The DVC zoo stage on a params file without zoo: writes only its note, through the guarded
    writer (no temporary left, an existing note replaced whole)."""
    from pathlib import Path

    from featcal_cli.main import main

    paper = Path(__file__).resolve().parents[1] / "params" / "paper-clip-vit-b32.yaml"
    out = tmp_path / "zoo"
    for _ in range(2):
        assert main(["zoo", "--params", str(paper), "--out", str(out)]) == 0
        assert [p.name for p in out.iterdir()] == ["NO_ZOO.md"]
    assert "no zoo: section" in (out / "NO_ZOO.md").read_text()
    assert "nothing to build" in capsys.readouterr().out
