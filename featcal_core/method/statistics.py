"""Token-weighted, uncentered statistics for FeatCal, accumulated in float64.

One accumulator per *input* of a block: the Linear modules that read the same tensor with the same
token weights (q, k and v, say) share one Gram matrix. Per-task sums live only while that task's
pass over the block runs; `end_task` folds them, scaled by s_t = 1 / max(‖C_t‖_F, ε), into running
sums, so memory is O(d_in²) per input whatever the number of tasks T. The two stages
(`task_contribution`, `merge`) can also run apart: one task's pass in another process, its
contribution folded here (same sums, bit for bit, as folding in place in the same task order).

Shapes: x_s, x_e are (N, d_in) token vectors (student / expert inputs); w is (N,) token weights.

Precision: the sums are float64 whatever runs the products. With `precision="float32"` the
token products (Gram, mixed and cross terms) run in float32, one chunk of at most
`TOKEN_CHUNK_FP32` tokens and `product_block` rows (SYMMETRIC_BLOCK_FP32 on the CPU,
SYMMETRIC_BLOCK_CUDA on CUDA) at a time, each added to the float64 sums at once (so no float32
sum covers more than one chunk, and the float32 work memory is one such row block, not a second
copy of the sums); token sums, the per-task scaling and every solve stay float64.
`precision="bfloat16"` is the same with bfloat16 token inputs (featcal_core/precision.py: on CUDA
each product returns float32; on CPU it is rounded to bfloat16 before the float64 add); products
of the sums themselves (once per task) stay float32. `precision="float64"` runs
everything in float64 (the audit path; it is the code the float64 reference tests were written
against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.solvers import (
    DTYPE,
    SOLVE_COLUMNS,
    Fallbacks,
    ensure_fallbacks,
    ridge_system,
    solve_linear_bias,
    solve_linear_weight,
)
from featcal_core.precision import PRODUCT_DTYPES, product

#: Gram matrices at least twice this wide are accumulated by block rows, upper triangle only
SYMMETRIC_BLOCK = 768
#: the same with float32 products (finer blocks: more of the triangle skipped, for d ≥ 768 too)
SYMMETRIC_BLOCK_FP32 = 384
#: the same on CUDA: a GPU runs a product in about the time it takes to launch it, so inputs
#: narrower than 2 × 4096 take one product (the whole square), wider ones a few row blocks
SYMMETRIC_BLOCK_CUDA = 4096
#: tokens per float64 work chunk in `LinearInputStats.add` (bounds its scratch buffers to a few
#: TOKEN_CHUNK × d_in float64 matrices whatever the batch size)
TOKEN_CHUNK = 512
#: tokens per work chunk when the products run in float32 (longer GEMMs, same scratch bytes)
TOKEN_CHUNK_FP32 = 1024
#: the dtype of the token products for each resolved precision (featcal_core/precision.py)
PRECISIONS: dict[str, torch.dtype] = PRODUCT_DTYPES


def product_dtype(precision: str) -> torch.dtype:
    """The dtype of the token products for `precision` (float64 | float32 | bfloat16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def product_block(product: torch.dtype, device: torch.device) -> int | None:
    """Rows per product block of the Gram and cross terms (add_gram, gram_norm, symmetrize_):
    None (SYMMETRIC_BLOCK) for float64 products; reduced products by SYMMETRIC_BLOCK_FP32 rows on
    the CPU, SYMMETRIC_BLOCK_CUDA on CUDA."""
    if product == DTYPE:
        return None
    return SYMMETRIC_BLOCK_CUDA if device.type == "cuda" else SYMMETRIC_BLOCK_FP32


def sums_dtype(product: torch.dtype) -> torch.dtype:
    """The dtype of products of the sums themselves (once per task, not per token): the
    products' dtype, but float32 for bfloat16 (the sums must not be rounded to 8 bits)."""
    return torch.float32 if product == torch.bfloat16 else product


def add_gram(
    acc: torch.Tensor, xw: torch.Tensor, x: torch.Tensor, block: int | None = None
) -> None:
    """acc += xwᵀ x for xw = diag(ω) x, in place. Matrices at least two blocks wide (`block`,
    default SYMMETRIC_BLOCK): only the upper triangle by block rows (the rest follows by
    symmetry: see `gram_norm` and `symmetrize_`, called with the same `block`)."""
    block = block or SYMMETRIC_BLOCK
    d = x.shape[1]
    if d < 2 * block:
        acc.addmm_(xw.T, x)
        return
    for i in range(0, d, block):
        acc[i : i + block, i:].addmm_(xw[:, i : i + block].T, x[:, i:])


def _blocks(d: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, d)) for i in range(0, d, block)]


def gram_norm(acc: torch.Tensor, block: int | None = None) -> float:
    """Frobenius norm of the symmetric matrix that `add_gram` holds in `acc` (upper block rows)."""
    block = block or SYMMETRIC_BLOCK
    d = acc.shape[0]
    if d < 2 * block:
        return float(torch.linalg.matrix_norm(acc))
    total = acc.new_zeros(())  # summed on acc's device: one read at the end
    for i, j in _blocks(d, block):
        total += acc[i:j, i:j].pow(2).sum() + 2.0 * acc[i:j, j:].pow(2).sum()
    return float(total) ** 0.5


def symmetrize_(acc: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Fill, in place, the lower block triangle that `add_gram` left out; returns `acc`."""
    block = block or SYMMETRIC_BLOCK
    d = acc.shape[0]
    if d >= 2 * block:
        for i, j in _blocks(d, block):
            acc[j:, i:j] = acc[i:j, j:].T
    return acc


def _column_sums(x: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of one chunk (N, d) of float32 or bfloat16 tokens, summed in float32 (the
    caller adds it to float64 sums). `x.sum(0, dtype=float64)` converts element by element:
    72 ms against 1.3 ms for 1600 × 3072 bfloat16 tokens here."""
    return (x if x.dtype == torch.float32 else x.float()).sum(0)


class Scratch:
    """Reusable float64 work buffers, so batches do not allocate tens of MB each (shared by the
    accumulators of one block: they run one after another)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, key: str, rows: int, cols: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        """An uninitialised (rows × cols) view of buffer `key` (float64 unless `dtype`), grown
        when needed."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < rows * cols or buffer.dtype != dtype:
            buffer = self._buffers[key] = torch.empty(rows * cols, dtype=dtype, device=self.device)
        return buffer[: rows * cols].view(rows, cols)


@dataclass
class LinearTarget:
    """Running sums of one Linear module fed by a `LinearInputStats`."""

    d_out: int
    has_bias: bool
    cross: torch.Tensor | None = None  # Σ_t s_t X_t W_tᵀ, (d_in × d_out)
    target_sum: torch.Tensor | None = None  # Σ_t s_t (b_t + W_t μt_t), (d_out)
    # the current task's Σ ω x_s (W_t x_t)ᵀ (direct mode) or its X_t W_tᵀ (via X_t), (d_in × d_out)
    task_cross: torch.Tensor | None = None


class LinearInputStats:
    """Sums for the Linear modules sharing one input (width d_in), in two stages.

    Per task: `add` accumulates that task's batches; `task_contribution` turns them into the task's
    scaled terms (s_t C_t, s_t μs_t, s_t, s_t X_t W_tᵀ, s_t(b_t + W_t μt_t)). Across tasks:
    `merge` adds contributions in the order given, so contributions computed in other processes
    (a Dask worker per task) fold to the same sums as `end_task` (= both stages in place). Buffers
    are allocated on first use: an accumulator that only merges holds the running sums only.

    Two exact ways to get Σ ω x_s x_tᵀ W_tᵀ, chosen by cost (N tokens per task, D = Σ d_out):
    - *direct*: per batch, y = x_t W_tᵀ and Σ ω x_s yᵀ (≈ 4·N·d_in·D flops);
    - *via X_t*: accumulate Σ ω x_s x_eᵀ (d_in × d_in) and multiply by W_tᵀ once per task
      (≈ 2·N·d_in² + 2·d_in²·D flops); cheaper for q/k/v, out and fc1-like modules.
    """

    def __init__(
        self,
        d_in: int,
        modules: dict[str, tuple[int, bool]],
        device: torch.device,
        tokens_hint: int | None = None,
        scratch: Scratch | None = None,
        precision: str = "float64",
        keeps_buffers: bool = False,
        params: FeatCalParams = FeatCalParams(),
    ):
        self.d_in = d_in
        #: α (the teacher's interpolation, in `add` and `task_contribution`), ε (the task scale's
        #: floor, the solve's jitter) and λ (the solve's ridge), set once here
        self.params = params
        self.precision = precision
        self.product = product_dtype(precision)
        # the Gram's block layout (add_gram, gram_norm, symmetrize_): None is SYMMETRIC_BLOCK
        self.block = product_block(self.product, device)
        self.device = device
        self.modules = dict(modules)
        self.scratch = scratch or Scratch(device)
        self.gram: torch.Tensor | None = None  # Σ s_t C_t (after the first merge)
        self.student_mean_sum: torch.Tensor | None = None  # Σ s_t μs_t
        self.scale_sum = 0.0  # Σ s_t
        self.num_tasks = 0
        self.targets = {name: LinearTarget(d_out, bias) for name, (d_out, bias) in modules.items()}
        total_out = sum(d_out for d_out, _ in modules.values())
        tokens = tokens_hint or 0
        self.via_x = tokens > 0 and d_in * (tokens + total_out) < 2 * tokens * total_out
        # Σ ω of the current task: a float64 scalar on the device once a weighted batch is added
        # (read into Python when the task closes, not per batch)
        self._task_weight: torch.Tensor | float = 0.0
        self._task_open = False
        self._task_gram: torch.Tensor | None = None  # Σ ω x_s x_sᵀ
        self._task_mixed: torch.Tensor | None = None  # via X_t: Σ ω x_s x_eᵀ
        self._task_student: torch.Tensor | None = None  # Σ ω x_s
        self._task_expert: torch.Tensor | None = None  # Σ ω x_e
        #: the per-task buffers serve task after task (`linear_groups(reuse=...)`); False: a
        #: one-task accumulator, which frees what it can as soon as the task closes
        self.keeps_buffers = keeps_buffers

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=DTYPE, device=self.device)

    def _open_task(self) -> None:
        """Zero the per-task sums (allocated once, on the first task)."""
        d = self.d_in
        if self.via_x and self._task_mixed is None:  # (freed after a one-task accumulator's task)
            self._task_mixed = self._zeros(d, d)
        if self._task_gram is None:
            self._task_gram = self._zeros(d, d)
            self._task_student, self._task_expert = self._zeros(d), self._zeros(d)
            for target in self.targets.values():
                if not self.via_x:
                    target.task_cross = self._zeros(d, target.d_out)
        buffers = [self._task_gram, self._task_mixed, self._task_student, self._task_expert]
        if not self.via_x:  # via X_t, task_cross is only written by `task_contribution`
            buffers += [t.task_cross for t in self.targets.values()]
        for buffer in buffers:
            if buffer is not None:
                buffer.zero_()
        self._task_open = True

    def add(
        self,
        x_s: torch.Tensor,
        x_e: torch.Tensor,
        w: torch.Tensor | None,
        expert_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """Add one batch of task t's tokens (w None: all weights 1); the teacher's input is
        x_t = α x_e + (1 − α) x_s (α: `self.params.alpha`).

        expert_params: name → (W_t (d_out × d_in), b_t or None).
        """
        chunk = TOKEN_CHUNK if self.product == DTYPE else TOKEN_CHUNK_FP32
        if x_s.shape[0] > chunk:
            for start in range(0, x_s.shape[0], chunk):
                stop = start + chunk
                self.add(
                    x_s[start:stop],
                    x_e[start:stop],
                    None if w is None else w[start:stop],
                    expert_params,
                )
            return
        if not self._task_open:
            self._open_task()
        if self.product != DTYPE:
            self._add_reduced(x_s, x_e, w, expert_params)
            return
        # allocated by _open_task
        assert self._task_gram is not None and self._task_student is not None
        assert self._task_expert is not None
        tokens = x_s.shape[0]
        x_s = self.scratch.take("x_s", tokens, self.d_in).copy_(x_s)
        x_e = self.scratch.take("x_e", tokens, self.d_in).copy_(x_e)
        if w is None:  # all token weights 1: skip the weighting
            xw = x_s
            self._task_student += x_s.sum(0)
            self._task_expert += x_e.sum(0)
            self._task_weight = self._task_weight + float(tokens)
        else:
            w = w.to(DTYPE)
            xw = torch.mul(x_s, w[:, None], out=self.scratch.take("xw", tokens, self.d_in))
            self._task_student += w @ x_s
            self._task_expert += w @ x_e
            self._task_weight = self._task_weight + w.sum()
        add_gram(self._task_gram, xw, x_s)
        if self.via_x:
            assert self._task_mixed is not None  # allocated by _open_task
            self._task_mixed.addmm_(xw.T, x_e)
            return
        # α x_e + (1 − α) x_s, written over x_e's scratch (x_e is not needed any more)
        x_t = torch.lerp(x_s, x_e, self.params.alpha, out=x_e)
        for name, target in self.targets.items():  # by blocks of W_t's rows (float64 copies)
            assert target.task_cross is not None  # direct mode: allocated by _open_task
            weight_t = expert_params[name][0]
            for start in range(0, target.d_out, SOLVE_COLUMNS):
                rows = weight_t[start : start + SOLVE_COLUMNS].to(DTYPE)
                y = torch.matmul(x_t, rows.T, out=self.scratch.take("y", tokens, rows.shape[0]))
                target.task_cross[:, start : start + rows.shape[0]].addmm_(xw.T, y)

    def _add_reduced(self, x_s, x_e, w, expert_params) -> None:
        """`add` with the token products in `self.product` (float32 or bfloat16), added row
        block by row block to the float64 sums; token sums accumulate in float64 (from float32
        vector sums over ≤ one chunk of tokens)."""
        # allocated by _open_task
        assert self._task_gram is not None and self._task_student is not None
        assert self._task_expert is not None
        assert self.block is not None  # reduced products: product_block
        tokens = x_s.shape[0]
        dtype = self.product
        x_s = self.scratch.take("x_s32", tokens, self.d_in, dtype).copy_(x_s)
        x_e = self.scratch.take("x_e32", tokens, self.d_in, dtype).copy_(x_e)
        if w is None:
            xw = x_s
            self._task_student += _column_sums(x_s)
            self._task_expert += _column_sums(x_e)
            self._task_weight = self._task_weight + float(tokens)
        else:
            w = w.to(dtype)
            xw = torch.mul(x_s, w[:, None], out=self.scratch.take("xw32", tokens, self.d_in, dtype))
            self._task_student += _column_sums(xw)
            wide = sums_dtype(dtype)  # float32 over ≤ one chunk of tokens
            self._task_expert += torch.mv(x_e.T.to(wide), w.to(wide))
            self._task_weight = self._task_weight + w.sum(dtype=DTYPE)
        self._add_product(self._task_gram, xw, x_s, symmetric=self.d_in >= 2 * self.block)
        if self.via_x:
            self._add_product(self._task_mixed, xw, x_e)
            return
        x_t = torch.lerp(x_s, x_e, self.params.alpha, out=x_e)
        for name, target in self.targets.items():
            assert target.task_cross is not None  # direct mode: allocated by _open_task
            weight_t = expert_params[name][0]
            for start in range(0, target.d_out, SOLVE_COLUMNS):
                rows = weight_t[start : start + SOLVE_COLUMNS].to(dtype)
                y = torch.matmul(
                    x_t, rows.T, out=self.scratch.take("y32", tokens, rows.shape[0], dtype)
                )
                self._add_product(target.task_cross[:, start : start + rows.shape[0]], xw, y)

    def _add_product(self, acc, left, right, symmetric: bool = False) -> None:
        """acc (float64, r × c) += leftᵀ right for left (N, r), right (N, c) in self.product, by
        blocks of `self.block` rows; symmetric: only the upper block triangle (add_gram's
        layout)."""
        block = self.block
        assert block is not None  # reduced products: product_block
        for i in range(0, acc.shape[0], block):
            start = i if symmetric else 0
            part = left[:, i : i + block]
            out = self.scratch.take(
                "product32", part.shape[1], right.shape[1] - start, self.product
            )
            acc[i : i + block, start:].add_(product(part.T, right[:, start:], out=out))

    def task_contribution(
        self,
        expert_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
        *,
        fallbacks: Fallbacks | None = None,
        task: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Close the current task: its scaled terms, s_t = 1 / max(‖C_t‖_F, ε), as float64 tensors
        keyed `gram`, `student_mean`, `scale` (1,), `cross:<module>`, `target:<module>`.
        A clamped s_t is recorded in `fallbacks` ("clamped_task_scale", naming `task`).

        The tensors may share memory with the per-task buffers: `merge` (or save) them before
        the next task's first `add`."""
        alpha, eps = self.params.alpha, self.params.eps
        total = float(self._task_weight)
        if total <= 0 or not self._task_open:
            raise ValueError("a task contributed no weighted tokens to a Linear input")
        gram = self._task_gram  # upper block rows only when wide: linear in the sums below
        # allocated by _open_task
        assert gram is not None and self._task_student is not None
        assert self._task_expert is not None
        norm = gram_norm(gram, self.block) / total
        if norm < eps:
            reason = f"‖C_t‖_F = {norm:.3g} < ε = {eps:g}: the task scale s_t was clamped to 1/ε"
            found = ensure_fallbacks(fallbacks)
            found.add("clamped_task_scale", reason, tuple(self.targets), task=task)
        s_t = 1.0 / max(norm, eps)
        scale = s_t / total
        teacher_mean = (alpha * self._task_expert + (1.0 - alpha) * self._task_student) / total
        # contributions hold the full symmetric Gram: the block layout never leaves this object
        symmetrize_(gram, self.block)
        wide = sums_dtype(self.product)
        if self.via_x:  # Σ ω x_s x_tᵀ, over the per-task buffer (once in float32 if reduced)
            assert self._task_mixed is not None  # allocated by _open_task
            mixed = self._task_mixed.mul_(alpha).add_(gram, alpha=1.0 - alpha)
            left = mixed if self.product == DTYPE else mixed.to(wide)
            if not self.keeps_buffers:  # one task only: X_t (float64) is freed before the products
                self._task_mixed = None
                del mixed
        out = {
            "scale": torch.tensor([s_t], dtype=DTYPE),
            "student_mean": self._task_student.mul_(scale),
        }
        for name, target in self.targets.items():
            weight_t, bias_t = expert_params[name]
            if self.via_x:  # X_t W_tᵀ, by blocks of W_t's rows (no float64 copy of all of W_t)
                if target.task_cross is None:  # kept for the next task (see `_open_task`)
                    target.task_cross = torch.empty(
                        self.d_in, target.d_out, dtype=DTYPE, device=self.device
                    )
                cross = target.task_cross
                for start in range(0, target.d_out, SOLVE_COLUMNS):
                    rows = weight_t[start : start + SOLVE_COLUMNS].to(wide)
                    if self.product == DTYPE:
                        torch.mm(left, rows.T, out=cross[:, start : start + SOLVE_COLUMNS])
                    else:
                        cross[:, start : start + SOLVE_COLUMNS] = left @ rows.T
                out[f"cross:{name}"] = cross.mul_(scale)
            else:
                assert target.task_cross is not None  # direct mode: allocated by _open_task
                out[f"cross:{name}"] = target.task_cross.mul_(scale)
            mean_out = torch.cat(
                [
                    weight_t[start : start + SOLVE_COLUMNS].to(DTYPE) @ teacher_mean
                    for start in range(0, target.d_out, SOLVE_COLUMNS)
                ]
            )
            if bias_t is not None:
                mean_out = mean_out + bias_t.to(DTYPE)
            out[f"target:{name}"] = mean_out.mul_(s_t)
        out["gram"] = gram.mul_(scale)
        self._task_weight = 0.0
        self._task_open = False
        return out

    def merge(self, contribution: dict[str, torch.Tensor], adopt: bool = False) -> None:
        """Add one task's contribution (from `task_contribution`, here or in another process).
        adopt: the contribution's tensors are private (e.g. just read from a file), so the first
        one becomes the running sum without a copy."""

        def accumulate(current: torch.Tensor | None, key: str) -> torch.Tensor:
            term = contribution[key].to(self.device, DTYPE)
            if current is None:
                return term if adopt else term.clone()
            return current.add_(term)

        self.gram = accumulate(self.gram, "gram")
        self.student_mean_sum = accumulate(self.student_mean_sum, "student_mean")
        for name, target in self.targets.items():
            target.cross = accumulate(target.cross, f"cross:{name}")
            target.target_sum = accumulate(target.target_sum, f"target:{name}")
        self.scale_sum += float(contribution["scale"][0])
        self.num_tasks += 1

    def end_task(self, expert_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> float:
        """Fold the current task into the running sums; returns its scale s_t."""
        contribution = self.task_contribution(expert_params)
        self.merge(contribution)
        return float(contribution["scale"][0])

    def solve(
        self,
        anchors: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
        fallbacks: Fallbacks | None = None,
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Closed-form (W, b) in float64 for every module (b None for a bias-free Linear), with
        λ and ε of `self.params`.

        anchors: name → (a(W), a(b)), unused when λ = 0. The shared left-hand side is factored
        once, in place: the running sums are consumed. A least-squares fallback (λ = 0, singular
        system) is recorded in `fallbacks`, one entry per module.
        """
        if self.gram is None:
            raise ValueError("no task was merged into this Linear input's statistics")
        assert self.student_mean_sum is not None  # merged with the gram
        for target in self.targets.values():
            target.task_cross = None
        self._task_gram = self._task_mixed = None
        lam, eps = self.params.lam, self.params.eps
        system = ridge_system(
            self.gram, lam, eps, in_place=True, fallbacks=fallbacks, modules=tuple(self.targets)
        )
        self.gram = None
        out = {}
        for name, target in self.targets.items():
            anchor_weight, anchor_bias = anchors.get(name, (None, None))
            assert target.cross is not None and target.target_sum is not None  # merged too
            weight = solve_linear_weight(system, target.cross, lam, eps, anchor_weight)
            bias = None
            if target.has_bias:
                bias = solve_linear_bias(
                    weight,
                    self.scale_sum,
                    target.target_sum,
                    self.student_mean_sum,
                    lam,
                    anchor_bias,
                )
            out[name] = (weight, bias)
        return out
