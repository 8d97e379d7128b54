"""Running a master in the foreground of a command (``diloco-master``, ``train.py role=master``):
building it from the master command's configuration, and serving it with progress lines on
stdout and SIGINT/SIGTERM handled (:func:`diloco_lightning.master.serve.serve`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["build", "default_state_dir", "run_master", "serve_command"]


def default_state_dir(hub) -> Path:
    """Where the master keeps its local state unless ``node_state_dir`` says: beside a folder hub
    (``<hub>-master``, a sibling of the hub folder), else (or when that is not writable) in the
    hub's download cache (``<cache>/master``)."""
    root = hub.local_root
    if root is not None:
        beside = Path(root).parent / f"{Path(root).name}-master"
        if beside.is_dir() or os.access(Path(root).parent, os.W_OK):
            return beside
    return Path(hub.cache_dir) / "master"


def build(cfg):
    """The hub and the :class:`~diloco_lightning.master.MasterOuterLoop` a config describes."""
    from diloco_lightning.app.config import master_config, open_configured_hub, validate_master_command

    validate_master_command(cfg)  # before anything imports torch: a configuration error is refused without it
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.master.weights import check_state
    from diloco_lightning.util.errors import ConfigError
    from diloco_lightning.wire.statefile import StateFileError, load_weights_file

    hub = open_configured_hub(cfg.hub)
    state_dir = Path(cfg.node_state_dir) if cfg.get("node_state_dir") else default_state_dir(hub)
    state = None
    if cfg.get("init"):
        try:
            state, _ = load_weights_file(cfg.init)
            check_state(state, str(cfg.init))
        except (StateFileError, ValueError) as e:
            detail = e.detail if isinstance(e, StateFileError) else str(e)
            raise ConfigError("init", f"{cfg.init} is not a model's initial weights ({detail}): give a safetensors "
                              "file of the model's state_dict, or leave init unset to adopt a worker's") from None
    master = MasterOuterLoop(
        hub,
        state,
        node_state_dir=state_dir,
        config=master_config(cfg, cfg.outer),
        holder=cfg.holder,
        metrics_path=cfg.metrics_path or (state_dir / "metrics.jsonl"),
        logger=lambda m: None,  # serve() prints its own progress line
    )
    return hub, master


def serve_command(master, **kw) -> int:
    """A master in the foreground of a command (``diloco-master``, ``train.py role=master``): one
    line saying what it runs, progress lines on stdout, SIGINT/SIGTERM stop it after a final
    round; returns the exit status (:class:`~diloco_lightning.master.serve.ServeReport`)."""
    from diloco_lightning.master.quorum import is_fraction
    from diloco_lightning.master.serve import serve

    def say(line: str) -> None:
        print(line, flush=True)

    where = master.hub.local_root or master.hub.url
    q = master.config.min_deltas
    quorum = f"{q:g} of the live nodes" if is_fraction(q) else f"{q} delta(s)"
    say(
        f"[master] {master.holder} on {where}: optimizer {master.config.outer_optimizer} "
        f"{master.optimizer.options if master.optimizer is not None else master.config.optimizer_options()}, "
        f"aggregation {master.config.aggregation}, quorum {quorum}; "
        f"local state in {master.node_state_dir} (node_state_dir=... to change)"
    )
    try:
        report = serve(master, say=say, handle_signals=True, finish=True, **kw)
    finally:
        master.hub.close()
    say(f"[master] stopped at outer_step {master.outer_step}")
    return report.exit_code


def run_master(cfg) -> int:
    """``train.py role=master`` (and the master's SLURM job): the run's master from a training run's
    config, serving rounds until Ctrl-C / SIGTERM (a final round is drained); the exit status of
    :func:`serve_command`."""
    from diloco_lightning.app.build import build_master, open_run_hub

    hub = open_run_hub(cfg)
    return serve_command(build_master(cfg, hub, on_round=lambda m: None))
