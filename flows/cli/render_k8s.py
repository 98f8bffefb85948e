"""``nvrx-pipeline render-k8s``: the EKS train stage's manifests as YAML."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import yaml

from flows.cli.common import (
    EXIT_USAGE,
    add_params_options,
    command,
    fail,
    load_params_dict,
    params_from_args,
)


def cmd_render_k8s(args: argparse.Namespace) -> int:
    from flows.context import eks_train_config, launch_request, render_global_batch
    from tasks.backends.eks.backend import EksBackend

    try:
        data = load_params_dict(args.config, args.set, [], args.run_id)
    except (OSError, ValueError) as e:
        return fail(e, EXIT_USAGE)
    batch = render_global_batch(data)
    forced: dict[str, Any] = {"backend": "eks"}
    if batch is not None:
        forced["global_batch"] = batch
    derived = None
    if not data.get("run_id"):
        # The same parameters name the same run (their canonical JSON's digest): rendering twice
        # gives one bundle, which `kubectl apply` takes as unchanged (a new id each call made a
        # second Job).
        canonical = json.dumps({**data, **forced}, sort_keys=True, default=str)
        derived = forced["run_id"] = f"rk-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"
    params = params_from_args(args, inject=[], **forced)
    if params is None:
        return EXIT_USAGE
    if batch is not None:
        print(
            f"note: global_batch not set; using {batch}, a multiple of the world size "
            f"{params.world_size} (nodes x eks.gpus_per_node); set global_batch to choose",
            file=sys.stderr,
        )
    if derived is not None:
        print(
            f"note: run id {derived}, derived from the parameters (--run-id names one)",
            file=sys.stderr,
        )
    run_id = params.run_id or ""
    request = launch_request(
        params,
        eks_train_config(params, run_id),
        run_id=run_id,
        attempt=args.attempt,
        invocation=args.invocation,
        epoch=args.epoch,
    )
    # What the train flow's launch creates for the same run, attempt, invocation and epoch.
    docs = EksBackend(params.eks, nodes=params.launched_nodes).bundle(request)
    print(yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False), end="")
    return 0


class _NoAliases(yaml.SafeDumper):
    """Every mapping written out where it stands: no `&id001`/`*id001` for a dict the manifests
    share (some tools and reviewers do not follow YAML aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def add(sub: Any) -> None:
    rk = command(
        sub, "render-k8s", cmd_render_k8s, help="print the EKS train-stage manifests as YAML"
    )
    add_params_options(rk)
    rk.add_argument("--run-id", help="run id (default: derived from the parameters)")
    rk.add_argument("--attempt", type=int, default=1, help="train-stage attempt (names the Job)")
    rk.add_argument(
        "--invocation",
        default="",
        help="the invocation whose Job to render (its first 6 characters end the names, as the "
        "flow's do; default: none)",
    )
    rk.add_argument(
        "--epoch", type=int, help="the attempt's epoch (NVRX_EPOCH), as the flow publishes it"
    )
