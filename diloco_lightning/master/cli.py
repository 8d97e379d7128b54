"""``diloco-master``: a master that needs no model code (Hydra, ``configs/master.yaml``).

    diloco-master hub.url=hf://my-org/my-run outer=cgad outer.lr=0.3 min_deltas=4
    diloco-master hub.url=/shared/hub outer.name=nesterov outer.lr=0.7 aggregation=arrival max_rounds=10
    diloco-master --help                      # the groups, and one line per key

The configuration is the ``master``, ``hub`` and ``outer`` sections of a training run
(:class:`~diloco_lightning.config.MasterCommandConf`), checked by the same functions as
``train.py``'s. A hub that does not exist is an error unless ``hub.create=true``.

Prints where its state lives at start, one progress line per round on stdout (outer step,
applied, rejected by reason, staleness histogram, round seconds, MB downloaded) and, while
nothing happens, a line at growing intervals saying what it waits for (a worker's initial
weights, deltas, the quorum). Appends the round's metrics to a JSONL file. Ctrl-C or
SIGTERM stops it after a final round (``drain_on_exit``); ``max_rounds`` / ``max_seconds``
end it without one. Exit status: 0 when it reached ``max_rounds`` / ``max_seconds``;
``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM) when a signal stopped it, after its final
round (a master's work is never done while workers may still send deltas, and a scheduler
must not take a stopped master for a finished job); 1 when that final round failed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from diloco_lightning.config import CONFIG_DIR

__all__ = ["main", "run", "serve", "CONFIG_DIR", "default_state_dir"]

log = logging.getLogger(__name__)


def _outer(cfg) -> tuple[str, dict[str, Any]]:
    """The optimizer name and its options (``lr`` included): :func:`diloco_lightning.config.outer_options`."""
    from diloco_lightning.config import outer_options

    return str(cfg.outer.name), outer_options(cfg.outer)


def default_state_dir(hub) -> Path:
    """Where the master keeps its local state unless ``node_state_dir`` says: beside a folder hub
    (``<hub>-master``, a sibling of the hub folder), else (or when that is not writable) in the
    hub's download cache (``<cache>/master``)."""
    root = getattr(hub, "root", None)
    if root is not None:
        beside = Path(root).parent / f"{Path(root).name}-master"
        if beside.is_dir() or os.access(Path(root).parent, os.W_OK):
            return beside
    return Path(hub.cache_dir) / "master"


def build(cfg):
    """The hub and the :class:`~diloco_lightning.master.MasterOuterLoop` a config describes."""
    from diloco_lightning.config import open_configured_hub, validate_master_command
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.statefile import load_weights_file

    validate_master_command(cfg)
    name, opts = _outer(cfg)
    hub = open_configured_hub(cfg.hub)
    state_dir = Path(cfg.node_state_dir) if cfg.get("node_state_dir") else default_state_dir(hub)
    state = None
    if cfg.get("init"):
        state, _ = load_weights_file(cfg.init)
    master = MasterOuterLoop(
        hub,
        state,
        node_state_dir=state_dir,
        poll_interval=float(cfg.poll_interval),
        outer_optimizer=name,
        outer_options=opts,
        aggregation=cfg.aggregation,
        weighting=cfg.weighting,
        min_deltas=int(cfg.min_deltas or 1),
        max_wait=cfg.max_wait,
        max_staleness=cfg.max_staleness,
        max_delta_norm=cfg.max_delta_norm,
        norm_global_ratio=cfg.norm_global_ratio,
        norm_ratio=cfg.norm_ratio,
        sweep_age=float(cfg.sweep_age),
        download_workers=int(cfg.download_workers),
        keep_globals=int(cfg.keep_globals),
        lease=bool(cfg.lease),
        lease_ttl=cfg.lease_ttl,
        holder=cfg.holder,
        metrics_path=cfg.metrics_path or (state_dir / "metrics.jsonl"),
        torch_threads=cfg.get("torch_threads"),
        logger=lambda m: None,  # serve() prints its own progress line
    )
    return hub, master


def _hub_label(hub) -> str:
    root = getattr(hub, "root", None)
    return str(root) if root is not None else hub.url


def serve(
    master,
    hub,
    *,
    poll_interval: float,
    max_rounds: int | None = None,
    max_seconds: float | None = None,
    drain_on_exit: bool = True,
    say: Callable[[str], Any] = lambda line: print(line, flush=True),
    on_round: Callable[[dict], Any] | None = None,
) -> int:
    """Run rounds until ``max_rounds`` / ``max_seconds`` or SIGINT/SIGTERM; return the exit status
    (see the module docstring). Shared by ``diloco-master`` and ``train.py role=master``."""
    from diloco_lightning.master.metrics import format_progress
    from diloco_lightning.waiting import Patience

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    where = _hub_label(hub)
    say(
        f"[master] {master.holder} on {where}: optimizer {master.config.outer_optimizer} "
        f"{master.optimizer.options if master.optimizer is not None else master.config.optimizer_options()}, "
        f"aggregation {master.config.aggregation}, quorum {master.config.min_deltas}; "
        f"local state in {master.node_state_dir} (node_state_dir=... to change)"
    )

    def patience(what: str) -> Patience:
        return Patience(what, where, say=lambda line: say(f"[master] {line}"))

    waiting: tuple[str, Patience] | None = None
    rounds = 0
    failures = 0
    deadline = time.monotonic() + float(max_seconds) if max_seconds else None
    standby_shown = False
    reached = False
    try:
        while not stop.is_set():
            delay = float(poll_interval)
            try:
                master.sync_once()
                failures = 0
            except Exception as e:  # noqa: BLE001 - reported, retried with backoff
                failures += 1
                delay = min(delay * 2 ** min(failures, 8), 300.0)
                say(f"[master] round failed ({type(e).__name__}: {e}); retrying in {delay:.1f}s")
            m = master.last_metrics or {}
            if m.get("standby"):
                if not standby_shown:
                    say("[master] standing by: another master holds the lease")
                    standby_shown = True
            else:
                standby_shown = False
            eventful = m and (m.get("published") or m.get("rejected") or m.get("adopted") is not None or m.get("conflict"))
            if eventful:
                say(f"[master] {format_progress(m)}")
                if on_round is not None:
                    on_round(m)
                if m.get("accepted"):
                    rounds += 1 if m.get("aggregation") == "round" else int(m.get("published", 0))
                waiting = None
            elif not m.get("standby"):
                if not master.has_state:
                    what = "a worker's initial weights (nodes/<node_id>/init.safetensors) or a published version"
                elif m.get("waiting"):
                    what = f"the quorum of {master.config.min_deltas} deltas ({m.get('pending', 0)} pending)"
                else:
                    what = f"deltas from the workers (outer_step {master.outer_step} is published)"
                if waiting is None or waiting[0] != what:
                    waiting = (what, patience(what))
                    if not master.has_state:  # the start of a run: say it at once, not only after 10 s
                        say(f"[master] waiting for {what} on {where}")
                waiting[1].tick()
            if max_rounds is not None and rounds >= int(max_rounds):
                reached = True
                break
            if deadline is not None and time.monotonic() >= deadline:
                reached = True
                break
            stop.wait(delay)
    finally:
        drained = True
        if received and drain_on_exit:
            say("[master] stopping: final round ...")
        try:
            master.stop(drain=bool(received and drain_on_exit))
        except Exception as e:  # noqa: BLE001
            drained = False
            say(f"[master] the final round failed: {type(e).__name__}: {e}")
        m = master.last_metrics or {}
        if received and m.get("published"):
            say(f"[master] {format_progress(m)}")
        hub.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say(f"[master] stopped at outer_step {master.outer_step}")
    if not drained:
        return 1
    if received and not reached:
        return 128 + int(received[0])  # a scheduler must not read a stopped master as a finished one
    return 0


def run(cfg) -> int:
    """Serve rounds until ``max_rounds`` / ``max_seconds`` or a signal. Returns the exit status."""
    hub, master = build(cfg)
    return serve(
        master, hub, poll_interval=float(cfg.poll_interval), max_rounds=cfg.get("max_rounds"),
        max_seconds=cfg.get("max_seconds"), drain_on_exit=bool(cfg.get("drain_on_exit", True)),
    )


def _hydra_entry(cfg) -> None:
    logging.basicConfig(
        level=getattr(logging, str(cfg.get("log_level", "INFO")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in ("httpx", "httpx2", "botocore", "boto3", "urllib3"):  # their INFO lines are not the master's news
        logging.getLogger(name).setLevel(logging.WARNING)
    if str(cfg.get("log_level", "INFO")).upper() != "DEBUG":
        # the progress line on stdout says each round once; the hub's own INFO line would repeat it
        logging.getLogger("diloco_lightning.hub").setLevel(logging.WARNING)
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    """The ``diloco-master`` console script."""
    from diloco_lightning.cli import run_app

    run_app("diloco-master", "master", _hydra_entry)


if __name__ == "__main__":
    main()
