"""Counted FLOPs of a FeatCal calibration at ViT geometry, and this machine's GEMM rate (a
benchmark aid). The counts are naive (every multiply-add is 2 FLOPs, no credit for the symmetric
Gram halves) and follow what `featcal_core.method.statistics` computes for each Linear input:

- forward: three block passes per task and block (merged on the student stream, expert on its
  stream, calibrated on the student stream): Linears 2·N·(4d² + 2·d·f), attention 4·N·S·d;
- statistics, per task and Linear input (d_in, D = Σ d_out): the Gram 2·N·d_in²; then either the
  mixed term 2·N·d_in² and its product with W_t 2·d_in²·D ("via X"), or y = x_t W_tᵀ and xᵀy,
  4·N·d_in·D ("direct"), whichever `LinearInputStats` picks;
- solve, per block and Linear input: Cholesky d_in³/3 and the two triangular solves 2·d_in²·D.
"""

from __future__ import annotations

import time

import torch


def linear_inputs(d: int, f: int) -> list[tuple[int, int]]:
    """(d_in, Σ d_out) of a ViT block's Linear inputs: q/k/v, out_proj, fc1, fc2."""
    return [(d, 3 * d), (d, d), (d, f), (f, d)]


def counted_flops(d: int, f: int, seq: int, blocks: int, tasks: int, images: int) -> dict:
    """FLOPs per phase for `tasks` experts × `images` inputs of `seq` tokens each."""
    n = images * seq
    per_pass = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * seq * d
    statistics = solve = 0
    for d_in, d_out in linear_inputs(d, f):
        via_x = d_in * (n + d_out) < 2 * n * d_out
        gram = 2 * n * d_in * d_in
        cross = (2 * n * d_in * d_in + 2 * d_in * d_in * d_out) if via_x else 4 * n * d_in * d_out
        statistics += gram + cross
        solve += d_in**3 / 3 + 2 * d_in * d_in * d_out
    return {
        "forward": 3 * tasks * blocks * per_pass,
        "statistics": tasks * blocks * statistics,
        "solve": blocks * solve,
    }


def gemm_rate(
    dtype: torch.dtype, size: int = 2048, seconds: float = 2.0, device: str = "cpu"
) -> float:
    """Measured FLOP/s of square GEMMs of `size` in `dtype` on `device` (CPU: all threads)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    torch.mm(a, b, out=out)  # warm up
    sync()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1 if not a.is_cuda else 50):
            torch.mm(a, b, out=out)
            done += 1
        sync()
    return done * 2 * size**3 / (time.perf_counter() - start)


def floor_seconds(flops: dict, rates: dict[str, float], precision: str) -> dict:
    """Seconds each phase would take at the measured GEMM rates (`rates`: dtype name → FLOP/s):
    forward in the precision's pass dtype (float32 for float64 products: the models' own),
    statistics in the products' precision, solves in float64."""
    forward = rates["bfloat16"] if precision == "bfloat16" else rates["float32"]
    return {
        "forward": flops["forward"] / forward,
        "statistics": flops["statistics"] / rates[precision],
        "solve": flops["solve"] / rates["float64"],
    }
