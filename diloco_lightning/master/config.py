"""The master's options: one definition (:class:`MasterConfig`), one validation.

``MasterOuterLoop`` takes them as keywords; ``diloco-master`` and ``train.py`` compose the
same fields into their Hydra schema (``diloco_lightning.app.config``), with the help text
written here, and validate them here. Nothing else lists them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from diloco_lightning.master.quorum import AUTO, is_fraction
from diloco_lightning.util.errors import ConfigError
from diloco_lightning.util.options import OptionError, check_choice, check_number, option
from diloco_lightning.wire.fragments import FragmentError, FragmentPlan, check_fragments_option, fragment_count

__all__ = ["AGGREGATIONS", "ARRIVAL_PUBLISH", "COMPAT_MODES", "WEIGHTINGS", "MasterConfig", "MasterConfigError", "OptionError",
           "with_run_fragments"]

#: ``round``: one outer step per round over every accepted delta; ``arrival``: one per delta
AGGREGATIONS = ("round", "arrival")
#: arrival mode's publications when one pass finds several deltas (master/arrival.py)
ARRIVAL_PUBLISH = ("pass", "each")
#: ``equal``: every delta weighs 1; ``tokens``: a delta weighs its header's ``num_tokens``
WEIGHTINGS = ("equal", "tokens")
#: ``speedtronic``: also speak Speedtronic 2.0's hub layout (diloco_lightning.master.compat)
COMPAT_MODES = ("speedtronic",)
log = logging.getLogger(__name__)

_MOMENTUM_OPTIMIZERS = ("nesterov", "poly_nesterov", "delayed_nesterov", "fedavg")
#: Speedtronic's Nesterov lr and momentum: what ``outer_lr`` / ``outer_momentum`` left null mean for an
#: optimizer whose signature has no default of its own (and for the Nesterov family, as before)
SPEEDTRONIC_LR, SPEEDTRONIC_MOMENTUM = 0.7, 0.9
#: optimizers whose own signature defaults (lr, momentum) a null outer_lr / outer_momentum means
_OWN_DEFAULTS = ("fedavg",)


def _parameters(name: str) -> Mapping[str, Any]:
    """The parameters of registered outer optimizer ``name``'s signature (none for an unknown name)."""
    import inspect

    from diloco_lightning.outer import OUTER_OPTIMIZERS

    cls = OUTER_OPTIMIZERS.get(name)
    return {} if cls is None else inspect.signature(cls).parameters


def _own_default(name: str, option: str, otherwise: float) -> float:
    """``option``'s default in the signature of an optimizer with defaults of its own (``fedavg``), else ``otherwise``."""
    if name not in _OWN_DEFAULTS:
        return otherwise
    return float(_parameters(name)[option].default)


def _takes(name: str, option: str) -> bool:
    """Whether outer optimizer ``name`` (a registered one) has the option ``option``."""
    return option in _parameters(name)


def default_lr(name: str) -> float:
    """The lr an outer optimizer gets when none is given: its own default (``fedavg``: 1), else Speedtronic's 0.7."""
    return _own_default(name, "lr", SPEEDTRONIC_LR)


class MasterConfigError(ConfigError):
    """The hub's published run does not match this master's configuration (optimizer, model)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


@dataclass
class MasterConfig:
    """Everything that shapes the master's behaviour: the keywords of :class:`MasterOuterLoop`.

    The outer optimizer (``outer_*``) keeps Speedtronic's constructor names; the Hydra schema
    takes it from its own ``outer`` group instead.
    """

    outer_optimizer: str = option(
        "fedavg", "outer optimizer by name (diloco_lightning.outer); fedavg, the mean of the deltas at lr 1: the "
        "scaling study's pick (docs/scaling.md), the one default of the library, train.py and diloco-master"
    )
    outer_options: dict[str, Any] = option(help="the outer optimizer's options (override outer_lr/outer_momentum)", factory=dict)
    outer_lr: float | None = option(
        None, "the outer optimizer's lr (null: its own default: fedavg 1; Speedtronic's 0.7 for nesterov and every "
        "optimizer without a default of its own)"
    )
    outer_momentum: float | None = option(
        None, "the momentum of the Nesterov family and of every other outer step with one, e.g. staleness_sgd (null: "
        "its own default: fedavg and staleness_sgd 0; Speedtronic's 0.9 for nesterov, poly_nesterov and "
        "delayed_nesterov); ignored, with a warning, by a step without momentum"
    )
    fragments: Any = option(
        None, "Streaming DiLoCo fragments, as the workers' (F, or a list of parameter-name pattern groups; null: "
        "the workers' diloco.fragments in a training run, else none)"
    )
    aggregation: str = option("round", "round: one outer step per round | arrival: one per accepted delta")
    weighting: str = option("equal", "equal | tokens (weight each delta by its num_tokens)")
    poll_interval: float = option(1.0, "seconds between the master's rounds")
    min_deltas: Any = option(
        1, "quorum: accepted deltas before a round is applied (an int), or a fraction of the live nodes (a float in (0, 1])"
    )
    max_wait: Any = option(
        None, "seconds after a round's first delta before applying below the quorum, or auto (from recent arrivals)"
    )
    node_timeout: float | None = option(
        None, "seconds without a heartbeat or delta before a node leaves the quorum (null: its claim's ttl, at most the "
        "transport's default claim ttl: 60 on a folder hub, 900 on hf:// and s3://; a training run: diloco.claim_ttl)"
    )
    max_staleness: int | None = option(None, "reject deltas staler than this (null: only the optimizer's gate decides)")
    max_delta_norm: float | None = option(None, "reject a delta whose L2 norm exceeds this")
    norm_global_ratio: float | None = option(
        100.0, "reject a delta whose norm exceeds this x max(||global||, 0.01 sqrt(n)), from the first one (null: off)"
    )
    norm_ratio: float | None = option(10.0, "reject a delta above this x the median norm of recent ones (null: off)")
    norm_window: int = option(32, "accepted norms the median of norm_ratio is taken over")
    norm_min_history: int = option(4, "norm_ratio engages once this many norms are known")
    download_workers: int = option(4, "parallel delta downloads")
    prefetch: int = option(4, "deltas downloaded ahead of the one being read")
    max_download_attempts: int = option(3, "a delta failing to download this many times is rejected")
    arrival_batch: int = option(64, "arrival mode: at most this many deltas per round")
    arrival_publish: str = option(
        "pass", "arrival mode, several deltas found in one pass (a master behind its arrivals): pass = each its own "
        "optimizer step and outer step, one version published at the end of the pass (published outer steps may "
        "skip numbers); each = one published version per delta (what a worker that installs a given version needs)")
    keep_globals: int = option(4, "older global versions kept on the hub (lockstep with delay d needs d + 2)")
    lease: bool = option(True, "one master at a time: a second one stands by")
    warm_standby: bool = option(
        True, "a master standing by (another holds the lease) keeps the newest published version loaded (weights, "
        "optimizer state, ledger) as it is published, so when the lease expires it takes over with its first "
        "round and no download (false: it loads the version at takeover)"
    )
    lease_ttl: float | None = option(
        None, "seconds the master's lease lives without renewal (null: max(3 x poll_interval, 30); on hf://, where "
        "each renewal is a commit, max(3 x poll_interval, 900))"
    )
    gc_every: int = option(16, "publications between garbage collections of orphans and leftovers")
    retry_max_delay: float = option(300.0, "the longest pause after failed rounds (backoff with jitter)")
    torch_threads: int | None = option(None, "torch threads of the master (the round is memory-bound; null: torch's default)")
    round_threads: int | None = option(
        None, "threads a round reads, checks and sums deltas on, each a whole run of tensors (util/lanes.py; the "
        "result's bits do not depend on it; null: the cores this process may use, at most 4; 1: one thread)")
    sweep_age: float = option(3600.0, "seconds after which temporary files of dead writers on other hosts are swept")
    until_finished: bool = option(
        False, "stop once every worker it knows has finished its training (its claim says so) and its last delta is "
        "applied, saying where the final model is and how to export it (master/finish.py); max_rounds / max_seconds "
        "still end it sooner"
    )
    expected_nodes: int | None = option(
        None, "with until_finished: the run is not over before this many workers were seen, each finished (null: "
        "the first finished worker may end it; train.py: its workers)"
    )
    compat: str | None = option(
        None, "speedtronic: also take Speedtronic's deltas, write its global/latest.safetensors + step_count.json, "
        "and adopt a run its master served (null: off)"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> "MasterConfig":
        """Raise :class:`~diloco_lightning.util.options.OptionError` naming the first option out of range."""
        if not isinstance(self.outer_optimizer, str) or not self.outer_optimizer:
            raise OptionError("outer_optimizer", f"must be an optimizer name, got {self.outer_optimizer!r}")
        if not isinstance(self.outer_options, Mapping):
            raise OptionError("outer_options", f"must be a mapping of option names to values, got {self.outer_options!r}")
        try:
            check_fragments_option(self.fragments)
        except FragmentError as e:
            raise OptionError("fragments", str(e).removeprefix("fragments "), str(e)) from None
        if fragment_count(self.fragments) > 1 and "fragments" in dict(self.outer_options):
            raise OptionError("outer_options", "fragments: the optimizer takes the run's fragments option; do not "
                              "give them in outer_options too")
        check_choice(self, "aggregation", AGGREGATIONS)
        check_choice(self, "weighting", WEIGHTINGS)
        check_choice(self, "arrival_publish", ARRIVAL_PUBLISH)
        if not isinstance(self.until_finished, bool):
            raise OptionError("until_finished", f"must be True or False, got {self.until_finished!r}")
        check_number(self, "expected_nodes", low=1, integer=True, optional=True)
        if not isinstance(self.lease, bool):
            raise OptionError("lease", f"must be True or False, got {self.lease!r}")
        if not isinstance(self.warm_standby, bool):
            raise OptionError("warm_standby", f"must be True or False, got {self.warm_standby!r}")
        check_number(self, "outer_lr", low=0.0, strict=True, optional=True)
        check_number(self, "outer_momentum", low=0.0, optional=True)
        if self.outer_momentum is not None and self.outer_optimizer not in _MOMENTUM_OPTIMIZERS \
                and not _takes(self.outer_optimizer, "momentum"):
            # a warning, not a refusal: Speedtronic's callers pass outer_momentum whatever the optimizer
            log.warning("outer_momentum=%s is ignored: %s has no momentum", self.outer_momentum, self.outer_optimizer)
        check_number(self, "poll_interval", low=0.0, strict=True)
        if is_fraction(self.min_deltas):
            if not 0.0 < self.min_deltas <= 1.0:
                raise OptionError("min_deltas", f"must be a count (an integer >= 1) or a fraction of the live nodes in "
                                  f"(0, 1], got {self.min_deltas!r}")
        else:
            try:
                check_number(self, "min_deltas", low=1, integer=True)
            except OptionError:
                raise OptionError("min_deltas", f"must be a count (an integer >= 1) or a fraction of the live nodes in "
                                  f"(0, 1], got {self.min_deltas!r}") from None
        if self.max_wait != AUTO:
            try:
                check_number(self, "max_wait", low=0.0, optional=True)
            except OptionError:
                raise OptionError("max_wait", f"must be a number of seconds >= 0, 'auto' or None, got {self.max_wait!r}") from None
        check_number(self, "node_timeout", low=0.0, strict=True, optional=True)
        check_number(self, "max_staleness", low=0, integer=True, optional=True)
        check_number(self, "max_delta_norm", low=0.0, strict=True, optional=True)
        check_number(self, "norm_global_ratio", low=0.0, strict=True, optional=True)
        check_number(self, "norm_ratio", low=1.0, strict=True, optional=True)
        check_number(self, "norm_window", low=1, integer=True)
        check_number(self, "norm_min_history", low=1, integer=True)
        check_number(self, "download_workers", low=1, integer=True)
        check_number(self, "prefetch", low=1, integer=True)
        check_number(self, "max_download_attempts", low=1, integer=True)
        check_number(self, "arrival_batch", low=1, integer=True)
        check_number(self, "keep_globals", low=0, integer=True)
        check_number(self, "lease_ttl", low=0.0, strict=True, optional=True)
        check_number(self, "gc_every", low=1, integer=True)
        check_number(self, "retry_max_delay", low=0.0, strict=True)
        check_number(self, "torch_threads", low=1, integer=True, optional=True)
        check_number(self, "round_threads", low=1, integer=True, optional=True)
        check_number(self, "sweep_age", low=0.0, strict=True)
        if self.compat is not None:
            if self.compat not in COMPAT_MODES:
                raise OptionError("compat", f"must be null or one of {list(COMPAT_MODES)}, got {self.compat!r}")
            if fragment_count(self.fragments) > 1:
                raise OptionError("compat", "cannot be combined with fragments: Speedtronic's deltas carry the whole model")
            if self.weighting != "equal":
                raise OptionError(
                    "compat", f"needs weighting='equal': Speedtronic's deltas carry no num_tokens (weighting is {self.weighting!r})"
                )
        self._check_optimizer()
        return self

    def _check_optimizer(self) -> None:
        """The outer optimizer's options, checked by building it once on a 2-value probe state: a bad
        option (``tau_cut=-1``, an unknown name) is refused here, naming the option, rather than when
        the first global state arrives (a traceback in the middle of a run)."""
        from diloco_lightning.outer import check_outer_options

        try:
            check_outer_options(self.outer_optimizer, **self.optimizer_options())
        except (ValueError, TypeError) as e:
            raise OptionError("outer_options", str(e), f"outer_options: {e}") from None

    def optimizer_options(self) -> dict[str, Any]:
        """``outer_lr`` (and ``outer_momentum`` for the Nesterov family and every other step with a
        momentum), overridden by ``outer_options``;
        a null one is the optimizer's own default (``fedavg``: lr 1, momentum 0), else Speedtronic's (0.7, 0.9)."""
        opts: dict[str, Any] = {"lr": default_lr(self.outer_optimizer) if self.outer_lr is None else self.outer_lr}
        if self.outer_optimizer in _MOMENTUM_OPTIMIZERS:
            momentum = _own_default(self.outer_optimizer, "momentum", SPEEDTRONIC_MOMENTUM)
            opts["momentum"] = momentum if self.outer_momentum is None else self.outer_momentum
        elif self.outer_momentum is not None and _takes(self.outer_optimizer, "momentum"):  # e.g. staleness_sgd
            opts["momentum"] = self.outer_momentum
        opts.update(dict(self.outer_options))
        if "lr" in opts:  # lr first, as it always printed
            opts = {"lr": opts.pop("lr"), **opts}
        return opts

    def effective_lease_ttl(self, rate_limited_writes: bool = False) -> float:
        """``lease_ttl``, or its default for a hub whose writes are cheap (30 s floor) or rate-limited
        commits (the Hugging Face Hub: a 900 s floor, so renewals, one every half ttl, cost 8 of the
        repository's commits an hour instead of 120)."""
        if self.lease_ttl is not None:
            return self.lease_ttl
        return max(3.0 * self.poll_interval, 900.0 if rate_limited_writes else 30.0)


def with_run_fragments(outer_optimizer: str, options: Mapping[str, Any], plan: FragmentPlan | None) -> dict[str, Any]:
    """The outer optimizer's options in a run split by ``plan``: PA-CGAD's fragments are the run's
    (its age ``a_f`` is counted per run fragment); any other optimizer's are unchanged."""
    from diloco_lightning.outer import gates_per_fragment  # torch: only once a run builds its optimizer

    out = dict(options)
    if plan is not None and gates_per_fragment(outer_optimizer):
        out["fragments"] = plan.optimizer_fragments()
    return out
