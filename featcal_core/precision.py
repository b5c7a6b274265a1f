"""Compute precision: the dtype the heavy products run in (block passes, the statistics' token
products, evaluation forwards, RegMean's Grams), chosen per device.

- "float64": everything in float64 (the audit path the oracle tests are written against);
- "float32": products in float32 (TF32 matmuls on CUDA); sums and solves in float64;
- "bfloat16": forwards under `torch.autocast(dtype=bfloat16)` (weights cast per pass, norms and
  residual sums in float32, autocast's own rules), token products on bfloat16 inputs (on CUDA
  accumulated and returned in float32; on CPU each chunk's product is rounded to bfloat16 before
  it is added to the float64 sums); sums, solves and written weights as in float32;
- "auto": bfloat16 where the hardware runs it natively (CUDA with compute capability ≥ 8.0; a CPU
  with avx512_bf16 or AMX and oneDNN), float32 elsewhere. The choice is the machine's, never the
  load of the moment: nothing is timed, so one machine always makes the same choice and every
  record of it reruns to the same bytes. `$FEATCAL_CPU_BFLOAT16` (1 or 0) overrides what the CPU
  flags say (a CPU whose flagged bfloat16 is slow, or a test of either outcome). A CPU without
  those flags emulates bfloat16 (measured on an avx2-only EPYC: a bfloat16 `torch.mm` at 1.3
  against 171 GFLOP/s in float32, block passes 7× slower).
Float64 checkpoints always run in float64 (they compute in float64 whatever is asked).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)

#: what `precision` may be set to (params `featcal.precision`, `--precision`)
CHOICES = ("auto", "float64", "float32", "bfloat16")
#: the dtype of the token products for each resolved precision
PRODUCT_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
#: below this ridge weight λ the bfloat16 precision keeps its token products in float32 (passes
#: stay bfloat16): an unregularised solve amplifies the products' rounding (measured on a tiny
#: CLIP pool at α 1: λ 0 with bfloat16 products raised block 1's drift from 12.8 to 18.6, the
#: float32 products' 12.8 was kept with bfloat16 passes alone; at λ 0.05 all three agree)
BF16_MIN_LAM = 0.01
#: CPU flags that mean native bfloat16 dot products (oneDNN's fast path)
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: the environment variable that overrides the CPU flags' answer (1: native, 0: emulated)
CPU_BF16_ENV = "FEATCAL_CPU_BFLOAT16"


@dataclass(frozen=True)
class Precision:
    """A resolved precision, what was asked for, why, and whether the device runs it natively
    or emulated (recorded in featcal.json, evaluation.json and MLflow: `record`)."""

    name: str  # float64 | float32 | bfloat16
    reason: str
    requested: str  # auto | float64 | float32 | bfloat16
    execution: str = "native"  # native | emulated (bfloat16 on a device without bfloat16 units)

    @property
    def product(self) -> torch.dtype:
        return PRODUCT_DTYPES[self.name]

    def record(self) -> dict[str, str]:
        """The precision fields of every record: `precision` (what ran), `precision_requested`,
        `precision_reason` and `precision_execution` (native or emulated)."""
        return {
            "precision": self.name,
            "precision_requested": self.requested,
            "precision_reason": self.reason,
            "precision_execution": self.execution,
        }


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bfloat16(device: torch.device) -> tuple[bool, str]:
    """(whether `device` runs bfloat16 products natively, the evidence in words)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return major >= 8, f"{name}, compute capability {major}.{minor}"
    if device.type == "cpu":
        override = os.environ.get(CPU_BF16_ENV, "").strip()
        if override in ("0", "1"):
            return override == "1", f"{CPU_BF16_ENV}={override}"
        if override:
            raise FeatCalError(f"{CPU_BF16_ENV} must be 1 or 0 (got {override!r}); unset it")
        found = [flag for flag in CPU_BF16_FLAGS if flag in _cpu_flags()]
        if found and torch.backends.mkldnn.is_available():
            return True, f"this CPU has {'/'.join(found)}"
        return False, "this CPU has neither avx512_bf16 nor amx_bf16"
    return False, f"{device.type} is not one featcal measured"


def resolve(requested: str, device: torch.device, model_dtype: torch.dtype) -> Precision:
    """The precision that runs for `requested` on `device` with checkpoints of `model_dtype`;
    refuses (one line) bfloat16 on a device that cannot run it."""
    if requested not in CHOICES:
        raise FeatCalError(f"--precision must be one of {', '.join(CHOICES)} (got {requested!r})")
    if model_dtype == torch.float64:  # they compute in float64: nothing narrower runs
        return Precision("float64", "the checkpoints are float64", requested)
    native, evidence = native_bfloat16(device)
    if requested == "auto":
        if native:
            return Precision("bfloat16", f"auto: native bfloat16 ({evidence})", requested)
        return Precision("float32", f"auto: no native bfloat16 ({evidence})", requested)
    if requested == "bfloat16":
        if device.type == "cuda" and not native:
            raise FeatCalError(
                f"--precision bfloat16: {evidence} has no bfloat16 matmuls; use --precision "
                "float32 (or auto)"
            )
        if not native:
            log.warning(
                "--precision bfloat16 on a device without native bfloat16 (%s): it runs, "
                "emulated, slower than float32",
                evidence,
            )
            return Precision(requested, f"asked for; emulated ({evidence})", requested, "emulated")
    return Precision(requested, "asked for", requested)


def pass_dtype(chosen: Precision, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the stems, block passes and hidden streams run in: the checkpoints' own, except
    16-bit checkpoints under float32 (or float64), which run in float32, as asked (on a CPU
    without bfloat16 units, bfloat16 ViT-B/32 block passes ran 7× slower than float32 ones).
    Calibrated weights are written in the checkpoints' dtype either way."""
    if model_dtype in (torch.bfloat16, torch.float16) and chosen.name != "bfloat16":
        return torch.float32
    return model_dtype


def resolve_forwards(
    requested: str, device: torch.device, model_dtype: torch.dtype = torch.float32
) -> Precision:
    """The precision of the forwards that only read features (evaluation, held-out scoring for
    `select:`, head calibration's feature pass) for `requested` on `device` with checkpoints of
    `model_dtype`: resolved as `resolve` does, then float64 runs as float32 (the heads' towers
    hold float32 weights), and the reason says so."""
    chosen = resolve(requested, device, model_dtype)
    if chosen.name == "float64":
        return Precision("float32", f"{chosen.reason}; the heads' towers run in float32", requested)
    return chosen


def products_for(chosen: Precision, lam: float) -> str:
    """The precision of the statistics' token products for passes in `chosen` and ridge `lam`:
    float32 for bfloat16 below BF16_MIN_LAM, else the same."""
    if chosen.name == "bfloat16" and lam < BF16_MIN_LAM:
        return "float32"
    return chosen.name


def autocast(precision: Precision | str, device: torch.device):
    """The context the forwards of `precision` run in: bfloat16 autocast, or nothing."""
    name = precision if isinstance(precision, str) else precision.name
    if name != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def allow_tf32(precision: Precision | str, device: torch.device) -> None:
    """TF32 for float32 matmuls on CUDA (the float32 path's GPU convention)."""
    name = precision if isinstance(precision, str) else precision.name
    if device.type == "cuda" and name == "float32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def product(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None = None):
    """`left @ right` for the statistics' sums: a float32 result from bfloat16 inputs where the
    device can (CUDA); elsewhere in the inputs' dtype, into `out`."""
    if left.dtype == torch.bfloat16 and left.device.type == "cuda":
        return torch.mm(left, right, out_dtype=torch.float32)
    return torch.mm(left, right) if out is None else torch.mm(left, right, out=out)
