"""open_clip checkpoints: importing them into featcal checkpoints and zero-shot heads
from the base's text tower (the tower's adapter is open_clip/architecture.py)."""
