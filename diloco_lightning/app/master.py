"""``diloco-master``: a master that needs no model code (Hydra, ``configs/master.yaml``).

    diloco-master hub.url=hf://my-org/my-run outer=cgad outer.lr=0.3 min_deltas=4
    diloco-master hub.url=/shared/hub outer.name=nesterov outer.lr=0.7 aggregation=arrival max_rounds=10
    diloco-master --help                      # the groups, and one line per key

The configuration is the ``master``, ``hub`` and ``outer`` sections of a training run
(:class:`~diloco_lightning.app.config.MasterCommandConf`), checked by the same functions as
``train.py``'s. A hub that does not exist is an error unless ``hub.create=true``.

Prints where its state lives at start, one progress line per round on stdout (outer step,
applied, rejected by reason, staleness histogram, round seconds, MB downloaded) and, while
nothing happens, a line at growing intervals saying what it waits for (a worker's initial
weights, deltas, the quorum). Appends the round's metrics to a JSONL file. Ctrl-C or
SIGTERM stops it after a final round (``drain_on_exit``); ``max_rounds`` / ``max_seconds``
end it without one. Exit status: 0 when it reached ``max_rounds`` / ``max_seconds``;
``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM) when a signal stopped it, after its final
round (a master's work is never done while workers may still send deltas, and a scheduler
must not take a stopped master for a finished job); 1 when that final round failed. SIGTERM
before the rounds start (while it imports, composes its configuration or reads the hub) ends it
with one line and status 143 too. A configuration that does not match the hub's run (another
outer optimizer, another model) ends it at once, in two lines naming the override that fixes it.
"""

from __future__ import annotations

import logging
import sys

from diloco_lightning.app.config import CONFIG_DIR

__all__ = ["main", "run", "CONFIG_DIR"]

log = logging.getLogger(__name__)


def run(cfg) -> int:
    """Serve rounds until ``max_rounds`` / ``max_seconds`` or a signal. Returns the exit status."""
    from diloco_lightning.app.serving import build, serve_command

    hub, master = build(cfg)
    return serve_command(master, max_rounds=cfg.get("max_rounds"), max_seconds=cfg.get("max_seconds"),
                         drain_on_exit=bool(cfg.get("drain_on_exit", True)))


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
    from diloco_lightning.app.cli import run_app
    from diloco_lightning.app.errors import terminate_as_exception

    with terminate_as_exception():  # SIGTERM before the rounds start (they handle it themselves): one line, 143
        run_app("diloco-master", "master", _hydra_entry)


if __name__ == "__main__":
    main()
