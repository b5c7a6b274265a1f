"""Real, offline task datasets (read from installed packages) as train/validation/test splits."""
