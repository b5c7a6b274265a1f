"""RegMean as a repair baseline (featcal_core/repair): the closed form against brute force, and
whole checkpoints against Grams collected with forward hooks on the Hugging Face models."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertModel,
    CLIPVisionModel,
    T5ForConditionalGeneration,
)

import factories
from factories import TINY_LLAMA
from featcal_cli.main import main
from featcal_core.data.synthetic import build_pool
from featcal_core.errors import FeatCalError
from featcal_core.method.settings import Settings
from featcal_core.method.solvers import Fallbacks
from featcal_core.repair import REGMEAN_RECORD, regmean_checkpoint
from featcal_core.repair.closed_form import reduce_off_diagonal_, regmean_weight
from featcal_core.repair.grams import GramSum

F64 = torch.float64
TINY_T5 = dict(
    d_model=16,
    d_ff=32,
    num_layers=2,
    num_decoder_layers=3,
    num_heads=2,
    d_kv=12,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
)
#: family → (pool builder arguments, HF model class, block-root substring of its Linear names)
FAMILIES = {
    "clip": ("clip", factories.TINY_CLIP, CLIPVisionModel, "encoder.layers."),
    "bert": ("bert", factories.TINY_BERT, BertModel, "encoder.layer."),
    "llama": ("llama", TINY_LLAMA, AutoModelForCausalLM, "model.layers."),
    "t5": ("t5", TINY_T5, T5ForConditionalGeneration, ".block."),
}
#: T5 decoder Linears that read the encoder's output (weighted by the encoder's tokens)
CROSS_KV = ("EncDecAttention.k", "EncDecAttention.v")


# ----------------------------------------------------------------------------- the closed form
def _problem(seed: int, tasks: int, tokens: int, d_in: int = 6, d_out: int = 4):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, d_in, generator=gen, dtype=F64) * (1 + t) for t in range(tasks)]
    ws = [torch.randn(d_out, d_in, generator=gen, dtype=F64) for _ in range(tasks)]
    return xs, ws


def test_alpha_one_is_least_squares_over_the_stacked_task_inputs():
    xs, ws = _problem(seed=1, tasks=3, tokens=20)
    got = regmean_weight([x.T @ x for x in xs], ws, alpha=1.0)
    stacked = torch.cat(xs)
    targets = torch.cat([x @ w.T for x, w in zip(xs, ws, strict=True)])
    expected = torch.linalg.lstsq(stacked, targets, driver="gelsd").solution.T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.6, 0.9])
def test_reduced_off_diagonals_match_the_direct_formula(alpha):
    xs, ws = _problem(seed=2, tasks=2, tokens=15)
    grams = [x.T @ x for x in xs]
    reduced = [alpha * g + (1 - alpha) * torch.diag(torch.diagonal(g)) for g in grams]
    lhs = sum(reduced)
    rhs = sum(g @ w.T for g, w in zip(reduced, ws, strict=True))
    expected = torch.linalg.solve(lhs, rhs).T
    kept = [g.clone() for g in grams]
    got = regmean_weight(grams, ws, alpha=alpha)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(g, k) for g, k in zip(grams, kept, strict=True))  # inputs untouched
    torch.testing.assert_close(reduce_off_diagonal_(grams[0].clone(), alpha), reduced[0])


def test_singular_gram_gets_a_recorded_ridge_towards_the_anchor():
    xs, ws = _problem(seed=3, tasks=1, tokens=3)  # 3 tokens, d_in = 6: rank 3
    anchor = torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=F64)
    found = Fallbacks("test")
    got = regmean_weight([xs[0].T @ xs[0]], ws, alpha=1.0, anchor=anchor, fallbacks=found)
    assert [e["kind"] for e in found.entries] == ["ridge"]
    torch.testing.assert_close(xs[0] @ got.T, xs[0] @ ws[0].T, rtol=1e-4, atol=1e-4)
    null = torch.eye(6, dtype=F64) - torch.linalg.pinv(xs[0]) @ xs[0]  # projector on ker X
    torch.testing.assert_close(got @ null, anchor @ null, rtol=1e-4, atol=1e-4)


def test_gram_sum_float32_products_match_float64():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2500, 40, generator=gen, dtype=torch.float32)  # several token chunks
    w = torch.rand(2500, generator=gen, dtype=F64) + 0.01
    sums = {p: GramSum(40, torch.device("cpu"), p) for p in ("float32", "float64")}
    for gram_sum in sums.values():
        gram_sum.add(x, w)
    exact = (x.to(F64) * w[:, None]).T @ x.to(F64) / w.sum()
    torch.testing.assert_close(sums["float64"].mean(), exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sums["float32"].mean(), exact, rtol=1e-5, atol=1e-5)
    assert sums["float32"].gram.dtype == F64


# ------------------------------------------------------------------------- whole checkpoints
@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """Tiny float64 pools, built once per family (3 tasks for CLIP, 2 for the text models)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            family, config, _, _ = FAMILIES[kind]
            tasks = ("alpha", "beta", "gamma") if kind == "clip" else ("alpha", "beta")
            root = tmp_path_factory.mktemp(kind)
            built[kind] = build_pool(root / "zoo", family, config, tasks, dtype=F64)
        return built[kind]

    return get


def _model_inputs(kind: str, pool, task: str) -> dict[str, torch.Tensor]:
    data = datasets.load_from_disk(str(pool.calib[task]))
    if kind == "clip":
        processor = AutoImageProcessor.from_pretrained(pool.base)
        pixels = processor(images=[im.convert("RGB") for im in data["image"]], return_tensors="pt")[
            "pixel_values"
        ]
        return {"pixel_values": pixels.to(F64)}
    tokenizer = AutoTokenizer.from_pretrained(pool.base)
    tokenizer.padding_side = "right"
    enc = tokenizer(
        list(data["text"]), padding=True, truncation=True, max_length=64, return_tensors="pt"
    )
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if kind == "t5":  # teacher forcing: the start token, then the target shifted right
        labels = tokenizer(
            list(data["target"]), padding=True, truncation=True, max_length=64, return_tensors="pt"
        )
        start = torch.zeros(len(labels["input_ids"]), 1, dtype=labels["input_ids"].dtype)
        inputs["decoder_input_ids"] = torch.cat([start, labels["input_ids"][:, :-1]], dim=1)
        inputs["decoder_attention_mask"] = labels["attention_mask"]
    return inputs


def _hooked_grams(kind: str, pool, task: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-token mean Grams of each named Linear's input over the real tokens, collected with
    forward hooks on expert `task`'s Hugging Face model running the whole task set at once."""
    _, _, model_cls, _ = FAMILIES[kind]
    model = model_cls.from_pretrained(
        pool.experts[task], dtype=F64, attn_implementation="eager"
    ).eval()
    inputs = _model_inputs(kind, pool, task)
    seen = {}
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(name, args[0])
        )
    with torch.no_grad():
        model(**inputs)
    grams = {}
    for name, x in seen.items():
        decoder = name.startswith("decoder.") and not name.endswith(CROSS_KV)
        mask = inputs.get("decoder_attention_mask" if decoder else "attention_mask")
        if mask is not None:
            x = x[mask.bool()]
        x = x.reshape(-1, x.shape[-1])
        grams[name] = x.T @ x / x.shape[0]
    return grams


def _expected(kind: str, pool, alpha: float) -> dict[str, torch.Tensor]:
    """RegMean's block-Linear tensors, computed here from the hooked Grams (torch.linalg.solve)."""
    _, _, model_cls, root = FAMILIES[kind]
    experts = {t: load_file(str(p / "model.safetensors")) for t, p in pool.experts.items()}
    first = next(iter(experts.values()))
    names = [
        n
        for n, m in model_cls.from_pretrained(pool.merged).named_modules()
        if root in n and isinstance(m, torch.nn.Linear)
    ]
    grams = {t: _hooked_grams(kind, pool, t, names) for t in experts}
    out = {}
    for name in names:
        reduced = {
            t: alpha * g[name] + (1 - alpha) * torch.diag(torch.diagonal(g[name]))
            for t, g in grams.items()
        }
        rhs = sum(reduced[t] @ experts[t][f"{name}.weight"].T for t in experts)
        out[f"{name}.weight"] = torch.linalg.solve(sum(reduced.values()), rhs).T
        if f"{name}.bias" in first:
            out[f"{name}.bias"] = torch.stack([e[f"{name}.bias"] for e in experts.values()]).mean(0)
    return out


@pytest.mark.parametrize("kind", ["clip", "bert", "llama", "t5"])
def test_checkpoint_matches_hooked_grams_and_keeps_everything_else(pools, tmp_path, kind):
    pool, alpha = pools(kind), 0.6
    out = tmp_path / "regmean"
    record = regmean_checkpoint(
        pool.base,
        pool.merged,
        pool.experts,
        pool.calib,
        out,
        alpha=alpha,
        settings=Settings(batch_size=5),
        progress=False,
    )
    assert json.loads((out / REGMEAN_RECORD).read_text()) == record
    assert record["hyperparameters"]["alpha"] == alpha and record["fallbacks"] == 0
    assert set(record["inputs"]["experts"]) == set(pool.experts)
    _, _, model_cls, _ = FAMILIES[kind]
    model_cls.from_pretrained(out)  # loads with transformers
    got = load_file(str(out / "model.safetensors"))
    merged = load_file(str(pool.merged / "model.safetensors"))
    expected = _expected(kind, pool, alpha)
    assert len(expected) >= 2 * FAMILIES[kind][1].get("num_hidden_layers", 2)
    assert set(got) == set(merged)
    for key, tensor in merged.items():
        if key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-8, atol=1e-10)
            if key.endswith(".weight"):
                assert not torch.equal(got[key], tensor), key
        else:  # embeddings, norms, heads: the merged checkpoint's, bit for bit
            assert torch.equal(got[key], tensor), key


def test_pooled_weights_change_only_the_last_block_and_spilling_changes_nothing(pools, tmp_path):
    pool = pools("clip")
    plain, pooled, spilled = tmp_path / "plain", tmp_path / "pooled", tmp_path / "spilled"
    for out, flag, spill in (
        (plain, False, None),
        (pooled, True, None),
        (spilled, False, tmp_path / "spill"),
    ):
        regmean_checkpoint(
            pool.base,
            pool.merged,
            pool.experts,
            pool.calib,
            out,
            pooled_weights=flag,
            spill_dir=spill,
            progress=False,
        )
    spill = load_file(str(spilled / "model.safetensors"))
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(pooled / "model.safetensors"))
    assert all(torch.equal(a[k], spill[k]) for k in a)
    assert not any((tmp_path / "spill").iterdir())  # the streams were removed
    assert all(torch.equal(a[k], b[k]) for k in a if "layers.1." not in k)
    assert not torch.equal(
        a["encoder.layers.1.mlp.fc1.weight"], b["encoder.layers.1.mlp.fc1.weight"]
    )


# ------------------------------------------------------------------------------- bad input, CLI
def test_bad_input_fails_before_any_output(pools, tmp_path):
    pool = pools("clip")
    out = tmp_path / "out"
    calib = {t: p for t, p in pool.calib.items() if t != "beta"}
    with pytest.raises(FeatCalError, match="'beta' has no --calib beta=DIR"):
        regmean_checkpoint(pool.base, pool.merged, pool.experts, calib, out, progress=False)
    missing = dict(pool.calib, beta=tmp_path / "nowhere")
    with pytest.raises(FeatCalError, match="--calib beta=.*nowhere.*does not exist"):
        regmean_checkpoint(pool.base, pool.merged, pool.experts, missing, out, progress=False)
    with pytest.raises(FeatCalError, match="--alpha must be a number in"):
        regmean_checkpoint(pool.base, pool.merged, pool.experts, pool.calib, out, alpha=1.5)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_cli_writes_the_same_checkpoint_as_the_api(pools, tmp_path, capsys):
    pool = pools("bert")
    args = ["regmean", "--base", str(pool.base), "--merged", str(pool.merged), "--no-progress"]
    for task in pool.experts:
        args += [
            "--expert",
            f"{task}={pool.experts[task]}",
            "--calib",
            f"{task}={pool.calib[task]}",
        ]
    assert main([*args, "--out", str(tmp_path / "cli"), "--alpha", "0.9"]) == 0
    regmean_checkpoint(
        pool.base,
        pool.merged,
        pool.experts,
        pool.calib,
        tmp_path / "api",
        alpha=0.9,
        progress=False,
    )
    cli, api = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("cli", "api"))
    assert all(torch.equal(cli[k], api[k]) for k in api)
    assert (
        json.loads((tmp_path / "cli" / REGMEAN_RECORD).read_text())["hyperparameters"]["alpha"]
        == 0.9
    )
    assert main([*args, "--out", str(tmp_path / "bad"), "--alpha", "-1"]) == 2
    assert "--alpha must be a number in [0, 1]" in capsys.readouterr().err


def test_gram_sum_bfloat16_products_stay_near_float64(record_property):
    """RegMean's Grams with bfloat16 products (`precision: bfloat16`): each chunk's product is
    rounded to bfloat16 on the CPU before the float64 add; measured 1.2e-3 relative (Frobenius),
    asserted ≤ 1e-2."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2500, 40, generator=gen, dtype=torch.float32)  # several token chunks
    w = torch.rand(2500, generator=gen, dtype=F64) + 0.01
    gram_sum = GramSum(40, torch.device("cpu"), "bfloat16")
    gram_sum.add(x, w)
    exact = (x.to(F64) * w[:, None]).T @ x.to(F64) / w.sum()
    got = gram_sum.mean()
    error = float(torch.linalg.matrix_norm(got - exact) / torch.linalg.matrix_norm(exact))
    record_property("report: RegMean Gram, bfloat16 products vs float64", f"{error:.2e}")
    assert got.dtype == F64 and 0 < error <= 1e-2
