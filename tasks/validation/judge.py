"""Checkpoint validation's pure half: what the run expects (:class:`Expectations`), the facts
gathered about one checkpoint directory (:class:`Facts`, by
:func:`tasks.validation.checkpoint.gather`), and the five checks that judge them into a
:class:`CheckpointReport`. The checks are declared like preflight's (tasks.checks.Check) and run
by the same runner: a check whose source could not be read is SKIPPED with the source's error,
and a SKIPPED check the checkpoint needs rejects it (a blind validation must not pass). The
snapshot holds the gathered Facts whole; a source is present when its part was read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.checks import Check, CheckResult, Snapshot, Source, Status, Verdict, blocks, run_all
from tasks.validation.load_mode import LoadMode
from tasks.validation.load_report import LoadReport
from trainer.checkpointing import FileEntry, Manifest, WorkloadRef


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What the run says the checkpoint must be; None: not known (the check is SKIPPED)."""

    # Overrides the workload the manifest says wrote the checkpoint.
    workload: WorkloadRef | None = None
    config_hash: str | None = None
    world_size: int | None = None
    # An elastic run (trainer.elastic) commits checkpoints on any world from this size up to
    # world_size (DCP reshards them on load); None: exactly world_size.
    min_world_size: int | None = None
    data_dir: Path | None = None  # enables the held-out loss check
    loss_tolerance: float = 0.25  # relative
    load_timeout_s: float = 600.0
    load_mode: LoadMode = LoadMode.AUTO


@dataclass
class Facts:
    path: Path
    manifest: Manifest | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)  # name -> what is on disk
    hash_mb_s: float | None = None
    dcp_entries: dict[str, tuple[int, ...] | None] | None = None  # key -> shape (None: bytes)
    expected_entries: dict[str, tuple[int, ...] | None] | None = None
    dcp_dtypes: dict[str, str] = field(default_factory=dict)  # tensor key -> "torch.float32"
    expected_dtypes: dict[str, str] = field(default_factory=dict)  # only the keys it knows
    tensor_bytes: int | None = None  # of every tensor the DCP metadata describes
    extent_errors: list[str] = field(default_factory=list)  # items beyond their shard's end
    load_mode: LoadMode | None = None  # what check 4 did (None: it did not get that far)
    load_why: str = ""  # why that mode, for the report
    load: LoadReport | None = None
    errors: dict[str, str] = field(default_factory=dict)
    # Sources this checkpoint's validation does not need (source -> why): what a check that
    # reads only those could not see does not fail the checkpoint. Anything else blind does.
    not_needed: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointReport:
    status: str  # "passed" | "failed"
    path: str
    step: int | None
    checks: list[CheckResult]
    hash_mb_s: float | None = None
    params_sha256: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def failed_checks(self) -> list[CheckResult]:
        """What rejects the checkpoint: a FAILED check, or a required one that could not look
        (SKIPPED, with why)."""
        return [c for c in self.checks if blocks(c)]

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "checks": [c.row() for c in self.checks]}


MANIFEST = Source(
    "manifest", "the checkpoint's manifest.json must be readable and name only files inside it"
)
DCP = Source("dcp", "the DCP metadata is read only once every file matches the manifest")
EXPECTED = Source(
    "expected",
    "validate with the run's workload (the pipeline's own, or validate --workload REF)",
)
LOADED = Source("load", "give the fresh-process load the files, memory and time it needs")


def snapshot(f: Facts) -> Snapshot:
    facts: dict[str, Any] = {"gathered": f}
    if f.manifest is not None:
        facts["manifest"] = f.manifest
    if f.dcp_entries is not None or "dcp_invalid" in f.errors:
        facts["dcp"] = True  # read: its entries, or refused (a finding, FAILED)
    if f.expected_entries is not None:
        facts["expected"] = f.expected_entries
    if f.load is not None:
        facts["load"] = f.load
    sources = ("manifest", "dcp", "expected", "load")
    errors = {k: f.errors[k] for k in sources if k in f.errors and k not in f.not_needed}
    not_read = {k: f.errors.get(k, why) for k, why in f.not_needed.items() if k in sources}
    return Snapshot(facts=facts, errors=errors, not_read=not_read)


def _gathered(snap: Snapshot) -> Facts:
    facts: Facts = snap.facts["gathered"]
    return facts


def manifest_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    if (m := f.manifest) is None:
        return Verdict(Status.FAILED, f.errors.get("manifest", "not read"))
    problems = []
    dir_step = f.path.name.removeprefix("step_")
    if not dir_step.isdigit() or int(dir_step) != m.step:
        problems.append(f"step {m.step} does not match directory {f.path.name}")
    if exp.config_hash is not None and m.config_hash != exp.config_hash:
        problems.append(f"config hash {m.config_hash} != the run's {exp.config_hash}")
    if exp.world_size is not None:
        low, ws = exp.min_world_size or exp.world_size, m.world_size
        if low == exp.world_size and ws != exp.world_size:
            problems.append(f"world size {ws} != the run's {exp.world_size}")
        elif not low <= ws <= exp.world_size:
            problems.append(f"world size {ws} is outside the run's {low}..{exp.world_size}")
    if problems:
        return Verdict(Status.FAILED, "; ".join(problems))
    return Verdict(Status.PASSED, f"step {m.step}, world size {m.world_size}, {len(m.files)} files")


def files_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    bad = []
    man: Manifest = snap.facts["manifest"]
    for e in man.files:
        got = f.files.get(e.name)
        if got is None:
            bad.append(f"{f.path / e.name} is missing")
        elif got.bytes != e.bytes:
            bad.append(f"{f.path / e.name} is {got.bytes} bytes, manifest says {e.bytes}")
        elif got.digest != e.digest:
            bad.append(f"{f.path / e.name} does not match its {man.digest}")
    if bad:
        return Verdict(Status.FAILED, "; ".join(bad))
    return Verdict(Status.PASSED, f"{len(f.files)} files verified at {f.hash_mb_s or 0:.0f} MB/s")


def coverage_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    if "dcp_invalid" in f.errors:
        return Verdict(Status.FAILED, f.errors["dcp_invalid"])
    have, want = f.dcp_entries or {}, f.expected_entries or {}
    missing = sorted(k for k in want if k not in have)
    wrong = sorted(k for k, shape in want.items() if k in have and have[k] != shape)
    wrong_dtype = sorted(
        k
        for k, dtype in f.expected_dtypes.items()
        if k in f.dcp_dtypes and f.dcp_dtypes[k] != dtype
    )
    if missing or wrong or wrong_dtype or f.extent_errors:
        detail = []
        if missing:
            detail.append(f"{len(missing)} missing, e.g. {missing[:3]}")
        if wrong:
            detail.append(
                f"{len(wrong)} with wrong shapes, e.g. "
                + ", ".join(f"{k} is {have[k]}, the model's is {want[k]}" for k in wrong[:3])
            )
        if wrong_dtype:
            detail.append(
                f"{len(wrong_dtype)} with wrong dtypes, e.g. "
                + ", ".join(
                    f"{k} is {f.dcp_dtypes[k]}, the model's is {f.expected_dtypes[k]}"
                    for k in wrong_dtype[:3]
                )
            )
        if f.extent_errors:
            detail.append(
                f"{len(f.extent_errors)} stored past their shard's end, e.g. "
                + "; ".join(f.extent_errors[:3])
            )
        return Verdict(Status.FAILED, "; ".join(detail))
    return Verdict(
        Status.PASSED,
        f"{len(want)} entries present with their shapes and dtypes, every stored item within "
        "its shard file",
    )


def load_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    res: LoadReport = snap.facts["load"]
    how = f"{f.load_why}: " if f.load_why else ""
    if not res.loaded:
        return Verdict(Status.FAILED, how + (res.error or "did not load"))
    if res.nonfinite:
        return Verdict(Status.FAILED, f"{how}non-finite values in {res.nonfinite}")
    return Verdict(Status.PASSED, f"{how}{res.tensors} tensors loaded, all finite")


def loss_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    if exp.data_dir is None:
        return Verdict(Status.SKIPPED, "no dataset given (optional check)")
    res: LoadReport = snap.facts["load"]
    if not res.loaded:
        return Verdict(Status.SKIPPED, "checkpoint did not load")
    recorded = f.manifest.loss if f.manifest else None
    got = res.heldout_loss
    if recorded is None:
        return Verdict(Status.SKIPPED, "the manifest records no loss")
    if got is None:
        return Verdict(Status.FAILED, "held-out loss is not finite")
    if abs(got - recorded) > exp.loss_tolerance * abs(recorded):
        return Verdict(
            Status.FAILED,
            f"held-out loss {got:.4f} vs recorded {recorded:.4f} "
            f"(tolerance {exp.loss_tolerance:.0%})",
        )
    return Verdict(Status.PASSED, f"held-out {got:.4f} vs recorded {recorded:.4f}")


CHECKS: tuple[Check, ...] = (
    Check(name="manifest", requires=(), fn=manifest_verdict),
    Check(name="files and digests", requires=(MANIFEST,), fn=files_verdict),
    Check(
        name="DCP metadata covers the model and optimizer",
        requires=(MANIFEST, DCP, EXPECTED),
        fn=coverage_verdict,
    ),
    Check(name="loads on 1 CPU rank, all tensors finite", requires=(LOADED,), fn=load_verdict),
    # Advisory: the held-out batch is a sample, and a run without its dataset at hand is
    # validated by the checks above.
    Check(
        name="held-out loss near the recorded loss",
        requires=(LOADED,),
        fn=loss_verdict,
        required=False,
    ),
)


def judge(f: Facts, exp: Expectations) -> CheckpointReport:
    results = run_all(CHECKS, snapshot(f), exp)
    return CheckpointReport(
        status="failed" if any(blocks(r) for r in results) else "passed",
        path=str(f.path),
        step=f.manifest.step if f.manifest else None,
        checks=results,
        hash_mb_s=None if f.hash_mb_s is None else round(f.hash_mb_s, 1),
        params_sha256=None if f.load is None else f.load.params_sha256,
    )
