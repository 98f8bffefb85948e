"""Every AWS client the pipeline builds (boto3 clients, s3fs filesystems) comes from here, so one
rule decides their region and retries.

Region: an explicit setting (``eks.region``), else the standard chain as the AWS CLI v2 reads it
(``AWS_REGION``, ``AWS_DEFAULT_REGION``, the region of ``AWS_PROFILE``'s profile in
``~/.aws/config`` / ``AWS_CONFIG_FILE``), ``us-east-1`` only when nothing is set. Retries:
``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` and the profile's ``max_attempts`` / ``retry_mode``
win, each on its own; our default fills only what they leave unset. botocore does the reading;
the one addition is ``AWS_REGION``, which boto3 ignores but the CLI, the other SDKs and EKS's
IRSA webhook (the cluster's region, in the flow runner's pod) use.

A fresh session per client: the default boto3 session captures ``AWS_PROFILE`` when first used
(clients are built once per stage: the cost does not matter). Local endpoints (SeaweedFS)
ignore the region; any value works there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tasks.errors import AwsConfigError

DEFAULT_REGION = "us-east-1"
# botocore's client-config ``max_attempts`` counts retries (4 attempts in all), unlike
# AWS_MAX_ATTEMPTS and the config file's max_attempts, which count attempts.
DEFAULT_RETRIES: dict[str, int | str] = {"max_attempts": 3, "mode": "standard"}
# What the environment and config file may set instead of DEFAULT_RETRIES' keys.
_RETRY_VARIABLES = {"max_attempts": "max_attempts", "mode": "retry_mode"}


@dataclass(frozen=True)
class Region:
    name: str
    source: str  # where it came from, for messages: "explicit", "AWS_REGION", "profile x", ...

    def __str__(self) -> str:
        return f"{self.name} (from {self.source})"


def session() -> Any:
    """A botocore session reading the environment and config file as they are now."""
    import botocore.session

    return botocore.session.Session()


def chain_value(sess: Any, name: str) -> Any:
    """The value of botocore variable ``name`` (``region``, ``max_attempts``, ``retry_mode``)
    from the environment or the profile's config, or None when neither sets it: unlike
    ``get_config_variable``, never botocore's built-in default, so that ours can apply."""
    from botocore.configprovider import BOTOCORE_DEFAUT_SESSION_VARIABLES, ConfigChainFactory
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    config_name, env_vars, _default, convert = BOTOCORE_DEFAUT_SESSION_VARIABLES[name]
    chain = ConfigChainFactory(session=sess).create_config_chain(
        env_var_names=env_vars, config_property_names=config_name, conversion_func=convert
    )
    try:
        return chain.provide()
    except ProfileNotFound as e:
        raise AwsConfigError(
            f"AWS_PROFILE: {e}; name a profile of {_config_file()} or unset AWS_PROFILE"
        ) from e
    except (BotoCoreError, ValueError) as e:  # an unparsable file, max_attempts not a number
        raise AwsConfigError(
            f"cannot read {name} from {env_vars} or {config_name} in {_config_file()}: {e}; "
            "fix the value or unset it"
        ) from e


def _config_file() -> str:
    return os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"


def resolve_region(
    explicit: str | None = None, *, sess: Any | None = None, setting: str = "explicit"
) -> Region:
    """The region every client gets (see the module's docstring for the order); ``setting``
    names where ``explicit`` came from, for messages (``eks.region``)."""
    from botocore.exceptions import InvalidRegionError
    from botocore.utils import validate_region_name

    region = Region(explicit, setting) if explicit else _find_region(sess)
    try:
        validate_region_name(region.name)
    except InvalidRegionError as e:
        raise AwsConfigError(
            f"{region.source}: {region.name!r} is not an AWS region name; set a region such as "
            "us-west-2"
        ) from e
    return region


def _find_region(sess: Any | None) -> Region:
    if os.environ.get("AWS_REGION"):
        return Region(os.environ["AWS_REGION"], "AWS_REGION")
    sess = sess if sess is not None else session()
    found = chain_value(sess, "region")
    if found:
        if os.environ.get("AWS_DEFAULT_REGION"):
            return Region(found, "AWS_DEFAULT_REGION")
        return Region(found, f"profile {sess.profile or 'default'} of {_config_file()}")
    return Region(DEFAULT_REGION, "default: no AWS_REGION, AWS_DEFAULT_REGION or profile region")


def retries(sess: Any | None = None) -> dict[str, int | str]:
    """Our default retry keys that neither the environment nor the config file sets (an empty
    dict when both are set: botocore then reads them itself)."""
    sess = sess if sess is not None else session()
    return {
        key: value
        for key, value in DEFAULT_RETRIES.items()
        if chain_value(sess, _RETRY_VARIABLES[key]) is None
    }


def client(
    service: str,
    *,
    region: str | None = None,
    endpoint_url: str | None = None,
    credentials: dict[str, str] | None = None,
    **config: Any,
) -> Any:
    """A boto3 client. ``region``: an explicit setting (None: the chain); ``credentials``
    (aws_access_key_id/aws_secret_access_key) replace the default credential chain; ``config``:
    other ``botocore.config.Config`` options (timeouts, pool size)."""
    import boto3
    from botocore.config import Config

    # Resolved before boto3 reads the config file itself, so a bad profile is our clear error.
    sess = session()
    region_name, retry = resolve_region(region, sess=sess).name, retries(sess)
    return boto3.Session(botocore_session=sess).client(
        service,
        region_name=region_name,
        endpoint_url=endpoint_url,
        config=Config(retries=retry, **config),
        **(credentials or {}),
    )


def s3fs_filesystem(
    *,
    region: str | None = None,
    endpoint_url: str | None = None,
    credentials: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """An s3fs filesystem with the same region and retries as :func:`client` (its aiobotocore
    client reads the same environment and profile for everything else)."""
    import s3fs

    sess = session()
    creds = credentials or {}
    return s3fs.S3FileSystem(
        key=creds.get("aws_access_key_id"),
        secret=creds.get("aws_secret_access_key"),
        endpoint_url=endpoint_url,
        client_kwargs={"region_name": resolve_region(region, sess=sess).name},
        config_kwargs={"retries": retries(sess)},
        **kwargs,
    )
