"""A raising rank releases its gloo connections at once: its peer's collective fails with a
closed connection instead of waiting out the process-group timeout (real gloo, FSDP2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port, worker_env

WORKER = Path(__file__).with_name("gloo_release_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "peer_error"),
    [
        ("release", "Connection closed by peer"),
        # The control: holding on to the model keeps the connections open until the timeout.
        ("keep", "Timed out"),
    ],
)
def test_peer_of_a_raising_rank_is_released(mode: str, peer_error: str):
    port = free_port()
    argv = [sys.executable, str(WORKER)]
    raising = subprocess.Popen(
        [*argv, "1", str(port), mode],
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        peer = subprocess.run(
            [*argv, "0", str(port), mode],
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        raising.kill()
        raising.wait()
    assert peer.returncode == 0, peer.stderr[-2000:]
    errors = [line for line in peer.stdout.splitlines() if line.startswith("PEER-ERROR")]
    assert len(errors) == 1 and peer_error in errors[0], peer.stdout
