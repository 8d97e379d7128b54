"""The examples in docs/examples/ run as docs/plugin.md says (issue 41: the plugin user's whole journey)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
JOURNEY = ROOT / "docs" / "examples" / "char_gpt_journey.py"
TINY = ["--steps=16", "--inner-steps=4", "--d-model=32", "--layers=1", "--seq=32", "--batch-size=8",
        "--max-bytes=200000", "--poll-interval=0.05", "--master-wait=60"]


def load_example():
    spec = importlib.util.spec_from_file_location("char_gpt_journey", JOURNEY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_char_gpt_has_about_255k_parameters():
    ex = load_example()
    n = sum(p.numel() for p in ex.CharGPT().parameters())
    assert 230_000 < n < 260_000, n


@pytest.mark.slow  # three Python processes that import torch and Lightning: about 30 s on 2 shared cores
def test_the_char_gpt_journey_runs_as_documented(tmp_path):
    out = tmp_path / "journey"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(JOURNEY), f"--out={out}", *TINY], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    text = done.stdout
    assert done.returncode == 0, text + done.stderr
    # everything ended by itself: both workers, then the master (until_finished), saying where the model is
    assert "w0: exited with status 0" in text and "w1: exited with status 0" in text
    assert "master: exited by itself with status 0" in text
    assert "every worker finished and its last delta is applied: w0 (last delta 4), w1 (last delta 4)" in text
    assert "diloco-export: wrote" in text

    # the exported file loads into the example's own module, with nothing missing or left over
    ex = load_example()
    exported = load_file(str(out / "final_model" / "model.safetensors"))
    module = ex.CharGPT(d_model=32, layers=1, seq=32)
    assert module.load_state_dict(exported) is not None
    assert set(exported) == set(module.state_dict())

    # it learnt something: the printed held-out loss is finite and below chance (ln 256 nats per byte)
    loss = float(re.search(r"held-out loss of the exported global model: ([0-9.]+)", text).group(1))
    assert math.isfinite(loss) and loss < math.log(256) - 0.5, loss

    # after fit each worker's module holds a global version bit for bit (the one with its last delta);
    # the worker whose last delta came last holds the exported (final) one
    finals = []
    for node in ("w0", "w1"):
        state = load_file(str(out / "workers" / f"{node}.safetensors"))
        assert state.keys() == exported.keys()
        line = re.search(rf"{node}'s module after fit: held-out loss ([0-9.]+), bit for bit (.*)", text)
        assert line, text
        if line.group(2).startswith("the exported global model"):
            finals.append(node)
            for k in state:
                assert torch.equal(state[k], exported[k]), (node, k)
        else:
            assert line.group(2).startswith("global version "), line.group(0)
    assert finals, text


def test_plugin_md_says_how_to_choose_inner_steps_and_how_many_workers_end_the_run():
    """Issue 41's last two points for a plugin user: advice on ``inner_steps``, and a master that knows
    how many workers make the run (``diloco-master expected_nodes=2 until_finished=true``)."""
    from diloco_lightning.master.config import MasterConfig
    from diloco_lightning.util.options import OptionError

    text = (ROOT / "docs" / "plugin.md").read_text()
    assert "## Choosing inner_steps" in text and "expected_nodes=" in text
    assert MasterConfig(until_finished=True, expected_nodes=2).validate().expected_nodes == 2
    with pytest.raises(OptionError, match="expected_nodes"):
        MasterConfig(expected_nodes=0).validate()
