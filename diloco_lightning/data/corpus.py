"""Text corpora: the Python standard library's own sources (no download) or a user's files.

A corpus is an ordered list of ``CorpusFile`` (path + stable name + size). Its
``corpus_key`` (hash of names and sizes) keys the tokenizer and token caches.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STDLIB_BYTES",
    "CorpusFile",
    "stdlib_corpus",
    "text_corpus",
    "corpus_key",
    "iter_texts",
]

#: Default byte budget for the stdlib corpus. ~12.6 MB of non-test ``.py`` exists in
#: CPython 3.11, so this takes (nearly) all of it; BPE training + encoding takes ~5 s.
DEFAULT_STDLIB_BYTES = 16_000_000

_STDLIB_SUFFIXES = (".py", ".txt", ".rst")
# Skipped because their presence or content depends on how Python was built/packaged
# (tests are stripped by many distros; _sysconfigdata embeds build paths), which would
# make the "same" corpus differ between otherwise identical machines.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "lib-dynload", "idle_test"}
_STDLIB_SKIP_PREFIXES = ("_sysconfigdata", "config-")


@dataclass(frozen=True)
class CorpusFile:
    """One document: ``name`` is stable across machines (stdlib-relative for the stdlib)."""

    path: Path
    name: str
    size: int


def stdlib_corpus(max_bytes: int | None = DEFAULT_STDLIB_BYTES) -> list[CorpusFile]:
    """Standard-library sources (``.py``, plus ``.txt``/``.rst`` docs if present), deterministically.

    Files are ordered by the SHA-1 of their stdlib-relative name (a fixed shuffle, so a
    small budget still samples the whole library, not just modules starting with "a")
    and taken whole while they fit in ``max_bytes``.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(_STDLIB_SKIP_PREFIXES)
        )
        for fn in sorted(filenames):
            if not fn.endswith(_STDLIB_SUFFIXES) or fn.startswith(_STDLIB_SKIP_PREFIXES):
                continue
            p = Path(dirpath) / fn
            size = p.stat().st_size
            if size:  # empty __init__.py files add nothing but cache-key noise
                found.append(CorpusFile(p, p.relative_to(root).as_posix(), size))
    found.sort(key=lambda f: hashlib.sha1(f.name.encode()).hexdigest())
    files = _take_budget(found, max_bytes)
    if not files:
        raise ValueError(f"max_bytes: no stdlib file found under {root} fits in {max_bytes} bytes")
    log.info("stdlib corpus: %d files, %.1f MB from %s", len(files), sum(f.size for f in files) / 1e6, root)
    return files


def text_corpus(patterns: str | Sequence[str], max_bytes: int | None = None) -> list[CorpusFile]:
    """User text files matching glob pattern(s) (``**`` allowed), sorted by path."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [os.fspath(patterns)]
    if not patterns:
        raise ValueError("text_files: empty list of patterns")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes!r}")
    paths: set[Path] = set()
    for pat in patterns:
        paths.update(Path(p).resolve() for p in glob.glob(os.path.expanduser(os.fspath(pat)), recursive=True))
    found = sorted(
        (CorpusFile(p, p.as_posix(), p.stat().st_size) for p in paths if p.is_file() and p.stat().st_size),
        key=lambda f: f.name,
    )
    if not found:
        raise ValueError(f"text_files: no non-empty file matches {list(patterns)!r}")
    files = _take_budget(found, max_bytes)
    if not files:
        raise ValueError(f"max_bytes: no file of text_files fits in {max_bytes} bytes")
    log.info("text corpus: %d files, %.1f MB", len(files), sum(f.size for f in files) / 1e6)
    return files


def _take_budget(files: list[CorpusFile], max_bytes: int | None) -> list[CorpusFile]:
    if max_bytes is None:
        return list(files)
    out, total = [], 0
    for f in files:
        if total + f.size <= max_bytes:
            out.append(f)
            total += f.size
    return out


def corpus_key(files: Sequence[CorpusFile]) -> str:
    """Hash of (name, size) of every file, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.size}\n".encode())
    return h.hexdigest()[:20]


def iter_texts(files: Sequence[CorpusFile]) -> Iterator[str]:
    """Yield each file's text; files that are not valid UTF-8 are skipped (logged)."""
    for f in files:
        try:
            yield f.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            log.debug("skipping non-UTF-8 file %s", f.path)
