"""Typed Hydra configuration for ``train.py`` / ``diloco-train`` and ``diloco-master``: ONE schema.

Every key is a dataclass field below, with its default and a one-line ``help`` (what
``--help`` prints and ``docs/configuration.md`` lists). ``train.py`` composes
:class:`TrainConf` (``configs/train.yaml``); ``diloco-master`` composes
:class:`MasterCommandConf` (``configs/master.yaml``), which *is* the ``master``,
``hub`` and ``outer`` sections of a training run, laid out at the top level. An unknown
key or a value of the wrong type fails at composition with the key named; range checks
that types cannot express run in :func:`validate` / :func:`validate_master_command`,
which share one check per section (:func:`validate_outer`, :func:`validate_hub`,
:func:`validate_master_section`) and raise :class:`ConfigError` naming the key (they live
in :mod:`diloco_lightning.app.checks`, with the sections' translations into library
objects, and are importable from here).

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
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from diloco_lightning.app.checks import (
    ACCELERATORS,
    INNER_OPTIMIZERS,
    LAUNCH_KINDS,
    PRECISIONS,
    ROLES,
    ConfigError,
    hub_options,
    master_config,
    open_configured_hub,
    outer_options,
    sim_options,
    validate,
    validate_diloco_section,
    validate_hub,
    validate_master_command,
    validate_master_section,
    validate_outer,
    validate_sim_section,
    worker_options,
)
from diloco_lightning.hub.options import HubOptions
from diloco_lightning.master.config import AGGREGATIONS, WEIGHTINGS, MasterConfig
from diloco_lightning.app.supervise import SuperviseOptions
from diloco_lightning.sim.options import SimOptions
from diloco_lightning.util.options import default_of
from diloco_lightning.worker.options import SYNC_MODES, WorkerOptions

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: a checkout (plain or editable install) has the configs beside the package
REPO_ROOT = PACKAGE_DIR.parent


def _data_dir(name: str) -> Path:
    """``diloco_lightning/<name>`` in an installed wheel, else the checkout's top-level ``<name>/``."""
    packaged = PACKAGE_DIR / name
    return packaged if packaged.is_dir() else REPO_ROOT / name


CONFIG_DIR = _data_dir("configs")
RECIPE_DIR = _data_dir("recipes")

__all__ = ["SYNC_MODES", "AGGREGATIONS", "WEIGHTINGS", "ConfigError", "TrainConf", "MasterCommandConf", "validate",
           "validate_master_command", "register_configs",
           # the checks and the sections' translations (diloco_lightning.app.checks), importable from here too
           "ACCELERATORS", "INNER_OPTIMIZERS", "LAUNCH_KINDS", "PRECISIONS", "ROLES", "hub_options", "master_config",
           "open_configured_hub", "outer_options", "sim_options", "validate_diloco_section", "validate_hub",
           "validate_master_section", "validate_outer", "validate_sim_section", "worker_options"]


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
    lead: list[tuple[str, Any, Any, str]] | None = None,
    doc: str | None = None,
) -> type:
    """A schema section made of a library option class's fields (their types, defaults and help),
    with the product's ``defaults`` on top, a few fields given another type (``retype``: name ->
    (type, default, help)) and ``lead`` / ``extra`` keys of the product's own (before / after the
    option class's). The option class stays the one definition: adding an option there adds the key here."""
    hints = typing.get_type_hints(options)
    defaults = defaults or {}
    retype = retype or {}
    unknown = sorted(set(defaults) - {f.name for f in dataclasses.fields(options)})
    if unknown:
        raise TypeError(f"{name}: no option(s) {unknown} in {options.__name__}")
    specs: list[tuple[str, Any, Any]] = [(key, t, field(default=default, metadata={"help": help_}))
                                         for key, t, default, help_ in lead or []]
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
    val_windows: int = opt(64, "held-out windows (seq_len + 1 tokens each) every evaluation scores: the first N of the "
                               "held-out split, the same set whatever data.batch_size is (all of them if the split holds fewer)")
    val_batch_size: int = opt(8, "held-out windows per forward pass while evaluating (memory and speed only, not the result)")
    val_batches: Optional[int] = opt(None, "old name: val_windows = val_batches x val_batch_size (null: use val_windows)")
    cache_dir: Optional[str] = opt(None, "tokenizer/token cache (default $DILOCO_CACHE_DIR or ~/.cache/diloco_lightning)")


@dataclass
class OptimConf:
    name: str = opt("adamw", "inner optimizer: adamw | adamw8bit (bitsandbytes) | muon (Muon on the blocks' matrices, AdamW on "
                                     "the rest: MuLoCo's; lr and weight_decay as AdamW's)")
    lr: float = opt(3e-3, "peak inner learning rate")
    betas: List[float] = opt(help="AdamW betas", factory=lambda: [0.9, 0.95])
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay")
    warmup_steps: int = opt(20, "linear warmup steps, then cosine decay to min_lr_ratio x lr")
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak")


# The ``diloco`` and ``master`` sections are the library's own option classes (WorkerOptions,
# MasterConfig: their defaults, types and help text, one definition). What the product chooses
# otherwise is a config group's choice (configs/diloco/lockstep.yaml, configs/hub/file.yaml), or a
# key of its own (``retype``: a product meaning, said in its help); tests/test_config.py checks it.
DiLoCoConf = compose_section("DiLoCoConf", WorkerOptions)


@dataclass
class OuterConf:
    """The ``outer`` group: the master's outer optimizer (``MasterConfig.outer_*``: the same defaults;
    each command's ``outer`` group default chooses the optimizer, configs/outer/<name>.yaml)."""

    name: str = opt(default_of(MasterConfig, "outer_optimizer"),
                    "outer optimizer: nesterov | fedavg | cgad | adam_decay | adam | delayed_nesterov | pa_cgad | poly_nesterov | "
                    "staleness_sgd | gap_aware | dc_asgd")
    lr: Optional[float] = opt(default_of(MasterConfig, "outer_lr"), "outer learning rate (null: the optimizer's own "
                              "default: fedavg 1, else Speedtronic's 0.7)")
    options: Dict[str, Any] = opt(help="the optimizer's other options (momentum, alpha, tau_cut, betas, eps ...)", factory=dict)
    state_dtype: str = opt("float32", "the outer optimizer's buffers (m, v, momentum): float32 (fp32) | bfloat16 (bf16: "
                                      "half the memory; the math runs in FP32, the buffers are rounded back once per step) | "
                                      "int8 (8-bit blockwise codes, a quarter)")
    stochastic_rounding: bool = opt(False, "with state_dtype=bfloat16: round the buffers stochastically (unbiased, "
                                           "seeded by step and key: a resumed master rounds the same) instead of to nearest even")


MasterConf = compose_section(
    "MasterConf", MasterConfig,
    exclude=("outer_optimizer", "outer_options", "outer_lr", "outer_momentum"),  # the ``outer`` group
    retype={
        "min_deltas": (Any, None, "quorum: accepted deltas before a round is applied, or a fraction of the live "
                                  "nodes (a float in (0, 1]; null: every worker in lockstep, else 1; diloco-master: "
                                  "1.0, every live node)"),
        "keep_globals": (Optional[int], None, "older global versions kept on the hub (null: what the workers' lockstep "
                                              "delay d needs, d + 2, at least 4; diloco-master: 4)"),
        "torch_threads": (Optional[int], 1, "torch threads of the master (this command's process: 1, since the round "
                                            "is memory-bound and more threads stall on shared cores; null: torch's default)"),
        "until_finished": (bool, True, "stop once every worker finished and its last delta is applied, saying where "
                                       "the final model is (train.py's runs end with their workers; diloco-master: "
                                       "false, it serves until stopped)"),
    },
    extra=[("holder", Optional[str], None, "this master's id in the lease (default host:pid:random)")],
    doc="The master's behaviour: ``master.*`` in a training run, the top level of ``diloco-master``.",
)


SimConf = compose_section(
    "SimConf", SimOptions,
    retype={k: (t, None, SimOptions.__dataclass_fields__[k].metadata["help"])
            for k, t in (("speeds", Optional[List[float]]), ("join_at", Optional[List[Optional[float]]]),
                         ("leave_at", Optional[List[Optional[float]]]), ("speed_law", Any),
                         ("traces", Optional[List[Any]]))},
    doc="``launch=sim``: how the simulator schedules the workers (diloco_lightning.sim.SimOptions).",
)


HubConf = compose_section(
    "HubConf", HubOptions,
    lead=[("url", Optional[str], "???", "file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix (required by "
           "diloco-master, hub=hf and hub=s3; train.py's hub=file: null is <run_dir>/hub)")],
    retype={"create": (bool, False, "create the hub folder / hf:// repository if it does not exist (else it is an error, "
                                    "so a misspelt hub is never created; an S3 bucket is never created)")},
    doc="Where the run meets: the ``hub`` section of both commands (diloco_lightning.hub.HubOptions, and the URL).",
)


SuperviseConf = compose_section(
    "SuperviseConf", SuperviseOptions,
    doc="How a run's crashed worker processes are restarted (diloco_lightning.app.supervise.SuperviseOptions).",
)


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
    kind: str = opt("local", "local: master + workers on this machine | submitit: SLURM jobs (the master and one per worker) | "
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
    hub: HubConf = opt(help="", factory=HubConf)  # type: ignore[valid-type]
    trainer: TrainerConf = opt(help="", factory=TrainerConf)
    launch: LaunchConf = opt(help="", factory=LaunchConf)
    supervise: SuperviseConf = opt(help="", factory=SuperviseConf)  # type: ignore[valid-type]
    sim: SimConf = opt(help="", factory=SimConf)  # type: ignore[valid-type]


@dataclass
class MasterCommandConf(MasterConf):  # type: ignore[valid-type,misc]
    """``diloco-master``: the :class:`MasterConf` keys at the top level, plus the hub, the outer
    optimizer and what a standalone process needs."""

    hub: HubConf = opt(help="", factory=HubConf)  # type: ignore[valid-type]
    outer: OuterConf = opt(help="", factory=OuterConf)
    node_state_dir: Optional[str] = opt(
        None, "the master's local state (default: beside a folder hub, <hub>-master; else <hub cache>/master)"
    )
    init: Optional[str] = opt(None, "a safetensors weights file to start from when the hub has no version")
    metrics_path: Optional[str] = opt(None, "JSONL, one line per round (default <node_state_dir>/metrics.jsonl)")
    max_rounds: Optional[int] = opt(None, "exit after this many published rounds")
    max_seconds: Optional[float] = opt(None, "exit after this long")
    until_finished: bool = opt(False, "exit (status 0) once every worker finished and its last delta is applied, "
                                      "saying where the final model is and the diloco-export command")
    drain_on_exit: bool = opt(True, "on Ctrl-C / SIGTERM: apply what is pending in a final round")
    log_level: str = opt("INFO", "logging level of the library's messages (DEBUG, INFO, WARNING)")


# ----------------------------------------------------------------------------- help and docs


def describe(schema: type, cfg: DictConfig | None = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(key, value, help)`` for every key of ``schema`` (depth first); values from ``cfg`` when given."""
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        node = None if cfg is None else OmegaConf.select(cfg, f.name, default=None, throw_on_missing=False)
        sub = dataclass_of(f.type)
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
    "LaunchConf": LaunchConf, "SimConf": SimConf, "SuperviseConf": SuperviseConf,
}


def dataclass_of(t: Any) -> type | None:
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


def run_id_from_overrides(overrides: List[str], *, sweep: bool = False) -> str:
    """A deterministic run id from the command line (never a timestamp).

    Keys that differ between the processes of one run (role, node_index, ...) are left
    out so a worker and its master agree, and so are the keys that extend a run
    (``trainer.max_steps``, ``trainer.max_time``: raising one resumes the same run). In a sweep
    (``sweep``) those stay in: two jobs of one sweep that differ only in ``trainer.max_steps``
    are two runs, each with its own schedule. Long ids are shortened with a hash.
    """
    from diloco_lightning.app.launches import EXTENDING_KEYS

    skip: tuple[str, ...] = ("role=", "node_index=", "run_id=", "run_root=", "launch.", "hub.", "+role=", "trainer.num_threads=",
                             "supervise.")
    if not sweep:
        skip += tuple(k + "=" for k in EXTENDING_KEYS)
    kept = sorted(o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(skip))
    text = ",".join(kept) if kept else "default"
    slug = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if len(slug) > 120:
        slug = slug[:100] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return slug


def _run_id_resolver() -> str:
    from hydra.core.hydra_config import HydraConfig

    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
        overrides, sweep = list(hc.overrides.task), hc.mode == RunMode.MULTIRUN
    except ValueError:  # composed outside a Hydra app (tests): no command line
        overrides, sweep = [], False
    return run_id_from_overrides(overrides, sweep=sweep)


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
