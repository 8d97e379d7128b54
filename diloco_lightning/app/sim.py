"""``launch=sim``: the whole run in this process, on the simulator (:mod:`diloco_lightning.sim`).

The same recipe as ``launch=local`` (model, data shards, inner optimizer, outer optimizer,
master options, ``diloco.sync`` / ``delay`` / ``delta_dtype``), built by the same functions
(:mod:`diloco_lightning.app.build`), without worker processes, Lightning Trainers or a hub:
K workers' inner loops run one after the other in this process, on a simulated clock
(``sim.speeds``, ``sim.speed_law``, ``sim.traces``; a budget of simulated time: ``sim.max_time``;
``diloco.inner_steps=auto``: Dynamic Local Updates on the simulated step rates). Writes what a
real run writes: ``results.json`` (with the same keys, plus a ``sim`` block: per-version
staleness histograms and outer step sizes, loss against simulated time and against delivered
tokens, each worker's H per phase), ``master/metrics.jsonl``
(one line per version), ``nodes/<id>/progress.jsonl`` and ``nodes/<id>/summary.json``; no hub
files (``sim.save_weights=true`` writes the final global weights to ``global.safetensors``).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.util.jsondoc import dumps_json
from diloco_lightning.app.build import (
    RESULTS_FILE,
    Evaluator,
    build_datamodule,
    build_module,
    node_id,
    nominal_inner_steps,
    recipe_name,
    regime,
    run_dir,
    run_master_config,
    single_worker_note,
    tau_label,
    val_windows,
)
from diloco_lightning.app.config import sim_options
from diloco_lightning.app.console import log_to_file
from diloco_lightning.app.local import mean_curve, finished_message, finished_results, print_round

__all__ = ["build_simulator", "run_sim"]


#: What ``launch=sim`` does with each of the product's worker options (``WorkerOptions``, the ``diloco``
#: section): every one is honoured as the product honours it, refused when set (with the sim's own
#: knob to use instead), or has no meaning without a hub (nothing waits, polls or claims).
#: tests/test_sim_options.py checks that this table names every option.
SIM_WORKER_OPTIONS: dict[str, str] = {
    "inner_steps": "honoured", "dylu_steps": "honoured", "dylu_min_steps": "honoured", "dylu_seconds": "honoured",
    "sync": "honoured", "delay": "honoured", "delta_dtype": "honoured", "topk": "honoured", "topk_values": "honoured",
    "topk_chunk": "honoured", "error_feedback": "honoured", "error_feedback_decay": "honoured", "fragments": "honoured",
    "rebase": "honoured", "lookahead": "honoured", "reset_inner_optimizer": "honoured",
    "throttle": "refused: the simulated clock's speeds are sim.speeds (or sim.speed_law, sim.traces)",
    "wait_timeout": "no hub", "poll_interval": "no hub", "claim_ttl": "no hub", "wait_for_hub": "no hub",
    # a simulated run's model is the master's global already (results.json scores it): nothing to install
    "final_install": "no hub", "final_wait": "no hub",
}


def sim_rebase(cfg: DictConfig) -> bool:
    """Whether the simulated workers rebase onto their own deltas: ``sim.rebase``, or the product's
    ``diloco.rebase`` where the product's worker uses it (``sync=async``, no fragments)."""
    from diloco_lightning.wire.fragments import fragment_count

    product = bool(cfg.diloco.rebase) and cfg.diloco.sync == "async" and fragment_count(_fragments(cfg)) == 1
    return bool(sim_options(cfg).rebase) or product


def _delay_option(cfg: DictConfig) -> Any:
    """``diloco.delay`` as plain Python, a distribution seeded by ``seed`` unless it names its own
    (as :func:`diloco_lightning.app.build.worker_delay` seeds the product's draw)."""
    delay = cfg.diloco.delay
    if isinstance(delay, DictConfig):
        return {"seed": cfg.seed, **OmegaConf.to_container(delay, resolve=True)}  # type: ignore[dict-item]
    if OmegaConf.is_list(delay):
        return list(delay)
    return delay


def _device(cfg: DictConfig):
    import torch

    acc = str(cfg.trainer.accelerator)
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _training_loss(module, batch):
    """The product's training step's loss (``LlamaLightningModule.training_step`` without its logging)."""
    x, y = module.inputs_targets(batch)
    return module.model.loss(x, y)


def build_worker(cfg: DictConfig, index: int, device):
    """Worker ``index`` of the run: its model (the product's module), shard, inner optimizer and schedule."""
    import torch

    from diloco_lightning.sim import InnerLoop, SimWorker
    from diloco_lightning.worker.params import module_state

    dm = build_datamodule(cfg, node_rank=index, num_nodes=cfg.workers)
    module = build_module(cfg, dm.vocab_size)
    if cfg.trainer.precision == "bf16-true":
        module.to(torch.bfloat16)  # what Lightning's bf16-true precision does to the module
    module.to(device)
    module.train()
    conf = module.configure_optimizers()
    sched = conf.get("lr_scheduler")
    scheduler = sched["scheduler"] if isinstance(sched, dict) else sched

    inner = InnerLoop(
        None, conf["optimizer"], iter(dm.train_dataloader()), scheduler=scheduler,
        gradient_clip_val=cfg.trainer.gradient_clip_val, precision=cfg.trainer.precision, device=device,
        count_tokens=lambda b: module.inputs_targets(b)[0].numel(), module=module, module_loss=_training_loss,
    )
    opts = sim_options(cfg)
    return SimWorker(index, module_state(module), inner, inner_steps=nominal_inner_steps(cfg),
                     max_steps=cfg.trainer.max_steps, speed=opts.speed(index), log_every=cfg.trainer.log_every_n_steps,
                     node_id=node_id(index), fragments=_fragments(cfg))


def _fragments(cfg: DictConfig) -> Any:
    """``diloco.fragments`` as plain Python (an int, a list of pattern groups, or None)."""
    frags = cfg.diloco.get("fragments")
    return OmegaConf.to_container(frags) if OmegaConf.is_list(frags) else frags


def expected_outer_steps(cfg: DictConfig) -> int:
    """The outer steps of a run of ``trainer.max_steps`` per worker (a step budget; with
    ``sim.max_time`` only an indication: the time decides)."""
    from diloco_lightning.wire.fragments import fragment_count

    # a boundary every H steps, or every H / F with fragments: one round per boundary
    phase = nominal_inner_steps(cfg) // fragment_count(_fragments(cfg))
    warmup = int(cfg.sim.get("sync_warmup") or 0)  # phases of one step, then of H
    rounds = min(warmup, cfg.trainer.max_steps) + max(0, cfg.trainer.max_steps - warmup) // phase
    return rounds * cfg.workers if cfg.master.aggregation == "arrival" else rounds


def dylu_option(cfg: DictConfig) -> dict[str, Any] | None:
    """The simulator's ``dylu`` argument: the product's ``diloco.dylu_*`` options with ``inner_steps=auto``."""
    if cfg.diloco.inner_steps != "auto":
        return None
    return {"max_steps": int(cfg.diloco.dylu_steps), "min_steps": cfg.diloco.get("dylu_min_steps"),
            "seconds": cfg.diloco.get("dylu_seconds")}


def _parallel(cfg: DictConfig, opts, device) -> int:
    """``sim.parallel``, or its default: ``min(workers, CPU cores)`` on a CPU, 1 on a GPU."""
    return opts.parallel or (1 if device.type == "cuda" else min(int(cfg.workers), os.cpu_count() or 1))


def build_simulator(cfg: DictConfig, *, evaluator: Evaluator | None = None, on_version=None):
    """The :class:`~diloco_lightning.sim.Simulator` of a run's configuration (data prepared first)."""
    from diloco_lightning.sim import SimMaster, Simulator
    from diloco_lightning.worker.options import resolve_encoding

    device = _device(cfg)
    workers = [build_worker(cfg, i, device) for i in range(cfg.workers)]
    config = run_master_config(cfg)
    master = SimMaster(workers[0].params, config)  # version 0: the first worker's initial weights, as its init offer
    n = int(cfg.launch.eval_points)
    total = max(1, expected_outer_steps(cfg))
    opts = sim_options(cfg)
    points: list[int] = []
    times: list[float] = []
    if n > 0 and opts.max_time is not None:  # evenly over simulated time: runs line up on one axis
        times = [k * float(opts.max_time) / n for k in range(n + 1)]
    elif n > 0:
        points = sorted({0} | {max(1, round(k * total / n)) for k in range(1, n + 1)})
    encoding, feedback = resolve_encoding(cfg.diloco.delta_dtype, cfg.diloco.topk, cfg.diloco.topk_values,
                                          cfg.diloco.error_feedback, cfg.diloco.topk_chunk)
    parallel = _parallel(cfg, opts, device)
    return Simulator(
        workers, master, sync=cfg.diloco.sync, delay=_delay_option(cfg), options=opts,
        delta_dtype=encoding, error_feedback=feedback, error_feedback_decay=cfg.diloco.error_feedback_decay,
        evaluate=evaluator.loss if evaluator else None,
        eval_points=points, on_version=on_version, parallel=parallel, seed=int(cfg.seed), eval_times=times,
        dylu=dylu_option(cfg), rebase=sim_rebase(cfg), reset_inner_optimizer=bool(cfg.diloco.reset_inner_optimizer),
        lookahead=bool(cfg.diloco.lookahead),
    )


def run_sim(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured recipe on the simulator; write and return ``results.json``."""
    import torch

    rdir = run_dir(cfg)
    label = recipe_name()
    done = finished_results(cfg, rdir)
    if done is not None:
        print(finished_message(cfg, rdir, done, resumes=False), flush=True)
        return done
    rdir.mkdir(parents=True, exist_ok=True)
    log_to_file(rdir / "train.log")
    started = time.perf_counter()

    def stage(text: str) -> None:  # the slow first minute says what it does
        print(f"[{time.perf_counter() - started:6.0f}s] {text}", flush=True)

    # one thread per op unless told otherwise: the workers run side by side on threads of their own
    # (sim.parallel), a small model's ops gain little from more, and on a shared machine spinning
    # threads cost far more than they give
    torch.set_num_threads(int(cfg.trainer.num_threads or 1))
    print(f"run {cfg.run_id}{f' (recipe {label})' if label else ''} on the simulator: {cfg.workers} workers, model "
          f"{cfg.model.preset}, outer {cfg.outer.name} (lr {cfg.outer.lr}), H={cfg.diloco.inner_steps}, sync "
          f"{cfg.diloco.sync}, aggregation {cfg.master.aggregation}, tau {tau_label(cfg)}, {cfg.trainer.max_steps} steps"
          + (f", simulated time {sim_options(cfg).max_time:g}" if sim_options(cfg).max_time is not None else ""),
          flush=True)
    if single_worker_note(cfg):
        print(single_worker_note(cfg), flush=True)
    stage("preparing the data (the tokenizer and token cache are built once, then cached)")
    dm = build_datamodule(cfg)
    dm.prepare_data()
    OmegaConf.save(cfg, rdir / "config.yaml", resolve=True)
    metrics_path = rdir / "master" / "metrics.jsonl"
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text("")
    total = expected_outer_steps(cfg)
    last_print = [0.0]

    def on_version(rec: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(dumps_json(rec, sort_keys=True) + "\n")
        now = time.perf_counter()
        if total <= 64 or now - last_print[0] >= 10.0 or rec.get("outer_step") == total:
            last_print[0] = now
            print_round(rec)

    stage(f"building {cfg.workers} workers")
    evaluator = Evaluator(cfg, dm)
    sim = build_simulator(cfg, evaluator=evaluator, on_version=on_version)
    stage(f"simulating: {total} outer steps expected, the first after each worker's first {nominal_inner_steps(cfg)} "
          "inner steps")
    result = sim.run()
    wall = time.perf_counter() - started
    results = _results(cfg, sim, result, dm.vocab_size, wall, label)
    for w in sim.workers:
        out = rdir / "nodes" / w.node_id
        out.mkdir(parents=True, exist_ok=True)
        (out / "progress.jsonl").write_text("".join(dumps_json({"step": s, "loss": v}) + "\n" for s, v in w.losses))
        (out / "summary.json").write_text(dumps_json(_worker_summary(cfg, sim, w), indent=2))
    if sim_options(cfg).save_weights:
        from diloco_lightning.wire.statefile import save_weights_file

        save_weights_file(rdir / "global.safetensors", result.final_state, metadata={"outer_step": str(result.outer_steps)})
    (rdir / RESULTS_FILE).write_text(dumps_json(results, indent=2))
    print(f"done in {wall:.0f}s: {result.outer_steps} outer steps, {results['deltas_accepted']} deltas accepted, "
          f"{results['deltas_rejected']} rejected, {results['sim']['inner_steps_per_second']:.1f} inner steps/s | "
          f"train loss {results['final_train_loss']:.3f} | eval loss of the global model {results['eval_loss']:.3f} "
          f"(chance {results['chance_loss']:.2f}){' DIVERGED' if results['diverged'] else ''} | {rdir / RESULTS_FILE}",
          flush=True)
    return results


def _histogram(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _worker_summary(cfg: DictConfig, sim, w) -> dict[str, Any]:
    return {
        "node_id": w.node_id, "delay": "per delta" if sim.delays.per_delta else sim.delays.fixed(w.index),
        "speed": w.speed, "wall_seconds": w.compute_seconds, "steps": w.steps, "tokens": w.inner.tokens,
        "final_train_loss": w.last_loss, "deltas_sent": w.boundaries,
        "bytes_sent": int(sim.transfers.bytes_sent * w.boundaries / max(1, sim.transfers.deltas)),
    }


def _results(cfg: DictConfig, sim, result, vocab_size: int, wall: float, label: str | None) -> dict[str, Any]:
    """``results.json``: the keys of a real run's (:func:`diloco_lightning.app.local.run_all`), plus ``sim``."""
    eval_loss = result.eval_curve[-1][1] if result.eval_curve else math.nan
    chance = math.log(vocab_size)
    curves = [w.losses for w in sim.workers]
    finals = [w.last_loss for w in sim.workers]
    final_train = sum(finals) / len(finals)
    records = [r for r in result.records]
    accepted = sum(int(r.get("accepted", 0)) for r in records)
    rejected = sum(int(r.get("rejected", 0)) for r in records)
    tokens = sum(w.inner.tokens for w in sim.workers)
    pending = sim.master.pending_record()
    if pending is not None:
        rejected += int(pending.get("rejected", 0))
    delays = [sim.delays.fixed(i) for i in range(cfg.workers)]
    return {
        "run_id": cfg.run_id, "recipe": label, "outer": cfg.outer.name, "outer_lr": cfg.outer.lr,
        "tau": tau_label(cfg), "regime": regime(cfg), "delays": delays,
        "precision": f"{cfg.trainer.precision}/{cfg.optim.name}", "seed": cfg.seed, "workers": cfg.workers,
        "inner_steps": cfg.diloco.inner_steps, "max_steps": cfg.trainer.max_steps, "outer_steps": result.outer_steps,
        "final_train_loss": final_train, "eval_loss": eval_loss, "chance_loss": chance, "eval_windows": val_windows(cfg),
        "diverged": not math.isfinite(eval_loss) or eval_loss > chance, "wall_seconds": wall, "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0, "bytes_sent": result.bytes_sent,
        "deltas_accepted": accepted, "deltas_rejected": rejected, "train_curve": mean_curve(curves),
        "eval_curve": result.eval_curve, "workers_summary": [_worker_summary(cfg, sim, w) for w in sim.workers],
        "launch": "sim",
        "sim": {
            "aggregation": cfg.master.aggregation, "sync": cfg.diloco.sync,
            "outer_state_dtype": str(cfg.outer.get("state_dtype", "float32")),
            "speeds": [w.speed for w in sim.workers], "sim_time": result.sim_time,
            "inner_steps": result.inner_steps, "run_seconds": result.wall_seconds,
            "inner_steps_per_second": result.inner_steps / result.wall_seconds if result.wall_seconds > 0 else 0.0,
            "staleness_histogram": result.staleness_histogram, "null_rounds": sim.master.null_rounds,
            # phases computed batched (sim.batched), else why not; phases per computation
            "batched": sim.batched_reason is None, "batched_reason": sim.batched_reason,
            "batch_sizes": _histogram(sim.runner.batches),
            # loss against simulated time: [time, eval loss] at each eval_curve point
            "eval_curve_time": [[t, loss] for t, (_, loss) in zip(result.eval_times, result.eval_curve)],
            "lost_phases": result.lost_phases,
            "stopped_early": result.stopped_early,
            "rebase": sim_rebase(cfg),
            "lookahead": bool(cfg.diloco.lookahead) and sim_rebase(cfg),
            "max_time": sim_options(cfg).max_time,
            # tokens of the deltas delivered to the master by each eval_curve point: [tokens, eval loss]
            "eval_curve_tokens": [[n, loss] for n, (_, loss) in zip(result.eval_tokens, result.eval_curve)],
            # H of each phase each worker began (differs between phases with inner_steps=auto)
            "phase_steps": [list(w.phase_lengths) for w in sim.workers],
            "traces": [sim_options(cfg).trace(i) for i in range(cfg.workers)],
            # per worker, its down intervals (join_at, leave_at, preemptions) within the run: [down, up or null]
            "down": [[[d, u if math.isfinite(u) else None] for d, u in sim.churn.intervals(i, result.sim_time)]
                     for i in range(cfg.workers)],
            "abandoned_phases": sim.abandoned_phases,
            # per worker, simulated time computing finished phases, computing lost or given-up ones, and down
            "time_use": result.time_use,
            # the communication: bytes per upload (by fragment) and per version, time spent transferring
            "comm": result.comm,
            "versions": [
                {k: r.get(k) for k in ("outer_step", "time", "accepted", "rejected", "rejected_by_reason",
                                       "staleness_histogram", "update_norm", "update_rms", "update_rms_over_lr",
                                       "null_round", "outer_state")}
                for r in records
            ],
        },
    }
