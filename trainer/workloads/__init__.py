"""Built-in workloads (see :mod:`trainer.workload` for the API and the registry of names)."""
