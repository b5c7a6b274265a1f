"""What a repair is, for the registry: `Repair` (its name, hyperparameters, output, step and
`run`), `Option` (one hyperparameter) and `RepairInputs` (what every repair reads and where it
writes). Import-light: no torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from featcal_core.errors import FeatCalError
from featcal_core.method.settings import Settings

#: what a repair leaves in its output folder: one checkpoint (`from_pretrained` loads it), one
#: module per task on the merged checkpoint, or nothing (the merge is evaluated as it is)
Output = Literal["checkpoint", "task_modules", "none"]


@dataclass(frozen=True)
class Option:
    """One hyperparameter of a repair: `<section>.<key>` in params.yaml (unless `in_params` is
    False: a flag of the repair's command only) and `--<flag>` on its command, with its default,
    bounds and help. The params schema and the command's flags are built from it."""

    key: str
    flag: str
    default: bool | int | float
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    in_params: bool = True
    section: str = "repair"  # the params section that holds it (FeatCal's: featcal)

    @property
    def kind(self) -> type:
        """bool, int or float: the type of the default."""
        return type(self.default)


@dataclass(frozen=True)
class RepairInputs:
    """What a repair reads and where it writes: the base model folder (None where the repair
    needs none), the merged checkpoint, {task: expert folder}, {task: calibration set folder},
    the output folder, the run settings (featcal: section and seed), the repair's own option
    values {Option.key: value}, and, for the repairs that fit to the tasks' heads, a function
    returning {task: head} (None: each expert's own head)."""

    base: str | None
    merged: str
    experts: Mapping[str, str]
    calibration_sets: Mapping[str, str]
    out: str
    settings: Settings = Settings()
    options: Mapping[str, Any] = field(default_factory=dict)
    heads: Callable[[], Mapping[str, Any]] | None = None
    spill_dir: str | None = None
    overwrite: bool = False
    progress: bool = True

    def option(self, repair: Repair, key: str) -> Any:
        """The value of `repair`'s option `key`: given, else its default."""
        if key in self.options:
            return self.options[key]
        return next(o.default for o in repair.options if o.key == key)

    def task_heads(self) -> Mapping[str, Any] | None:
        """{task: head} from `heads`, or None (each expert's own head)."""
        return self.heads() if self.heads is not None else None

    def trained(self) -> dict[str, Any]:
        """The keywords every trained repair (Surgery, AdaMerging) takes besides its options:
        the heads, the run settings and seed, the tokenizer folder (the base), overwrite and
        progress."""
        return {
            "heads": self.task_heads(),
            "settings": self.settings,
            "seed": self.settings.seed,
            "tokenizer_dir": self.base,
            "overwrite": self.overwrite,
            "progress": self.progress,
        }


@dataclass(frozen=True)
class CommandSpec:
    """A repair's own command `featcal <name>`: the help of its inputs, whether --base is
    required, and whether it takes --spill-dir."""

    merged: str
    out: str
    base: str
    expert: str | None = None
    base_required: bool = True
    spill_dir: bool = False


@dataclass(frozen=True)
class Repair:
    """One repair of a merged model.

    name: `repair.method` and the command's name; summary: one line, what it does;
    output: what it writes (`Output`); step: its step in `featcal run` (progress display, MLflow
    run); artifact: the MLflow artifact path of its output; run: `(RepairInputs) -> record`
    (None for `none`); options: its hyperparameters; settings: the `featcal:` run settings it
    reads (flags of its command); needs_heads: it fits to the tasks' evaluation heads;
    classification_only: it needs classification heads (causal LMs are refused); blockwise: the
    flows run it block by block, resumable, instead of calling `run` (FeatCal); command: its
    own command (None: none, or one of its own elsewhere); describe: the command's one-line
    summary of a record."""

    name: str
    summary: str
    output: Output
    step: str
    artifact: str
    run: Callable[[RepairInputs], dict] | None
    options: tuple[Option, ...] = ()
    settings: tuple[str, ...] = ()
    needs_heads: bool = False
    classification_only: bool = False
    blockwise: bool = False
    command: CommandSpec | None = None
    describe: Callable[[dict], str] | None = None

    def check(self, values: Mapping[str, Any], where: Callable[[Option], str]) -> dict:
        """`values` ({Option.key: value}, the missing at their defaults) checked against each
        option's type and bounds; FeatCalError names the option by `where(option)` (its flag,
        or its params key)."""
        checked = {}
        for option in self.options:
            value = values.get(option.key, option.default)
            kind = option.kind
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            if kind is bool:
                ok, wanted = isinstance(value, bool), "true or false"
            else:
                ok = is_number and (isinstance(value, int) if kind is int else math.isfinite(value))
                ok = ok and _within(float(value), option)
                wanted = f"a {'whole number' if kind is int else 'number'}{_range(option)}"
            if not ok:
                raise FeatCalError(f"{self.name} {where(option)} must be {wanted} (got {value!r})")
            checked[option.key] = value
        return checked

    def params_options(self) -> tuple[Option, ...]:
        """The options that are params keys of the `repair:` section."""
        return tuple(o for o in self.options if o.in_params and o.section == "repair")


def _within(value: float, option: Option) -> bool:
    """Whether `value` keeps `option`'s bounds."""
    return (
        (option.ge is None or value >= option.ge)
        and (option.gt is None or value > option.gt)
        and (option.le is None or value <= option.le)
    )


def _range(option: Option) -> str:
    """' in [0, 1]', ' >= 1', ' > 0' or '' for an option's bounds."""
    low = option.ge if option.ge is not None else option.gt
    if low is not None and option.le is not None:
        return f" in {'[' if option.ge is not None else '('}{low:g}, {option.le:g}]"
    if low is not None:
        return f" {'>=' if option.ge is not None else '>'} {low:g}"
    return f" <= {option.le:g}" if option.le is not None else ""
