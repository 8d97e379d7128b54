"""How option dataclasses are written: one field per option with its default and help text,
one ``validate()`` that raises :class:`OptionError` naming the option.

The library's option sets (:class:`~diloco_lightning.master.config.MasterConfig`,
:class:`~diloco_lightning.worker.options.WorkerOptions`) are defined once, beside their
owner; the Hydra product (``diloco_lightning.app.config``) composes them into its schema
with its own defaults, and reports an :class:`OptionError` with the key's full name.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, field, fields
from typing import Any

from diloco_lightning.util.errors import ConfigError

__all__ = ["OptionError", "option", "default_of", "check_number", "check_choice"]


class OptionError(ConfigError):
    """An option out of range; ``option`` names it, the message says what is wanted."""

    def __init__(self, option: str, detail: str, message: str | None = None) -> None:
        self.option = option
        super().__init__(option, detail, message or f"{option} {detail}")


def option(default: Any = None, help: str = "", *, factory: Any = None) -> Any:  # noqa: A002 - the option's help
    """A dataclass field with its default (or ``factory``) and the one line of help users read."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def default_of(options: type, name: str) -> Any:
    """The default of option ``name`` of the option dataclass ``options`` (where other code needs
    the value, it reads it from here: each default is written once)."""
    for f in fields(options):
        if f.name == name:
            if f.default_factory is not MISSING:
                return f.default_factory()
            if f.default is MISSING:
                raise TypeError(f"{options.__name__}.{name} has no default")
            return f.default
    raise TypeError(f"{options.__name__} has no option {name!r}")


def check_number(obj: Any, name: str, *, low: float, strict: bool = False, optional: bool = False,
                 integer: bool = False) -> None:
    """``getattr(obj, name)`` is a finite number (an int when ``integer``) above ``low`` (or at
    least it, unless ``strict``), or None when ``optional``; else :class:`OptionError`."""
    v = getattr(obj, name)
    if v is None and optional:
        return
    ok = (
        not isinstance(v, bool)
        and isinstance(v, (int, float))
        and (not integer or isinstance(v, int))
        and math.isfinite(v)
        and (v > low if strict else v >= low)
    )
    if not ok:
        want = f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {low}" + (" or None" if optional else "")
        raise OptionError(name, f"must be {want}, got {v!r}")


def check_choice(obj: Any, name: str, choices: tuple[str, ...] | list[str]) -> None:
    v = getattr(obj, name)
    if v not in choices:
        raise OptionError(name, f"must be one of {list(choices)}, got {v!r}")
