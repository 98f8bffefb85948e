"""Real-process helpers: run the trainer under ft_launcher, torchrun-free single processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.checkpointing.config import (
    CheckpointConfig,
    DurableConfig,
    MemoryConfig,
    ResumePolicy,
)
from trainer.checkpointing.layout import NODE_MEMORY_ENV
from trainer.config import InJobConfig, InProcessConfig, TrainConfig, save_config
from trainer.event_types import Event
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args
from trainer.launch import worker_env as launch_env
from trainer.rundir import read_events as typed_events

REPO = Path(__file__).resolve().parents[1]

# Short timeouts so that drills detect faults in seconds, still nested as arch §2 requires:
# pg < soft < hard < ft_launcher heartbeat.
FAST_INPROCESS = InProcessConfig(
    pg_timeout_s=2.0,
    soft_timeout_s=4.0,
    hard_timeout_s=8.0,
    heartbeat_timeout_s=6.0,
    barrier_timeout_s=30.0,
    completion_timeout_s=30.0,
)
FAST_INJOB = InJobConfig(
    # Pinned short, so that the drills' faults are detected in seconds: the step timeout a
    # ceiling the learned one stays under, the others fixed. The checkpoint section (and the
    # backstop over it) covers the async writer's start-up (the first save after a (re)start,
    # or the final one of a resume a few steps before the end, waits for a spawned interpreter
    # importing torch, 12-25 s on 2 loaded cores). The auto path (every timeout learned) runs
    # in test_fault_drills (LEARNING_INJOB) and in every pipeline test (the run form's
    # defaults); pinned here, the suite does not wait 30 s of allowance per detected stall.
    startup_allowance_s=30.0,
    step_timeout_s=4.5,
    heartbeat_timeout_s=30.0,
    initial_heartbeat_timeout_s=60.0,
    checkpoint_timeout_s=30.0,
    load_timeout_s=12.0,
    out_of_section_timeout_s=12.0,
)
# Every timeout auto, as a user's run has them, with a start-up allowance of 30 s.
AUTO_INJOB = InJobConfig(startup_allowance_s=30.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port P with P+1 free too (the flow's metrics endpoint and rank 0's), below the
    ephemeral range."""
    import random

    for _ in range(200):
        port = random.randrange(23000, 29000, 2)
        ok = True
        for p in (port, port + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no free pair of ports")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, *, timeout: float = 2.0) -> Samples:
    """One Prometheus scrape over HTTP, parsed by prometheus_client's own text parser:
    {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def free_s3_port() -> int:
    """A port for a SeaweedFS server whose derived ports (master +1, volume +2, filer +3, admin
    +4, and gRPC 10000 above each) are all free too; below the ephemeral range, so no client
    connection takes one of them while it starts."""
    import random

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(200):
        port = random.randrange(12000, 22000)
        if all(bindable(port + d + g) for d in range(5) for g in (0, 10000)):
            return port
    raise RuntimeError("no free port set for a SeaweedFS server")


@dataclass(frozen=True)
class SmallCheckpoint:
    path: Path  # a committed checkpoint directory
    params_sha256: str  # the run's, at the checkpoint's step (its last)


def ckpt(
    interval: int = 5,
    *,
    memory: int | str = 1,
    keep_last: int = 3,
    resume: ResumePolicy = ResumePolicy.AUTO,
    verify: bool = True,
    timeout_s: float = 300.0,
) -> CheckpointConfig:
    """A checkpoint config, tersely: a durable save every ``interval`` steps, a memory save
    every ``memory`` (0: no memory tiers)."""
    return CheckpointConfig(
        durable=DurableConfig(
            interval=interval, keep_last=keep_last, timeout_s=timeout_s, verify_on_resume=verify
        ),
        memory=MemoryConfig(interval=memory),
        resume=resume,
    )


def as_pre_v2_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Rewrite a committed checkpoint's manifest the way commits wrote it before manifest v2
    (format nvrx-ckpt-v1, every file's sha256, read back from disk): what checkpoints already on
    the shared filesystem hold. Returns the manifest written."""
    path = ckpt / "manifest.json"
    man = json.loads(path.read_text())
    files = [
        {
            "name": e["name"],
            "bytes": e["bytes"],
            "sha256": hashlib.sha256((ckpt / e["name"]).read_bytes()).hexdigest(),
        }
        for e in man["files"]
    ]
    old = {**man, "format": "nvrx-ckpt-v1", "digest": "sha256", "files": files}
    path.write_text(json.dumps(old, indent=1, sort_keys=True))
    return old


def vouch_for(ckpt: Path, name: str, data: bytes) -> None:
    """Write ``data`` as the checkpoint's file ``name`` and make its manifest vouch for it (size
    and digest, in the manifest's own algorithm): a consistent pair, what a writer of other
    bytes leaves, or anyone who can write the checkpoint (the digests are no signature)."""
    from trainer.checkpointing.manifest import read_manifest
    from trainer.hashing import new_hasher

    digest = read_manifest(ckpt).digest
    (ckpt / name).write_bytes(data)
    path = ckpt / "manifest.json"
    man = json.loads(path.read_text())
    h = new_hasher(digest)
    h.update(data)
    for e in man["files"]:
        if e["name"] == name:
            e["bytes"], e[digest] = len(data), h.hexdigest()
    path.write_text(json.dumps(man, indent=1, sort_keys=True))


def make_config(run_root: Path, data_dir: Path, **overrides: Any) -> TrainConfig:
    base = TrainConfig(
        run_root=run_root,
        data_dir=data_dir,
        steps=20,
        checkpoint=ckpt(5),
        inprocess=FAST_INPROCESS,
        injob=FAST_INJOB,
    )
    return replace(base, **overrides)


def write_config(cfg: TrainConfig) -> Path:
    """The config file the workers read, beside the run directory."""
    return save_config(cfg, cfg.run_root.parent / f"{cfg.run_root.name}.config.json")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def read_events(run_root: Path) -> list[dict[str, Any]]:
    """The run's valid events as the JSON objects their lines hold (decoded by the product's one
    decoder, :func:`trainer.rundir.read_events`): what tests assert was written."""
    return [e.model_dump(mode="json", exclude_unset=True) for e in typed_events(run_root)]


def assert_handed_off(events: list[dict[str, Any]], fault: dict[str, Any]) -> None:
    """A node evicted with notice (trainer.notice) handed off: every rank heard the notice at
    one step, no earlier than the step in flight when the eviction came, and saved it durably
    before the node left; the job went on from exactly that step (nothing before it replayed)."""
    [handoff] = [e for e in events if e["kind"] == "handoff"]
    before = max(e["step"] for e in events if e["kind"] == "step" and e["t"] < fault["t"])
    assert handoff["step"] >= before and handoff["leaving"] >= 1, (handoff, before)
    commits = {e["step"] for e in events if e["kind"] == "checkpoint" and e["step"] >= before}
    assert handoff["path"] and handoff["step"] in commits, "committed"
    loaded = [
        e for e in events if e["kind"] == "resume" and e["action"] == "loaded"
        and e["t"] > handoff["t"]
    ]  # fmt: skip
    assert loaded and loaded[0]["step"] == handoff["step"], (loaded[:1], handoff)


@dataclass
class RunOutcome:
    returncode: int
    log: str
    result: dict[str, Any] | None
    typed: list[Event]  # as the product's readers receive them

    @property
    def events(self) -> list[dict[str, Any]]:
        return [e.model_dump(mode="json", exclude_unset=True) for e in self.typed]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def _outcome(cfg: TrainConfig, rc: int, log: str) -> RunOutcome:
    path = cfg.run_root / "result.json"
    result = json.loads(path.read_text()) if path.exists() else None
    return RunOutcome(rc, log, result, typed_events(cfg.run_root))


def _run(argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run in a new session and kill the whole session afterwards: a SIGKILLed trainer outside
    ft_launcher leaves its checkpoint writer behind, which must not outlive the test."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**worker_env(), **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ft_launcher(cfg: TrainConfig, nproc: int, tag: str) -> tuple[list[str], Path, dict[str, str]]:
    spec = LaunchSpec(
        nnodes=1,
        nproc_per_node=nproc,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_id=cfg.run_root.name + tag,
    )
    config = write_config(cfg)
    argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, config))
    log_path = cfg.run_root.parent / f"{cfg.run_root.name}{tag}.log"
    # The one node's memory (trainer.checkpointing.node_copy): kept across its respawns, as
    # the local backend keeps a simulated node's.
    memory = cfg.run_root.parent / f"{cfg.run_root.name}{tag}.node-memory"
    return argv, log_path, {**launch_env(config), NODE_MEMORY_ENV: str(memory)}


def run_ft_launcher(
    cfg: TrainConfig,
    *,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    tag: str = "",
) -> RunOutcome:
    argv, log_path, launch = _ft_launcher(cfg, nproc, tag)
    rc = _run(argv, log_path, timeout, {**launch, **(env or {})})
    return _outcome(cfg, rc, log_path.read_text())


def start_ft_launcher(
    cfg: TrainConfig, *, nproc: int = 2, env: dict[str, str] | None = None, tag: str = ""
) -> subprocess.Popen[bytes]:
    """As :func:`run_ft_launcher`, without waiting: the caller owns the session (kill it with
    ``os.killpg(proc.pid, SIGKILL)``)."""
    argv, log_path, launch = _ft_launcher(cfg, nproc, tag)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**worker_env(), **launch, **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )


def run_single(cfg: TrainConfig, *, timeout: float = 180) -> RunOutcome:
    """One process, world size 1, no launcher (the debugging mode)."""
    config = write_config(cfg)
    argv = [sys.executable, *trainer_args(cfg, config)]
    log_path = cfg.run_root.parent / f"{cfg.run_root.name}.log"
    rc = _run(argv, log_path, timeout, launch_env(config))
    return _outcome(cfg, rc, log_path.read_text())


# A user's workload in a module of its own: its own model, block and options, nothing from this
# repository but the workload API (the tests write it to a temporary directory).
OUTSIDE_WORKLOAD = """
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.workload import WorkloadSpec


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(32, ge=8)
    vocab: int = Field(512, ge=2)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Mlp(nn.Module):
    def __init__(self, o):
        super().__init__()
        self.emb = nn.Embedding(o.vocab, o.width)
        self.blocks = nn.ModuleList(Block(o.width) for _ in range(2))
        self.head = nn.Linear(o.width, o.vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(o, device):
    with device:
        return Mlp(o)


def loss(model, inputs, targets):
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


spec = WorkloadSpec(
    name="outside-mlp",
    options=Options,
    build_model=build,
    block_classes=lambda o: (Block,),
    loss=loss,
    vocab_size=lambda o: o.vocab,
    seq_len=lambda o: 32,
)
"""


def lease_holder(run_root: Path, run_id: str) -> subprocess.Popen[str]:
    """A process holding the run's lease (an invocation's flow process, as it was); kill it to
    leave the lease an evicted or SIGKILLed flow runner leaves."""
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from tasks.ownership.lease import RunLease\n"
        f"RunLease(Path({str(run_root)!r}), {run_id!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def readme_glossary() -> str:
    """The README's "Reading the report and `status`" section: where every figure they print
    is defined (issue 27)."""
    text = (REPO / "README.md").read_text()
    start = text.index("### Reading the report and `status`")
    return text[start : text.index("\n## ", start)]


def figures_in_report(md: str) -> list[str]:
    """What a run report prints a figure under: its bullet labels, the time breakdown's rows
    and the fault table's columns."""
    from flows.report import TIME_PARTS

    labels = ["ETTR", "wall time"]
    if "## Where the train stage's time went" in md:
        labels += [label for _, label in TIME_PARTS]
    for line in md.splitlines():
        if line.startswith("| fault |"):
            labels += [c.strip() for c in line.strip("|").split("|") if c.strip()][1:]
    return labels


def assert_figures_defined(labels: list[str]) -> None:
    glossary = readme_glossary()
    undefined = [label for label in labels if f"**{label}**" not in glossary]
    assert not undefined, f"printed but not defined in the README's glossary: {undefined}"


def small_trained_model(seed: int) -> tuple[Any, Any]:
    """A two-layer model and its AdamW after one step (optimizer state present): what a memory
    tier or a peer copy saves, in microseconds."""
    import torch  # here: most users of these helpers start processes, not models

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.8, 0.95))
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    return m, o
