"""The flow's parameters are flat (one per PipelineParams field) and a run's groups merge deep over
its deployment's: a custom run that sets one field keeps every other default of its deployment.
Tested through the endpoint the UI's Run button calls, on a real Prefect server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import yaml

from flows.models import PipelineParams
from flows.parameters import deep_merge
from flows.pipeline import resolve_params, training_pipeline
from tasks.backends.eks.params import ALLOWED_ENV, EksParams
from tests.helpers import REPO


def _eks_defaults() -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "deploy" / "eks" / "prefect.yaml").read_text())
    return dict(spec["deployments"][0]["parameters"])


def test_the_form_has_one_parameter_per_field_with_its_limits():
    schema = training_pipeline.parameters.model_dump()
    props = schema["properties"]
    assert list(props) == list(PipelineParams.model_fields)
    assert props["steps"]["minimum"] == 1 and props["steps"]["description"]
    assert props["backend"]["enum"] == ["local", "eks"]
    assert all(p.get("description") for p in props.values())
    # Drills sit in their own section, last, apart from what production runs set.
    assert list(props)[-1] == "drills" and "faults" not in props
    assert not schema.get("required")


def test_deep_merge_keeps_what_the_run_left_out():
    base = {"backend": "eks", "eks": {"image": "i", "queue": None}, "steps": 5}
    assert deep_merge(base, {"steps": 7, "eks": {"queue": "q"}}) == {
        "backend": "eks",
        "eks": {"image": "i", "queue": "q"},
        "steps": 7,
    }
    assert deep_merge(base, {"script_args": ["a"]})["script_args"] == ["a"]  # lists replace


@pytest.fixture
def eks_deployment(prefect_server: str, monkeypatch) -> tuple[str, dict[str, Any]]:
    """deploy/eks/prefect.yaml's on-demand deployment, registered on the test server."""
    defaults = _eks_defaults()
    for field, env in ALLOWED_ENV.items():  # what the EKS pool's flow-run pods allow
        monkeypatch.setenv(env, defaults["eks"].get(field, EksParams.model_fields[field].default))
    # This deployment's runs may inject exception drills (the "drill" case below); a
    # deployment allows none unless it says so (tests/adversarial/test_hostile_forms.py).
    monkeypatch.setenv("NVRX_ALLOWED_DRILLS", "exception")
    dep_id = training_pipeline.to_deployment(name="eks-params-test", parameters=defaults).apply()
    return str(dep_id), defaults


@pytest.mark.parametrize(
    ("custom", "expect"),
    [
        ({"steps": 7}, {"steps": 7}),
        # one field of a group: the group's other fields stay the deployment's
        ({"eks": {"queue": "team-a"}}, {"eks.queue": "team-a"}),
        (
            {"drills": {"faults": ["exception@step=3,rank=1"]}},
            {"drills.faults": ["exception@step=3,rank=1"]},
        ),
    ],
    ids=["steps", "one-eks-field", "drill"],
)
def test_a_custom_run_keeps_the_deployments_other_parameters(
    eks_deployment: tuple[str, dict[str, Any]], prefect_server: str, custom, expect
):
    dep_id, defaults = eks_deployment
    r = httpx.post(
        f"{prefect_server}/deployments/{dep_id}/create_flow_run",
        json={"parameters": custom},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    run = r.json()
    # What the flow does with them: Prefect validates each parameter, then the flow merges its
    # groups over the deployment's and validates the whole.
    params = resolve_params(training_pipeline.validate_parameters(run["parameters"]), dep_id)
    assert params.backend == "eks" and params.s3_endpoint is None
    want = PipelineParams.model_validate(defaults).model_dump()
    for dotted, value in expect.items():
        group, _, key = dotted.partition(".")
        if key:
            want[group][key] = value
        else:
            want[group] = value
    assert params.model_dump() == want


def test_a_bad_value_is_refused_by_the_run_buttons_endpoint(
    eks_deployment: tuple[str, dict[str, Any]], prefect_server: str
):
    dep_id, _ = eks_deployment
    r = httpx.post(
        f"{prefect_server}/deployments/{dep_id}/create_flow_run",
        json={"parameters": {"steps": 0}},
        timeout=30,
    )
    assert r.status_code in (409, 422) and "steps" in r.text, r.text


def test_descriptions_render_as_text_in_the_form():
    """The UI renders descriptions as markup: an angle-bracketed placeholder would vanish."""
    import re

    def descriptions(schema: dict) -> list[str]:
        found = [p.get("description", "") for p in schema.get("properties", {}).values()]
        for sub in schema.get("definitions", {}).values():
            found += descriptions(sub)
        return found

    texts = descriptions(training_pipeline.parameters.model_dump())
    assert texts and not [t for t in texts if re.search(r"<[A-Za-z_]", t)]
