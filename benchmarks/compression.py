"""Size, speed and error of every pseudo-gradient encoding (diloco_lightning.encoding).

For each model (``llama25m``: 23.5M parameters, d 320, 6 layers, ffn 864, tied 50304 x 320
embedding; ``tiny``: the tiny recipe's 1.25M-parameter model, d 128, 4 layers, ffn 344, vocab
4096) a pseudo-gradient ``anchor - local`` is made by a few real AdamW steps on a Zipf-distributed
token stream (rare tokens' embedding rows move little, as in real text), or with ``--delta
synthetic`` by Gaussian noise. Then, per encoding:

- bytes: the real delta file a worker writes (``compression.encode_delta`` + ``deltafile.write_delta``,
  with the header a worker puts there: identity, tokens, fingerprint, encoding), and its ratio to
  the FP32 file;
- encode GB/s (``encode``; ``+resid``: ``encode_with_residual`` into reused residual buffers;
  ``worker``: ``ErrorFeedback.encode(in_place=True)``, the uploader's whole step, residual added)
  and decode GB/s (``decode_add_`` into an FP32 sum, the master's path, and plain ``decode``),
  in FP32 bytes of the delta per second, median of ``--repeats`` runs, on one core (one torch
  thread; ``--threads`` to change it). Time is the thread's CPU time (``time.thread_time``): on a
  shared machine the wall clock also counts the other processes' turns on the core; ``--wall``
  measures wall-clock time instead;
- ``/goal``: the slowest of the four timed paths (encode, ``+resid``, ``worker``, ``dec_add``)
  over the 1 GB/s goal (>= 1: met);
- the relative error ``||delta - decode(encode(delta))|| / ||delta||`` over the whole state;
- on the 25M state, int4's worker step with ``delta += residual`` as a pass of its own (``int4
  apart``) and inside the encoder's pass (``int4 fused``, what ``ErrorFeedback`` does), alternated,
  with their ratio; then three bounds in the same units (:func:`bounds`): one read-and-write pass over
  the delta into a kept buffer (the core's memory bandwidth), the same into new memory (the page
  faults a fresh output pays), and the two ``torch.topk`` calls that ctopk's selection makes per
  chunk, alone.

Usage::

    python benchmarks/compression.py                        # both models, real deltas, 7 repeats
    python benchmarks/compression.py --models tiny --delta synthetic --repeats 3
    python benchmarks/compression.py --json runs/perf/compression_raw.json   # also the figures as JSON

Targets (bytes relative to FP32): int8 <= 0.27x, int4 <= 0.14x, topk 1 % with int4 values
<= 0.03x, ctopk 1-3 % with 2-bit values 50x to 100x smaller; every encoding's encode (all three
paths) and ``decode_add_`` >= 1 GB/s of FP32 input on one core on the 25M state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_lightning.encoding.feedback import ErrorFeedback, encode_delta
from diloco_lightning.wire.delta import model_fingerprint, write_delta
from diloco_lightning.encoding import EncodingSpec, decode, decode_add_, encode, encode_with_residual
from diloco_lightning.models.llama import Llama, llama_config

ENCODINGS = {
    "float32": EncodingSpec("float32"),
    "bfloat16": EncodingSpec("bfloat16"),
    "float16": EncodingSpec("float16"),
    "int8": EncodingSpec("int8"),
    "int4": EncodingSpec("int4"),
    "topk1%+int8": EncodingSpec("topk", topk=0.01, topk_values="int8"),
    "topk1%+int4": EncodingSpec("topk", topk=0.01, topk_values="int4"),
    "ctopk1%+int2": EncodingSpec("ctopk", topk=0.01, topk_values="int2"),
    "ctopk1.6%+int2": EncodingSpec("ctopk", chunk_k=64, topk_values="int2"),  # SparseLoCo's 64 of 4096
    "ctopk2%+int2": EncodingSpec("ctopk", topk=0.02, topk_values="int2"),
    "ctopk3%+int2": EncodingSpec("ctopk", topk=0.03, topk_values="int2"),
    "ctopk1.6%+sign": EncodingSpec("ctopk", chunk_k=64, topk_values="sign"),
    "ctopk1.6%+int8": EncodingSpec("ctopk", chunk_k=64, topk_values="int8"),
}
SIZE_TARGETS = {"int8": 0.27, "int4": 0.14, "topk1%+int4": 0.03, "ctopk1.6%+int2": 0.02, "ctopk1%+int2": 0.01}
SPEED_TARGET = 1.0  # GB/s of FP32 input on one core, every encoding's encode paths and decode_add_ (25M state)


def pseudo_gradient(preset: str, kind: str, steps: int) -> dict[str, torch.Tensor]:
    """``anchor - local`` after ``steps`` AdamW steps (lr 1e-3, wd 0.1), or Gaussian noise."""
    torch.manual_seed(0)
    model = Llama(llama_config(preset), device="cpu")
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    if kind == "synthetic":
        return {k: torch.randn(v.shape) * 1e-3 for k, v in anchor.items()}
    vocab = model.config.vocab_size
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(steps):
        tokens = torch.multinomial(zipf, 8 * 129, replacement=True).view(8, 129)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: anchor[k] - v.detach() for k, v in model.state_dict().items() if k in anchor}


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the 4-bit float grid (FP4), magnitudes


def e2m1_round_trip(t: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The alternative to int4 we did not take: FP4 (E2M1) codes, absmax -> 6, per block of 128."""
    flat = t.reshape(-1)
    v = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
    s = v.abs().amax(1, keepdim=True) / 6
    s[s == 0] = 1
    nearest = ((v / s).abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return (E2M1[nearest] * v.sign() * s).reshape(-1)[: flat.numel()].view(t.shape)


CLOCK = time.thread_time  # --wall: time.perf_counter


def timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(repeats))


def file_bytes(delta: dict[str, torch.Tensor], spec: EncodingSpec, folder: str) -> int:
    """The size of the delta file a worker writes for ``delta`` (header included)."""
    sent, _ = encode_delta(delta, spec, error_feedback=False)
    path = os.path.join(folder, "nodes", "w0", "delta_12.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return write_delta(path, sent, node_id="w0", local_step=12, base_outer_step=11, num_tokens=8 * 8 * 128,
                       model_fingerprint=model_fingerprint(delta), extra_metadata={"phases": "1"})


def bench_model(preset: str, args: argparse.Namespace) -> list[dict]:
    delta = pseudo_gradient(preset, args.delta, args.steps)
    numel = sum(t.numel() for t in delta.values())
    gb = numel * 4 / 1e9
    norm = torch.sqrt(sum(t.double().square().sum() for t in delta.values()))
    print(f"\n{preset}: {numel / 1e6:.2f}M parameters in {len(delta)} tensors, {args.delta} delta "
          f"(rms {norm.item() / numel**0.5:.2e})")
    print(f"{'encoding':<15} {'bytes':>11} {'vs fp32':>8} {'x fewer':>8} {'enc GB/s':>9} {'+resid':>7} {'worker':>7} "
          f"{'dec_add':>8} {'decode':>7} {'/goal':>6} {'rel err':>9}  target")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        fp32_bytes = file_bytes(delta, ENCODINGS["float32"], folder)
        for label, spec in ENCODINGS.items():
            size = fp32_bytes if label == "float32" else file_bytes(delta, spec, folder)
            encs = {k: encode(t, spec) for k, t in delta.items()}
            t_enc = median_time(lambda: [encode(t, spec) for t in delta.values()], args.repeats)
            residual = {k: torch.empty_like(t) for k, t in delta.items()}  # a worker's error-feedback buffers
            t_res = median_time(lambda: [encode_with_residual(t, spec, out=residual[k]) for k, t in delta.items()],
                                args.repeats)
            fb, work = ErrorFeedback(spec), {k: t.clone() for k, t in delta.items()}
            t_worker = median_time(lambda: fb.encode(work, in_place=True), args.repeats)
            sums = {k: torch.zeros_like(t) for k, t in delta.items()}
            t_add = median_time(lambda: [decode_add_(sums[k], e, 0.5) for k, e in encs.items()], args.repeats)
            t_dec = median_time(lambda: [decode(e) for e in encs.values()], args.repeats)
            err = torch.sqrt(sum((delta[k] - decode(e)).double().square().sum() for k, e in encs.items())) / norm
            ratio = size / fp32_bytes
            verdict = []
            slowest = min(gb / t_enc, gb / t_res, gb / t_worker, gb / t_add)
            if label in SIZE_TARGETS:
                verdict.append(f"size <= {SIZE_TARGETS[label]} {'ok' if ratio <= SIZE_TARGETS[label] else 'MISS'}")
            if preset == "llama25m" and label != "float32":  # float32 sends the tensors themselves: nothing to time
                verdict.append(f"GB/s >= {SPEED_TARGET:g} {'ok' if slowest >= SPEED_TARGET else 'MISS'}")
            print(f"{label:<15} {size:>11,} {ratio:>7.4f}x {1 / ratio:>7.1f}x {gb / t_enc:>9.2f} {gb / t_res:>7.2f} "
                  f"{gb / t_worker:>7.2f} {gb / t_add:>8.2f} {gb / t_dec:>7.2f} {slowest / SPEED_TARGET:>6.2f} "
                  f"{err.item():>9.2e}  {', '.join(verdict)}".rstrip())
            rows.append({"model": preset, "params": numel, "encoding": label, "bytes": size, "ratio": ratio,
                         "encode_gbs": gb / t_enc, "residual_gbs": gb / t_res, "worker_gbs": gb / t_worker,
                         "decode_add_gbs": gb / t_add, "decode_gbs": gb / t_dec, "rel_err": err.item()})
    if preset == "tiny":  # on the small model only: the FP4 reference is slow and memory-hungry
        err = torch.sqrt(sum((t - e2m1_round_trip(t)).double().square().sum() for t in delta.values())) / norm
        print(f"{'(fp4 e2m1)':<15} {'as int4':>11} {'':>8} {'':>8} {'':>9} {'':>7} {'':>7} {'':>8} {'':>7} {'':>6} {err.item():>9.2e}  "
              "the 4-bit float alternative to int4 (not implemented)")
    if preset == "llama25m":
        rows += bounds(delta, gb, args.repeats)
    return rows


def bounds(delta: dict[str, torch.Tensor], gb: float, repeats: int) -> list[dict]:
    """What bounds the encoders on this core, in the same GB/s of FP32 input, over the same tensors:
    one read-and-write pass (``torch.add`` into a kept buffer: the core's memory bandwidth), the
    same pass into new memory (``clone``: the page faults any new output pays), and the two
    ``torch.topk`` calls per 4096-value chunk that ctopk 64/4096's selection makes (on int32 keys
    of the shapes it uses: 512 block maxima, then 512 candidates)."""
    kept = {k: torch.empty_like(t) for k, t in delta.items()}
    t_add = median_time(lambda: [torch.add(t, t, out=kept[k]) for k, t in delta.items()], repeats)
    t_new = median_time(lambda: [t.clone() for t in delta.values()], repeats)
    rows = sum(t.numel() for t in delta.values()) // 4096
    keys = torch.randint(0, 1 << 30, (rows, 512), dtype=torch.int32)
    t_topk = median_time(lambda: [torch.topk(keys, 65, dim=1, sorted=False) for _ in range(2)], repeats)
    # the worker's int4 step with delta += residual as a pass of its own, and inside the encoder's pass
    # (encode_with_residual(add=)): alternated, so both see the same load
    spec, res = EncodingSpec("int4"), {k: torch.zeros_like(t) for k, t in delta.items()}
    work = {k: t.clone() for k, t in delta.items()}
    apart, fused = [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up
        apart.append(timed(lambda: [encode_with_residual(work[k].add_(res[k]), spec, out=res[k]) for k in work]))
        fused.append(timed(lambda: [encode_with_residual(work[k], spec, out=res[k], add=res[k]) for k in work]))
    t_apart, t_fused = statistics.median(apart[1:]), statistics.median(fused[1:])
    out = []
    for label, t, what in (("(int4 apart)", t_apart, "int4's worker step, delta += residual in a pass of its own"),
                           ("(int4 fused)", t_fused, f"the same, added in the encoder's pass: {t_apart / t_fused:.2f}x"),
                           ("(one pass)", t_add, "torch.add into a kept buffer: one core's read+write bandwidth"),
                           ("(new memory)", t_new, "clone: the same pass into new pages (an encoder's fresh output)"),
                           ("(ctopk topk)", t_topk, "ctopk 64/4096's two torch.topk calls alone (the selection's floor)")):
        print(f"{label:<15} {'':>11} {'':>8} {'':>8} {gb / t:>9.2f} {'':>7} {'':>7} {'':>8} {'':>7} {gb / t / SPEED_TARGET:>6.2f} "
              f"{'':>9}  {what}")
        out.append({"bound": label.strip("()"), "gbs": gb / t})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama25m,tiny", help="comma-separated model presets")
    parser.add_argument("--delta", default="real", choices=["real", "synthetic"])
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps that make a real delta")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per figure (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: one core)")
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of the thread's CPU time")
    parser.add_argument("--encodings", default=None, help=f"comma-separated subset of {','.join(ENCODINGS)}".replace("%", "%%"))
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    global CLOCK
    if args.wall or args.threads != 1:  # the CPU time of several threads is not a duration
        CLOCK = time.perf_counter
    torch.set_num_threads(args.threads)
    if args.encodings:
        for name in [n for n in ENCODINGS if n not in args.encodings.split(",") and n != "float32"]:
            del ENCODINGS[name]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}, "
          f"{'wall-clock' if CLOCK is time.perf_counter else 'thread CPU'} time; GB/s = FP32 bytes of the delta per second")
    rows = []
    load = os.getloadavg()[0]
    for preset in args.models.split(","):
        rows += bench_model(preset, args)
    print(f"# load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "clock": "wall" if CLOCK is time.perf_counter else "thread",
                                               "repeats": args.repeats, "delta": args.delta, "rows": rows,
                                               "load_before": load, "load_after": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
