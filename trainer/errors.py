"""The trainer's errors under one base (arch §5): :class:`TrainerError` for every error the
trainer raises on purpose, and one terminal subclass, :class:`TerminalError`, for what no restart
can fix. A worker that meets a terminal error escapes the in-process layer, reports it (the
``fatal`` event, ``result.json``, the ``no_restart`` marker), asks ft_launcher not to respawn it
and exits with the error's ``exit_code``; the pipeline reads that as do-not-requeue. Every other
error is a fault: the layers restart around it."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """The worker's exit codes, the one list (arch §2): anything else is a crash that the in-job
    layer may restart."""

    OK = 0  # done: result.json written
    CONFIG = 2  # bad configuration: nothing started, not restarted
    FATAL = 3  # bad data, no valid checkpoint, a full disk: not restarted
    FENCED = 4  # its attempt was replaced: it changed nothing (trainer.fence)
    LEFT = 5  # its node was evicted with notice: its step saved, it left (trainer.notice)
    # A node of its world left with notice (its step saved): restarted in-job at once, since no
    # in-process restart re-forms a world without that node (trainer.notice).
    REFORM = 6


class TrainerError(Exception):
    """An error the trainer raises on purpose (each names what failed and the fix)."""


class TerminalError(TrainerError):
    """No restart can fix it: bad configuration, bad data, no valid checkpoint, a full disk."""

    exit_code = ExitCode.FATAL


class ConfigError(TerminalError, ValueError):
    """A configuration value is invalid. The message names the field and the fix."""

    exit_code = ExitCode.CONFIG

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def require(ok: bool, field_name: str, message: str) -> None:
    """Raise :class:`ConfigError` naming ``field_name`` unless ``ok``."""
    if not ok:
        raise ConfigError(field_name, message)
