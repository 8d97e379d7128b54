"""Does this machine have what a run needs? Answered in seconds, before anything heavy starts.

``train.py`` calls :func:`check_resources` right after validating the config, before a
tokenizer is trained or a worker is started: a recipe that needs GPUs, bf16 support,
bitsandbytes or more memory than the machine has is refused with ONE line saying what is
missing and which override would make it fit (``workers=``, ``launch=submitit``, a
smaller recipe). ``launch.check_resources=false`` starts it anyway (an expert who knows
better); ``launch.available_memory_gb`` states the memory the run may use instead of
measuring it (a scheduler's limit, or a test).

The memory estimate (:func:`estimate`) counts the parameters from the model config
(:meth:`~diloco_lightning.models.llama.LlamaConfig.parameter_count`, nothing is built) and
adds, per worker replica on its device: weights, gradients and the inner optimizer's state
in the precision used (AdamW: two moments in the weights' dtype; 8-bit AdamW: ~2 bytes),
activations saved for the backward pass (per token and block ~16*C + 4*F values, plus the
logits and their float32 loss buffers, B*T*V values) and the process itself; per worker
in host memory: the DiLoCo anchor and the export copy (FP32, on the CPU whatever the
device) and, in ``sync=async``, the prefetched global version; and for the master: the
global state, a working copy, the outer optimizer's buffers and the running sum (FP32).
Calibrated on ``llama25m`` (B=16, T=256, FP32 on CPU: 4.0 GB peak per process measured,
4.5 GB estimated), it errs on the safe side.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from diloco_lightning.util.errors import DiLoCoError

__all__ = ["ResourceError", "Machine", "Estimate", "estimate", "check_resources", "available_ram"]

GB = 1e9
_PROCESS_OVERHEAD = 0.6 * GB  # torch + Lightning + data loader of one worker process (host)
_GPU_CONTEXT = 0.8 * GB  # CUDA context and allocator slack per GPU process
_MASTER_BYTES_PER_PARAM = 20  # global + working copy + two optimizer buffers + running sum, FP32
_OVERRIDE = "launch.check_resources=false starts it anyway"


class ResourceError(DiLoCoError, RuntimeError):
    """This machine lacks what the run needs; the one-line message says what and the fix."""


@dataclass
class Machine:
    """What the run may use here."""

    ram_bytes: float
    gpu_bytes: list[float] = field(default_factory=list)  # per visible CUDA device
    gpu_names: list[str] = field(default_factory=list)
    bf16: bool = False  # every visible GPU supports bfloat16
    cuda_build: bool = False
    stated: bool = False  # the memory figures come from launch.available_memory_gb

    @classmethod
    def detect(cls, available_memory_gb: float | None = None) -> "Machine":
        """Measure free RAM and the visible GPUs (``available_memory_gb`` replaces the memory figures:
        host RAM on a CPU run, each GPU's memory on a GPU run)."""
        import torch

        gpus, names, majors = [], [], []
        if torch.cuda.is_available():
            # device properties only: no CUDA context (which would take GPU memory from worker 0) is created
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(float(props.total_memory))
                names.append(props.name)
                majors.append(props.major)
        bf16 = bool(majors) and min(majors) >= 8  # bfloat16 compute: Ampere (sm_80) and newer
        ram = available_ram()
        stated = available_memory_gb is not None
        if available_memory_gb is not None:
            ram = float(available_memory_gb) * GB
            gpus = [float(available_memory_gb) * GB for _ in gpus]
        return cls(ram, gpus, names, bf16, torch.version.cuda is not None, stated)


def available_ram() -> float:
    """Bytes of memory this process may still use: ``MemAvailable``, capped by a cgroup limit
    (containers, SLURM, Kubernetes) when there is one."""
    avail = math.inf
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not math.isfinite(avail):
        try:
            avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            avail = math.inf
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = open(limit_file).read().strip()
            usage = float(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and float(limit_text) < 2**60:
            avail = min(avail, float(limit_text) - usage)
    return avail


@dataclass
class Estimate:
    """Bytes a run needs (see the module docstring for what each part counts)."""

    params: int
    device_bytes: float  # one worker replica on its device (weights, grads, inner optimizer, activations)
    host_bytes: float  # one worker in host memory besides the above (DiLoCo copies, the process)
    master_bytes: float

    def worker_bytes_on_cpu(self) -> float:
        return self.device_bytes + self.host_bytes


def _precision_bytes(precision: str) -> tuple[float, float, float]:
    """(weights + transient casts, gradients, activations) bytes per value."""
    if precision == "bf16-true":
        return 2.0, 2.0, 2.0
    if precision in ("bf16-mixed", "16-mixed"):
        return 6.0, 4.0, 2.0  # FP32 weights + their half copies; FP32 grads; half activations
    return 4.0, 4.0, 4.0


def estimate(cfg: Any) -> Estimate:
    """The memory a run of ``cfg`` (a composed ``train.py`` config) needs."""
    from diloco_lightning.app.build import model_config

    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    mc = model_config(cfg, vocab)
    n = mc.parameter_count()
    weights, grads, acts = _precision_bytes(cfg.trainer.precision)
    weight_dtype_bytes = 2.0 if cfg.trainer.precision == "bf16-true" else 4.0
    inner = 2.0 if cfg.optim.name == "adamw8bit" else 2 * weight_dtype_bytes
    tokens = cfg.data.batch_size * cfg.data.seq_len
    activations = tokens * mc.n_layers * (16 * mc.d_model + 4 * mc.ffn_hidden) * acts + tokens * mc.vocab_size * (acts + 8)
    device = n * (weights + grads + inner) + activations
    diloco = n * (12.0 if cfg.diloco.sync == "async" else 8.0)
    return Estimate(n, device, diloco + _PROCESS_OVERHEAD, n * _MASTER_BYTES_PER_PARAM + 0.3 * GB)


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x < 100 * GB else f"{x / GB:.0f} GB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _needs_gpu(cfg: Any) -> bool:
    return str(cfg.trainer.accelerator) in ("gpu", "cuda")


def check_resources(cfg: Any, machine: Machine | None = None, label: str | None = None) -> Estimate:
    """Raise :class:`ResourceError` when this machine cannot run ``cfg``; return the estimate.

    What runs here: ``role=all`` with ``launch=local``: the master and every worker;
    ``launch=submitit``: the master only (the workers run in SLURM jobs); ``role=worker``: one
    worker (``trainer.devices`` replicas); ``role=master``: the master.
    """
    what = f"recipe {label}" if label else "this run"
    est = estimate(cfg)
    role, kind, workers = cfg.role, cfg.launch.kind, int(cfg.workers)
    local_workers = 0 if role == "master" or (role == "all" and kind == "submitit") else (1 if role == "worker" else workers)
    if machine is None:
        machine = Machine.detect(cfg.launch.available_memory_gb)
    smaller = _smaller_recipes(label, est)
    if local_workers and cfg.optim.name == "adamw8bit":
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ResourceError(
                f"{what} uses optim=adamw8bit, which needs bitsandbytes (not installed): pip install "
                f"'diloco-lightning[bnb]', or use optim=adamw ({_OVERRIDE})"
            )
    on_gpu = bool(local_workers) and (_needs_gpu(cfg) or (cfg.trainer.accelerator == "auto" and bool(machine.gpu_bytes)))
    if local_workers and _needs_gpu(cfg) and not machine.gpu_bytes:
        why = "this torch is a CPU build" if not machine.cuda_build else "torch sees no CUDA device"
        raise ResourceError(
            f"{what} needs GPUs (trainer.accelerator={cfg.trainer.accelerator}: {local_workers} worker(s), "
            f"~{_gb(est.device_bytes + _GPU_CONTEXT)} of GPU memory each; {_params(est.params)} parameters, "
            f"{cfg.trainer.precision}, {cfg.optim.name}) but this machine has none ({why}): run it on a GPU machine "
            f"(or launch=submitit), or choose a CPU recipe{': ' + smaller if smaller else ''} ({_OVERRIDE})"
        )
    if on_gpu and cfg.trainer.precision.startswith("bf16") and not machine.bf16:
        raise ResourceError(
            f"{what} uses trainer.precision={cfg.trainer.precision} but {machine.gpu_names[0]} has no bfloat16 "
            f"support (it needs an Ampere or newer GPU): use trainer.precision=16-mixed or 32-true ({_OVERRIDE})"
        )
    if local_workers and not on_gpu and cfg.trainer.precision == "16-mixed":
        raise ResourceError(
            f"{what} uses trainer.precision=16-mixed, which needs a GPU; on a CPU use bf16-mixed or 32-true ({_OVERRIDE})"
        )
    master = est.master_bytes if role in ("all", "master") else 0.0
    ram_source = "stated by launch.available_memory_gb" if machine.stated else "available"
    if on_gpu:
        n_dev = len(machine.gpu_bytes)
        per_device = math.ceil(local_workers / n_dev)
        need_dev = per_device * (est.device_bytes + _GPU_CONTEXT)
        have_dev = min(machine.gpu_bytes)
        if need_dev > have_dev:
            fit = int(have_dev // (est.device_bytes + _GPU_CONTEXT)) * n_dev
            fix = f"use workers={fit}" if fit >= 1 else "use GPUs with more memory"
            raise ResourceError(
                f"{what} needs ~{_gb(need_dev)} per GPU ({per_device} worker(s) per GPU x ~{_gb(est.device_bytes)}: "
                f"{_params(est.params)} parameters, {cfg.trainer.precision}, {cfg.optim.name}) but the GPUs have "
                f"{_gb(have_dev)}: {fix}, launch=submitit, or a smaller recipe{': ' + smaller if smaller else ''} ({_OVERRIDE})"
            )
        need_ram, per_worker = local_workers * est.host_bytes + master, est.host_bytes
    else:
        per_worker = est.worker_bytes_on_cpu()
        need_ram = local_workers * per_worker + master
    if need_ram > machine.ram_bytes:
        fit = int(max(0.0, machine.ram_bytes - master) // per_worker) if per_worker else 0
        parts = [f"{local_workers} worker(s) x ~{_gb(per_worker)}"] if local_workers else []
        if master:
            parts.append(f"master ~{_gb(master)}")
        fixes = []
        if local_workers > 1 and fit >= 1:
            fixes.append(f"use workers={fit}")
        if role == "all" and kind == "local":
            fixes.append("launch=submitit (workers on other machines)")
        if smaller:
            fixes.append(f"a smaller recipe ({smaller})")
        raise ResourceError(
            f"{what} needs ~{_gb(need_ram)} of memory ({' + '.join(parts)}; {_params(est.params)} parameters, "
            f"{cfg.trainer.precision}, {cfg.optim.name}) but this machine has {_gb(machine.ram_bytes)} {ram_source}: "
            f"{', or '.join(fixes) if fixes else 'run it on a bigger machine'} ({_OVERRIDE})"
        )
    return est


def _smaller_recipes(label: str | None, est: Estimate) -> str:
    """Shipped CPU recipes smaller than this run, as ``recipe=<name>`` alternatives."""
    out = [name for name, n in (("llama25m_tau8", 23.5e6), ("tiny", 1.25e6)) if n < est.params * 0.5 and name != label]
    return " or ".join(f"recipe={name}" for name in out)
