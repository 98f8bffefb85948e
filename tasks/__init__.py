"""The work each pipeline stage does, as plain functions (and thin Prefect tasks over them).

Imports ``trainer`` (checkpoint manifest format, fault specs, launch command) but never ``flows``.
"""
