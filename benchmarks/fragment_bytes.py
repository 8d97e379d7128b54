"""Bytes of the largest single upload with Streaming DiLoCo fragments (issue 15).

For each model (``tiny``: the tiny recipe's 1.25M-parameter Llama, vocab 4096, tied 4096 x 128
embedding; ``llama25m``: 23.5M parameters, tied 50304 x 320 embedding) and ``F`` in 1, 2, 4
(``diloco_lightning/wire/fragments.py``: block i in fragment i mod F; a tensor without a block index
that has at least F rows and more than 1/(2F) of the model -- the tied embedding here -- split
into F row ranges, range p in fragment p; the other tensors placed largest first in the lightest
fragment), every fragment's delta file is written exactly as a worker writes
it (``deltafile.write_delta``, FP32 or ``--dtype``, with the worker's header: identity, tokens,
fingerprint, ``phases`` and the fragment entries) and measured on disk. Printed per F: the bytes of
each fragment's file, the largest one (a worker's peak upload: one every ``H/F`` inner steps), its
ratio to the whole-model delta (F=1), and the ideal 1/F.

Usage::

    python benchmarks/fragment_bytes.py                   # both models, FP32 deltas
    python benchmarks/fragment_bytes.py --models tiny --dtype bfloat16

The total bytes sent per ``H`` inner steps are the same for every F (each parameter is sent once
per H); only the peak changes. Without the row split a model whose tied embedding is a large
share of its parameters (68 % of llama25m) could not go below that share.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_lightning.wire.delta import model_fingerprint, synced_keys, write_delta  # noqa: E402
from diloco_lightning.wire.fragments import build_plan  # noqa: E402
from diloco_lightning.models.llama import Llama, llama_config  # noqa: E402
from diloco_lightning.worker.params import module_state  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def file_bytes(tmp: Path, state: dict[str, torch.Tensor], dtype: torch.dtype, fp: str, extra: dict) -> int:
    """The bytes of a delta of ``state``'s tensors (a fragment's: its pieces, by piece name)."""
    path = tmp / "delta_1.safetensors"
    tensors = {k: torch.zeros(v.shape, dtype=dtype) for k, v in state.items()}
    n = write_delta(path, tensors, node_id="w0", local_step=1, base_outer_step=0, num_tokens=123456,
                    model_fingerprint=fp, extra_metadata={"phases": "1", **extra})
    path.unlink()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "llama25m"])
    ap.add_argument("--fragments", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for preset in args.models:
            model = Llama(llama_config(preset), device="cpu")
            state = {k: v.detach() for k, v in module_state(model).items()}
            fp = model_fingerprint(state)
            n = sum(state[k].numel() for k in synced_keys(state))
            emb = max(state[k].numel() for k in synced_keys(state))
            print(f"\n{preset}: {n / 1e6:.2f}M synced parameters, largest tensor {emb / 1e6:.2f}M ({emb / n:.0%}); "
                  f"{args.dtype} deltas")
            print(f"{'F':>3} {'fragment files (MB)':<44} {'largest MB':>10} {'vs F=1':>7} {'ideal 1/F':>9}")
            full = None
            for f in args.fragments:
                plan = build_plan(f, state)
                if plan is None:
                    sizes = [file_bytes(tmp, {k: state[k] for k in synced_keys(state)}, dtype, fp, {})]
                else:
                    sizes = [file_bytes(tmp, plan.substate(name, state), dtype, fp,
                                        {"fragment": name, "fragments": str(f), "base_fragment_step": "0"})
                             for name in plan.names]
                full = full or max(sizes)
                shown = " ".join(f"{s / 1e6:.2f}" for s in sizes)
                print(f"{f:>3} {shown:<44} {max(sizes) / 1e6:>10.2f} {max(sizes) / full:>7.2f} {1 / f:>9.2f}")
            if f > 1 and plan is not None:
                big = max(plan.names, key=lambda name: plan.numel(name, state))
                print(f"    largest fragment at F={f}: {', '.join(k for k in plan.keys[big] if block_free(k))} + "
                      f"{sum(1 for k in plan.keys[big] if not block_free(k))} block tensors")


def block_free(key: str) -> bool:
    from diloco_lightning.wire.fragments import block_index

    return block_index(key) is None


if __name__ == "__main__":
    main()
