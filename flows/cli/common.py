"""What every command shares: exit codes (one table), a subcommand whose --help lists its own,
and the run parameters from --config/--set/--inject/--run-id (validated, errors naming the field
and the fix)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from trainer.worker_cli import set_dotted  # one meaning of --set KEY=VALUE, trainer's too

if TYPE_CHECKING:
    from flows.models import PipelineParams
    from tasks.storage.s3 import S3Settings

EXIT_FAILED = 1
EXIT_USAGE = 2

# What each command's exit status means, in the order of the top-level --help (which lists them
# all; each command's --help, its own).
EXIT_CODES: dict[str, dict[int, str]] = {
    "run": {
        0: "the run completed (checkpoint validated, export verified)",
        1: "the pipeline failed: the cause on stderr (--json: the PipelineResult)",
        2: "bad parameters: the field and the fix on stderr",
    },
    "params": {0: "the parameters printed", 2: "no parameter matches NAME"},
    "render-k8s": {0: "the manifests printed", 2: "bad parameters"},
    "serve": {
        0: "stopped (Ctrl-C)",
        1: "the Prefect server failed",
        2: "bad default parameters",
    },
    "up": {0: "both servers up (their addresses printed)", 1: "a server did not start"},
    "down": {0: "stopped (or nothing was up)"},
    "automations": {
        0: "applied (or printed, with --dry-run)",
        1: "the Prefect server refused them or could not be reached",
        2: "a bad automations file or flag",
    },
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
    "prepare-dataset": {
        0: "written (and uploaded)",
        1: "the upload failed",
        2: "bad input: error: <field>: <message>",
    },
    "weights-digest": {
        0: "the listing and its digest printed",
        1: "the S3 prefix could not be read",
        2: "bad usage (not a directory or s3:// URI, a refused file name, no weight files)",
    },
}


def fail(message: object, code: int) -> int:
    """Print ``error: MESSAGE`` on stderr; return the exit status ``code``."""
    print(f"error: {message}", file=sys.stderr)
    return code


def emit(as_json: bool, data: object, text: str) -> int:
    """Print ``text``, or with --json ``data`` as one JSON object or list, the last line of
    stdout (what scripts parse); exit status 0."""
    print(json.dumps(data) if as_json else text, flush=True)
    return 0


def add_s3_endpoint(parser: argparse.ArgumentParser) -> None:
    """``--s3-endpoint`` (as ``args.endpoint``): one spelling, like prepare-dataset's and the
    s3_endpoint parameter; the old ``--endpoint`` still works, unlisted."""
    parser.add_argument(
        "--s3-endpoint",
        dest="endpoint",
        help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)",
    )
    parser.add_argument("--endpoint", dest="endpoint", help=argparse.SUPPRESS)
    parser.add_argument(
        "--state-dir",
        default=".state",
        type=Path,
        help="a local endpoint that is this state directory's S3 server uses its keys (.state)",
    )


def s3_settings(args: argparse.Namespace) -> S3Settings:
    """The S3 settings of a command with :func:`add_s3_endpoint`'s options."""
    from tasks.storage.local_s3 import settings_for

    return settings_for(args.endpoint or os.environ.get("AWS_ENDPOINT_URL"), args.state_dir)


def add_params_options(
    parser: argparse.ArgumentParser,
    config: str = "YAML or JSON file of PipelineParams",
    overrides: str = "override a parameter (dotted keys: dataset.bucket=...)",
) -> None:
    parser.add_argument("--config", type=Path, help=config)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=overrides)


def command(
    sub: Any, name: str, fn: Callable[[Any], int], codes_of: str | None = None, **kw: Any
) -> argparse.ArgumentParser:
    """A subcommand running ``fn(args)``, whose --help ends with its exit codes (``codes_of``:
    another command's, for a subcommand of a group)."""
    codes = EXIT_CODES[codes_of or name].items()
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        epilog="exit codes:\n" + "\n".join(f"  {code}  {what}" for code, what in codes),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )
    parser.set_defaults(fn=fn)
    return parser


def load_params_dict(
    config: Path | None, sets: list[str], inject: list[str], run_id: str | None
) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if config is not None:
        if config.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(config.read_text()) or {}
        else:
            data = json.loads(config.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{config}: expected a mapping of parameters")
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected key=value (dotted keys for nested fields)")
        set_dotted(data, key.strip(), value.strip())
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
            if (kept := kept_endpoint(Path(str(data.get("state_dir") or ".state")))) is not None:
                data["s3_endpoint"] = kept
        data.update(forced)
        if not deployment:
            data.setdefault("run_id", new_run_id())  # known up front: progress tails its events
        elif data.get("run_id"):
            # Every run of the deployment would share it; each later one would resume the first.
            raise ValueError("run_id: a deployment default cannot name the run; set it per run")
        return PipelineParams(**data)
    except ValidationError as e:
        print(f"error: {format_validation_error(e)}", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
    return None
