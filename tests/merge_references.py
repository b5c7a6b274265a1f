"""Plain in-memory float64 references of the merge methods' definitions, written independently of
featcal_core.merging (straight from the papers and the authors' code, no chunking, no streaming):
tests/test_merge_methods.py compares the registry's methods against them."""

from __future__ import annotations

import math

import torch


def task_vectors(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """τ stacked: (T, *S) float64."""
    return torch.stack([e.double() - base.double() for e in experts])


def disjoint_mean(taus: torch.Tensor) -> torch.Tensor:
    """TIES steps 3–4 on (T, *S): γ = sign(Σ τ), mean of the nonzero τ agreeing with γ."""
    sign = torch.sign(taus.sum(0))
    agree = (torch.sign(taus) == sign) & (taus != 0)
    total = (taus * agree).sum(0)
    count = agree.sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def dare(base, experts, masks, drop_rate, scale, ties: bool) -> torch.Tensor:
    """DARE given the keep masks (T, *S) bool: τ̂ = τ·m/(1−p), then TA (sum) or TIES' mean."""
    dropped = task_vectors(base, experts) * masks / (1.0 - drop_rate)
    merged = disjoint_mean(dropped) if ties else dropped.sum(0)
    return base.double() + scale * merged


def breadcrumbs(base, experts, density, gamma, scale) -> torch.Tensor:
    """Model Breadcrumbs, mergekit's magnitude_outliers by index: sort |τ| ascending, keep
    positions [n_bot, n − n_top) of the order (no ties in the test data)."""
    merged = torch.zeros_like(base, dtype=torch.float64)
    for tau in task_vectors(base, experts):
        flat = tau.reshape(-1)
        n = flat.numel()
        n_keep, n_top = int(density * n), int(gamma * n)
        n_bot = n - n_keep - n_top
        if n_bot < 0:
            n_top, n_bot = n_top + n_bot, 0
        order = torch.argsort(flat.abs())
        mask = torch.zeros(n, dtype=torch.bool)
        mask[order[n_bot : n - n_top]] = True
        merged += (flat * mask).reshape(base.shape)
    return base.double() + scale * merged


def ties_global(bases: dict, experts: list[dict], names: list[str], top_k, scale) -> dict:
    """TIES with the paper's global trim: one threshold per expert over the concatenation of
    every tensor in `names` (k = ceil(top_k % of all entries), ties kept)."""
    flat = torch.stack(
        [
            torch.cat([e[n].double().reshape(-1) - bases[n].double().reshape(-1) for n in names])
            for e in experts
        ]
    )
    total = flat.shape[1]
    keep = min(total, max(1, math.ceil(total * top_k / 100)))
    thresholds = flat.abs().sort(dim=1, descending=True).values[:, keep - 1]
    out = {}
    for name in names:
        taus = task_vectors(bases[name], [e[name] for e in experts])
        limit = thresholds.reshape(-1, *[1] * (taus.dim() - 1))
        trimmed = torch.where(taus.abs() >= limit, taus, torch.zeros_like(taus))
        out[name] = bases[name].double() + scale * disjoint_mean(trimmed)
    return out


def tsv_m(base, experts, scale) -> torch.Tensor:
    """TSV-M as the authors' code builds it: each task's top int(r/T) triplets placed in
    zero-padded r-column blocks, both factors orthogonalised by SVD (u @ vᵀ), reconstructed.
    Non-matrices: the mean task vector."""
    taus = task_vectors(base, experts)
    if base.dim() != 2:
        return base.double() + scale * taus.mean(0)
    count = len(experts)
    sum_u = sum_s = sum_v = None
    for i, tau in enumerate(taus):
        u, s, v = torch.linalg.svd(tau, full_matrices=False)
        if i == 0:
            sum_u, sum_s, sum_v = torch.zeros_like(u), torch.zeros_like(s), torch.zeros_like(v)
        k = int(s.shape[0] * (1 / count))
        sum_u[:, i * k : (i + 1) * k] = u[:, :k]
        sum_s[i * k : (i + 1) * k] = s[:k]
        sum_v[i * k : (i + 1) * k, :] = v[:k, :]
    u_u, _, v_u = torch.linalg.svd(sum_u, full_matrices=False)
    u_v, _, v_v = torch.linalg.svd(sum_v, full_matrices=False)
    merged = u_u @ v_u @ torch.diag(sum_s) @ u_v @ v_v
    return base.double() + scale * merged


def iso_c(base, experts, scale) -> torch.Tensor:
    """Iso-C: M = Σ τ, SVD, all singular values replaced by their mean. Non-matrices: mean τ."""
    taus = task_vectors(base, experts)
    if base.dim() != 2:
        return base.double() + scale * taus.mean(0)
    u, s, v = torch.linalg.svd(taus.sum(0), full_matrices=False)
    return base.double() + scale * (u @ torch.diag(torch.full_like(s, s.mean().item())) @ v)


def iso_cts(base, experts, scale, fraction) -> torch.Tensor:
    """Iso-CTS as the authors' code: common space of Σ τ, then per task the top directions of τ
    projected off it, all stacked, orthogonalised and given the mean singular value."""
    taus = task_vectors(base, experts)
    if base.dim() != 2:
        return base.double() + scale * taus.mean(0)
    count, r = len(experts), min(base.shape)
    common = int(r * fraction)
    common = r - round((r - common) / count) * count
    per_task = (r - common) // count
    u, s, v = torch.linalg.svd(taus.sum(0), full_matrices=False)
    cu, cs, cv = u[:, :common], s[:common], v[:common, :]
    all_u = torch.zeros(base.shape[0], r, dtype=torch.float64)
    all_s = torch.zeros(r, dtype=torch.float64)
    all_v = torch.zeros(r, base.shape[1], dtype=torch.float64)
    for i, tau in enumerate(taus):
        projected = tau - cu @ cu.T @ tau
        pu, ps, pv = torch.linalg.svd(projected, full_matrices=False)
        all_u[:, i * per_task : (i + 1) * per_task] = pu[:, :per_task]
        all_s[i * per_task : (i + 1) * per_task] = ps[:per_task]
        all_v[i * per_task : (i + 1) * per_task, :] = pv[:per_task, :]
    start = count * per_task
    all_u[:, start:], all_s[start:], all_v[start:, :] = cu, cs, cv
    a, _, b = torch.linalg.svd(all_u, full_matrices=False)
    c, _, d = torch.linalg.svd(all_v, full_matrices=False)
    level = torch.full((r,), all_s.mean().item(), dtype=torch.float64)
    return base.double() + scale * (a @ b @ torch.diag(level) @ c @ d)
