"""``diloco-master``: a master that needs no model code (Hydra, ``configs/master.yaml``).

    diloco-master hub.url=hf://my-org/my-run outer=cgad outer.lr=0.3 min_deltas=4
    diloco-master hub.url=/shared/hub outer.name=nesterov outer.lr=0.7 aggregation=arrival max_rounds=10

Prints one progress line per round on stdout (outer step, applied, rejected by reason,
staleness histogram, round seconds, MB downloaded) and appends the round's metrics to a
JSONL file. Ctrl-C or SIGTERM stops it after a final round (``drain_on_exit``);
``max_rounds`` / ``max_seconds`` end it without one.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run", "CONFIG_DIR"]

log = logging.getLogger(__name__)

#: the repository's top-level ``configs/`` folder
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _outer(cfg) -> tuple[str, dict[str, Any]]:
    """The optimizer name and its options (``lr`` included); options the named optimizer does not take
    are dropped with a warning, so ``outer.name=X`` works on top of another group's defaults."""
    from omegaconf import OmegaConf

    from diloco_lightning.outer import outer_optimizer_options

    name = str(cfg.outer.name)
    opts = OmegaConf.to_container(cfg.outer.get("options") or {}, resolve=True) or {}
    if not isinstance(opts, dict):
        raise ValueError(f"outer.options must be a mapping, got {opts!r}")
    opts["lr"] = float(cfg.outer.lr)
    accepted = outer_optimizer_options(name)
    dropped = sorted(k for k in opts if k not in accepted)
    if dropped:
        log.warning("outer optimizer %r takes no option(s) %s; ignoring them", name, dropped)
        opts = {k: v for k, v in opts.items() if k in accepted}
    if isinstance(opts.get("betas"), list):
        opts["betas"] = tuple(opts["betas"])
    return name, opts


def build(cfg):
    """The hub and the :class:`~diloco_lightning.master.MasterOuterLoop` a config describes."""
    from diloco_lightning.hub import open_hub
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.statefile import load_weights_file

    url = cfg.hub.url
    if not url:
        raise ValueError("hub.url is required (file:///abs/path, a plain path, or hf://org/repo)")
    hub_opts: dict[str, Any] = {}
    if cfg.hub.get("cache_dir"):
        hub_opts["cache_dir"] = cfg.hub.cache_dir
    if str(url).startswith("hf://"):
        for key in ("endpoint", "revision"):
            if cfg.hub.get(key):
                hub_opts[key] = cfg.hub[key]
    hub = open_hub(str(url), **hub_opts)
    state_dir = Path(cfg.node_state_dir) if cfg.get("node_state_dir") else Path(hub.cache_dir) / "master"
    state = None
    if cfg.get("init"):
        state, _ = load_weights_file(cfg.init)
    name, opts = _outer(cfg)
    master = MasterOuterLoop(
        hub,
        state,
        node_state_dir=state_dir,
        poll_interval=float(cfg.poll_interval),
        outer_optimizer=name,
        outer_options=opts,
        aggregation=cfg.aggregation,
        weighting=cfg.weighting,
        min_deltas=int(cfg.min_deltas),
        max_wait=cfg.max_wait,
        max_staleness=cfg.max_staleness,
        max_delta_norm=cfg.max_delta_norm,
        norm_global_ratio=cfg.get("norm_global_ratio", 100.0),
        norm_ratio=cfg.norm_ratio,
        sweep_age=float(cfg.get("sweep_age", 3600.0)),
        download_workers=int(cfg.download_workers),
        keep_globals=int(cfg.keep_globals),
        lease=bool(cfg.lease),
        lease_ttl=cfg.lease_ttl,
        holder=cfg.holder,
        metrics_path=cfg.metrics_path or (state_dir / "metrics.jsonl"),
        torch_threads=cfg.get("torch_threads"),
        logger=lambda m: None,  # the CLI prints its own progress line
    )
    return hub, master


def run(cfg) -> int:
    """Serve rounds until ``max_rounds`` / ``max_seconds`` or a signal. Returns the exit status."""
    from diloco_lightning.master.metrics import format_progress

    hub, master = build(cfg)
    stop = threading.Event()
    interrupted = [False]

    def on_signal(signum, _frame):
        interrupted[0] = True
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    print(
        f"[master] {master.holder} on {hub.url}: optimizer {master.config.outer_optimizer} "
        f"{master.optimizer.options if master.optimizer is not None else master.config.optimizer_options()}, "
        f"aggregation {master.config.aggregation}, state in {master.node_state_dir}",
        flush=True,
    )
    rounds = 0
    failures = 0
    deadline = time.monotonic() + float(cfg.max_seconds) if cfg.get("max_seconds") else None
    standby_shown = False
    try:
        while not stop.is_set():
            delay = float(cfg.poll_interval)
            try:
                master.sync_once()
                failures = 0
            except Exception as e:  # noqa: BLE001 - reported, retried with backoff
                failures += 1
                delay = min(delay * 2 ** min(failures, 8), 300.0)
                print(f"[master] round failed ({type(e).__name__}: {e}); retrying in {delay:.1f}s", file=sys.stderr, flush=True)
            m = master.last_metrics or {}
            if m.get("standby"):
                if not standby_shown:
                    print("[master] standing by: another master holds the lease", flush=True)
                    standby_shown = True
            else:
                standby_shown = False
            if m and (m.get("published") or m.get("rejected") or m.get("adopted") is not None or m.get("conflict")):
                print(f"[master] {format_progress(m)}", flush=True)
                if m.get("accepted"):
                    rounds += 1 if m.get("aggregation") == "round" else int(m.get("published", 0))
            if cfg.get("max_rounds") is not None and rounds >= int(cfg.max_rounds):
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            stop.wait(delay)
    finally:
        if interrupted[0] and cfg.get("drain_on_exit", True):
            print("[master] stopping: final round ...", flush=True)
        master.stop(drain=bool(interrupted[0] and cfg.get("drain_on_exit", True)))
        m = master.last_metrics or {}
        if interrupted[0] and m.get("published"):
            print(f"[master] {format_progress(m)}", flush=True)
        hub.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"[master] stopped at outer_step {master.outer_step}", flush=True)
    return 0


def _hydra_entry(cfg) -> None:
    logging.basicConfig(
        level=getattr(logging, str(cfg.get("log_level", "INFO")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    """The ``diloco-master`` console script."""
    import hydra

    hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="master")(_hydra_entry)()


if __name__ == "__main__":
    main()
