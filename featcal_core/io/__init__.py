"""Files: lazy per-tensor safetensors reading and streaming writing, checkpoints, the
calibrated model's export, and the guarantees on every output (the guarded writer, the
run lock, the fault-injection points)."""
