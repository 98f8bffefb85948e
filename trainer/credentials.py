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

# A credential's word anywhere in a name, joined or not (PGPASSWORD, MYSQL_PWD is not caught:
# the worker's environment is an allow-list, tasks.secrets; this is the second line).
CREDENTIAL_WORD = re.compile(
    r"SECRET|TOKEN(?!IZER)|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|AUTH",
    re.IGNORECASE,
)
# A URL that carries a password: scheme://user:password@host.
URL_WITH_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@]*:[^/\s@]*@", re.IGNORECASE)


def is_credential(name: str, value: str = "") -> bool:
    """Whether ``name`` (or ``value``) looks like a credential."""
    return bool(
        SECRET_NAME.fullmatch(name)
        or CREDENTIAL_WORD.search(name)
        or URL_WITH_PASSWORD.search(value)
    )


def secret_like(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that look like credentials, sorted."""
    return sorted(k for k in env if is_credential(k))
