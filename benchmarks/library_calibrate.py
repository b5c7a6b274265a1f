"""One `featcal_core.calibrate` in its own process, from a JSON spec: the benchmarks' way to
calibrate on a machine without the pipeline's packages (the device tool's GPU image has no
Prefect, which the `featcal` command needs). Used by calibrate_vit_b32.py --library and
llm_block_time.py.

    python3 benchmarks/library_calibrate.py '{"base": ..., "merged": ..., "experts": {...},
        "calib": {...}, "out": ..., "options": {calibrate's keywords}, "profile": N}'

`profile` N > 0 prints the N top functions of a cProfile of the call (by cumulative and by own
time). featcal_core is imported only here, in the child.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def command(spec: dict) -> list[str]:
    """The argv that runs `spec` in a child process."""
    return [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)]


def main() -> None:
    import cProfile
    import logging
    import pstats

    from featcal_core import calibrate

    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(sys.argv[1])
    profile = cProfile.Profile() if spec.get("profile") else None
    if profile:
        profile.enable()
    calibrate(
        spec["base"],
        spec["merged"],
        spec["experts"],
        spec["calib"],
        spec["out"],
        overwrite=True,
        progress=False,
        **spec.get("options", {}),
    )
    if profile:
        profile.disable()
        print("profile of featcal_core.calibrate,", spec.get("options", {}).get("precision"))
        for key in ("cumulative", "tottime"):
            pstats.Stats(profile).sort_stats(key).print_stats(spec["profile"])


if __name__ == "__main__":
    main()
