"""Staleness gates: the scale a staleness-aware outer optimizer puts on a pseudo-gradient.

``staleness`` (tau) is ``outer_step at application - base_outer_step`` (see the contract,
``docs/spec.md``). A gate maps tau to a factor in ``[0, 1]`` that multiplies the pseudo-gradient
*before* it enters the optimizer's buffers.

- :func:`cgad_gate`: Cosine-Gated Adam-Decay (Shah & Sun 2026, arXiv 2605.09126),
  ``0.5 * (1 + cos(pi * tau / tau_cut)) * exp(-alpha * tau)`` for ``0 <= tau <= tau_cut``, 0 beyond.
- :func:`exp_gate`: the same without the cosine cut (Adam-Decay), ``exp(-alpha * tau)``.
- :func:`poly_gate`: the "Poly" baseline of Liu et al. 2024 (arXiv 2401.09135), ``(1 + tau) ** -power``.

Every gate returns exactly ``0.0`` below :data:`MIN_GATE`: such a pseudo-gradient is treated as
fully gated (too stale) rather than applied at a scale below what FP32 buffers can resolve.
For the defaults (alpha 0.2) this only matters to :func:`exp_gate` beyond tau ~ 345.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["MIN_GATE", "cgad_gate", "check_staleness", "exp_gate", "poly_gate"]

#: Gates below this value are rounded to 0 (a fully gated, i.e. rejected, pseudo-gradient).
MIN_GATE = 1e-30


def check_staleness(staleness: float) -> float:
    """Return ``staleness`` as a float after checking that it is a finite number ``>= 0``.

    Raises:
        ValueError: if ``staleness`` is negative, NaN, infinite or not a real number.
    """
    if isinstance(staleness, bool) or not isinstance(staleness, numbers.Real):
        raise ValueError(f"staleness must be a non-negative number, got {staleness!r}")  # noqa: TRY004
    tau = float(staleness)
    if not math.isfinite(tau) or tau < 0:
        raise ValueError(f"staleness must be a finite number >= 0, got {staleness!r}")
    return tau


def _floor(value: float) -> float:
    return value if value >= MIN_GATE else 0.0


def cgad_gate(staleness: float, alpha: float = 0.2, tau_cut: float = 32) -> float:
    """CGAD gate ``sigma(tau) = 0.5 * (1 + cos(pi * tau / tau_cut)) * exp(-alpha * tau)``.

    Shah & Sun 2026 (arXiv 2605.09126): for ``0 <= tau <= tau_cut``; 0 for ``tau > tau_cut``
    (``sigma(tau_cut)`` is already 0). With the defaults: tau 0 -> 1, 4 -> 0.432, 8 -> 0.172,
    16 -> 0.0204, 24 -> 0.0012, >= 32 -> 0.

    Raises:
        ValueError: on a negative staleness.
    """
    tau = check_staleness(staleness)
    if tau >= tau_cut:
        return 0.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * tau / tau_cut))
    return _floor(cosine * math.exp(-alpha * tau))


def exp_gate(staleness: float, alpha: float = 0.2) -> float:
    """Adam-Decay gate ``exp(-alpha * tau)`` (CGAD without the cosine cut, arXiv 2605.09126)."""
    tau = check_staleness(staleness)
    return _floor(math.exp(-alpha * tau))


def poly_gate(staleness: float, power: float = 0.5) -> float:
    """Poly gate ``(1 + tau) ** -power`` (Liu et al. 2024, arXiv 2401.09135)."""
    tau = check_staleness(staleness)
    return _floor((1.0 + tau) ** -power)
