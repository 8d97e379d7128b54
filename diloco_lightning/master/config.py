"""The master's options: one definition (:class:`MasterConfig`), one validation.

``MasterOuterLoop`` takes them as keywords, ``diloco-master`` and ``train.py`` compose them
into their Hydra schema (``diloco_lightning/config.py``); nothing else lists them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["AGGREGATIONS", "WEIGHTINGS", "MasterConfig", "MasterConfigError"]

#: ``round``: one outer step per round over every accepted delta; ``arrival``: one per delta
AGGREGATIONS = ("round", "arrival")
#: ``equal``: every delta weighs 1; ``tokens``: a delta weighs its header's ``num_tokens``
WEIGHTINGS = ("equal", "tokens")
_MOMENTUM_OPTIMIZERS = ("nesterov", "poly_nesterov", "delayed_nesterov")


class MasterConfigError(ValueError):
    """The hub's published run does not match this master's configuration (optimizer, model)."""


@dataclass
class MasterConfig:
    """Everything that shapes the master's behaviour (the keywords of :class:`MasterOuterLoop`,
    documented there)."""

    outer_optimizer: str = "nesterov"
    outer_options: dict[str, Any] = field(default_factory=dict)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "round"
    weighting: str = "equal"
    poll_interval: float = 60.0
    min_deltas: int = 1
    max_wait: float | None = None
    max_staleness: int | None = None
    max_delta_norm: float | None = None
    norm_global_ratio: float | None = 100.0
    norm_ratio: float | None = 10.0
    norm_window: int = 32
    norm_min_history: int = 4
    download_workers: int = 4
    prefetch: int = 4
    max_download_attempts: int = 3
    arrival_batch: int = 64
    keep_globals: int = 4
    lease: bool = True
    lease_ttl: float | None = None
    gc_every: int = 16
    retry_max_delay: float = 300.0
    torch_threads: int | None = None
    sweep_age: float = 3600.0

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> "MasterConfig":
        """Raise ``ValueError`` naming the first option out of range; returns ``self``."""

        def bad(name: str, want: str) -> None:
            raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def num(name: str, *, low: float, strict: bool = False, optional: bool = False, integer: bool = False) -> None:
            v = getattr(self, name)
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
                bad(name, f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {low}"
                          + (" or None" if optional else ""))

        if not isinstance(self.outer_optimizer, str) or not self.outer_optimizer:
            bad("outer_optimizer", "an optimizer name")
        if not isinstance(self.outer_options, Mapping):
            bad("outer_options", "a mapping of option names to values")
        if self.aggregation not in AGGREGATIONS:
            bad("aggregation", f"one of {list(AGGREGATIONS)}")
        if self.weighting not in WEIGHTINGS:
            bad("weighting", f"one of {list(WEIGHTINGS)}")
        if not isinstance(self.lease, bool):
            bad("lease", "True or False")
        num("outer_lr", low=0.0, strict=True)
        num("outer_momentum", low=0.0)
        num("poll_interval", low=0.0, strict=True)
        num("min_deltas", low=1, integer=True)
        num("max_wait", low=0.0, optional=True)
        num("max_staleness", low=0, integer=True, optional=True)
        num("max_delta_norm", low=0.0, strict=True, optional=True)
        num("norm_global_ratio", low=0.0, strict=True, optional=True)
        num("norm_ratio", low=1.0, strict=True, optional=True)
        num("norm_window", low=1, integer=True)
        num("norm_min_history", low=1, integer=True)
        num("download_workers", low=1, integer=True)
        num("prefetch", low=1, integer=True)
        num("max_download_attempts", low=1, integer=True)
        num("arrival_batch", low=1, integer=True)
        num("keep_globals", low=0, integer=True)
        num("lease_ttl", low=0.0, strict=True, optional=True)
        num("gc_every", low=1, integer=True)
        num("retry_max_delay", low=0.0, strict=True)
        num("torch_threads", low=1, integer=True, optional=True)
        num("sweep_age", low=0.0, strict=True)
        return self

    def optimizer_options(self) -> dict[str, Any]:
        """``outer_lr`` (and ``outer_momentum`` for the Nesterov family), overridden by ``outer_options``."""
        opts: dict[str, Any] = {"lr": self.outer_lr}
        if self.outer_optimizer in _MOMENTUM_OPTIMIZERS:
            opts["momentum"] = self.outer_momentum
        opts.update(dict(self.outer_options))
        return opts

    def effective_lease_ttl(self) -> float:
        return self.lease_ttl if self.lease_ttl is not None else max(3.0 * self.poll_interval, 30.0)
