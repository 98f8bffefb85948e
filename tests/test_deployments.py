"""Deployments: the static ``deploy/prefect.yaml`` matches what ``nvrx-pipeline serve`` serves, and
``serve`` rejects bad defaults naming the field. The served deployments themselves, driven from the
UI in a real browser, are in ``test_ui_browser.py``."""

from __future__ import annotations

import pytest
import yaml

from flows.deployments import NIGHTLY, NIGHTLY_CRON, ON_DEMAND
from flows.models import PipelineParams
from tests.helpers import REPO


def test_prefect_yaml_matches_served_deployments():
    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {ON_DEMAND, NIGHTLY}
    for d in deps.values():
        module, _, func = d["entrypoint"].partition(":")
        assert (REPO / module).is_file() and func == "training_pipeline"
        PipelineParams(**d["parameters"])  # defaults are valid parameters
        assert d["work_pool"]["name"] == "nvrx-local"
    assert deps[NIGHTLY]["schedules"][0]["cron"] == NIGHTLY_CRON


def test_local_deployments_ignore_the_eks_allow_lists(monkeypatch):
    """The EKS worker's allow-lists (deploy/eks/prefect.yaml) never get in a local run's way,
    and the local deployments name no EKS values to allow."""
    from tasks.backends.eks.params import ALLOWED_ENV

    for name in ALLOWED_ENV.values():
        monkeypatch.setenv(name, "something-else")
    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        params = d["parameters"]
        assert params["backend"] == "local" and "eks" not in params
        assert "job_variables" not in d["work_pool"]
        PipelineParams(**params)


def test_served_defaults_carry_overrides():
    from flows.deployments import deployments
    from flows.models import PipelineParams

    deps = deployments(PipelineParams(steps=7, drills={"faults": ["exception@step=3,rank=1"]}))
    assert {d.name for d in deps} == {ON_DEMAND, NIGHTLY}
    for d in deps:
        assert d.parameters["steps"] == 7 and "run_id" not in d.parameters
        assert d.parameters["drills"]["faults"] == ["exception@step=3,rank=1"]


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--set", "steps=0"], "steps"),
        (["--set", "run_id=fixed"], "run_id"),
        (["--set", "no_such=1"], "no_such"),
        (["--config", "/nonexistent/defaults.yaml"], "defaults.yaml"),
    ],
)
def test_serve_rejects_bad_defaults(argv: list[str], expect: str, capsys):
    from flows.cli import main
    from flows.cli.common import EXIT_USAGE

    assert main(["serve", *argv]) == EXIT_USAGE
    assert expect in capsys.readouterr().err


def test_every_deployment_runs_one_flow_run_at_a_time():
    """Served and declared alike: a second run waits in the queue (ENQUEUE), it does not compete
    for the nodes and the state directory."""
    from flows.deployments import COLLISION_STRATEGY, CONCURRENCY_LIMIT, deployments

    for d in deployments():
        assert d.concurrency_limit == CONCURRENCY_LIMIT == 1
        assert d.concurrency_options.collision_strategy.value == COLLISION_STRATEGY
    for path in (REPO / "deploy" / "prefect.yaml", REPO / "deploy" / "eks" / "prefect.yaml"):
        for d in yaml.safe_load(path.read_text())["deployments"]:
            assert d["concurrency_limit"] == {
                "limit": CONCURRENCY_LIMIT,
                "collision_strategy": COLLISION_STRATEGY,
            }, (path, d["name"])
