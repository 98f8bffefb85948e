"""Checkpoints under faults, with real trainer processes."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import RunOutcome, ckpt, make_config, run_ft_launcher, run_single
from trainer import checkpointing
from trainer.checkpointing.config import ResumePolicy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single_baseline(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    cfg = make_config(tmp_path_factory.mktemp("single") / "baseline", dataset, steps=20)
    out = run_single(cfg)
    assert out.returncode == 0, out.log[-3000:]
    return out


def test_sigkill_while_writing_leaves_nothing_trusted(
    single_baseline, dataset: Path, tmp_path: Path
):
    # The save of step 10 blocks first on committing step 5, so step 5 is committed for sure.
    cfg = make_config(
        tmp_path / "run", dataset, steps=20, faults=("sigkill@step=10,phase=checkpoint",)
    )
    killed = run_single(cfg)
    assert killed.returncode == -9
    # The save of step 10 was in flight: its directory is partial, nothing points at it.
    assert checkpointing.partial_path(cfg.run_root, 10).exists()
    assert not checkpointing.committed_path(cfg.run_root, 10).exists()
    assert checkpointing.read_latest(cfg.run_root) == 5
    assert checkpointing.choose_resume(cfg.run_root, fingerprint=cfg.fingerprint()).step == 5

    resumed = run_single(cfg)  # the fault fired once: this life runs to the end
    assert resumed.returncode == 0, resumed.log[-3000:]
    loaded = [e for e in resumed.of_kind("resume") if e["action"] == "loaded"]
    assert [e["step"] for e in loaded] == [5]
    assert any(e["action"] == "removed-partial" for e in resumed.of_kind("resume"))
    assert resumed.result["params_sha256"] == single_baseline.result["params_sha256"]


def test_injected_corruption_is_caught_by_the_next_resume(single_baseline, dataset, tmp_path):
    # Deterministic order: step 10 commits (and is corrupted) when the save of step 15 starts,
    # then the rank dies with step 15 in flight; the restart must skip 10 and load 5. (A
    # corrupt newest checkpoint found by a later run rather than a restart takes the same
    # resume path; its reason is tested in tests/test_manifest.py. No valid checkpoint at all is
    # tests/test_pipeline.py's unrecoverable attempt, with real workers: the CI budget.)
    cfg = make_config(
        tmp_path / "run",
        dataset,
        steps=20,
        faults=("corrupt-checkpoint@step=10", "sigkill@step=15,phase=checkpoint"),
        # The durable tier alone: node memory would resume from step 14 and read no checkpoint.
        checkpoint=ckpt(5, memory=0),
    )
    out = run_ft_launcher(cfg, nproc=1)
    assert out.returncode == 0, out.log[-3000:]
    corrupted = [f for f in out.of_kind("fault") if f["fault_kind"] == "corrupt-checkpoint"]
    assert len(corrupted) == 1 and corrupted[0]["step"] == 10
    assert any(e["action"] == "skipped" and e["step"] == 10 for e in out.of_kind("resume"))
    assert [r["layer"] for r in out.of_kind("restart")] == ["injob"]
    assert [e["step"] for e in out.of_kind("resume") if e["action"] == "loaded"] == [5]
    assert out.result["params_sha256"] == single_baseline.result["params_sha256"]


def test_two_rank_checkpoint_loads_on_one_rank(dataset: Path, tmp_path: Path):
    cfg = make_config(tmp_path / "run", dataset, steps=10)
    two = run_ft_launcher(cfg, nproc=2)
    assert two.returncode == 0, two.log[-3000:]
    assert two.result["world_size"] == 2
    # Same run, one rank: resumes from the 2-rank checkpoint at step 10 (resharded), trains no
    # step, and digests the loaded parameters.
    one = run_single(cfg)
    assert one.returncode == 0, one.log[-3000:]
    loaded = [e for e in one.of_kind("resume") if e["action"] == "loaded"][-1]
    assert loaded["saved_world_size"] == 2 and loaded["world_size"] == 1 and loaded["step"] == 10
    assert one.result["world_size"] == 1
    assert one.result["params_sha256"] == two.result["params_sha256"]


def test_recorded_commits_with_checkpoints_gone_fail_loudly(dataset: Path, tmp_path: Path):
    cfg = make_config(tmp_path / "run", dataset, steps=4, checkpoint=ckpt(2))
    assert run_single(cfg).returncode == 0
    shutil.rmtree(checkpointing.checkpoints_dir(cfg.run_root))  # lost, or the wrong volume mounted
    out = run_single(replace(cfg, steps=6))
    assert out.returncode == 3, out.log[-3000:]
    assert f"run {cfg.run_root}: its events.jsonl records committed checkpoints up to step 4" in (
        out.log
    )
    assert "restore" in out.log and "resume=fresh" in out.log
    assert [e["step"] for e in out.of_kind("step")] == [1, 2, 3, 4], "must not train from scratch"
    # Starting over is still possible, explicitly.
    fresh = run_single(replace(cfg, steps=6, checkpoint=ckpt(2, resume=ResumePolicy.FRESH)))
    assert fresh.returncode == 0, fresh.log[-3000:]
    assert fresh.result is not None and fresh.result["final_step"] == 6
