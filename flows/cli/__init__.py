"""``nvrx-pipeline``: a module per command or per few of one concept, each parsing its arguments
and printing (the work is in ``tasks/`` and ``flows/``). Every command's usage and exit codes are
in its ``--help`` (:data:`EXIT_CODES`); with ``--json`` the last line of stdout is one JSON
object (the ``PipelineResult`` for ``run``)."""

from __future__ import annotations

import argparse
from importlib import import_module

from flows.cli.common import EXIT_CODES

# Modules of flows.cli, in the order of the top-level --help.
COMMANDS = (
    "run",
    "params",
    "render_k8s",
    "services",
    "checkpoint",
    "status",
    "prepare_dataset",
    "weights_digest",
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
    for name in COMMANDS:
        import_module(f"flows.cli.{name}").add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))
