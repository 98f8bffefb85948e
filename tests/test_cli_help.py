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


def test_one_spelling_per_option_across_commands(capsys):
    """Issue 27: the S3 endpoint is --s3-endpoint and the state directory --state-dir wherever
    a command takes them (run sets its parameters from them)."""
    from flows.cli.common import params_from_args

    for cmd in ("run", "export", "pull", "prepare-dataset"):
        assert "--s3-endpoint" in _help([cmd, "--help"], capsys), cmd
    for cmd in ("run", "status"):
        assert "--state-dir" in _help([cmd, "--help"], capsys), cmd
    args = build_parser().parse_args(
        ["run", "--state-dir", "/tmp/st", "--s3-endpoint", "http://127.0.0.1:9000"]
    )
    p = params_from_args(args, inject=[])
    assert p is not None and (p.state_dir, p.s3_endpoint) == ("/tmp/st", "http://127.0.0.1:9000")


def test_runs_lists_a_state_directorys_runs_newest_first(tmp_path, capsys):
    """Issue 27: `runs` finds a run's id again: ended runs from their saved result, one that has
    not ended from its events; a stray file or a hostile result changes nothing."""
    import os

    root = tmp_path / "fsx" / "runs"
    done = root / "run-done"
    done.mkdir(parents=True)
    (done / "events.jsonl").write_text("")
    (done / "pipeline_result.json").write_text(
        json.dumps(
            {"status": "completed", "run_id": "run-done", "final_step": 30, "target_steps": 30}
        )
    )
    os.utime(done / "pipeline_result.json", (1000, 1000))
    os.utime(done / "events.jsonl", (1000, 1000))
    cut = root / "run-cut"
    cut.mkdir()
    (cut / "events.jsonl").write_text(
        "\n".join(
            json.dumps({"t": 1.0 + i, "kind": "step", "step": i, "step_s": 0.1}) for i in (1, 2, 3)
        )
        + "\n"
    )
    hostile = root / "run-hostile"
    hostile.mkdir()
    (hostile / "events.jsonl").write_text("1\nnull\n")
    (hostile / "pipeline_result.json").write_text("[not json")
    os.utime(hostile / "events.jsonl", (500, 500))
    os.utime(hostile / "pipeline_result.json", (500, 500))
    typed = root / "run-typed"  # JSON, but not a result: no end, its events say the rest
    typed.mkdir()
    (typed / "events.jsonl").write_text("")
    (typed / "pipeline_result.json").write_text('{"status": ["x"], "final_step": "9"}')
    os.utime(typed / "events.jsonl", (400, 400))
    os.utime(typed / "pipeline_result.json", (400, 400))
    (root / "stray.txt").write_text("x")
    (root / "empty").mkdir()
    assert main(["runs", "--state-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["state"], r["step"]) for r in rows] == [
        ("run-cut", "interrupted (run it again to resume)", 3),
        ("run-done", "completed", 30),
        ("run-hostile", "interrupted (run it again to resume)", 0),
        ("run-typed", "interrupted (run it again to resume)", 0),
    ]
    assert main(["runs", "--runs-root", str(root)]) == 0
    text = capsys.readouterr().out
    assert "run-done" in text and "30/30" in text and "nvrx-pipeline status RUN_ID" in text
    assert main(["runs", "--state-dir", str(tmp_path / "nothing")]) == 0
    assert "no runs under" in capsys.readouterr().out


def test_one_module_per_command_that_parses_and_prints() -> None:
    """Issue 27: each command lives in a module of flows/cli/ (its parser, its checks,
    its printing), and the modules stay small: the work is in tasks/ and flows/."""
    import argparse
    import inspect

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(EXIT_CODES)
    for name, cmd in sub.choices.items():
        fn = cmd.get_default("fn")
        if fn is None:  # a group (automations apply)
            [inner] = [a for a in cmd._actions if isinstance(a, argparse._SubParsersAction)]
            fn = next(iter(inner.choices.values())).get_default("fn")
        module = inspect.getmodule(fn)
        assert module is not None and module.__name__.startswith("flows.cli."), name
        assert module.__name__ != "flows.cli.common", name
        lines = inspect.getsource(module).count("\n")
        assert lines < 200, f"{module.__name__}: {lines} lines; move the logic to tasks/"


def test_status_takes_the_saved_end_only_when_it_is_one(tmp_path, capsys):
    """The pipeline's saved result is a file of the shared filesystem: a garbled one is no end
    (the events still say the rest), a valid one gives the state, stages and export."""
    run = tmp_path / "fsx" / "runs" / "run-b"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text(
        '{"t": 1, "kind": "step", "step": 3, "loss": 0.5, "step_s": 0.1}\n'
    )
    saved = run / "pipeline_result.json"
    for text, state, export in [
        ('{"status": ["not", "a", "state"]}', "running or interrupted", None),
        ("not json", "running or interrupted", None),
        (
            '{"status": "completed", "stage_durations_s": {"train": 2.5}, '
            '"export": {"uri": "s3://b/p"}, "other": 1}',
            "completed",
            "s3://b/p",
        ),
    ]:
        saved.write_text(text)
        assert main(["status", "run-b", "--run-root", str(run), "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert (st["state"], st["step"], st["export_uri"]) == (state, 3, export)
    assert main(["status", "run-b", "--run-root", str(run)]) == 0
    out = capsys.readouterr().out
    assert "run run-b: completed" in out and "stages: train 2.5 s" in out and "s3://b/p" in out
