"""Memory, disk traffic and FLOPs of FeatCal on one Llama-class block, from the geometry alone.

Pure arithmetic (no torch), so a measuring parent process can import it. `estimate(geometry,
workload)` walks one block the way `BlockRunner.calibrate` allocates (block.py, statistics.py,
task_statistics.py, block_solve.py, solvers.py, streams.py), keeping a ledger of the live
tensors in bytes, and returns the peak of live host memory (and of device memory, for CUDA)
with the terms live at that moment, each phase's high-water mark, the named sizes (a block's
weights, one task's statistics, the running sums, a stream, ...), one block's disk traffic and
its FLOPs. `seconds(estimate, rates)` turns the FLOPs (and, given a bandwidth, the traffic) into
a time per block.

Symbols: d hidden width, f FFN width, H / K attention / key-value heads of width h, T tasks
(experts), n calibration inputs per task of L (padded) tokens, N weighted tokens per task
(at most n·L), B the batch size, b the checkpoints' bytes per element, p the token products'.

What a block holds (one Linear *group* per input: q/k/v share one, o_proj, gate/up share one,
down_proj reads the f-wide input):
- per group of width d_in with outputs D = Σ d_out, per task, float64: the Gram d_in², the
  student and expert token sums 2·d_in, and either the cross terms d_in·D ("direct") or the mixed
  Gram d_in² ("via X", chosen when d_in·(N + D) < 2·N·D, as `LinearInputStats` does; its cross
  terms d_in·D appear when the task closes);
- the running sums across tasks (in memory): Gram, cross terms, means, float64 — or, spilled
  (`--spill-dir`), each task's contribution in a file, folded back one group at a time;
- the merged and the expert block modules (b bytes per parameter), a third block while one is
  read, the base block during the solves, and the solved block;
- one batch's activations (both models' captured Linear inputs, the eager attention scores
  B·H·L² in float32 and b) and the products' scratch (≤ 1024 tokens × d_in in p);
- the hidden-state streams, two per task (n·L·d·b each): all in memory, or on disk with one
  being written (gathered on the device on CUDA, then copied to the host);
- the solve of a group: the factor (in place when λ > 0), the float64 anchors a(W) of its
  modules, one right-hand side, triangular-solve columns, the float64 solutions.
Not modelled: the CUDA caching allocator's reserve and context, Python objects, the allocator's
fragmentation (the measured baseline absorbs what is constant).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from featcal_core.method.hyperparameters import FeatCalParams

#: bytes of one float64 entry (every sum, every solve)
F64 = 8
#: bytes per element of the token products' dtype (precision.PRODUCT_DTYPES)
PRODUCT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}
#: mirrors of the code's constants (tests/test_memory_model.py checks they agree)
TOKEN_CHUNK = 512  # statistics.TOKEN_CHUNK: tokens per float64 work chunk
TOKEN_CHUNK_FP32 = 1024  # statistics.TOKEN_CHUNK_FP32: the same for float32/bfloat16 products
SYMMETRIC_BLOCK = 768  # statistics.SYMMETRIC_BLOCK: Gram row blocks, float64 products
SYMMETRIC_BLOCK_FP32 = 384  # statistics.SYMMETRIC_BLOCK_FP32: the same, reduced products
SYMMETRIC_BLOCK_CUDA = 4096  # statistics.SYMMETRIC_BLOCK_CUDA: the same on CUDA
SOLVE_COLUMNS = 512  # solvers.SOLVE_COLUMNS: right-hand-side columns per triangular solve
BF16_MIN_LAM = 0.01  # precision.BF16_MIN_LAM: below it bfloat16 passes keep float32 products
BATCH_SIZE = 16  # settings.Settings.batch_size
#: resident memory of a `featcal calibrate` process once torch, transformers' Llama modules,
#: datasets and featcal are imported, before any tensor (VmRSS, torch 2.14, transformers 5.25,
#: this project's 2-core CPU machine; docs/benchmarks.md measures it per run)
IMPORTS_BYTES = 834 * 2**20


@dataclass(frozen=True)
class LinearGroup:
    """Linear modules reading one input of width d_in: label (its first module), outputs
    (module → d_out), whether they have biases."""

    label: str
    d_in: int
    outputs: dict[str, int]
    bias: bool = False

    @property
    def width_out(self) -> int:
        """D = Σ d_out over the group."""
        return sum(self.outputs.values())


@dataclass(frozen=True)
class Geometry:
    """A Llama-class decoder: hidden width, FFN width, heads, key-value heads, blocks, vocabulary
    (stems only: the embedding is not calibrated), head width (hidden / heads unless given),
    q/k/v biases (Qwen2)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int = 1
    vocab: int = 32000
    head_dim: int | None = None
    attention_bias: bool = False

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def groups(self) -> list[LinearGroup]:
        """The Linear groups of one block, in the order the block solves them."""
        d, f, h = self.hidden, self.intermediate, self.head_width
        q, kv = self.heads * h, self.kv_heads * h
        return [
            LinearGroup(
                "q_proj", d, {"q_proj": q, "k_proj": kv, "v_proj": kv}, self.attention_bias
            ),
            LinearGroup("o_proj", q, {"o_proj": d}),
            LinearGroup("gate_proj", d, {"gate_proj": f, "up_proj": f}),
            LinearGroup("down_proj", f, {"down_proj": d}),
        ]

    def norm_widths(self) -> list[int]:
        """input_layernorm and post_attention_layernorm (RMSNorm, weight only)."""
        return [self.hidden, self.hidden]

    def block_parameters(self) -> int:
        """Parameters of one block (Linear weights and biases, norm weights)."""
        linear = sum(g.d_in * g.width_out + (g.width_out if g.bias else 0) for g in self.groups())
        return linear + sum(self.norm_widths())

    def parameters(self) -> int:
        """The whole model: blocks, untied embedding and lm_head, final norm."""
        return self.layers * self.block_parameters() + 2 * self.vocab * self.hidden + self.hidden


#: published geometries (their config.json); `vocab` is the real one
GEOMETRIES: dict[str, Geometry] = {
    "tinyllama-1.1b": Geometry(2048, 5632, 32, 4, layers=22, vocab=32000),
    "llama-3.2-3b": Geometry(3072, 8192, 24, 8, layers=28, vocab=128256, head_dim=128),
    "llama-3.1-8b": Geometry(4096, 14336, 32, 8, layers=32, vocab=128256),
    "llama-3.1-70b": Geometry(8192, 28672, 64, 8, layers=80, vocab=128256),
}


@dataclass(frozen=True)
class Workload:
    """How a calibration runs: tasks T, inputs n per task of `tokens` L (padded) tokens,
    `real_tokens` N weighted tokens per task (None: n·L; the fewest over the tasks), the resolved
    precision (float64 | float32 | bfloat16), the checkpoints' bytes per element, spilled
    (`--spill-dir`: streams and per-task statistics on disk) or in memory, the device
    (cpu | cuda), the batch size, λ, and the process's resident memory before any tensor."""

    tasks: int
    inputs: int
    tokens: int
    real_tokens: int | None = None
    precision: str = "float32"
    weight_bytes: int = 2
    spill: bool = True
    device: str = "cpu"
    batch_size: int = BATCH_SIZE
    lam: float = FeatCalParams().lam
    baseline_bytes: int = IMPORTS_BYTES

    def __post_init__(self) -> None:
        if self.precision not in PRODUCT_BYTES:
            raise ValueError(f"precision must be one of {sorted(PRODUCT_BYTES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError("device must be cpu or cuda")
        if min(self.tasks, self.inputs, self.tokens, self.batch_size) < 1:
            raise ValueError("tasks, inputs, tokens and batch_size must be at least 1")

    @property
    def weighted_tokens(self) -> int:
        """N: weighted tokens per task."""
        return self.real_tokens if self.real_tokens is not None else self.inputs * self.tokens

    @property
    def products(self) -> str:
        """The token products' precision (precision.products_for)."""
        if self.precision == "bfloat16" and self.lam < BF16_MIN_LAM:
            return "float32"
        return self.precision

    @property
    def pass_bytes(self) -> int:
        """Bytes per element of the stems, block modules and streams (precision.pass_dtype): the
        checkpoints', except 16-bit checkpoints outside bfloat16, which run in float32."""
        return 4 if self.weight_bytes == 2 and self.precision != "bfloat16" else self.weight_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation: the passes' dtype, bfloat16 under bfloat16 autocast."""
        return 2 if self.precision == "bfloat16" else self.pass_bytes

    @property
    def activation_dtype(self) -> str:
        """The activations' dtype name (the forwards' GEMM rate in `seconds`)."""
        return {2: "bfloat16", 4: "float32", 8: "float64"}[self.activation_bytes]


@dataclass
class _Ledger:
    """Live tensors by term (bytes) and the high-water mark: its total, where, and the terms."""

    live: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    phase: str = ""
    at_peak: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)

    def set(self, term: str, nbytes: float) -> None:
        if nbytes:
            self.live[term] = int(nbytes)
        else:
            self.live.pop(term, None)

    def add(self, term: str, nbytes: float) -> None:
        self.set(term, self.live.get(term, 0) + nbytes)

    def drop(self, *terms: str) -> None:
        for term in terms:
            self.live.pop(term, None)

    def mark(self, phase: str) -> None:
        total = sum(self.live.values())
        self.phases[phase] = max(self.phases.get(phase, 0), total)
        if total > self.peak:
            self.peak, self.phase, self.at_peak = total, phase, dict(self.live)

    def summary(self) -> dict:
        return {"peak_bytes": self.peak, "phase": self.phase, "live": self.at_peak}


def via_x(group: LinearGroup, tokens: int) -> bool:
    """Whether `LinearInputStats` accumulates the mixed Gram X_t (else the cross terms directly)."""
    return tokens > 0 and group.d_in * (tokens + group.width_out) < 2 * tokens * group.width_out


def task_buffers(group: LinearGroup, tokens: int) -> int:
    """Bytes of one task's accumulators of `group` while its batches run (float64)."""
    d = group.d_in
    cross = 0 if via_x(group, tokens) else d * group.width_out
    return F64 * (d * d * (2 if via_x(group, tokens) else 1) + 2 * d + cross)


def contribution_bytes(group: LinearGroup) -> int:
    """Bytes of one task's contribution of `group` (task_statistics.py): Gram, student mean,
    cross terms, target sums, scale; also the size of its running sums."""
    d, width = group.d_in, group.width_out
    return F64 * (d * d + d + d * width + width + 1)


def statistics_file_bytes(geometry: Geometry) -> int:
    """Tensor bytes of one task's statistics file of one block (its header excluded): every
    group's contribution and four (d,) float64 vectors per norm."""
    norms = sum(F64 * 4 * width for width in geometry.norm_widths())
    return sum(contribution_bytes(g) for g in geometry.groups()) + norms


def _activations(geometry: Geometry, work: Workload) -> dict[str, int]:
    """Peak bytes of one batch's activations in the statistics pass (both block modules run,
    their captured Linear inputs held until accumulated) and in a plain forward."""
    g, a = geometry, work.activation_bytes
    seqs = min(work.batch_size, work.inputs)
    m = seqs * work.tokens  # tokens of one batch, padding included
    d, f, heads = g.hidden, g.intermediate, g.heads * g.head_width
    scores = seqs * g.heads * work.tokens**2 * (2 * a + 4)  # pre-softmax, float32 softmax, cast
    captured = m * a * (5 * d + f)  # q/k/v, o, gate/up, down inputs, the residual, the output
    attention = m * a * (d + 4 * heads) + scores  # normed input, q, repeated k and v, output
    mlp = m * a * (4 * d + 3 * f)  # act(gate), up, their product (down's input)
    forward = max(attention, mlp)
    padded = work.weighted_tokens < work.inputs * work.tokens
    batch_tokens = min(m, work.weighted_tokens)
    # `Selection.tokens` copies student and expert tokens of the widest input when padded
    copies = 2 * batch_tokens * a * max(gr.d_in for gr in g.groups()) if padded else 0
    return {
        "statistics pass": max(captured + forward, 2 * captured + copies),
        "forward": m * a * d + forward,
    }


def _product_block(work: Workload) -> int:
    """Rows per product block of the Gram and cross terms (statistics.product_block)."""
    if work.products == "float64":
        return SYMMETRIC_BLOCK
    return SYMMETRIC_BLOCK_CUDA if work.device == "cuda" else SYMMETRIC_BLOCK_FP32


def _scratch(geometry: Geometry, work: Workload) -> int:
    """Bytes of the products' reusable work buffers (statistics.Scratch) of one block."""
    widest = max(g.d_in for g in geometry.groups())
    batch_tokens = min(min(work.batch_size, work.inputs) * work.tokens, work.weighted_tokens)
    direct = any(not via_x(g, work.weighted_tokens) for g in geometry.groups())
    if work.products == "float64":
        rows = min(TOKEN_CHUNK, batch_tokens)
        return F64 * (2 * rows * widest + (rows * SOLVE_COLUMNS if direct else 0))
    p = PRODUCT_BYTES[work.products]
    rows = min(TOKEN_CHUNK_FP32, batch_tokens)
    inputs = 2 * rows * widest * p  # x_s, x_e in the products' dtype
    product = _product_block(work) * max(widest, SOLVE_COLUMNS) * p
    upcast = rows * widest * 4 if work.products == "bfloat16" else 0  # _column_sums' .float()
    return inputs + product + upcast + (rows * SOLVE_COLUMNS * p if direct else 0)


def _solve_group(dev: _Ledger, host: _Ledger, group: LinearGroup, work: Workload, b: int) -> None:
    """The solve of one group (block_solve.solve → LinearInputStats.solve): anchors, factor,
    one right-hand side at a time, the float64 solutions, then the solved weights kept in the
    checkpoints' dtype (on the host)."""
    d = group.d_in
    cuda = work.device == "cuda"
    for d_out in group.outputs.values():  # a(W) = ρ·merged + (1 − ρ)·base, float64
        dev.set("base tensor (float64 copy)", F64 * d_out * d)
        dev.set("base tensor (on device)", b * d_out * d if cuda else 0)
        dev.add("anchors (float64)", F64 * d_out * d)
        dev.mark("solve: anchors")
    dev.drop("base tensor (float64 copy)", "base tensor (on device)")
    if work.lam <= 0:  # no ridge: the factor is a new matrix beside the Gram
        dev.set("Cholesky factor (λ = 0)", F64 * d * d)
    for d_out in group.outputs.values():
        dev.set("right-hand side (float64)", F64 * d * d_out)
        dev.set("triangular-solve columns", 3 * F64 * d * min(SOLVE_COLUMNS, d_out))
        dev.mark("solve: triangular solves")
        dev.drop("triangular-solve columns")
        dev.add("solutions (float64)", F64 * d * d_out)  # .T.contiguous() beside the rhs
        dev.mark("solve: triangular solves")
        dev.drop("right-hand side (float64)")
    dev.drop("Cholesky factor (λ = 0)")
    dev.drop(f"running sums: Gram {group.label}")  # the factor goes with the system
    for d_out in group.outputs.values():
        host.add("solved block (checkpoint dtype)", b * d_out * d)
        host.mark("solve: keep")
    dev.drop("solutions (float64)", "anchors (float64)")


def estimate(geometry: Geometry, work: Workload) -> dict:
    """Peak host and device memory (bytes, with the terms live at the peak and each phase's
    high-water mark), the named sizes, one block's disk traffic (bytes) and FLOPs."""
    g, b, c = geometry, work.weight_bytes, work.pass_bytes  # checkpoints', passes' bytes
    cuda = work.device == "cuda"
    host = _Ledger()
    dev = _Ledger() if cuda else host
    tokens = work.weighted_tokens
    block = g.block_parameters() * b  # as read from and written to files
    module = g.block_parameters() * c  # as loaded into a block module
    stream = work.inputs * work.tokens * g.hidden * c  # one task's stream (n, L, d)
    groups = g.groups()
    per_task = sum(task_buffers(gr, tokens) for gr in groups)
    act = _activations(g, work)
    scratch = _scratch(g, work)
    seqs = min(work.batch_size, work.inputs)
    batch = seqs * work.tokens * g.hidden * c
    host.set("process baseline (imports)", work.baseline_bytes)

    # stems: each model's embedding read and loaded, both streams of every task written
    stem = g.vocab * g.hidden * b
    dev.set("stem module", g.vocab * g.hidden * c)
    host.set("stem weights read", stem)
    if cuda:
        dev.set("stem weights (on device)", g.vocab * g.hidden * c)
    host.set("streams (in memory)", 0 if work.spill else (2 * work.tasks - 1) * stream)
    if cuda:  # transfers.HostRows: gathered on the device, copied to the host at the end
        dev.set("stream being written (on device)", stream)
    host.set("stream being written", stream)
    host.mark("stems")
    host.drop("stem weights read", "stream being written")
    dev.drop("stem module", "stem weights (on device)", "stream being written (on device)")
    host.set("streams (in memory)", 0 if work.spill else 2 * work.tasks * stream)

    # one block: the merged block read into its module (the expert module holds the last task's)
    dev.set("block modules (merged, expert)", 2 * module)
    host.set("block weights read", block)
    if cuda:
        dev.set("block weights (on device)", module)
    host.mark("read merged block")
    kept_cross = sum(F64 * gr.d_in * gr.width_out for gr in groups if via_x(gr, tokens))
    for task in range(work.tasks):
        host.set("block weights read", block)
        if cuda:
            dev.set("block weights (on device)", module)
        host.mark("read expert block")
        host.drop("block weights read")
        dev.drop("block weights (on device)")
        # in memory, the buffers serve every task (via X, with the cross terms of the first)
        dev.set(
            "task statistics (float64)", per_task + (kept_cross if task and not work.spill else 0)
        )
        dev.set("products scratch", scratch)
        dev.set("activations (one batch)", act["statistics pass"])
        if work.spill:
            host.set("stream batches read", 2 * batch)
        elif cuda:
            dev.set("stream batches (on device)", 2 * batch)
        # the expert's outputs (transfers.HostRows): one tensor from the first batch on, on the
        # device until the pass ends (then copied to the host)
        dev.set("expert outputs", stream)
        dev.mark("statistics pass")
        if cuda:
            host.mark("statistics pass")
        dev.drop("activations (one batch)", "stream batches (on device)")
        host.drop("stream batches read")
        host.set("expert outputs", stream)
        host.mark("expert outputs")
        dev.drop("expert outputs")
        host.drop("expert outputs")
        # closing the task group by group; via X the cross terms appear and X_t is converted
        for gr in groups:
            if not via_x(gr, tokens):
                continue
            reduced = work.products != "float64"
            if reduced:
                dev.set("X_t in float32", 4 * gr.d_in**2)
            if work.spill and reduced:  # a one-task accumulator frees X_t before the products
                dev.add("task statistics (float64)", -F64 * gr.d_in**2)
            if work.spill or task == 0:
                dev.add("task statistics (float64)", F64 * gr.d_in * gr.width_out)
            dev.mark("close task")
            dev.drop("X_t in float32")
            if work.spill and not reduced:  # freed when task_contribution returns
                dev.add("task statistics (float64)", -F64 * gr.d_in**2)
        if work.spill:
            if cuda:  # save_tensors moves one tensor at a time to the host
                largest = max(F64 * max(gr.d_in**2, gr.d_in * gr.width_out) for gr in groups)
                host.set("statistics tensor (to host)", largest)
                host.mark("save task statistics")
                host.drop("statistics tensor (to host)")
            dev.drop("task statistics (float64)", "products scratch")
        elif task == 0:  # the first fold clones the contribution into the running sums
            for gr in groups:
                dev.set(f"running sums: Gram {gr.label}", F64 * gr.d_in**2)
                dev.add("running sums: cross terms", contribution_bytes(gr) - F64 * gr.d_in**2)
            dev.mark("fold")
    dev.drop("task statistics (float64)", "products scratch")  # _reused.clear()

    # solves: the base block is read; spilled statistics are folded one group at a time
    host.set("base block", block)
    for gr in groups:
        if work.spill:
            gram, rest = F64 * gr.d_in**2, contribution_bytes(gr) - F64 * gr.d_in**2
            largest = F64 * max(gr.d_in**2, gr.d_in * max(gr.outputs.values()))
            dev.set(f"running sums: Gram {gr.label}", gram)
            dev.set("running sums: cross terms", rest)
            if work.tasks > 1:  # the next task's tensor, read beside the sum it is added to
                host.set("statistics tensor read", largest)
                if cuda:
                    dev.set("statistics tensor (on device)", largest)
            dev.mark("fold")
            if cuda:
                host.mark("fold")
            host.drop("statistics tensor read")
            dev.drop("statistics tensor (on device)")
        _solve_group(dev, host, gr, work, b)
        if work.spill:
            dev.drop("running sums: cross terms")
    dev.drop("running sums: cross terms")
    host.drop("base block")

    # the calibrated block's pass: every task's student stream through the solved block
    if cuda:
        dev.set("block weights (on device)", module)
        dev.mark("load calibrated block")
        dev.drop("block weights (on device)")
    dev.set("activations (one batch)", act["forward"])
    if work.spill:
        host.set("stream batches read", 2 * batch)
    if cuda:
        dev.set("stream being written (on device)", stream)
    host.set("stream being written", stream)
    dev.mark("calibrated pass")
    if cuda:
        host.mark("calibrated pass")
    dev.drop("activations (one batch)", "stream being written (on device)")

    file_bytes = statistics_file_bytes(g)
    terms = {
        "block weights (one model)": block,
        "one task's statistics while it runs": per_task,
        "one task's statistics file": file_bytes,
        "running sums (in memory)": sum(contribution_bytes(gr) for gr in groups),
        "one stream (n, L, d)": stream,
        "all streams (2 per task)": 2 * work.tasks * stream,
        "activations, statistics pass (one batch)": act["statistics pass"],
        "products scratch": scratch,
        "down_proj Gram (float64)": F64 * g.intermediate**2,
    }
    spilled = work.tasks * file_bytes if work.spill else 0
    streams_io = stream * work.tasks if work.spill else 0
    disk = {
        "weights read": (work.tasks + 2) * block,  # merged, each expert, base
        "statistics written": spilled,
        "statistics read": spilled,
        "streams written": 2 * streams_io,  # each task's expert and student outputs
        "streams read": 4 * streams_io,  # both inputs twice: statistics and calibrated passes
        "block file written": block,
    }
    return {
        "geometry": asdict(g),
        "workload": {
            **asdict(work),
            "products": work.products,
            "pass_bytes": work.pass_bytes,
            "activation_dtype": work.activation_dtype,
        },
        "via_x": {gr.label: via_x(gr, tokens) for gr in groups},
        "host": host.summary(),
        "device": dev.summary() if cuda else None,
        "phases": {"host": host.phases, **({"device": dev.phases} if cuda else {})},
        "terms": terms,
        "disk_per_block": disk,
        "flops_per_block": flops(g, work),
    }


def run_disk(geometry: Geometry, work: Workload) -> dict[str, int]:
    """Bytes a whole `featcal calibrate` run writes and reads through files (every block, the
    stems, the exported model and its sha256 for the output's marker; not the sha256 of input
    files that featcal's digest store does not hold yet, up to one read of each input
    checkpoint), and the most its work directory (`--spill-dir`, else inside the output folder)
    holds at once: one block's task statistics and streams, and every block's calibrated
    tensors until the export."""
    g, b, layers = geometry, work.weight_bytes, geometry.layers
    per = estimate(geometry, work)["disk_per_block"]
    block, stem = g.block_parameters() * b, g.vocab * g.hidden * b
    stream = work.inputs * work.tokens * g.hidden * work.pass_bytes
    model = g.parameters() * b
    stems_written = 2 * work.tasks * stream if work.spill else 0
    written = layers * (per["statistics written"] + per["streams written"] + block)
    read = layers * (per["weights read"] + per["statistics read"] + per["streams read"])
    read += (work.tasks + 1) * stem  # the stems: the merged model's and each expert's
    read += model  # the export: the block files and the merged model's other tensors
    read += model  # the guarded writer's sha256 of every written file (io/outputs.py marker)
    files = work.tasks * statistics_file_bytes(g) + (2 * work.tasks + 1) * stream
    return {
        "written": written + stems_written + model,
        "read": read,
        "work directory peak": layers * block + (files if work.spill else 0),
    }


def _gram_flops(tokens: int, d: int, block: int) -> int:
    """Multiply-adds ×2 of `add_gram`'s upper block rows (the whole matrix below two blocks)."""
    if d < 2 * block:
        return 2 * tokens * d * d
    return sum(2 * tokens * min(block, d - i) * (d - i) for i in range(0, d, block))


def flops(geometry: Geometry, work: Workload) -> dict[str, int]:
    """FLOPs of one block (a multiply-add is 2): forward (three passes per task: merged and
    expert in the statistics pass, the calibrated block after the solve; Linears and eager
    attention, on padded tokens), statistics (per task and group: the Gram's upper block rows,
    then the mixed Gram and its product with W_t, or y = x_t W_tᵀ and xᵀy), solve (per group:
    Cholesky d_in³/3 and two triangular solves 2·d_in²·D)."""
    g = geometry
    padded = work.inputs * work.tokens
    linear = sum(gr.d_in * gr.width_out for gr in g.groups())
    attention = 4 * work.tokens * g.heads * g.head_width  # QKᵀ and AV per token, causal unused
    forward = 3 * work.tasks * padded * (2 * linear + attention)
    tokens = work.weighted_tokens
    block = _product_block(work)
    statistics = solve = 0
    for gr in g.groups():
        d, width = gr.d_in, gr.width_out
        cross = (
            2 * tokens * d * d + 2 * d * d * width if via_x(gr, tokens) else 4 * tokens * d * width
        )
        statistics += _gram_flops(tokens, d, block) + cross
        solve += d**3 // 3 + 2 * d * d * width
    return {"forward": forward, "statistics": work.tasks * statistics, "solve": solve}


def seconds(
    estimate_: dict, rates: dict[str, float], disk_bytes_per_s: float | None = None
) -> dict[str, float]:
    """Seconds per block at GEMM rates (`rates`: dtype name → FLOP/s, e.g.
    benchmarks/flops.gemm_rate): forward in the activations' dtype, statistics in the products',
    solve in float64; plus the disk traffic at `disk_bytes_per_s` when given."""
    work = estimate_["workload"]
    passes = work["activation_dtype"]
    counted = estimate_["flops_per_block"]
    out = {
        "forward": counted["forward"] / rates[passes],
        "statistics": counted["statistics"] / rates[work["products"]],
        "solve": counted["solve"] / rates["float64"],
    }
    if disk_bytes_per_s:
        out["disk"] = sum(estimate_["disk_per_block"].values()) / disk_bytes_per_s
    out["total"] = sum(out.values())
    return out
