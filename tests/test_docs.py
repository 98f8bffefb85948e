"""``docs/architecture.md`` against the code it describes, so the doc cannot drift silently.

- every repository path it names in backticks (```flows/parameters.py```, ```deploy/eks/```)
  exists;
- every dotted name it gives for our own code (```tasks.retry_policy.prefect_retry_condition```)
  is a module, or a name defined in one (read with ``ast``: nothing is imported);
- every relative link resolves, down to the heading its ``#anchor`` names;
- it stands on its own: no pointer to notes outside the repository;
- the layering it states holds: ``trainer/`` imports nothing from ``tasks/`` or ``flows/``, and
  ``tasks/`` nothing from ``flows/``.

And the rest of the docs: every file under ``docs/`` resolves its links and paths;
``docs/layout.md`` names every module and top-level directory and nothing the tree lacks; the
README stays a newcomer's page that links every reference page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
DOCS_MD = sorted((REPO / "docs").rglob("*.md"))  # the reference the README links

TOP_DIRS = ("flows", "tasks", "trainer", "deploy", "benchmarks", "tests", "docs", "examples")
PACKAGES = ("flows", "tasks", "trainer")
_PATH = re.compile(rf"(?:{'|'.join(TOP_DIRS)})/[\w./-]*")
_DOTTED = re.compile(rf"(?:{'|'.join(PACKAGES)})(?:\.\w+)+")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> str:
    """The Markdown outside fenced code blocks (diagrams hold run-time paths, not repo paths)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def spans(text: str) -> list[str]:
    """Inline code spans, each split on whitespace (a span may be a command line)."""
    return [word for s in _SPAN.findall(prose(text)) for word in s.split()]


def repo_paths(text: str) -> set[str]:
    return {w.rstrip(".,;:") for w in spans(text) if _PATH.fullmatch(w.rstrip(".,;:"))}


def missing_paths(text: str, root: Path = REPO) -> list[str]:
    return sorted(p for p in repo_paths(text) if not (root / p).exists())


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds: defs, classes, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def resolve_dotted(name: str, root: Path = REPO) -> str | None:
    """None when ``name`` names a module of ours or a name defined in one; else why not."""
    parts = name.split(".")
    # The longest prefix that is a module file or package.
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        module = base.with_suffix(".py")
        if not module.is_file():
            module = base / "__init__.py"
        if module.is_file():
            break
    else:
        return f"{name}: no module {parts[0]}"
    scope: ast.AST = ast.parse(module.read_text())
    for i, attr in enumerate(parts[cut:], start=cut):
        body = getattr(scope, "body", None)
        found = _defined(body) if isinstance(body, list) else {}
        if attr not in found:
            where = ".".join(parts[:i])
            return f"{name}: {where} ({module.relative_to(root)}) defines no {attr!r}"
        scope = found[attr]
    return None


def dotted_names(text: str) -> set[str]:
    return {w.rstrip(".,;:") for w in spans(text) if _DOTTED.fullmatch(w.rstrip(".,;:"))}


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to dashes."""
    out = set()
    for line in prose(markdown).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in _LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            bad.append(f"{target}: {path} does not exist")
        elif anchor and anchor not in anchors(path.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {path.name}")
    return bad


# -- the doc --------------------------------------------------------------------------------------
def test_every_repository_path_named_exists() -> None:
    text = DOC.read_text()
    assert len(repo_paths(text)) > 40, "the extractor found (almost) no paths: is it broken?"
    assert missing_paths(text) == []


def test_every_dotted_name_of_our_code_resolves() -> None:
    names = dotted_names(DOC.read_text())
    assert names, "no dotted names found: is the extractor broken?"
    assert [why for n in sorted(names) if (why := resolve_dotted(n))] == []


def test_every_relative_link_and_anchor_resolves() -> None:
    assert _LINK.search(DOC.read_text()), "no links found"
    assert broken_links(DOC) == []


@pytest.mark.parametrize("internal", ["DESIGN.md", "NVRX_NOTES", "PLATFORM_NOTES", "/work/"])
def test_stands_on_its_own(internal: str) -> None:
    assert internal not in DOC.read_text()


# -- the checkers themselves: each catches what it is for -----------------------------------------
def test_checkers_flag_drift(tmp_path: Path) -> None:
    text = "See `flows/pipeline.py`, `tasks/gone.py` and `python -m trainer.data --verify`.\n"
    assert missing_paths(text) == ["tasks/gone.py"]
    assert "trainer.data" in dotted_names(text)
    assert resolve_dotted("tasks.retry_policy.stage_retry_allowed") is None
    assert resolve_dotted("trainer.resilience.Heartbeat.beat") is None
    assert resolve_dotted("tasks.retry_policy.no_such_thing") is not None
    assert resolve_dotted("flows.nowhere") is not None
    # A path inside a fenced diagram is a run-time path, not the repository's.
    assert missing_paths("```\ntasks/gone.py\n```\n") == []
    doc = tmp_path / "d.md"
    doc.write_text("# A heading (`x`), here\n[a](#a-heading-x-here) [b](#nope) [c](missing.md)\n")
    assert broken_links(doc) == [
        "#nope: no heading #nope in d.md",
        f"missing.md: {(tmp_path / 'missing.md').resolve()} does not exist",
    ]


# -- the layering the doc states -------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"), [("trainer", {"tasks", "flows"}), ("tasks", {"flows"})]
)
def test_arrows_point_one_way(package: str, forbidden: set[str]) -> None:
    offenders = {
        str(p.relative_to(REPO)): sorted(_imports(p) & forbidden)
        for p in sorted((REPO / package).rglob("*.py"))
        if _imports(p) & forbidden
    }
    assert offenders == {}


def test_the_readme_contents_list_every_section_and_resolve() -> None:
    """Issue 27: the README's contents name every section, and every link in it resolves."""
    readme = REPO / "README.md"
    text = readme.read_text()
    contents = text[text.index("Contents (") : text.index("\n## ")]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    sections = set()
    for line in prose(text).splitlines():
        m = re.match(r"(##|###)\s+(.*?)\s*$", line)
        if m:
            sections.add(re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-"))
    assert listed == sections, (sections - listed, listed - sections)
    assert broken_links(readme) == []


def test_the_readme_links_every_reference_page() -> None:
    """The reference moved under docs/ (issues 27 and 41): the README's "Where the reference
    lives" links every file there."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Where the reference lives") :].split("\n## ")[0]
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)(?:#[^)]*)?\)", section))
    assert linked == {p.relative_to(REPO / "docs").as_posix() for p in DOCS_MD}


def test_the_readme_is_a_newcomers_page() -> None:
    """Issue 41: what it is, the two commands (as .ci/run and the Makefile run them), reading
    the report, three things to try, where the reference lives; at most ~300 lines."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    sections = re.findall(r"^## (.*)$", prose(text), re.M)
    assert sections == ["The two commands", "Three things to try next", "Where the reference lives"]
    assert re.search(r"^make run +#", text, re.M) and re.search(r"^make test +#", text, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "### Reading the report and `status`" in text  # tests/helpers.py reads it
    assert missing_paths(text) == []


def test_docs_holds_the_moved_reference() -> None:
    names = {p.name for p in DOCS_MD}
    assert {"metrics.md", "parameters.md", "checkpoints.md", "exports.md"} <= names
    assert {"ownership.md", "trainer.md", "layout.md", "architecture.md", "glossary.md"} <= names


@pytest.mark.parametrize("doc", DOCS_MD, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_docs_file_links_and_paths_resolve(doc: Path) -> None:
    """Every Markdown file under docs/ (issue 27): each relative link and its anchor, every
    repository path it names in backticks, and (issue 41) every dotted name of our code."""
    text = doc.read_text()
    assert broken_links(doc) == [] and missing_paths(text) == []
    assert [why for n in sorted(dotted_names(text)) if (why := resolve_dotted(n))] == []


def test_the_metrics_table_names_every_restart_layer() -> None:
    """Issue 27: the table (docs/metrics.md) listed 3 of the 5 layers a restart is counted
    under."""
    from trainer.events import LAYERS

    row = next(
        line
        for line in (REPO / "docs" / "metrics.md").read_text().splitlines()
        if line.startswith("| `nvrx_restarts_total`")
    )
    assert re.findall(r"`([a-z-]+)`", row.split("|")[3]) == ["layer", *LAYERS]


def test_the_glossary_links_and_paths_resolve() -> None:
    """docs/glossary.md (issue 27): every link and anchor, and every repository path it names."""
    glossary = REPO / "docs" / "glossary.md"
    text = glossary.read_text()
    assert broken_links(glossary) == [] and missing_paths(text) == []
    assert "glossary.md" in (REPO / "README.md").read_text()


# -- docs/layout.md against the tree (issue 41, item 6) --------------------------------------------
LAYOUT = REPO / "docs" / "layout.md"
_ITEM = re.compile(r"^( *)- `([^`]+)`")
# Top-level directories that are not the repository's own: tool caches, build outputs, state.
_NOT_OURS = {"build", "runs"}


def layout_paths(markdown: str) -> list[str]:
    """The paths a nested list names: each item's first code span, under its parents' (two
    spaces of indent per level; a directory's name ends in ``/``)."""
    out: list[str] = []
    parents: list[str] = []
    for line in prose(markdown).splitlines():
        m = _ITEM.match(line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        del parents[depth:]
        path = "".join(parents) + m.group(2)
        out.append(path)
        if path.endswith("/"):
            parents.append(m.group(2))
        else:
            parents.append("")  # a file has no children; keeps the depth count right
    return out


def top_level_dirs(root: Path = REPO) -> set[str]:
    return {
        p.name + "/"
        for p in root.iterdir()
        if p.is_dir()
        and (not p.name.startswith(".") or p.name == ".ci")
        and not p.name.endswith(".egg-info")
        and p.name not in _NOT_OURS
    }


def product_modules(root: Path = REPO) -> set[str]:
    """Every product module and package: a package is its directory (``__init__.py`` aside)."""
    out: set[str] = set()
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            out.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    return out


def layout_drift(markdown: str, root: Path = REPO) -> dict[str, list[str]]:
    named = layout_paths(markdown)
    return {
        "missing from the tree": sorted(p for p in named if not (root / p).exists()),
        "not in the layout": sorted((product_modules(root) | top_level_dirs(root)) - set(named)),
        "named twice": sorted({p for p in named if named.count(p) > 1}),
    }


def test_the_layout_names_every_module_and_nothing_else() -> None:
    drift = layout_drift(LAYOUT.read_text())
    assert drift == {"missing from the tree": [], "not in the layout": [], "named twice": []}


def test_the_layout_checker_flags_drift(tmp_path: Path) -> None:
    for rel in ("trainer/__init__.py", "trainer/a.py", "trainer/sub/__init__.py", "tools/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / ".venv").mkdir()
    text = "- `trainer/`: x\n  - `a.py`: y\n  - `gone.py`: z\n- `tools/`\n"
    assert layout_paths(text) == ["trainer/", "trainer/a.py", "trainer/gone.py", "tools/"]
    assert layout_drift(text, tmp_path) == {
        "missing from the tree": ["trainer/gone.py"],
        "not in the layout": ["trainer/sub/"],
        "named twice": [],
    }


_TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def missing_tests(text: str, root: Path = REPO) -> list[str]:
    """``tests/x.py::name`` references whose file defines no such test (function or class, at
    any depth: parametrized tables keep their name)."""
    missing = []
    for path, name in sorted(set(_TEST_REF.findall(text))):
        file = root / path
        tree = ast.parse(file.read_text()) if file.exists() else None
        names = (
            set()
            if tree is None
            else {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            }
        )
        if name not in names:
            missing.append(f"{path}::{name}")
    return missing


@pytest.mark.parametrize("doc", DOCS_MD, ids=lambda p: p.name)
def test_every_test_a_page_names_exists(doc: Path) -> None:
    """The security page's "held by" column (and any page's test reference) names a real test:
    a boundary whose test was renamed away would read as held."""
    assert missing_tests(doc.read_text()) == []


def test_the_test_reference_checker_flags_drift(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_here():\n    pass\n")
    text = "`tests/test_a.py::test_here`, `tests/test_a.py::test_gone`, `tests/test_b.py::test_x`"
    assert missing_tests(text, tmp_path) == [
        "tests/test_a.py::test_gone",
        "tests/test_b.py::test_x",
    ]


def test_the_run_root_listing_names_every_layout_path() -> None:
    """architecture.md's run-root listing (section 3) against ``trainer.rundir.Layout``, where
    every run-root path is named once: a file added there is listed here too."""
    from trainer.rundir import Layout

    listing = DOC.read_text().split("  runs/<run_id>/\n", 1)[1].split("```", 1)[0]
    paths = {name: p for name, p in vars(Layout).items() if isinstance(p, Path)}
    assert "DEPLOYMENT" in paths  # tasks.ownership.binding's record
    unlisted = {name: str(p) for name, p in paths.items() if p.name not in listing}
    assert unlisted == {}, f"not in architecture.md's runs/<run_id>/ listing: {unlisted}"
