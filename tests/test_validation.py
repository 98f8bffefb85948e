"""Checkpoint validation on real checkpoints written by the trainer, and the pure checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.checks import Status
from tasks.validation.checkpoint import Expectations, Facts, gather, judge, validate_checkpoint
from tests.helpers import REPO, make_config, run_single, worker_env
from trainer import manifest
from trainer.faults import flip_bytes


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory) -> tuple[Path, dict]:
    cfg = make_config(tmp_path_factory.mktemp("val") / "run", dataset, steps=10)
    out = run_single(cfg)
    assert out.returncode == 0, out.log[-2000:]
    return cfg.run_root, {"hash": cfg.fingerprint(), "sha": out.result["params_sha256"]}


@pytest.fixture
def ckpt(trained, tmp_path: Path) -> Path:
    src = manifest.committed_path(trained[0], 10)
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def statuses(report) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report.checks}


@pytest.mark.slow
def test_valid_checkpoint_passes_every_check(trained, ckpt: Path, dataset: Path):
    exp = Expectations(config_hash=trained[1]["hash"], world_size=1, data_dir=dataset)
    report = validate_checkpoint(ckpt, exp)
    assert report.passed, report.checks
    assert set(statuses(report).values()) == {"PASSED"}
    assert report.hash_mb_s and report.hash_mb_s > 0
    # Loaded in a fresh process on one CPU rank: the same parameters the run ended with.
    assert report.params_sha256 == trained[1]["sha"]


@pytest.mark.slow
def test_flipped_bytes_fail_naming_the_file(ckpt: Path):
    victim = sorted(ckpt.glob("*.distcp"))[0]
    flip_bytes(victim)
    report = validate_checkpoint(ckpt, Expectations())
    s = statuses(report)
    assert not report.passed
    assert s["files and digests"] == "FAILED"
    assert victim.name in next(c["detail"] for c in report.checks if c["status"] == "FAILED")
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"


def test_cli_validate_json(ckpt: Path):
    argv = [sys.executable, "-m", "flows.cli", "validate", str(ckpt), "--json"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["status"] == "passed" and len(report["checks"]) == 5
    flip_bytes(ckpt / ".metadata")
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=300
    )
    assert proc.returncode == 1
    assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == "failed"


def test_run_mismatch_detected(ckpt: Path):
    facts = gather(ckpt, Expectations(), load=False)
    report = judge(facts, Expectations(config_hash="other", world_size=4))
    detail = report.checks[0]["detail"]
    assert report.checks[0]["status"] == "FAILED"
    assert "config hash" in detail and "world size 1 != the run's 4" in detail


def _facts(**kw) -> Facts:
    base = Facts(
        path=Path("/x/step_000000010"),
        manifest={"step": 10, "world_size": 2, "files": [], "loss": 4.0},
    )
    for k, v in kw.items():
        setattr(base, k, v)
    return base


def test_coverage_reports_missing_and_misshapen_entries():
    f = _facts(
        dcp_entries={"model.a": (2, 2), "model.b": (3,)},
        expected_entries={"model.a": (2, 2), "model.b": (4,), "optim.state.a.exp_avg": (2, 2)},
    )
    r = judge(f, Expectations())
    c = next(x for x in r.checks if x["name"].startswith("DCP"))
    assert c["status"] == "FAILED" and "1 missing" in c["detail"] and "wrong shapes" in c["detail"]


def test_nonfinite_and_loss_out_of_tolerance_fail():
    f = _facts(load={"loaded": True, "tensors": 3, "nonfinite": ["model.w"], "heldout_loss": 9.0})
    r = judge(f, Expectations(data_dir=Path("/data")))
    s = statuses(r)
    assert s["loads on 1 CPU rank, all tensors finite"] == Status.FAILED.value
    assert s["held-out loss near the recorded loss"] == Status.FAILED.value


def test_blind_checks_are_skipped_not_passed():
    f = _facts(errors={"dcp": "cannot read .metadata", "load": "not requested"})
    s = statuses(judge(f, Expectations()))
    assert s["DCP metadata covers the model and optimizer"] == "SKIPPED"
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"
    assert s["held-out loss near the recorded loss"] == "SKIPPED"


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/x.distcp", "x\n"])
def test_manifest_names_outside_the_checkpoint_fail(ckpt: Path, name: str):
    """Names are joined onto the checkpoint and hashed and loaded: a name that leaves the
    directory fails the manifest check, and nothing is hashed or loaded."""
    path = ckpt / "manifest.json"
    man = json.loads(path.read_text())
    man["files"][0]["name"] = name
    path.write_text(json.dumps(man))
    facts = gather(ckpt, Expectations())
    assert facts.files == {} and facts.load is None
    s = statuses(judge(facts, Expectations()))
    assert s["manifest"] == "FAILED" and s["files and digests"] == "SKIPPED"
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"
    detail = judge(facts, Expectations()).checks[0]["detail"]
    assert repr(name) in detail


def test_refused_metadata_fails_coverage_and_skips_the_load(ckpt: Path):
    """A .metadata the restricted reader refuses is a finding (FAILED), not a blind check."""
    import hashlib
    import pickle

    data = pickle.dumps({"not": "metadata"})
    (ckpt / ".metadata").write_bytes(data)
    path = ckpt / "manifest.json"
    man = json.loads(path.read_text())
    for e in man["files"]:
        if e["name"] == ".metadata":
            e["bytes"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    path.write_text(json.dumps(man))
    report = validate_checkpoint(ckpt, Expectations())
    s = statuses(report)
    assert s["files and digests"] == "PASSED"
    assert s["DCP metadata covers the model and optimizer"] == "FAILED"
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"


def test_a_manifest_does_not_choose_code_to_import(ckpt: Path):
    """A manifest naming a ``package.module:attr`` workload is not imported on its word: the
    checks that would rebuild it are SKIPPED naming the fix, and the caller naming the same
    workload is what lets it run."""
    canary = ckpt.parent / "imported"
    module = ckpt.parent / "planted_workload.py"
    module.write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    path = ckpt / "manifest.json"
    man = json.loads(path.read_text())
    man["workload"] = {"ref": "planted_workload:SPEC", "options": {}}
    path.write_text(json.dumps(man))
    sys.path.insert(0, str(ckpt.parent))
    try:
        facts = gather(ckpt, Expectations(), load=False)
    finally:
        sys.path.remove(str(ckpt.parent))
    assert not canary.exists()
    assert "code to import" in facts.errors["expected"]
    assert "--workload planted_workload:SPEC" in facts.errors["expected"]
    s = statuses(judge(facts, Expectations()))
    assert s["DCP metadata covers the model and optimizer"] == "SKIPPED"
    named = gather(ckpt, Expectations(workload={"ref": "gpt-tiny", "options": {}}), load=False)
    assert "expected" not in named.errors and named.expected_entries
