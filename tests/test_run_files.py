"""Every writer of a shared directory: a link planted at a temporary name or at the target is
never written through, and two writers of one path never share a temporary file."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.backends.local_nodes import _EXIT_WRAPPER
from trainer.node_beat import NodeBeat
from trainer.run_files import write_durably, write_json_atomic, write_text_atomic


def _exit_wrapper(path: Path) -> None:
    """The simulated node's shell, as the local backend starts it, running ``true``."""
    env = {**os.environ, "NVRX_EXIT_FILE": str(path)}
    subprocess.run(["/bin/sh", "-c", _EXIT_WRAPPER, "nvrx-node0", "true"], env=env, check=True)


def _beat(path: Path) -> None:
    NodeBeat(path, interval_s=3600).close()


@dataclass(frozen=True)
class Writer:
    name: str
    write: Callable[[Path], None]
    old_temp: str  # the temporary name it used to write through, ``{}``: the target's name


WRITERS = [
    Writer("write_durably", lambda p: write_durably(p, "new\n"), ".{}.tmp"),
    Writer("write_text_atomic", lambda p: write_text_atomic(p, "new\n"), ".{}.tmp"),
    Writer("write_json_atomic", lambda p: write_json_atomic(p, {"new": 1}), ".{}.tmp"),
    Writer("node beat", _beat, f".{{}}.{os.getpid()}"),
    Writer("node exit wrapper", _exit_wrapper, "{}.tmp"),
]
PLANTED_AT = ["old temporary name", "target"]


@pytest.mark.parametrize("where", PLANTED_AT)
@pytest.mark.parametrize("writer", WRITERS, ids=[w.name for w in WRITERS])
def test_a_planted_link_is_never_written_through(tmp_path: Path, writer: Writer, where: str):
    shared = tmp_path / "run"
    shared.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    target = shared / "file"
    link = shared / writer.old_temp.format(target.name) if where != "target" else target
    link.symlink_to(victim)

    writer.write(target)

    assert victim.read_text() == "untouched\n"
    assert target.is_file() and not target.is_symlink()
    # The writer left its own file only: no temporary file beside it.
    left = sorted(p.name for p in shared.iterdir())
    assert left == sorted({target.name, link.name})


@pytest.mark.parametrize(
    "write", [write_durably, write_text_atomic], ids=["write_durably", "write_text_atomic"]
)
def test_two_writers_of_one_path_never_share_a_temporary_file(tmp_path: Path, write):
    """With one fixed temporary name, a writer's rename found its file already renamed by the
    other (FileNotFoundError) or renamed the other's half-written bytes into place."""
    target = tmp_path / "file"
    texts = {"a": "a" * 65536 + "\n", "b": "b" * 65536 + "\n"}
    errors: list[BaseException] = []

    def run(text: str) -> None:
        try:
            for _ in range(40):
                write(target, text)
                assert target.read_text() in texts.values()
        except BaseException as e:  # said by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in texts.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
