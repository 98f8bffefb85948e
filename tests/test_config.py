"""Bad configuration fails before any process group starts, naming the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import REPO, ckpt, make_config, worker_env
from trainer.config import ConfigError, InJobConfig, InProcessConfig, TrainConfig
from trainer.model_config import model_config, tiny


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"steps": -1}, "steps"),
        ({"steps": 0}, "steps"),
        ({"global_batch": 0}, "global_batch"),
        ({"lr": 0.0}, "lr"),
    ],
)
def test_bad_values_name_the_field(overrides, field, dataset: Path, tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        make_config(tmp_path / "run", dataset, **overrides)
    assert err.value.field == field
    assert field in str(err.value)


def test_unknown_model_size():
    with pytest.raises(ConfigError, match=r"model: unknown model size 'huge'"):
        model_config("huge")


def test_missing_data_dir(tmp_path: Path):
    with pytest.raises(ConfigError, match="data_dir: dataset directory .* does not exist"):
        make_config(tmp_path / "run", tmp_path / "nope")


def test_gloo_timeout_must_be_below_soft_timeout():
    with pytest.raises(ConfigError, match=r"inprocess.pg_timeout_s: must be below"):
        InProcessConfig(pg_timeout_s=10, soft_timeout_s=8)


# Small section timeouts so that each InJobConfig is valid on its own; each case breaks one
# cross-layer rule (arch §2: an inner layer gets its chance before the outer one acts).
_SECTIONS = dict(
    checkpoint_timeout_s=10, load_timeout_s=10, out_of_section_timeout_s=30, step_timeout_s=4.5
)
NESTING = [
    # ft_launcher's heartbeat must not give up while an in-process restart may still succeed.
    (
        InProcessConfig(hard_timeout_s=16),
        InJobConfig(heartbeat_timeout_s=10, **_SECTIONS),
        r"injob.heartbeat_timeout_s: must exceed inprocess.hard_timeout_s",
    ),
    # An in-process restart runs out of section.
    (
        InProcessConfig(hard_timeout_s=16),
        InJobConfig(heartbeat_timeout_s=30, **{**_SECTIONS, "out_of_section_timeout_s": 12}),
        r"injob.out_of_section_timeout_s: must exceed inprocess.hard_timeout_s",
    ),
    # A stalled step: the peers' collective timeout (then an in-process restart) comes first.
    (
        InProcessConfig(pg_timeout_s=3),
        InJobConfig(heartbeat_timeout_s=30, **{**_SECTIONS, "step_timeout_s": 3.5}),
        r"injob.step_timeout_s: must exceed inprocess.pg_timeout_s \+ injob.heartbeat_interval_s",
    ),
]


@pytest.mark.parametrize("inprocess,injob,message", NESTING)
def test_layer_timeouts_nest(inprocess, injob, message, dataset: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path / "run", dataset, inprocess=inprocess, injob=injob)
    # ... unless the in-process layer is switched off.
    off = dataclasses.replace(inprocess, enabled=False)
    make_config(tmp_path / "run", dataset, inprocess=off, injob=injob)


def test_injob_sections_fit_under_the_heartbeat_backstop():
    with pytest.raises(ConfigError, match=r"injob.heartbeat_timeout_s: must be >= every section"):
        InJobConfig(heartbeat_timeout_s=20, load_timeout_s=25)
    with pytest.raises(ConfigError, match=r"injob.heartbeat_timeout_s: must be >= every section"):
        InJobConfig(heartbeat_timeout_s=500)  # the sections auto: the 600 s allowance
    with pytest.raises(ConfigError, match=r"injob.step_timeout_s: must exceed injob.heartbeat_i"):
        InJobConfig(step_timeout_s=1.0, heartbeat_interval_s=1.0, step_timeout_floor_s=1.0)


def test_bad_fault_spec_rejected(dataset: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="invalid fault spec 'explode@step=3'"):
        make_config(tmp_path / "run", dataset, faults=("explode@step=3",))


def test_model_param_counts():
    assert tiny().num_params() < 1_000_000
    assert 100e6 < model_config("100m").num_params() < 130e6
    assert 7e9 < model_config("8b").num_params() < 9e9


def test_fingerprint_ignores_paths_and_timeouts(dataset: Path, tmp_path: Path):
    a = make_config(tmp_path / "a", dataset)
    b = replace(a, run_root=tmp_path / "b", checkpoint=ckpt(timeout_s=99.0))
    c = replace(a, lr=a.lr * 2)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


@pytest.mark.parametrize(
    ("args", "field", "process"),
    [
        # The worker's real entry point once (its own interpreter: torch's ~3 s import each);
        # the other fields through the same main() in this process.
        (["--set", "steps=-3"], "steps", True),
        (["--set", "checkpoint.durable.interval=0"], "checkpoint.durable.interval", False),
        (["--set", "workload=gpt-huge"], "workload", False),
        (["--set", "workload_options.size=huge"], "workload_options.size", False),
        (["--set", "data_dir=/nonexistent/data"], "data_dir", False),
        (["--set", "steps=many"], "steps", False),
        (["--set", "stepz=3"], "stepz", False),
    ],
)
def test_cli_rejects_bad_config_before_starting(
    args, field, process: bool, dataset: Path, tmp_path: Path, capsys, monkeypatch
):
    flags = ["--set", f"run_root={tmp_path / 'run'}", "--set", f"data_dir={dataset}", *args]
    if process:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.train", *flags],
            capture_output=True,
            text=True,
            env=worker_env(),
            cwd=REPO,
            timeout=120,
        )
        code, stderr = proc.returncode, proc.stderr
    else:
        from trainer.train import main

        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # run by hand, as above
        code, stderr = main(flags), capsys.readouterr().err
    assert code == 2, stderr
    assert f"invalid configuration: {field}" in stderr
    assert not (tmp_path / "run").exists(), "nothing may start on a bad config"


def test_param_count_formula_matches_the_model():
    from trainer.model import GPT

    cfg = tiny()
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"ckpt_interval": 5}, "ckpt_interval", "moved to checkpoint.durable.interval"),
        ({"memory_interval": 0}, "memory_interval", "moved to checkpoint.memory.interval"),
        ({"checkpoint": {"durable": {"interval": 0}}}, "checkpoint.durable.interval", "N >= 1"),
        ({"checkpoint": {"memory": {"every": 2}}}, "checkpoint.memory.every", "unknown field"),
        ({"checkpoint": {"resume": "later"}}, "checkpoint.resume", "later"),
    ],
)
def test_the_checkpoint_config_names_each_field(data, field, words, tmp_path: Path):
    """One nested checkpoint config (issue 40, item 1): a config file of the flat fields it
    replaced is refused naming where each went; a bad value names its field."""
    base = {"run_root": str(tmp_path / "run"), "data_dir": str(tmp_path), "local_paths": False}
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({**base, **data})
    assert err.value.field == field and words in str(err.value)
    cfg = TrainConfig.from_dict({**base, "checkpoint": ckpt(3, memory=0).to_dict()})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and not cfg.checkpoint.memory.enabled
