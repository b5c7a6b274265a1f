"""The merge methods added to the registry (DARE, Model Breadcrumbs, TIES' global trim, TSV-M,
Iso-C, Iso-CTS): each against a plain in-memory float64 reference (tests/merge_references.py),
chunked against whole-tensor merges through run.py, bad hyperparameters, DARE's mask statistics
and determinism, the exact streaming selection behind the global trim, and `featcal merge`."""

from __future__ import annotations

import json
import math

import merge_references as ref
import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal_cli import merge_command
from featcal_cli.main import build_parser
from featcal_core import merging
from featcal_core.errors import FeatCalError
from featcal_core.io.safetensors_io import Reader
from featcal_core.merging.base import Place
from featcal_core.merging.breadcrumbs import band_counts
from featcal_core.merging.dare import keep_mask
from featcal_core.merging.iso import subspace_sizes
from featcal_core.merging.order_statistics import kth_smallest_abs
from featcal_core.merging.ties import kept_count

EXACT = dict(rtol=1e-12, atol=1e-12)


def _experts(shape, count=3, seed=0, delta=0.1):
    """A float64 base (shape) and `count` experts = base + seeded Gaussian deltas."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    return base, [
        base + delta * torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(count)
    ]


def _merge(method: str, base, experts, hp=None, place=None):
    merger = merging.get(method)
    extra = {"place": place} if place is not None and merger.takes_place else {}
    return merger.merge_tensor(base, experts, merger.check(hp or {}), **extra)


# ----- (a) each method against its in-memory reference ------------------------------------------
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("drop_rate", [0.0, 0.5, 0.9])
def test_dare_matches_reference_given_the_mask(ties, drop_rate):
    base, experts = _experts((40, 30))
    method = "dare_ties" if ties else "dare_task_arithmetic"
    hp = {"drop_rate": drop_rate, "seed": 11, "scale": 0.7}
    merged = _merge(method, base, experts, hp, Place("layer.weight"))
    masks = torch.stack(
        [keep_mask(11, "layer.weight", t, 0, base.numel(), drop_rate) for t in range(3)]
    ).reshape(3, *base.shape)
    torch.testing.assert_close(
        merged, ref.dare(base, experts, masks, drop_rate, 0.7, ties), **EXACT
    )
    assert merged.dtype == torch.float64 and merged.shape == base.shape


def test_dare_ties_differs_from_dare_task_arithmetic_where_survivors_overlap():
    base, experts = _experts((50, 40))
    hp = {"drop_rate": 0.5}
    linear = _merge("dare_task_arithmetic", base, experts, hp)
    elected = _merge("dare_ties", base, experts, hp)
    assert not torch.equal(linear, elected)


@pytest.mark.parametrize(
    ("density", "gamma"),
    [(0.15, 0.006), (0.5, 0.1), (0.2, 0.0), (1.0, 0.3), (0.7, 0.5), (0.05, 0.01)],
)
@pytest.mark.parametrize("shape", [(40, 30), (257,), (3, 4, 5)])
def test_breadcrumbs_matches_reference(density, gamma, shape):
    base, experts = _experts(shape)
    hp = {"density": density, "gamma": gamma, "scale": 0.4}
    merged = _merge("breadcrumbs", base, experts, hp)
    torch.testing.assert_close(merged, ref.breadcrumbs(base, experts, density, gamma, 0.4), **EXACT)


def test_breadcrumbs_by_hand_keeps_ties_at_the_thresholds():
    """n = 10, density 0.5 → k = 5, gamma 0.1 → r = 1, b = 4. Sorted |τ|: 0 1 1 2 3 3 4 5 9 9:
    lo = 5th smallest = 3, hi = 9th smallest = 9; both 9s are kept (tie at hi)."""
    assert band_counts(10, 0.5, 0.1) == (5, 4, 1)
    tau = torch.tensor([0.0, 1, 1, 2, 3, -3, 5, 9, -9, 4], dtype=torch.float64)
    merged = _merge(
        "breadcrumbs", torch.zeros(10), [tau], {"density": 0.5, "gamma": 0.1, "scale": 1}
    )
    assert torch.equal(
        merged, torch.tensor([0.0, 0, 0, 0, 3, -3, 5, 9, -9, 4], dtype=torch.float64)
    )
    # density 0.05 of 10 entries keeps none
    none = _merge("breadcrumbs", torch.zeros(10), [tau], {"density": 0.05, "gamma": 0.0})
    assert torch.equal(none, torch.zeros(10, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(12, 8), (8, 12), (30, 20), (17,), (2, 3, 4), ()])
@pytest.mark.parametrize("count", [1, 3])
def test_tsv_m_matches_reference(shape, count):
    base, experts = _experts(shape, count=count)
    merged = _merge("tsv_m", base, experts, {"scale": 0.8})
    torch.testing.assert_close(merged, ref.tsv_m(base, experts, 0.8), rtol=1e-10, atol=1e-10)


def test_tsv_m_of_one_expert_is_its_task_vector_and_of_too_many_is_no_update():
    base, experts = _experts((10, 6), count=1)
    torch.testing.assert_close(_merge("tsv_m", base, experts), experts[0], rtol=0, atol=1e-12)
    base, experts = _experts((4, 3), count=4)  # r = 3 < T = 4: no triplet kept
    assert torch.equal(_merge("tsv_m", base, experts), base)


@pytest.mark.parametrize("shape", [(12, 8), (8, 12), (30, 20), (17,), (2, 3, 4)])
def test_iso_c_matches_reference(shape):
    base, experts = _experts(shape)
    merged = _merge("iso_c", base, experts, {"scale": 1.3})
    torch.testing.assert_close(merged, ref.iso_c(base, experts, 1.3), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.3, 1.0])
@pytest.mark.parametrize("shape", [(12, 8), (8, 12), (30, 20), (17,)])
def test_iso_cts_matches_reference(shape, fraction):
    base, experts = _experts(shape)
    merged = _merge("iso_cts", base, experts, {"scale": 0.9, "common_space_fraction": fraction})
    expected = ref.iso_cts(base, experts, 0.9, fraction)
    torch.testing.assert_close(merged, expected, rtol=1e-10, atol=1e-10)


def test_iso_subspace_sizes_and_iso_cts_without_task_space_is_iso_c():
    assert subspace_sizes(32, 3, 0.8) == (26, 2)  # c0 = 25, round(7 / 3) = 2
    assert subspace_sizes(768, 8, 0.8) == (616, 19)
    assert subspace_sizes(10, 8, 0.1) == (2, 1)  # round(9 / 8) = 1
    assert subspace_sizes(4, 3, 0.1) == (1, 1)  # round(4 / 3) = 1; c = 1
    assert subspace_sizes(8, 3, 0.1) == (2, 2)  # round(8 / 3) = 3 would need 9 > 8: lowered
    base, experts = _experts((12, 8))
    torch.testing.assert_close(
        _merge("iso_cts", base, experts, {"common_space_fraction": 1.0}),
        _merge("iso_c", base, experts),
        rtol=1e-10,
        atol=1e-10,
    )


# ----- TIES' global trim: exact streaming selection -----------------------------------------------
@pytest.mark.parametrize("collect_limit", [0, 50, 1 << 20])
def test_streaming_selection_equals_kthvalue(collect_limit):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(30011, generator=gen, dtype=torch.float64)
    values *= torch.logspace(-300, 5, values.numel(), dtype=torch.float64)  # subnormals to large
    values[::7] = 0.0
    values[1::9] = -0.0
    values[2::11] = -1.25  # many ties
    values[3::13] = 5e-324  # the smallest subnormal
    magnitudes = values.abs()
    chunks = lambda: iter(values.split(997))  # noqa: E731
    for rank in (1, 2, 4288, 4289, 15000, 29999, 30011):
        got = kth_smallest_abs(chunks, values.numel(), rank, collect_limit=collect_limit)
        assert got == torch.kthvalue(magnitudes, rank).values.item(), rank
    with pytest.raises(ValueError):
        kth_smallest_abs(chunks, values.numel() + 1, 3, collect_limit=collect_limit)


def test_ties_global_threshold_is_kthvalue_over_the_concatenated_task_vector():
    ties = merging.get("ties")
    hp = ties.check({"top_k": 30, "trim": "global"})
    pieces = [_experts(shape, count=2, seed=i) for i, shape in enumerate([(20, 7), (33,), ()])]
    streams = [[(e - b).reshape(-1) for e in experts] for b, experts in pieces]
    total = sum(s[0].numel() for s in streams)

    def task_vectors(t):
        return iter([s[t] for s in streams])

    thresholds = ties.prepare_checkpoint(task_vectors, 2, total, hp)
    keep = kept_count(total, 30)
    for t in range(2):
        flat = torch.cat([s[t] for s in streams]).abs()
        assert thresholds[t] == torch.kthvalue(flat, total - keep + 1).values.item()


# ----- (b) through run.py: chunked = whole, and the expected values -----------------------------
SHAPES = {"w": (64, 32), "k": (6, 5, 4), "v": (40,), "s": ()}
CASES = [
    ("dare_task_arithmetic", {"drop_rate": 0.6, "seed": 5}),
    ("dare_ties", {}),
    ("breadcrumbs", {"density": 0.3, "gamma": 0.05, "scale": 0.5}),
    ("ties", {"trim": "global", "top_k": 25}),
    ("ties", {"trim": "tensor"}),
    ("tsv_m", {}),
    ("iso_c", {"scale": 0.5}),
    ("iso_cts", {}),
]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny safetensors base and three experts (float32 tensors of SHAPES, plus an int64 one)."""
    root = tmp_path_factory.mktemp("zoo")
    gen = torch.Generator().manual_seed(7)
    base = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    ids = torch.arange(6).reshape(2, 3)

    def save(name, tensors):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
        save_file(
            {**tensors, "ids": ids},
            str(root / name / "model.safetensors"),
            metadata={"format": "pt"},
        )
        return root / name

    experts = {
        f"t{i}": save(
            f"t{i}", {n: v + 0.05 * torch.randn(v.shape, generator=gen) for n, v in base.items()}
        )
        for i in range(3)
    }
    return save("base", base), experts


def _load(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(("method", "hp"), CASES)
def test_chunked_merge_equals_whole_and_the_in_memory_merge(zoo, tmp_path, monkeypatch, method, hp):
    import featcal_core.merging.run as run

    base, experts = zoo
    whole = run.merge_checkpoints(base, experts, tmp_path / "whole", method, hp, progress=False)
    monkeypatch.setattr(run, "CHUNK_ENTRIES", 100)  # w: chunks of 3 rows; k: of 5 rows
    chunked_names: set[str] = set()
    rows = Reader.rows

    def spy(self, name, start, stop):
        chunked_names.add(name)
        return rows(self, name, start, stop)

    monkeypatch.setattr(Reader, "rows", spy)
    run.merge_checkpoints(base, experts, tmp_path / "chunked", method, hp, progress=False)
    assert chunked_names == ({"w", "k"} if merging.get(method).chunkable else set())
    assert (tmp_path / "chunked" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()
    assert whole["tensors"] == {"merged": 4, "copied": 1}

    merged, theta0 = _load(tmp_path / "chunked"), _load(base)
    thetas = [_load(p) for p in experts.values()]
    if hp.get("trim") == "global":
        expected = ref.ties_global(theta0, thetas, list(SHAPES), hp["top_k"], 1.0)
    else:
        expected = {
            n: _merge(method, theta0[n], [t[n] for t in thetas], hp, Place(n)) for n in SHAPES
        }
    for name in SHAPES:
        torch.testing.assert_close(merged[name], expected[name].float(), rtol=0, atol=0)
    assert torch.equal(merged["ids"], theta0["ids"])


def test_ties_global_trim_differs_from_tensor_trim(zoo, tmp_path):
    import featcal_core.merging.run as run

    base, experts = zoo
    run.merge_checkpoints(base, experts, tmp_path / "g", "ties", {"trim": "global"}, progress=False)
    run.merge_checkpoints(base, experts, tmp_path / "t", "ties", {}, progress=False)
    global_, tensor = _load(tmp_path / "g"), _load(tmp_path / "t")
    assert any(not torch.equal(global_[n], tensor[n]) for n in SHAPES)
    record = json.loads((tmp_path / "t" / "merge.json").read_text())
    assert record["hyperparameters"] == {"top_k": 20.0, "scale": 1.0}  # no "trim": as before


def test_dare_through_run_is_reproducible_and_seeded(zoo, tmp_path):
    import featcal_core.merging.run as run

    base, experts = zoo
    for out, seed in (("a", 1), ("b", 1), ("c", 2)):
        run.merge_checkpoints(
            base, experts, tmp_path / out, "dare_ties", {"seed": seed}, progress=False
        )
    a, b, c = (_load(tmp_path / out) for out in "abc")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["w"], c["w"])


# ----- (c) bad hyperparameters -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "hp", "needles"),
    [
        ("dare_ties", {"drop_rate": 1.0}, ("'drop_rate'", "--drop-rate", ">= 0", "< 1", "1.0")),
        ("dare_task_arithmetic", {"drop_rate": -0.1}, ("'drop_rate'", ">= 0")),
        ("dare_ties", {"drop_rate": "0.5"}, ("'drop_rate'", "number")),
        ("dare_ties", {"seed": 1.5}, ("'seed'", "--seed", "whole number", "1.5")),
        ("dare_task_arithmetic", {"seed": True}, ("'seed'", "whole number")),
        ("dare_ties", {"scale": float("inf")}, ("'scale'", "finite")),
        ("dare_ties", {"top_k": 20}, ("'top_k'", "dare_ties", "drop_rate, scale, seed")),
        ("breadcrumbs", {"density": 0}, ("'density'", "--density", "> 0", "<= 1")),
        ("breadcrumbs", {"density": 1.5}, ("'density'", "1.5")),
        ("breadcrumbs", {"gamma": 1.0}, ("'gamma'", "--gamma", ">= 0", "< 1")),
        ("breadcrumbs", {"gamma": -0.01}, ("'gamma'", "-0.01")),
        ("ties", {"trim": "layer"}, ("'trim'", "--trim", "'tensor', 'global'", "'layer'")),
        ("ties", {"trim": 1}, ("'trim'", "'tensor'")),
        ("ties", {"drop_rate": 0.5}, ("'drop_rate'", "scale, top_k, trim")),
        ("tsv_m", {"scale": "big"}, ("'scale'", "tsv_m", "number")),
        ("tsv_m", {"top_k": 1}, ("'top_k'", "tsv_m", "scale")),
        ("iso_c", {"scale": float("nan")}, ("'scale'", "iso_c", "finite")),
        (
            "iso_cts",
            {"common_space_fraction": 0},
            ("'common_space_fraction'", "--common-space-fraction", "> 0", "<= 1"),
        ),
        ("iso_cts", {"common_space_fraction": 1.2}, ("'common_space_fraction'", "1.2")),
    ],
)
def test_bad_hyperparameters_name_the_key(method, hp, needles):
    with pytest.raises(FeatCalError) as info:
        merging.get(method).check(hp)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_defaults_and_normalised_values():
    assert merging.get("dare_ties").check(None) == {"drop_rate": 0.9, "scale": 1.0, "seed": 0}
    assert merging.get("dare_task_arithmetic").check({"seed": 3.0})["seed"] == 3  # params.yaml
    assert merging.get("breadcrumbs").check(None) == {"density": 0.15, "gamma": 0.006, "scale": 0.2}
    assert merging.get("ties").check(None) == {"top_k": 20.0, "scale": 1.0}
    assert merging.get("ties").check({"trim": "global"})["trim"] == "global"
    assert merging.get("tsv_m").check(None) == {"scale": 1.0}
    assert merging.get("iso_c").check(None) == {"scale": 1.0}
    assert merging.get("iso_cts").check(None) == {"scale": 1.0, "common_space_fraction": 0.8}


# ----- (d) DARE's mask ---------------------------------------------------------------------------
@pytest.mark.parametrize("drop_rate", [0.1, 0.5, 0.9])
def test_dare_mask_drops_about_p_and_is_a_function_of_seed_name_expert_and_index(drop_rate):
    n = 200_000
    mask = keep_mask(4, "w", 1, 0, n, drop_rate)
    dropped = 1.0 - mask.double().mean().item()
    assert abs(dropped - drop_rate) < 5 * math.sqrt(drop_rate * (1 - drop_rate) / n)
    assert torch.equal(mask, keep_mask(4, "w", 1, 0, n, drop_rate))  # same seed: same mask
    agree = p_agree = drop_rate**2 + (1 - drop_rate) ** 2  # independent masks agree this often
    for other in (
        keep_mask(5, "w", 1, 0, n, drop_rate),
        keep_mask(4, "v", 1, 0, n, drop_rate),
        keep_mask(4, "w", 2, 0, n, drop_rate),
    ):
        agree = (other == mask).double().mean().item()
        assert abs(agree - p_agree) < 0.01
    for start, stop in ((0, 17), (1000, 1013), (n - 5, n)):  # chunk-independent
        assert torch.equal(keep_mask(4, "w", 1, start, stop - start, drop_rate), mask[start:stop])


def test_dare_merge_chunk_equals_merge_tensor_rows():
    base, experts = _experts((30, 7))
    for method in ("dare_task_arithmetic", "dare_ties"):
        merger = merging.get(method)
        hp = merger.check({"drop_rate": 0.7, "seed": 9})
        whole = merger.merge_tensor(base, experts, hp, place=Place("x"))
        parts = [
            merger.merge_chunk(
                base[a:b], [e[a:b] for e in experts], hp, None, place=Place("x", a * 7)
            )
            for a, b in ((0, 4), (4, 19), (19, 30))
        ]
        assert torch.equal(torch.cat(parts), whole)


# ----- the command line --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        (
            ["--method", "dare_ties", "--hp", "drop_rate=0.5", "--hp", "seed=7"],
            {"drop_rate": 0.5, "scale": 1.0, "seed": 7},
        ),
        (
            ["--method", "ties", "--hp", "trim=global", "--top-k", "30"],
            {"top_k": 30.0, "scale": 1.0, "trim": "global"},
        ),
        (
            ["--method", "iso_cts", "--scale", "0.7", "--hp", "common_space_fraction=0.5"],
            {"scale": 0.7, "common_space_fraction": 0.5},
        ),
    ],
)
def test_cli_takes_the_new_methods_hyperparameters(zoo, tmp_path, argv, recorded):
    base, experts = zoo
    out = tmp_path / "out"
    args = ["merge", "--base", str(base), "--out", str(out), "--no-progress", *argv]
    for task, path in experts.items():
        args += ["--expert", f"{task}={path}"]
    assert merge_command.run(build_parser().parse_args(args)) == 0
    record = json.loads((out / "merge.json").read_text())
    assert record["method"] == argv[1] and record["hyperparameters"] == recorded
