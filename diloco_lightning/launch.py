"""What ``train.py`` runs: a whole run on this machine, one worker, or one master.

``role=all`` (default): prepares the data once, starts the master in this process and
``workers`` worker processes (``python -m diloco_lightning.launch --config ... --node-index i``)
sharing a folder hub in ``<run_root>/<run_id>/hub``, prints one progress line per outer
round, evaluates the final global model on the held-out split and writes
``results.json`` in the run folder.

``role=worker`` / ``role=master`` run one part against a shared hub
(``hub=hf hub.url=hf://org/run``) for multi-machine runs; a multi-GPU worker is one
``torchrun`` (or SLURM) job running ``train.py role=worker ...``.

Run folders derive from ``run_id`` (itself derived from the command line), never from
timestamps, and nothing relies on Hydra changing the working directory.

Before anything heavy starts, :func:`run` refuses a run this machine cannot hold
(:mod:`diloco_lightning.resources`), and a run whose ``results.json`` says it is finished
says so and keeps its results (an interrupted one resumes from its checkpoints). Ctrl-C or
SIGTERM stops the workers (each uploads what is pending) and the master, and ends with
:class:`Interrupted` (status 130 / 143); a failed worker ends the run with :class:`RunError`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.config import hub_options as _section_hub_options
from diloco_lightning.config import open_configured_hub, outer_options as _section_outer_options, validate

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
#: progress lines of the role=all parent: at most this often when there is news, and at least this often
PROGRESS_EVERY, HEARTBEAT_EVERY = 10.0, 60.0


class RunError(RuntimeError):
    """A run that failed: a worker exited with an error or was killed (the message names it and carries
    its log's last lines), or the run ran past ``launch.timeout``."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run before its work was done; ``exit_code`` is ``128 + signal``."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message)


class _Signal(BaseException):
    """Raised in the main thread by the SIGTERM handler of :func:`_terminate_as_exception`."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _terminate_as_exception():
    """While the block runs (main thread), SIGTERM raises :class:`_Signal` like Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise _Signal(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def recipe_name() -> str | None:
    """The ``recipe=`` chosen on the command line (None outside a Hydra app or without one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get("recipe")
    except (ValueError, ImportError, AttributeError):
        return None


# ----------------------------------------------------------------------------- paths and pieces


def run_dir(cfg: DictConfig) -> Path:
    """``cfg.run_dir`` (the Hydra job's output dir, set by :func:`run`), else ``<run_root>/<run_id>``."""
    if OmegaConf.select(cfg, "run_dir"):
        return Path(cfg.run_dir).resolve()
    return (Path(cfg.run_root) / cfg.run_id).resolve()


def _resolve_run_dir(cfg: DictConfig) -> None:
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
    """This worker's staleness tau: an int, ``delay[index % len]``, or a seeded uniform draw."""
    delay = cfg.diloco.delay
    if isinstance(delay, (int,)) and not isinstance(delay, bool):
        return int(delay)
    if OmegaConf.is_list(delay) or isinstance(delay, list):
        return int(list(delay)[index % len(delay)])
    import random

    rng = random.Random(f"{delay.get('seed', cfg.seed)}:{index}")
    return rng.randint(int(delay.get("low", 0)), int(delay["high"]))


def regime(cfg: DictConfig) -> str:
    delay = cfg.diloco.delay
    return "fixed" if isinstance(delay, int) and not isinstance(delay, bool) else "heterogeneous"


def tau_label(cfg: DictConfig) -> str:
    delay = cfg.diloco.delay
    if isinstance(delay, int) and not isinstance(delay, bool):
        return str(delay)
    if OmegaConf.is_list(delay) or isinstance(delay, list):
        return str(max(int(x) for x in delay))
    return str(int(delay["high"]))


def build_datamodule(cfg: DictConfig, node_rank: int = 0, num_nodes: int = 1):
    from diloco_lightning.data import TextDataModule

    d = cfg.data
    kwargs: dict[str, Any] = dict(
        seq_len=d.seq_len, batch_size=d.batch_size, val_fraction=d.val_fraction,
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

    m = OmegaConf.to_container(cfg.model, resolve=True)
    m.pop("preset")
    m["vocab_size"] = m.get("vocab_size") or vocab_size
    return LlamaConfig(**m, seed=cfg.seed)


def build_module(cfg: DictConfig, vocab_size: int):
    from diloco_lightning.lit_module import LlamaLightningModule

    o = cfg.optim
    return LlamaLightningModule(
        model_config(cfg, vocab_size), optimizer=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, total_steps=cfg.trainer.max_steps,
        min_lr_ratio=o.min_lr_ratio,
    )


def outer_options(cfg: DictConfig) -> dict[str, Any]:
    """The outer optimizer's options (``lr`` included): :func:`diloco_lightning.config.outer_options`."""
    return _section_outer_options(cfg.outer)


# ----------------------------------------------------------------------------- worker


class _ProgressFile:
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
                        f.write(json.dumps({"step": step, "loss": float(loss), "time": now}) + "\n")

        return ProgressCallback()


def run_worker(cfg: DictConfig, index: int | None = None) -> dict[str, Any]:
    """Train one worker to ``trainer.max_steps`` with the DiLoCo callback; returns its summary."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from diloco_lightning import DiLoCo

    index = cfg.node_index if index is None else index
    nid = node_id(index)
    out = run_dir(cfg) / "nodes" / nid
    out.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    L.seed_everything(cfg.seed + 1000 * index, workers=True, verbose=False)
    dm = build_datamodule(cfg, node_rank=index, num_nodes=cfg.workers)
    module = build_module(cfg, dm.vocab_size)
    d = cfg.diloco
    callback = DiLoCo(
        hub=hub_url(cfg), node_id=nid, inner_steps=d.inner_steps, sync=d.sync, delay=worker_delay(cfg, index),
        delta_dtype=d.delta_dtype, reset_inner_optimizer=d.reset_inner_optimizer, hub_options=hub_options(cfg),
        wait_timeout=d.wait_timeout, poll_interval=d.poll_interval, claim_ttl=d.claim_ttl,
    )
    ckpt_dir = out / "checkpoints"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=d.inner_steps)
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, precision=t.precision, max_steps=t.max_steps,
        gradient_clip_val=t.gradient_clip_val, log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=None if t.val_check_interval else 1,
        limit_val_batches=cfg.data.val_batches if t.val_check_interval else 0,
        logger=CSVLogger(out, name="logs"), callbacks=[callback, checkpoint, _ProgressFile(out / "progress.jsonl", t.log_every_n_steps).callback()],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )
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
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ----------------------------------------------------------------------------- master


def build_master(cfg: DictConfig, hub, *, on_round=None):
    from diloco_lightning.master import MasterOuterLoop

    m = cfg.master
    min_deltas = m.min_deltas or (cfg.workers if cfg.diloco.sync == "lockstep" else 1)
    return MasterOuterLoop(
        hub, None, node_state_dir=str(run_dir(cfg) / "master"), poll_interval=m.poll_interval,
        outer_optimizer=cfg.outer.name, outer_options=outer_options(cfg), aggregation=m.aggregation,
        weighting=m.weighting, min_deltas=min_deltas, max_wait=m.max_wait, max_staleness=m.max_staleness,
        max_delta_norm=m.max_delta_norm, norm_global_ratio=m.norm_global_ratio, norm_ratio=m.norm_ratio,
        sweep_age=m.sweep_age, download_workers=m.download_workers, keep_globals=m.keep_globals, lease=m.lease,
        lease_ttl=m.lease_ttl, holder=m.holder, metrics_path=str(run_dir(cfg) / "master" / "metrics.jsonl"),
        logger=on_round, torch_threads=m.torch_threads,
    )


def run_master(cfg: DictConfig) -> int:
    """role=master: serve rounds until Ctrl-C / SIGTERM (a final round is drained); the exit status
    of :func:`diloco_lightning.master.cli.serve`."""
    from diloco_lightning.master.cli import serve

    hub = open_run_hub(cfg)
    master = build_master(cfg, hub, on_round=lambda m: None)
    return serve(master, hub, poll_interval=float(cfg.master.poll_interval))


def _is_round(metrics: dict) -> bool:
    """A poll that published or rejected something (idle polls are not printed)."""
    return bool(metrics.get("published") or metrics.get("accepted") or metrics.get("rejected_by_reason"))


def _print_round(metrics: dict) -> None:
    """The same progress line as ``diloco-master``'s (:func:`diloco_lightning.master.metrics.format_progress`)."""
    from diloco_lightning.master.metrics import format_progress

    print(f"[master] {format_progress(metrics)}", flush=True)


# ----------------------------------------------------------------------------- evaluation


class _Evaluator:
    """Held-out loss of a global state: one module and the validation split, built once."""

    def __init__(self, cfg: DictConfig, dm) -> None:
        self.cfg, self.dm = cfg, dm
        self.module = None

    def loss(self, state: dict) -> float:
        import torch

        if self.module is None:
            self.module = build_module(self.cfg, self.dm.vocab_size)
            self.module.eval()
            self.dm.setup("validate")
        install_state(self.module, state)
        losses = []
        with torch.no_grad():
            for i, batch in enumerate(self.dm.val_dataloader()):
                if i >= self.cfg.data.val_batches:
                    break
                x, y = self.module._inputs_targets(batch)
                losses.append(float(self.module.model.loss(x, y)))
        return sum(losses) / len(losses) if losses else math.nan


def evaluate_global(cfg: DictConfig, hub, dm, evaluator: _Evaluator | None = None) -> tuple[int, float]:
    """(outer_step, mean held-out loss) of the newest published global model."""
    from diloco_lightning.globals import load_global

    manifest, state = load_global(hub)
    return manifest.outer_step, (evaluator or _Evaluator(cfg, dm)).loss(state)


def install_state(module, state: dict) -> None:
    """Copy a global state into ``module`` under the callback's key names (tied weights once,
    persistent buffers only: :func:`diloco_lightning.worker.module_state`)."""
    import torch

    from diloco_lightning.worker import module_state

    own = module_state(module)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"global weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t)


def _eval_points(cfg: DictConfig) -> list[int]:
    """Outer steps at which the role=all parent evaluates the global model: 0, then ``eval_points``
    evenly spaced ones up to the expected last (``max_steps / inner_steps`` rounds)."""
    n = int(cfg.launch.eval_points)
    if n <= 0:
        return []
    total = max(1, cfg.trainer.max_steps // cfg.diloco.inner_steps)
    return sorted({0} | {max(1, round(k * total / n)) for k in range(1, n + 1)})


# ----------------------------------------------------------------------------- role=all


def _worker_command(config_path: Path, index: int) -> list[str]:
    return [sys.executable, "-m", "diloco_lightning.launch", "--config", str(config_path), "--node-index", str(index)]


def _read_progress(path: Path) -> list[tuple[int, float]]:
    return [(s, l) for s, l, _ in _read_progress_timed(path)]


def _read_progress_timed(path: Path) -> list[tuple[int, float, float | None]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
            t = d.get("time")
            out.append((int(d["step"]), float(d["loss"]), float(t) if isinstance(t, (int, float)) else None))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def _progress_line(cfg: DictConfig, rdir: Path, elapsed: float) -> tuple[str, tuple]:
    """``[  42s] w0 step 30/160 loss 6.53 (0.3 s/step, ~39 s left) | w1 ...`` and a key that changes with news."""
    from diloco_lightning.waiting import format_duration

    parts, key = [], []
    total = cfg.trainer.max_steps
    for i in range(cfg.workers):
        prog = _read_progress_timed(rdir / "nodes" / node_id(i) / "progress.jsonl")
        if not prog:
            parts.append(f"{node_id(i)} starting")
            key.append(-1)
            continue
        step, loss, t = prog[-1]
        key.append(step)
        text = f"{node_id(i)} step {step}/{total} loss {loss:.3f}"
        first = next(((s, tt) for s, _, tt in prog if tt is not None), None)
        if first and t is not None and step > first[0] and t > first[1]:
            rate = (t - first[1]) / (step - first[0])
            text += f" ({rate:.2g} s/step, ~{format_duration(rate * (total - step))} left)"
        parts.append(text)
    return f"[{elapsed:6.0f}s] " + " | ".join(parts), tuple(key)


def _finished_results(cfg: DictConfig, rdir: Path) -> dict[str, Any] | None:
    """The results of this run if a previous invocation finished it (as many workers, at least as many steps)."""
    path = rdir / RESULTS_FILE
    try:
        done = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict):
        return None
    if int(done.get("max_steps") or -1) >= cfg.trainer.max_steps and int(done.get("workers") or -1) == cfg.workers:
        return done
    return None


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL: see `dmesg`)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


def run_all(cfg: DictConfig) -> dict[str, Any]:
    rdir = run_dir(cfg)
    label = recipe_name()
    done = _finished_results(cfg, rdir)
    if done is not None:
        print(
            f"run {cfg.run_id} is already finished: {rdir / RESULTS_FILE} (eval loss {done.get('eval_loss', math.nan):.3f} "
            f"after {done.get('outer_steps')} outer steps). Nothing to do: to train further raise trainer.max_steps "
            f"(it resumes); to start again use another run_id=... or delete {rdir}.",
            flush=True,
        )
        return done
    rdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    named = f" (recipe {label})" if label and f"recipe={label}" not in str(cfg.run_id) else ""
    print(f"run {cfg.run_id}{named}: {cfg.workers} workers, model {cfg.model.preset}, "
          f"outer {cfg.outer.name} (lr {cfg.outer.lr}), H={cfg.diloco.inner_steps}, sync {cfg.diloco.sync}, "
          f"tau {tau_label(cfg)}, {cfg.trainer.max_steps} steps; hub {hub_label(cfg)}", flush=True)
    dm = build_datamodule(cfg)
    dm.prepare_data()  # tokenizer + token cache built once here, not raced by the workers
    config_path = rdir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)

    hub = open_run_hub(cfg)
    rounds: list[dict] = []
    master = build_master(cfg, hub, on_round=lambda m: (rounds.append(m), _print_round(m)) if _is_round(m) else None)
    master.start()

    devices = _device_list(cfg)
    threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // cfg.workers)
    procs: list[subprocess.Popen] = []
    logs = []
    evaluator = _Evaluator(cfg, dm)
    points = _eval_points(cfg)
    eval_curve: list[list[float]] = []
    interrupted: int | None = None
    failed: tuple[int, Any] | None = None
    try:
        with _terminate_as_exception():
            for i in range(cfg.workers):
                env = dict(os.environ)
                env["OMP_NUM_THREADS"] = str(threads)
                # the package is importable in workers even when train.py runs from a checkout without install
                pkg_root = str(Path(__file__).resolve().parents[1])
                env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
                log_path = rdir / "nodes" / node_id(i) / "worker.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                fh = open(log_path, "ab")
                logs.append((fh, log_path))
                procs.append(subprocess.Popen(_worker_command(config_path, i), env=env, stdout=fh, stderr=subprocess.STDOUT))
            failed = _watch(cfg, rdir, procs, master, evaluator, points, eval_curve, started)
    except (KeyboardInterrupt, _Signal) as e:
        interrupted = e.signum if isinstance(e, _Signal) else int(signal.SIGINT)
    finally:
        if failed or interrupted:
            # each worker gets SIGTERM: it uploads what is pending and exits (status 143)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for fh, _ in logs:
            fh.close()
        master.stop(drain=not (failed or interrupted))
    if interrupted:
        hub.close()
        name = signal.Signals(interrupted).name
        raise Interrupted(
            interrupted,
            f"interrupted by {name}{' (Ctrl-C)' if interrupted == signal.SIGINT else ''}: stopped the master at outer_step "
            f"{master.outer_step} and {len(procs)} worker(s); checkpoints in {rdir / 'nodes'}. The same command resumes "
            f"the run.",
        )
    if failed:
        i, code = failed
        hub.close()
        if i < 0:
            raise RunError(f"run {cfg.run_id} {code}; see the worker logs in {rdir / 'nodes'}")
        tail = "\n".join("    " + line for line in logs[i][1].read_text(errors="replace").splitlines()[-25:])
        raise RunError(
            f"worker {node_id(i)} {_describe_exit(code)}; the other workers were stopped. Last lines of "
            f"{logs[i][1]}:\n{tail or '    (empty)'}"
        )

    outer_step, eval_loss = evaluate_global(cfg, hub, dm, evaluator)
    hub.close()
    if not eval_curve or eval_curve[-1][0] != outer_step:
        eval_curve.append([outer_step, eval_loss])
    wall = time.perf_counter() - started
    summaries = [json.loads((rdir / "nodes" / node_id(i) / "summary.json").read_text()) for i in range(cfg.workers)]
    curves = [_read_progress(rdir / "nodes" / node_id(i) / "progress.jsonl") for i in range(cfg.workers)]
    train_curve = _mean_curve(curves)
    chance = math.log(dm.vocab_size)
    accepted = sum(int(r.get("accepted", 0)) for r in rounds)
    rejected = sum(sum((r.get("rejected_by_reason") or {}).values()) for r in rounds)
    final_train = [s["final_train_loss"] for s in summaries]
    final_train_loss = sum(final_train) / len(final_train)
    diverged = not math.isfinite(eval_loss) or eval_loss > chance
    tokens = sum(s["tokens"] for s in summaries)
    results = {
        "run_id": cfg.run_id,
        "recipe": label,
        "outer": cfg.outer.name,
        "outer_lr": cfg.outer.lr,
        "tau": tau_label(cfg),
        "regime": regime(cfg),
        "delays": [worker_delay(cfg, i) for i in range(cfg.workers)],
        "precision": f"{cfg.trainer.precision}/{cfg.optim.name}",
        "seed": cfg.seed,
        "workers": cfg.workers,
        "inner_steps": cfg.diloco.inner_steps,
        "max_steps": cfg.trainer.max_steps,
        "outer_steps": outer_step,
        "final_train_loss": final_train_loss,
        "eval_loss": eval_loss,
        "chance_loss": chance,
        "diverged": diverged,
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "bytes_sent": sum(s["bytes_sent"] for s in summaries),
        "deltas_accepted": accepted,
        "deltas_rejected": rejected,
        "train_curve": train_curve,
        "eval_curve": eval_curve,
        "workers_summary": summaries,
    }
    (rdir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    print(
        f"done in {wall:.0f}s: {outer_step} outer steps, {accepted} deltas accepted, {rejected} rejected, "
        f"{results['bytes_sent'] / 1e6:.1f} MB sent, {results['tokens_per_second']:.0f} tokens/s | "
        f"train loss {curves[0][0][1] if curves and curves[0] else float('nan'):.3f} -> {final_train_loss:.3f} | "
        f"eval loss of the global model {eval_loss:.3f} (chance {chance:.2f}){' DIVERGED' if diverged else ''} | "
        f"{rdir / RESULTS_FILE}",
        flush=True,
    )
    return results


def _watch(cfg, rdir, procs, master, evaluator, points, eval_curve, started) -> tuple[int, Any] | None:
    """Poll the workers until all are done (None) or one failed (``(index, exit code)``; index -1: the
    run's timeout); print progress lines; evaluate the global model at the outer steps in ``points``."""
    last_print, last_key = time.perf_counter(), None
    points = list(points)
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        now = time.perf_counter()
        if now - started > cfg.launch.timeout:
            return (-1, f"ran past launch.timeout={cfg.launch.timeout:g} s")
        if points and master.has_state and master.outer_step >= points[0]:
            step, state = master.snapshot()
            while points and points[0] <= step:
                points.pop(0)
            eval_curve.append([step, evaluator.loss(state)])
        line, key = _progress_line(cfg, rdir, now - started)
        first = any(k >= 0 for k in key) and not (last_key and any(k >= 0 for k in last_key))
        if first or (key != last_key and now - last_print >= PROGRESS_EVERY) or now - last_print >= HEARTBEAT_EVERY:
            print(line, flush=True)  # the first progress at once, news every 10 s, a heartbeat every minute
            last_print, last_key = now, key
        time.sleep(0.2)


def _mean_curve(curves: list[list[tuple[int, float]]]) -> list[list[float]]:
    by_step: dict[int, list[float]] = {}
    for c in curves:
        for s, v in c:
            by_step.setdefault(s, []).append(v)
    return [[s, sum(v) / len(v)] for s, v in sorted(by_step.items())]


def _device_list(cfg: DictConfig) -> list[str]:
    if cfg.launch.devices:
        return [str(d) for d in cfg.launch.devices]
    if cfg.trainer.accelerator in ("gpu", "cuda", "auto"):
        try:
            import torch

            return [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            return []
    return []


# ----------------------------------------------------------------------------- entry points


def _quiet_hub_logs() -> None:
    """The console shows one line per round (the master's progress line): the hub's own INFO lines
    (one per publication, the lease) would repeat it."""
    for name in ("diloco_lightning.hub", "diloco_lightning.master.lease", "botocore", "boto3", "urllib3", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Validate, refuse what this machine cannot run, then dispatch on ``cfg.role``."""
    validate(cfg)
    _resolve_run_dir(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    finished = cfg.role == "all" and cfg.launch.kind == "local" and _finished_results(cfg, run_dir(cfg)) is not None
    if cfg.launch.check_resources and not finished:  # a finished run starts nothing: run_all only says so
        from diloco_lightning.resources import check_resources

        check_resources(cfg, label=recipe_name())
    _quiet_hub_logs()
    if cfg.launch.kind == "submitit" and cfg.role == "all":
        from diloco_lightning.slurm import run_submitit

        return run_submitit(cfg)
    if cfg.role == "worker":
        return run_worker(cfg)
    if cfg.role == "master":
        code = run_master(cfg)
        if code:
            raise SystemExit(code)
        return None
    return run_all(cfg)


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_lightning.launch --config run_dir/config.yaml --node-index i``: one worker.

    Exit status 143 when SIGTERM stopped it (after uploading what was pending)."""
    ap = argparse.ArgumentParser(description="run one DiLoCo worker from a resolved run config")
    ap.add_argument("--config", required=True)
    ap.add_argument("--node-index", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = OmegaConf.load(args.config)
    cfg.role = "worker"
    cfg.node_index = args.node_index
    run_worker(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
