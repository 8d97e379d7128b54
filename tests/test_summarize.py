"""The sweep summary: the single-shot risk explained, wall seconds without fake precision, and the
eval-loss figure (mean ± std band over seeds, linear axis) from real results.json files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from diloco_lightning.app.summarize import load_results, markdown_table, summarize


def _result(root: Path, seed: int, outer: str, final: float) -> None:
    run = root / f"outer={outer},seed={seed}"
    run.mkdir(parents=True)
    curve = [[0, 8.3], [2, 6.0 + 0.1 * seed], [4, final]]
    run.joinpath("results.json").write_text(json.dumps({
        "recipe": "tiny", "outer": outer, "tau": "0", "regime": "fixed", "precision": "32-true/adamw", "seed": seed,
        "eval_loss": final, "final_train_loss": final + 0.5, "diverged": False, "wall_seconds": 41.23456,
        "deltas_accepted": 8, "deltas_rejected": 0, "eval_curve": curve, "train_curve": [[1, 8.3], [32, 6.0]],
    }))


def test_summary_table_and_eval_band_figure(tmp_path):
    for seed, final in ((0, 5.0), (1, 5.2)):
        _result(tmp_path, seed, "cgad", final)
    _result(tmp_path, 0, "nesterov", 5.5)
    rows = summarize(load_results(tmp_path))
    cgad = next(r for r in rows if r["outer"] == "cgad")
    assert cgad["runs"] == 2 and abs(cgad["single_shot_risk"] - (5.1 + 0.1)) < 1e-9  # mean + std
    table = markdown_table(rows)
    assert "| cgad | 0 | fixed | 32-true/adamw | 2 | 5.1000 ± 0.1000 | 5.2000 |" in table
    assert table.rstrip().endswith("(lower is better; inf when a seed diverged).") and "single-shot risk = mean + std" in table
    assert "| 41 |" in table and "41.2346" not in table  # wall seconds: whole seconds
    proc = subprocess.run([sys.executable, "-m", "diloco_lightning.summarize", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "loss_tau0.png"
    assert png.stat().st_size > 5000


def test_the_figure_plots_eval_loss_with_a_seed_band_on_a_linear_axis(tmp_path):
    from diloco_lightning.app.summarize import _series, loss_figure

    for seed, final in ((0, 5.0), (1, 5.4)):
        _result(tmp_path, seed, "cgad", final)
    by_tau, kinds = _series(load_results(tmp_path))
    fig = loss_figure("0", by_tau["0"], kinds["0"])
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylabel() == "eval loss of the global model" and ax.get_xlabel() == "outer step"
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 2, 4] and abs(line.get_ydata()[-1] - 5.2) < 1e-9  # the mean over seeds
    (band,) = ax.collections  # the ± std band: 5.2 ± 0.2 at the last point
    ys = band.get_paths()[0].vertices[:, 1]
    assert abs(min(ys) - 5.0) < 1e-9 and any(abs(y - 5.4) < 1e-9 for y in ys)
