"""``role=all``: a whole run on this machine. Prepares the data once, starts the master in this
process and ``workers`` worker processes (:mod:`diloco_lightning.app.worker`) sharing a folder
hub in ``<run_root>/<run_id>/hub``, prints one progress line per outer round and worker
progress at least every minute, evaluates the global model along the way and at the end, and
writes ``results.json`` in the run folder.

A run whose ``results.json`` says it is finished says so and keeps its results (an interrupted
one resumes from its checkpoints). Ctrl-C or SIGTERM stops the workers (each uploads what is
pending) and the master, and ends with :class:`~diloco_lightning.app.errors.Interrupted`; a
worker that crashed (a signal, an exception) is restarted from its checkpoint with back-off, one line
each (``supervise.*``, :mod:`diloco_lightning.app.supervise`); one that ended with a configuration
error, or crashed once more than ``supervise.restarts`` allows, ends the run with
:class:`~diloco_lightning.app.errors.RunError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.util.jsondoc import dumps_json
from diloco_lightning.app.build import (
    RESULTS_FILE,
    Evaluator,
    build_datamodule,
    build_master,
    eval_points,
    evaluate_global,
    hub_label,
    node_id,
    open_run_hub,
    recipe_name,
    regime,
    run_dir,
    single_worker_note,
    val_windows,
    tau_label,
    worker_delay,
)
from diloco_lightning.app.console import log_to_file
from diloco_lightning.app.launches import Launches, invoked_as, read_jsonl, resume_command, round_counts
from diloco_lightning.app.errors import Interrupted, RunError, Signal, terminate_as_exception
from diloco_lightning.app.supervise import Restarts, Spare, SuperviseOptions, describe_exit
from diloco_lightning.app.processes import process_env, restart_worker, start_worker, stop_workers
from diloco_lightning.app.worker import worker_command

log = logging.getLogger(__name__)

#: progress lines of the role=all parent: at most this often when there is news, and at least this often
PROGRESS_EVERY, HEARTBEAT_EVERY = 10.0, 60.0


def is_round(metrics: dict) -> bool:
    """A poll that published or rejected something (idle polls are not printed)."""
    return bool(metrics.get("published") or metrics.get("accepted") or metrics.get("rejected_by_reason"))


def print_round(metrics: dict) -> None:
    """The same progress line as ``diloco-master``'s (:func:`diloco_lightning.master.metrics.format_progress`)."""
    from diloco_lightning.master.metrics import format_progress

    print(f"[master] {format_progress(metrics)}", flush=True)


def _read_progress(path: Path) -> list[tuple[int, float]]:
    return [(step, loss) for step, loss, _ in _read_progress_timed(path)]


def _read_progress_timed(path: Path) -> list[tuple[int, float, float | None]]:
    out = []
    for d in read_jsonl(path):
        try:
            t = d.get("time")
            out.append((int(d["step"]), float(d["loss"]), float(t) if isinstance(t, (int, float)) else None))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _progress_line(rdir: Path, workers: int, total: int, elapsed: float, since: float | None = None) -> tuple[str, tuple]:
    """``[  42s] w0 step 30/160 loss 6.53 (0.3 s/step, ~39 s left) | w1 ...`` (``total``: the steps
    each worker trains) and a key that changes with news. The rate is this launch's: only the lines
    written at or after ``since`` (the launch's start, ``time.time()``) count, so the time between a
    run's launches (``progress.jsonl`` is appended by each) never slows it down."""
    from diloco_lightning.util.waiting import format_duration

    parts, key = [], []
    for i in range(workers):
        prog = _read_progress_timed(rdir / "nodes" / node_id(i) / "progress.jsonl")
        if not prog:
            parts.append(f"{node_id(i)} starting")
            key.append(-1)
            continue
        step, loss, t = prog[-1]
        key.append(step)
        text = f"{node_id(i)} step {step}/{total} loss {loss:.3f}"
        first = next(((s, tt) for s, _, tt in prog if tt is not None and (since is None or tt >= since)), None)
        if first and t is not None and step > first[0] and t > first[1]:
            rate = (t - first[1]) / (step - first[0])
            text += f" ({rate:.2g} s/step, ~{format_duration(rate * (total - step))} left)"
        parts.append(text)
    return f"[{elapsed:6.0f}s] " + " | ".join(parts), tuple(key)


def _loss(results: dict[str, Any]) -> float:
    """A results.json's eval loss as a number to print (NaN when it holds none: null, or missing)."""
    x = results.get("eval_loss")
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def finished_results(cfg: DictConfig, rdir: Path) -> dict[str, Any] | None:
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


def _same_folder(cfg: DictConfig) -> dict[str, str]:
    """The overrides that bring a command without ``-m`` back to this job's folder: none outside a sweep
    (the run folder is named after the overrides, less the ones that extend a run); in a sweep, whose
    job folders are ``<hydra.sweep.dir>/<run_id>`` and whose ids keep ``trainer.max_steps``, the job's
    ``run_id`` and the folder it is in (``run_root``, or ``hydra.run.dir`` for another layout)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or not hc.runtime.output_dir:
            return {}
        out = Path(hc.runtime.output_dir).resolve()
    except (ValueError, ImportError):
        return {}

    def shown(path: Path) -> str:  # as short as it stays right: relative to where the command runs
        try:
            return str(path.relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(path)

    if out.name == str(cfg.run_id):
        return {"run_id": str(cfg.run_id), "run_root": shown(out.parent)}
    return {"run_id": str(cfg.run_id), "hydra.run.dir": shown(out)}


def finished_message(cfg: DictConfig, rdir: Path, done: dict[str, Any], *, resumes: bool = True) -> str:
    """What a finished run's command says: its results, and the exact command that trains it further in
    the same folder (a sweep's job too). ``resumes``: the run continues from its checkpoints (the
    simulator's starts again from step 0, in the same folder)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):
        overrides = []
    more = resume_command(overrides, invoked_as(), **{"trainer.max_steps": 2 * int(cfg.trainer.max_steps)},
                          **_same_folder(cfg))
    how = "train it further (it resumes)" if resumes else "run it longer in the same folder (the simulator starts again)"
    return (f"run {cfg.run_id} is already finished: {rdir / RESULTS_FILE} (eval loss {_loss(done):.3f} "
            f"after {done.get('outer_steps')} outer steps, {done.get('max_steps')} steps per worker). Nothing to do. To "
            f"{how}, raise trainer.max_steps:\n    {more}\nTo start again, use another "
            f"run_id=... or delete {rdir}.")


def run_all(cfg: DictConfig) -> dict[str, Any]:
    """The whole run (see the module docstring): its results, or Interrupted / RunError."""
    rdir = run_dir(cfg)
    done = finished_results(cfg, rdir)
    if done is not None:
        print(finished_message(cfg, rdir, done), flush=True)
        return done
    hub = open_run_hub(cfg)  # first: a hub that does not exist is refused in seconds, before the data is built
    rdir.mkdir(parents=True, exist_ok=True)
    log_to_file(rdir / "train.log")
    launches = Launches(rdir)
    started = time.perf_counter()
    print(_opening_line(cfg), flush=True)
    dm = build_datamodule(cfg)
    dm.prepare_data()  # tokenizer + token cache built once here, not raced by the workers
    config_path = rdir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    rounds: list[dict] = []

    def on_round(m: dict) -> None:
        if is_round(m):
            rounds.append(m)
            print_round(m)

    master = build_master(cfg, hub, on_round=on_round, in_thread=True)
    master.start()

    devices = _device_list(cfg.launch, cfg.trainer)
    threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // cfg.workers)
    procs: list[subprocess.Popen] = []
    logs: list[tuple[Any, Path]] = []
    evaluator = Evaluator(cfg, dm)
    eval_curve: list[list[float]] = []
    interrupted: int | None = None
    failed: tuple[int, Any] | None = None
    error: BaseException | None = None
    supervise = SuperviseOptions(**{k: cfg.supervise[k] for k in SuperviseOptions.names()}).validate()
    policies = [Restarts(supervise, f"worker {node_id(i)}") for i in range(cfg.workers)]

    spares: list[Spare] = []  # one per worker when supervise.spare (each knows its worker's life)

    def restart(i: int, line: str) -> None:
        device = devices[i % len(devices)] if devices else None
        spare = spares[i] if spares else None
        restart_worker(config_path, rdir, i, threads, device, procs, logs, line, spare)

    def keep_spares() -> None:
        for i, sp in enumerate(spares):
            code = procs[i].poll()
            if code is None:
                sp.keep(supervise.spare_after)
            elif code == 0:  # this worker is done: no restart will need its spare
                sp.close()

    try:
        with terminate_as_exception():
            for i in range(cfg.workers):
                device = devices[i % len(devices)] if devices else None
                start_worker(config_path, rdir, i, threads, device, procs, logs)
                if supervise.spare and supervise.restarts > 0:
                    spares.append(Spare(worker_command(config_path, i), env=process_env(threads, device),
                                        stdout=logs[i][0], stderr=subprocess.STDOUT))
            failed = _watch(rdir, procs, master, evaluator, eval_points(cfg), eval_curve, started,
                            timeout=float(cfg.launch.timeout), max_steps=int(cfg.trainer.max_steps),
                            since=launches.started, policies=policies, restart=restart,
                            keep=keep_spares if spares else None)
    except (KeyboardInterrupt, Signal) as e:
        interrupted = e.signum if isinstance(e, Signal) else int(signal.SIGINT)
    except Exception as e:  # the master's configuration error (never retried), or a bug: the workers stop too
        error = e
        raise
    finally:
        for sp in spares:
            sp.close()
        if failed or interrupted or error is not None:
            stop_workers(procs)
        for fh, _ in logs:
            fh.close()
        master.stop(drain=not (failed or interrupted or error is not None))
    if failed or interrupted:
        launches.end("interrupted" if interrupted else "failed", max_steps=int(cfg.trainer.max_steps),
                      outer_step=master.outer_step if master.has_state else None)
        hub.close()
        if interrupted:
            raise _interrupted(interrupted, master.outer_step, len(procs), rdir)
        assert failed is not None
        note = policies[failed[0]].spent(failed[1]) if failed[0] >= 0 and isinstance(failed[1], int) else None
        raise _failure(str(cfg.run_id), failed, [path for _, path in logs], rdir, note)
    return finish_run(cfg, rdir, hub, dm, evaluator, launches, rounds, eval_curve)


def _opening_line(cfg: DictConfig) -> str:
    """``run <id> (recipe <r>): <n> workers, model ..., outer ..., H=..., tau ...; hub ...``: the
    whole run's settings in one line."""
    label = recipe_name()
    named = f" (recipe {label})" if label and f"recipe={label}" not in str(cfg.run_id) else ""
    note = single_worker_note(cfg)
    return (f"run {cfg.run_id}{named}: {cfg.workers} workers, model {cfg.model.preset}, "
            f"outer {cfg.outer.name} (lr {cfg.outer.lr}), H={cfg.diloco.inner_steps}, sync {cfg.diloco.sync}, "
            f"tau {tau_label(cfg)}, {cfg.trainer.max_steps} steps; hub {hub_label(cfg)}" + (f"\n{note}" if note else ""))


def _interrupted(signum: int, outer_step: int | None, workers: int, rdir: Path) -> Interrupted:
    """What a user reads after Ctrl-C or SIGTERM: what was stopped, and that the same command resumes."""
    name = signal.Signals(signum).name
    return Interrupted(
        signum,
        f"interrupted by {name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}: stopped the master at outer_step "
        f"{outer_step} and {workers} worker(s); checkpoints in {rdir / 'nodes'}. The same command resumes "
        f"the run.",
    )


def _failure(run_id: str, failed: tuple[int, Any], log_paths: list[Path], rdir: Path, note: str | None = None) -> RunError:
    """A failed run: the worker that failed (index -1: the run's timeout) and its log's last lines (``note``:
    why it was not restarted, when its restarts are spent)."""
    i, code = failed
    if i < 0:
        return RunError(f"run {run_id} {code}; see the worker logs in {rdir / 'nodes'}")
    tail = "\n".join("    " + line for line in log_paths[i].read_text(errors="replace").splitlines()[-25:])
    return RunError(
        f"worker {node_id(i)} {describe_exit(code)}{' (' + note + ')' if note else ''}; the other workers were "
        f"stopped. Last lines of "
        f"{log_paths[i]}:\n{tail or '    (empty)'}"
    )


def finish_run(cfg: DictConfig, rdir: Path, hub, dm, evaluator: Evaluator, launches: Launches, rounds: list[dict],
               eval_curve: list[list[float]]) -> dict[str, Any]:
    """The end of a whole run (local or SLURM): evaluate the newest global model, write
    ``results.json`` (whole-run counters, this launch's under ``last_launch``) and print the summary."""
    label = recipe_name()
    outer_step, eval_loss = evaluate_global(cfg, hub, dm, evaluator)
    hub.close()
    if not eval_curve or eval_curve[-1][0] != outer_step:
        eval_curve.append([outer_step, eval_loss])
    wall, launch_wall = launches.whole_seconds(), launches.seconds()
    summaries = [json.loads((rdir / "nodes" / node_id(i) / "summary.json").read_text()) for i in range(cfg.workers)]
    curves = [_read_progress(rdir / "nodes" / node_id(i) / "progress.jsonl") for i in range(cfg.workers)]
    train_curve = mean_curve(curves)
    chance = math.log(dm.vocab_size)
    # the whole run's rounds (metrics.jsonl is appended by every launch) and this launch's
    accepted, rejected = round_counts(r for r in read_jsonl(rdir / "master" / "metrics.jsonl") if is_round(r))
    launch_accepted, launch_rejected = round_counts(rounds)
    final_train = [s["final_train_loss"] for s in summaries]
    final_train_loss = sum(final_train) / len(final_train)
    diverged = not math.isfinite(eval_loss) or eval_loss > chance
    tokens = sum(s["tokens"] for s in summaries)
    launch_tokens = sum(s.get("launch", {}).get("tokens", s["tokens"]) for s in summaries)
    previous = launches.previous()
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
        "eval_windows": val_windows(cfg),
        "diverged": diverged,
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "bytes_sent": sum(s["bytes_sent"] for s in summaries),
        "deltas_accepted": accepted,
        "deltas_rejected": rejected,
        "launches": len(previous) + 1,
        # the counters above are the whole run's (every launch of this run_id); these, the last launch's
        "last_launch": {
            "wall_seconds": launch_wall,
            "tokens": launch_tokens,
            "tokens_per_second": launch_tokens / launch_wall if launch_wall > 0 else 0.0,
            "bytes_sent": sum(s.get("launch", {}).get("bytes_sent", s["bytes_sent"]) for s in summaries),
            "deltas_accepted": launch_accepted,
            "deltas_rejected": launch_rejected,
            "from_step": min((s.get("launch", {}).get("from_step", 0) for s in summaries), default=0),
        },
        "train_curve": train_curve,
        "eval_curve": eval_curve,
        "workers_summary": summaries,
    }
    (rdir / RESULTS_FILE).write_text(dumps_json(results, indent=2))
    launches.end("finished", max_steps=int(cfg.trainer.max_steps), outer_step=outer_step)
    again = f" (launch {len(previous) + 1} of this run: {launch_wall:.0f} s, {launch_accepted} deltas accepted)" if previous else ""
    print(
        f"done in {wall:.0f}s{again}: {outer_step} outer steps, {accepted} deltas accepted, {rejected} rejected, "
        f"{results['bytes_sent'] / 1e6:.1f} MB sent, {results['tokens_per_second']:.0f} tokens/s | "
        f"train loss {curves[0][0][1] if curves and curves[0] else float('nan'):.3f} -> {final_train_loss:.3f} | "
        f"eval loss of the global model {eval_loss:.3f} (chance {chance:.2f}){' DIVERGED' if diverged else ''} | "
        f"{rdir / RESULTS_FILE}",
        flush=True,
    )
    return results


def _watch(rdir: Path, procs: list[subprocess.Popen], master: Any, evaluator: Evaluator, points: list[int],
           eval_curve: list[list[float]], started: float, *, timeout: float, max_steps: int,
           since: float | None = None, policies: list[Restarts] | None = None,
           restart: Any = None, keep: Any = None) -> tuple[int, Any] | None:
    """Poll the workers until all are done (None) or one failed (``(index, exit code)``; index -1:
    ``timeout`` seconds since ``started`` passed); print progress lines (their rates from the
    progress written since ``since``, this launch's start); evaluate the global model at the outer
    steps in ``points``. A configuration error that ended the master is raised. With ``policies``
    (one :class:`~diloco_lightning.app.supervise.Restarts` per worker), a worker that crashed is
    restarted by ``restart(index, line)`` after its back-off, the line printed; it fails the run
    only when its policy says no. ``keep()``: called at each poll (the warm spares)."""
    last_print, last_key = time.perf_counter(), None
    points = list(points)
    due: dict[int, tuple[float, str]] = {}  # workers waiting for their restart: when, and the line
    while True:
        if getattr(master, "error", None) is not None:  # a configuration error ended the master: no retry fixes it
            raise master.error
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c in (None, 0) or i in due:
                continue
            policy = policies[i] if policies is not None and restart is not None else None
            delay = policy.decide(c) if policy is not None else None
            if policy is None or delay is None:
                return (i, c)
            line = policy.line(c, delay)
            print(line, flush=True)
            due[i] = (time.perf_counter() + delay, line)
        for i, (when, line) in list(due.items()):
            if time.perf_counter() >= when:
                del due[i]
                policies[i].started()  # type: ignore[index]
                restart(i, line)  # type: ignore[misc]
                codes[i] = None
        if not due and all(c == 0 for c in codes):
            return None
        if keep is not None:
            keep()
        now = time.perf_counter()
        if now - started > timeout:
            return (-1, f"ran past launch.timeout={timeout:g} s")
        if points and master.has_state and master.outer_step >= points[0]:
            step, state = master.snapshot()
            while points and points[0] <= step:
                points.pop(0)
            eval_curve.append([step, evaluator.loss(state)])
        line, key = _progress_line(rdir, len(procs), max_steps, now - started, since)
        first = any(k >= 0 for k in key) and not (last_key and any(k >= 0 for k in last_key))
        if first or (key != last_key and now - last_print >= PROGRESS_EVERY) or now - last_print >= HEARTBEAT_EVERY:
            print(line, flush=True)  # the first progress at once, news every 10 s, a heartbeat every minute
            last_print, last_key = now, key
        time.sleep(0.2)


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[list[float]]:
    """The workers' training curves averaged per step: ``[[step, mean loss], ...]`` (results.json's ``train_curve``)."""
    by_step: dict[int, list[float]] = {}
    for c in curves:
        for s, v in c:
            by_step.setdefault(s, []).append(v)
    return [[s, sum(v) / len(v)] for s, v in sorted(by_step.items())]


def _device_list(launch: DictConfig, trainer: DictConfig) -> list[str]:
    """The devices the workers take in turn: ``launch.devices``, else every CUDA device when
    ``trainer.accelerator`` may use one, else none."""
    if launch.devices:
        return [str(d) for d in launch.devices]
    if trainer.accelerator in ("gpu", "cuda", "auto"):
        try:
            import torch

            return [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            return []
    return []
