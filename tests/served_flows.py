"""Deployments that tests/test_cancel.py serves from a real Prefect runner, in a process of their
own: ``python -m tests.served_flows {local|kmock}`` (``PREFECT_API_URL`` names the server).

- ``local``: the product's own deployments (:func:`flows.deployments.serve_all`, what
  ``nvrx-pipeline serve`` runs): nothing test-only in the flow.
- ``kmock``: the EKS backend against kmock and a stubbed FSx. A served flow runs in a spawned
  process of the runner, which cannot see clients the test made in its own memory, so
  :func:`pipeline_on_kmock` builds them from its parameters (kmock's URL; the FSx stub's answers
  come from the same :func:`tests.test_eks_pipeline.stubbed_fsx` the EKS pipeline test uses).

:func:`pipeline_on_kmock` calls ``training_pipeline.fn(...)`` (the real pipeline's body in
this flow run), not ``training_pipeline(...)`` as a subflow: the runner runs the
cancellation and crashed hooks of the flow *it* served, in the runner's process
(``PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS=false`` in the flow's process). A subflow's
hooks would never be run by the runner, so the wrapper carries the pipeline's own hook,
:func:`flows.pipeline._clean_up_after`, run under :func:`use_clients` with kmock's clients (the
runner's process has no clients of its own either), and the pipeline's run name. One flow
run then is the run, as with the product deployment: its name is the run id, its parameters
carry the pipeline's (as one ``params`` object, beside ``kube_url``), cancelling it cancels the
training.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from flows.models import PipelineParams, PipelineResult
from flows.pipeline import _clean_up_after, run_id_of_flow_run, training_pipeline
from tasks.backends.eks.clients import EksClients
from tests.eks_cluster import use_clients

KMOCK_FLOW = "nvrx-training-pipeline-on-kmock"
KMOCK_DEPLOYMENT = "kmock"


def kmock_clients(kube_url: str, params: PipelineParams) -> tuple[EksClients, Any]:
    """kmock's Kube and a stubbed FSx client (with its Stubber, to activate around the run)."""
    from kubernetes import client

    from tasks.backends.eks.fsx import Backoff
    from tasks.backends.eks.kube import Kube
    from tests.test_eks_pipeline import stubbed_fsx

    cfg = client.Configuration()
    cfg.host = kube_url
    fsx, stub = stubbed_fsx(params)
    clients = EksClients(
        kube=Kube(client.ApiClient(cfg)),
        fsx=fsx,
        fsx_backoff=Backoff(first_s=0.05, max_s=0.2, deadline_s=30),
        poll_s=0.2,
    )
    return clients, stub


def _clean_up_on_kmock(flow: Any, flow_run: Any, state: Any) -> None:
    """The pipeline's hook, with the clients it would get from the environment in a cluster."""
    raw = flow_run.parameters or {}
    params = PipelineParams.model_validate(raw["params"])
    clients, _ = kmock_clients(str(raw["kube_url"]), params)  # cleanup calls no FSx API
    # The pipeline's parameters as the product's flow run carries them (no deployment defaults).
    as_pipeline = flow_run.model_copy(
        update={"parameters": params.flow_parameters(), "deployment_id": None}
    )
    with use_clients(clients):
        _clean_up_after(flow, as_pipeline, state)


def _kmock_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params")
    named = params.run_id if isinstance(params, PipelineParams) else (params or {}).get("run_id")
    return str(named or run_id_of_flow_run(flow_run.id))


@flow(
    name=KMOCK_FLOW,
    flow_run_name=_kmock_run_name,
    on_cancellation=[_clean_up_on_kmock],
    on_crashed=[_clean_up_on_kmock],
)
def pipeline_on_kmock(params: PipelineParams, kube_url: str) -> PipelineResult:
    clients, stub = kmock_clients(kube_url, params)
    with stub, use_clients(clients):
        return training_pipeline.fn(**params.flow_parameters())


def main(argv: list[str]) -> None:
    from prefect import serve

    if argv == ["local"]:
        from flows.deployments import serve_all

        serve_all()
    elif argv == ["kmock"]:
        # By its module's name, not __main__'s: the runner's spawned flow process imports it.
        from tests.served_flows import pipeline_on_kmock as served

        serve(served.to_deployment(name=KMOCK_DEPLOYMENT), limit=1)
    else:
        raise SystemExit("usage: python -m tests.served_flows {local|kmock}")


if __name__ == "__main__":
    main(sys.argv[1:])
