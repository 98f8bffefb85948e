"""`nvrx-pipeline --help` and every command's: usage and exit codes, plain text; `--version`."""

from __future__ import annotations

import argparse
import json
import tomllib

import pytest

from flows.cli import EXIT_CODES, build_parser, main
from tests.helpers import REPO


def _commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_its_exit_codes():
    assert list(EXIT_CODES) == _commands()
    for codes in EXIT_CODES.values():
        assert 0 in codes and set(codes) <= {0, 1, 2}


@pytest.mark.parametrize(
    "argv", [[], *([c] for c in _commands()), ["automations", "apply"]], ids=" ".join
)
def test_help_lists_the_exit_codes_in_plain_text(argv: list[str], capsys):
    text = _help([*argv, "--help"], capsys)
    assert "``" not in text and ":mod:" not in text  # no reStructuredText leaks into a terminal
    if not argv:
        for command in EXIT_CODES:
            assert f"\n  {command} " in text
        return
    command = argv[0]
    assert "exit codes:" in text
    for code, what in EXIT_CODES[command].items():
        assert f"  {code}  {what}" in text


def test_version_names_the_package_and_its_runtime(capsys):
    text = _help(["--version"], capsys)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert text.startswith(f"nvrx-pipeline {version} (torch ")
    assert "nvidia-resiliency-ext" in text and "prefect" in text


def test_a_listed_exit_code_is_the_one_returned(tmp_path, capsys):
    """The code `status --help` lists for an unknown run is what it returns."""
    assert main(["status", "no-such-run", "--state-dir", str(tmp_path)]) == 2
    assert "no events" in EXIT_CODES["status"][2] and "no events" in capsys.readouterr().err


def test_status_checks_the_id_it_is_given(tmp_path, capsys):
    """`status xyz --run-root <another run>` must not report that run as xyz (issue 27), and an
    id that is no run id never becomes a path."""
    other = tmp_path / "fsx" / "runs" / "run-a"
    other.mkdir(parents=True)
    (other / "events.jsonl").write_text("")
    assert main(["status", "xyz", "--run-root", str(other)]) == 2
    assert "is run 'run-a', not 'xyz'" in capsys.readouterr().err
    assert main(["status", "run-a", "--run-root", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == "run-a"
    assert main(["status", "../runs/run-a", "--state-dir", str(tmp_path)]) == 2
    assert "lowercase letters, digits and dashes" in capsys.readouterr().err
