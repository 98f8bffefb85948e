"""Every name a benchmark or tool imports from the product still exists.

Benchmarks run only by hand (``benchmarks/gpu_check.sh`` only on a GPU machine), so a rename in
the product would otherwise surface there first: issue 41 left seven of them importing names it
had moved.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("trainer", "tasks", "flows")
SCRIPTS = sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "tools").glob("*.py")])


def product_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from <product module> import name``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] in PRODUCT:
            out += [(node.module, a.name) for a in node.names if a.name != "*"]
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_product_name_a_script_imports_exists(path: Path) -> None:
    missing = []
    for module, name in product_imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"from {module} import {name}")
    assert not missing, f"{path.relative_to(REPO)}: {missing}"
