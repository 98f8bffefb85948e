"""The worker's command line (trainer.worker_cli): its surface is frozen; a setting is a field."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, TrainConfig, save_config
from trainer.worker_cli import OPTIONS, build_parser, claimed_run_root, config_from_args


def _cfg(argv: list[str]) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_the_surface_is_config_set_and_inject():
    """A new setting is a TrainConfig field reached by --set, never a new flag: change this
    list only with the docs (docs/trainer.md) and every caller of the worker."""
    flags = sorted(s for a in build_parser()._actions for s in a.option_strings)
    assert flags == sorted(["-h", "--help", *OPTIONS])
    assert OPTIONS == ("--config", "--set", "--inject")


def test_set_reaches_every_level_and_keeps_the_kinds(tmp_path: Path):
    base = ["--set", f"run_root={tmp_path / 'run'}", "--set", f"data_dir={tmp_path}"]
    cfg = _cfg(
        [
            *base,
            "--set=steps=7",
            "--set=lr=1",
            "--set=checkpoint.durable.interval=3",
            "--set=inprocess.enabled=false",
            "--set=workload_options.seq_len=32",
            "--set=metrics_port=9465",
            "--inject=sigkill@step=4,rank=0",
        ]
    )
    assert (cfg.steps, cfg.lr, cfg.checkpoint.durable.interval) == (7, 1.0, 3)
    assert not cfg.inprocess.enabled and cfg.workload_options == {"seq_len": 32}
    assert cfg.metrics_port == 9465 and [str(f) for f in cfg.faults] == ["sigkill@step=4,rank=0"]
    assert cfg.run_root == tmp_path / "run"


def test_set_overrides_the_config_file(tmp_path: Path):
    path = save_config(TrainConfig(run_root=tmp_path / "r", data_dir=tmp_path), tmp_path / "c.json")
    cfg = _cfg([f"--config={path}", "--set=steps=9", "--set=run_root=/elsewhere"])
    assert cfg.steps == 9 and cfg.run_root == Path("/elsewhere")
    args = build_parser().parse_args([f"--config={path}"])
    assert claimed_run_root(args) == tmp_path / "r"
    args = build_parser().parse_args([f"--config={path}", "--set=run_root=/x"])
    assert claimed_run_root(args) == Path("/x")


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["steps=many"], "steps"),  # a number's field takes only a number
        (["verify_data=1"], "verify_data"),  # a switch takes only true/false
        (["stepz=3"], "stepz"),  # unknown: named, with the known ones
        (["checkpoint.durable.intervl=3"], "checkpoint.durable.intervl"),
        (["steps.x=3"], "steps"),  # not a section
        (["steps"], "--set"),  # no '='
    ],
)
def test_a_bad_set_names_the_field(sets: list[str], field: str, tmp_path: Path):
    argv = ["--set", f"run_root={tmp_path}", "--set", f"data_dir={tmp_path}"]
    with pytest.raises(ConfigError) as e:
        _cfg([*argv, *(f"--set={s}" for s in sets)])
    assert e.value.field == field


def test_without_a_config_file_run_root_and_data_dir_are_required(tmp_path: Path):
    with pytest.raises(ConfigError, match="--set run_root=DIR"):
        _cfg([f"--set=data_dir={tmp_path}"])
