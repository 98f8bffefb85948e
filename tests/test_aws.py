"""The region and retries of every AWS client the pipeline builds (tasks/aws.py): the standard
chain (environment, AWS_PROFILE, AWS_CONFIG_FILE) decides unless a region is given, and our
defaults apply only where nothing is set. Asserted on the real boto3/s3fs client objects; no
network, except one round trip to the session's local SeaweedFS server."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber

from flows.context import RunContext
from flows.models import PipelineParams
from tasks import aws
from tasks.backends.eks.backend import EksBackend
from tasks.backends.eks.params import EksParams
from tasks.errors import AwsConfigError
from tasks.preflight.eks import gather_eks
from tasks.storage.s3 import S3Settings, boto3_client, s3fs_filesystem
from tests.test_eks_preflight import REQ

REPO = Path(__file__).resolve().parents[1]
CHAIN_VARIABLES = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_DEFAULTS_MODE",
)
PROFILES = """\
[default]
region = sa-east-1
[profile lab]
region = ap-south-1
max_attempts = 9
"""


@pytest.fixture(autouse=True)
def no_aws_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Nothing set: no variable, an empty config file (the developer's ~/.aws never leaks in).
    Returns the config file, for tests that write profiles into it."""
    for name in CHAIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws-config"
    config.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    # Kube.from_environment (EksBackend.clients) reads a kubeconfig; nothing connects to it.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # The kubernetes client reads $KUBECONFIG once, when first imported (maybe already, by a
    # module collected before this one): its default location must follow too.
    monkeypatch.setattr(
        "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return config


def _s3fs_client(settings: S3Settings) -> Any:
    """s3fs builds its aiobotocore client on connect (no request is sent)."""
    return s3fs_filesystem(settings).connect()


def _run_s3(eks: dict[str, Any], backend: str) -> Any:
    params = PipelineParams(backend=backend, nodes=2, global_batch=16, run_id="r", eks=eks)
    return boto3_client(RunContext.create(params).s3)


# Every client the pipeline builds, as the pipeline builds it: (name, factory(eks section)).
# A new AWS client belongs here; test_no_client_bypasses_the_resolver catches one that does not
# go through tasks/aws.py, test_every_factory_site_is_enumerated one missing from this table.
FACTORIES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "s3 boto3 (CLI export, prepare-dataset)": lambda eks: boto3_client(S3Settings()),
    "s3 boto3 of a local run (preflight, export)": lambda eks: _run_s3(eks, "local"),
    "s3 boto3 of an eks run (preflight, export)": lambda eks: _run_s3(eks, "eks"),
    "s3fs (hydrate)": lambda eks: _s3fs_client(S3Settings()),
    "s3fs of an eks run (hydrate)": lambda eks: _s3fs_client(
        S3Settings(region=EksParams(**eks).region)
    ),
    "fsx (eks preflight, hydrate, export)": lambda eks: (
        EksBackend(EksParams(**eks), nodes=1).clients.fsx
    ),
    "s3 boto3 of the local SeaweedFS server": lambda eks: boto3_client(
        S3Settings(endpoint_url="http://127.0.0.1:8333")
    ),
}
# Where the pipeline calls the resolver's factories (the files FACTORIES' entries go through).
FACTORY_SITES = {"tasks/storage/s3.py", "tasks/backends/eks/clients.py"}

DEFAULT_RETRIES = {"mode": "standard", "total_max_attempts": 4}  # 3 retries


def _profiles(config: Path) -> None:
    config.write_text(PROFILES)


# (case, environment, whether the config file holds PROFILES, region, retries)
SCENARIOS: list[tuple[str, dict[str, str], bool, str, dict[str, Any]]] = [
    ("nothing set: our defaults", {}, False, "us-east-1", DEFAULT_RETRIES),
    ("AWS_REGION", {"AWS_REGION": "eu-west-1"}, False, "eu-west-1", DEFAULT_RETRIES),
    (
        "AWS_DEFAULT_REGION",
        {"AWS_DEFAULT_REGION": "eu-north-1"},
        False,
        "eu-north-1",
        DEFAULT_RETRIES,
    ),
    (
        "AWS_REGION over AWS_DEFAULT_REGION (as the AWS CLI)",
        {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-north-1"},
        False,
        "eu-west-1",
        DEFAULT_RETRIES,
    ),
    ("the default profile's region", {}, True, "sa-east-1", DEFAULT_RETRIES),
    (
        "AWS_PROFILE: its region and max_attempts, our mode",
        {"AWS_PROFILE": "lab"},
        True,
        "ap-south-1",
        {"mode": "standard", "total_max_attempts": 9},
    ),
    (
        "the environment over the profile",
        {"AWS_PROFILE": "lab", "AWS_REGION": "eu-west-1", "AWS_MAX_ATTEMPTS": "7"},
        True,
        "eu-west-1",
        {"mode": "standard", "total_max_attempts": 7},
    ),
    (
        "AWS_MAX_ATTEMPTS",
        {"AWS_MAX_ATTEMPTS": "7"},
        False,
        "us-east-1",
        {"mode": "standard", "total_max_attempts": 7},
    ),
    (
        "AWS_RETRY_MODE",
        {"AWS_RETRY_MODE": "adaptive"},
        False,
        "us-east-1",
        {"mode": "adaptive", "total_max_attempts": 4},
    ),
    (
        "both retry variables",
        {"AWS_RETRY_MODE": "adaptive", "AWS_MAX_ATTEMPTS": "7"},
        False,
        "us-east-1",
        {"mode": "adaptive", "total_max_attempts": 7},
    ),
]


# What every factory is checked against (the whole table runs on one client below: the rule
# is the same code for all of them).
EVERY_CLIENT = [
    SCENARIOS[0],
    (
        "AWS_REGION and both retry variables",
        {"AWS_REGION": "eu-west-1", "AWS_MAX_ATTEMPTS": "7", "AWS_RETRY_MODE": "adaptive"},
        False,
        "eu-west-1",
        {"mode": "adaptive", "total_max_attempts": 7},
    ),
    SCENARIOS[5],
]


def _apply(
    monkeypatch: pytest.MonkeyPatch, config: Path, env: dict[str, str], profiles: bool
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if profiles:
        _profiles(config)


@pytest.mark.parametrize("factory", FACTORIES, ids=list(FACTORIES))
@pytest.mark.parametrize(
    "case,env,profiles,region,retries", EVERY_CLIENT, ids=[s[0] for s in EVERY_CLIENT]
)
def test_every_client_follows_the_chain(
    monkeypatch: pytest.MonkeyPatch,
    no_aws_config: Path,
    factory: str,
    case: str,
    env: dict[str, str],
    profiles: bool,
    region: str,
    retries: dict[str, Any],
) -> None:
    _apply(monkeypatch, no_aws_config, env, profiles)
    client = FACTORIES[factory]({})  # eks.region empty: the chain
    assert client.meta.region_name == region
    assert client.meta.config.retries == retries


@pytest.mark.parametrize(
    "case,env,profiles,region,retries", SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_the_chain(
    monkeypatch: pytest.MonkeyPatch,
    no_aws_config: Path,
    case: str,
    env: dict[str, str],
    profiles: bool,
    region: str,
    retries: dict[str, Any],
) -> None:
    _apply(monkeypatch, no_aws_config, env, profiles)
    client = aws.client("s3")
    assert client.meta.region_name == region
    assert client.meta.config.retries == retries


@pytest.mark.parametrize("factory", [f for f in FACTORIES if "eks run" in f or "fsx" in f])
def test_explicit_eks_region_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, no_aws_config: Path, factory: str
) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_PROFILE", "lab")
    _profiles(no_aws_config)
    client = FACTORIES[factory]({"region": "ap-northeast-1"})
    assert client.meta.region_name == "ap-northeast-1"
    # a region given does not touch the retries: the profile's max_attempts still holds
    assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 9}


def test_s3fs_filesystem_carries_the_resolved_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    fs = s3fs_filesystem(S3Settings())
    assert fs.client_kwargs == {"region_name": "eu-west-1"}
    assert fs.config_kwargs == {"retries": {"mode": "standard"}}  # max_attempts: botocore's read


def test_a_local_endpoint_works_in_any_region(
    monkeypatch: pytest.MonkeyPatch, s3_settings: S3Settings
) -> None:
    """SeaweedFS ignores the region; a non-default one must not break signing or s3fs."""
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    client = boto3_client(s3_settings)
    bucket = "aws-chain"
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="k", Body=b"eu-west-1 bytes")
    fs = s3fs_filesystem(s3_settings)
    assert fs.cat(f"{bucket}/k") == b"eu-west-1 bytes"
    assert client.meta.region_name == fs.s3.meta.region_name == "eu-west-1"
    assert fs.s3.meta.config.retries["mode"] == "adaptive"


def test_resolved_region_names_its_source(monkeypatch: pytest.MonkeyPatch, no_aws_config: Path):
    assert aws.resolve_region() == aws.Region("us-east-1", aws.resolve_region().source)
    assert "default" in aws.resolve_region().source
    assert aws.resolve_region("ap-northeast-1").source == "explicit"
    _profiles(no_aws_config)
    monkeypatch.setenv("AWS_PROFILE", "lab")
    assert str(aws.resolve_region()) == f"ap-south-1 (from profile lab of {no_aws_config})"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-north-1")
    assert str(aws.resolve_region()) == "eu-north-1 (from AWS_DEFAULT_REGION)"


@pytest.mark.parametrize(
    "env,named",
    [
        ({"AWS_PROFILE": "nope"}, "AWS_PROFILE"),
        ({"AWS_REGION": "eu west 1"}, "AWS_REGION"),
        ({"AWS_DEFAULT_REGION": "eu_north_1"}, "AWS_DEFAULT_REGION"),
        ({"AWS_MAX_ATTEMPTS": "many"}, "AWS_MAX_ATTEMPTS"),
    ],
)
def test_bad_configuration_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(AwsConfigError, match=named):
        boto3_client(S3Settings())


def test_fsx_preflight_error_names_the_region_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system in another region is "not found": the preflight says which region asked."""
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    fsx = aws.client("fsx", credentials={"aws_access_key_id": "x", "aws_secret_access_key": "x"})
    req = REQ  # the EKS preflight tests' requirements (file system fs-0123456789abcdef0)
    with Stubber(fsx) as stub:
        stub.add_client_error("describe_file_systems", "FileSystemNotFound", http_status_code=400)
        snap = gather_eks(object(), fsx, req)  # Kubernetes sources fail on their own
    assert "fs-0123456789abcdef0 in region eu-west-1" in snap.errors["fsx"]


def test_eks_region_is_optional_and_validated() -> None:
    assert EksParams().region is None
    assert EksParams(region="eu-central-1").region == "eu-central-1"
    with pytest.raises(ValueError, match="region"):
        EksParams(region="eu-central")


# -- every client goes through the resolver ------------------------------------------------------
SOURCES = sorted(
    p for d in ("flows", "tasks", "trainer", "benchmarks") for p in (REPO / d).rglob("*.py")
)
RESOLVER = REPO / "tasks" / "aws.py"
# What builds an AWS client or session without the resolver's region and retries.
BYPASS = re.compile(
    r"\bboto3\.(?:client|resource|Session|session\.Session)\(|\bS3FileSystem\(|"
    r"\bbotocore\.session\b|\bget_session\(|\.create_client\(|\baiobotocore\b|"
    r"\bregion_name\s*="
)
FACTORY_CALL = re.compile(r"\baws\.(?:client|s3fs_filesystem)\(")


def bypasses(path_text: dict[str, str]) -> list[str]:
    return [
        f"{path}:{n}: {line.strip()}"
        for path, text in path_text.items()
        for n, line in enumerate(text.splitlines(), 1)
        if BYPASS.search(line)
    ]


def _sources(exclude: Path | None = None) -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in SOURCES if p != exclude}


def test_no_client_bypasses_the_resolver() -> None:
    assert bypasses(_sources(exclude=RESOLVER)) == []


def test_bypass_check_can_fail() -> None:
    snippet = {"tasks/x.py": 'import boto3\nc = boto3.client("sts", region_name="us-east-1")\n'}
    assert bypasses(snippet) == [f"tasks/x.py:2: {snippet['tasks/x.py'].splitlines()[1]}"]
    assert bypasses({"tasks/y.py": "fs = s3fs.S3FileSystem(anon=True)"})
    assert bypasses(_sources())  # the resolver itself is found


def test_every_factory_site_is_enumerated() -> None:
    sites = {path for path, text in _sources().items() if FACTORY_CALL.search(text)}
    assert sites == FACTORY_SITES, "add the new client to FACTORIES (and FACTORY_SITES)"


def test_pods_get_no_aws_configuration() -> None:
    """The training pods call no AWS API (no IAM role, no egress): no AWS_* reaches them, so
    nothing suggests they could."""
    from flows.context import eks_train_config
    from tasks.backends.eks.render import render_all

    params = PipelineParams(
        backend="eks", nodes=2, global_batch=16, run_id="r", eks={"region": "eu-west-1"}
    )
    objs = render_all(eks_train_config(params, "r"), run_id="r", attempt=1, nodes=2, eks=params.eks)
    (job,) = [o for o in objs if o["kind"] == "Job"]
    env = [e["name"] for c in job["spec"]["template"]["spec"]["containers"] for e in c["env"]]
    assert env and not [n for n in env if n.startswith("AWS_")]


@pytest.mark.parametrize(
    "eks,said",
    [({}, "eu-west-1 (from AWS_REGION)"), ({"region": "us-west-2"}, "us-west-2 (from eks.region)")],
)
def test_eks_backend_logs_the_region_and_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, eks: dict[str, Any], said: str
) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    logged: list[str] = []
    EksBackend(EksParams(**eks), nodes=1, log=logged.append).clients  # noqa: B018
    assert logged == [f"AWS region of FSx and S3: {said}"]
