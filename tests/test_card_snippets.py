"""The usage snippet of a model card runs as it stands on the class the folder holds: a tiny merge
of each family (CLIP vision tower, full CLIPModel, BERT, T5 encoder, T5 with its decoder, Llama),
its own card (README.md, written by the merge) and the card of a calibrated model written into
the same kind of folder (with refit heads in the folder where a family has them); the python
block is taken from the card, its `folder` pointed at the model, and executed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

import factories
from factories import TINY_LLAMA
from featcal_core.architectures import detect
from featcal_core.data.synthetic import build_pool
from featcal_core.evaluation.linear_head import LinearHead
from featcal_core.evaluation.task_heads import save_task_heads
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.merging.run import merge_checkpoints
from featcal_core.provenance.model_card import family_facts, write_model_card

TINY_T5 = dict(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8)
PLACEHOLDER = 'Path("path/to/this/folder")'


def _clip(root: Path):
    """A full CLIPModel base and CLIPVisionModel experts (as the paper's setting publishes)."""
    base = factories.tiny_clip_model(root / "base")
    return base, factories.vision_experts(base, root, ("alpha",))


def _pool(family: str, config: dict):
    def build(root: Path):
        pool = build_pool(root, family, config, ("alpha",), rows=2)
        return pool.base, pool.experts

    return build


#: family → (builder of (base, experts), the class the merged folder holds, its snippet's output
#: name, the width of one refit head's features or None: no heads for that family)
FAMILIES = {
    "clip-vision": (_pool("clip", factories.TINY_CLIP), "CLIPVisionModel", "features", 32),
    "clip": (_clip, "CLIPModel", "features", None),
    "bert": (_pool("bert", factories.TINY_BERT), "AutoModel", "features", 32),
    "t5-encoder": (_pool("t5", dict(TINY_T5, encoder_only=True)), "T5EncoderModel", "features", 16),
    "t5": (_pool("t5", TINY_T5), "AutoModelForSeq2SeqLM", "output", None),
    "llama": (_pool("llama", TINY_LLAMA), "AutoModelForCausalLM", "output", None),
}


def _snippet(card: Path, folder: Path) -> str:
    """The card's python block with `folder` set to `folder`."""
    blocks = re.findall(r"```python\n(.*?)```", card.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1, card.read_text()
    assert PLACEHOLDER in blocks[0]
    return blocks[0].replace(PLACEHOLDER, f"Path({str(folder)!r})")


def _run(card: Path, folder: Path) -> dict:
    """Execute the card's snippet against `folder`; returns its names."""
    names: dict = {"__name__": "card_snippet"}
    exec(compile(_snippet(card, folder), str(card), "exec"), names)
    return names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_snippet_of_a_merged_and_a_calibrated_card_runs(family, tmp_path):
    build, loader, result, head_width = FAMILIES[family]
    torch.manual_seed(0)
    base, experts = build(tmp_path / "pool")
    merged = tmp_path / "merged"
    merge_checkpoints(base, experts, merged, "task_arithmetic", progress=False)

    # the merge's own card: its snippet loads the class saved, on a synthetic example
    card = merged / "README.md"
    assert f"model = {loader}.from_pretrained(folder)" in card.read_text()
    names = _run(card, merged)
    if result == "features":
        assert names["features"].ndim == 2 and names["features"].shape[0] >= 1
        assert torch.isfinite(names["features"]).all()
    else:  # generated token ids, decoded
        assert names["output"].ndim == 2
    ModelCard.load(card)  # a valid Hugging Face card

    # a calibrated model's card in the same kind of folder (with refit heads where there are)
    calibrated = tmp_path / "calibrated"
    shutil.copytree(merged, calibrated)
    (calibrated / "README.md").unlink()
    if head_width is not None:
        head = LinearHead(torch.randn(3, head_width), torch.zeros(3), ["a", "b", "c"])
        save_task_heads(calibrated, {"alpha": head})
    checkpoint = Checkpoint(calibrated, "calibrated model")
    architecture = detect(checkpoint.config, str(calibrated / "config.json")).name
    write_model_card(
        calibrated,
        title="calibrated",
        recipe={"merge": {"method": "task_arithmetic"}, "featcal": {"alpha": 1.0}},
        inputs={},
        model=family_facts(architecture),
    )
    names = _run(calibrated / "README.md", calibrated)
    if head_width is not None:
        assert names["logits"].shape == (names["features"].shape[0], 3)
        assert set(names["predicted"]) <= {"a", "b", "c"}
