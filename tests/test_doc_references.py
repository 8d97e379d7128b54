"""Docs name only code that exists: every ``diloco_lightning.x.y`` name and every ``path/file.py: Name``
reference in ``README.md``, ``docs/*.md`` and the package's docstrings must resolve.

* A dotted name is imported (the longest importable module prefix) and the rest looked up as
  attributes, so a re-export or an old import path (``util/aliases.py``) counts.
* A file path (``worker/core.py``, ``diloco_lightning/hub/s3.py``, ``benchmarks/study.py``: relative to
  the package or to the repository) must exist; ``path.py: Name`` or ``path.py: Class.attr`` must be
  defined in it (a function, a class, a module-level name, an import, a method, or an attribute the
  class's methods set on ``self``)."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

import diloco_lightning

PACKAGE = Path(diloco_lightning.__file__).resolve().parent
ROOT = PACKAGE.parent

DOTTED = re.compile(r"(?<![\w/.])~?(diloco_lightning(?:\.[A-Za-z_]\w*)+)")
# a file path, optionally followed by ": Name" or ": Class.attr" (a call's "()" allowed)
PATH_REF = re.compile(r"(?<![\w/.-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_]\w*\.py)(?::\s*`?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?")
TOP = ("diloco_lightning", "benchmarks", "tests", "docs")


def _sources() -> list[tuple[str, str]]:
    """``(where, text)`` of every doc page and docstring checked."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for p in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(p.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    name = getattr(node, "name", "")
                    out.append((f"{p.relative_to(ROOT)}{':' + name if name else ''} (line {getattr(node, 'lineno', 1)})", doc))
    return out


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _file(path: str) -> Path | None:
    for base in (ROOT, PACKAGE):
        p = base / path
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def _names(path: Path) -> dict[str, set[str]]:
    """Module-level names of a file (key ""), and each class's attributes (key: the class)."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {"": set()}

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return [(a.asname or a.name).split(".")[0] for a in node.names]
        return []

    for node in tree.body:
        out[""].update(targets(node))
        if isinstance(node, ast.ClassDef):
            attrs = out.setdefault(node.name, set())
            for item in node.body:
                attrs.update(targets(item))
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Attribute,)) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store):
                    attrs.add(sub.attr)
    return out


def _resolve_path_ref(path: str, name: str | None) -> str | None:
    """None when the reference resolves, else what is missing."""
    p = _file(path)
    if p is None:
        return f"no file {path}"
    if not name:
        return None
    names = _names(p)
    head, _, rest = name.partition(".")
    if head not in names[""]:
        return f"{path} defines no {head}"
    if rest and head in names:
        attr = rest.split(".")[0]
        if attr not in names[head]:
            return f"{path}: {head} has no {attr}"
    return None


def _problems() -> list[str]:
    bad = []
    for where, text in _sources():
        for m in DOTTED.finditer(text):
            if not _resolve_dotted(m.group(1)):
                bad.append(f"{where}: {m.group(1)}")
        for m in PATH_REF.finditer(text):
            path, name = m.group(1), m.group(2)
            if "/" not in path:
                # a bare file name: checked when it names a Name and is one file of the package
                # ("fragments.py: build_plan"); else it is prose ("train.py: error: ...", "setup.py")
                found = sorted(PACKAGE.rglob(path))
                if name is None or len(found) != 1:
                    continue
                path = str(found[0].relative_to(PACKAGE))
            if path.split("/")[0] not in TOP and not _file(path):
                if "/" not in path or not (PACKAGE / path.split("/")[0]).is_dir():
                    continue  # a path outside this repository (a user's script, another project's file)
            problem = _resolve_path_ref(path, name)
            if problem:
                bad.append(f"{where}: {problem}")
    return sorted(set(bad))


def test_docs_and_docstrings_name_only_what_exists():
    bad = _problems()
    assert not bad, "references to code that does not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("see `worker/core.py: DiLoCoWorker.boundary()`", True),
    ("see `worker/core.py: DiLoCoWorker.no_such_method`", False),
    ("see `master/nothing_here.py`", False),
    ("see `diloco_lightning.master.MasterOuterLoop`", True),
    ("see :class:`~diloco_lightning.master.validation.NoSuchThing`", False),
    ("`diloco_lightning.deltafile` still imports", True),  # an old path (util/aliases.py)
])
def test_the_checker_sees_what_it_should(text, ok):
    found = [m.group(1) for m in DOTTED.finditer(text) if not _resolve_dotted(m.group(1))]
    found += [p for m in PATH_REF.finditer(text) if (p := _resolve_path_ref(m.group(1), m.group(2)))]
    assert (not found) == ok, found
