"""Ownership of a run (arch §6): one writer per run directory, and no orphans."""
