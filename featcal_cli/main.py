"""`featcal` console entry point. Bad input ends with one line on stderr and exit status 2.

Every subcommand is a `featcal_cli.arguments.Command` declared in the `COMMANDS` of one command
module; this module only assembles the parser from them and dispatches.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import sys
import typing
from collections.abc import Iterator

from featcal_cli import (
    calibrate_command,
    check_command,
    compare_command,
    demo_command,
    lineage_command,
    merge_command,
    open_clip_command,
    params_command,
    pipeline_commands,
    repair_commands,
    zoo_command,
)
from featcal_cli.arguments import Command, hub_models
from featcal_cli.sigterm import sigterm_stops
from featcal_core.errors import FeatCalError
from featcal_core.log_detail import is_detail, is_reported

EXIT_BAD_INPUT = 2

#: the command modules, in the order `featcal --help` lists their commands
MODULES = (
    demo_command,
    pipeline_commands,
    check_command,
    params_command,
    merge_command,
    calibrate_command,
    compare_command,
    repair_commands,
    lineage_command,
    open_clip_command,
    zoo_command,
)


def commands() -> dict[str, Command]:
    """Every subcommand by name (a name declared twice is a programming error)."""
    table: dict[str, Command] = {}
    for module in MODULES:
        for command in module.COMMANDS:
            if command.name in table:
                raise RuntimeError(f"featcal {command.name} is declared twice")
            table[command.name] = command
    return table


class UsageError(SystemExit):
    """A command line the parser refused; its one line is already on stderr. Exit status 2
    (`main` returns it; a caller of `parse_args` sees SystemExit(2), as with argparse)."""


#: argparse's "argument --flag: problem"
_ARGUMENT = re.compile(r"argument (?P<flag>[^:]+): (?P<problem>.*)")
#: a negative number is a flag's value, not an option: -2e-1 and -.5 as well as argparse's -1
_NEGATIVE_NUMBER = re.compile(r"^-(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def usage_line(prog: str, message: str) -> str:
    """argparse's complaint `message` about a command line of `prog` ("featcal" or "featcal
    <command>") as the one line after `featcal: error: `: the command, the flag and what is
    wrong, then where the flags are listed (`featcal <command> --help`)."""
    message = " ".join(message.split())
    found = _ARGUMENT.fullmatch(message)
    if prog == "featcal":  # the top level: the command itself is wrong or missing
        if found and found["flag"] == "command":
            message = found["problem"].replace("invalid choice:", "unknown command", 1)
        elif message == "the following arguments are required: command":
            message = "a command is required (featcal COMMAND [FLAGS])"
        return f"{message}; see featcal --help"
    where = f"{prog} {found['flag']}: {found['problem']}" if found else f"{prog}: {message}"
    return f"{where}; see {prog} --help"


class FeatCalParser(argparse.ArgumentParser):
    """The parser of `featcal` and of each of its commands: every complaint (a bad or missing
    flag, a value of the wrong type, an unknown command or flag) is one line on stderr,
    `featcal: error: featcal <command> --flag: what is wrong; see featcal <command> --help`,
    and exit status 2 (UsageError), as every other error of featcal is; no usage text.
    Negative numbers in any notation (`--lam -2e-1`) are values, not flags."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> typing.NoReturn:
        self.fail(self.prog, message)

    @staticmethod
    def fail(prog: str, message: str) -> typing.NoReturn:
        print(f"featcal: error: {usage_line(prog, message)}", file=sys.stderr)
        raise UsageError(EXIT_BAD_INPUT)

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # argparse names the top level here; name the command they were given to
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command and self.prog == "featcal" else self.prog
            self.fail(prog, f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = FeatCalParser(prog="featcal", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more output, anywhere on the command line: -v every module's log "
        "and the libraries' progress bars, -vv debug",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=FeatCalParser)
    for command in commands().values():
        command.add_arguments(
            sub.add_parser(command.name, help=command.help, description=command.help)
        )
    return parser


def split_verbosity(argv: list[str]) -> tuple[list[str], int]:
    """argv without its -v / -vv / --verbose flags (accepted anywhere), and their count."""
    rest, count = [], 0
    for arg in argv:
        if arg == "--verbose":
            count += 1
        elif re.fullmatch(r"-v+", arg):  # -v, -vv, -vvv ...
            count += len(arg) - 1
        else:
            rest.append(arg)
    return rest, count


#: featcal's own loggers (and every logger below them); any other logger is a library's
OWN_LOGGERS = ("featcal", "featcal_core", "featcal_cli")

#: own loggers whose INFO lines the console shows when quiet (but their detail lines,
#: featcal_core.log_detail): the run's steps and results, and a stage's progress off a terminal
#: (featcal_core.progress: a line per 10 %)
QUIET_INFO = ("featcal", "featcal_cli", "featcal_core.progress")


#: libraries that set their own level (and handler) when imported, from an environment switch:
#: (logger, the switch it reads); the user's own setting of a switch wins
#: the logger of MLflow's SQL store (see configure_logging)
MLFLOW_STORE_LOGGER = "mlflow.store.db.utils"
LIBRARY_SWITCHES = (
    ("datasets", "DATASETS_VERBOSITY"),
    ("transformers", "TRANSFORMERS_VERBOSITY"),
    ("huggingface_hub", "HF_HUB_VERBOSITY"),
    ("mlflow", "MLFLOW_LOGGING_LEVEL"),
)


def _below(name: str, loggers: tuple[str, ...]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in loggers)


def own_logger(name: str) -> bool:
    """Whether the logger `name` is featcal's own (OWN_LOGGERS or below one), not a library's."""
    return _below(name, OWN_LOGGERS)


class ConsoleThreshold(logging.Filter):
    """The filter on featcal's console handler (the root logger's): a record shows from `level`
    up, whatever its logger (a library's, present or imported later, whatever level it set on
    itself: httpx2's request lines, MLflow's, alembic's); below it, an INFO record of featcal's
    QUIET_INFO loggers shows unless it is a detail line (featcal_core.log_detail: per block,
    per candidate, per task). A record of a failure the command reports in its own one line
    (featcal_core.log_detail.REPORTED) never shows. flows.progress carries it over to the
    handler that prints above the bar."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if is_reported(record):
            return False
        if record.levelno >= self.level:
            return True
        return (
            record.levelno >= logging.INFO
            and _below(record.name, QUIET_INFO)
            and not is_detail(record)
        )


def configure_logging(verbosity: int) -> None:
    """Quiet by default, on the console: featcal's step and result lines at INFO (QUIET_INFO,
    but their detail lines), its other modules' and every other logger's (any library, present
    or imported later) from WARNING: the console's ConsoleThreshold and the root logger's level,
    so no library's INFO lines (httpx2's HTTP requests) without -v; the libraries' progress bars
    off. -v: everything at INFO, with bars; -vv: DEBUG. featcal's own loggers record from INFO
    at every verbosity (DEBUG with -vv): what the console leaves out still reaches the Prefect
    UI beside a flow run (flows.environment). Libraries that set their own level and
    handler when imported (LIBRARY_SWITCHES: datasets, transformers, huggingface_hub, MLflow)
    get it through their switches: ERROR when quiet (e.g. datasets' "using the latest cached
    version" per offline load), WARNING with -v (the user's own setting wins). datasets' records
    print once (through its own handler)."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, when nothing configured the root before
        # (a plain StreamHandler: Prefect keeps a user's root handler when it configures logging)
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        console.addFilter(ConsoleThreshold(level))
        root.addHandler(console)
    for handler in root.handlers:
        for threshold in handler.filters:
            if isinstance(threshold, ConsoleThreshold):
                threshold.level = level
    root.setLevel(level)  # also when something configured the root before
    for name in (*OWN_LOGGERS, *QUIET_INFO):
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(min(level, logging.INFO))
    library = {0: logging.ERROR, 1: logging.WARNING}.get(verbosity, logging.DEBUG)
    for name, switch in LIBRARY_SWITCHES:
        logging.getLogger(name).setLevel(library)
        os.environ.setdefault(switch, logging.getLevelName(library).lower())
    logging.getLogger("datasets").propagate = False  # it has its own handler: not twice
    # MLflow's SQL store logs each failed statement at ERROR with its traceback; featcal
    # reports the failure in one line (tracking_store_failure): the traceback is -v's
    logging.getLogger(MLFLOW_STORE_LOGGER).setLevel(logging.CRITICAL if verbosity == 0 else level)
    if verbosity == 0:
        _library_bars_off()


def _library_bars_off() -> None:
    """transformers' "Loading weights", datasets' "Saving the dataset" and, unless stderr is a
    terminal, the Hub's download bars (on a terminal a multi-GB download shows its bytes): the
    libraries read these switches when imported (later, in this process or the flow's); one
    already imported is switched off directly."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for module, function in (
        ("transformers.utils.logging", "disable_progress_bar"),
        ("datasets.utils.logging", "disable_progress_bar"),
    ):
        if module.split(".")[0] in sys.modules:
            getattr(importlib.import_module(module), function)()


def installed_params(args: argparse.Namespace) -> None:
    """--params NAME (no .yaml, no folder) that is no file: the params file of that name that
    ships with featcal (`featcal params list`; featcal_core.params.installed), replaced by its
    path in place, so that every step and flow reads that file from any working directory."""
    if not isinstance(getattr(args, "params", None), str):
        return
    from featcal_core.params.installed import resolve_params

    path = resolve_params(args.params)
    if str(path) != args.params:
        logging.getLogger("featcal").info("--params %s: the installed %s", args.params, path)
        args.params = str(path)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """What wraps a command's run. SIGTERM (a scheduler stopping the job, `timeout`, `kill`)
    ends it within about a second in any phase: exit status 143, one `featcal: error:` line,
    temporary outputs removed, the processes it started (its Prefect server) stopped, the run
    lock released (featcal_cli/sigterm.py; main thread only, the previous handler restored
    after). The local Prefect server its first flow starts serves its later flows too and stops
    when it ends (flows.environment.command_scope)."""
    from featcal.flows.environment import command_scope

    with sigterm_stops(), command_scope():
        yield


def main(argv: list[str] | None = None) -> int:
    argv, verbosity = split_verbosity(sys.argv[1:] if argv is None else list(argv))
    try:
        args = build_parser().parse_args(argv)
    except UsageError:  # its one line is on stderr already
        return EXIT_BAD_INPUT
    configure_logging(verbosity + args.verbose)  # e.g. -vvv before the command
    try:
        with _sigterm_exits():
            hub_models(args)  # Hub ids wherever a model folder is taken
            installed_params(args)  # --params NAME: a params file that ships with featcal
            return commands()[args.command].run(args)
    except FeatCalError as exc:
        print(f"featcal: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # one line naming the path, never a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"featcal: error:{where}: {exc.strerror or exc}; check that path (space, "
            "permissions, a read-only filesystem)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    except Exception as exc:
        line = tracking_store_failure(exc)
        if line is None:
            raise
        print(f"featcal: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT


def tracking_store_failure(exc: BaseException) -> str | None:
    """The one line for `exc` when it (or an exception it came from) was raised by the MLflow
    tracking store's database layer (featcal.tracking.store.store_failure): what failed, the
    store this command opened, and the fix; None for any other exception."""
    from featcal.tracking.store import opened_store, store_failure

    failure = store_failure(exc)
    if failure is None:
        return None
    store = opened_store()
    where = f" in {store}" if store else ""
    return (
        f"the MLflow tracking store failed ({failure}){where}; free space on its filesystem, "
        "or point tracking.mlflow_tracking_uri (MLFLOW_TRACKING_URI) at another store"
    )


if __name__ == "__main__":
    sys.exit(main())
