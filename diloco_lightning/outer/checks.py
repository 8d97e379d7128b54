"""The outer optimizers' option checks: each raises ``ValueError`` naming the option."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_betas", "check_int", "check_real"]


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a float after checking that it is a finite number in the given range.

    Raises:
        ValueError: naming ``name`` when ``value`` is not a finite real number in range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")  # noqa: TRY004 (a bad option value)
    result = float(value)
    ok = math.isfinite(result)
    if ok and low is not None:
        ok = result > low if low_open else result >= low
    if ok and high is not None:
        ok = result < high if high_open else result <= high
    if not ok:
        lo = "-inf" if low is None else f"{low!r}"
        hi = "inf" if high is None else f"{high!r}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return result


def check_betas(betas: Any) -> tuple[float, float]:
    """Check Adam's ``betas``: two numbers in ``[0, 1)``."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return (
        check_real("betas[0]", beta1, low=0.0, high=1.0, high_open=True),
        check_real("betas[1]", beta2, low=0.0, high=1.0, high_open=True),
    )



def check_int(name: str, value: Any, *, low: int) -> int:
    """Return ``value`` as an int after checking that it is an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)
