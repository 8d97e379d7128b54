"""JSON documents read from a hub: parsed with bounds on size and depth, or refused with a reason.

Every JSON document a hub holds (the manifest, the lease, a node's claim, Speedtronic's
``step_count.json``, a safetensors file's header) was written by someone the reader does not
trust. ``json.loads`` alone is not enough for such bytes: a 60 KB document of nested brackets
makes it raise ``RecursionError`` (not a ``ValueError``: every caller that meant to turn a bad
document into a rejection let it through, and one manifest halted every round), it accepts
``NaN`` and ``Infinity``, and it reads a document of any size. :func:`load_json` checks, in
this order and in time linear in the size:

1. the size, against ``max_bytes`` (before anything is decoded);
2. the text is UTF-8;
3. the nesting depth of arrays and objects, against ``max_depth``, by one scan that skips the
   strings (a bracket inside a string does not count), so the parser never recurses deeper. The
   scan is one pass: each of its tokens (a string, a bracket, a run of anything else) starts where
   the last one ended and always matches, an unterminated string included (it runs to the end), so
   no text is read twice. (It used to try a string at every quote and fail at the end of the text:
   24 KB of escaped quotes, ``"\\"\\"...``, took n²/2 steps and froze a master for 5.7 s.);
4. the JSON itself, without the non-standard constants ``NaN``, ``Infinity`` and ``-Infinity``,
   without numbers too large for a float (``1e999`` would read as infinity), and with every
   number bounded in digits: an integer of at most :data:`MAX_INT_DIGITS` digits (Python reads
   4,300; a 401-digit one passed, and the first ``math.isfinite``, ``float()`` or ``:.3g`` of
   it raised ``OverflowError``, which no caller expects) and a float finite.

Any failure is a :class:`JSONDocumentError` (a ``DiLoCoError`` and a ``ValueError``) naming the document and what is
wrong with it; the caller turns it into its documented rejection (a replaced manifest, an
expired lease, an ignored claim). Every number it returns converts to a finite float.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from diloco_lightning.util.errors import DiLoCoError

__all__ = ["JSONDocumentError", "load_json", "DEFAULT_MAX_DEPTH", "MAX_INT_DIGITS", "finite_json", "dumps_json"]

#: deeper than any document this package writes (a manifest is 4 levels, a claim 3)
DEFAULT_MAX_DEPTH = 32

#: the most digits of an integer (2**64 has 20): its magnitude stays below 1e20, a float converts it
MAX_INT_DIGITS = 20

# What the depth scan drops: a JSON string, escapes included, closed by its quote or, unterminated,
# by the end of the text (a lone backslash there too), or a run of any character but a bracket and
# a quote. One of the two matches wherever a quote or such a character stands, and a string's
# match never backtracks (each character is either ordinary or one escape pair): one pass, linear.
_NOT_BRACKETS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[^\[\]{}"]+', re.DOTALL)
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONDocumentError(DiLoCoError, ValueError):
    """A JSON document that is too large, too deep, not UTF-8 or not JSON."""


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:40]} is not a finite number")
    return x


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits ({text[:20]}...), more than the {MAX_INT_DIGITS} allowed")
    return int(text)


def load_json(data: str | bytes, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH, what: str = "document") -> Any:
    """The document ``data`` holds, checked as the module docstring says (``JSONDocumentError``)."""
    size = len(data)  # characters of a str (at most as many as its UTF-8 bytes)
    if size > max_bytes:
        raise JSONDocumentError(f"{what}: {size} bytes, more than the {max_bytes} such a document may have")
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONDocumentError(f"{what}: not UTF-8 ({e.reason} at byte {e.start})") from None
    else:
        text = data
    brackets = _NOT_BRACKETS.sub("", text)  # the brackets outside strings
    if brackets and max(accumulate(map(_STEP.__getitem__, brackets))) > max_depth:
        raise JSONDocumentError(f"{what}: nested more than {max_depth} levels deep")
    try:
        return json.loads(text, parse_constant=_no_constants, parse_float=_finite, parse_int=_bounded_int)
    except (ValueError, RecursionError) as e:  # RecursionError: belt and braces, the scan bounds the depth
        raise JSONDocumentError(f"{what}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by ``None`` (``null``), in dicts, lists and
    tuples at any depth: what this package writes as JSON (``results.json``, ``metrics.jsonl``,
    ``progress.jsonl``) stays JSON that any reader accepts (a bare ``NaN`` is not JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def dumps_json(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`finite_json` of ``obj`` (``allow_nan=False``: never a bare ``NaN``)."""
    return json.dumps(finite_json(obj), allow_nan=False, **kw)

