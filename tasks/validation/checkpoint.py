"""Checkpoint validation: gather facts about one checkpoint directory once (:func:`gather`, the
I/O half: files, DCP metadata, the fresh-process load), judge them with pure checks
(:func:`tasks.validation.judge.judge`), into a :class:`~tasks.validation.judge.CheckpointReport`;
and the validate stage's choice (:func:`validate_latest`): the newest committed checkpoint that
passes, falling back to the previous valid one (reported), failing when none is valid.

Checks (each PASSED / FAILED / SKIPPED with why):
1. manifest well-formed; step, world size and config hash consistent with the run;
2. every file present with its size and digest (the manifest's: xxh3-128, or sha256 in
   checkpoints before manifest v2; hashed in parallel; MB/s reported);
3. the DCP metadata covers every model and optimizer entry the model config defines, with their
   shapes and dtypes, and every stored item lies within its shard file;
4. loads on CPU in a fresh process on world size 1 (resharding) and every tensor is finite; or,
   when the load would not fit in this process's memory (``Expectations.load_mode``), not
   loaded: the metadata checks of 3 are then what vouches for the tensors, and 4 says so;
5. optional: the loss on a held-out batch is within a tolerance of the loss recorded at that step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import ValidationFailed
from tasks.secrets import scrubbed
from tasks.validation import load_process
from tasks.validation.files import hash_files, untrusted_workload_message
from tasks.validation.judge import CheckpointReport, Expectations, Facts, judge
from tasks.validation.load_mode import LoadMode, choose_load_mode, memory_budget
from tasks.validation.load_report import LoadReport
from trainer import checkpointing
from trainer.checkpointing import FileEntry, WorkloadRef
from trainer.untrusted import METADATA, load_dcp_metadata

_REPO = Path(__file__).resolve().parents[2]


# -- gathering (I/O) --------------------------------------------------------------------------
def expected_tensors(
    workload: WorkloadRef,
) -> tuple[dict[str, tuple[int, ...] | None], dict[str, str]]:
    """Every DCP key a checkpoint of this workload must hold with its shape: the model's
    parameters and, with the default AdamW, its state (a workload's own optimizer may keep other
    state, so only the model is checked then); and the dtypes known for them: a parameter's own
    (FSDP2 mixed precision casts copies for compute, the stored parameters keep it) and AdamW's
    moments, which take their parameter's (AdamW's ``step`` is left out: its dtype follows
    torch's default dtype at the time)."""
    import torch

    from trainer.workload import adamw, load_workload

    wl = load_workload(workload.ref, workload.options)
    model = wl.build_model(torch.device("meta"))  # meta: no memory, initial weights never read
    shapes: dict[str, tuple[int, ...] | None] = {}
    dtypes: dict[str, str] = {}
    for name, p in model.named_parameters():
        keys = [f"model.{name}"]
        if wl.spec.build_optimizer is adamw:
            keys += [f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"]
            shapes[f"optim.state.{name}.step"] = ()
        for key in keys:
            shapes[key] = tuple(p.shape)
            dtypes[key] = str(p.dtype)
    return shapes, dtypes


@dataclass(frozen=True)
class DcpIndex:
    """What a checkpoint's DCP metadata says about its tensors, without reading them."""

    shapes: dict[str, tuple[int, ...] | None]  # key -> shape (None: a bytes entry)
    dtypes: dict[str, str]
    tensor_bytes: int
    extents: list[tuple[str, str, int]]  # (item, shard file, offset + length)


def _dcp_index(path: Path) -> DcpIndex:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = load_dcp_metadata(path)  # restricted: a forged .metadata cannot run code
    shapes: dict[str, tuple[int, ...] | None] = {}
    dtypes: dict[str, str] = {}
    total = 0
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            shapes[k] = tuple(v.size)
            dtypes[k] = str(v.properties.dtype)
            total += math.prod(v.size) * v.properties.dtype.itemsize
        else:
            shapes[k] = None
    extents = [
        (str(idx.fqn), str(info.relative_path), int(info.offset) + int(info.length))
        for idx, info in md.storage_data.items()
    ]
    return DcpIndex(shapes, dtypes, total, extents)


def extent_errors(extents: list[tuple[str, str, int]], files: dict[str, FileEntry]) -> list[str]:
    """Stored items that would be read past the end of their shard file (or from a file that
    is not there): a truncated shard the manifest's digests would also catch, found here
    without reading a tensor."""
    bad = []
    for item, name, end in extents:
        if (got := files.get(name)) is None:
            bad.append(f"{item} is stored in {name}, which is missing")
        elif end > got.bytes:
            bad.append(f"{item} ends at byte {end} of {name}, which has {got.bytes}")
    return bad


def child_env(parent: dict[str, str]) -> dict[str, str]:
    """The environment of the load-check process: ``parent`` without credentials and without
    the trainer's distributed settings (it is a world of its own)."""
    env = scrubbed(parent)  # no credentials: it reads files others control (tasks.secrets)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NVRX_CONFIG"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), parent.get("PYTHONPATH")]))
    return env


def prestart_load_check() -> None:
    """Start the next load check's interpreter now, with the environment it would get
    (tasks.validation.load_process)."""
    load_process.prestart(child_env(dict(os.environ)))


def _fresh_process_load(
    path: Path,
    exp: Expectations,
    *,
    safetensors_out: Path | None = None,
    pretrained_out: Path | None = None,
) -> LoadReport:
    argv = [str(path)]
    if exp.workload is not None:
        argv += ["--workload", exp.workload.ref]
        argv += ["--workload-options", json.dumps(exp.workload.options)]
    paths = {"--data-dir": exp.data_dir, "--safetensors": safetensors_out}
    for flag, value in {**paths, "--pretrained": pretrained_out}.items():
        if value is not None:
            argv += [flag, str(value)]
    # A fresh interpreter, possibly started while the trainer's processes exited
    # (tasks.validation.load_process); its arguments go on stdin.
    proc = load_process.run(argv, child_env(dict(os.environ)), exp.load_timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-800:]
        return LoadReport.failed(f"load process exited {proc.returncode}: {tail}")
    return LoadReport.parse(lines[-1])


def gather(path: Path, exp: Expectations, *, load: bool = True) -> Facts:
    """Every fact the checks judge, read once and in order: the manifest and the files it
    vouches for, what the workload expects, the load. A step that makes the load impossible
    says why in ``errors["load"]`` and ends the gathering."""
    path = Path(path)
    facts = Facts(path=path)
    digests_ok = _read_files(path, facts)
    if "load" in facts.errors:
        return facts
    workload = _read_expected(path, exp, facts)
    if "load" in facts.errors:
        return facts
    _read_load(path, exp, facts, load=load, digests_ok=digests_ok, workload=workload)
    return facts


def _read_files(path: Path, facts: Facts) -> bool:
    """The manifest, every file's digest against it, and the DCP metadata once they match;
    whether they all match."""
    try:
        man = facts.manifest = checkpointing.read_manifest(path)
    except checkpointing.CheckpointError as e:
        facts.errors["manifest"] = str(e)
        facts.errors["load"] = "not loaded: no manifest to vouch for the files"
        return False
    sizes = {e.name: e.bytes for e in man.files}
    facts.files, facts.hash_mb_s = hash_files(path, list(sizes), man.digest, limits=sizes)
    digests_ok = all(facts.files.get(e.name) == e for e in man.files)
    if not digests_ok:
        # The DCP .metadata is a pickle: never read it before the manifest vouched for it.
        facts.errors["dcp"] = "not read: files do not match the manifest"
    else:
        try:
            index = _dcp_index(path)
        except Exception as e:
            # Read and refused (forged or garbled) is a finding about the checkpoint: FAILED.
            facts.errors["dcp_invalid"] = f"{path / METADATA}: {type(e).__name__}: {e}"
        else:
            facts.dcp_entries, facts.dcp_dtypes = index.shapes, index.dtypes
            facts.tensor_bytes = index.tensor_bytes
            facts.extent_errors = extent_errors(index.extents, facts.files)
    return digests_ok


def _read_expected(path: Path, exp: Expectations, facts: Facts) -> WorkloadRef | None:
    """The workload the checkpoint is judged against (the run's, else the manifest's if it may
    be named from a file) and the tensors it expects."""
    from trainer.workload import safe_to_name_from_file  # imports torch: only when validating

    workload = exp.workload or (facts.manifest.workload if facts.manifest else None)
    if workload and exp.workload is None and not safe_to_name_from_file(workload.ref):
        why = untrusted_workload_message(path, workload.ref)
        facts.errors["expected"] = why
        facts.errors["load"] = why
        return None
    if workload and workload.is_script:
        # A user's script builds its own model: nothing here can rebuild it to compare.
        why = f"written by the training script {workload.ref[7:]!r}: its model is its own"
        facts.errors["expected"] = why
        facts.errors["load"] = why
        facts.not_needed.update(expected=why, load=why)
        return None
    if workload:
        try:
            facts.expected_entries, facts.expected_dtypes = expected_tensors(workload)
        except Exception as e:
            facts.errors["expected"] = f"workload {workload.ref!r}: {e}"
    else:
        facts.errors["expected"] = "workload unknown (not in the manifest, none given)"
    return workload


def _read_load(
    path: Path,
    exp: Expectations,
    facts: Facts,
    *,
    load: bool,
    digests_ok: bool,
    workload: WorkloadRef | None,
) -> None:
    """Check 4's facts: the load in a fresh process, or why there is none."""
    if not load:
        facts.errors["load"] = "not requested"
        facts.not_needed["load"] = "not requested (quick checks)"
    elif not digests_ok:
        facts.errors["load"] = "skipped: files do not match the manifest"
    elif "dcp_invalid" in facts.errors:
        facts.errors["load"] = "skipped: the DCP metadata was refused"
    elif not workload:
        facts.errors["load"] = "workload unknown"
    else:
        budget, source = memory_budget() if exp.load_mode == LoadMode.AUTO else (None, "")
        facts.load_mode, facts.load_why = choose_load_mode(
            exp.load_mode,
            tensor_bytes=facts.tensor_bytes or 0,
            budget_bytes=budget,
            budget_source=source,
        )
        if facts.load_mode == LoadMode.METADATA:
            facts.errors["load"] = (
                f"{facts.load_why}; tensors not loaded (their shapes, dtypes and places in "
                "the shard files were checked against the DCP metadata instead)"
            )
            facts.not_needed["load"] = facts.load_why
            return
        try:
            facts.load = _fresh_process_load(path, exp)
        except subprocess.TimeoutExpired:
            facts.errors["load"] = f"load did not finish in {exp.load_timeout_s} s"


def consolidate(
    path: Path,
    out: Path,
    *,
    pretrained_out: Path | None = None,
    workload: WorkloadRef | None = None,
) -> LoadReport:
    """Write the checkpoint's full model weights as one safetensors file and, when the workload
    has one, its own self-contained layout (an HF directory for Llama) (fresh process, one CPU
    rank); the load's report says where and what (``safetensors``, ``pretrained``)."""
    res = _fresh_process_load(
        path, Expectations(workload=workload), safetensors_out=out, pretrained_out=pretrained_out
    )
    if not res.loaded or res.safetensors is None or res.params_sha256 is None:
        raise RuntimeError(f"consolidating {path} failed: {res.error}")
    return res


def validate_checkpoint(path: Path, exp: Expectations, *, load: bool = True) -> CheckpointReport:
    return judge(gather(path, exp, load=load), exp)


@dataclass
class ValidationOutcome:
    chosen: CheckpointReport
    rejected: list[CheckpointReport] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        return bool(self.rejected)


def validate_latest(run_root: Path, exp: Expectations, *, load: bool = True) -> ValidationOutcome:
    """``load=False`` skips the fresh-process load check (quick checks only)."""
    rejected: list[CheckpointReport] = []
    for step in reversed(checkpointing.committed_steps(run_root)):
        report = validate_checkpoint(checkpointing.committed_path(run_root, step), exp, load=load)
        if report.step is None:
            # The manifest could not be read (it is what failed): the directory names the step,
            # so the report and the fallback still say which checkpoint was rejected.
            report = dataclasses.replace(report, step=step)
        if report.passed:
            return ValidationOutcome(report, rejected)
        rejected.append(report)
    if not rejected:
        raise ValidationFailed(
            f"no committed checkpoint under {checkpointing.checkpoints_dir(run_root)}"
        )
    details = "; ".join(
        f"step {r.step}: " + ", ".join(c.detail for c in r.failed_checks()) for r in rejected
    )
    raise ValidationFailed(f"no valid checkpoint: {details}")
