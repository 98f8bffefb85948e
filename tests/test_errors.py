"""The trainer's errors under one base, with one terminal subclass (trainer.errors)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import trainer
from trainer.checkpointing import NoValidCheckpoint
from trainer.checkpointing.restoring import FatalError
from trainer.config import ConfigError
from trainer.data import DataError
from trainer.errors import ExitCode, TerminalError, TrainerError
from trainer.prepare import PrepareError


def _trainer_exceptions() -> list[type[BaseException]]:
    out = []
    for info in pkgutil.walk_packages(trainer.__path__, "trainer."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                out.append(cls)
    return out


def test_every_error_the_trainer_defines_is_a_trainer_error():
    found = _trainer_exceptions()
    assert len(found) >= 15
    assert [c.__qualname__ for c in found if not issubclass(c, TrainerError)] == []


def test_what_no_restart_fixes_is_terminal_with_its_exit_code():
    assert {c: c.exit_code for c in (ConfigError, FatalError, DataError, PrepareError)} == {
        ConfigError: 2,
        FatalError: 3,
        DataError: 3,
        PrepareError: 3,
    }
    # A checkpoint nobody can trust is a fatal error only once the resume gives up on all of
    # them (trainer.checkpointing.manager wraps it); on its own it is a fault a fallback may
    # still fix.
    assert not issubclass(NoValidCheckpoint, TerminalError)
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, RuntimeError)


def test_the_worker_exit_codes_are_one_enum():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0,
        "CONFIG": 2,
        "FATAL": 3,
        "FENCED": 4,
        "LEFT": 5,
        "REFORM": 6,
    }
    assert isinstance(TerminalError.exit_code, ExitCode) and isinstance(
        ConfigError.exit_code, ExitCode
    )
    # No second spelling of them anywhere in the trainer (an EXIT_... constant of its own).
    for info in pkgutil.walk_packages(trainer.__path__, "trainer."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        assert [n for n in vars(module) if n.startswith("EXIT_")] == [], info.name
