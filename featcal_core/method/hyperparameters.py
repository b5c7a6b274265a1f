"""FeatCal's hyperparameters: defaults and bounds, defined once (import-light: no torch).

`FeatCalParams` checks itself, so the library refuses what params.yaml and the CLI refuse;
featcal_core/params/sections.py builds its `featcal:` schema from `DEFAULTS` and `BOUNDS`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from featcal_core.errors import FeatCalError

#: inclusive range of each hyperparameter (None: unbounded above)
BOUNDS: dict[str, tuple[float, float | None]] = {
    "alpha": (0.0, 1.0),  # teacher interpolation α
    "rho": (0.0, 10.0),  # anchor blend ρ (> 1 extrapolates past the merge)
    "lam": (0.0, None),  # ridge weight λ
    "eps": (0.0, 1.0),  # jitter ε
}


@dataclass(frozen=True)
class FeatCalParams:
    """FeatCal hyperparameters (defaults: the authors' demo), each finite and within BOUNDS."""

    alpha: float = 0.25  # teacher interpolation α
    rho: float = 2.2  # anchor blend ρ
    lam: float = 0.05  # ridge λ
    eps: float = 1e-8  # jitter ε

    def __post_init__(self) -> None:
        for name, (low, high) in BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FeatCalError(f"FeatCal {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                wanted = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
                raise FeatCalError(f"FeatCal {name} must be finite and {wanted}, got {value!r}")


#: the default of each hyperparameter
DEFAULTS: dict[str, float] = asdict(FeatCalParams())
