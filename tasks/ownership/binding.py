"""Which deployment a run belongs to: recorded when the run is first held, checked by every
invocation that comes from a deployment.

A ``run_id`` names a directory on the shared filesystem that every deployment on it can name:
without this record, a run started from one deployment could resume, export or read another's
run. ``<run_root>/deployment.json`` (``trainer.rundir.Layout.DEPLOYMENT``) names the deployment
whose run created the run (or none: the CLI, Python). A run started from a deployment may
continue only a run its own deployment created; one started outside any deployment runs with
its caller's own powers (it could read the directory anyway) and may continue any. A run
directory with no record (made before runs were recorded) is no deployment's: a deployment's run
refuses it.

:func:`check`, before the lease, reads only, so a refused invocation writes nothing into the
other run's directory; :func:`bind`, under the lease, writes the record of a new run once
(``O_EXCL``) and decides again on what it finds, so two deployments racing for a new run id
cannot both have it. :func:`refusal` is the decision, pure.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import PipelineError
from trainer.rundir import Layout

MAX_RECORD_BYTES = 4096


class RunOfAnotherDeployment(PipelineError):
    """The run id names a run this deployment did not create: not resumed, nothing written.
    Not retried (tasks.retry_policy)."""


@dataclass(frozen=True)
class Creator:
    """A deployment (its id and FLOW/DEPLOYMENT name), or none for a run outside any."""

    deployment_id: str | None = None
    deployment: str | None = None

    def describe(self) -> str:
        if self.deployment_id is None:
            return "no deployment (the command line or Python)"
        return f"deployment {self.deployment} ({self.deployment_id})"

    def to_json(self) -> str:
        return json.dumps(
            {"deployment_id": self.deployment_id, "deployment": self.deployment}, sort_keys=True
        )

    @classmethod
    def parse(cls, text: str) -> Creator | None:
        """The record, or None when it is not one (the file is untrusted)."""
        try:
            d = json.loads(text)
            ident, name = d["deployment_id"], d["deployment"]
        except (ValueError, KeyError, TypeError):
            return None
        if not all(v is None or isinstance(v, str) for v in (ident, name)):
            return None
        return cls(ident, name)


def recorded(run_root: Path) -> Creator | bool | None:
    """The run's creator; None: no record; False: a record that cannot be read as one."""
    try:
        fd = os.open(Path(run_root) / Layout.DEPLOYMENT, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        return False
    creator = Creator.parse(raw.decode("utf-8", "replace"))
    return False if creator is None else creator


def refusal(run_id: str, me: Creator, found: Creator | bool | None, exists: bool) -> str | None:
    """Why ``me`` may not continue the run (None: it may). Pure: what the run root holds in,
    a decision out."""
    if me.deployment_id is None or not exists:
        return None  # outside a deployment; or a new run, which this invocation creates
    if isinstance(found, Creator) and found.deployment_id == me.deployment_id:
        return None
    if isinstance(found, Creator):
        whose = f"was created by {found.describe()}"
    elif found is None:
        whose = "has no record of the deployment that created it (made before runs were bound)"
    else:
        whose = f"has an unreadable {Layout.DEPLOYMENT}"
    return (
        f"run_id: run {run_id!r} {whose}; this run comes from {me.describe()}, which may "
        "continue only the runs it created. Use another run_id (or leave it empty for a new "
        "run), or continue that run from its own deployment"
    )


def check(run_root: Path, run_id: str, me: Creator) -> None:
    """Refuse (:class:`RunOfAnotherDeployment`) a run ``me`` did not create; reads only."""
    run_root = Path(run_root)
    why = refusal(run_id, me, recorded(run_root), run_root.exists())
    if why is not None:
        raise RunOfAnotherDeployment(why)


def bind(run_root: Path, run_id: str, me: Creator, *, existed: bool) -> None:
    """Under the run's lease (which made the run root): record ``me`` as the run's creator when
    there is no record and the run is new (or ``me`` is no deployment), then decide as
    :func:`check` does on what the record says now. ``existed``: the run root was there before
    this invocation took the lease."""
    run_root = Path(run_root)
    if recorded(run_root) is None and (not existed or me.deployment_id is None):
        with contextlib.suppress(FileExistsError):
            fd = os.open(
                run_root / Layout.DEPLOYMENT,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                0o644,
            )
            with os.fdopen(fd, "w") as f:
                f.write(me.to_json())
                f.flush()
                os.fsync(f.fileno())
    why = refusal(run_id, me, recorded(run_root), exists=True)
    if why is not None:
        raise RunOfAnotherDeployment(why)
