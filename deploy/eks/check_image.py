"""Every command the EKS Jobs run exists in the image (issue 28, item 3).

The commands come from the code that renders the Jobs (the training Job, fixed-size and
elastic, the hydration Job) and from the work pool template (the flow-run pod), never from a
list kept by hand: a Job that starts running a new tool fails this check until the image has it.

    python deploy/eks/check_image.py --inside         # here: this environment (the image's build
                                                      # runs this, so a broken image never builds)
    python deploy/eks/check_image.py --image IMAGE    # a built image, where Docker runs
    python deploy/eks/check_image.py --dockerfile     # no Docker: the same check read off the
                                                      # Dockerfile (what it installs and copies)

Each finding names the Job, the command and what provides it (or that nothing does). Exit 0 when
every command is found, 1 when one is not, 2 when the check itself cannot run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EKS_DIR = Path(__file__).resolve().parent
REPO = EKS_DIR.parents[1]
# What the base image (NVIDIA's NGC PyTorch container, Ubuntu) has before the Dockerfile adds
# anything: its shell tools and Python with torch. Only these may be used without an install.
BASE_EXECUTABLES = frozenset({"python", "python3", "env", "/usr/bin/env", "sh", "bash"})
BASE_MODULES = frozenset({"torch"})
# The flow-run pod runs the worker's command after the template's: Prefect's own.
PREFECT_WORKER_COMMAND = ["prefect", "flow-run", "execute"]


@dataclass(frozen=True)
class Need:
    """One thing a Job's container runs: an executable, or a module run with ``python -m``."""

    job: str
    kind: str  # "executable" or "module"
    name: str

    def __str__(self) -> str:
        what = f"python -m {self.name}" if self.kind == "module" else self.name
        return f"{self.job}: {what}"


def _argv_needs(job: str, argv: list[str]) -> list[Need]:
    if not argv:
        return []
    needs = [Need(job, "executable", argv[0])]
    exe = Path(argv[0]).name
    if exe == "env" and len(argv) > 1:  # /usr/bin/env prog ...: prog too
        return needs + _argv_needs(job, argv[1:])
    if exe.startswith("python") and "-m" in argv:
        needs.append(Need(job, "module", argv[argv.index("-m") + 1]))
    return needs


def _entrypoint() -> list[str]:
    text = (EKS_DIR / "Dockerfile").read_text()
    found = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.M)
    return list(json.loads(found[-1])) if found else []


def needs() -> list[Need]:
    """What every Job runs, as the code renders it."""
    sys.path.insert(0, str(REPO))
    from flows.context import eks_train_config, launch_request
    from flows.models import PipelineParams
    from tasks.backends.eks.backend import EksBackend
    from tasks.backends.eks.hydrate import hydration_job
    from tasks.backends.eks.params import EksParams

    out: list[Need] = []
    for nodes, label in ((2, "training Job"), ("1:2", "elastic training Job")):
        params = PipelineParams(backend="eks", nodes=nodes, global_batch=16, run_id="check")
        cfg = eks_train_config(params, "check")
        request = launch_request(params, cfg, run_id="check", attempt=1, invocation="check")
        # The bundle the train flow applies (EksBackend.bundle, what render-k8s prints too).
        for doc in EksBackend(params.eks, nodes=params.launched_nodes).bundle(request):
            if doc["kind"] == "Job":
                out += _pod_needs(label, doc["spec"]["template"]["spec"])
    job = hydration_job(
        name="check", eks=EksParams(), data_dir="/fsx/d",
        manifest_sha256="0" * 64,
    )  # fmt: skip
    out += _pod_needs("hydration Job", job["spec"]["template"]["spec"])
    template = json.loads((EKS_DIR / "work-pool-template.json").read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    for c in pod["containers"]:
        argv = list(c.get("command") or []) + PREFECT_WORKER_COMMAND
        out += _argv_needs("flow-run pod", argv)
    return list(dict.fromkeys(out))


def _pod_needs(job: str, pod: dict) -> list[Need]:
    out: list[Need] = []
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        command = list(c.get("command") or _entrypoint())
        args = [a for a in c.get("args") or [] if isinstance(a, str)]
        out += _argv_needs(f"{job} ({c['name']})", command + args)
    return out


# -- where each is found ---------------------------------------------------------------------
def missing_here(items: list[Need]) -> list[str]:
    """Checked in this environment (inside the image when the build runs it)."""
    bad = []
    for n in items:
        if n.kind == "executable" and shutil.which(n.name) is None:
            bad.append(f"{n}: not on PATH")
        elif n.kind == "module" and importlib.util.find_spec(n.name) is None:
            bad.append(f"{n}: module not importable")
    return bad


def missing_from_dockerfile(items: list[Need], dockerfile: str) -> list[str]:
    """The same check read off the Dockerfile: an executable is the base image's, or a console
    script of a distribution the Dockerfile installs (the project, or one of its dependencies,
    as installed here); a module's package is copied into the image, or the base image's."""
    from importlib.metadata import distributions

    text = re.sub(r"\\\n", " ", dockerfile)
    copied = set(re.findall(r"^COPY\s+(\S+)/\s", text, flags=re.M))
    installs_project = bool(re.search(r"pip install\b[^\n]*\s\.(\s|$)", text, flags=re.M))
    project = _project_requirements() if installs_project else set()
    scripts: dict[str, str] = {}
    for dist in distributions():
        name = _norm(dist.metadata["Name"] or "")
        if name in project:
            for ep in dist.entry_points:
                if ep.group == "console_scripts":
                    scripts[ep.name] = name
    if installs_project:
        for ep_name in _project_scripts():
            scripts[ep_name] = "nvrx-pipeline"
    bad = []
    for n in items:
        if n.kind == "executable":
            if n.name not in BASE_EXECUTABLES and n.name not in scripts:
                bad.append(f"{n}: neither the base image's nor installed by the Dockerfile")
        elif n.name.split(".")[0] not in copied | BASE_MODULES:
            bad.append(f"{n}: package {n.name.split('.')[0]}/ is not copied into the image")
    return bad


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _project_scripts() -> list[str]:
    return list(_pyproject()["project"].get("scripts", {}))


def _project_requirements() -> set[str]:
    """The project's dependencies, and theirs, as installed in this environment."""
    from importlib.metadata import PackageNotFoundError, requires

    todo = [
        re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in _pyproject()["project"]["dependencies"]
    ]
    seen: set[str] = set()
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_image.py", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--inside", action="store_true", help="check this environment")
    mode.add_argument("--image", help="check a built image (needs Docker)")
    mode.add_argument("--dockerfile", action="store_true", help="check the Dockerfile")
    args = p.parse_args(argv)
    if args.image:
        if shutil.which("docker") is None:
            print("error: --image needs Docker; use --dockerfile here", file=sys.stderr)
            return 2
        return subprocess.call(
            ["docker", "run", "--rm", "--entrypoint", "python", args.image,
             "/opt/nvrx-pipeline/deploy/eks/check_image.py", "--inside"]
        )  # fmt: skip
    items = needs()
    if args.inside:
        bad = missing_here(items)
    else:
        bad = missing_from_dockerfile(items, (EKS_DIR / "Dockerfile").read_text())
    for line in bad:
        print(f"missing: {line}")
    if not bad:
        print(f"all {len(items)} commands the Jobs run are there: " + ", ".join(map(str, items)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
