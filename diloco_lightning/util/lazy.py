"""Lazy package exports (PEP 562): a package's public names imported on first use, so importing one
light module of a package (``diloco_lightning.master.config``, ``diloco_lightning.worker.options``)
does not import torch through the package's ``__init__`` (a configuration error is reported without
it: ``benchmarks/restart_time.py``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose name ``n`` lives in module ``exports[n]``;
    a name is imported once, then kept in the package's namespace."""

    def __getattr__(name: str) -> object:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
