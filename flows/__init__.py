"""Prefect flows only: the pipeline, its stages, parameter/result models, CLI, deployments."""
