"""MLflow tracking of featcal's runs (installed as `featcal.tracking`): the parent run and one
nested run per step (`runs.py`), the store, artifact root, experiment and git commit
(`store.py`), what each step logs (`log.py`) and MLflow's limits, logged in batches
(`batches.py`). Used by the flows; featcal_core knows nothing of it."""
