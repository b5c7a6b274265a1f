"""One `featcal_core.calibrate` in its own process, from a JSON spec: the benchmarks' way to
calibrate on a machine without the pipeline's packages (the device tool's GPU image has no
Prefect, which the `featcal` command needs). Used by calibrate_vit_b32.py --library and
llm_block_time.py.

    python3 benchmarks/library_calibrate.py '{"base": ..., "merged": ..., "experts": {...},
        "calib": {...}, "out": ..., "options": {calibrate's keywords}, "profile": N}'

`profile` N > 0 prints the N top functions of a cProfile of the call (by cumulative and by own
time). `torch_profile` N > 0 runs the call under `torch.profiler` instead (CPU, and CUDA where
there is a GPU) and prints its N top operators by own host time and, on a GPU, by device time;
`trace` names a file for its Chrome trace. featcal_core is imported only here, in the child.
"""

from __future__ import annotations

import contextlib
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
    with _torch_profile(spec):
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


@contextlib.contextmanager
def _torch_profile(spec: dict):
    """Run the enclosed call under torch.profiler when spec["torch_profile"] > 0."""
    rows = spec.get("torch_profile") or 0
    if rows <= 0:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    precision = spec.get("options", {}).get("precision")
    averages = prof.key_averages()
    print(f"torch.profiler of featcal_core.calibrate, {precision}: by own host time")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    if torch.cuda.is_available():
        print(f"torch.profiler of featcal_core.calibrate, {precision}: by device time")
        print(averages.table(sort_by="self_device_time_total", row_limit=rows))
    if spec.get("trace"):
        prof.export_chrome_trace(spec["trace"])
        print("Chrome trace:", spec["trace"])


if __name__ == "__main__":
    main()
