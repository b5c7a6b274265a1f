"""Provenance: resolving and locking models (models.lock.json) and tracing any
result back through its records (lineage, model cards)."""
