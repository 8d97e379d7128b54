"""What a user installs: the wheel, in a clean virtualenv, its commands run from a foreign folder.

The wheel is built from a copy of the checkout (``pip wheel --no-build-isolation``: nothing is
downloaded) and installed with ``--no-deps --no-index`` into a fresh ``python -m venv``. The venv
does not see this checkout, its editable install or ``PYTHONPATH``; it reaches the heavy
dependencies already installed (torch, Lightning, ...) through a ``.pth`` file naming the
site-packages folders they are imported from here, which Python does not scan for ``.pth``
files of their own (so an editable install there stays invisible). So ``diloco-master`` and ``diloco-train`` can only work if the
wheel itself carries the package, its configs and its recipes. CI runs this test (``.ci/run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _dependency_dirs() -> list[str]:
    """The site-packages folders this interpreter imports the dependencies from (a venv made with
    --system-site-packages has two), never one holding this checkout."""
    import importlib

    dirs: list[str] = []
    for name in ("torch", "lightning", "accelerate", "safetensors", "huggingface_hub", "hydra", "omegaconf", "yaml",
                 "tokenizers", "numpy", "typing_extensions"):
        mod = importlib.import_module(name)
        path = Path(mod.__file__).resolve()  # a package's __init__.py, or a module file
        d = str(path.parents[1] if path.name == "__init__.py" else path.parent)
        if d not in dirs and not Path(d, "diloco_lightning").exists() and Path(d) != ROOT:
            dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HYDRA_FULL_ERROR")}
    _ok(_run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(tmp / "dist"), "-q"], tmp, clean))
    (wheel,) = (tmp / "dist").glob("diloco_lightning-*.whl")
    _ok(_run([sys.executable, "-m", "venv", str(tmp / "venv")], tmp, clean))
    py = tmp / "venv" / "bin" / "python"
    site = Path(_ok(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, clean)).stdout.strip())
    (site / "_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    _ok(_run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp, clean))
    env = dict(clean, PATH=f"{tmp / 'venv' / 'bin'}{os.pathsep}{clean.get('PATH', '')}",
               DILOCO_CACHE_DIR=str(tmp / "cache"), DILOCO_CACHE=str(tmp / "hubcache"))
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return tmp / "venv" / "bin", env, elsewhere


def test_the_wheel_carries_the_package_configs_and_recipes(venv):
    bin_dir, env, cwd = venv
    out = _ok(_run([str(bin_dir / "python"), "-c", textwrap.dedent("""
        import diloco_lightning, diloco_lightning.app.config as c
        print(diloco_lightning.__file__); print(c.CONFIG_DIR); print(sorted(p.stem for p in c.RECIPE_DIR.glob('*.yaml')))
    """)], cwd, env)).stdout.splitlines()
    venv_root = str(bin_dir.parent)
    assert out[0].startswith(venv_root) and out[1].startswith(venv_root) and out[1].endswith("diloco_lightning/configs")
    assert "tiny" in out[2] and "llama7b_tau8" in out[2]


def test_diloco_master_from_a_foreign_folder(venv):
    bin_dir, env, cwd = venv
    help_text = _ok(_run([str(bin_dir / "diloco-master"), "--help"], cwd, env)).stdout
    assert "outer: adam, adam_decay, cgad" in help_text and "hub.url=???" in help_text and "model:" not in help_text
    # a hub with one worker's initial weights: the master adopts them and publishes outer step 0
    _ok(_run([str(bin_dir / "python"), "-c", textwrap.dedent("""
        import torch
        from diloco_lightning.hub import open_hub
        from diloco_lightning.wire.statefile import save_weights_file
        save_weights_file("init.safetensors", {"w": torch.ones(3, 2)})
        open_hub("hub").upload_init("init.safetensors", "w0")
    """)], cwd, env))
    proc = _ok(_run([str(bin_dir / "diloco-master"), "hub.url=hub", "max_seconds=3", "poll_interval=0.1"], cwd, env))
    assert "[master] outer_step 0" in proc.stdout and (cwd / "hub" / "global" / "manifest.json").is_file()
    # the export the master's last lines print, from the same foreign folder: the global as a plain file
    _ok(_run([str(bin_dir / "diloco-export"), "hub.url=hub", "out=final"], cwd, env))
    loaded = _ok(_run([str(bin_dir / "python"), "-c", "from safetensors.torch import load_file; "
                       "print(load_file('final/model.safetensors')['w'].tolist())"], cwd, env)).stdout
    assert loaded.strip() == "[[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]" and (cwd / "final" / "diloco_global.json").is_file()
    bad = _run([str(bin_dir / "diloco-master"), "hub.url=hubb"], cwd, env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 2 and "hub.create=true" in bad.stderr


def test_diloco_train_runs_a_recipe_from_a_foreign_folder(venv):
    bin_dir, env, cwd = venv
    assert "recipe: llama1b_tau0" in _ok(_run([str(bin_dir / "diloco-train"), "--help"], cwd, env)).stdout
    proc = _ok(_run([str(bin_dir / "diloco-train"), "recipe=tiny", "trainer.max_steps=16", "data.max_bytes=300000",
                     "data.seq_len=32", "data.vocab_size=512", "launch.eval_points=0"], cwd, env, timeout=600))
    results = list((cwd / "runs").rglob("results.json"))
    assert len(results) == 1 and "done in" in proc.stdout
    import json

    r = json.loads(results[0].read_text())
    assert r["recipe"] == "tiny" and r["outer_steps"] == 2 and r["deltas_accepted"] == 4
