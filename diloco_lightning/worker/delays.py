"""A lockstep worker's delay (tau) from the ``delay`` option: a number, a per-node list or a seeded
distribution. No torch: a configuration is checked with it (``worker/options.py``); ``worker/sync.py``
re-exports every name (the old import paths keep working)."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DELAY_DISTRIBUTIONS", "draw_delay", "node_index_of", "resolve_delay"]



def node_index_of(node_id: str, node_index: int | None) -> int:
    """``node_index`` if given, else the number that ends ``node_id`` (``"w3"`` -> 3)."""
    if node_index is not None:
        if isinstance(node_index, bool) or not isinstance(node_index, int) or node_index < 0:
            raise ValueError(f"node_index must be a non-negative integer, got {node_index!r}")
        return node_index
    m = re.search(r"(\d+)$", node_id)
    if m is None:
        raise ValueError(
            f"delay is a per-node list or a distribution, so each worker needs its index: pass node_index= "
            f"(node_id {node_id!r} does not end with a number to take it from)"
        )
    return int(m.group(1))


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


#: the laws a delay may be drawn from (:func:`draw_delay`)
DELAY_DISTRIBUTIONS = ("uniform", "choice", "geometric", "pareto")


def resolve_delay(delay: Any, node_id: str, node_index: int | None = None) -> int:
    """This worker's lockstep delay (tau) from the ``delay`` option.

    * an int >= 0: the same for every worker;
    * a list of ints: ``delay[index % len(delay)]`` (per-node delays);
    * a mapping, a seeded distribution drawn once per worker (``random.Random(f"{seed}:{index}")``,
      the draw ``train.py`` makes for each worker) by :func:`draw_delay`, e.g.
      ``{"distribution": "uniform", "low": 0, "high": 8, "seed": 0}`` (inclusive bounds; the
      default distribution when ``high`` is given) or
      ``{"distribution": "choice", "values": [0, 4, 8], "weights": [2, 1, 1], "seed": 0}``.

    ``index`` is ``node_index`` or the number ending ``node_id``.
    """
    if isinstance(delay, bool):
        raise ValueError(f"delay must be an int, a list of ints or a distribution mapping, got {delay!r}")
    if isinstance(delay, int):
        return _nonneg_int(delay, "delay")
    if isinstance(delay, Sequence) and not isinstance(delay, (str, bytes)):
        values = [_nonneg_int(d, f"delay[{i}]") for i, d in enumerate(delay)]
        if not values:
            raise ValueError("delay: an empty list gives no delay to any worker")
        return values[node_index_of(node_id, node_index) % len(values)]
    if isinstance(delay, Mapping):
        index = node_index_of(node_id, node_index)
        return draw_delay(delay, random.Random(f"{delay.get('seed', 0)}:{index}"))
    raise ValueError(f"delay must be an int, a list of ints or a distribution mapping, got {delay!r}")


def draw_delay(spec: Mapping[str, Any], rng: random.Random) -> int:
    """One draw of a delay from the law ``spec`` names (``seed`` is ignored here: ``rng`` is seeded).

    * ``uniform``: ``low`` (default 0) to ``high``, inclusive, equally likely;
    * ``choice``: one of ``values`` (with ``weights``, default equal);
    * ``geometric``: ``P(tau = k) = p (1 - p)^k`` for k >= 0, given by ``mean`` (``p = 1 / (mean + 1)``);
    * ``pareto``: a heavy tail, the discretised Lomax law ``tau = floor(scale * (U^(-1/shape) - 1))``,
      ``P(tau >= x) ~ (1 + x / scale)^-shape`` (``shape`` default 1.5, ``scale`` default 4: median 2,
      mean 8, 3.7 % of the draws at 32 or more);

    ``geometric`` and ``pareto`` take an optional ``max`` (draws above it are set to it). Raises
    ``ValueError`` naming the key on a bad spec.
    """
    spec = dict(spec)
    spec.pop("seed", None)
    dist = spec.pop("distribution", "uniform" if "high" in spec else None)
    if dist == "uniform":
        low = _nonneg_int(spec.pop("low", 0), "delay['low']")
        if "high" not in spec:
            raise ValueError("delay: a uniform distribution needs 'high'")
        high = _nonneg_int(spec.pop("high"), "delay['high']")
        if high < low:
            raise ValueError(f"delay: 'high' ({high}) is below 'low' ({low})")
        out = rng.randint(low, high)
    elif dist == "choice":
        values = spec.pop("values", None)
        if not isinstance(values, Sequence) or not values:
            raise ValueError("delay: a choice distribution needs a non-empty 'values' list")
        values = [_nonneg_int(v, "delay['values'][...]") for v in values]
        weights = spec.pop("weights", None)
        if weights is not None and (len(weights) != len(values) or any(float(w) < 0 for w in weights)):
            raise ValueError("delay: 'weights' must be as long as 'values' and non-negative")
        out = rng.choices(values, weights=weights)[0]
    elif dist in ("geometric", "pareto"):
        cap = spec.pop("max", None)
        if cap is not None:
            cap = _nonneg_int(cap, "delay['max']")
        if dist == "geometric":
            mean = _positive_real(spec.pop("mean", None), "delay['mean']")
            u = 1.0 - rng.random()  # (0, 1]
            out = int(math.floor(math.log(u) / math.log(mean / (mean + 1.0))))
        else:
            shape = _positive_real(spec.pop("shape", 1.5), "delay['shape']")
            scale = _positive_real(spec.pop("scale", 4.0), "delay['scale']")
            u = 1.0 - rng.random()
            out = int(min(math.floor(scale * (u ** (-1.0 / shape) - 1.0)), 2**62))
        if cap is not None:
            out = min(out, cap)
    else:
        raise ValueError(f"delay: unknown distribution {dist!r} (expected one of {', '.join(DELAY_DISTRIBUTIONS)})")
    if spec:
        raise ValueError(f"delay: unknown key(s) {sorted(spec)} in the distribution spec")
    return out


def _positive_real(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)
