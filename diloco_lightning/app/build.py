"""The pieces of a run, from its configuration: folders and the hub, the data, the model, the
master, and the evaluation of a global model. Every part of the product builds them here.

Run folders derive from ``run_id`` (itself derived from the command line), never from
timestamps, and nothing relies on Hydra changing the working directory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.app.config import hub_options as _section_hub_options
from diloco_lightning.app.config import master_config, open_configured_hub, to_container
from diloco_lightning.app.config import outer_options as _section_outer_options

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"


def recipe_name() -> str | None:
    """The ``recipe=`` chosen on the command line (None outside a Hydra app or without one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get("recipe")
    except (ValueError, ImportError, AttributeError):
        return None


def run_dir(cfg: DictConfig) -> Path:
    """``cfg.run_dir`` (the Hydra job's output dir, set by :func:`run`), else ``<run_root>/<run_id>``."""
    if OmegaConf.select(cfg, "run_dir"):
        return Path(cfg.run_dir).resolve()
    return (Path(cfg.run_root) / cfg.run_id).resolve()


def resolve_run_dir(cfg: DictConfig) -> None:
    """Pin ``cfg.run_dir`` once, so every process of the run (workers read the saved config) agrees."""
    if OmegaConf.select(cfg, "run_dir"):
        return
    try:
        from hydra.core.hydra_config import HydraConfig

        out = HydraConfig.get().runtime.output_dir
    except (ValueError, ImportError):
        out = None
    with open_dict_safe(cfg):
        cfg.run_dir = str(Path(out).resolve()) if out else str((Path(cfg.run_root) / cfg.run_id).resolve())


def open_dict_safe(cfg: DictConfig):
    from omegaconf import open_dict

    return open_dict(cfg)


def hub_url(cfg: DictConfig) -> str:
    return cfg.hub.url or (run_dir(cfg) / "hub").as_uri()


def hub_options(cfg: DictConfig) -> dict[str, Any]:
    """``open_hub`` options of a worker: the hub must exist (the role=all parent creates its folder
    first) unless ``hub.create=true``."""
    return _section_hub_options(cfg.hub, hub_url(cfg))


def open_run_hub(cfg: DictConfig):
    """The run's hub for the master / the role=all parent: ``<run_dir>/hub`` (created), or ``hub.url``
    (it must exist unless ``hub.create=true``)."""
    if cfg.hub.url:
        return open_configured_hub(cfg.hub)
    return open_configured_hub(cfg.hub, hub_url(cfg), create=True)


def hub_label(cfg: DictConfig) -> str:
    """The hub as users read it: a folder path, or the URL."""
    return cfg.hub.url or str(run_dir(cfg) / "hub")


def node_id(index: int) -> str:
    return f"w{index}"


def worker_delay(cfg: DictConfig, index: int) -> int:
    """This worker's staleness tau: :func:`~diloco_lightning.worker.resolve_delay` (the one draw), a
    distribution seeded by ``seed`` unless it names its own."""
    from diloco_lightning.worker import resolve_delay

    delay = cfg.diloco.delay
    if isinstance(delay, (DictConfig, dict)):
        delay = {"seed": cfg.seed, **to_container(delay)}
    elif OmegaConf.is_list(delay):
        delay = list(delay)
    return resolve_delay(delay, node_id(index), index)


def nominal_inner_steps(cfg: DictConfig) -> int:
    """H, or with ``diloco.inner_steps=auto`` (Dynamic Local Updates) the fastest worker's, ``dylu_steps``."""
    h = cfg.diloco.inner_steps
    return int(cfg.diloco.dylu_steps) if h == "auto" else int(h)


def regime(cfg: DictConfig) -> str:
    delay = cfg.diloco.delay
    return "fixed" if isinstance(delay, int) and not isinstance(delay, bool) else "heterogeneous"


def tau_label(cfg: DictConfig) -> str:
    delay = cfg.diloco.delay
    if isinstance(delay, int) and not isinstance(delay, bool):
        return str(delay)
    if OmegaConf.is_list(delay) or isinstance(delay, list):
        return str(max(int(x) for x in delay))
    if "values" in delay:
        return str(max(int(x) for x in delay["values"]))
    if "high" in delay:
        return str(int(delay["high"]))
    # an unbounded law (geometric, pareto): its name, and its cap when it has one
    name = str(delay.get("distribution", "delay"))
    return f"{name}<={int(delay['max'])}" if delay.get("max") is not None else name


def val_windows(cfg: DictConfig) -> int:
    """The held-out windows every evaluation scores: ``data.val_windows`` (or the old ``data.val_batches``
    times ``data.val_batch_size``), never a function of the training batch size."""
    d = cfg.data
    return int(d.val_batches) * int(d.val_batch_size) if d.get("val_batches") is not None else int(d.val_windows)


#: outer steps that, at lr 1 and momentum 0, hand a single worker's model back unchanged (plain SGD on deltas)
_PLAIN_SGD = ("fedavg", "nesterov", "staleness_sgd", "poly_nesterov")


def single_worker_note(cfg: DictConfig) -> str | None:
    """What a ``workers=1`` run is not, said in one line, when its outer step is not the identity
    (lr 1, no momentum): the master then pulls the worker's model back (or pushes it on) every round,
    so the run is not one worker alone; None when it is (``outer=fedavg``) or when ``workers > 1``."""
    if int(cfg.workers) != 1:
        return None
    momentum = (cfg.outer.get("options") or {}).get("momentum", 0.0 if cfg.outer.name == "fedavg" else None)
    if cfg.outer.name in _PLAIN_SGD and float(cfg.outer.lr) == 1.0 and momentum is not None and float(momentum) == 0.0:
        return None
    return (f"note: workers=1 with outer={cfg.outer.name} (lr {cfg.outer.lr}) is not one worker alone: the outer step "
            "moves the model away from the worker's own every round (outer=fedavg is plain training)")


def build_datamodule(cfg: DictConfig, node_rank: int = 0, num_nodes: int = 1):
    from diloco_lightning.data import TextDataModule

    d = cfg.data
    kwargs: dict[str, Any] = dict(
        seq_len=d.seq_len, batch_size=d.batch_size, val_fraction=d.val_fraction,
        val_batch_size=d.val_batch_size, val_windows=val_windows(cfg),
        node_rank=node_rank, num_nodes=num_nodes, seed=cfg.seed, cache_dir=d.cache_dir,
    )
    if d.source == "tokens":
        kwargs.update(token_file=d.paths, token_dtype=d.token_dtype,
                      tokenizer=None if d.tokenizer in ("bpe", None) else d.tokenizer,
                      vocab_size=cfg.model.vocab_size or d.vocab_size)
    else:
        kwargs.update(text_files=d.paths if d.source == "text" else None, tokenizer=d.tokenizer,
                      vocab_size=d.vocab_size if d.tokenizer != "byte" else None, max_bytes=d.max_bytes)
    return TextDataModule(**kwargs)


def model_config(cfg: DictConfig, vocab_size: int):
    from diloco_lightning.models.llama import LlamaConfig

    m = to_container(cfg.model)
    m.pop("preset")
    m["vocab_size"] = m.get("vocab_size") or vocab_size
    return LlamaConfig(**m, seed=cfg.seed)


def build_module(cfg: DictConfig, vocab_size: int):
    from diloco_lightning.models.lit_module import LlamaLightningModule

    o = cfg.optim
    return LlamaLightningModule(
        model_config(cfg, vocab_size), optimizer=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, total_steps=cfg.trainer.max_steps,
        min_lr_ratio=o.min_lr_ratio,
    )


def outer_options(cfg: DictConfig) -> dict[str, Any]:
    """The outer optimizer's options (``lr`` included): :func:`diloco_lightning.app.config.outer_options`."""
    return _section_outer_options(cfg.outer)


def run_master_config(cfg: DictConfig):
    """The :class:`~diloco_lightning.master.MasterConfig` of a training run's master: its section and
    the ``outer`` group, with what the section leaves to the workers taken from them (the quorum:
    every worker in lockstep, else 1; their fragments; enough kept versions for their lockstep delay;
    their ``diloco.claim_ttl`` as the node timeout). A lockstep worker installs a given version, so
    its master publishes every one (``arrival_publish="each"``: no outer step is skipped)."""
    lockstep = cfg.diloco.sync == "lockstep"
    max_delay = max(worker_delay(cfg, i) for i in range(cfg.workers)) if lockstep else 0
    config = master_config(cfg.master, cfg.outer, min_deltas=cfg.workers if lockstep else 1,
                           fragments=cfg.diloco.get("fragments"), max_delay=max_delay,
                           node_timeout=cfg.diloco.get("claim_ttl"))
    return dataclasses.replace(config, arrival_publish="each") if lockstep else config


def build_master(cfg: DictConfig, hub, *, on_round=None, in_thread: bool = False):
    """The run's master. ``in_thread``: ``role=all``'s, in the parent process, which stops it itself
    after its workers exited (so it never ends on its own: ``until_finished`` off)."""
    from diloco_lightning.master import MasterOuterLoop

    config = run_master_config(cfg)
    if in_thread and config.until_finished:  # role=all: the parent stops its master once the workers exited (app/local.py)
        config = dataclasses.replace(config, until_finished=False)
    # until_finished: the run is over once all of its workers finished
    config = dataclasses.replace(config, expected_nodes=config.expected_nodes or int(cfg.workers))
    return MasterOuterLoop(
        hub, None, node_state_dir=str(run_dir(cfg) / "master"), config=config, holder=cfg.master.holder,
        metrics_path=str(run_dir(cfg) / "master" / "metrics.jsonl"), logger=on_round,
    )


class Evaluator:
    """Held-out loss of a global state: one module and the validation split, built once."""

    def __init__(self, cfg: DictConfig, dm) -> None:
        self.cfg, self.dm = cfg, dm
        self.module: Any = None

    def loss(self, state: Mapping[str, Any]) -> float:
        import torch

        from diloco_lightning.worker.params import copy_into, module_state

        if self.module is None:
            self.module = build_module(self.cfg, self.dm.vocab_size)
            self.module.eval()
            self.dm.setup("validate")
        copy_into(module_state(self.module), state, what="the global state")
        total, windows = 0.0, 0
        with torch.no_grad():  # every window weighs the same, whatever the last batch's size
            for batch in self.dm.val_dataloader():
                x, y = self.module.inputs_targets(batch)
                total += float(self.module.model.loss(x, y)) * x.shape[0]
                windows += x.shape[0]
        return total / windows if windows else math.nan


def evaluate_global(cfg: DictConfig, hub, dm, evaluator: Evaluator | None = None) -> tuple[int, float]:
    """(outer_step, mean held-out loss) of the newest published global model."""
    from diloco_lightning.hub.versions import load_global

    manifest, state = load_global(hub)
    return manifest.outer_step, (evaluator or Evaluator(cfg, dm)).loss(state)


def eval_points(cfg: DictConfig) -> list[int]:
    """Outer steps at which the role=all parent evaluates the global model: 0, then ``eval_points``
    evenly spaced ones up to the expected last (``max_steps / inner_steps`` rounds)."""
    n = int(cfg.launch.eval_points)
    if n <= 0:
        return []
    total = max(1, cfg.trainer.max_steps // nominal_inner_steps(cfg))
    return sorted({0} | {max(1, round(k * total / n)) for k in range(1, n + 1)})
