"""Lazy reading, the streaming safetensors writer, and the library's import boundary."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.safetensors_io import write_streaming


def test_streaming_writer_round_trips_every_dtype(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=gen).to(torch.float16),
        "f64": torch.randn(4, generator=gen, dtype=torch.float64),
        "i64": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(3.5),
    }
    src = tmp_path / "src.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt"})
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.json").write_text("{}")
    src.rename(ckpt_dir / "model.safetensors")
    ckpt = Checkpoint(ckpt_dir)
    entries = [(k, i.dtype, i.shape) for k, i in ckpt.tensors.items()]
    out = tmp_path / "out.safetensors"
    write_streaming(out, entries, lambda k: ckpt.read([k])[k], {"format": "pt"})
    back = load_file(str(out))
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype
        assert torch.equal(back[key], tensor)
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_featcal_core_imports_no_orchestration():
    code = (
        "import sys, featcal_core, featcal_core.method.calibration, featcal_core.architectures as a; "
        "a.supported(); "
        "bad = [m for m in ('prefect', 'mlflow', 'dvc') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
