"""Which environment variables are credentials, by name (the workers' environment is scrubbed
of them, tasks.secrets; a worker reports the names it still has, never the values)."""

from __future__ import annotations

import re
from collections.abc import Mapping

# Every variable named like a secret (HF_TOKEN, PREFECT_API_KEY, PREFECT_API_AUTH_STRING,
# *_PASSWORD, GOOGLE_APPLICATION_CREDENTIALS, SSH_AUTH_SOCK, AWS_SECRET_ACCESS_KEY...).
SECRET_NAME = re.compile(
    r"(?:.*_)?(?:SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|KEY|CREDENTIALS?|AUTH)(?:_.*)?",
    re.IGNORECASE,
)


def secret_like(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that look like credentials, sorted."""
    return sorted(k for k in env if SECRET_NAME.fullmatch(k))
