"""How a calibration runs (not FeatCal's hyperparameters): defaults defined once (import-light:
no torch). featcal_core/params/sections.py builds the matching `featcal:` fields, and so the CLI
flags, from `SETTING_DEFAULTS`."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Settings:
    """How calibration inputs are drawn and run."""

    num_per_task: int = 256  # calibration inputs per task (seeded sample when a set is larger)
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"  # cpu | cuda | auto
    max_length: int = 128  # token limit for text models
    pooling: str | None = None  # cls | mean | None (the architecture's default)
    token_weighting: str = "all"  # all | answer (causal LMs: only positions predicting targets)
    # auto | float64 | float32 | bfloat16: the dtype of the block passes and of the token
    # products feeding the float64 statistics (featcal_core/precision.py); sums and solves are
    # float64 whatever runs; auto: bfloat16 where the device has it natively, else float32
    precision: str = "auto"


#: the default of each setting
SETTING_DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(Settings)}

#: the settings of the `featcal:` section (the seed is `run.seed`), in their order
RUN_SETTINGS: tuple[str, ...] = tuple(name for name in SETTING_DEFAULTS if name != "seed")
