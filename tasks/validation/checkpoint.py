"""Checkpoint validation: gather facts about one checkpoint directory once (:func:`gather`), judge
them with pure checks (:func:`judge`), into a :class:`CheckpointReport`.

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

import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from tasks.checks import Check, Snapshot, Source, Status, Verdict, blocks, run_all
from tasks.secrets import scrubbed
from tasks.validation import load_process
from tasks.validation.files import check_file_names, hash_files, untrusted_workload_message
from trainer import checkpointing
from trainer.untrusted import METADATA, UnsafeNameError, load_dcp_metadata

_REPO = Path(__file__).resolve().parents[2]


class LoadMode(StrEnum):
    """How check 4 looks at the tensors."""

    FULL = "full"  # load every tensor in a fresh process, check each is finite
    METADATA = "metadata"  # load nothing: the DCP metadata against the model built on "meta"
    AUTO = "auto"  # full when the load fits in the memory this process may use, else metadata


# Peak memory of a full load per byte of checkpoint tensors: the model and optimizer state the
# load fills hold every tensor once; initialising AdamW's state first allocates the gradients
# (a third of an AdamW checkpoint's tensors) for one step; DCP reads each item into a buffer
# before copying it, and the parameter digest copies one tensor at a time. Plus the interpreter
# with torch imported.
LOAD_MEMORY_FACTOR = 1.5
LOAD_OVERHEAD_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What the run says the checkpoint must be; None: not known (the check is SKIPPED)."""

    # {"ref", "options"}: overrides the workload the manifest says wrote the checkpoint.
    workload: dict[str, Any] | None = None
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
    manifest: dict[str, Any] | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size, digest
    hash_mb_s: float | None = None
    dcp_entries: dict[str, tuple[int, ...] | None] | None = None  # key -> shape (None: bytes)
    expected_entries: dict[str, tuple[int, ...] | None] | None = None
    dcp_dtypes: dict[str, str] = field(default_factory=dict)  # tensor key -> "torch.float32"
    expected_dtypes: dict[str, str] = field(default_factory=dict)  # only the keys it knows
    tensor_bytes: int | None = None  # of every tensor the DCP metadata describes
    extent_errors: list[str] = field(default_factory=list)  # items beyond their shard's end
    load_mode: LoadMode | None = None  # what check 4 did (None: it did not get that far)
    load_why: str = ""  # why that mode, for the report
    load: dict[str, Any] | None = None
    errors: dict[str, str] = field(default_factory=dict)
    # Sources this checkpoint's validation does not need (source -> why): what a check that
    # reads only those could not see does not fail the checkpoint. Anything else blind does.
    not_needed: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointReport:
    status: str  # "passed" | "failed"
    path: str
    step: int | None
    checks: list[dict[str, Any]]
    hash_mb_s: float | None = None
    params_sha256: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def failed_checks(self) -> list[dict[str, Any]]:
        """What rejects the checkpoint: a FAILED check, or a required one that could not look
        (SKIPPED, with why)."""
        return [
            c
            for c in self.checks
            if c["status"] == Status.FAILED.value
            or (c["status"] == Status.SKIPPED.value and c.get("required", True))
        ]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- gathering (I/O) --------------------------------------------------------------------------
def expected_tensors(
    workload: dict[str, Any],
) -> tuple[dict[str, tuple[int, ...] | None], dict[str, str]]:
    """Every DCP key a checkpoint of this workload must hold with its shape: the model's
    parameters and, with the default AdamW, its state (a workload's own optimizer may keep other
    state, so only the model is checked then); and the dtypes known for them: a parameter's own
    (FSDP2 mixed precision casts copies for compute, the stored parameters keep it) and AdamW's
    moments, which take their parameter's (AdamW's ``step`` is left out: its dtype follows
    torch's default dtype at the time)."""
    import torch

    from trainer.workload import adamw, load_workload

    wl = load_workload(workload["ref"], workload.get("options") or {})
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


def expected_entries(workload: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """The keys and shapes of :func:`expected_tensors`."""
    return expected_tensors(workload)[0]


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


def extent_errors(
    extents: list[tuple[str, str, int]], files: dict[str, dict[str, Any]]
) -> list[str]:
    """Stored items that would be read past the end of their shard file (or from a file that
    is not there): a truncated shard the manifest's digests would also catch, found here
    without reading a tensor."""
    bad = []
    for item, name, end in extents:
        size = (files.get(name) or {}).get("bytes")
        if size is None:
            bad.append(f"{item} is stored in {name}, which is missing")
        elif end > size:
            bad.append(f"{item} ends at byte {end} of {name}, which has {size}")
    return bad


# -- how check 4 looks at the tensors ----------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def choose_load_mode(
    requested: LoadMode, *, tensor_bytes: int, budget_bytes: int | None, budget_source: str
) -> tuple[LoadMode, str]:
    """(mode, why) for check 4 (pure). ``auto``: a full load only when its estimated peak
    (``LOAD_MEMORY_FACTOR`` x the tensors + ``LOAD_OVERHEAD_BYTES``) fits in what this process
    may use; it would otherwise be OOM-killed (taking the flow runner with it: the load check's
    process shares its cgroup) or leave the check unanswered."""
    if requested == LoadMode.FULL:
        return LoadMode.FULL, "full load (load_mode full, as asked)"
    if requested == LoadMode.METADATA:
        return LoadMode.METADATA, "metadata-only (load_mode metadata, as asked)"
    need = tensor_bytes * LOAD_MEMORY_FACTOR + LOAD_OVERHEAD_BYTES
    if budget_bytes is None:
        return LoadMode.FULL, "full load (auto: the memory this process may use is not known)"
    versus = (
        f"checkpoint tensors {_gb(tensor_bytes)} x {LOAD_MEMORY_FACTOR} + "
        f"{_gb(LOAD_OVERHEAD_BYTES)}: {_gb(need)}"
    )
    budget = f"{_gb(budget_bytes)} this process may use ({budget_source})"
    if need > budget_bytes:
        return LoadMode.METADATA, f"metadata-only (auto): {versus} > {budget}"
    return LoadMode.FULL, f"full load (auto): {versus} <= {budget}"


CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "unlimited" as a page-rounded 2**63 - 1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_memory_left(root: Path = CGROUP_ROOT, proc_cgroup: Path | None = None) -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less what the cgroup already
    uses), or None without a limit. cgroup v2 (``memory.max``, ``memory.current``; the
    process's own group from /proc/self/cgroup, then the root a container sees), else v1."""
    candidates = []
    try:
        for line in (proc_cgroup or Path("/proc/self/cgroup")).read_text().splitlines():
            if line.startswith("0::"):
                candidates.append(root / line[3:].strip().lstrip("/"))
    except OSError:
        pass
    candidates.append(root)
    for group in candidates:
        limit = _read_int(group / "memory.max")
        if limit is not None:
            return max(0, limit - (_read_int(group / "memory.current") or 0))
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    if limit is not None and limit < _NO_LIMIT:
        return max(0, limit - (_read_int(root / "memory" / "memory.usage_in_bytes") or 0))
    return None


def memory_budget() -> tuple[int | None, str]:
    """(bytes this process may still use, where that figure comes from)."""
    try:
        import psutil

        available: int | None = int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or /proc unreadable: the cgroup alone, or unknown
        available = None
    left = cgroup_memory_left()
    if left is not None and (available is None or left <= available):
        return left, "cgroup memory limit less usage"
    if available is None:
        return None, "unknown"
    return available, "available memory"


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
) -> dict[str, Any]:
    argv = [str(path)]
    if exp.workload is not None:
        argv += [
            "--workload",
            exp.workload["ref"],
            "--workload-options",
            json.dumps(exp.workload.get("options") or {}),
        ]
    if exp.data_dir is not None:
        argv += ["--data-dir", str(exp.data_dir)]
    if safetensors_out is not None:
        argv += ["--safetensors", str(safetensors_out)]
    if pretrained_out is not None:
        argv += ["--pretrained", str(pretrained_out)]
    # A fresh interpreter, possibly started while the trainer's processes exited
    # (tasks.validation.load_process); its arguments go on stdin.
    proc = load_process.run(argv, child_env(dict(os.environ)), exp.load_timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-800:]
        return {"loaded": False, "error": f"load process exited {proc.returncode}: {tail}"}
    return dict(json.loads(lines[-1]))


def gather(path: Path, exp: Expectations, *, load: bool = True) -> Facts:
    path = Path(path)
    facts = Facts(path=path)
    try:
        facts.manifest = checkpointing.read_manifest(path)
    except checkpointing.CheckpointError as e:
        facts.errors["manifest"] = str(e)
        facts.errors["load"] = "not loaded: no manifest to vouch for the files"
        return facts
    try:
        check_file_names(facts.manifest, path)
    except UnsafeNameError as e:
        facts.errors["manifest"] = str(e)
        facts.errors["load"] = "not loaded: the manifest names files outside the checkpoint"
        return facts
    names = [e["name"] for e in facts.manifest["files"]]
    digest = checkpointing.digest_of(facts.manifest)
    sizes = {e["name"]: int(e["bytes"]) for e in facts.manifest["files"]}
    facts.files, facts.hash_mb_s = hash_files(path, names, digest, limits=sizes)
    digests_ok = all(
        facts.files.get(e["name"], {}).get(digest) == e[digest] for e in facts.manifest["files"]
    )
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
    from trainer.workload import safe_to_name_from_file  # imports torch: only when validating

    workload = exp.workload or checkpointing.workload_of(facts.manifest)
    if workload and exp.workload is None and not safe_to_name_from_file(workload["ref"]):
        why = untrusted_workload_message(path, workload["ref"])
        facts.errors["expected"] = why
        facts.errors["load"] = why
        return facts
    if workload and workload["ref"].startswith("script:"):
        # A user's script builds its own model: nothing here can rebuild it to compare.
        why = f"written by the training script {workload['ref'][7:]!r}: its model is its own"
        facts.errors["expected"] = why
        facts.errors["load"] = why
        facts.not_needed.update(expected=why, load=why)
        return facts
    if workload:
        try:
            facts.expected_entries, facts.expected_dtypes = expected_tensors(workload)
        except Exception as e:
            facts.errors["expected"] = f"workload {workload['ref']!r}: {e}"
    else:
        facts.errors["expected"] = "workload unknown (not in the manifest, none given)"
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
            return facts
        try:
            facts.load = _fresh_process_load(path, exp)
        except subprocess.TimeoutExpired:
            facts.errors["load"] = f"load did not finish in {exp.load_timeout_s} s"
    return facts


# -- judging (pure) ---------------------------------------------------------------------------
# The checks are declared like preflight's (tasks.checks.Check) and run by the same runner: a
# check whose source could not be read is SKIPPED with the source's error, and a SKIPPED check
# the checkpoint needs rejects it (a blind validation must not pass). The snapshot holds the
# gathered Facts whole; a source is present when its part was read.
MANIFEST = Source(
    name="manifest",
    facts=("manifest",),
    fix="the checkpoint's manifest.json must be readable and name only files inside it",
)
DCP = Source(
    name="dcp",
    facts=("dcp",),
    fix="the DCP metadata is read only once every file matches the manifest",
)
EXPECTED = Source(
    name="expected",
    facts=("expected",),
    fix="validate with the run's workload (the pipeline's own, or validate --workload REF)",
)
LOADED = Source(
    name="load",
    facts=("load",),
    fix="give the fresh-process load the files, memory and time it needs",
)


def snapshot(f: Facts) -> Snapshot:
    facts: dict[str, Any] = {"gathered": f}
    if "manifest" not in f.errors and f.manifest is not None:
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
    if "manifest" in f.errors:
        return Verdict(Status.FAILED, f.errors["manifest"])
    m = f.manifest or {}
    problems = []
    dir_step = f.path.name.removeprefix("step_")
    if not dir_step.isdigit() or int(dir_step) != m.get("step"):
        problems.append(f"step {m.get('step')} does not match directory {f.path.name}")
    if exp.config_hash is not None and m.get("config_hash") != exp.config_hash:
        problems.append(f"config hash {m.get('config_hash')} != the run's {exp.config_hash}")
    if exp.world_size is not None:
        low, ws = exp.min_world_size or exp.world_size, m.get("world_size")
        if low == exp.world_size and ws != exp.world_size:
            problems.append(f"world size {ws} != the run's {exp.world_size}")
        elif not (isinstance(ws, int) and low <= ws <= exp.world_size):
            problems.append(f"world size {ws} is outside the run's {low}..{exp.world_size}")
    if problems:
        return Verdict(Status.FAILED, "; ".join(problems))
    return Verdict(
        Status.PASSED, f"step {m['step']}, world size {m['world_size']}, {len(m['files'])} files"
    )


def files_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    bad = []
    digest = checkpointing.digest_of(snap.facts["manifest"])
    for e in snap.facts["manifest"]["files"]:
        got = f.files.get(e["name"])
        if got is None:
            bad.append(f"{f.path / e['name']} is missing")
        elif got["bytes"] != e["bytes"]:
            bad.append(f"{f.path / e['name']} is {got['bytes']} bytes, manifest says {e['bytes']}")
        elif got.get(digest) != e[digest]:
            bad.append(f"{f.path / e['name']} does not match its {digest}")
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
    res = snap.facts["load"]
    how = f"{f.load_why}: " if f.load_why else ""
    if not res.get("loaded"):
        return Verdict(Status.FAILED, how + str(res.get("error", "did not load")))
    if res.get("nonfinite"):
        return Verdict(Status.FAILED, f"{how}non-finite values in {res['nonfinite']}")
    return Verdict(Status.PASSED, f"{how}{res.get('tensors')} tensors loaded, all finite")


def loss_verdict(snap: Snapshot, exp: Expectations) -> Verdict:
    f = _gathered(snap)
    if exp.data_dir is None:
        return Verdict(Status.SKIPPED, "no dataset given (optional check)")
    if not snap.facts["load"].get("loaded"):
        return Verdict(Status.SKIPPED, "checkpoint did not load")
    recorded = (f.manifest or {}).get("loss")
    got = snap.facts["load"].get("heldout_loss")
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
    rows = [{**r.to_dict(), "required": r.required} for r in results]
    return CheckpointReport(
        status="failed" if any(blocks(r) for r in results) else "passed",
        path=str(f.path),
        step=(f.manifest or {}).get("step"),
        checks=rows,
        hash_mb_s=None if f.hash_mb_s is None else round(f.hash_mb_s, 1),
        params_sha256=(f.load or {}).get("params_sha256"),
    )


def consolidate(
    path: Path,
    out: Path,
    *,
    pretrained_out: Path | None = None,
    workload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the checkpoint's full model weights as one safetensors file and, when the workload
    has one, its own self-contained layout (an HF directory for Llama) (fresh process, one CPU
    rank). Returns ``{path, bytes, sha256, params_sha256, pretrained}``."""
    res = _fresh_process_load(
        path, Expectations(workload=workload), safetensors_out=out, pretrained_out=pretrained_out
    )
    if not res.get("loaded") or "safetensors" not in res:
        raise RuntimeError(f"consolidating {path} failed: {res.get('error')}")
    return {
        **res["safetensors"],
        "params_sha256": res["params_sha256"],
        "pretrained": res.get("pretrained"),
    }


def validate_checkpoint(path: Path, exp: Expectations, *, load: bool = True) -> CheckpointReport:
    return judge(gather(path, exp, load=load), exp)
