"""The command line's ``key=value`` words as strings: split, quoted for Hydra, unquoted for a user.

Pure string functions (no schema, no Hydra), so that the modules that print commands
(:mod:`diloco_lightning.app.launches`) and the ones that check keys (:mod:`diloco_lightning.app.keys`)
share them without importing each other.
"""

from __future__ import annotations

__all__ = ["plain_override", "quote_values", "split_override"]


def split_override(arg: str) -> tuple[str, str, str] | None:
    """``("+", "outer.lr", "0.1")`` for ``+outer.lr=0.1``; None for a flag or a bare word."""
    if arg.startswith("-") or "=" not in arg and not arg.startswith("~"):
        return None
    head, _, value = arg.partition("=")
    sign = head[: len(head) - len(head.lstrip("+~"))]
    return sign, head[len(sign):], value


_QUOTES = ("'", '"')


def _needs_quotes(value: str) -> bool:
    """A value Hydra would refuse for its ``=`` and that means one string: not already quoted, not a
    list, a dict or an interpolation of Hydra's grammar."""
    return "=" in value and value[:1] not in _QUOTES + ("[", "{", "$") and not (set(value) >= set(_QUOTES))


def quote_values(args: list[str]) -> list[str]:
    """``args`` with each ``key=value`` whose value holds a further ``=`` quoted for Hydra
    (``hub.url=runs/recipe=tiny/hub`` -> ``hub.url='runs/recipe=tiny/hub'``); everything else as given."""
    out = []
    for arg in args:
        parts = split_override(arg)
        if parts is not None and "=" in arg and _needs_quotes(parts[2]):
            sign, key, value = parts
            q = '"' if "'" in value else "'"
            arg = f"{sign}{key}={q}{value}{q}"
        out.append(arg)
    return out


def plain_override(arg: str) -> str:
    """The form of ``arg`` a user types: a value :func:`quote_values` quoted, unquoted again."""
    parts = split_override(arg)
    if parts is None or "=" not in arg:
        return arg
    sign, key, value = parts
    if len(value) >= 2 and value[0] in _QUOTES and value[-1] == value[0] and _needs_quotes(value[1:-1]) \
            and value[0] not in value[1:-1]:
        return f"{sign}{key}={value[1:-1]}"
    return arg
