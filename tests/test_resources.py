"""A run the machine cannot hold is refused in seconds, before anything heavy starts, with one line
that says what is missing and which override fits; an explicit override lets an expert proceed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from diloco_lightning.app.config import CONFIG_DIR, RECIPE_DIR, register_configs, validate
from diloco_lightning.app.build import model_config
from diloco_lightning.models.llama import Llama
from diloco_lightning.app.resources import GB, Machine, ResourceError, check_resources, estimate

ROOT = Path(__file__).resolve().parents[1]
register_configs()


def _cfg(*overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return validate(compose("train", overrides=list(overrides)))


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DILOCO_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"run_root={tmp_path / 'runs'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
def test_parameter_count_from_the_config_equals_the_built_model(recipe):
    cfg = _cfg(f"recipe={recipe}")
    mc = model_config(cfg, cfg.model.vocab_size or cfg.data.vocab_size)
    with torch.device("meta"):
        model = Llama(mc)
    assert mc.parameter_count() == sum(p.numel() for p in model.parameters())


def test_gpu_recipe_on_a_cpu_machine_is_refused_before_anything_starts(tmp_path):
    """`recipe=llama7b_tau8` here (no GPU): one line naming the GPU need and the ways out, status 1,
    and nothing trained or written (no tokenizer, no run folder)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _train(tmp_path, "recipe=llama7b_tau8")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr
    msg = lines[0]
    assert msg.startswith("train.py: error: recipe llama7b_tau8 needs GPUs (trainer.accelerator=gpu: 8 worker(s)"), msg
    assert "6.74B parameters" in msg and "launch=submitit" in msg and "recipe=llama25m_tau8" in msg
    assert "launch.check_resources=false" in msg
    assert not (tmp_path / "cache").exists()  # no tokenizer trained
    run = tmp_path / "runs" / "recipe=llama7b_tau8"  # Hydra's own record (hydra/) is all there is
    assert not (run / "config.yaml").exists() and not (run / "nodes").exists() and not (run / "hub").exists()


def test_memory_refusal_names_the_workers_that_fit(tmp_path):
    """`launch.available_memory_gb` states the memory (a scheduler's limit): llama25m's 4 workers do not fit
    in 6 GB, one does; the line says so."""
    proc = _train(tmp_path, "recipe=llama25m_tau8", "launch.available_memory_gb=6")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr
    msg = lines[0]
    assert "recipe llama25m_tau8 needs ~" in msg and "4 worker(s) x ~" in msg and "6.0 GB stated by launch.available_memory_gb" in msg
    assert "use workers=1" in msg and "recipe=tiny" in msg and "launch=submitit" in msg
    assert not (tmp_path / "cache").exists()  # refused before the tokenizer was trained


def test_estimate_scales_with_workers_precision_and_optimizer():
    base = estimate(_cfg("recipe=llama25m_tau8"))
    assert base.params == 23_535_680
    # FP32 + AdamW: 4 (weights) + 4 (grads) + 8 (moments) bytes per parameter, plus activations
    assert base.device_bytes > 16 * base.params
    bf16 = estimate(_cfg("recipe=llama25m_tau8", "trainer.precision=bf16-true", "optim=adamw8bit"))
    assert bf16.device_bytes < base.device_bytes
    big = estimate(_cfg("recipe=llama7b_tau8"))
    assert 6.7e9 < big.params < 6.8e9 and 60 * GB < big.device_bytes < 80 * GB  # "one 80 GB GPU each"


def test_check_resources_against_stated_machines():
    cfg = _cfg("recipe=llama7b_tau8")
    # eight 80 GB Ampere GPUs and 2 TB of RAM: it fits
    check_resources(cfg, Machine(2000 * GB, [80 * GB] * 8, ["A100-80GB"] * 8, bf16=True, cuda_build=True), "llama7b_tau8")
    # 40 GB GPUs: refused, naming the per-GPU need
    with pytest.raises(ResourceError, match=r"needs ~7\d\.\d GB per GPU .* but the GPUs have 40\.0 GB"):
        check_resources(cfg, Machine(2000 * GB, [40 * GB] * 8, ["A100-40GB"] * 8, bf16=True, cuda_build=True), "llama7b_tau8")
    # two 80 GB GPUs for 8 workers: 4 per GPU do not fit; the line says how many workers do
    with pytest.raises(ResourceError, match="use workers=2"):
        check_resources(cfg, Machine(2000 * GB, [80 * GB] * 2, ["H100"] * 2, bf16=True, cuda_build=True), "llama7b_tau8")
    # no bf16 (a V100): refused with the precision override
    with pytest.raises(ResourceError, match="no bfloat16 support .* trainer.precision=16-mixed"):
        check_resources(cfg, Machine(2000 * GB, [80 * GB] * 8, ["V100"] * 8, bf16=False, cuda_build=True), "llama7b_tau8")
    # host memory: the FP32 anchors of 8 workers do not fit in 64 GB of RAM
    with pytest.raises(ResourceError, match="of memory"):
        check_resources(cfg, Machine(64 * GB, [80 * GB] * 8, ["H100"] * 8, bf16=True, cuda_build=True), "llama7b_tau8")
    # launch=submitit: only the master runs here (the workers run in SLURM jobs)
    check_resources(_cfg("recipe=llama7b_tau8", "launch=submitit"), Machine(200 * GB), "llama7b_tau8")
    # 16-mixed on a CPU
    with pytest.raises(ResourceError, match="16-mixed, which needs a GPU"):
        check_resources(_cfg("recipe=tiny", "trainer.precision=16-mixed"), Machine(64 * GB))
    # the demo fits in 4 GB
    check_resources(_cfg("recipe=tiny"), Machine(4 * GB))


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_an_explicit_override_skips_the_check(tmp_path):
    """launch.check_resources=false: the run starts (and fails later for its own reasons: here a role=worker
    with no master, stopped by its short wait_timeout), proving the check did not stop it."""
    proc = _train(tmp_path, "recipe=tiny", "launch.available_memory_gb=0.01", "launch.check_resources=false", "role=worker",
                  f"hub.url={tmp_path / 'hub'}", "hub.create=true", "diloco.wait_timeout=1", "data.max_bytes=100000",
                  "data.vocab_size=300", "supervise.restarts=0")  # a master away: not restarted here
    assert "needs ~" not in proc.stderr
    assert "no master published outer step 0" in proc.stderr, proc.stderr[-2000:]
    refused = _train(tmp_path, "recipe=tiny", "launch.available_memory_gb=0.01")
    assert refused.returncode == 1 and "needs ~" in refused.stderr
