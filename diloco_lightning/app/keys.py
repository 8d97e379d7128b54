"""The keys a command accepts, checked on the command line before Hydra composes anything.

Hydra refuses an unknown key with a hint to prefix it with ``+``; followed, the hint *adds*
the key, which nothing reads: the run starts and the value is silently dropped. So every
``key=value`` argument, with or without ``+`` / ``++`` / ``~``, is checked here against the
command's schema (:mod:`diloco_lightning.app.config`), and an unknown one is refused naming the
closest known key. Keys under a free-form field (``outer.options.*``, ``launch.submitit.*``,
``diloco.delay.*`` ...) are the owner's to check; Hydra's own (``hydra.*``, ``hydra/launcher=``)
are Hydra's.

``diloco-master`` is the ``master``, ``hub`` and ``outer`` sections of a training run laid out at
the top level: :func:`master_aliases` maps ``train.py``'s names (``master.poll_interval=1``) onto
its own (``poll_interval=1``), so the README's form works in both commands.

A value with a further ``=`` (``hub.url=runs/recipe=tiny/hub``: the run folders ``train.py``
names after its overrides) is not a value Hydra's grammar takes unquoted; :func:`quote_values`
quotes it before Hydra parses the command line, so every path a command prints can be pasted
back as printed, and :func:`plain_override` writes it back unquoted in a command it prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from diloco_lightning.app.checks import ConfigError
from diloco_lightning.app.overrides import plain_override, quote_values, split_override

__all__ = ["known_keys", "check_override_keys", "master_aliases", "split_override", "quote_values", "plain_override"]


def _is_free_form(t: Any) -> bool:
    """A field whose value may have keys of its own (a dict, a list, ``Any``)."""
    if t is Any or t is dict or t is list:
        return True
    origin = typing.get_origin(t)
    if origin in (dict, list, typing.Union):
        return origin is not typing.Union or any(_is_free_form(a) for a in typing.get_args(t) if a is not type(None))
    return False


def known_keys(schema: type, prefix: str = "") -> tuple[set[str], set[str]]:
    """``(keys, free)``: every dotted key of ``schema`` (sections included), and the free-form ones
    (below which any key is the field's owner's to check)."""
    from diloco_lightning.app.config import dataclass_of

    keys: set[str] = set()
    free: set[str] = set()
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        keys.add(key)
        sub = dataclass_of(hints.get(f.name, f.type))
        if sub is not None:
            k, fr = known_keys(sub, key + ".")
            keys |= k
            free |= fr
        elif _is_free_form(hints.get(f.name, f.type)):
            free.add(key)
    return keys, free


def _closest(key: str, keys: set[str]) -> str | None:
    leaf = key.rsplit(".", 1)[-1]
    same_section = [k for k in keys if k.rsplit(".", 1)[0] == key.rsplit(".", 1)[0]] if "." in key else []
    for pool in (same_section, sorted(keys)):
        match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if match:
            return match[0]
    by_leaf = [k for k in sorted(keys) if k.rsplit(".", 1)[-1] == leaf]
    return by_leaf[0] if by_leaf else None


def check_override_keys(args: list[str], schema: type, groups: tuple[str, ...], *, aliases: dict[str, str] | None = None
                        ) -> None:
    """Raise :class:`ConfigError` for the first ``key=value`` in ``args`` whose key ``schema`` does not
    have (a config group choice, ``group=option``, is a key too), naming the closest known key."""
    keys, free = known_keys(schema)
    keys |= set(groups)
    for arg in args:
        parts = split_override(arg)
        if parts is None:
            continue
        sign, key, _ = parts
        if not key or key.startswith("hydra") or "/" in key or "@" in key:
            continue  # Hydra's own (hydra.*, hydra/launcher=...), package overrides
        if key in keys or any(key.startswith(f + ".") for f in free):
            continue
        match = _closest(key, keys)
        hint = f"did you mean {match}?" if match else "--help lists every key"
        if aliases and key.split(".", 1)[0] in aliases:
            hint = aliases[key.split(".", 1)[0]] + (f"; did you mean {match}?" if match else "")
        plus = " (a '+' adds a key nothing reads: it is refused too)" if "+" in sign else ""
        raise ConfigError(key, f"unknown key; {hint}{plus}")


def master_aliases(args: list[str], master_keys: set[str]) -> list[str]:
    """``diloco-master`` arguments with ``train.py``'s ``master.<key>`` names mapped to the top level
    (``master.poll_interval=1`` -> ``poll_interval=1``) when ``<key>`` is a master key."""
    out = []
    for arg in args:
        parts = split_override(arg)
        if parts is not None and parts[1].startswith("master."):
            sign, key, value = parts
            inner = key[len("master."):]
            if inner.split(".", 1)[0] in master_keys:
                out.append(f"{sign}{inner}" + (f"={value}" if "=" in arg else ""))
                continue
        out.append(arg)
    return out
