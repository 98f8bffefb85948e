"""Checkpoint validation: gather facts about one checkpoint directory once (:func:`gather`), judge
them with pure checks (:func:`judge`), into a :class:`CheckpointReport`.

Checks (each PASSED / FAILED / SKIPPED with why):
1. manifest well-formed; step, world size and config hash consistent with the run;
2. every file present with its size and sha256 (hashed in parallel; MB/s reported);
3. the DCP metadata covers every model and optimizer entry the model config defines, shapes too;
4. loads on CPU in a fresh process on world size 1 (resharding) and every tensor is finite;
5. optional: the loss on a held-out batch is within a tolerance of the loss recorded at that step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.checks import CheckResult, Status
from tasks.validation.load_check import untrusted_workload_message
from trainer import manifest as ckpt_manifest
from trainer.hashing import sha256_file
from trainer.untrusted import METADATA, UnsafeNameError, check_component, load_dcp_metadata

_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What the run says the checkpoint must be; None: not known (the check is SKIPPED)."""

    # {"ref", "options"}: overrides the workload the manifest says wrote the checkpoint.
    workload: dict[str, Any] | None = None
    config_hash: str | None = None
    world_size: int | None = None
    data_dir: Path | None = None  # enables the held-out loss check
    loss_tolerance: float = 0.25  # relative
    load_timeout_s: float = 600.0


@dataclass
class Facts:
    path: Path
    manifest: dict[str, Any] | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size, sha256
    hash_mb_s: float | None = None
    dcp_entries: dict[str, tuple[int, ...] | None] | None = None  # key -> shape (None: bytes)
    expected_entries: dict[str, tuple[int, ...] | None] | None = None
    load: dict[str, Any] | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointReport:
    status: str  # "passed" | "failed"
    path: str
    step: int | None
    checks: list[dict[str, str]]
    hash_mb_s: float | None = None
    params_sha256: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def failed_checks(self) -> list[dict[str, str]]:
        return [c for c in self.checks if c["status"] == Status.FAILED.value]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- gathering (I/O) --------------------------------------------------------------------------
def hash_files(path: Path, names: list[str]) -> tuple[dict[str, dict[str, Any]], float]:
    t0 = time.perf_counter()
    present = [n for n in names if (path / n).is_file()]
    # hashlib releases the GIL on large buffers: threads hash files in parallel.
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        digests = dict(
            zip(present, pool.map(lambda n: sha256_file(path / n), present), strict=True)
        )
    total = sum((path / n).stat().st_size for n in present)
    seconds = time.perf_counter() - t0
    files = {n: {"bytes": (path / n).stat().st_size, "sha256": digests[n]} for n in present}
    return files, (total / 1e6 / seconds if seconds > 0 else 0.0)


_hash_files = hash_files  # the name benchmarks/transfer_throughput.py imports


def expected_entries(workload: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Every DCP key a checkpoint of this workload must hold: the model's parameters with their
    shapes and, with the default AdamW, its state (a workload's own optimizer may keep other
    state, so only the model is checked then)."""
    import torch

    from trainer.workload import adamw, load_workload

    wl = load_workload(workload["ref"], workload.get("options") or {})
    model = wl.build_model(torch.device("meta"))  # meta: initial weights are never read
    out: dict[str, tuple[int, ...] | None] = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = tuple(p.shape)
        if wl.spec.build_optimizer is adamw:
            out[f"optim.state.{name}.exp_avg"] = tuple(p.shape)
            out[f"optim.state.{name}.exp_avg_sq"] = tuple(p.shape)
            out[f"optim.state.{name}.step"] = ()
    return out


def _dcp_entries(path: Path) -> dict[str, tuple[int, ...] | None]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = load_dcp_metadata(path)  # restricted: a forged .metadata cannot run code
    return {
        k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
        for k, v in md.state_dict_metadata.items()
    }


def check_file_names(manifest: dict[str, Any], path: Path) -> None:
    """Every ``files[i].name`` of a checkpoint manifest is a plain file name in ``path``: the
    manifest is untrusted, and its names are joined onto the directory and opened."""
    for i, entry in enumerate(manifest["files"]):
        name = entry.get("name") if isinstance(entry, dict) else None
        if name != METADATA:  # DCP's one dot-file, by its exact name
            check_component(name, where=f"{path / ckpt_manifest.MANIFEST}: files[{i}].name")


# Variables that give a process credentials: the load check needs none, and it reads files that
# anyone with write access to the shared filesystem controls. Every AWS_* variable goes (keys,
# session token, profile, role ARN, web identity token file, container credentials URI and
# token); the SDKs' other sources (~/.aws files, instance metadata) are pointed at nothing.
# Any other variable named like a secret (HF_TOKEN, PREFECT_API_AUTH_STRING, *_PASSWORD,
# GOOGLE_APPLICATION_CREDENTIALS, SSH_AUTH_SOCK...) goes too; the check never needs one.
_SECRET_NAME = re.compile(
    r"(?:.*_)?(?:SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|KEY|CREDENTIALS?|AUTH)(?:_.*)?",
    re.IGNORECASE,
)
_CHILD_OVERRIDES = {
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def child_env(parent: dict[str, str]) -> dict[str, str]:
    """The environment of the load-check process: ``parent`` without credentials and without
    the trainer's distributed settings (it is a world of its own)."""
    env = {
        k: v
        for k, v in parent.items()
        if not k.upper().startswith("AWS_") and not _SECRET_NAME.fullmatch(k)
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NVRX_CONFIG"):
        env.pop(key, None)
    env.update(_CHILD_OVERRIDES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), parent.get("PYTHONPATH")]))
    return env


def _fresh_process_load(
    path: Path,
    exp: Expectations,
    *,
    safetensors_out: Path | None = None,
    pretrained_out: Path | None = None,
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tasks.validation.load_check", str(path)]
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
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=child_env(dict(os.environ)),
        cwd=_REPO,
        timeout=exp.load_timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-800:]
        return {"loaded": False, "error": f"load process exited {proc.returncode}: {tail}"}
    return dict(json.loads(lines[-1]))


def gather(path: Path, exp: Expectations, *, load: bool = True) -> Facts:
    path = Path(path)
    facts = Facts(path=path)
    try:
        facts.manifest = ckpt_manifest.read_manifest(path)
    except ckpt_manifest.CheckpointError as e:
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
    facts.files, facts.hash_mb_s = hash_files(path, names)
    digests_ok = all(
        facts.files.get(e["name"], {}).get("sha256") == e["sha256"] for e in facts.manifest["files"]
    )
    if not digests_ok:
        # The DCP .metadata is a pickle: never read it before the manifest vouched for it.
        facts.errors["dcp"] = "not read: files do not match the manifest"
    else:
        try:
            facts.dcp_entries = _dcp_entries(path)
        except Exception as e:
            # Read and refused (forged or garbled) is a finding about the checkpoint: FAILED.
            facts.errors["dcp_invalid"] = f"{path / METADATA}: {type(e).__name__}: {e}"
    from trainer.workload import safe_to_name_from_file  # imports torch: only when validating

    workload = exp.workload or ckpt_manifest.workload_of(facts.manifest)
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
        return facts
    if workload:
        try:
            facts.expected_entries = expected_entries(workload)
        except Exception as e:
            facts.errors["expected"] = f"workload {workload['ref']!r}: {e}"
    else:
        facts.errors["expected"] = "workload unknown (not in the manifest, none given)"
    if not load:
        facts.errors["load"] = "not requested"
    elif not digests_ok:
        facts.errors["load"] = "skipped: files do not match the manifest"
    elif "dcp_invalid" in facts.errors:
        facts.errors["load"] = "skipped: the DCP metadata was refused"
    elif not workload:
        facts.errors["load"] = "workload unknown"
    else:
        try:
            facts.load = _fresh_process_load(path, exp)
        except subprocess.TimeoutExpired:
            facts.errors["load"] = f"load did not finish in {exp.load_timeout_s} s"
    return facts


# -- judging (pure) ---------------------------------------------------------------------------
Check = Callable[[Facts, Expectations], CheckResult]


def _skip(name: str, why: str) -> CheckResult:
    return CheckResult(name, Status.SKIPPED, why)


def check_manifest(f: Facts, exp: Expectations) -> CheckResult:
    name = "manifest"
    if "manifest" in f.errors:
        return CheckResult(name, Status.FAILED, f.errors["manifest"])
    m = f.manifest or {}
    problems = []
    dir_step = f.path.name.removeprefix("step_")
    if not dir_step.isdigit() or int(dir_step) != m.get("step"):
        problems.append(f"step {m.get('step')} does not match directory {f.path.name}")
    if exp.config_hash is not None and m.get("config_hash") != exp.config_hash:
        problems.append(f"config hash {m.get('config_hash')} != the run's {exp.config_hash}")
    if exp.world_size is not None and m.get("world_size") != exp.world_size:
        problems.append(f"world size {m.get('world_size')} != the run's {exp.world_size}")
    if problems:
        return CheckResult(name, Status.FAILED, "; ".join(problems))
    return CheckResult(
        name,
        Status.PASSED,
        f"step {m['step']}, world size {m['world_size']}, {len(m['files'])} files",
    )


def check_files(f: Facts, exp: Expectations) -> CheckResult:
    name = "files and digests"
    if f.manifest is None or "manifest" in f.errors:
        return _skip(name, f.errors.get("manifest", "no manifest"))
    bad = []
    for e in f.manifest["files"]:
        got = f.files.get(e["name"])
        if got is None:
            bad.append(f"{f.path / e['name']} is missing")
        elif got["bytes"] != e["bytes"]:
            bad.append(f"{f.path / e['name']} is {got['bytes']} bytes, manifest says {e['bytes']}")
        elif got["sha256"] != e["sha256"]:
            bad.append(f"{f.path / e['name']} does not match its sha256")
    if bad:
        return CheckResult(name, Status.FAILED, "; ".join(bad))
    return CheckResult(
        name, Status.PASSED, f"{len(f.files)} files verified at {f.hash_mb_s or 0:.0f} MB/s"
    )


def check_coverage(f: Facts, exp: Expectations) -> CheckResult:
    name = "DCP metadata covers the model and optimizer"
    if "dcp_invalid" in f.errors:
        return CheckResult(name, Status.FAILED, f.errors["dcp_invalid"])
    for source in ("manifest", "dcp", "expected"):
        if source in f.errors:
            return _skip(name, f.errors[source])
    have, want = f.dcp_entries or {}, f.expected_entries or {}
    missing = sorted(k for k in want if k not in have)
    wrong = sorted(k for k, shape in want.items() if k in have and have[k] != shape)
    if missing or wrong:
        detail = []
        if missing:
            detail.append(f"{len(missing)} missing, e.g. {missing[:3]}")
        if wrong:
            detail.append(f"{len(wrong)} with wrong shapes, e.g. {wrong[:3]}")
        return CheckResult(name, Status.FAILED, "; ".join(detail))
    return CheckResult(name, Status.PASSED, f"{len(want)} entries present with their shapes")


def check_load(f: Facts, exp: Expectations) -> CheckResult:
    name = "loads on 1 CPU rank, all tensors finite"
    if "load" in f.errors:
        return _skip(name, f.errors["load"])
    res = f.load or {}
    if not res.get("loaded"):
        return CheckResult(name, Status.FAILED, str(res.get("error", "did not load")))
    if res.get("nonfinite"):
        return CheckResult(name, Status.FAILED, f"non-finite values in {res['nonfinite']}")
    return CheckResult(name, Status.PASSED, f"{res.get('tensors')} tensors loaded, all finite")


def check_loss(f: Facts, exp: Expectations) -> CheckResult:
    name = "held-out loss near the recorded loss"
    if exp.data_dir is None:
        return _skip(name, "no dataset given (optional check)")
    if "load" in f.errors or not (f.load or {}).get("loaded"):
        return _skip(name, "checkpoint did not load")
    recorded = (f.manifest or {}).get("loss")
    got = (f.load or {}).get("heldout_loss")
    if recorded is None:
        return _skip(name, "the manifest records no loss")
    if got is None:
        return CheckResult(name, Status.FAILED, "held-out loss is not finite")
    if abs(got - recorded) > exp.loss_tolerance * abs(recorded):
        return CheckResult(
            name,
            Status.FAILED,
            f"held-out loss {got:.4f} vs recorded {recorded:.4f} "
            f"(tolerance {exp.loss_tolerance:.0%})",
        )
    return CheckResult(name, Status.PASSED, f"held-out {got:.4f} vs recorded {recorded:.4f}")


CHECKS: tuple[Check, ...] = (check_manifest, check_files, check_coverage, check_load, check_loss)


def judge(f: Facts, exp: Expectations) -> CheckpointReport:
    results = [c(f, exp) for c in CHECKS]
    failed = any(r.status == Status.FAILED for r in results)
    return CheckpointReport(
        status="failed" if failed else "passed",
        path=str(f.path),
        step=(f.manifest or {}).get("step"),
        checks=[r.to_dict() for r in results],
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
