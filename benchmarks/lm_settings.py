"""Fixed settings of `lm_token_weighting.py`: paths, the four text tasks and their prompt, the
FeatCal grid, and the tiny LM zoo's geometry, text limits and training schedule."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DATA = ROOT / "data" / "zoo" / "text" / "data"
TASKS = ("rotten_tomatoes", "subjectivity", "polarity", "hedge")
TEMPLATE = "{text} ->"
WEIGHTINGS = ("all", "answer")
ALPHAS = (0.25, 0.5, 1.0)
LAMS = (0.05, 0.5)
RHO = 2.2
PAPER = (0.25, 0.05)  # (α, λ) of the authors' demo, ρ = 2.2
MAX_TEXT_TOKENS = 56  # texts are cut to this many tokens (bos + text + "->" + answer ≤ 64)
MAX_LENGTH = 64  # token limit of training sequences and of calibration rows
BATCH = 32
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
GEOMETRY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
PRETRAIN_LR = 2e-3
FINETUNE_LR = 1e-3
ZOO_VERSION = 1
