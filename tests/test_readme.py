"""The README's first two lines are the fresh-machine commands, CI runs exactly the second, and the
README's complete Accelerate example runs as written."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    return [lines[0].strip(), lines[1].strip()]


def test_readme_starts_with_install_and_test_commands():
    install, test = _readme_commands()
    assert "constraints-cpu.txt" in install and "torch==2.13.0" in install
    assert install.endswith("python train.py recipe=tiny")
    assert test.startswith("python -m pytest")


def test_ci_runs_exactly_the_readme_test_command_and_the_slow_tests():
    _, test = _readme_commands()
    ci = [l.strip() for l in ROOT.joinpath(".ci/run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert test in ci
    # the slow tests (the wheel in a clean venv, the S3 kill -9 matrix, DDP) run after it, all of them
    assert ci.index("python -m pytest -q -m slow") > ci.index(test)


def test_constraints_pin_cpu_torch():
    pins = [l for l in ROOT.joinpath("constraints-cpu.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert pins == ["torch==2.13.0"]


def test_the_readme_says_how_to_install_without_cuda_torch():
    """A CPU machine installs torch's CPU build before ``pip install .`` or a wheel (the package asks for
    any torch: pip alone fetches the default build and its CUDA libraries)."""
    text = ROOT.joinpath("README.md").read_text()
    install = text.split("Not editing the code?", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in install.splitlines() if line.startswith("    pip install")]
    assert commands == [
        "pip install -c constraints-cpu.txt torch==2.13.0",
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install .",
        "pip install diloco_lightning-*.whl",
    ]
    assert "CUDA" in install


def test_the_readme_accelerate_example_runs(tmp_path):
    text = ROOT.joinpath("README.md").read_text()
    section = text.split("## Using it in a plain Accelerate loop", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "from accelerate import Accelerator" in code and "diloco.step()" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    tmp = tmp_path / "tmp"  # the example's temporary folders: none is left behind
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert not [p.name for p in tmp.iterdir() if not p.name.startswith(("torchinductor", "pymp"))], list(tmp.iterdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("loss ") and "deltas sent; the master published outer step" in last
    sent = int(last.split("; ")[1].split()[0])
    published = int(last.rsplit(" ", 1)[1])
    assert 1 <= sent <= 12 and 1 <= published <= sent  # 96 steps / H=8 = 12 phases, merged when uploads overlap
    assert "DiLoCo w0 | step 8 | sync 1 | outer_step 0" in proc.stderr  # a line per sync, with no logging set up
