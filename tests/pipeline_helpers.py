"""Helpers of the pipeline tests (both backends)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from flows.models import PipelineParams, PipelineResult
from tasks.storage.s3 import S3Settings, boto3_client
from trainer import checkpointing


def make_params(state: Path, s3: S3Settings, **kw: Any) -> PipelineParams:
    base: dict[str, Any] = {
        "state_dir": str(state),
        "s3_endpoint": s3.endpoint_url,
        "steps": 20,
        "nodes": 2,
        "nproc_per_node": 1,
    }
    return PipelineParams(**{**base, **kw})


def run_pipeline(params: PipelineParams) -> tuple[Any, PipelineResult | None]:
    from flows.pipeline import training_pipeline

    state = training_pipeline(**params.flow_parameters(), return_state=True)
    result = state.result(raise_on_failure=False) if state.is_completed() else None
    return state, result


def assert_exported(result: PipelineResult, s3: S3Settings) -> None:
    """Every object of the committed checkpoint is in S3 and its bytes hash to the manifest's:
    the checkpoint's, with every file's sha256 (format v1, what readers outside check)."""
    assert result.export.verified and result.export.uri
    bucket, _, base = result.export.uri.removeprefix("s3://").partition("/")
    client = boto3_client(s3)
    ckpt = Path(result.checkpoint.uri)  # type: ignore[arg-type]
    local = checkpointing.read_manifest(ckpt)
    remote = json.loads(client.get_object(Bucket=bucket, Key=f"{base}manifest.json")["Body"].read())
    # A consolidated export adds what it made (model.safetensors, hf/...) under "consolidated".
    consolidated = remote.pop("consolidated", {})
    shas = {e.name: hashlib.sha256((ckpt / e.name).read_bytes()).hexdigest() for e in local.files}
    assert remote == checkpointing.as_sha256(local, shas)
    made = [{"name": n, **e} for n, e in consolidated.items() if "sha256" in e]
    made += [
        {**f, "name": f"{d}/{f['name']}"}
        for d, e in consolidated.items()
        for f in e.get("files", [])
    ]
    for entry in [*remote["files"], *made]:
        body = client.get_object(Bucket=bucket, Key=f"{base}{entry['name']}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"], entry["name"]
    assert result.export.objects == len(local.files) + len(made) + 1


def nvrx_events(run_id: str, *, expect: str, timeout_s: float = 15.0) -> list[Any]:
    """The Prefect events about run ``run_id`` (oldest first), once ``expect`` is among them
    (the server persists events asynchronously)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(prefix=["nvrx."]),
        resource=EventResourceFilter(id=[f"nvrx.run.{run_id}"]),
    )
    deadline = time.time() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=flt, limit=50)  # the server caps a page at 50
        events = sorted(page.events, key=lambda e: e.occurred)
        if any(e.event == expect for e in events) or time.time() > deadline:
            return events
        time.sleep(0.5)


class Scraper:
    """Scrapes Prometheus endpoints over HTTP every ``every_s`` in a thread while a run goes on
    (a context manager); ``series(url, name, **labels)`` is what the scrapes saw, in order. A
    scrape the endpoint refused (not up yet, or gone) is left out."""

    def __init__(self, *urls: str, every_s: float = 0.1) -> None:
        import threading

        self.urls = urls
        self.every_s = every_s
        self.scrapes: dict[str, list[Any]] = {u: [] for u in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        from tests.helpers import scrape

        while not self._stop.wait(self.every_s):
            for url in self.urls:
                try:
                    self.scrapes[url].append(scrape(url, timeout=1.0))
                except OSError:  # refused, reset, timed out: not serving right now
                    continue

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def series(self, url: str, name: str, **labels: str) -> list[float]:
        from tests.helpers import sample

        values = (sample(s, name, **labels) for s in self.scrapes[url])
        return [v for v in values if v is not None]


class LocalPrometheus:
    """A real Prometheus (Debian's binary) running the shipped local recipe,
    ``deploy/prometheus/prometheus-local.yml`` with its alert rules, its two targets replaced by
    ``flow`` and ``rank0`` (host:port) and scraping every second; a context manager. Its queries
    go to its own HTTP API (``query_range``)."""

    def __init__(self, tmp: Path, *, flow: str, rank0: str) -> None:
        import yaml

        from tests.helpers import REPO, free_port

        src = REPO / "deploy" / "prometheus" / "prometheus-local.yml"
        config = yaml.safe_load(src.read_text())
        config["global"]["scrape_interval"] = "1s"
        config["global"]["evaluation_interval"] = "1s"
        config["rule_files"] = [str(src.parent / f) for f in config["rule_files"]]
        targets = {"nvrx-flow": flow, "nvrx-rank0": rank0}
        assert [j["job_name"] for j in config["scrape_configs"]] == list(targets)
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.data = tmp / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        self._proc: Any = None

    def __enter__(self) -> LocalPrometheus:
        import shutil
        import subprocess
        import time
        import urllib.request

        binary = shutil.which("prometheus")
        assert binary, "prometheus not installed: `make promtool` installs Debian's package"
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self._proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError("prometheus not ready in 30 s: " + self.log.read_text()[-2000:])

    def __exit__(self, *exc: object) -> None:
        import os
        import signal

        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(10)
            except Exception:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[Any]:
        import urllib.parse
        import urllib.request

        q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{q}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])


def clean_rerun(drilled: Path, run_root: Path, *, nodes: int = 2, nproc_per_node: int = 1) -> str:
    """The fault-free reference of a drilled pipeline run, cheaper than a second pipeline run:
    the drilled run's own first-attempt training config (``config/train-attempt1.json``, as the
    flow wrote it) without its faults, trained once more by the train stage's own attempt (the
    watcher, the local backend, real ft_launcher agents as the same simulated nodes) into
    ``run_root``, without preflight, hydration, validation or export. Its ``params_sha256``."""
    import dataclasses

    from tasks.backends.base import LaunchRequest
    from tasks.backends.local import LocalBackend
    from tasks.classify import EndKind
    from tasks.train_stage import run_attempt
    from trainer.config import load_config

    cfg = load_config(drilled / "config" / "train-attempt1.json")
    cfg = dataclasses.replace(cfg, run_root=run_root, faults=())
    request = LaunchRequest(
        run_id=run_root.name,
        attempt=1,
        cfg=cfg,
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        min_nodes=nodes,
        deadline_s=300,
    )
    report = run_attempt(LocalBackend(), request)
    assert report.outcome.kind == EndKind.COMPLETED, report.outcome.message
    result = json.loads((run_root / "result.json").read_text())
    assert result["final_step"] == cfg.steps and result["params_sha256"]
    return str(result["params_sha256"])


def assert_report_and_status(result: PipelineResult, params: Any, state: Path, capsys: Any) -> None:
    """The run report artifact and `nvrx-pipeline status` agree with the events file."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.cli import main
    from flows.context import RunContext
    from flows.report import TIME_PARTS
    from tests.helpers import assert_figures_defined, figures_in_report
    from trainer.history import RunHistory

    history = RunHistory.read(RunContext.create(params).run_root)
    ettr = history.ettr()
    assert ettr is not None and result.ettr == ettr
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["run-report"]))
        )
    [report] = [a for a in arts if f"# Run `{result.run_id}`: completed" in str(a.data)]
    text = str(report.data)
    assert text.index("completed") < text.index("## Stage timeline") < text.index("## Faults")
    assert f"**{ettr:.3f}**" in text
    for f in history.fault_records():
        assert f"| {f.kind} | {f.step} |" in text and f"| {f.recovered_by} |" in text
    # The train stage's wall time in parts that add up to it (issue 27), every figure defined
    # in the README; each recovered fault says where training went back to.
    t = result.train_time
    assert t is not None and t.wall_s > 0 and min(t.model_dump().values()) > -0.01
    parts = t.model_dump()
    assert abs(sum(v for k, v in parts.items() if k != "wall_s") - t.wall_s) < 0.01
    assert t.startup > 0 and t.productive > 0 and t.recovery > 0
    for f in result.faults:
        assert f.recovered_by == "none" or None not in (f.resume_step, f.replayed_steps)
    assert_figures_defined(figures_in_report(text))
    # Saved with the run too: it outlives the Prefect server that holds the artifact.
    run_root = RunContext.create(params).run_root
    assert (run_root / "report.md").read_text().strip() == text.strip()
    assert (run_root / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["status", result.run_id, "--state-dir", str(state)]) == 0
    plain = capsys.readouterr().out
    assert "ETTR:" in plain and all(label in plain for _, label in TIME_PARTS)
    assert main(["status", result.run_id, "--state-dir", str(state), "--json"]) == 0
    st = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert st["state"] == "completed" and st["step"] == params.steps and st["ettr"] == ettr
    assert st["time"] == parts
    assert [f["recovered_by"] for f in st["faults"]] == [f.recovered_by for f in result.faults]
