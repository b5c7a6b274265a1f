"""Prefect flows composing the tasks (the pipeline issue adds them)."""
