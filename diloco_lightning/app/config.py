"""Typed Hydra configuration for ``train.py`` / ``diloco-train`` and ``diloco-master``: ONE schema.

Every key is a dataclass field below, with its default and a one-line ``help`` (what
``--help`` prints and ``docs/configuration.md`` lists). ``train.py`` composes
:class:`TrainConf` (``configs/train.yaml``); ``diloco-master`` composes
:class:`MasterCommandConf` (``configs/master.yaml``), which *is* the ``master``,
``hub`` and ``outer`` sections of a training run, laid out at the top level. An unknown
key or a value of the wrong type fails at composition with the key named; range checks
that types cannot express run in :func:`validate` / :func:`validate_master_command`,
which share one check per section (:func:`validate_outer`, :func:`validate_hub`,
:func:`validate_master_section`) and raise :class:`ConfigError` naming the key.

Configs live in the top-level ``configs/`` folder of a checkout and ship inside the
wheel as ``diloco_lightning/configs`` (``setup.py`` maps the one onto the other: one
copy). Recipes (``recipes/*.yaml``, one ``# @package _global_`` file each, using
``override /group: option`` defaults) likewise. Hydra looks a ``recipe=X`` choice up as
``recipe/X.yaml`` under its search path, so :func:`register_configs` stores each recipe
file in the ConfigStore under the ``recipe`` group: ``python train.py
recipe=llama1b_tau8`` then just works, and an unknown recipe fails at composition
listing the available ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from diloco_lightning.master.config import AGGREGATIONS, WEIGHTINGS, MasterConfig
from diloco_lightning.options import OptionError
from diloco_lightning.sim.options import SimOptions
from diloco_lightning.worker.options import SYNC_MODES, WorkerOptions

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: a checkout (plain or editable install) has the configs beside the package
REPO_ROOT = PACKAGE_DIR.parent


def _data_dir(name: str) -> Path:
    """``diloco_lightning/<name>`` in an installed wheel, else the checkout's top-level ``<name>/``."""
    packaged = PACKAGE_DIR / name
    return packaged if packaged.is_dir() else REPO_ROOT / name


CONFIG_DIR = _data_dir("configs")
RECIPE_DIR = _data_dir("recipes")

ROLES = ("all", "worker", "master")
INNER_OPTIMIZERS = ("adamw", "adamw8bit")
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCH_KINDS = ("local", "submitit", "sim")
__all__ = ["SYNC_MODES", "AGGREGATIONS", "WEIGHTINGS", "ConfigError", "TrainConf", "MasterCommandConf", "validate",
           "validate_master_command", "register_configs"]


def opt(default: Any = None, help: str = "", *, factory: Any = None) -> Any:  # noqa: A002 - the key's help text
    """A schema field: its default (or ``factory``) and the one line ``--help`` prints for it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def compose_section(
    name: str,
    options: type,
    *,
    exclude: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    retype: dict[str, tuple[Any, Any, str]] | None = None,
    extra: list[tuple[str, Any, Any, str]] | None = None,
    doc: str | None = None,
) -> type:
    """A schema section made of a library option class's fields (their types, defaults and help),
    with the product's ``defaults`` on top, a few fields given another type (``retype``: name ->
    (type, default, help)) and ``extra`` keys of the product's own. The option class stays the one
    definition: adding an option there adds the key here."""
    hints = typing.get_type_hints(options)
    defaults = defaults or {}
    retype = retype or {}
    unknown = sorted(set(defaults) - {f.name for f in dataclasses.fields(options)})
    if unknown:
        raise TypeError(f"{name}: no option(s) {unknown} in {options.__name__}")
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(options):
        if f.name in exclude:
            continue
        if f.name in retype:
            t, default, help_ = retype[f.name]
            specs.append((f.name, t, field(default=default, metadata={"help": help_})))
        elif f.name in defaults:
            specs.append((f.name, hints[f.name], field(default=defaults[f.name], metadata=f.metadata)))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            specs.append((f.name, hints[f.name], field(default_factory=f.default_factory, metadata=f.metadata)))
        else:
            specs.append((f.name, hints[f.name], field(default=f.default, metadata=f.metadata)))
    for key, t, default, help_ in extra or []:
        specs.append((key, t, field(default=default, metadata={"help": help_})))
    cls = dataclasses.make_dataclass(name, specs)
    cls.__module__ = __name__
    cls.__doc__ = doc or f"{options.__name__}'s options (diloco_lightning), as schema keys."
    return cls


@dataclass
class ModelConf:
    preset: str = opt("tiny", "name of the geometry (set by the model group: tiny, llama25m, llama1b, llama7b)")
    vocab_size: Optional[int] = opt(None, "embedding rows; null: the tokenizer's size (data.vocab_size)")
    d_model: int = opt(128, "hidden size C")
    n_layers: int = opt(4, "transformer blocks")
    n_heads: int = opt(4, "query heads (must divide d_model)")
    n_kv_heads: int = opt(2, "key/value heads (grouped-query attention; must divide n_heads)")
    ffn_hidden: int = opt(344, "SwiGLU hidden size")
    max_seq_len: int = opt(512, "longest sequence the rotary tables cover (>= data.seq_len)")
    rope_theta: float = opt(10000.0, "rotary embedding base")
    norm_eps: float = opt(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = opt(True, "share the input embedding and the output head")
    init_std: float = opt(0.02, "std of the normal init")


@dataclass
class DataConf:
    source: str = opt("stdlib", "stdlib (Python's own sources, no download) | text (data.paths) | tokens (a token file)")
    paths: Optional[str] = opt(None, "glob of text files (source=text) or a flat token file (source=tokens)")
    token_dtype: str = opt("uint16", "dtype of the token file (source=tokens)")
    tokenizer: str = opt("bpe", "bpe (trained locally and cached) | byte | path/to/tokenizer.json")
    vocab_size: int = opt(4096, "BPE vocabulary trained (and the model's, unless model.vocab_size is set)")
    max_bytes: int = opt(4_000_000, "bytes of text read to train the tokenizer and build the token cache")
    seq_len: int = opt(128, "tokens per training sequence")
    batch_size: int = opt(8, "sequences per optimizer step, per worker")
    val_fraction: float = opt(0.02, "share of the tokens held out for evaluation")
    val_batches: int = opt(8, "held-out batches per evaluation")
    cache_dir: Optional[str] = opt(None, "tokenizer/token cache (default $DILOCO_CACHE_DIR or ~/.cache/diloco_lightning)")


@dataclass
class OptimConf:
    name: str = opt("adamw", "inner optimizer: adamw | adamw8bit (bitsandbytes)")
    lr: float = opt(3e-3, "peak inner learning rate")
    betas: List[float] = opt(help="AdamW betas", factory=lambda: [0.9, 0.95])
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay")
    warmup_steps: int = opt(20, "linear warmup steps, then cosine decay to min_lr_ratio x lr")
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak")


# The ``diloco`` and ``master`` sections are the library's own option classes (WorkerOptions,
# MasterConfig: their defaults, types and help text), with the product's defaults on top.
DiLoCoConf = compose_section(
    "DiLoCoConf", WorkerOptions,
    defaults={"inner_steps": 8, "dylu_steps": 8, "sync": "lockstep", "wait_timeout": 600.0, "poll_interval": 0.05},
)


@dataclass
class OuterConf:
    name: str = opt("cgad", "outer optimizer: nesterov | cgad | adam_decay | adam | delayed_nesterov | pa_cgad | poly_nesterov")
    lr: float = opt(0.7, "outer learning rate")
    options: Dict[str, Any] = opt(help="the optimizer's other options (momentum, alpha, tau_cut, betas, eps ...)", factory=dict)
    state_dtype: str = opt("float32", "the outer optimizer's buffers (m, v, momentum): float32 (fp32) | bfloat16 (bf16: "
                                      "half the memory; the math runs in FP32, the buffers are rounded back once per step)")
    stochastic_rounding: bool = opt(False, "with state_dtype=bfloat16: round the buffers stochastically (unbiased, "
                                           "seeded by step and key: a resumed master rounds the same) instead of to nearest even")


MasterConf = compose_section(
    "MasterConf", MasterConfig,
    exclude=("outer_optimizer", "outer_options", "outer_lr", "outer_momentum"),  # the ``outer`` group
    defaults={"poll_interval": 0.05, "keep_globals": 20, "torch_threads": 1},
    retype={"min_deltas": (Any, None, "quorum: accepted deltas before a round is applied, or a fraction of the live "
                                      "nodes (a float in (0, 1]; null: every worker in lockstep, else 1)")},
    extra=[("holder", Optional[str], None, "this master's id in the lease (default host:pid:random)")],
    doc="The master's behaviour: ``master.*`` in a training run, the top level of ``diloco-master``.",
)


SimConf = compose_section(
    "SimConf", SimOptions,
    retype={k: (t, None, SimOptions.__dataclass_fields__[k].metadata["help"])
            for k, t in (("speeds", Optional[List[float]]), ("join_at", Optional[List[Optional[float]]]),
                         ("leave_at", Optional[List[Optional[float]]]))},
    doc="``launch=sim``: how the simulator schedules the workers (diloco_lightning.sim.SimOptions).",
)


@dataclass
class HubConf:
    url: Optional[str] = opt(
        "???", "file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix (required by diloco-master, hub=hf "
        "and hub=s3; train.py's hub=file: null is <run_dir>/hub)"
    )
    create: bool = opt(
        False, "create the hub folder / hf:// repository if it does not exist (else it is an error; an S3 bucket is never created)"
    )
    endpoint_url: Optional[str] = opt(
        None, "s3://: the store's endpoint URL (MinIO, R2, Ceph ...; default AWS, or $AWS_ENDPOINT_URL_S3); hf://: the "
        "Hub's URL (default https://huggingface.co or $HF_ENDPOINT)"
    )
    endpoint: Optional[str] = opt(None, "the same as hub.endpoint_url (an alias: set one of them)")
    region: Optional[str] = opt(None, "s3:// only: the bucket's region (default boto3's: $AWS_REGION, the profile ...)")
    addressing_style: Optional[str] = opt(None, "s3:// only: path | virtual | auto (MinIO usually needs path)")
    revision: Optional[str] = opt(None, "hf:// only: the branch (default main)")
    private: bool = opt(True, "hf:// only: a created repository is private")
    layout: str = opt(
        "shared", "hf:// only: shared (one repository for the run) | per_node (hub.url is the master's repository, each "
        "node writes to its own, named by hub.node_repo: a commit budget per node; see the README)"
    )
    node_repo: str = opt(
        "{repo}-{node}", "hf:// with layout=per_node: the node repositories' names ({org} and {repo}: hub.url's parts; "
        "{node}: the node id; a '/' names another namespace)"
    )
    commits_per_hour: float = opt(
        128.0, "hf:// only: commits this process makes per repository and hour at most (128: the Hub's limit on a free "
        "account; 0: no limit). A delta beyond it is merged into the next one, a publication waits. With "
        "layout=shared every process commits to one repository: give each its share"
    )
    cache_dir: Optional[str] = opt(None, "downloads (default $DILOCO_CACHE_DIR or ~/.cache/diloco_lightning, then <hash of the url>)")


@dataclass
class TrainerConf:
    accelerator: str = opt("cpu", "cpu | gpu | cuda | auto")
    devices: int = opt(1, "devices per worker (more than 1: DDP inside the worker)")
    precision: str = opt("32-true", "32-true | bf16-true | bf16-mixed | 16-mixed")
    max_steps: int = opt(200, "optimizer steps per worker")
    max_time: Optional[float] = opt(None, "seconds each worker trains at most, then stops as at max_steps (null: no limit)")
    gradient_clip_val: Optional[float] = opt(1.0, "gradient norm clip (null: off)")
    log_every_n_steps: int = opt(10, "steps between progress/metric lines")
    val_check_interval: Optional[int] = opt(None, "steps between a worker's local evaluations (null: none)")
    num_threads: Optional[int] = opt(None, "torch threads per worker process (null: cores / workers)")


@dataclass
class LaunchConf:
    kind: str = opt("local", "local: master + workers on this machine | submitit: one SLURM job per worker | "
                             "sim: the run in this process on the simulator (sim.*)")
    devices: Optional[List[str]] = opt(None, "GPUs assigned round-robin to the workers (null: every visible GPU, else CPU)")
    timeout: float = opt(3600.0, "seconds a role=all run may last")
    check_resources: bool = opt(True, "refuse to start when the machine lacks what the recipe needs (false: start anyway)")
    available_memory_gb: Optional[float] = opt(
        None, "memory this run may use, GB (null: measure: free RAM, or each GPU's memory)"
    )
    eval_points: int = opt(8, "evaluations of the global model during a role=all run (eval_curve in results.json)")
    submitit: Dict[str, Any] = opt(help="submitit executor parameters (partition, timeout_min, gpus_per_node ...)", factory=dict)


@dataclass
class TrainConf:
    role: str = opt("all", "all: master + workers here | worker | master")
    run_id: Optional[str] = opt(None, "run folder name (default: from the command line; set it to join or resume a run)")
    run_root: str = opt("runs", "where run folders go")
    run_dir: Optional[str] = opt(None, "set by train.py: the Hydra job's output dir (<run_root>/<run_id>)")
    seed: int = opt(0, "seed of the model init, data order and delays")
    workers: int = opt(2, "number of workers")
    node_index: int = opt(0, "role=worker: which worker this process is (0 <= node_index < workers)")
    model: ModelConf = opt(help="", factory=ModelConf)
    data: DataConf = opt(help="", factory=DataConf)
    optim: OptimConf = opt(help="", factory=OptimConf)
    diloco: DiLoCoConf = opt(help="", factory=DiLoCoConf)  # type: ignore[valid-type]  # made by compose_section
    outer: OuterConf = opt(help="", factory=OuterConf)
    master: MasterConf = opt(help="", factory=MasterConf)  # type: ignore[valid-type]
    hub: HubConf = opt(help="", factory=HubConf)
    trainer: TrainerConf = opt(help="", factory=TrainerConf)
    launch: LaunchConf = opt(help="", factory=LaunchConf)
    sim: SimConf = opt(help="", factory=SimConf)  # type: ignore[valid-type]


@dataclass
class MasterCommandConf(MasterConf):  # type: ignore[valid-type,misc]
    """``diloco-master``: the :class:`MasterConf` keys at the top level, plus the hub, the outer
    optimizer and what a standalone process needs."""

    hub: HubConf = opt(help="", factory=HubConf)
    outer: OuterConf = opt(help="", factory=OuterConf)
    node_state_dir: Optional[str] = opt(
        None, "the master's local state (default: beside a folder hub, <hub>-master; else <hub cache>/master)"
    )
    init: Optional[str] = opt(None, "a safetensors weights file to start from when the hub has no version")
    metrics_path: Optional[str] = opt(None, "JSONL, one line per round (default <node_state_dir>/metrics.jsonl)")
    max_rounds: Optional[int] = opt(None, "exit after this many published rounds")
    max_seconds: Optional[float] = opt(None, "exit after this long")
    drain_on_exit: bool = opt(True, "on Ctrl-C / SIGTERM: apply what is pending in a final round")
    log_level: str = opt("INFO", "logging level of the library's messages (DEBUG, INFO, WARNING)")


class ConfigError(ValueError):
    """A configuration value out of range; the message starts with the key."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"{key}: {detail}")


def _check(cond: bool, key: str, detail: str) -> None:
    if not cond:
        raise ConfigError(key, detail)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----------------------------------------------------------------------------- shared section checks


def validate_outer(o: DictConfig, prefix: str = "outer.") -> None:
    """The outer optimizer section (both commands)."""
    from diloco_lightning.outer import OUTER_OPTIMIZERS

    _check(o.name in OUTER_OPTIMIZERS, f"{prefix}name",
           f"unknown outer optimizer {o.name!r}; valid: {', '.join(sorted(OUTER_OPTIMIZERS))}")
    _check(_number(o.lr) and o.lr > 0, f"{prefix}lr", f"must be a number > 0, got {o.lr}")
    _check(isinstance(o.options, (DictConfig, dict)), f"{prefix}options", "must be a mapping")
    from diloco_lightning.outer.base import STATE_DTYPES

    state_dtype = str(o.get("state_dtype", "float32"))
    _check(state_dtype in STATE_DTYPES, f"{prefix}state_dtype", f"must be float32 (fp32) or bfloat16 (bf16), got {state_dtype!r}")
    _check(not o.get("stochastic_rounding", False) or STATE_DTYPES[state_dtype] != STATE_DTYPES["float32"],
           f"{prefix}stochastic_rounding", f"needs {prefix}state_dtype=bfloat16 (FP32 buffers are not rounded)")
    try:
        outer_options(o, prefix)
    except ValueError as e:
        raise ConfigError(f"{prefix}options", str(e)) from None


def outer_options(o: DictConfig, prefix: str = "outer.") -> dict[str, Any]:
    """``{"lr": o.lr, **o.options}`` for the named optimizer; options it does not take are dropped
    with a warning, so ``outer.name=X`` works on top of another group's options."""
    from diloco_lightning.outer import outer_optimizer_options

    raw = OmegaConf.to_container(o.options, resolve=True) if isinstance(o.options, DictConfig) else dict(o.options or {})
    opts: dict[str, Any] = {str(k): v for k, v in (raw or {}).items()}  # type: ignore[union-attr]
    opts["lr"] = float(o.lr)
    # the buffers' precision: recorded only when not the default (a published run's options stay as they were)
    if str(o.get("state_dtype", "float32")) not in ("float32", "fp32"):
        opts["state_dtype"] = str(o.state_dtype)
    if o.get("stochastic_rounding", False):
        opts["stochastic_rounding"] = True
    accepted = outer_optimizer_options(str(o.name))
    dropped = sorted(k for k in opts if k not in accepted)
    if dropped:
        log.warning("outer optimizer %r takes no option(s) %s; ignoring %s", o.name, dropped,
                    ", ".join(f"{prefix}options.{k}" for k in dropped))
        opts = {k: v for k, v in opts.items() if k in accepted}
    if isinstance(opts.get("betas"), list):
        opts["betas"] = tuple(opts["betas"])
    return opts


def validate_hub(h: DictConfig, prefix: str = "hub.", *, required: bool = False) -> None:
    """The hub section (both commands): the URL's form (whether it exists is checked when it is opened)."""
    from omegaconf import MISSING

    _check(not OmegaConf.is_missing(h, "url"), f"{prefix}url", "is required: file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix")
    url = h.url
    if url is None or url == MISSING:
        _check(not required, f"{prefix}url", "is required: file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix")
        return
    _check(isinstance(url, str) and url.strip() != "", f"{prefix}url", f"must be a non-empty string, got {url!r}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    _check(scheme in ("", "file", "hf", "s3"), f"{prefix}url",
           f"unsupported scheme in {url!r}; use file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix")
    _check(scheme == "hf" or not h.get("revision"), f"{prefix}revision", f"applies to hf:// hubs only (hub.url is {url!r})")
    for key in ("endpoint_url", "endpoint"):
        _check(scheme in ("hf", "s3") or not h.get(key), f"{prefix}{key}",
               f"applies to hf:// and s3:// hubs only (hub.url is {url!r})")
    _check(not (h.get("endpoint") and h.get("endpoint_url") and h.endpoint != h.endpoint_url), f"{prefix}endpoint_url",
           f"and {prefix}endpoint are the same option and disagree ({h.endpoint_url!r}, {h.endpoint!r}); set one of them")
    for key in ("region", "addressing_style"):
        _check(scheme == "s3" or not h.get(key), f"{prefix}{key}", f"applies to s3:// hubs only (hub.url is {url!r})")
    _check(h.get("addressing_style") in (None, "path", "virtual", "auto"), f"{prefix}addressing_style",
           f"must be path, virtual or auto, got {h.get('addressing_style')!r}")
    layout = h.get("layout", "shared")
    _check(layout in ("shared", "per_node"), f"{prefix}layout", f"must be shared or per_node, got {layout!r}")
    _check(scheme == "hf" or layout == "shared", f"{prefix}layout", f"per_node applies to hf:// hubs only (hub.url is {url!r})")
    if scheme == "hf" and layout == "per_node":
        from diloco_lightning.hub.hf_nodes import parse_node_repo

        try:
            org, _, name = url[len("hf://"):].strip("/").partition("/")
            parse_node_repo(h.node_repo, org, name)
        except ValueError as e:
            raise ConfigError(f"{prefix}node_repo", str(e)) from None
    cph = h.get("commits_per_hour", 128.0)
    _check(_number(cph) and (cph == 0 or cph >= 1), f"{prefix}commits_per_hour", f"must be 0 (no limit) or >= 1, got {cph}")


def _section(node: DictConfig, names: list[str]) -> dict[str, Any]:
    return {k: OmegaConf.to_container(node[k], resolve=True) if isinstance(node[k], (DictConfig, ListConfig)) else node[k]
            for k in names if k in node}


def validate_master_section(m: DictConfig, prefix: str = "master.") -> None:
    """The master's behaviour (``master.*`` of a training run, the top level of ``diloco-master``):
    :meth:`MasterConfig.validate`, the one validation, with the key's full name in the error."""
    values = _section(m, [n for n in MasterConfig.names() if n in m])
    if values.get("min_deltas") is None:
        values.pop("min_deltas", None)  # null: decided by the run (every worker in lockstep, else 1)
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
    validate_outer(cfg.outer, "outer.")
    validate_master_section(cfg.master, "master.")
    validate_hub(cfg.hub, "hub.")
    t = cfg.trainer
    _check(t.accelerator in ACCELERATORS, "trainer.accelerator", f"must be one of {list(ACCELERATORS)}, got {t.accelerator!r}")
    _check(t.precision in PRECISIONS, "trainer.precision", f"must be one of {list(PRECISIONS)}, got {t.precision!r}")
    _check(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    _check(t.max_time is None or t.max_time > 0, "trainer.max_time", f"must be > 0 seconds or null, got {t.max_time}")
    _check(t.devices >= 1, "trainer.devices", "must be >= 1")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", "must be >= 1")
    da = cfg.data
    _check(da.source in ("stdlib", "text", "tokens"), "data.source", f"must be stdlib, text or tokens, got {da.source!r}")
    _check(da.source == "stdlib" or da.paths, "data.paths", f"required when data.source={da.source}")
    _check(da.seq_len >= 1, "data.seq_len", "must be >= 1")
    _check(da.batch_size >= 1, "data.batch_size", "must be >= 1")
    _check(0 < da.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
    _check(cfg.model.max_seq_len >= da.seq_len, "model.max_seq_len", f"must be >= data.seq_len ({da.seq_len})")
    la = cfg.launch
    _check(la.kind in LAUNCH_KINDS, "launch.kind", f"must be one of {list(LAUNCH_KINDS)}, got {la.kind!r}")
    _check(la.available_memory_gb is None or la.available_memory_gb > 0, "launch.available_memory_gb", "must be > 0")
    _check(la.eval_points >= 0, "launch.eval_points", "must be >= 0")
    _check(la.timeout > 0, "launch.timeout", "must be > 0")
    if la.kind == "sim":
        validate_sim_section(cfg)
    return cfg


def validate_sim_section(cfg: DictConfig) -> None:
    """``launch=sim``: the ``sim`` section, and what the simulator does not reproduce."""
    from diloco_lightning.sim.inner import PRECISIONS as SIM_PRECISIONS

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
    frags = cfg.diloco.get("fragments")
    _check(frags is None or frags == 1, "diloco.fragments",
           "launch=sim does not simulate streaming fragments yet: drop diloco.fragments, or run it with launch=local")
    _check(cfg.diloco.inner_steps != "auto", "diloco.inner_steps",
           "launch=sim does not simulate Dynamic Local Updates yet (inner_steps=auto): give a number of inner steps")


def validate_master_command(cfg: DictConfig) -> DictConfig:
    """``diloco-master``'s checks: the same section checks as a training run's. Returns ``cfg``."""
    validate_hub(cfg.hub, "hub.", required=True)
    validate_outer(cfg.outer, "outer.")
    validate_master_section(cfg, "")
    _check(cfg.max_rounds is None or cfg.max_rounds >= 0, "max_rounds", f"must be >= 0, got {cfg.max_rounds}")
    _check(cfg.max_seconds is None or cfg.max_seconds > 0, "max_seconds", f"must be > 0, got {cfg.max_seconds}")
    _check(str(cfg.log_level).upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
           f"must be DEBUG, INFO, WARNING or ERROR, got {cfg.log_level!r}")
    if cfg.init is not None:
        _check(Path(cfg.init).expanduser().is_file(), "init", f"no such weights file: {cfg.init}")
    return cfg


# ----------------------------------------------------------------------------- turning sections into objects


def hub_options(h: DictConfig, url: str, *, create: bool | None = None) -> dict[str, Any]:
    """``open_hub`` options of a hub section for ``url`` (only those that apply to its transport)."""
    opts: dict[str, Any] = {}
    if h.get("cache_dir"):
        opts["cache_dir"] = h.cache_dir
    endpoint = h.get("endpoint_url") or h.get("endpoint")  # one option, two names
    if url.startswith("s3://"):  # a bucket is never created; a prefix needs no creating
        if endpoint:
            opts["endpoint_url"] = endpoint
        for key in ("region", "addressing_style"):
            if h.get(key):
                opts[key] = h[key]
        return opts
    opts["create"] = bool(h.create) if create is None else create
    if url.startswith("hf://"):
        if endpoint:
            opts["endpoint"] = endpoint
        if h.get("revision"):
            opts["revision"] = h.revision
        opts["private"] = bool(h.get("private", True))
        opts["commits_per_hour"] = float(h.get("commits_per_hour", 128.0))
        if h.get("layout", "shared") == "per_node":
            opts["layout"] = "per_node"
            opts["node_repo"] = h.node_repo
    return opts


def open_configured_hub(h: DictConfig, url: str | None = None, *, create: bool | None = None, prefix: str = "hub."):
    """Open the hub a section names (``url`` overrides ``h.url``). A hub that does not exist is a
    :class:`ConfigError` naming ``hub.url`` unless ``hub.create`` (or ``create``) asks to create it."""
    from diloco_lightning.hub import HubNotFoundError, open_hub

    url = url or h.url
    opts = hub_options(h, url, create=create)
    try:
        return open_hub(url, **opts)
    except HubNotFoundError as e:
        if str(url).startswith("s3://"):  # the transport's message says what to do (a bucket is never created)
            raise ConfigError(f"{prefix}url", str(e)) from None
        raise ConfigError(f"{prefix}url", f"{e}; check the spelling, or pass {prefix}create=true to create it") from None
    except ValueError as e:
        raise ConfigError(f"{prefix}url", str(e)) from None
    except OSError as e:  # a folder hub that cannot be created or read (permissions, a file in the way)
        raise ConfigError(f"{prefix}url", f"cannot open the hub folder {url}: {e.strerror or e}") from None


def master_config(section: DictConfig, outer: DictConfig, *, min_deltas: int | None = None,
                  fragments: Any = None) -> MasterConfig:
    """The :class:`MasterConfig` a master section and the ``outer`` group describe (``min_deltas``,
    ``fragments``: the values when the section leaves them null; a training run's are the workers')."""
    values = _section(section, [n for n in MasterConfig.names() if n in section])
    if values.get("min_deltas") is None:
        values["min_deltas"] = min_deltas or 1
    if values.get("fragments") is None and fragments is not None:
        values["fragments"] = OmegaConf.to_container(fragments) if isinstance(fragments, ListConfig) else fragments
    return MasterConfig(outer_optimizer=str(outer.name), outer_options=outer_options(outer), **values).validate()


def sim_options(cfg: DictConfig) -> SimOptions:
    """The :class:`~diloco_lightning.sim.options.SimOptions` of a run's ``sim`` section (validated)."""
    return SimOptions(**_section(cfg.sim, SimOptions.names())).validate(int(cfg.workers))


def worker_options(section: DictConfig) -> dict[str, Any]:
    """The :class:`WorkerOptions` keywords a ``diloco`` section gives (``delay`` as written)."""
    return _section(section, WorkerOptions.names())


# ----------------------------------------------------------------------------- help and docs


def field_help(cls: type, name: str) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    return ""


def describe(schema: type, cfg: DictConfig | None = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(key, value, help)`` for every key of ``schema`` (depth first); values from ``cfg`` when given."""
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        node = None if cfg is None else OmegaConf.select(cfg, f.name, default=None, throw_on_missing=False)
        sub = _dataclass_of(f.type)
        if sub is not None:
            out.extend(describe(sub, node if isinstance(node, DictConfig) else None, key + "."))
            continue
        if cfg is not None and OmegaConf.is_missing(cfg, f.name):
            value: Any = "???"
        elif cfg is not None:
            value = OmegaConf.to_container(node, resolve=False) if isinstance(node, (DictConfig, ListConfig)) else node
        else:
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        out.append((key, value, f.metadata.get("help", "")))
    return out


_SECTION_TYPES = {
    "ModelConf": ModelConf, "DataConf": DataConf, "OptimConf": OptimConf, "DiLoCoConf": DiLoCoConf,
    "OuterConf": OuterConf, "MasterConf": MasterConf, "HubConf": HubConf, "TrainerConf": TrainerConf,
    "LaunchConf": LaunchConf, "SimConf": SimConf,
}


def _dataclass_of(t: Any) -> type | None:
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return t
    return _SECTION_TYPES.get(t) if isinstance(t, str) else None


def group_options(group: str) -> list[tuple[str, str]]:
    """``(option, first comment line)`` of each ``configs/<group>/*.yaml`` (or recipe)."""
    folder = RECIPE_DIR if group == "recipe" else CONFIG_DIR / group
    out = []
    for p in sorted(folder.glob("*.yaml")):
        words: list[str] = []
        for line in p.read_text().splitlines():
            text = line.strip()
            if text.startswith("# @package") or (not words and not text):
                continue
            if not text.startswith("#"):
                break
            words.append(text.lstrip("#").strip())
        desc = " ".join(w for w in words if w)
        out.append((p.stem, desc if len(desc) <= 160 else desc[:157].rsplit(" ", 1)[0] + " ..."))
    return out


def format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return str(value)


# ----------------------------------------------------------------------------- Hydra plumbing


def run_id_from_overrides(overrides: List[str]) -> str:
    """A deterministic run id from the command line (never a timestamp).

    Keys that differ between the processes of one run (role, node_index, ...) are left
    out so a worker and its master agree. Long ids are shortened with a hash.
    """
    skip = ("role=", "node_index=", "run_id=", "run_root=", "launch.", "hub.", "+role=", "trainer.num_threads=")
    kept = sorted(o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(skip))
    text = ",".join(kept) if kept else "default"
    slug = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if len(slug) > 120:
        slug = slug[:100] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return slug


def _run_id_resolver() -> str:
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # composed outside a Hydra app (tests): no command line
        overrides = []
    return run_id_from_overrides(overrides)


def register_configs() -> None:
    """Store both schemas and every ``recipes/*.yaml`` in Hydra's ConfigStore (idempotent)."""
    if not OmegaConf.has_resolver("dl_run_id"):
        OmegaConf.register_new_resolver("dl_run_id", _run_id_resolver)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConf)
    cs.store(name="master_schema", node=MasterCommandConf)
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        if not isinstance(node, dict):
            raise ConfigError(f"recipe={path.stem}", f"{path} must hold a mapping")
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")


def to_container(cfg: DictConfig | dict | None) -> dict[str, Any]:
    """A mapping section as a plain, resolved dict (``{}`` for None)."""
    if cfg is None:
        return {}
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)  # type: ignore[return-value]
