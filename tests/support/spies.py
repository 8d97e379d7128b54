"""Spies on a hub handle: what a test counts of its calls (``tests/test_master.py``, ``tests/test_hardening.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["count_downloads"]


def count_downloads(hub: Any) -> dict[str, int]:
    """Count ``hub.download`` calls per path from now on: the returned dict fills as they come."""
    counts: dict[str, int] = {}
    orig = hub.download

    def download(path, **kw):
        counts[path] = counts.get(path, 0) + 1
        return orig(path, **kw)

    hub.download = download
    return counts
