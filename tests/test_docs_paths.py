"""Every repository path the docs name in backticks exists (README.md, docs/*.md and each package
folder's __init__ docstring), so a file moved in a reorganisation leaves no stale pointer behind.

A token is a path when it contains "/" or ends in a file suffix of this repository; it resolves
from the repository root, from prefixserve/, or, short (`llama.py`, `sched/scheduler.py`), as
the tail of at least one path under prefixserve/, tests/, benchmarks/ or docs/. No model, no
server: this reads text only.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prefixserve"
# Where a short path (a bare file name, `sched/scheduler.py`) may point.
SEARCH_DIRS = ("prefixserve", "tests", "benchmarks", "docs")
FILE_SUFFIXES = (".py", ".md", ".json", ".toml", ".cpp", ".h", ".sh")

FENCE = re.compile(r"^\s*(```|~~~)")
# Inline code, which Markdown lets run across a line break; a path broken there is joined.
CODE_SPAN = re.compile(r"`([^`]+)`")
LINE_BREAK = re.compile(r"\s*\n\s*")
# The skip rules, each a reason a backticked token is not a path in this checkout:
# 1. Anything but letters, digits, `_`, `.`, `-` and `/`: URLs (`:`), globs and placeholders
#    (`serving_*.py`, `<out>/logs/`), home-relative paths (`~`), code and prose (spaces, `=`,
#    `(`), HTTP routes with their method (`GET /metrics`).
PATH_CHARS = re.compile(r"[\w./-]+")
# 2. A leading "/": absolute paths (`/tmp/x`) and HTTP routes (`/v1/models`).
# 3. A leading "../": outside the checkout (`../shared/DESIGN.md`).
OUTSIDE_PREFIXES = ("/", "../")
# 4. Names that end like a file but are no file of this repository: another project, files of
#    a model's or an adapter's directory.
NOT_PATHS = frozenset({"llama.cpp", "adapter_config.json", "prefixserve_conversion.json"})
# 5. A "/" but neither a file suffix nor a trailing "/", and a first segment that names no
#    folder of the repository: ratios and units (`tokens/s`, `hits/lookups`).


@functools.cache
def folder_names() -> frozenset[str]:
    """The names of the root's folders and of every folder under SEARCH_DIRS."""
    top = {path.name for path in ROOT.iterdir() if path.is_dir()}
    return frozenset(
        top | {path.rpartition("/")[2] for path in repo_paths() if (ROOT / path).is_dir()}
    )


def _first_segment_is_folder(token: str) -> bool:
    return token.split("/", 1)[0] in folder_names()


def is_repo_path(token: str) -> bool:
    if not PATH_CHARS.fullmatch(token):
        return False
    if token.startswith(OUTSIDE_PREFIXES) or token in NOT_PATHS:
        return False
    if token.endswith(FILE_SUFFIXES):
        return True
    if "/" not in token:
        return False
    return token.endswith("/") or _first_segment_is_folder(token)


def path_tokens(text: str, first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(line, token) for each backticked repository path in Markdown text, fences skipped."""
    lines = text.splitlines()
    in_fence = False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            in_fence = not in_fence
            lines[i] = ""
        elif in_fence:
            lines[i] = ""
    prose = "\n".join(lines)
    for match in CODE_SPAN.finditer(prose):
        token = LINE_BREAK.sub("", match.group(1)).strip()
        if is_repo_path(token):
            yield first_line + prose.count("\n", 0, match.start()), token


def docstring_text(source: str) -> tuple[int, str] | None:
    """(first line, text) of a module's docstring, or None."""
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.Expr):
        return None
    value = body[0].value
    if not isinstance(value, ast.Constant) or not isinstance(value.value, str):
        return None
    return value.lineno, value.value


def doc_sources() -> Iterator[tuple[str, int, str]]:
    """(name, first line, text) of README.md, docs/*.md and each __init__.py docstring."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield path.relative_to(ROOT).as_posix(), 1, path.read_text()
    for path in sorted(PACKAGE.rglob("__init__.py")):
        found = docstring_text(path.read_text())
        if found is not None:
            yield path.relative_to(ROOT).as_posix(), *found


@functools.cache
def repo_paths() -> list[str]:
    """Every file and folder under SEARCH_DIRS, relative to the root, "/"-separated."""
    paths = []
    for top in SEARCH_DIRS:
        for path in (ROOT / top).rglob("*"):
            if "__pycache__" not in path.parts:
                paths.append(path.relative_to(ROOT).as_posix())
    return paths


def resolves(token: str, known: list[str]) -> bool:
    want_dir = token.endswith("/")
    rel = token.rstrip("/")
    for base in (ROOT, PACKAGE):
        candidate = base / rel
        if candidate.is_dir() if want_dir else candidate.exists():
            return True
    tail = "/" + rel
    return any(path.endswith(tail) and (not want_dir or (ROOT / path).is_dir()) for path in known)


def missing_paths(sources: list[tuple[str, int, str]]) -> list[str]:
    known = repo_paths()
    return [
        f"{name}:{line}: `{token}`"
        for name, first_line, text in sources
        for line, token in path_tokens(text, first_line)
        if not resolves(token, known)
    ]


def test_docs_name_existing_paths() -> None:
    missing = missing_paths(list(doc_sources()))
    assert not missing, "stale paths in the docs (doc:line: path):\n" + "\n".join(missing)


FAKE_DOC = """\
# A doc

`prefixserve/llm.py` and `engine/client.py`, `llama.py`, `sched/scheduler.py`,
`tests/kv_cache/`, `docs/cache.md` and `prefixserve/no_such_module.py` (stale).
Skipped: `https://example.com/a.py`, `serving_*.py`, `<out>/logs/`, `~/.cache/x.json`,
`/tmp/a.py`, `/v1/models`, `GET /metrics`, `../shared/DESIGN.md`, `llama.cpp`, `tokens/s`,
`--flag`, `LLMEngine.step`, `hits/lookups`. Checked too: `sched/gone`.
```bash
python `gone/in_a_fence.py`
```
Across a line break: `core/sched/
  nowhere.py`, then `moved_away.py` and `kv_cache/`, `prefixserve/
engine/client.py`.
"""

FAKE_MODULE = '''\
# a comment first

"""A package.

It names `gone.py` and `core/request.py`.
"""
'''


def test_extractor_finds_stale_paths_and_skips_non_paths() -> None:
    tokens = [token for _, token in path_tokens(FAKE_DOC)]
    assert tokens == [
        "prefixserve/llm.py",
        "engine/client.py",
        "llama.py",
        "sched/scheduler.py",
        "tests/kv_cache/",
        "docs/cache.md",
        "prefixserve/no_such_module.py",
        "sched/gone",
        "core/sched/nowhere.py",
        "moved_away.py",
        "kv_cache/",
        "prefixserve/engine/client.py",
    ]
    module_doc = docstring_text(FAKE_MODULE)
    assert module_doc is not None
    sources = [("fake.md", 1, FAKE_DOC), ("pkg/__init__.py", *module_doc)]
    assert missing_paths(sources) == [
        "fake.md:4: `prefixserve/no_such_module.py`",
        "fake.md:7: `sched/gone`",
        "fake.md:11: `core/sched/nowhere.py`",
        "fake.md:12: `moved_away.py`",
        "pkg/__init__.py:5: `gone.py`",
    ]
    assert docstring_text("x = 1\n") is None
