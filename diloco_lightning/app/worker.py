"""One worker of a run: a Lightning ``Trainer`` with the ``DiLoCo`` callback, a checkpoint at
every boundary (resumed from when it exists) and a progress file the whole-run parent reads.

    python -m diloco_lightning.app.worker --config <run_dir>/config.yaml --node-index i

is what ``train.py`` (role=all) and SLURM jobs start for each worker. Exit status 143 when
SIGTERM stopped it (after uploading what was pending).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.app.supervise import GO, SPARE_FLAG
from diloco_lightning.util import timeline
from diloco_lightning.util.jsondoc import dumps_json
from diloco_lightning.app.build import (
    build_datamodule,
    build_module,
    hub_options,
    hub_url,
    node_id,
    nominal_inner_steps,
    run_dir,
    worker_delay,
)
from diloco_lightning.app.config import worker_options
from diloco_lightning.worker.options import WorkerOptions

log = logging.getLogger(__name__)


class ProgressFile:
    """Appends ``{"step", "loss", "time"}`` lines to ``progress.jsonl`` (read by the role=all parent):
    at step 1 (so the first progress shows early, even when a step takes a minute), then every
    ``every`` steps, at least every ``seconds`` when steps are slow, and at the last one."""

    def __init__(self, path: Path, every: int, seconds: float = 30.0) -> None:
        self.path, self.every, self.seconds = path, max(1, every), seconds
        self.last = 0.0
        path.parent.mkdir(parents=True, exist_ok=True)

    def callback(self):
        import lightning as L

        outer = self

        class ProgressCallback(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                step = trainer.global_step
                now = time.time()
                if step == 1 or step % outer.every == 0 or step == trainer.max_steps or now - outer.last >= outer.seconds:
                    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                    if loss is None:
                        return
                    outer.last = now
                    with open(outer.path, "a") as f:
                        f.write(dumps_json({"step": step, "loss": float(loss), "time": now}) + "\n")

        return ProgressCallback()


def _launch_start(diloco: Any) -> Any:
    """A callback noting where this launch started (after a resume: the checkpoint's step, tokens and
    upload totals), so a worker's summary tells its whole run from this launch."""
    import lightning as L

    class LaunchStart(L.Callback):
        step = tokens = bytes_sent = deltas_sent = 0

        def on_train_start(self, trainer, pl_module):  # after the checkpoint and DiLoCo's start
            self.step = int(trainer.global_step)
            self.tokens = int(getattr(pl_module, "tokens_seen", 0))
            totals = diloco.worker.totals if diloco.worker is not None else {}
            self.bytes_sent = int(totals.get("bytes_uploaded_total", 0))
            self.deltas_sent = int(totals.get("deltas_uploaded_total", 0))

    return LaunchStart()


def _refuse_a_running_node_id(cfg: DictConfig, nid: str) -> None:
    """:class:`~diloco_lightning.worker.claim.NodeIdTakenError` when another live worker holds ``nid``
    on the run's hub (the worker's own claim, at its start, still decides)."""
    from diloco_lightning.app.checks import open_configured_hub
    from diloco_lightning.worker.claim import ClaimKeeper

    hub = open_configured_hub(cfg.hub, hub_url(cfg))
    try:
        ClaimKeeper(hub, nid).check_free()
    finally:
        hub.close()


def run_worker(cfg: DictConfig, index: int | None = None) -> dict[str, Any]:
    """Train one worker to ``trainer.max_steps`` with the DiLoCo callback; returns its summary."""
    index = cfg.node_index if index is None else index
    nid = node_id(index)
    timeline.mark("config")
    _refuse_a_running_node_id(cfg, nid)  # at once: before Lightning is imported, the data or the model built
    timeline.mark("node_checked")

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from diloco_lightning import DiLoCo

    timeline.mark("imports")
    out = run_dir(cfg) / "nodes" / nid
    out.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    L.seed_everything(cfg.seed + 1000 * index, workers=True, verbose=False)
    dm = build_datamodule(cfg, node_rank=index, num_nodes=cfg.workers)
    timeline.mark("data")
    module = build_module(cfg, dm.vocab_size)
    timeline.mark("model")
    # the diloco section, one WorkerOptions passed whole (this worker's delay drawn from the run's seed)
    options = WorkerOptions(**{**worker_options(cfg.diloco), "delay": worker_delay(cfg, index)})
    callback = DiLoCo(hub=hub_url(cfg), node_id=nid, hub_options=hub_options(cfg), options=options)
    ckpt_dir = out / "checkpoints"
    start = _launch_start(callback)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0,
                                 every_n_train_steps=nominal_inner_steps(cfg))
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, precision=t.precision, max_steps=t.max_steps,
        max_time=timedelta(seconds=float(t.max_time)) if t.get("max_time") else None,
        gradient_clip_val=t.gradient_clip_val, log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=None if t.val_check_interval else 1,
        limit_val_batches=1.0 if t.val_check_interval else 0,  # the datamodule's val_windows
        logger=CSVLogger(out, name="logs"),
        callbacks=[callback, checkpoint, ProgressFile(out / "progress.jsonl", t.log_every_n_steps).callback(), start],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )
    timeline.mark("trainer")
    last = ckpt_dir / "last.ckpt"
    started = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(last) if last.is_file() else None)
    summary = {
        "node_id": nid,
        "delay": worker_delay(cfg, index),
        "wall_seconds": time.perf_counter() - started,
        "steps": trainer.global_step,
        "tokens": int(getattr(module, "tokens_seen", 0)),
        "final_train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "bytes_sent": int(callback.metrics.get("bytes_uploaded_total", 0)),
        "deltas_sent": int(callback.metrics.get("deltas_uploaded_total", 0)),
    }
    # the figures above are the whole run's (checkpointed); this launch's part of them
    summary["launch"] = {
        "from_step": start.step,
        "steps": summary["steps"] - start.step,
        "tokens": summary["tokens"] - start.tokens,
        "bytes_sent": summary["bytes_sent"] - start.bytes_sent,
        "deltas_sent": summary["deltas_sent"] - start.deltas_sent,
    }
    (out / "summary.json").write_text(dumps_json(summary, indent=2))
    return summary


def worker_command(config_path: Path, index: int) -> list[str]:
    return [sys.executable, "-m", "diloco_lightning.app.worker", "--config", str(config_path), "--node-index", str(index)]


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a :func:`worker_command` process, with ``extra`` set: the folder
    holding this package first on ``PYTHONPATH``, so the worker imports it even when ``train.py`` runs
    from a checkout that was never installed."""
    env = dict(os.environ, **extra)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_lightning.app.worker --config run_dir/config.yaml --node-index i``: one worker.

    Exit status 143 when SIGTERM stopped it (after uploading what was pending); 2 or 3 after a
    user error (a configuration error; another one, e.g. a missing hub) and 75 when the hub or the
    master stayed away past ``diloco.wait_timeout``, in one line (:func:`exit_status`:
    what a supervisor restarts)."""
    ap = argparse.ArgumentParser(description="run one DiLoCo worker from a resolved run config")
    ap.add_argument("--config", required=True)
    ap.add_argument("--node-index", type=int, required=True)
    ap.add_argument(SPARE_FLAG, action="store_true",
                    help="a warm spare: import torch and Lightning, then wait for a line 'go' on standard input "
                         "(end of input: leave quietly) before anything else (app/supervise.py)")
    args = ap.parse_args(argv)
    if args.spare and not _wait_as_spare():
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig), f"{args.config} must hold a mapping"
    cfg.role = "worker"
    cfg.node_index = args.node_index
    try:
        run_worker(cfg)
    except Exception as e:
        from diloco_lightning.app.errors import short_message

        code = exit_status(e)
        if code is None:  # a bug: its traceback, status 1 (a crash: a supervisor restarts it)
            raise
        # what to fix, in one line, and the status a supervisor reads (app/supervise.py: restarted or not)
        print(f"worker {node_id(args.node_index)}: error: {short_message(e)}", file=sys.stderr, flush=True)
        return code
    return 0




def _wait_as_spare() -> bool:
    """A spare's wait (app/supervise.py: ``Spare``): the imports a worker's start pays for first, then
    one line on standard input. True: told to go; False: the input ended (no longer needed)."""
    import lightning  # noqa: F401  # what a restart would otherwise wait for
    import lightning.pytorch.callbacks  # noqa: F401
    import lightning.pytorch.loggers  # noqa: F401
    import torch  # noqa: F401

    import diloco_lightning.adapters.lightning  # noqa: F401
    import diloco_lightning.models.lit_module  # noqa: F401

    timeline.mark("spare_ready")
    go = sys.stdin.buffer.readline() == GO
    if go:
        timeline.mark("go")
    return go


def exit_status(e: BaseException) -> int | None:
    """The exit status of a worker process that ``e`` ended: :data:`~diloco_lightning.app.supervise.EXIT_HUB_AWAY` for a hub or master that
    stayed away, :data:`~diloco_lightning.app.supervise.EXIT_CONFIG` / ``EXIT_USER`` for what its user fixes, None for a bug (the
    traceback is kept, status 1: a crash, restarted)."""
    from diloco_lightning.app.errors import is_config_error, is_user_error
    from diloco_lightning.app.supervise import EXIT_CONFIG, EXIT_HUB_AWAY, EXIT_USER
    from diloco_lightning.hub.base import HubUnavailableError
    from diloco_lightning.worker.sync import WaitTimeoutError

    if isinstance(e, (HubUnavailableError, WaitTimeoutError)):
        return EXIT_HUB_AWAY
    if is_config_error(e):
        return EXIT_CONFIG
    if is_user_error(e):
        return EXIT_USER
    return None


def supervised(cfg: Any) -> bool:
    """Whether this ``role=worker`` command supervises its worker: restarts allowed, and not under torchrun
    (its elastic agent restarts the ranks) or in a DDP rank Lightning started."""
    if int(cfg.supervise.restarts) <= 0:
        return False
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    return int(cfg.trainer.devices) == 1


def supervise_worker(cfg: Any, *, say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``train.py role=worker``, supervised: the worker runs as a child process
    (``python -m diloco_lightning.app.worker``, its output on this command's) and is restarted after a
    crash (:mod:`diloco_lightning.app.supervise`). Returns its summary; a user error ends with the worker's own lines
    (``SystemExit``: 2 for a configuration error, else 1); spent restarts end in a
    :class:`~diloco_lightning.app.errors.RunError`."""
    import json

    from omegaconf import OmegaConf

    from diloco_lightning.app.build import node_id, run_dir
    from diloco_lightning.app.errors import RunError, Signal, terminate_as_exception
    from diloco_lightning.app.supervise import EXIT_CONFIG, EXIT_USER, Restarts, Spare, SuperviseOptions, describe_exit
    from diloco_lightning.hub.base import HubUnavailableError

    speak = say or (lambda line: print(line, file=sys.stderr, flush=True))
    options = SuperviseOptions(**{k: cfg.supervise[k] for k in SuperviseOptions.names()}).validate()
    index = int(cfg.node_index)
    nid = node_id(index)
    # what the worker refuses first (a missing hub, a node id another live worker holds) is refused here, as an
    # unsupervised worker's: the command's own lines, and no run folder left
    try:
        _refuse_a_running_node_id(cfg, nid)
    except HubUnavailableError as e:  # an outage is not the user's to fix: the worker (restarted as needed) waits
        speak(f"[supervise] worker {nid}: the hub is unreachable now ({type(e).__name__}); starting the worker anyway")
    out = run_dir(cfg) / "nodes" / nid
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "worker-config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    env = worker_env()
    policy = Restarts(options, f"worker {nid}")
    spare = Spare(worker_command(config_path, index), env=env) if options.spare else None
    proc: subprocess.Popen | None = None
    try:
        with terminate_as_exception():
            while True:
                policy.started()
                proc = (spare.take() if spare is not None and policy.total else None) or subprocess.Popen(
                    worker_command(config_path, index), env=env)
                code = _wait_keeping_a_spare(proc, spare, options.spare_after)
                proc = None
                if code == 0:
                    return json.loads((out / "summary.json").read_text())
                if code in (EXIT_CONFIG, EXIT_USER):  # the worker said what to fix; no restart fixes it
                    raise SystemExit(EXIT_CONFIG if code == EXIT_CONFIG else 1)
                delay = policy.decide(code)
                if delay is None:
                    raise RunError(f"worker {nid} {describe_exit(code)}; {policy.spent(code)}. Its output is above")
                speak(policy.line(code, delay))
                time.sleep(delay)
    except (KeyboardInterrupt, Signal):
        if proc is not None and proc.poll() is None:  # SIGTERM to this command only: the worker stops cleanly too
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    finally:
        if spare is not None:
            spare.close()


def _wait_keeping_a_spare(proc: subprocess.Popen, spare: Any, after: float) -> int:
    """``proc.wait()``, starting ``spare`` (app/supervise.py: ``Spare``) once ``proc`` has run ``after`` seconds."""
    if spare is None:
        return proc.wait()
    try:
        return proc.wait(after)
    except subprocess.TimeoutExpired:
        spare.prepare()
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
