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
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.config import validate

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"


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
    opts: dict[str, Any] = {}
    url = hub_url(cfg)
    if url.startswith("hf://"):
        if cfg.hub.endpoint:
            opts["endpoint"] = cfg.hub.endpoint
        opts["private"] = bool(cfg.hub.private)
    if cfg.hub.cache_dir:
        opts["cache_dir"] = cfg.hub.cache_dir
    return opts


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
    opts = OmegaConf.to_container(cfg.outer.options, resolve=True) or {}
    opts["lr"] = cfg.outer.lr
    if "betas" in opts:
        opts["betas"] = tuple(opts["betas"])
    return opts


# ----------------------------------------------------------------------------- worker


class _ProgressFile:
    """Appends ``{"step", "loss"}`` lines to ``progress.jsonl`` (read by the role=all parent)."""

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every = path, max(1, every)
        path.parent.mkdir(parents=True, exist_ok=True)

    def callback(self):
        import lightning as L

        outer = self

        class ProgressCallback(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                step = trainer.global_step
                if step % outer.every == 0 or step == trainer.max_steps:
                    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                    if loss is None:
                        return
                    with open(outer.path, "a") as f:
                        f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")

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
        wait_timeout=d.wait_timeout, poll_interval=d.poll_interval,
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
        max_delta_norm=m.max_delta_norm, norm_global_ratio=m.norm_global_ratio, keep_globals=m.keep_globals, lease_ttl=m.lease_ttl,
        metrics_path=str(run_dir(cfg) / "master" / "metrics.jsonl"), logger=on_round, torch_threads=1,
    )


def run_master(cfg: DictConfig) -> None:
    """role=master: serve rounds until interrupted (Ctrl-C drains a final round)."""
    from diloco_lightning.hub import open_hub

    hub = open_hub(hub_url(cfg), **hub_options(cfg))
    master = build_master(cfg, hub, on_round=lambda m: _print_round(m) if _is_round(m) else None)
    master.start()
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping master (final round) ...", flush=True)
    finally:
        master.stop(drain=True)
        hub.close()


def _is_round(metrics: dict) -> bool:
    """A poll that published or rejected something (idle polls are not printed)."""
    return bool(metrics.get("published") or metrics.get("accepted") or metrics.get("rejected_by_reason"))


def _print_round(metrics: dict) -> None:
    rej = metrics.get("rejected_by_reason") or {}
    hist = metrics.get("staleness_histogram") or {}
    print(
        f"[master] outer_step {metrics.get('outer_step')} | accepted {metrics.get('accepted', 0)}"
        f" | rejected {sum(rej.values()) if rej else 0}{' ' + json.dumps(rej) if rej else ''}"
        f" | staleness {json.dumps(hist, sort_keys=True)} | {metrics.get('round_seconds', 0):.2f}s",
        flush=True,
    )


# ----------------------------------------------------------------------------- evaluation


def evaluate_global(cfg: DictConfig, hub, dm) -> tuple[int, float]:
    """(outer_step, mean held-out loss) of the newest published global model."""
    import torch

    from diloco_lightning.globals import load_global

    manifest, state = load_global(hub)
    module = build_module(cfg, dm.vocab_size)
    install_state(module, state)
    module.eval()
    dm.setup("validate")
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(dm.val_dataloader()):
            if i >= cfg.data.val_batches:
                break
            x, y = module._inputs_targets(batch)
            losses.append(float(module.model.loss(x, y)))
    return manifest.outer_step, (sum(losses) / len(losses) if losses else math.nan)


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


# ----------------------------------------------------------------------------- role=all


def _worker_command(config_path: Path, index: int) -> list[str]:
    return [sys.executable, "-m", "diloco_lightning.launch", "--config", str(config_path), "--node-index", str(index)]


def _read_progress(path: Path) -> list[tuple[int, float]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
            out.append((int(d["step"]), float(d["loss"])))
        except (ValueError, KeyError):
            continue
    return out


def run_all(cfg: DictConfig) -> dict[str, Any]:
    from diloco_lightning.hub import open_hub

    rdir = run_dir(cfg)
    rdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"run {cfg.run_id}: {cfg.workers} workers, model {cfg.model.preset}, outer {cfg.outer.name} "
          f"(lr {cfg.outer.lr}), H={cfg.diloco.inner_steps}, sync {cfg.diloco.sync}, tau {tau_label(cfg)}; "
          f"hub {hub_url(cfg)}", flush=True)
    dm = build_datamodule(cfg)
    dm.prepare_data()  # tokenizer + token cache built once here, not raced by the workers
    config_path = rdir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)

    hub = open_hub(hub_url(cfg), **hub_options(cfg))
    rounds: list[dict] = []
    master = build_master(cfg, hub, on_round=lambda m: (rounds.append(m), _print_round(m)) if _is_round(m) else None)
    master.start()

    devices = _device_list(cfg)
    threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // cfg.workers)
    procs: list[subprocess.Popen] = []
    logs = []
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

    failed = None
    last_print = 0.0
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.perf_counter() - started > cfg.launch.timeout:
                failed = (-1, "timeout")
                break
            now = time.perf_counter()
            if now - last_print > 10.0:
                last_print = now
                parts = []
                for i in range(cfg.workers):
                    prog = _read_progress(rdir / "nodes" / node_id(i) / "progress.jsonl")
                    if prog:
                        parts.append(f"{node_id(i)} step {prog[-1][0]} loss {prog[-1][1]:.3f}")
                if parts:
                    print(f"[{now - started:6.0f}s] " + " | ".join(parts), flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        failed = (-1, "interrupted")
    finally:
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for fh, _ in logs:
            fh.close()
        master.stop(drain=not failed)
    if failed:
        i, code = failed
        tail = ""
        if i >= 0:
            tail = "\n".join(logs[i][1].read_text(errors="replace").splitlines()[-30:])
        hub.close()
        raise RuntimeError(f"worker {node_id(i) if i >= 0 else ''} failed ({code}); see {logs[i][1] if i >= 0 else rdir}\n{tail}")

    outer_step, eval_loss = evaluate_global(cfg, hub, dm)
    hub.close()
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
        "recipe": OmegaConf.select(cfg, "hydra.runtime.choices.recipe", default=None),
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


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Dispatch on ``cfg.role``."""
    validate(cfg)
    _resolve_run_dir(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.launch.kind == "submitit" and cfg.role == "all":
        from diloco_lightning.slurm import run_submitit

        return run_submitit(cfg)
    if cfg.role == "worker":
        return run_worker(cfg)
    if cfg.role == "master":
        run_master(cfg)
        return None
    return run_all(cfg)


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_lightning.launch --config run_dir/config.yaml --node-index i``: one worker."""
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
