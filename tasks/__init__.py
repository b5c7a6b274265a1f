"""Prefect tasks wrapping featcal_core (the pipeline issue adds them)."""
