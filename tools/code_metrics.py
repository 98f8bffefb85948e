"""The product's size and shape, counted from its own source (issue 41's measures).

Run ``python tools/code_metrics.py`` (``--json`` for a machine-readable copy). Everything is read
with :mod:`ast` from ``flows/``, ``tasks/`` and ``trainer/`` (the installed packages); tests,
benchmarks and tools are not product.

- ``lines``: physical lines of every product module (what ``wc -l`` counts).
- ``import_cycles``: strongly connected groups of product modules in the import graph. Module-level
  imports only (a function-level import is a deliberate late binding; ``lazy`` counts them too).
- ``modules_over_400`` / ``modules_over_500``: by physical lines.
- ``functions_over_80``: functions (or methods) whose body spans more than 80 lines.
- ``event_key_reads``: ``x["field"]`` and ``x.get("field")`` with an event field name as the key
  (every field the event schema declares), in modules that read the event log, outside the
  decoder and the fold.
- ``dict_str_any``: annotations spelled ``dict[str, Any]``.
- ``test_only``: top-level product functions and classes (and their methods) whose name is used by
  tests and nowhere else in the product, nor by the repository's benchmarks and tools. Names are
  matched, not resolved: a name that is also an attribute elsewhere counts as used.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "trainer")
# The decoder and the fold may read event fields by key: they are where dicts become types.
EVENT_READERS = {"trainer.event_types", "trainer.event_read", "trainer.history"}


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(
    module: str, path: Path, tree: ast.Module, names: set[str], *, lazy: bool
) -> set[str]:
    """Product modules ``module`` imports (at module level, or anywhere when ``lazy``)."""
    is_pkg = path.name == "__init__.py"
    body = ast.walk(tree) if lazy else _module_level(tree)
    found: set[str] = set()
    for node in body:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            # The longest product module that the target names (``a.b.c`` may be a name in a.b).
            while t and t not in names:
                t = t.rpartition(".")[0]
            if t and t != module:
                found.add(t)
    return found


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """Module-level statements, including those under ``if``/``try`` (not ``TYPE_CHECKING``)."""
    out: list[ast.AST] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                stack.extend(node.orelse)
                continue
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for h in node.handlers:
                stack.extend(h.body)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def event_fields(trees: dict[str, ast.Module]) -> set[str]:
    """Every field name the event schema declares (annotated class attributes)."""
    fields: set[str] = set()
    for node in ast.walk(trees["trainer.event_types"]):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and target.id != "model_config":
                    fields.add(target.id)
    return fields


def key_reads(tree: ast.Module, fields: set[str]) -> int:
    n = 0
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            literal = isinstance(node.value, ast.Name) and node.value.id == "Literal"
            if isinstance(node.slice, ast.Constant) and not literal:  # a type is not a read
                key = node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
        if isinstance(key, str) and key in fields:
            n += 1
    return n


def _names_used(tree: ast.AST) -> set[str]:
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
            if node.asname:
                used.add(node.asname)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # "module:function" entry points and __all__ strings.
            used.update(node.value.replace(":", ".").split("."))
    return used


def _definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    out: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    dunder = sub.name.startswith("__") if hasattr(sub, "name") else True
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not dunder:
                        out.append((f"{node.name}.{sub.name}", sub))
    return out


def test_only(trees: dict[str, ast.Module], root: Path = ROOT) -> list[str]:
    """Product definitions whose name only tests use."""
    test_names: set[str] = set()
    for path in (root / "tests").rglob("*.py"):
        test_names |= _names_used(ast.parse(path.read_text()))
    # Names used in the product outside each definition's own body, or by the repository's
    # own benchmarks and tools (they run the product; tests only check it).
    uses: dict[str, int] = defaultdict(int)
    for folder in ("benchmarks", "tools"):
        for path in (root / folder).rglob("*.py"):
            for name in _names_used(ast.parse(path.read_text())):
                uses[name] += 1
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                uses[node.id] += 1
            elif isinstance(node, ast.Attribute):
                uses[node.attr] += 1
            elif isinstance(node, ast.alias):
                uses[node.name.rpartition(".")[2]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                for part in node.value.replace(":", ".").split("."):
                    uses[part] += 1
    out: list[str] = []
    for module, tree in trees.items():
        for qual, node in _definitions(tree):
            name = qual.rpartition(".")[2]
            inside = sum(
                1
                for n in ast.walk(node)
                if (isinstance(n, ast.Name) and n.id == name)
                or (isinstance(n, ast.Attribute) and n.attr == name)
            )
            if uses[name] - inside <= 0 and name in test_names:
                out.append(f"{module}.{qual}")
    return sorted(out)


def measure(root: Path = ROOT) -> dict[str, Any]:
    mods = product_modules(root)
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in mods.items()}
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    names = set(mods)
    graph = {m: imports_of(m, mods[m], trees[m], names, lazy=False) for m in mods}
    lazy_graph = {m: imports_of(m, mods[m], trees[m], names, lazy=True) for m in mods}
    long_functions = sorted(
        (f"{m}.{n.name}", n.end_lineno - n.lineno + 1)  # type: ignore[operator]
        for m, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > 80  # type: ignore[operator]
    )
    fields = event_fields(trees)
    # Only modules that read the event log (import its decoder, writer or fold): elsewhere the
    # same names ("step", "t") are keys of other records (manifests, configs).
    event_modules = {
        "trainer.event_read",
        "trainer.event_types",
        "trainer.events",
        "trainer.history",
    }
    reads = {
        m: key_reads(t, fields)
        for m, t in trees.items()
        if m not in EVENT_READERS and lazy_graph[m] & event_modules
    }
    dict_any = {
        m: sum(1 for n in ast.walk(t) if ast.unparse(n) in ("dict[str, Any]", "Dict[str, Any]"))
        for m, t in trees.items()
        if isinstance(t, ast.Module)
    }
    only = test_only(trees, root)
    return {
        "lines": sum(lines.values()),
        "modules": len(mods),
        "modules_over_400": sorted((m, n) for m, n in lines.items() if n > 400),
        "modules_over_500": sorted((m, n) for m, n in lines.items() if n > 500),
        "import_cycles": cycles(graph),
        "import_cycles_with_lazy": cycles(lazy_graph),
        "functions_over_80": long_functions,
        "event_key_reads": sum(reads.values()),
        "event_key_reads_by_module": {m: n for m, n in sorted(reads.items()) if n},
        # The same count in every module: an upper bound (other records share the names).
        "event_key_reads_any_module": sum(
            key_reads(t, fields) for m, t in trees.items() if m not in EVENT_READERS
        ),
        "dict_str_any": sum(dict_any.values()),
        "test_only": only,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the whole measure as JSON")
    ap.add_argument("--root", type=Path, default=ROOT, help="a checkout to measure")
    args = ap.parse_args(argv)
    m: dict[str, Any] = measure(args.root)
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    lazy = len(m["import_cycles_with_lazy"])
    rows = [
        ("product lines", f"{m['lines']} in {m['modules']} modules"),
        ("modules over 400", len(m["modules_over_400"])),
        ("modules over 500", len(m["modules_over_500"])),
        ("import cycles", f"{len(m['import_cycles'])} (with lazy imports: {lazy})"),
        ("functions over 80", len(m["functions_over_80"])),
        (
            "event-key reads",
            f"{m['event_key_reads']} (any module: {m['event_key_reads_any_module']})",
        ),
        ("dict[str, Any]", m["dict_str_any"]),
        ("used only by tests", len(m["test_only"])),
    ]
    for name, value in rows:
        print(f"{name:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
