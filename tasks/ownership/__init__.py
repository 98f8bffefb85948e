"""Ownership of a run (DESIGN §8): one writer per run directory, and no orphans."""
