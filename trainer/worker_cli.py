"""The worker's command line: ``--config FILE``, ``--set KEY=VALUE``, ``--inject SPEC``.

A setting is a field of :class:`~trainer.config.TrainConfig`, never a flag of its own: ``--set``
takes any field by its dotted name (``steps=30``, ``checkpoint.durable.interval=10``,
``inprocess.enabled=false``, ``workload_options.size=100m``), its value JSON or else a bare
string, and the config validates the whole, naming the field and the fix. ``--inject`` adds a
drill (the spelling ``nvrx-pipeline run`` has). ``tests/test_worker_cli.py`` holds this surface.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig, load_config
from trainer.errors import ConfigError

OPTIONS = ("--config", "--set", "--inject")


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="The training worker (trainer.train).")
    p.add_argument(
        "--config",
        type=Path,
        help="the attempt's training config (JSON, written by the launcher); without it, "
        "the defaults, and --set run_root=DIR --set data_dir=DIR",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set one config field (dotted for nested ones, e.g. checkpoint.durable.interval=10)",
    )
    p.add_argument(
        "--inject", action="append", default=[], metavar="SPEC", help="fault, e.g. sigkill@step=7"
    )
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config file if given, else the defaults; then every ``--set`` and ``--inject``."""
    if args.config is not None:
        data = load_config(args.config).to_dict()
    else:  # every default, so that --set knows each field's kind
        data = TrainConfig(run_root=Path(), data_dir=Path(), local_paths=False).to_dict()
        for name in ("run_root", "data_dir", "local_paths"):
            del data[name]
    for item in args.set:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError("--set", f"{item!r}: write KEY=VALUE, e.g. --set steps=30")
        set_dotted(data, key.strip(), raw.strip())
    if "run_root" not in data or "data_dir" not in data:
        raise ConfigError(
            "config", "pass --config FILE, or --set run_root=DIR and --set data_dir=DIR"
        )
    if args.inject:
        data["faults"] = [*data.get("faults", []), *args.inject]
    return TrainConfig.from_dict(data)


def set_dotted(data: dict[str, Any], key: str, raw: str) -> None:
    """``data[a][b]... = value``: JSON if it parses, else the text. A number or a switch the
    config already holds takes only its own kind (``steps=abc`` is refused here, by name)."""
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    *sections, name = key.split(".")
    for i, part in enumerate(sections):
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise ConfigError(".".join(sections[: i + 1]), f"is a value, not a section: {key}")
    old = data.get(name)
    if isinstance(old, bool) and not isinstance(value, bool):
        raise ConfigError(key, f"takes true or false, got {raw!r}")
    if isinstance(old, (int, float)) and not isinstance(old, bool) and isinstance(value, str):
        raise ConfigError(key, f"takes a number, got {raw!r}")
    data[name] = value


def claimed_run_root(args: argparse.Namespace) -> Path | None:
    """Where the command line says the run lives, even when its config is invalid (the
    no-restart marker goes there): the last ``--set run_root``, else the config file's."""
    said = [
        v for k, eq, v in (s.partition("=") for s in args.set) if eq and k.strip() == "run_root"
    ]
    if said and said[-1].strip():
        return Path(said[-1].strip())
    try:
        return Path(json.loads(args.config.read_text())["run_root"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
