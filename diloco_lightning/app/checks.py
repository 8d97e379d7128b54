"""Checks of a composed configuration, and its sections turned into the library's objects.

The schema (:mod:`diloco_lightning.app.config`) types every key; what types cannot express
(ranges, choices, what one key implies for another) is checked here: :func:`validate`
(``train.py``) and :func:`validate_master_command` (``diloco-master``) share one check per
section (:func:`validate_outer`, :func:`validate_hub`, :func:`validate_master_section`) and raise
:class:`ConfigError` naming the key. The library's own option classes (``MasterConfig``,
``WorkerOptions``, ``SimOptions``) stay the one validation of their options: a section is handed
to them and their error comes back with the key's full name. :func:`hub_options`,
:func:`master_config`, :func:`worker_options`, :func:`sim_options` and :func:`outer_options` turn
sections into what the library takes. Every name here is importable from
:mod:`diloco_lightning.app.config` too.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from diloco_lightning.hub.options import HubOptions
from diloco_lightning.hub.transports import known_url, url_forms
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.util.errors import ConfigError
from diloco_lightning.util.options import OptionError, check_number, default_of
from diloco_lightning.sim.options import SimOptions
from diloco_lightning.worker.options import WorkerOptions

log = logging.getLogger(__name__)

ROLES = ("all", "worker", "master")
INNER_OPTIMIZERS = ("adamw", "adamw8bit", "muon")
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCH_KINDS = ("local", "submitit", "sim")
__all__ = [
    "ACCELERATORS", "INNER_OPTIMIZERS", "LAUNCH_KINDS", "PRECISIONS", "ROLES", "ConfigError", "hub_options",
    "master_config", "open_configured_hub", "outer_options", "sim_options", "validate", "validate_diloco_section",
    "validate_hub", "validate_master_command", "validate_master_section", "validate_outer", "validate_sim_section",
    "worker_options",
]


def _check(cond: bool, key: str, detail: str) -> None:
    if not cond:
        raise ConfigError(key, detail)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----------------------------------------------------------------------------- shared section checks


def validate_outer(o: DictConfig, prefix: str = "outer.") -> None:
    """The outer optimizer section (both commands): :func:`diloco_lightning.outer.options.outer_options`,
    the one check, with the key's full name in the error; then the optimizer built once on a probe
    (:func:`~diloco_lightning.outer.check_outer_options`), so a value it refuses (``tau_cut=-1``) is a
    one-line error now, not a traceback when the first weights arrive."""
    from diloco_lightning.outer import check_outer_options

    opts = outer_options(o, prefix)
    try:
        check_outer_options(str(o.name), **opts)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix}options", str(e)) from None


def check_outer_lr(o: DictConfig, prefix: str = "outer.") -> None:
    """``outer.lr``: null or a number > 0 (``MasterConfig.outer_lr``'s rule), checked before the optimizers'
    package imports torch, so the commonest bad outer value is refused in well under a second."""
    from types import SimpleNamespace

    try:
        check_number(SimpleNamespace(lr=o.lr), "lr", low=0.0, strict=True, optional=True)
    except OptionError as e:
        raise ConfigError(f"{prefix}lr", e.detail) from None


def outer_options(o: DictConfig, prefix: str = "outer.") -> dict[str, Any]:
    """``{"lr": o.lr, **o.options}`` for the named optimizer (:func:`diloco_lightning.outer.options.outer_options`:
    options it does not take are dropped with a warning, so ``outer.name=X`` works on top of another
    group's options); a :class:`ConfigError` naming the key. ``options.lr`` (the library's spelling) is
    the lr when ``lr`` is null, and an error when both are given and differ (it used to be dropped
    silently in favour of ``lr``)."""
    check_outer_lr(o, prefix)
    from diloco_lightning.master.config import default_lr
    from diloco_lightning.outer.options import outer_options as checked

    raw = OmegaConf.to_container(o.options, resolve=True) if isinstance(o.options, DictConfig) else o.options
    raw = {} if raw is None else raw
    lr = o.lr
    if isinstance(raw, dict) and "lr" in raw:  # ``options.lr``: the library's spelling (MasterConfig.outer_options), one lr
        raw = dict(raw)
        given = raw.pop("lr")
        if lr is not None and given != lr:
            raise ConfigError(f"{prefix}options.lr", f"the learning rate is given twice ({prefix}lr={lr}, {prefix}options.lr="
                              f"{given}): keep {prefix}lr")
        lr = given
    lr = lr if lr is not None else default_lr(str(o.name))
    try:
        return checked(o.name, lr, raw, state_dtype=o.get("state_dtype", "float32"),
                       stochastic_rounding=o.get("stochastic_rounding", False), where=prefix)
    except OptionError as e:
        raise ConfigError(f"{prefix}{e.option}", e.detail) from None


def validate_hub(h: DictConfig, prefix: str = "hub.", *, required: bool = False) -> None:
    """The hub section (both commands): the URL's form (whether it exists is checked when it is opened)."""
    from omegaconf import MISSING

    _check(not OmegaConf.is_missing(h, "url"), f"{prefix}url", f"is required: {url_forms()}")
    url = h.url
    if url is None or url == MISSING:
        _check(not required, f"{prefix}url", f"is required: {url_forms()}")
        return
    _check(isinstance(url, str) and url.strip() != "", f"{prefix}url", f"must be a non-empty string, got {url!r}")
    _check(known_url(url), f"{prefix}url", f"unsupported scheme in {url!r}; use {url_forms()}")
    try:
        _hub_options(h).validate(url)
    except OptionError as e:
        raise ConfigError(f"{prefix}{e.option}", e.detail.replace("(the url is", f"({prefix}url is")
                          .replace("and endpoint are", f"and {prefix}endpoint are")) from None


def _hub_options(h: DictConfig) -> HubOptions:
    return HubOptions(**_section(h, [n for n in HubOptions.names() if n in h]))


def _section(node: DictConfig, names: list[str]) -> dict[str, Any]:
    return {k: OmegaConf.to_container(node[k], resolve=True) if isinstance(node[k], (DictConfig, ListConfig)) else node[k]
            for k in names if k in node}


def validate_master_section(m: DictConfig, prefix: str = "master.") -> None:
    """The master's behaviour (``master.*`` of a training run, the top level of ``diloco-master``):
    :meth:`MasterConfig.validate`, the one validation, with the key's full name in the error."""
    values = _section(m, [n for n in MasterConfig.names() if n in m])
    for key in ("min_deltas", "keep_globals"):  # null: decided by the run (master_config)
        if values.get(key) is None:
            values.pop(key, None)
    try:
        MasterConfig(**values).validate()
    except OptionError as e:
        raise ConfigError(f"{prefix}{e.option}", e.detail) from None


def validate_diloco_section(d: DictConfig, workers: int, prefix: str = "diloco.") -> None:
    """The workers' options: :meth:`WorkerOptions.validate` (``delay`` resolved for every worker)."""
    opts = WorkerOptions(**_section(d, WorkerOptions.names()))
    try:
        for i in range(max(1, workers)):
            opts.validate(f"w{i}", i)
    except OptionError as e:
        raise ConfigError(f"{prefix}{e.option}", e.detail) from None


# ----------------------------------------------------------------------------- the two commands


def validate(cfg: DictConfig) -> DictConfig:
    """``train.py``'s checks (range and choice checks the schema's types cannot express). Returns ``cfg``."""
    _check(cfg.role in ROLES, "role", f"must be one of {list(ROLES)}, got {cfg.role!r}")
    _check(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
    _check(cfg.workers >= 1, "workers", f"must be >= 1, got {cfg.workers}")
    _check(0 <= cfg.node_index < cfg.workers, "node_index", f"must be in [0, workers={cfg.workers}), got {cfg.node_index}")
    if cfg.run_id is not None:
        _check(re.fullmatch(r"[A-Za-z0-9._=,+-]{1,200}", cfg.run_id) is not None, "run_id",
               f"must be 1-200 characters of [A-Za-z0-9._=,+-], got {cfg.run_id!r}")
    validate_diloco_section(cfg.diloco, cfg.workers)
    o = cfg.optim
    _check(o.name in INNER_OPTIMIZERS, "optim.name", f"must be one of {list(INNER_OPTIMIZERS)}, got {o.name!r}")
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", f"must be two values in [0, 1), got {list(o.betas)}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    validate_hub(cfg.hub, "hub.")
    validate_supervise_section(cfg)
    t = cfg.trainer
    _check(t.accelerator in ACCELERATORS, "trainer.accelerator", f"must be one of {list(ACCELERATORS)}, got {t.accelerator!r}")
    _check(t.precision in PRECISIONS, "trainer.precision", f"must be one of {list(PRECISIONS)}, got {t.precision!r}")
    _check(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    _check_reaches_a_boundary(cfg)
    _check(t.max_time is None or t.max_time > 0, "trainer.max_time", f"must be > 0 seconds or null, got {t.max_time}")
    _check(t.devices >= 1, "trainer.devices", "must be >= 1")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", "must be >= 1")
    da = cfg.data
    _check(da.source in ("stdlib", "text", "tokens"), "data.source", f"must be stdlib, text or tokens, got {da.source!r}")
    _check(da.source == "stdlib" or da.paths, "data.paths", f"required when data.source={da.source}")
    _check(da.seq_len >= 1, "data.seq_len", "must be >= 1")
    _check(da.batch_size >= 1, "data.batch_size", "must be >= 1")
    _check(0 < da.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
    _check(da.val_windows >= 1, "data.val_windows", f"must be >= 1, got {da.val_windows}")
    _check(da.val_batch_size >= 1, "data.val_batch_size", f"must be >= 1, got {da.val_batch_size}")
    _check(da.val_batches is None or da.val_batches >= 1, "data.val_batches",
           f"must be >= 1 or null (it is the old name: data.val_windows counts windows), got {da.val_batches}")
    _check(cfg.model.max_seq_len >= da.seq_len, "model.max_seq_len", f"must be >= data.seq_len ({da.seq_len})")
    la = cfg.launch
    _check(la.kind in LAUNCH_KINDS, "launch.kind", f"must be one of {list(LAUNCH_KINDS)}, got {la.kind!r}")
    _check(la.available_memory_gb is None or la.available_memory_gb > 0, "launch.available_memory_gb", "must be > 0")
    _check(la.eval_points >= 0, "launch.eval_points", "must be >= 0")
    _check(la.timeout > 0, "launch.timeout", "must be > 0")
    if la.kind == "sim":
        validate_sim_section(cfg)
    _check_outer_sections(cfg.master, "master.", cfg.outer)
    return cfg


def _check_outer_sections(master: DictConfig, master_prefix: str, outer: DictConfig) -> None:
    """The master's and the outer optimizer's sections, after every other check: each builds the outer
    optimizer on a probe, which imports torch (a bad value elsewhere is refused without it, and so is
    a bad ``outer.lr``)."""
    check_outer_lr(outer, "outer.")
    validate_master_section(master, master_prefix)
    validate_outer(outer, "outer.")


def _check_reaches_a_boundary(cfg: DictConfig) -> None:
    """``trainer.max_steps`` must reach the first boundary: a run shorter than one inner phase sends
    no delta, trains nothing the master sees, and used to end with a NaN eval loss reported as DIVERGED."""
    from diloco_lightning.wire.fragments import fragment_count

    d = cfg.diloco
    h = d.get("dylu_steps") if d.inner_steps == "auto" else d.inner_steps
    if isinstance(h, bool) or not isinstance(h, int):
        return
    try:
        f = fragment_count(d.get("fragments"))
    except ValueError:
        return  # the diloco section's own check reports it
    first = max(1, h // max(1, f))  # with F fragments, a boundary every H / F steps
    what = "diloco.dylu_steps" if d.inner_steps == "auto" else "diloco.inner_steps"
    _check(cfg.trainer.max_steps >= first, "trainer.max_steps",
           f"is {cfg.trainer.max_steps}, fewer than the {first} inner steps before a worker's first boundary ({what}"
           f"{' / diloco.fragments' if f > 1 else ''}): no delta would ever be sent. Raise trainer.max_steps or lower {what}")


def validate_supervise_section(cfg: DictConfig) -> None:
    """``supervise.*``: :meth:`SuperviseOptions.validate`, with the key's full name in the error."""
    from diloco_lightning.app.supervise import SuperviseOptions

    if cfg.get("supervise") is None:
        return
    try:
        SuperviseOptions(**_section(cfg.supervise, SuperviseOptions.names())).validate()
    except OptionError as e:
        raise ConfigError(f"supervise.{e.option}", e.detail) from None


def validate_sim_section(cfg: DictConfig) -> None:
    """``launch=sim``: the ``sim`` section, and what the simulator does not reproduce."""
    from diloco_lightning.sim.options import PRECISIONS as SIM_PRECISIONS

    try:
        opts = sim_options(cfg)
    except OptionError as e:
        raise ConfigError(f"sim.{e.option}", e.detail) from None
    _check(not opts.changes_membership() or cfg.diloco.sync == "async", "sim.join_at" if opts.join_at else "sim.leave_at",
           "a worker joining late or leaving needs diloco.sync=async (lockstep imposes every worker's every delta)")
    _check(cfg.role == "all", "role", f"launch=sim runs the whole run in one process: use role=all, got {cfg.role!r}")
    _check(cfg.trainer.precision in SIM_PRECISIONS, "trainer.precision",
           f"launch=sim reproduces {', '.join(SIM_PRECISIONS)}; got {cfg.trainer.precision!r}")
    _check(cfg.trainer.devices == 1, "trainer.devices", "launch=sim runs each worker on one device")
    throttle = cfg.diloco.throttle
    _check(throttle in (0, 0.0, None) or (OmegaConf.is_list(throttle) and not any(throttle)), "diloco.throttle",
           "launch=sim does not sleep: give the simulated workers' speeds with sim.speeds=[1,1,0.25] instead")
    _check(cfg.diloco.inner_steps != "auto" or cfg.diloco.get("fragments") in (None, 1), "diloco.inner_steps",
           "launch=sim simulates Dynamic Local Updates (inner_steps=auto) without fragments: give a number of inner "
           "steps, or drop diloco.fragments")


def validate_master_command(cfg: DictConfig) -> DictConfig:
    """``diloco-master``'s checks: the same section checks as a training run's. Returns ``cfg``."""
    validate_hub(cfg.hub, "hub.", required=True)
    _check(cfg.max_rounds is None or cfg.max_rounds >= 0, "max_rounds", f"must be >= 0, got {cfg.max_rounds}")
    _check(cfg.max_seconds is None or cfg.max_seconds > 0, "max_seconds", f"must be > 0, got {cfg.max_seconds}")
    _check(str(cfg.log_level).upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
           f"must be DEBUG, INFO, WARNING or ERROR, got {cfg.log_level!r}")
    if cfg.init is not None:
        _check(Path(cfg.init).expanduser().is_file(), "init", f"no such weights file: {cfg.init}")
    _check_outer_sections(cfg, "", cfg.outer)
    return cfg


# ----------------------------------------------------------------------------- turning sections into objects


def hub_options(h: DictConfig, url: str, *, create: bool | None = None) -> dict[str, Any]:
    """``open_hub`` options of a hub section for ``url`` (:meth:`HubOptions.open_options`: only those
    that apply to its transport)."""
    return _hub_options(h).open_options(url, create=create)


def open_configured_hub(h: DictConfig, url: str | None = None, *, create: bool | None = None, prefix: str = "hub."):
    """Open the hub a section names (``url`` overrides ``h.url``). A hub that does not exist is a
    :class:`ConfigError` naming ``hub.url`` unless ``hub.create`` (or ``create``) asks to create it."""
    from diloco_lightning.hub import HubNotFoundError, open_hub, transport_for

    url = url or h.url
    opts = hub_options(h, url, create=create)
    try:
        return open_hub(url, **opts)
    except HubNotFoundError as e:
        if not transport_for(url).creatable:  # the transport's message says what to do (a bucket is never created)
            raise ConfigError(f"{prefix}url", str(e)) from None
        raise ConfigError(f"{prefix}url", f"{e}; check the spelling, or pass {prefix}create=true to create it") from None
    except ValueError as e:
        raise ConfigError(f"{prefix}url", str(e)) from None
    except OSError as e:  # a folder hub that cannot be created or read (permissions, a file in the way)
        raise ConfigError(f"{prefix}url", f"cannot open the hub folder {url}: {e.strerror or e}") from None


def master_config(section: DictConfig, outer: DictConfig, *, min_deltas: int | None = None,
                  fragments: Any = None, max_delay: int = 0, node_timeout: float | None = None) -> MasterConfig:
    """The :class:`MasterConfig` a master section and the ``outer`` group describe (``min_deltas``,
    ``fragments``, ``node_timeout``: the values when the section leaves them null; a training run's are
    the workers': their quorum, their fragments, their ``diloco.claim_ttl``; ``max_delay``: the workers'
    largest lockstep delay, which a null ``keep_globals`` keeps enough versions for)."""
    values = _section(section, [n for n in MasterConfig.names() if n in section])
    if values.get("min_deltas") is None:
        values["min_deltas"] = min_deltas or 1
    if values.get("node_timeout") is None and node_timeout is not None:
        values["node_timeout"] = float(node_timeout)
    if values.get("keep_globals") is None:
        values["keep_globals"] = max(default_of(MasterConfig, "keep_globals"), max_delay + 2)
    if values.get("fragments") is None and fragments is not None:
        values["fragments"] = OmegaConf.to_container(fragments) if isinstance(fragments, ListConfig) else fragments
    return MasterConfig(outer_optimizer=str(outer.name), outer_options=outer_options(outer), **values).validate()


def sim_options(cfg: DictConfig) -> SimOptions:
    """The :class:`~diloco_lightning.sim.options.SimOptions` of a run's ``sim`` section (validated)."""
    return SimOptions(**_section(cfg.sim, SimOptions.names())).validate(int(cfg.workers))


def worker_options(section: DictConfig) -> dict[str, Any]:
    """The :class:`WorkerOptions` keywords a ``diloco`` section gives (``delay`` as written)."""
    return _section(section, WorkerOptions.names())
