"""Every closed form against brute-force least squares on random data."""

from __future__ import annotations

import pytest
import torch

from featcal_core.errors import FeatCalError
from featcal_core.method import solvers, statistics
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.norm_statistics import NormStats
from featcal_core.method.solvers import anchor
from featcal_core.method.statistics import LinearInputStats

D64 = torch.float64


def _tasks(seed: int, d_in: int, d_out: int, n_tasks: int = 3, tokens: int = 40):
    gen = torch.Generator().manual_seed(seed)
    tasks = []
    for t in range(n_tasks):
        scale = 10.0**t  # very different energies: exercises the 1/‖C‖_F task scale
        tasks.append(
            dict(
                x_s=scale * torch.randn(tokens, d_in, generator=gen, dtype=D64),
                x_e=scale * torch.randn(tokens, d_in, generator=gen, dtype=D64),
                w=torch.rand(tokens, generator=gen, dtype=D64) + 0.05,
                W=torch.randn(d_out, d_in, generator=gen, dtype=D64),
                b=torch.randn(d_out, generator=gen, dtype=D64),
            )
        )
    merged_w = torch.randn(d_out, d_in, generator=gen, dtype=D64)
    base_w = torch.randn(d_out, d_in, generator=gen, dtype=D64)
    merged_b = torch.randn(d_out, generator=gen, dtype=D64)
    base_b = torch.randn(d_out, generator=gen, dtype=D64)
    return tasks, (merged_w, base_w, merged_b, base_b)


def _brute_linear(tasks, alpha, lam, eps, a_w, a_b):
    """Stack the weighted least-squares rows of Σ_t s_t E_ω‖W x_s − W_t x_t‖² + λ‖W − a‖² and the
    bias objective (with the solved W) and hand them to lstsq."""
    rows, targets, bias_rows, bias_targets = [], [], [], []
    for t in tasks:
        total = t["w"].sum()
        c = (t["x_s"] * t["w"][:, None]).T @ t["x_s"] / total
        s = 1.0 / max(float(torch.linalg.matrix_norm(c)), eps)
        x_t = alpha * t["x_e"] + (1 - alpha) * t["x_s"]
        root = torch.sqrt(s * t["w"] / total)[:, None]
        rows.append(root * t["x_s"])
        targets.append(root * (x_t @ t["W"].T))
        t["_s"], t["_xt"], t["_root"] = s, x_t, root
    d_in = tasks[0]["x_s"].shape[1]
    rows.append(torch.sqrt(torch.tensor(lam + eps, dtype=D64)) * torch.eye(d_in, dtype=D64))
    targets.append(lam / (lam + eps) ** 0.5 * a_w.T if lam > 0 else torch.zeros_like(a_w.T))
    weight = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    # bias: minimise Σ_t s_t E_ω ‖W x_s + b − (W_t x_t + b_t)‖² + λ‖b − a_b‖²
    d_out = weight.shape[0]
    for t in tasks:
        residual = t["_xt"] @ t["W"].T + t["b"] - t["x_s"] @ weight.T  # target for b, per token
        for i in range(residual.shape[0]):
            bias_rows.append(t["_root"][i] * torch.eye(d_out, dtype=D64))
            bias_targets.append(t["_root"][i] * residual[i])
    if lam > 0:
        bias_rows.append(lam**0.5 * torch.eye(d_out, dtype=D64))
        bias_targets.append(lam**0.5 * a_b)
    bias = torch.linalg.lstsq(torch.cat(bias_rows), torch.cat(bias_targets)[:, None]).solution[:, 0]
    return weight, bias


@pytest.mark.parametrize("token_chunk", [None, 7], ids=["whole-batches", "7-token-chunks"])
@pytest.mark.parametrize("via_x", [False, True])
@pytest.mark.parametrize("lam", [0.0, 0.05, 3.0])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_linear_weight_and_bias_match_brute_force(lam, alpha, via_x, token_chunk, monkeypatch):
    if token_chunk is not None:  # batches of 20 tokens are accumulated 7 + 7 + 6 at a time
        monkeypatch.setattr(statistics, "TOKEN_CHUNK", token_chunk)
    d_in, d_out, rho, eps = 6, 4, 2.2, 1e-8
    tasks, (mw, bw, mb, bb) = _tasks(1, d_in, d_out)
    a_w, a_b = anchor(mw, bw, rho), anchor(mb, bb, rho)
    stats = LinearInputStats(
        d_in,
        {"lin": (d_out, True)},
        torch.device("cpu"),
        tokens_hint=40 if via_x else None,
        params=FeatCalParams(alpha=alpha, rho=rho, lam=lam, eps=eps),
    )
    assert stats.via_x == via_x
    for t in tasks:
        params = {"lin": (t["W"], t["b"])}
        for part in range(2):  # two batches per task: accumulation across batches
            sl = slice(part * 20, (part + 1) * 20)
            stats.add(t["x_s"][sl], t["x_e"][sl], t["w"][sl], params)
        stats.end_task(params)
    weight, bias = stats.solve({"lin": (a_w, a_b)})["lin"]
    ref_w, ref_b = _brute_linear(tasks, alpha, lam, eps, a_w, a_b)
    torch.testing.assert_close(weight, ref_w, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(bias, ref_b, rtol=1e-7, atol=1e-9)


def test_linear_shared_input_matches_separate_groups():
    """q/k/v sharing one Gram matrix gives the same result as solving each alone."""
    tasks, _ = _tasks(2, 5, 3)
    hp = FeatCalParams(alpha=0.3, lam=0.0, eps=1e-8)
    together = LinearInputStats(
        5, {"q": (3, True), "k": (3, False)}, torch.device("cpu"), params=hp
    )
    alone = {
        n: LinearInputStats(5, {n: (3, n == "q")}, torch.device("cpu"), params=hp)
        for n in ("q", "k")
    }
    for t in tasks:
        params = {"q": (t["W"], t["b"]), "k": (2 * t["W"], None)}
        together.add(t["x_s"], t["x_e"], t["w"], params)
        for n, s in alone.items():
            s.add(t["x_s"], t["x_e"], t["w"], {n: params[n]})
        together.end_task(params)
        for n, s in alone.items():
            s.end_task({n: params[n]})
    solved = together.solve({})
    for n in ("q", "k"):
        w1, b1 = solved[n]
        w2, b2 = alone[n].solve({})[n]
        torch.testing.assert_close(w1, w2)
        assert (b1 is None) == (n == "k")


def _layernorm_tasks(seed: int, d: int, n_tasks: int = 3, tokens: int = 30):
    gen = torch.Generator().manual_seed(seed)
    return [
        dict(
            x=3 * torch.randn(tokens, d, generator=gen, dtype=D64) + t,
            w=torch.rand(tokens, generator=gen, dtype=D64) + 0.1,
            g=torch.randn(d, generator=gen, dtype=D64),
            b=torch.randn(d, generator=gen, dtype=D64),
        )
        for t in range(n_tasks)
    ]


@pytest.mark.parametrize("lam", [0.0, 0.05, 2.0])
def test_layernorm_matches_brute_force(lam):
    d, eps_ln, rho = 5, 1e-5, 2.2
    tasks = _layernorm_tasks(3, d)
    gen = torch.Generator().manual_seed(9)
    mg, bg, mb, bb = (torch.randn(d, generator=gen, dtype=D64) for _ in range(4))
    a_g, a_b = anchor(mg, bg, rho), anchor(mb, bb, rho)
    stats = NormStats(d, eps_ln, rms=False, has_bias=True, device=torch.device("cpu"))
    for t in tasks:
        stats.add(t["x"], t["w"])
        stats.end_task(t["g"], t["b"])
    gamma, beta = stats.solve(lam, 1e-8, a_g, a_b)
    # brute force per channel: Σ_t E_ω (γ z + β − γ_t z − β_t)² + λ(γ − aγ)² + λ(β − aβ)²
    for c in range(d):
        rows, targets = [], []
        for t in tasks:
            z = torch.nn.functional.layer_norm(t["x"], (d,), eps=eps_ln)[:, c]
            root = torch.sqrt(t["w"] / t["w"].sum())
            rows.append(torch.stack([root * z, root], 1))
            targets.append(root * (t["g"][c] * z + t["b"][c]))
        if lam > 0:
            rows.append(lam**0.5 * torch.eye(2, dtype=D64))
            targets.append(lam**0.5 * torch.stack([a_g[c], a_b[c]]))
        sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)[:, None]).solution[:, 0]
        torch.testing.assert_close(torch.stack([gamma[c], beta[c]]), sol, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_rmsnorm_matches_brute_force(lam):
    d, eps_ln = 4, 1e-6
    tasks = _layernorm_tasks(4, d)
    gen = torch.Generator().manual_seed(5)
    a_g = torch.randn(d, generator=gen, dtype=D64)
    stats = NormStats(d, eps_ln, rms=True, has_bias=False, device=torch.device("cpu"))
    for t in tasks:
        stats.add(t["x"], t["w"])
        stats.end_task(t["g"], None)
    gamma, beta = stats.solve(lam, 1e-8, a_g, None)
    assert beta is None
    for c in range(d):
        rows, targets = [], []
        for t in tasks:
            z = t["x"] * torch.rsqrt(t["x"].pow(2).mean(-1, keepdim=True) + eps_ln)
            root = torch.sqrt(t["w"] / t["w"].sum())
            rows.append((root * z[:, c])[:, None])
            targets.append(root * t["g"][c] * z[:, c])
        if lam > 0:
            rows.append(torch.tensor([[lam**0.5]], dtype=D64))
            targets.append(lam**0.5 * a_g[c : c + 1])
        sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)[:, None]).solution[0, 0]
        torch.testing.assert_close(gamma[c], sol, rtol=1e-8, atol=1e-10)


def test_large_lambda_tends_to_anchor():
    tasks, (mw, bw, mb, bb) = _tasks(6, 4, 3)
    a_w, a_b = anchor(mw, bw, 2.0), anchor(mb, bb, 2.0)
    errors = []
    for lam in (1e0, 1e3, 1e6):
        hp = FeatCalParams(alpha=0.25, lam=lam, eps=1e-8)
        stats = LinearInputStats(4, {"lin": (3, True)}, torch.device("cpu"), params=hp)
        for t in tasks:
            params = {"lin": (t["W"], t["b"])}
            stats.add(t["x_s"], t["x_e"], t["w"], params)
            stats.end_task(params)
        weight, bias = stats.solve({"lin": (a_w, a_b)})["lin"]
        errors.append(float((weight - a_w).abs().max() + (bias - a_b).abs().max()))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-4


def test_blocked_symmetric_gram_equals_full(monkeypatch):
    monkeypatch.setattr(statistics, "SYMMETRIC_BLOCK", 3)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20, 10, generator=gen, dtype=D64)
    w = torch.rand(20, generator=gen, dtype=D64)
    acc = torch.zeros(10, 10, dtype=D64)
    for part in (slice(0, 7), slice(7, 20)):
        statistics.add_gram(acc, x[part] * w[part, None], x[part])
    full = (x * w[:, None]).T @ x
    assert statistics.gram_norm(acc) == pytest.approx(float(torch.linalg.matrix_norm(full)))
    torch.testing.assert_close(statistics.symmetrize_(acc), full)


@pytest.mark.parametrize("via_x", [False, True])
def test_reduced_products_in_one_block_equal_the_row_blocks(monkeypatch, via_x):
    """CUDA's layout (one product over the whole square, statistics.product_block) gives the
    contribution of the CPU's row blocks of the upper triangle, to float32 rounding."""
    assert statistics.product_block(torch.float32, torch.device("cuda")) == 4096
    assert statistics.product_block(torch.float32, torch.device("cpu")) == 384
    assert statistics.product_block(torch.float64, torch.device("cuda")) is None
    gen = torch.Generator().manual_seed(12)
    d_in, d_out, tokens = 10, 7, 40
    modules = {"lin": (d_out, True)}
    params = {"lin": (torch.randn(d_out, d_in, generator=gen), torch.randn(d_out, generator=gen))}
    x_s, x_e = torch.randn(tokens, d_in, generator=gen), torch.randn(tokens, d_in, generator=gen)
    w = torch.rand(tokens, generator=gen)
    cpu = torch.device("cpu")
    found = {}
    for rows in (3, 4096):  # 4 row blocks of the triangle; one product
        monkeypatch.setattr(statistics, "SYMMETRIC_BLOCK_FP32", rows)
        stats = LinearInputStats(d_in, modules, cpu, tokens if via_x else None, precision="float32")
        assert stats.block == rows
        stats.add(x_s, x_e, w, params)
        found[rows] = stats.task_contribution(params)
    for key, tensor in found[3].items():  # float32 products: ~1e-7 of the largest entry
        error = float((found[4096][key] - tensor).abs().max())
        assert error <= 1e-6 * float(tensor.abs().max()), (key, error)


def test_factored_solve_in_column_chunks_matches_a_direct_solve(monkeypatch):
    monkeypatch.setattr(solvers, "SOLVE_COLUMNS", 3)  # 8 columns: 3 + 3 + 2
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    lhs = x.T @ x + 0.1 * torch.eye(6, dtype=torch.float64)
    rhs = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    expected = torch.linalg.solve(lhs, rhs)
    for positive_definite in (False, True):  # a new factor, or factored over the matrix
        system = solvers.SPDSystem(lhs.clone(), positive_definite)
        assert system.factor is not None
        torch.testing.assert_close(system.solve(rhs.clone()), expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(FeatCalError, match="not positive definite"):
        solvers.SPDSystem(-lhs, positive_definite=True)


def test_failed_factorization_restores_the_matrix_for_least_squares():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    lhs = x.T @ x  # rank 3 of 6: Cholesky fails
    lhs[0, 0] -= 1.0  # and indefinite, so it fails early
    system = solvers.SPDSystem(lhs.clone())  # not known to be positive definite (λ = 0)
    assert system.factor is None
    assert torch.equal(system.matrix, lhs)
    rhs = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    expected = torch.linalg.lstsq(lhs, rhs, driver="gelsd").solution
    torch.testing.assert_close(system.solve(rhs), expected)
