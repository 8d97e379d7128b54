"""Docs name only code that exists: every ``diloco_lightning.x.y`` name and every ``path/file.py: Name``
reference in ``README.md``, ``docs/*.md`` and the package's docstrings must resolve.

* A dotted name is imported (the longest importable module prefix) and the rest looked up as
  attributes, so a re-export counts (the old flat paths, ``diloco_lightning.deltafile``, are gone).
* A file path (``worker/core.py``, ``diloco_lightning/hub/s3.py``, ``benchmarks/study.py``: relative to
  the package or to the repository) must exist; ``path.py: Name`` or ``path.py: Class.attr`` must be
  defined in it (a function, a class, a module-level name, an import, a method, or an attribute the
  class's methods set on ``self``).
* A bare file name in backticks (```read.py```, ```nodeclaim.py's```) must be a file of this repository,
  and a ``.md`` page named (``SPEC.md``, ``docs/spec.md``) must exist in it.
* ```module.name``` (``compression.encode_delta``: the first layout's flat module names) must be a
  configuration key (``diloco.claim_ttl``) or a package module's (or folder's) name."""

from __future__ import annotations

import ast
import functools
import os
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
    ("`diloco_lightning.deltafile` still imports", False),  # the first layout's flat paths are gone
])
def test_the_checker_sees_what_it_should(text, ok):
    found = [m.group(1) for m in DOTTED.finditer(text) if not _resolve_dotted(m.group(1))]
    found += [p for m in PATH_REF.finditer(text) if (p := _resolve_path_ref(m.group(1), m.group(2)))]
    assert (not found) == ok, found


# ----------------------------------------------------------------------------- bare file names, pages, module.name

BARE_PY = re.compile(r"`([A-Za-z_]\w*\.py)(?:'s)?\b")
MD_REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")
MODULE_NAME = re.compile(r"`~?([a-z_]\w*)\.([A-Za-z_]\w*)(?:\(\))?`")
#: files named that are not this repository's, and why
FOREIGN_FILES = {
    "main.py": "a user's training script (docs/plugin.md)",
    "outer.py": "Speedtronic's module (master/compat.py)",
    "diloco.py": "Speedtronic's module (master/compat.py)",
    "tensors.py": "Speedtronic's module (master/compat.py)",
    "summary.md": "the table diloco_lightning.app.summarize writes into a results folder",
}


@functools.lru_cache(maxsize=None)
def _repo_files(suffix: str) -> frozenset[str]:
    """The names of the repository's files ending in ``suffix``: one walk, its run folders and hidden
    folders (``.git``) not entered."""
    names: set[str] = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in {"runs", "outputs", "__pycache__"}]
        names.update(f for f in files if f.endswith(suffix))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _config_keys() -> frozenset[str]:
    from diloco_lightning.app.config import MasterCommandConf, TrainConf, describe

    return frozenset(k for schema in (TrainConf, MasterCommandConf) for k, _, _ in describe(schema))


@functools.lru_cache(maxsize=None)
def _package_names() -> tuple[frozenset[str], frozenset[str]]:
    """(module stems and folder names of the package, names every module defines at its top level)."""
    places = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    defined = set()
    for p in PACKAGE.rglob("*.py"):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
    return frozenset(places), frozenset(defined)


def _more_problems(text: str) -> list[str]:
    """What a text names that is missing: a bare ``x.py`` no file of the repository is, a ``.md`` page
    that is not here, or ``module.name`` (a name the package defines) under a module that does not exist."""
    bad = []
    py_files, md_files = _repo_files(".py"), _repo_files(".md")
    for m in BARE_PY.finditer(text):
        if m.group(1) not in py_files and m.group(1) not in FOREIGN_FILES:
            bad.append(f"no file {m.group(1)}")
    for m in MD_REF.finditer(text):
        path = m.group(1)
        if "/" in path:
            if not (ROOT / path.split("/")[0]).is_dir():
                continue  # another repository's (shared/SPEC.md: where the contract came from)
            if not (ROOT / path).is_file():
                bad.append(f"no page {path}")
        elif path not in md_files and path not in FOREIGN_FILES:
            bad.append(f"no page {path}")
    places, defined = _package_names()
    keys = _config_keys()
    for m in MODULE_NAME.finditer(text):
        mod, name = m.groups()
        if mod in places or mod in ("cfg", "diloco_lightning") or name not in defined:
            continue
        if f"{mod}.{name}" in keys or any(k.startswith(f"{mod}.{name}.") for k in keys):
            continue  # a configuration key
        bad.append(f"no module {mod} (for {mod}.{name})")
    return bad


def test_docs_name_only_files_pages_and_modules_that_exist():
    bad = sorted({f"{where}: {p}" for where, text in _sources() for p in _more_problems(text)})
    assert not bad, "references to files, pages or modules that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("`deltafile.read_delta` (`deltaread.py`) checks", False),  # the first layout's names
    ("(`nodeclaim.py: NodeReport`)", False),
    ("`compression.encode_delta` + `deltafile.write_delta`", False),
    ("the contract (SPEC.md, \"Hub layout\")", False),
    ("the contract (docs/spec.md, \"Hub layout\"; given as shared/SPEC.md)", True),
    ("`read.py` and `wire/claims.py: NodeReport`; `diloco.claim_ttl`, `sim.rebase`", True),
    ("`encoding/feedback.py: encode_delta`, `feedback.encode_delta`", True),
])
def test_the_second_checker_sees_what_it_should(text, ok):
    found = _more_problems(text)
    found += [p for m in PATH_REF.finditer(text) if "/" in m.group(1) and (p := _resolve_path_ref(m.group(1), m.group(2)))]
    assert (not found) == ok, found
