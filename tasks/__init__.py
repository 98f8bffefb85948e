"""The work each pipeline stage does, as plain functions and pure decisions: no Prefect task or
flow lives here (those are in ``flows``).

Imports ``trainer`` (checkpoint manifest format, fault specs, launch command) but never ``flows``.
"""
