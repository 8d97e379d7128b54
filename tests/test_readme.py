"""The README's first two lines are the fresh-machine commands, and CI runs exactly the second."""

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


def test_ci_runs_exactly_the_readme_test_command():
    _, test = _readme_commands()
    ci = [l.strip() for l in ROOT.joinpath(".ci/run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert ci[-1] == test


def test_constraints_pin_cpu_torch():
    pins = [l for l in ROOT.joinpath("constraints-cpu.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert pins == ["torch==2.13.0"]
