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
from tasks.validation.load_report import LoadReport
from tests.helpers import REPO, as_pre_v2_checkpoint, make_config, run_single, vouch_for, worker_env
from trainer import checkpointing
from trainer.checkpointing import FileEntry, Manifest, WorkloadRef
from trainer.faults import flip_bytes


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory) -> tuple[Path, dict]:
    cfg = make_config(tmp_path_factory.mktemp("val") / "run", dataset, steps=10)
    out = run_single(cfg)
    assert out.returncode == 0, out.log[-2000:]
    return cfg.run_root, {"hash": cfg.fingerprint(), "sha": out.result["params_sha256"]}


@pytest.fixture
def ckpt(trained, tmp_path: Path) -> Path:
    src = checkpointing.committed_path(trained[0], 10)
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


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
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(
    trained, dataset: Path, tmp_path: Path
):
    """The newest checkpoint corrupted after it committed (what the corrupt-checkpoint drill
    does): the validate stage's decision fails it naming the file, falls back to the previous
    one, and that one is what the stage hands to the export (flows.stages)."""
    from tasks.validation.checkpoint import validate_latest

    run_root = tmp_path / "run"
    shutil.copytree(
        checkpointing.checkpoints_dir(trained[0]), checkpointing.checkpoints_dir(run_root)
    )
    assert checkpointing.committed_steps(run_root)[-2:] == [5, 10]
    victim = sorted(checkpointing.committed_path(run_root, 10).glob("*.distcp"))[0]
    flip_bytes(victim)
    exp = Expectations(config_hash=trained[1]["hash"], world_size=1, data_dir=dataset)
    outcome = validate_latest(run_root, exp)
    assert outcome.fell_back and [r.step for r in outcome.rejected] == [10]
    assert victim.name in outcome.rejected[0].failed_checks()[0].detail
    assert outcome.chosen.step == 5 and outcome.chosen.passed
    assert outcome.chosen.path == str(checkpointing.committed_path(run_root, 5))


@pytest.mark.slow
def test_flipped_bytes_fail_naming_the_file(ckpt: Path):
    victim = sorted(ckpt.glob("*.distcp"))[0]
    flip_bytes(victim)
    report = validate_checkpoint(ckpt, Expectations())
    s = statuses(report)
    assert not report.passed
    assert s["files and digests"] == "FAILED"
    assert victim.name in next(c.detail for c in report.checks if c.status == "FAILED")
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"


@pytest.mark.slow
def test_a_checkpoint_of_manifest_v1_still_validates(trained, ckpt: Path):
    """A checkpoint committed before manifest v2 (every file's sha256, written here the old way)
    validates, loads in the fresh process, and a flipped byte still fails it naming the file."""
    as_pre_v2_checkpoint(ckpt)
    report = validate_checkpoint(ckpt, Expectations(config_hash=trained[1]["hash"], world_size=1))
    assert report.passed, report.checks
    assert report.params_sha256 == trained[1]["sha"]
    victim = sorted(ckpt.glob("*.distcp"))[0]
    flip_bytes(victim)
    report = validate_checkpoint(ckpt, Expectations(), load=False)
    detail = {c.name: c.detail for c in report.checks}
    assert f"{victim} does not match its sha256" in detail["files and digests"]


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
    detail = report.checks[0].detail
    assert report.checks[0].status == "FAILED"
    assert "config hash" in detail and "world size 1 != the run's 4" in detail


@pytest.mark.parametrize(
    ("low", "high", "ok"),
    [(1, 2, True), (2, 3, True), (3, 4, False), (None, 2, True), (None, 3, False)],
)
def test_an_elastic_runs_checkpoint_may_come_from_any_world_in_its_range(low, high, ok):
    """A 2-rank checkpoint (written after the job shrank) is the run's when 2 is in its range."""
    r = judge(_facts(), Expectations(world_size=high, min_world_size=low))
    manifest = r.checks[0]
    assert (manifest.status == "PASSED") == ok, manifest.detail
    if not ok:
        assert "world size 2" in manifest.detail


def _facts(**kw) -> Facts:
    base = Facts(
        path=Path("/x/step_000000010"),
        manifest=Manifest(step=10, world_size=2, digest="sha256", files=(), loss=4.0),
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
    c = next(x for x in r.checks if x.name.startswith("DCP"))
    assert c.status == "FAILED" and "1 missing" in c.detail and "wrong shapes" in c.detail


def test_nonfinite_and_loss_out_of_tolerance_fail():
    f = _facts(load=LoadReport(loaded=True, tensors=3, nonfinite=["model.w"], heldout_loss=9.0))
    r = judge(f, Expectations(data_dir=Path("/data")))
    s = statuses(r)
    assert s["loads on 1 CPU rank, all tensors finite"] == Status.FAILED.value
    assert s["held-out loss near the recorded loss"] == Status.FAILED.value


def test_blind_checks_are_skipped_and_a_blind_required_one_rejects():
    """Checks run on the same runner as preflight (tasks.checks.run_check): a check that could
    not look is SKIPPED with why, and one the checkpoint needs rejects it: a blind validation
    must not pass."""
    f = _facts(errors={"dcp": "cannot read .metadata", "load": "load did not finish in 600 s"})
    r = judge(f, Expectations())
    s = statuses(r)
    assert s["DCP metadata covers the model and optimizer"] == "SKIPPED"
    assert s["loads on 1 CPU rank, all tensors finite"] == "SKIPPED"
    assert s["held-out loss near the recorded loss"] == "SKIPPED"
    assert not r.passed
    rejected = {c.name: c.detail for c in r.failed_checks()}
    assert rejected == {
        COVERAGE: "source 'dcp' failed: cannot read .metadata",
        LOAD: "source 'load' failed: load did not finish in 600 s",
    }


# (case, what could not be read and why it was not needed: the checkpoint still passes)
NOT_NEEDED = [
    ("script", {"expected": "its model is its own", "load": "its model is its own"}),
    ("quick", {"load": "not requested (quick checks)"}),
    ("metadata-only", {"load": "metadata-only (memory)"}),
]


@pytest.mark.parametrize(("case", "not_needed"), NOT_NEEDED, ids=[c[0] for c in NOT_NEEDED])
def test_checks_a_checkpoint_does_not_need_stop_nothing(case: str, not_needed: dict[str, str]):
    f = _facts(
        errors=dict(not_needed),
        not_needed=dict(not_needed),
        dcp_entries={"model.a": (2,)},
        expected_entries=None if "expected" in not_needed else {"model.a": (2,)},
    )
    r = judge(f, Expectations())
    assert r.passed, r.checks
    skipped = {c.name: c for c in r.checks if c.status == "SKIPPED"}
    assert "loads on 1 CPU rank, all tensors finite" in skipped
    assert all(not c.required for c in skipped.values())
    assert r.failed_checks() == []


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
    detail = judge(facts, Expectations()).checks[0].detail
    assert repr(name) in detail


def test_refused_metadata_fails_coverage_and_skips_the_load(ckpt: Path):
    """A .metadata the restricted reader refuses is a finding (FAILED), not a blind check."""
    import pickle

    vouch_for(ckpt, ".metadata", pickle.dumps({"not": "metadata"}))
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
    named = gather(ckpt, Expectations(workload=WorkloadRef("gpt-tiny")), load=False)
    assert "expected" not in named.errors and named.expected_entries


# -- load modes: full, metadata-only, auto ------------------------------------------------------
LOAD = "loads on 1 CPU rank, all tensors finite"
COVERAGE = "DCP metadata covers the model and optimizer"


def _no_load(*args, **kwargs):
    raise AssertionError("metadata mode must not start the load process")


def _rewrite_metadata(ckpt: Path, change) -> None:
    """Re-pickle the checkpoint's DCP metadata after ``change(md)`` and make the manifest vouch
    for it (a consistent pair: what a writer with a different model would have left)."""
    import pickle

    from trainer.untrusted import load_dcp_metadata

    md = load_dcp_metadata(ckpt)
    change(md)
    vouch_for(ckpt, ".metadata", pickle.dumps(md))


def test_forced_metadata_mode_passes_without_loading(ckpt: Path, monkeypatch):
    from tasks.validation import checkpoint

    monkeypatch.setattr(checkpoint, "_fresh_process_load", _no_load)
    report = validate_checkpoint(ckpt, Expectations(load_mode=checkpoint.LoadMode.METADATA))
    assert report.passed, report.checks
    s = statuses(report)
    assert s["files and digests"] == s[COVERAGE] == "PASSED"
    assert s[LOAD] == "SKIPPED" and report.params_sha256 is None
    detail = {c.name: c.detail for c in report.checks}
    assert detail[LOAD].startswith("metadata-only (load_mode metadata, as asked)")
    assert "tensors not loaded" in detail[LOAD]
    assert "shapes and dtypes" in detail[COVERAGE] and "within its shard file" in detail[COVERAGE]


def test_metadata_mode_fails_a_shape_mismatch_naming_the_tensor(ckpt: Path, monkeypatch):
    import torch

    from tasks.validation import checkpoint

    key = "model.head.weight"

    def widen(md) -> None:
        entry = md.state_dict_metadata[key]
        entry.size = torch.Size([entry.size[0] + 1, *entry.size[1:]])

    _rewrite_metadata(ckpt, widen)
    monkeypatch.setattr(checkpoint, "_fresh_process_load", _no_load)
    report = validate_checkpoint(ckpt, Expectations(load_mode=checkpoint.LoadMode.METADATA))
    assert not report.passed
    failed = {c.name: c.detail for c in report.failed_checks()}
    assert set(failed) == {COVERAGE}
    assert f"{key} is (" in failed[COVERAGE] and "the model's is (" in failed[COVERAGE]


def test_metadata_mode_fails_a_dtype_mismatch_naming_the_tensor(ckpt: Path):
    import torch

    from tasks.validation import checkpoint

    key = "optim.state.head.weight.exp_avg"

    def halve(md) -> None:
        md.state_dict_metadata[key].properties.dtype = torch.bfloat16

    _rewrite_metadata(ckpt, halve)
    facts = gather(ckpt, Expectations(load_mode=checkpoint.LoadMode.METADATA))
    failed = {c.name: c.detail for c in judge(facts, Expectations()).failed_checks()}
    assert f"{key} is torch.bfloat16, the model's is torch.float32" in failed[COVERAGE]


def test_auto_mode_loads_nothing_when_memory_is_short(ckpt: Path, monkeypatch):
    from tasks.validation import checkpoint

    monkeypatch.setattr(checkpoint, "memory_budget", lambda: (200 << 20, "cgroup limit"))
    monkeypatch.setattr(checkpoint, "_fresh_process_load", _no_load)
    report = validate_checkpoint(ckpt, Expectations())  # load_mode defaults to auto
    assert report.passed, report.checks
    detail = next(c for c in report.checks if c.name == LOAD)
    assert detail.status == "SKIPPED"
    assert detail.detail.startswith("metadata-only (auto): checkpoint tensors ")
    assert "> 0.2 GB this process may use (cgroup limit); tensors not loaded" in detail.detail


@pytest.mark.parametrize(
    ("requested", "tensor_gb", "budget_gb", "mode", "phrase"),
    [
        ("auto", 16.1, 3.2, "metadata", "metadata-only (auto): checkpoint tensors 16.1 GB x 1.5"),
        ("auto", 1.0, 3.2, "full", "full load (auto): "),
        ("auto", 1.0, None, "full", "not known"),
        ("full", 160.0, 3.2, "full", "as asked"),
        ("metadata", 0.001, 100.0, "metadata", "as asked"),
    ],
)
def test_choose_load_mode(requested, tensor_gb, budget_gb, mode, phrase):
    from tasks.validation.load_mode import LoadMode, choose_load_mode

    got, why = choose_load_mode(
        LoadMode(requested),
        tensor_bytes=int(tensor_gb * 1e9),
        budget_bytes=None if budget_gb is None else int(budget_gb * 1e9),
        budget_source="test",
    )
    assert got == LoadMode(mode) and phrase in why


def test_cgroup_memory_left(tmp_path: Path):
    from tasks.validation.load_mode import cgroup_memory_left

    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    group = tmp_path / "kubepods" / "pod1"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(f"{4 << 30}\n")
    (group / "memory.current").write_text(f"{1 << 30}\n")
    assert cgroup_memory_left(tmp_path, proc) == 3 << 30
    (group / "memory.max").write_text("max\n")  # no limit in the pod's group nor the root
    assert cgroup_memory_left(tmp_path, proc) is None
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # v1's "unlimited"
    assert cgroup_memory_left(tmp_path, proc) is None
    (v1 / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 << 30}\n")
    assert cgroup_memory_left(tmp_path, proc) == 6 << 30


def test_items_past_their_shard_end_fail_coverage():
    from tasks.validation.checkpoint import extent_errors

    files = {"__0_0.distcp": FileEntry("__0_0.distcp", 100, "x")}
    bad = extent_errors(
        [("model.a", "__0_0.distcp", 100), ("model.b", "__0_0.distcp", 101), ("c", "gone", 1)],
        files,
    )
    assert bad == [
        "model.b ends at byte 101 of __0_0.distcp, which has 100",
        "c is stored in gone, which is missing",
    ]
    f = _facts(dcp_entries={}, expected_entries={}, extent_errors=bad)
    c = next(x for x in judge(f, Expectations()).checks if x.name == COVERAGE)
    assert c.status == "FAILED" and "model.b ends at byte 101" in c.detail
