"""constraints.txt pins what `make` installs: every dependency of pyproject.toml, at a version its
range allows, so a fresh machine gets the versions the suite ran with."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_is_pinned_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    pins = _pins()
    for req in reqs:
        name = canonicalize_name(req.name)
        if name == "torch":  # the Makefile's TORCH_SPEC: the CPU build, never from this file
            assert name not in pins
            continue
        assert name in pins, f"{req.name} is not in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"
        )
    assert "pip" in pins  # an old pip is upgraded to this one first


def test_make_installs_with_the_constraints():
    makefile = (REPO / "Makefile").read_text()
    installs = [ln for ln in makefile.splitlines() if "pip install" in ln]
    assert installs and all("-c constraints.txt" in ln for ln in installs)
