"""``nvrx-pipeline``: run the pipeline, serve its deployments, validate, export or pull a
checkpoint, prepare a dataset, apply the automations. Every command's usage and exit codes are
in its ``--help`` (:data:`EXIT_CODES`); with ``--json`` the last line of stdout is one JSON
object (the ``PipelineResult`` for ``run``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from flows.models import PipelineParams, PipelineResult

EXIT_FAILED = 1
EXIT_USAGE = 2

# What each command's exit status means: its --help lists them, and the top-level --help all.
EXIT_CODES: dict[str, dict[int, str]] = {
    "run": {
        0: "the run completed (checkpoint validated, export verified)",
        1: "the pipeline failed: the cause on stderr (--json: the PipelineResult)",
        2: "bad parameters: the field and the fix on stderr",
    },
    "params": {0: "the parameters printed", 2: "no parameter matches NAME"},
    "render-k8s": {0: "the manifests printed", 2: "bad parameters"},
    "serve": {0: "stopped (Ctrl-C)", 1: "the Prefect server failed", 2: "bad default parameters"},
    "up": {0: "both servers up (their addresses printed)", 1: "a server did not start"},
    "down": {0: "stopped (or nothing was up)"},
    "validate": {
        0: "every check passed",
        1: "a check failed: the report names it and the file",
        2: "bad usage (no such directory, a bad --workload)",
    },
    "export": {
        0: "exported and verified against the manifest",
        1: "the export failed",
        2: "bad usage",
    },
    "pull": {
        0: "pulled and verified",
        1: "the pull failed or did not verify (DIR left as it was)",
        2: "bad usage (S3_URI not an S3 URI, DIR not empty and not this export)",
    },
    "status": {
        0: "the summary printed",
        2: "no events for that run (pass --state-dir or --run-root)",
    },
    "runs": {0: "the list printed (empty: no run under that root)"},
    "automations": {
        0: "applied (or printed, with --dry-run)",
        1: "the Prefect server refused them or could not be reached",
        2: "a bad automations file or flag",
    },
    "prepare-dataset": {
        0: "written (and uploaded)",
        1: "the upload failed",
        2: "bad input: error: <field>: <message>",
    },
}


def _exit_codes(command: str) -> str:
    return "exit codes:\n" + "\n".join(
        f"  {code}  {what}" for code, what in EXIT_CODES[command].items()
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{d} {of(d)}" for d in ("torch", "nvidia-resiliency-ext", "prefect"))
    return f"nvrx-pipeline {of('nvrx-pipeline')} ({parts})"


def _set_dotted(d: dict[str, Any], key: str, raw: str) -> None:
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def load_params_dict(
    config: Path | None, sets: list[str], inject: list[str], run_id: str | None
) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if config is not None:
        text = config.read_text()
        if config.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{config}: expected a mapping of parameters")
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected key=value (dotted keys for nested fields)")
        _set_dotted(data, key.strip(), value.strip())
    if inject:
        drills = data.setdefault("drills", {})
        drills["faults"] = [*drills.get("faults", []), *inject]
    if run_id:
        data["run_id"] = run_id
    return data


def format_validation_error(e: ValidationError) -> str:
    from flows.param_docs import did_you_mean

    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            near = did_you_mean(loc)
            msg = f"no such parameter{f' (did you mean {near}?)' if near else ''}"
            msg += "; `nvrx-pipeline params` lists them all"
        lines.append(f"  {loc}: {msg}")
    return "invalid parameters:\n" + "\n".join(lines)


class _LiveProgress:
    """Tails the run's step events: a progress bar on a terminal, a line every 10 steps
    otherwise. Faults, restarts and recoveries are the flow's log lines alone (printing them
    here too showed each twice)."""

    def __init__(self, run_root: Path, target: int, tty: bool) -> None:
        self.run_root, self.target, self.tty = run_root, target, tty
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _LiveProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        from trainer.event_read import EventReader

        path = self.run_root / "events.jsonl"
        tail = EventReader(path, from_start=False)
        out = sys.stderr
        if self.tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} steps"),
                TimeElapsedColumn(),
                transient=False,
            ) as bar:
                task = bar.add_task("training", total=self.target)
                while not self.stop.wait(0.5):
                    for e in tail.read_new_dicts():
                        if e["kind"] == "step":
                            bar.update(
                                task,
                                completed=e["step"],
                                description=f"training loss {e['loss']:.3f} "
                                f"{e.get('tokens_per_s', 0):,.0f} tok/s",
                            )
            return
        while not self.stop.wait(1.0):
            for e in tail.read_new_dicts():
                if e["kind"] == "step" and (e["step"] % 10 == 0 or e["step"] == self.target):
                    print(
                        f"step {e['step']}/{self.target} loss {e['loss']:.4f} "
                        f"{e.get('tokens_per_s', 0):.0f} tok/s",
                        file=out,
                        flush=True,
                    )


def params_from_args(
    args: argparse.Namespace, *, inject: list[str], deployment: bool = False, **forced: Any
) -> PipelineParams | None:
    """PipelineParams from --config/--set/--run-id (+ forced fields); None after printing why
    the parameters are invalid. ``deployment``: defaults of a deployment, which name no run."""
    from flows.models import PipelineParams, new_run_id

    try:
        data = load_params_dict(args.config, args.set, inject, getattr(args, "run_id", None))
        for flag in ("state_dir", "s3_endpoint"):  # run's own spellings of two parameters
            if getattr(args, flag, None) is not None:
                data[flag] = getattr(args, flag)
        local = data.get("backend", "local") == "local"
        if args.command == "run" and local and "s3_endpoint" not in data:
            from tasks.storage.local_s3 import kept_endpoint

            # The S3 server `up` keeps for this state directory, on whatever port it has.
            kept = kept_endpoint(Path(str(data.get("state_dir") or ".state")))
            if kept is not None:
                data["s3_endpoint"] = kept
        data.update(forced)
        if deployment:
            if data.get("run_id"):
                # Every run of the deployment would share it; each later one would resume the first.
                raise ValueError("run_id: a deployment default cannot name the run; set it per run")
        else:
            data.setdefault("run_id", new_run_id())  # known up front: progress tails its events
        return PipelineParams(**data)
    except ValidationError as e:
        print(f"error: {format_validation_error(e)}", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_run(args: argparse.Namespace) -> int:
    from flows.context import RunContext
    from flows.models import PipelineResult

    params = params_from_args(args, inject=args.inject)
    if params is None:
        return EXIT_USAGE
    ctx = RunContext.create(params)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not os.environ.get("PREFECT_API_URL"):
        from tasks.local_services import kept_prefect_api

        # The state directory's kept server (`nvrx-pipeline up`): the run, its report and
        # artifacts stay in its UI; without one Prefect starts a temporary server.
        kept = kept_prefect_api(Path(params.state_dir))
        if kept is not None:
            os.environ["PREFECT_API_URL"] = kept
            print(
                f"Prefect server: {kept.removesuffix('/api')} (nvrx-pipeline up)", file=sys.stderr
            )
    from flows.pipeline import training_pipeline

    status = 0
    started = time.time()
    # SIGTERM (a scheduler, `kill`, Prefect cancelling the process) unwinds like Ctrl-C, so the
    # run ends what it started and gives its lease back (arch §6); SIGKILL is what the next
    # invocation's takeover is for.
    signal.signal(signal.SIGTERM, _interrupt)
    with _LiveProgress(ctx.run_root, params.steps, sys.stderr.isatty()):
        # (``**fields`` in the flow's signature hides Prefect's return_state overload from mypy)
        state = cast(
            "State[PipelineResult]",
            training_pipeline(**params.flow_parameters(), return_state=True),
        )
    if state.is_completed():
        result = state.result()
    else:
        status = EXIT_FAILED
        saved = ctx.run_root / "pipeline_result.json"
        # Only this invocation's: a refused second invocation must not report the owner's.
        if saved.exists() and saved.stat().st_mtime >= started:
            result = PipelineResult.model_validate_json(saved.read_text())
        else:
            result = PipelineResult(
                status="failed", run_id=ctx.run_id, target_steps=params.steps, error=state.message
            )
        print(f"error: pipeline failed: {result.error or state.message}", file=sys.stderr)
    if args.json:
        print(result.model_dump_json(), flush=True)
    else:
        from flows.report import REPORT_FILE, render_report

        print(render_report(result))
        saved = ctx.run_root / REPORT_FILE
        if saved.exists() and saved.stat().st_mtime >= started:
            print(f"report saved: {saved} (the timeline: {ctx.run_root / 'timeline.png'})")
    return status


def cmd_validate(args: argparse.Namespace) -> int:
    from tasks.validation.checkpoint import Expectations, validate_checkpoint

    if not args.path.is_dir():
        print(f"error: {args.path} is not a checkpoint directory", file=sys.stderr)
        return EXIT_USAGE
    # The workload, batch and seed come from the checkpoint's own manifest unless overridden.
    workload = (
        None if args.workload is None else {"ref": args.workload, "options": args.workload_options}
    )
    exp = Expectations(workload=workload, data_dir=args.data_dir)
    report = validate_checkpoint(args.path, exp)
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        print(f"{report.status.upper()}: {report.path} (step {report.step})")
        for c in report.checks:
            print(f"  {c['status']:<8} {c['name']}: {c['detail']}")
    return 0 if report.passed else EXIT_FAILED


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError
    from tasks.export import ExportOptions, export_checkpoint
    from tasks.storage.s3 import S3Settings, boto3_client, parse_s3_uri

    try:
        bucket, prefix = parse_s3_uri(args.s3_uri)
        settings = S3Settings(endpoint_url=args.endpoint or os.environ.get("AWS_ENDPOINT_URL"))
        report = export_checkpoint(
            boto3_client(settings),
            args.path,
            bucket,
            prefix,
            args.run_id or args.path.parent.parent.name,
            endpoint=settings.endpoint_url,
            options=ExportOptions(
                sse=args.sse,
                kms_key_id=args.kms_key_id,
                consolidated=args.consolidated,
                workload=None
                if args.workload is None
                else {"ref": args.workload, "options": args.workload_options},
            ),
        )
    except (PipelineError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        print(
            f"exported {report.uri}: {report.objects} objects ({report.uploaded} uploaded, "
            f"{report.skipped} already there), verified by {report.verification}"
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """An export prefix -> a local directory, verified against its manifest (tasks.pull).
    Exit 2 for a bad S3_URI or a DIR that cannot take it, 1 if the pull fails or does not
    verify (DIR is then left as it was)."""
    from tasks.errors import PipelineError, PullUsageError, StorageError
    from tasks.pull import pull_export
    from tasks.storage.s3 import S3Settings, boto3_client, parse_s3_uri

    try:
        bucket, prefix = parse_s3_uri(args.s3_uri)
    except StorageError as e:
        print(f"error: S3_URI: {e}", file=sys.stderr)
        return EXIT_USAGE
    tty, last = sys.stderr.isatty(), [-1]

    def progress(done: int, total: int, name: str | None) -> None:
        # A terminal gets a line per file; a log, a line every 10 % (mid-file too).
        tenth = 10 * done // max(total, 1)
        if (tty and name is not None) or (not tty and tenth != last[0]):
            last[0] = tenth
            what = f" ({name})" if name else ""
            print(f"pull: {100 * done // max(total, 1):3d}%{what}", file=sys.stderr, flush=True)

    settings = S3Settings(endpoint_url=args.endpoint or os.environ.get("AWS_ENDPOINT_URL"))
    try:
        report = pull_export(
            boto3_client(settings),
            bucket,
            prefix,
            args.dir,
            endpoint=settings.endpoint_url,
            on_progress=progress,
        )
    except PullUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (PipelineError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        how = "downloaded" if report.downloaded else "already there"
        print(
            f"pulled {report.uri} to {report.dir}: step {report.step}, {report.files} files, "
            f"{report.bytes} bytes, verified ({how})"
        )
    return 0


def render_global_batch(data: dict[str, Any]) -> int | None:
    """The global batch ``render-k8s`` uses when the parameters set none: the run form's default
    (8) is sized for the embedded default's world of 2 CPU workers, and an EKS world (nodes x
    eks.gpus_per_node, 16 by default) must divide it, so take the smallest multiple of the
    world that is at least the default. None when the user set one (theirs is validated as
    is) or the world cannot be read (validation then names the bad field)."""
    from flows.models import PipelineParams
    from tasks.backends.eks.params import EksParams

    if "global_batch" in data:
        return None
    raw_eks = data.get("eks")
    eks: dict[str, Any] = raw_eks if isinstance(raw_eks, dict) else {}
    try:
        nodes = int(data.get("nodes", PipelineParams.model_fields["nodes"].default))
        gpus = int(eks.get("gpus_per_node", EksParams.model_fields["gpus_per_node"].default))
    except (TypeError, ValueError):
        return None
    world = nodes * gpus
    if world < 1:
        return None
    default = int(PipelineParams.model_fields["global_batch"].default)
    return world * max(1, -(-default // world))


def cmd_render_k8s(args: argparse.Namespace) -> int:
    import yaml

    from flows.context import eks_train_config
    from tasks.backends.eks.render import render_all

    try:
        data = load_params_dict(args.config, args.set, [], args.run_id)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    batch = render_global_batch(data)
    forced: dict[str, Any] = {"backend": "eks"}
    if batch is not None:
        forced["global_batch"] = batch
    params = params_from_args(args, inject=[], **forced)
    if params is None:
        return EXIT_USAGE
    if batch is not None:
        print(
            f"note: global_batch not set; using {batch}, a multiple of the world size "
            f"{params.world_size} (nodes x eks.gpus_per_node); set global_batch to choose",
            file=sys.stderr,
        )
    run_id = params.run_id or ""
    docs = render_all(
        eks_train_config(params, run_id),
        run_id=run_id,
        attempt=args.attempt,
        nodes=params.max_nodes,
        min_nodes=params.node_range.min,
        spares=params.spares,
        eks=params.eks,
        deadline_s=params.train_timeout_s,
    )
    print(yaml.safe_dump_all(docs, sort_keys=False), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.deployments import serve_all

    defaults = params_from_args(args, inject=[], deployment=True)
    if defaults is None:
        return EXIT_USAGE
    try:
        serve_all(defaults)
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # the server: unreachable, or it refused the deployments
        print(f"error: serving the deployments failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError
    from tasks.local_services import start_prefect
    from tasks.storage.local_s3 import keep_local_s3
    from tasks.storage.s3 import S3Settings

    state = Path(args.state_dir)
    try:
        endpoint = keep_local_s3(S3Settings(endpoint_url=args.s3_endpoint), state)
        api = start_prefect(state, port=args.port)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    ui = api.removesuffix("/api")
    print(f"Prefect UI: {ui} (runs of --state-dir {state} use it; its data in {state}/prefect)")
    print(f"S3: {endpoint} (the demo's data and exports, kept until `nvrx-pipeline down`)")
    print(f"stop both: nvrx-pipeline down --state-dir {state}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from tasks.local_services import stop_prefect
    from tasks.storage.local_s3 import unkeep_local_s3

    state = Path(args.state_dir)
    prefect = stop_prefect(state)
    s3 = unkeep_local_s3(state)
    print(f"Prefect server: {'stopped' if prefect else 'was not running'}")
    print(f"S3 server: {'stopped' if s3 else 'not running, or still used by a run'}")
    return 0


def _owner(run_root: Path) -> dict[str, Any] | None:
    """Who holds the run's lease (arch §6), if anyone."""
    import time as _time

    from tasks.ownership.lease import LEASE_FILE, LeaseRecord, owner_alive

    try:
        rec = LeaseRecord.parse((run_root / LEASE_FILE).read_text())
    except OSError:
        return None
    if rec is None:
        return None
    now = _time.time()
    return {
        "owner": rec.owner.describe(),
        "pid": rec.owner.pid,
        "host": rec.owner.host,
        # By the owner's clock against ours: a hint for a person, never a decision.
        "heartbeat_age_s": round(now - rec.heartbeat_at, 1),
        # On this host, from the process table; on another, not known from one look (the
        # lease's takeover watches its record change instead).
        "alive": owner_alive(rec),
    }


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from flows.models import RUN_ID
    from flows.report import (
        ETTR_DEFINITION,
        SHORT_RUN_NOTE,
        resumed_from,
        time_rows,
        too_short_for_ettr,
    )
    from trainer.history import RunHistory, TimeBreakdown
    from trainer.run_files import read_json_object

    if not RUN_ID.fullmatch(args.run_id):
        print(
            f"error: run_id {args.run_id!r}: lowercase letters, digits and dashes (a run's id, "
            "as `run` printed it)",
            file=sys.stderr,
        )
        return 2
    run_root = args.run_root or Path(args.state_dir) / "fsx" / "runs" / args.run_id
    # A run's directory is named by its id (<fsx>/runs/<id>): another run's directory given
    # with --run-root must not be reported under this id.
    if run_root.resolve().name != args.run_id:
        print(
            f"error: {run_root} is run {run_root.resolve().name!r}, not {args.run_id!r}: pass "
            "that run's id, or the --run-root of this one",
            file=sys.stderr,
        )
        return 2
    if not (run_root / "events.jsonl").exists():
        print(
            f"error: no events for run {args.run_id!r} at {run_root}/events.jsonl; pass "
            "--state-dir (local runs) or --run-root (e.g. /fsx/runs/ID on EKS)",
            file=sys.stderr,
        )
        return 2
    st = RunHistory.read(run_root).status(read_json_object(run_root / "pipeline_result.json"))
    st["owner"] = _owner(run_root)
    if args.json:
        print(json.dumps({"run_id": args.run_id, **st}))
        return 0
    loss = "" if st["loss"] is None else f", loss {st['loss']:.4f}"
    if st["tokens_per_s"] is not None:
        loss += f", {st['tokens_per_s']:.0f} tok/s"
    print(f"run {args.run_id}: {st['state']}")
    if st["owner"] is not None:
        o = st["owner"]
        print(
            f"  owner: {o['owner']}, heartbeat {o['heartbeat_age_s']:.0f} s ago"
            + (
                ""
                if o["alive"] or o["alive"] is None
                else " (gone: the next run of this id takes it over)"
            )
        )
    print(f"  step {st['step']}{loss}")
    if st["stages"]:
        print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in st["stages"].items()))
    for a in st["train_attempts"]:
        print(f"  train attempt {a['attempt']} ({a['backend']}): {a['outcome']}")
    for f in st["faults"]:
        rec = (
            "not recovered"
            if f["recovered_by"] == "none"
            else (f"recovered by {f['recovered_by']} in {f['recovery_s']:.1f} s")
        )
        if f["resume_step"] is not None:
            rec += f", {resumed_from(f['resume_step'])}, {f['replayed_steps']} step(s) replayed"
        print(f"  fault {f['fault']}: {rec}")
    print(
        f"  checkpoints: {st['checkpoints']} committed, latest step {st['latest_checkpoint_step']}"
        + (f", max blocking {st['ckpt_blocking_s_max']:.3f} s" if st["checkpoints"] else "")
    )
    if st["ettr"] is not None:
        print(f"  ETTR: {st['ettr']:.3f} ({ETTR_DEFINITION})")
    if st["time"] is not None:
        time_s = TimeBreakdown(**st["time"])
        print(f"  train attempts {time_s.wall_s:.1f} s:")
        for label, sec, share in time_rows(time_s):
            print(f"    {label:<20} {sec:7.1f} s  {share:4.0%}")
        if too_short_for_ettr(time_s):
            print(f"  {SHORT_RUN_NOTE}")
    if st["export_uri"]:
        print(f"  export: {st['export_uri']}")
    if st["error"]:
        print(f"  error: {st['error']}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from tasks.run_list import list_runs

    root = args.runs_root or Path(args.state_dir) / "fsx" / "runs"
    rows = list_runs(root)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    if not rows:
        print(f"no runs under {root} (pass --state-dir, or --runs-root /fsx/runs on EKS)")
        return 0
    print(f"{'run id':<34} {'state':<12} {'step':>10}  updated")
    for r in rows:
        step = f"{r.step}/{r.target_steps}" if r.target_steps else str(r.step)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.updated))
        owner = f"  (owner {r.owner})" if r.owner else ""
        print(f"{r.run_id:<34} {r.state:<12} {step:>10}  {when}{owner}")
    print(f"details: nvrx-pipeline status RUN_ID --state-dir {args.state_dir}")
    return 0


def cmd_automations(args: argparse.Namespace) -> int:
    import yaml

    from flows.automations import (
        AutomationConfigError,
        apply,
        load,
        resolve,
        resume_parameters,
        stall_ids,
    )

    try:
        if args.dry_run:
            # Dry run: no server to look names up in; a nil id stands in for each one given.
            ids: dict[str, Any] = {
                k: "00000000-0000-0000-0000-000000000000"
                for k, given in _placeholder_flags(args)
                if given
            }
            if args.deployment:
                ids["{resume_parameters}"] = resume_parameters()
            resolved = resolve(load(args.file), {**ids, **stall_ids(args.checkpoint_stall_minutes)})
            print(yaml.safe_dump({"automations": resolved.automations}, sort_keys=False), end="")
            applied: dict[str, str] = {}
            skipped = resolved.skipped
        else:
            applied, skipped = apply(
                path=args.file,
                notify_block=args.notify_block,
                deployment=args.deployment,
                checkpoint_stall_minutes=args.checkpoint_stall_minutes,
            )
    except AutomationConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the server: unreachable, or it refused an automation
        from prefect.settings import PREFECT_API_URL

        print(
            f"error: the Prefect server at {PREFECT_API_URL.value() or '(none configured)'}: "
            f"{type(e).__name__}: {e}; check PREFECT_API_URL and that the server is up",
            file=sys.stderr,
        )
        return EXIT_FAILED
    for name, aid in applied.items():
        print(f"applied {name} ({aid})")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    from flows.param_docs import did_you_mean, format_table, params_docs

    docs = params_docs()
    if args.names:
        picked = [
            d for d in docs if any(d.name == n or d.name.startswith(f"{n}.") for n in args.names)
        ]
        if not picked:
            near = [m for n in args.names if (m := did_you_mean(n, docs))]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            print(f"error: no parameter named {' '.join(args.names)}{hint}", file=sys.stderr)
            return EXIT_USAGE
        docs = picked
    if args.json:
        print(json.dumps([d.__dict__ for d in docs]))
    else:
        print(format_table(docs))
    return 0


def _placeholder_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    return [("{notify_block}", bool(args.notify_block)), ("{deployment}", bool(args.deployment))]


def cmd_prepare_dataset(args: argparse.Namespace) -> int:
    """Token files or JSONL text -> a dataset directory (and, with --s3-uri, its S3 prefix).
    Exit 2 with ``error: <field>: <message>`` for bad input, 1 if the upload fails."""
    from tasks.errors import StorageError
    from tasks.storage.s3 import S3Settings, parse_s3_uri
    from trainer import prepare
    from trainer.data import DataError

    def usage(field: str, message: str) -> int:
        print(f"error: {field}: {message}", file=sys.stderr)
        return EXIT_USAGE

    target = client = None
    if args.s3_uri:
        from tasks.storage.s3 import boto3_client, check_bucket, describe_client_error

        try:
            target = parse_s3_uri(args.s3_uri)
        except StorageError as e:
            return usage("s3_uri", str(e))
        settings = S3Settings(
            endpoint_url=args.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        try:  # before the conversion, which can take a while: the bucket must be there
            client = boto3_client(settings)
            check_bucket(client, target[0], endpoint=settings.endpoint_url)
        except StorageError as e:
            print(f"error: upload: {e}", file=sys.stderr)
            return EXIT_FAILED
    elif args.s3_endpoint:
        return usage("s3_endpoint", "only means something with --s3-uri")
    last = [-1]

    def progress(done: int, total: int, what: str) -> None:  # a line every 10 %
        tenth = 10 * done // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"prepare: {10 * tenth:3d}% ({what})", file=sys.stderr, flush=True)

    common: dict[str, Any] = {"dtype": args.dtype, "progress": progress}
    if args.shard_tokens is not None:
        common["shard_tokens"] = args.shard_tokens
    try:
        if args.tokenizer is not None:
            if args.input_dtype is not None:
                return usage("input_dtype", "is for token files; JSONL is tokenized (--tokenizer)")
            manifest = prepare.from_jsonl(
                args.inputs,
                args.out,
                tokenizer_json=args.tokenizer,
                text_field=args.text_field,
                append_eos=not args.no_eos,
                eos_id=args.eos_id,
                vocab_size=args.vocab_size,
                **common,
            )
        else:
            if args.vocab_size is None:
                return usage(
                    "vocab_size",
                    "token files need --vocab-size (the tokenizer's vocabulary size); "
                    "JSONL text needs --tokenizer",
                )
            for flag, given in (
                ("--text-field", args.text_field != "text"),
                ("--eos-id", args.eos_id is not None),
                ("--no-eos", args.no_eos),
            ):
                if given:
                    return usage(flag.lstrip("-").replace("-", "_"), "needs --tokenizer")
            manifest = prepare.from_token_files(
                args.inputs,
                args.out,
                vocab_size=args.vocab_size,
                input_dtype=args.input_dtype,
                **common,
            )
    except prepare.PrepareError as e:
        return usage(e.field, e.message)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    summary: dict[str, Any] = {
        "dir": str(args.out),
        "dtype": manifest["dtype"],
        "vocab_size": manifest["vocab_size"],
        "files": len(manifest["files"]),
        "tokens": manifest["total_tokens"],
        "source": manifest["source"]["kind"],
    }
    if target is not None:
        from tasks.hydrate import upload_dataset

        bucket, prefix = target
        try:
            objects = upload_dataset(client, args.out, bucket, prefix)
        except Exception as e:  # boto3/botocore errors: one line with the cause
            why = describe_client_error(e, bucket=bucket, endpoint=settings.endpoint_url)
            print(f"error: upload: {why}", file=sys.stderr)
            return EXIT_FAILED
        summary.update(uri=f"s3://{bucket}/{prefix}", objects=objects)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(
            f"wrote {summary['dir']}: {summary['files']} shards, {summary['tokens']} "
            f"{summary['dtype']} tokens (vocab_size {summary['vocab_size']})"
        )
        if target is not None:
            print(f"uploaded {summary['uri']} ({summary['objects']} objects)")
    return 0


def _command(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with its exit codes."""
    return sub.add_parser(  # type: ignore[no-any-return]
        name,
        epilog=_exit_codes(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvrx-pipeline",
        description="Fault-tolerant distributed PyTorch training: the pipeline from preflight to "
        "a verified checkpoint in S3, and the tools around it.",
        epilog="exit codes, by command:\n"
        + "\n".join(
            f"  {cmd:<16} "
            + "; ".join(f"{c} {w.split(':')[0].split(' (')[0]}" for c, w in codes.items())
            for cmd, codes in EXIT_CODES.items()
        )
        + "\n\n`nvrx-pipeline COMMAND --help` describes each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)
    run = _command(sub, "run", help="run the whole pipeline")
    run.add_argument("--config", type=Path, help="YAML or JSON file of PipelineParams")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter (dotted keys: dataset.bucket=...)",
    )
    run.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault drill, e.g. node-loss@step=9,node=1",
    )
    run.add_argument("--run-id", help="name the run; an existing id resumes it")
    # The same spellings as status, export, pull and prepare-dataset (each sets its parameter).
    run.add_argument(
        "--state-dir", help="the state_dir parameter: local state (FSx, S3 data, runs; .state)"
    )
    run.add_argument(
        "--s3-endpoint", help="the s3_endpoint parameter (a local one is started on demand)"
    )
    run.add_argument("--json", action="store_true", help="print the PipelineResult as JSON last")
    run.epilog = (
        "parameters: `nvrx-pipeline params` lists every one with its default and description;\n"
        "examples/params/ holds a params file per backend (--config).\n\n" + (run.epilog or "")
    )
    run.set_defaults(fn=cmd_run)
    par = _command(
        sub,
        "params",
        help="list every run parameter with its default and description",
        description="Every run parameter: its dotted name (what --set and a --config file's "
        "nesting take), type, default and description.",
    )
    par.add_argument("names", nargs="*", metavar="NAME", help="only these (a group: dataset)")
    par.add_argument("--json", action="store_true", help="a JSON list instead of text")
    par.set_defaults(fn=cmd_params)
    rk = _command(sub, "render-k8s", help="print the EKS train-stage manifests as YAML")
    rk.add_argument("--config", type=Path, help="YAML or JSON file of PipelineParams")
    rk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rk.add_argument("--run-id", help="run id (default: a new one)")
    rk.add_argument("--attempt", type=int, default=1, help="train-stage attempt (names the Job)")
    rk.set_defaults(fn=cmd_render_k8s)
    serve = _command(sub, "serve", help="serve the deployments (schedules included)")
    serve.add_argument("--config", type=Path, help="YAML or JSON file: the deployments' defaults")
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a default parameter of both deployments (the UI form starts from these)",
    )
    serve.set_defaults(fn=cmd_serve)
    up = _command(
        sub,
        "up",
        help="keep a local Prefect server (the UI) and the S3 server up across runs",
        description="Start, for a state directory, a Prefect server (UI and artifacts, its "
        "database under STATE_DIR/prefect) and the embedded S3 server, and keep them up after "
        "each run ends, until `down`. `run` with the same --state-dir uses them.",
    )
    up.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    up.add_argument("--port", type=int, default=4200, help="the Prefect server's port (4200)")
    up.add_argument("--s3-endpoint", default="http://127.0.0.1:8333", help="the S3 server's")
    up.set_defaults(fn=cmd_up)
    down = _command(sub, "down", help="stop what `up` started")
    down.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    down.set_defaults(fn=cmd_down)
    val = _command(sub, "validate", help="validate a committed checkpoint directory")
    val.add_argument("path", type=Path)
    val.add_argument(
        "--workload", help="workload that wrote it (default: the one its manifest names)"
    )
    val.add_argument(
        "--workload-options", type=json.loads, default={}, help="with --workload: JSON object"
    )
    val.add_argument("--data-dir", type=Path, help="dataset: enables the held-out loss check")
    val.add_argument("--json", action="store_true")
    val.set_defaults(fn=cmd_validate)
    exp = _command(sub, "export", help="export a committed checkpoint to S3")
    exp.add_argument("path", type=Path)
    exp.add_argument("s3_uri")
    exp.add_argument("--run-id")
    exp.add_argument(
        "--s3-endpoint",
        dest="endpoint",
        help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)",
    )
    # The old spelling still works; one spelling (--s3-endpoint, like prepare-dataset and the
    # s3_endpoint parameter) is shown.
    exp.add_argument("--endpoint", dest="endpoint", help=argparse.SUPPRESS)
    exp.add_argument("--sse", choices=["AES256", "aws:kms"], help="server-side encryption")
    exp.add_argument("--kms-key-id", help="KMS key id or ARN (with --sse aws:kms)")
    exp.add_argument(
        "--consolidated",
        action="store_true",
        help="also export the full weights as one model.safetensors",
    )
    exp.add_argument(
        "--workload",
        help="with --consolidated: workload that wrote it (default: the built-in its manifest "
        "names; a package.module:attr workload must be named here)",
    )
    exp.add_argument(
        "--workload-options", type=json.loads, default={}, help="with --workload: JSON object"
    )
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(fn=cmd_export)
    pull = _command(
        sub,
        "pull",
        help="download an export from S3 into a directory, verified against its manifest",
        description="Download the export at S3_URI (s3://bucket/prefix/<run_id>/step_<N>/) into "
        "DIR, every file checked against the export's manifest.json (size and sha256). It lands "
        "in a hidden directory beside DIR and is renamed to DIR only once it verifies. DIR must "
        "be absent or empty, or already hold the same verified export (then nothing is "
        "downloaded).",
    )
    pull.add_argument("s3_uri", metavar="S3_URI", help="the export prefix")
    pull.add_argument("dir", metavar="DIR", type=Path, help="directory to create (or empty one)")
    pull.add_argument(
        "--s3-endpoint",
        dest="endpoint",
        help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)",
    )
    # The old spelling still works; one spelling (--s3-endpoint, like prepare-dataset and the
    # s3_endpoint parameter) is shown.
    pull.add_argument("--endpoint", dest="endpoint", help=argparse.SUPPRESS)
    pull.add_argument("--json", action="store_true", help="print a summary as JSON last")
    pull.set_defaults(fn=cmd_pull)
    stp = _command(sub, "status", help="summarise a run from its events file")
    runs = _command(sub, "runs", help="list the runs of a state directory, newest first")
    runs.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    runs.add_argument("--runs-root", type=Path, help="the runs directory itself (EKS: /fsx/runs)")
    runs.add_argument("--json", action="store_true", help="a JSON list instead of text")
    runs.set_defaults(fn=cmd_runs)
    stp.add_argument("run_id")
    stp.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    stp.add_argument("--run-root", type=Path, help="the run directory itself (EKS: /fsx/runs/ID)")
    stp.add_argument("--json", action="store_true")
    stp.set_defaults(fn=cmd_status)
    auto = _command(sub, "automations", help="Prefect automations for nvrx events")
    auto_sub = auto.add_subparsers(dest="action", required=True)
    ap = auto_sub.add_parser(
        "apply",
        help="create or replace the shipped automations",
        epilog=_exit_codes("automations"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from flows.automations import DEFAULT_FILE

    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="automations YAML")
    ap.add_argument(
        "--notify-block", help="notification block TYPE-SLUG/NAME, e.g. slack-webhook/ops"
    )
    ap.add_argument(
        "--deployment",
        help="the pipeline deployment FLOW/NAME whose runs are resumed on capacity.restored",
    )
    ap.add_argument(
        "--checkpoint-stall-minutes",
        type=float,
        default=30.0,
        metavar="N",
        help="notify when a training run commits no checkpoint for N minutes (30)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print what would be applied")
    ap.set_defaults(fn=cmd_automations)
    prep = _command(
        sub,
        "prepare-dataset",
        help="turn token files (.bin/.npy) or JSONL text into a dataset (optionally upload it)",
        description="Token files (.bin raw tokens, .npy integer arrays) or, with --tokenizer, "
        "JSONL text -> shard_*.bin + dataset.json in --out.",
    )
    prep.add_argument("inputs", nargs="+", type=Path, help="input files, concatenated in order")
    prep.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    prep.add_argument("--tokenizer", type=Path, help="local tokenizer.json: inputs are JSONL")
    prep.add_argument("--text-field", default="text", help="JSONL field with the text (text)")
    prep.add_argument("--eos-id", type=int, help="EOS id after each document (default: found)")
    prep.add_argument("--no-eos", action="store_true", help="no EOS between JSONL documents")
    prep.add_argument("--input-dtype", help="dtype of raw .bin inputs: uint16 or uint32")
    prep.add_argument("--vocab-size", type=int, help="vocabulary size (required for token files)")
    prep.add_argument("--dtype", help="output dtype, uint16 or uint32 (default: smallest fitting)")
    prep.add_argument("--shard-tokens", type=int, help="tokens per output shard (64 Mi)")
    prep.add_argument("--s3-uri", help="also upload the dataset to s3://bucket/prefix")
    prep.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)")
    prep.add_argument("--json", action="store_true", help="print a summary as JSON last")
    prep.set_defaults(fn=cmd_prepare_dataset)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
