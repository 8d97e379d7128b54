"""The environment of a subprocess that runs this checkout's code (``train.py``, a command, a
racing hub writer): ``PYTHONPATH`` starts at the repository root (not at an installed copy), and
with a test's ``tmp_path`` the caches are the test's own."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOT", "TESTS", "SUPPORT", "repo_env"]

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent


def repo_env(tmp_path: Path | None = None, *, cache: Path | None = None, base: dict[str, str] | None = None,
             **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with the repository root first on ``PYTHONPATH``.

    Given ``tmp_path``: the tokenizer and token cache (``DILOCO_CACHE_DIR``: ``cache``, default
    ``tmp_path/cache``) and the hubs' download cache (``DILOCO_CACHE``: ``tmp_path/hubcache``) are
    private to the test, and ``HYDRA_FULL_ERROR`` is dropped (a user error is the one or two lines
    a user sees). ``extra``: set last.
    """
    env = dict(base if base is not None else os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    if tmp_path is not None:
        env["DILOCO_CACHE_DIR"] = str(cache if cache is not None else tmp_path / "cache")
        env["DILOCO_CACHE"] = str(tmp_path / "hubcache")
        env.pop("HYDRA_FULL_ERROR", None)
    env.update(extra)
    return env
