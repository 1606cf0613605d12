"""The written reference stays true to the tree: every path a Note, docstring or comment names
exists, every Note cited is written somewhere (in the file it is cited in, where one is named),
every ``:mod:`` / ``:func:`` / ``:class:`` reference with a module resolves, the
glossary (``docs/concepts.md``) names files that exist, one concept per heading, at most 25, and
the pages a user reads (``README.md`` and every page of ``docs/``, :data:`PAGES`) cite only paths,
Notes and links that exist, every page linked from the README (their code blocks run in
``tests/docs/test_readme.py``). Reads files only: no model runs, about a second."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
SOURCES = ("lightning_swap", "accelerate_swap", "tests", "benchmarks", "examples")
CONCEPTS = ROOT / "docs" / "concepts.md"
MAX_CONCEPTS = 25
#: The pages a user reads: the README, then every page of ``docs/``.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

#: A path the text names: ``engine/offload.py``, ``core/scale/auto.py``, ``benchmarks/RESULTS.md``
#: (the first part one of the tree's folders), or a bare file name in double backquotes.
_TREE_DIRS = ("lightning_swap", "accelerate_swap", "core", "engine", "measure", "decide", "runtime", "scale", "unified",
              "tests", "benchmarks", "examples", "docs")
_PATH = re.compile(r"(?<![\w/.\-])((?:%s)/(?:[\w\-]+/)*[\w\-]+\.(?:py|md))\b" % "|".join(_TREE_DIRS))
_BARE = re.compile(r"``([\w\-]+\.(?:py|md))``")
_NOTE = re.compile(r"Note\s+\[([^\]]+)\]")
_NOTE_IN = re.compile(r"Notes?\s+\[([^\]]+)\](?:,?\s+and\s+\[([^\]]+)\])?(?:\s+\([^)]*\))?,?\s+in\s+``([^`]+)``")
_DEFINED = re.compile(r"^[ \t]*(?:[rf]?\"\"\")?[ \t]*Note \[([^\]]+)\][:,]", re.M)
_ROLE = re.compile(r":(mod|func|class|meth|data|attr|exc):`~?(\.?[\w.]+)`")


def _title(text: str) -> str:
    return " ".join(text.split())


@lru_cache(maxsize=None)
def _files() -> tuple[str, ...]:
    """Every file of the tree, relative to its root (no environments, caches or git)."""
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", "node_modules"}
    return tuple(sorted(
        p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    ))


@lru_cache(maxsize=None)
def _sources() -> dict[str, str]:
    """Each Python file under :data:`SOURCES` but this one (whose examples are dead on purpose),
    its comment markers and string joins removed at line starts, so that a Note's title or a path
    broken over two lines reads as one."""
    out = {}
    for rel in _files():
        if rel.endswith(".py") and rel.split("/")[0] in SOURCES and ROOT / rel != Path(__file__).resolve():
            text = (ROOT / rel).read_text()
            text = re.sub(r"\"[ \t]*\n[ \t]*f?\"", "", text)  # "implicit " "string joins"
            out[rel] = re.sub(r"\n[ \t]*#:?[ \t]?", "\n", text)
    return out


def resolves(path: str) -> list[str]:
    """The files of the tree that ``path`` names: itself, or any file it is the tail of."""
    path = path.removeprefix("./")
    return [f for f in _files() if f == path or f.endswith("/" + path)]


def dead_paths(text: str) -> list[str]:
    """The paths ``text`` names that name no file of the tree."""
    found = {m.group(1) for m in _PATH.finditer(text)} | {m.group(1) for m in _BARE.finditer(text)}
    return sorted(p for p in found if not resolves(p))


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@pytest.mark.slow
def test_no_note_or_docstring_names_a_path_that_is_gone():
    dead = [f"{rel}:{_line(text, text.find(p))}: {p}" for rel, text in _sources().items() for p in dead_paths(text)]
    assert not dead, "paths that name no file (fix them to the current file):\n" + "\n".join(dead)


@lru_cache(maxsize=None)
def _defined() -> dict[str, set[str]]:
    """Each Note's title and the files that write it (the Note's title and a colon opening a line)."""
    out: dict[str, set[str]] = {}
    for rel, text in _sources().items():
        for m in _DEFINED.finditer(text):
            out.setdefault(_title(m.group(1)), set()).add(rel)
    return out


def test_every_note_cited_is_written_somewhere():
    missing = sorted({
        f"{rel}:{_line(text, m.start())}: Note [{_title(m.group(1))}]"
        for rel, text in _sources().items() for m in _NOTE.finditer(text) if _title(m.group(1)) not in _defined()
    })
    assert not missing, "Notes cited but written nowhere:\n" + "\n".join(missing)


def test_a_note_cited_in_a_file_is_in_that_file():
    wrong = []
    for rel, text in _sources().items():
        for m in _NOTE_IN.finditer(text):
            targets = resolves(m.group(3).split("::")[0])
            for title in filter(None, (m.group(1), m.group(2))):
                cited = _title(title)
                if targets and not any(cited in _title(_sources().get(t, "")) for t in targets):
                    wrong.append(f"{rel}:{_line(text, m.start())}: Note [{cited}] in {m.group(3)}")
    assert not wrong, "Notes cited in a file that does not hold them:\n" + "\n".join(wrong)


@lru_cache(maxsize=None)
def _module_names(rel: str) -> frozenset[str]:
    """The names a module defines, imports or lists in ``__all__`` at its top level (and, for a
    package, its modules)."""
    path = ROOT / rel
    names = set()
    if path.is_dir():
        names.update(p.stem for p in path.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
        path = path / "__init__.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                    names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _modules(dotted: list[str]) -> list[str]:
    """The files or packages of the tree whose dotted path ends with ``dotted``."""
    tail = "/".join(dotted)
    return [
        f.removesuffix("/__init__.py") if f.endswith("/__init__.py") else f
        for f in _files() if f.split("/")[0] in ("lightning_swap", "accelerate_swap")
        and (f.endswith(f"/{tail}.py") or f == f"{tail}.py" or f.endswith(f"/{tail}/__init__.py") or f == f"{tail}/__init__.py")
    ]


def reference_resolves(role: str, target: str) -> bool:
    """Whether a Sphinx reference names something of the tree: ``:mod:`` a module (relative, or
    under ``lightning_swap`` / ``accelerate_swap``), other roles a name defined in the module its
    dotted prefix names. A name with no module part, or outside the tree, is not checked."""
    target = target.removeprefix("~")
    relative = target.startswith(".")
    parts = target.lstrip(".").split(".")
    if not relative and parts[0] not in ("lightning_swap", "accelerate_swap"):
        return True
    if role == "mod":
        return bool(_modules(parts))
    for k in range(len(parts) - 1, 0, -1):
        modules = _modules(parts[:k])
        if modules:
            return any(parts[k] in _module_names(m) for m in modules)
    return not relative or len(parts) == 1


def test_every_sphinx_reference_to_a_module_resolves():
    dead = [
        f"{rel}:{_line(text, m.start())}: :{m.group(1)}:`{m.group(2)}`"
        for rel, text in _sources().items() for m in _ROLE.finditer(text) if not reference_resolves(m.group(1), m.group(2))
    ]
    assert not dead, "references to modules or names that are gone:\n" + "\n".join(dead)


@pytest.mark.parametrize("text, dead", [
    ("Note [A throughput search that can only win] in ``core/scale.py``", ["core/scale.py"]),
    ("``core/profiler.py`` and ``core/scale/batch_search.py``", ["core/profiler.py"]),
    ("see ``no_such_module.py`` and ``trace.py``", ["no_such_module.py"]),
    ("``path/to/file.py:factory`` is how a user names a file", []),
])
def test_a_dead_path_is_found(text, dead):
    assert dead_paths(text) == dead


@pytest.mark.parametrize("role, target, ok", [
    ("mod", ".costs", False), ("mod", ".observe", True), ("func", "~.costmodel.simulate", True),
    ("func", "~.costmodel.no_such_function", False), ("class", "lightning_swap.core.SwapSession", True), ("mod", "logging", True),
])
def test_a_dead_reference_is_found(role, target, ok):
    assert reference_resolves(role, target) is ok


def _concepts() -> dict[str, str]:
    """Each ``### Concept`` of the glossary and its text."""
    sections = re.split(r"^### +(.+)$", CONCEPTS.read_text(), flags=re.M)
    return {name.strip(): body.split("\n## ")[0] for name, body in zip(sections[1::2], sections[2::2])}


def test_every_concept_names_a_file_that_exists():
    concepts = _concepts()
    assert 0 < len(concepts) <= MAX_CONCEPTS, f"{len(concepts)} concepts: the glossary keeps to the ones a newcomer must learn"
    for name, body in concepts.items():
        where = [line for line in body.splitlines() if line.startswith("Where:")]
        assert len(where) == 1, f"{name!r}: one 'Where:' line naming its files"
        paths = re.findall(r"`([\w\-/.]+\.(?:py|md))`", where[0])
        assert paths, f"{name!r}: its 'Where:' line names no file"
        missing = [p for p in paths if not (ROOT / p).is_file()]
        assert not missing, f"{name!r} names files that do not exist: {missing}"


def test_the_glossary_cites_only_notes_that_are_written_and_is_linked_from_the_readme():
    text = CONCEPTS.read_text()
    missing = sorted({_title(t) for t in _NOTE.findall(text) if _title(t) not in _defined()})
    assert not missing, f"the glossary cites Notes written nowhere: {missing}"
    assert not dead_paths(text), dead_paths(text)
    assert "docs/concepts.md" in (ROOT / "README.md").read_text()


#: Markdown: ``Note [A]`` or ``Notes [A], [B] and [C]``, then maybe ``in `file` and `file` ``.
_MD_NOTES = re.compile(r"Notes?\s+((?:\[[^\]]+\](?:,\s*|,?\s+and\s+)?)+)(?:\([^)]*\)\s*)?(?:,?\s+in\s+((?:`[^`]+`(?:,?\s+(?:and\s+)?)?)+))?")
#: A Markdown link's target, its ``#anchor`` dropped.
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def page_problems(text: str, rel: str = "README.md") -> list[str]:
    """What the page at ``rel`` (from the root) cites in ``text`` that does not exist: a path, a
    Note (anywhere, or in the files it is said to be in), a relative link."""
    folder = (ROOT / rel).parent
    problems = [f"{rel}: names {p}, no such file" for p in dead_paths(text)]
    for m in _MD_NOTES.finditer(text):
        named = re.findall(r"`([^`]+)`", m.group(2) or "")
        files = [f for path in named for f in resolves(path)]
        for title in map(_title, re.findall(r"\[([^\]]+)\]", m.group(1))):
            if title not in _defined():
                problems.append(f"{rel}:{_line(text, m.start())}: Note [{title}] is written nowhere")
            elif files and not any(title in _title(_sources().get(f, "")) for f in files):
                problems.append(f"{rel}:{_line(text, m.start())}: Note [{title}] is not in {named}")
    for target in _MD_LINK.findall(text):
        if "://" not in target and not (folder / target).exists():
            problems.append(f"{rel}: links to {target}, no such file")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_a_page_cites_only_paths_notes_and_links_that_exist(page):
    problems = page_problems(page.read_text(), page.relative_to(ROOT).as_posix())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, rel, problems", [
    ("Note [Finding the blocks] in `core/segments.py`", "README.md", []),
    ("Note [Finding the blocks] in `core/scale/auto.py`", "README.md", ["README.md:1: Note [Finding the blocks] is not in ['core/scale/auto.py']"]),
    ("Notes [Finding the\nblocks] and [No such note]", "docs/x.md", ["docs/x.md:1: Note [No such note] is written nowhere"]),
    ("[the glossary](concepts.md), [the same](docs/concepts.md)", "docs/x.md", ["docs/x.md: links to docs/concepts.md, no such file"]),
    ("[the glossary](docs/concepts.md#step), [a site](https://example.org/a.md)", "README.md", []),
    ("`core/no_such.py`", "README.md", ["README.md: names core/no_such.py, no such file"]),
])
def test_a_dead_citation_in_a_page_is_found(text, rel, problems):
    assert page_problems(text, rel) == problems


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert not [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
