"""The workload API and the one serialized training config: references, options, the config
file every worker reads (a round trip that keeps every field), and what the manifest records."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import OUTSIDE_WORKLOAD, ckpt
from trainer.checkpointing.config import ResumePolicy
from trainer.config import (
    ConfigError,
    Device,
    InJobConfig,
    InProcessConfig,
    TrainConfig,
    load_config,
    save_config,
)
from trainer.step_check import StepCheckConfig
from trainer.straggler_config import StragglerConfig, StragglerPolicy
from trainer.worker_cli import build_parser, config_from_args
from trainer.workload import BUILTIN, load_workload


def _every_field_changed(dataset: Path, tmp_path: Path) -> TrainConfig:
    """A config where every field (nested ones too) differs from its default."""
    return TrainConfig(
        run_root=tmp_path / "run",
        data_dir=dataset,
        workload="llama-tiny",
        workload_options={"seq_len": 32, "activation_checkpointing": True},
        steps=7,
        global_batch=4,
        micro_batches=4,
        lr=1e-3,
        weight_decay=0.05,
        seed=99,
        device=Device.CPU,
        deterministic=True,
        checkpoint=ckpt(
            3, memory=2, keep_last=2, resume=ResumePolicy.FRESH, verify=False, timeout_s=77.0
        ),
        verify_data=False,
        data_manifest_sha256="0" * 64,
        faults=("exception@step=2,rank=0", "sigkill@step=5"),
        inprocess=InProcessConfig(
            enabled=False,
            pg_timeout_s=2.5,
            soft_timeout_s=7.0,
            hard_timeout_s=15.0,
            heartbeat_timeout_s=11.0,
            barrier_timeout_s=50.0,
            completion_timeout_s=55.0,
            max_restarts=4,
            monitor_interval_s=0.5,
            last_call_wait_s=0.5,
            termination_grace_s=2.0,
        ),
        injob=InJobConfig(
            enabled=False,
            max_restarts=2,
            initial_heartbeat_timeout_s=80.0,
            heartbeat_timeout_s=25.0,
            monitor_interval_s=0.7,
            workers_stop_timeout_s=4.0,
            rdzv_join_timeout_s=19.0,
            rdzv_last_call_s=3.0,
            rdzv_keep_alive_s=1.5,
            rdzv_keep_alive_misses=4,
            heartbeat_interval_s=2.0,
            step_timeout_s=9.0,
            checkpoint_timeout_s=20.0,
            load_timeout_s=21.0,
            out_of_section_timeout_s=22.0,
            check_interval_s=0.5,
            learn_after_sections=4,
            startup_allowance_s=500.0,
            timeout_multiple=6.0,
            section_floor_s=20.0,
            step_timeout_floor_s=2.5,
            node_silence_s=45.0,
            evict_grace_s=20.0,
        ),
        step_check=StepCheckConfig(
            enabled=False, window=64, sigma=8.0, min_samples=16, repeat_wait_s=30.0
        ),
        straggler=StragglerConfig(
            policy=StragglerPolicy.REPLACE,
            enter=1.2,
            leave=1.1,
            window=5,
            confirm_windows=2,
            confirm_s=10.0,
            warmup_steps=3,
            ckpt_share=0.5,
            max_evict_share=0.5,
            evict_period_s=600.0,
        ),
        local_paths=False,
        metrics_port=9999,
        metrics_addr="0.0.0.0",
        metrics_every_node=True,
    )


def _assert_all_differ(cfg: TrainConfig, default: TrainConfig) -> None:
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("run_root", "data_dir", "script_args"):  # script_args: the next test
            continue
        ours, theirs = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(ours):
            for sub in dataclasses.fields(ours):  # type: ignore[arg-type]
                assert getattr(ours, sub.name) != getattr(theirs, sub.name), f"{f.name}.{sub.name}"
        else:
            assert ours != theirs, f.name


def test_config_file_round_trip_keeps_every_field(dataset: Path, tmp_path: Path):
    cfg = _every_field_changed(dataset, tmp_path)
    _assert_all_differ(cfg, TrainConfig(run_root=tmp_path / "run", data_dir=dataset))
    path = save_config(cfg, tmp_path / "attempt.json")
    assert load_config(path) == cfg
    # ... and through the worker's own command line (what ft_launcher runs).
    assert config_from_args(build_parser().parse_args([f"--config={path}"])) == cfg
    assert load_config(path).fingerprint() == cfg.fingerprint()


def test_script_config_round_trip(dataset: Path, tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = TrainConfig(
        run_root=tmp_path / "run",
        data_dir=dataset,
        workload=f"script:{script}",
        script_args=("--data-dir", "{data_dir}", "--steps", "{steps}"),
        steps=6,
    )
    assert load_config(save_config(cfg, tmp_path / "s.json")) == cfg
    assert cfg.expanded_script_args() == ["--data-dir", str(dataset), "--steps", "6"]
    with pytest.raises(ConfigError, match=r"^script_args: only a script"):
        dataclasses.replace(cfg, workload="gpt-tiny")
    with pytest.raises(ConfigError, match=r"^workload: training script .* not found"):
        dataclasses.replace(cfg, workload=f"script:{tmp_path / 'nope.py'}")


def test_flags_override_single_fields_of_the_file(dataset: Path, tmp_path: Path):
    cfg = _every_field_changed(dataset, tmp_path)
    path = save_config(cfg, tmp_path / "attempt.json")
    got = config_from_args(build_parser().parse_args([f"--config={path}", "--set=steps=9"]))
    assert got == dataclasses.replace(cfg, steps=9)
    # a switch flag that is not given leaves the file's value, whichever it is
    off = save_config(dataclasses.replace(cfg, deterministic=False), tmp_path / "off.json")
    assert not config_from_args(build_parser().parse_args([f"--config={off}"])).deterministic
    argv = [f"--config={off}", "--set=deterministic=true"]
    on = config_from_args(build_parser().parse_args(argv))
    assert on == dataclasses.replace(cfg, deterministic=True)
    assert config_from_args(build_parser().parse_args([f"--config={path}"])).deterministic


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(stpes=3), "stpes"),
        (lambda d: d["inprocess"].update(soft=1), "inprocess.soft"),
        (lambda d: d.update(device="tpu"), "config"),
        (lambda d: d.update(workload="nope"), "workload"),
    ],
)
def test_bad_config_file_names_the_field(mutate, field, dataset: Path, tmp_path: Path):
    path = save_config(_every_field_changed(dataset, tmp_path), tmp_path / "a.json")
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("ref", "options", "field", "words"),
    [
        ("gpt-huge", {}, "workload", "not a built-in workload"),
        ("no_such_pkg.mod:spec", {}, "workload", "cannot import module 'no_such_pkg.mod'"),
        ("json:no_such_attr", {}, "workload", "has no attribute 'no_such_attr'"),
        ("json:dumps", {}, "workload", "not a trainer.workload.WorkloadSpec"),
        ("script:train.py", {}, "workload", "training script"),
        ("gpt-tiny", {"size": "huge"}, "workload_options.size", "tiny"),
        ("gpt-tiny", {"dropout": 2.0}, "workload_options.dropout", "less than 1"),
        ("llama-tiny", {"hidden": 3}, "workload_options.hidden", "unknown option"),
        ("llama-tiny", {"mixed_precision": "fp8"}, "workload_options.mixed_precision", "bf16"),
    ],
)
def test_bad_workloads_are_refused_naming_the_field(ref, options, field, words):
    with pytest.raises(ConfigError) as err:
        load_workload(ref, options)
    assert err.value.field == field and words in str(err.value)


def test_pipeline_params_refuse_bad_workloads_before_anything_starts():
    from pydantic import ValidationError

    from flows.models import PipelineParams

    with pytest.raises(ValidationError, match=r"workload_options\.size"):
        PipelineParams(workload="llama-tiny", workload_options={"size": "70b"})
    with pytest.raises(ValidationError, match=r"workload: cannot import module 'nope'"):
        PipelineParams(workload="nope:spec")


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_workloads_build_on_meta(name: str):
    """Every named shape builds (on the meta device: no memory) with its blocks found."""
    from trainer.workload import _outermost

    wl = load_workload(name)
    model = wl.build_model(torch.device("meta"))
    blocks = _outermost(model, wl.spec.block_classes(wl.options))
    assert blocks and wl.vocab_size >= 512 and wl.seq_len >= 64
    n = sum(p.numel() for p in model.parameters())
    expected = {"gpt-tiny": (1e5, 1e6), "llama-tiny": (1e5, 1e6), "gpt-100m": (1e8, 1.3e8)}
    expected |= {"llama-1b": (1.1e9, 1.4e9), "llama3-8b": (7.9e9, 8.1e9), "gpt-8b": (7e9, 9e9)}
    lo, hi = expected[name]
    assert lo < n < hi, (name, n)


def test_a_workload_from_outside_the_repository(tmp_path: Path, monkeypatch):
    (tmp_path / "my_workloads").mkdir()
    (tmp_path / "my_workloads" / "__init__.py").write_text("")
    (tmp_path / "my_workloads" / "mlp.py").write_text(OUTSIDE_WORKLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    wl = load_workload("my_workloads.mlp:spec", {"width": 16})
    model = wl.build_model("cpu")
    x = torch.randint(0, 64, (2, 8))
    loss = wl.loss(model, x, x)
    assert loss.shape == () and torch.isfinite(loss)
    with pytest.raises(ConfigError, match=r"workload_options.width"):
        load_workload("my_workloads.mlp:spec", {"width": 1})
    sys.modules.pop("my_workloads.mlp", None)


ACTIVATION_CHECKPOINTING_PROBE = """
import socket, torch, torch.distributed as dist
from trainer.workload import OptimSettings, load_workload
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.randint(0, 512, (2, 32))
out = []
for ac in (False, True):
    wl = load_workload("llama-tiny", {"activation_checkpointing": ac, "mixed_precision": "bf16"})
    torch.manual_seed(0)
    model = wl.shard(wl.build_model("cpu"), device=torch.device("cpu"), world_size=1)
    optim = wl.build_optimizer(model, OptimSettings(lr=1e-3, weight_decay=0.0))
    for _ in range(2):
        wl.loss(model, x, x).backward()
        optim.step()
        optim.zero_grad()
    out.append({n.replace("_checkpoint_wrapped_module.", ""): p.full_tensor().clone()
                for n, p in model.named_parameters()})
    wrapped = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())
    assert wrapped == (2 if ac else 0), wrapped
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 is CUDA-only
assert out[0].keys() == out[1].keys()
assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
print("ok")
"""


def test_activation_checkpointing_recomputes_the_same_training():
    """Activation checkpointing wraps each decoder layer and changes no result (CPU: bitwise)."""
    import subprocess

    from tests.helpers import REPO, worker_env

    proc = subprocess.run(
        [sys.executable, "-c", ACTIVATION_CHECKPOINTING_PROBE],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
