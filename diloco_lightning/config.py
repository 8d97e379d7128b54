"""Typed Hydra configuration for ``train.py`` and ``diloco-master``.

The schema below is registered in Hydra's ConfigStore as ``train_schema`` and is
the first entry of ``configs/train.yaml``'s defaults, so an unknown key or a value
of the wrong type fails at composition with the key named. Range checks (H >= 1,
tau >= 0, ...) run in :func:`validate`, which ``train.py`` calls before anything
else and which names the key too.

Recipes live in the top-level ``recipes/`` folder (one ``# @package _global_``
file each, using ``override /group: option`` defaults). Hydra looks a
``recipe=X`` choice up as ``recipe/X.yaml`` under its search path, so
:func:`register_configs` stores each recipe file in the ConfigStore under the
``recipe`` group: ``python train.py recipe=llama1b_tau8`` then just works, and an
unknown recipe fails at composition listing the available ones.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
RECIPE_DIR = REPO_ROOT / "recipes"

ROLES = ("all", "worker", "master")
SYNC_MODES = ("async", "lockstep")
DELTA_DTYPES = ("float32", "bfloat16")
INNER_OPTIMIZERS = ("adamw", "adamw8bit")
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")
AGGREGATIONS = ("round", "arrival")
WEIGHTINGS = ("equal", "tokens")


@dataclass
class ModelConf:
    preset: str = "tiny"
    vocab_size: Optional[int] = None  # None: the tokenizer's
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 344
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02


@dataclass
class DataConf:
    source: str = "stdlib"  # stdlib | text | tokens
    paths: Optional[str] = None  # glob of text files (source=text) or a token file (source=tokens)
    token_dtype: str = "uint16"
    tokenizer: str = "bpe"  # bpe (trained locally and cached) | byte | path/to/tokenizer.json
    vocab_size: int = 4096
    max_bytes: int = 4_000_000
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.02
    val_batches: int = 8
    cache_dir: Optional[str] = None


@dataclass
class OptimConf:
    name: str = "adamw"
    lr: float = 3e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass
class DiLoCoConf:
    inner_steps: int = 8
    sync: str = "lockstep"
    delay: Any = 0  # int, a per-worker list, or {"distribution": "uniform", "low": 0, "high": 8}
    delta_dtype: str = "float32"
    reset_inner_optimizer: bool = False
    wait_timeout: float = 600.0
    poll_interval: float = 0.05


@dataclass
class OuterConf:
    name: str = "cgad"
    lr: float = 0.7
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class MasterConf:
    poll_interval: float = 0.05
    aggregation: str = "round"
    weighting: str = "equal"
    min_deltas: Optional[int] = None  # None: every worker in lockstep, 1 in async
    max_wait: Optional[float] = None
    max_staleness: Optional[int] = None
    max_delta_norm: Optional[float] = None
    norm_global_ratio: Optional[float] = 100.0
    keep_globals: int = 20
    lease_ttl: float = 60.0


@dataclass
class HubConf:
    url: Optional[str] = None  # None: <run_dir>/hub (a folder hub)
    endpoint: Optional[str] = None  # hf:// only; the token comes from HF_TOKEN, never from configs
    private: bool = True
    cache_dir: Optional[str] = None


@dataclass
class TrainerConf:
    accelerator: str = "cpu"
    devices: int = 1
    precision: str = "32-true"
    max_steps: int = 200
    gradient_clip_val: Optional[float] = 1.0
    log_every_n_steps: int = 10
    val_check_interval: Optional[int] = None  # optimizer steps between evaluations; None: at the end only
    num_threads: Optional[int] = None  # torch threads per worker process; None: cores / workers


@dataclass
class LaunchConf:
    kind: str = "local"  # local: master + K worker processes here | submitit: one SLURM job per worker
    devices: Optional[List[str]] = None  # round-robin device list; None: every visible GPU, else CPU
    timeout: float = 3600.0
    submitit: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConf:
    role: str = "all"
    run_id: Optional[str] = None
    run_root: str = "runs"
    run_dir: Optional[str] = None  # set by train.py: the Hydra job's output dir (<run_root>/<run_id>, or the sweep's)
    seed: int = 0
    workers: int = 2
    node_index: int = 0
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    optim: OptimConf = field(default_factory=OptimConf)
    diloco: DiLoCoConf = field(default_factory=DiLoCoConf)
    outer: OuterConf = field(default_factory=OuterConf)
    master: MasterConf = field(default_factory=MasterConf)
    hub: HubConf = field(default_factory=HubConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    launch: LaunchConf = field(default_factory=LaunchConf)


class ConfigError(ValueError):
    """A configuration value out of range; the message starts with the key."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"{key}: {detail}")


def _check(cond: bool, key: str, detail: str) -> None:
    if not cond:
        raise ConfigError(key, detail)


def validate(cfg: DictConfig) -> DictConfig:
    """Range and choice checks the schema's types cannot express. Returns ``cfg``."""
    from diloco_lightning.outer import OUTER_OPTIMIZERS

    _check(cfg.role in ROLES, "role", f"must be one of {list(ROLES)}, got {cfg.role!r}")
    _check(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
    _check(cfg.workers >= 1, "workers", f"must be >= 1, got {cfg.workers}")
    _check(0 <= cfg.node_index < cfg.workers, "node_index", f"must be in [0, workers={cfg.workers}), got {cfg.node_index}")
    if cfg.run_id is not None:
        _check(re.fullmatch(r"[A-Za-z0-9._=,+-]{1,200}", cfg.run_id) is not None, "run_id",
               f"must be 1-200 characters of [A-Za-z0-9._=,+-], got {cfg.run_id!r}")
    d = cfg.diloco
    _check(d.inner_steps >= 1, "diloco.inner_steps", f"H must be >= 1, got {d.inner_steps}")
    _check(d.sync in SYNC_MODES, "diloco.sync", f"must be one of {list(SYNC_MODES)}, got {d.sync!r}")
    _check(d.delta_dtype in DELTA_DTYPES, "diloco.delta_dtype", f"must be one of {list(DELTA_DTYPES)}, got {d.delta_dtype!r}")
    delay = d.delay
    if isinstance(delay, (ListConfig, list)):
        _check(len(delay) > 0, "diloco.delay", "an empty list")
        for i, v in enumerate(delay):
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"diloco.delay[{i}]",
                   f"tau must be a non-negative integer, got {v!r}")
    elif isinstance(delay, (DictConfig, dict)):
        _check(set(delay) <= {"distribution", "low", "high", "seed"} and delay.get("distribution") == "uniform",
               "diloco.delay", "a distribution must be {distribution: uniform, low: int, high: int[, seed: int]}")
        _check(0 <= int(delay.get("low", 0)) <= int(delay.get("high", -1)), "diloco.delay",
               "need 0 <= low <= high (tau cannot be negative)")
    else:
        _check(isinstance(delay, int) and not isinstance(delay, bool) and delay >= 0, "diloco.delay",
               f"tau must be a non-negative integer, got {delay!r}")
    _check(d.wait_timeout > 0, "diloco.wait_timeout", "must be > 0")
    o = cfg.optim
    _check(o.name in INNER_OPTIMIZERS, "optim.name", f"must be one of {list(INNER_OPTIMIZERS)}, got {o.name!r}")
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", f"must be two values in [0, 1), got {list(o.betas)}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    _check(cfg.outer.name in OUTER_OPTIMIZERS, "outer.name",
           f"unknown outer optimizer {cfg.outer.name!r}; valid: {sorted(OUTER_OPTIMIZERS)}")
    _check(cfg.outer.lr > 0, "outer.lr", f"must be > 0, got {cfg.outer.lr}")
    m = cfg.master
    _check(m.aggregation in AGGREGATIONS, "master.aggregation", f"must be one of {list(AGGREGATIONS)}")
    _check(m.weighting in WEIGHTINGS, "master.weighting", f"must be one of {list(WEIGHTINGS)}")
    _check(m.min_deltas is None or m.min_deltas >= 1, "master.min_deltas", "must be >= 1")
    _check(m.max_staleness is None or m.max_staleness >= 0, "master.max_staleness", "must be >= 0")
    _check(m.keep_globals >= 1, "master.keep_globals", "must be >= 1")
    _check(m.poll_interval > 0, "master.poll_interval", "must be > 0")
    t = cfg.trainer
    _check(t.precision in PRECISIONS, "trainer.precision", f"must be one of {list(PRECISIONS)}, got {t.precision!r}")
    _check(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    _check(t.devices >= 1, "trainer.devices", "must be >= 1")
    da = cfg.data
    _check(da.source in ("stdlib", "text", "tokens"), "data.source", f"must be stdlib, text or tokens, got {da.source!r}")
    _check(da.source == "stdlib" or da.paths, "data.paths", f"required when data.source={da.source}")
    _check(da.seq_len >= 1, "data.seq_len", "must be >= 1")
    _check(da.batch_size >= 1, "data.batch_size", "must be >= 1")
    _check(0 < da.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
    _check(cfg.model.max_seq_len >= da.seq_len, "model.max_seq_len", f"must be >= data.seq_len ({da.seq_len})")
    _check(cfg.launch.kind in ("local", "submitit"), "launch.kind", "must be local or submitit")
    return cfg


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
    """Store the schema and every ``recipes/*.yaml`` in Hydra's ConfigStore (idempotent)."""
    if not OmegaConf.has_resolver("dl_run_id"):
        OmegaConf.register_new_resolver("dl_run_id", _run_id_resolver)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConf)
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        if not isinstance(node, dict):
            raise ConfigError(f"recipe={path.stem}", f"{path} must hold a mapping")
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
