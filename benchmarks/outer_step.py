"""Time one outer-optimizer step over a whole model, side by side with torch's fused optimizers.

Every optimizer of ``diloco_lightning.outer`` steps over the tensors of a Llama-shaped model
(tied embeddings, ~50k vocabulary) on CPU, interleaved with the nearest torch equivalent on the
same tensors: ``torch.optim.Adam(fused=True)`` for the Adam family (cgad, adam_decay, adam,
pa_cgad) and ``torch.optim.SGD(momentum=0.9, nesterov=True, fused=True)`` for the Nesterov family
(nesterov, poly_nesterov, delayed_nesterov). Reported: the median step time of each, their ratio,
and the achieved memory bandwidth (bytes the step reads and writes, FP32, divided by its time).

Usage::

    python benchmarks/outer_step.py                       # 25M and 200M, 11 repeats
    python benchmarks/outer_step.py --sizes 25M --repeats 21 --staleness 8
    python benchmarks/outer_step.py --state-dtype bfloat16 # bf16 global state (math in FP32)

Targets: cgad, adam_decay and adam within 1.15x of fused Adam; nesterov within 1.15x of fused
SGD; the others within 1.5x of their torch equivalent. ``delayed_nesterov`` is timed per arrival,
averaged over whole windows of ``buffer_size`` arrivals (the last one moves the momentum).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_lightning.outer import build_outer_optimizer

# name: (d_model, layers, ffn, vocab)
GEOMETRIES = {
    "25M": (320, 6, 864, 50304),
    "200M": (1024, 12, 2816, 50304),
    "1B": (2048, 22, 5632, 32000),  # TinyLlama-like (full-size KV); needs ~30 GB of memory
}

# optimizer -> (torch reference, FP32 tensors each step reads + writes, per parameter)
DN_BUFFER = 4
STREAMS = {
    "cgad": ("adam", 7),
    "adam_decay": ("adam", 7),
    "adam": ("adam", 7),
    "pa_cgad": ("adam", 7),
    "nesterov": ("sgd", 5),
    "poly_nesterov": ("sgd", 5),
    # inside a window: Q += g/N, state -= lr/N g (6); the window's last arrival: one fused call (5)
    "delayed_nesterov": ("sgd", ((DN_BUFFER - 1) * 6 + 5) / DN_BUFFER),
}
REFERENCE_STREAMS = {"adam": 7, "sgd": 5}
TARGETS = {"cgad": 1.15, "adam_decay": 1.15, "adam": 1.15, "nesterov": 1.15}


def llama_state(d_model: int, layers: int, ffn: int, vocab: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = {"model.embed_tokens.weight": (vocab, d_model)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (d_model, d_model)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, d_model)
        shapes[p + "mlp.up_proj.weight"] = (ffn, d_model)
        shapes[p + "mlp.down_proj.weight"] = (d_model, ffn)
        shapes[p + "input_layernorm.weight"] = (d_model,)
        shapes[p + "post_attention_layernorm.weight"] = (d_model,)
    shapes["model.norm.weight"] = (d_model,)
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).mul_(0.02).to(dtype) for k, s in shapes.items()}


def options_for(name: str, state: dict[str, torch.Tensor]) -> dict:
    if name in ("nesterov", "poly_nesterov"):
        return {"lr": 0.7, "momentum": 0.9}
    if name == "delayed_nesterov":
        return {"lr": 0.7, "momentum": 0.9, "buffer_size": DN_BUFFER}
    if name == "pa_cgad":  # two fragments: embeddings + even layers, odd layers + final norm
        even = [k for k in state if k.startswith("model.embed") or (".layers." in k and int(k.split(".")[2]) % 2 == 0)]
        odd = [k for k in state if k not in set(even)]
        return {"lr": 1e-4, "fragments": {"even": even, "odd": odd}}
    return {"lr": 1e-4}


def run_steps(opt, state: dict, delta: dict, staleness: float, count: int) -> None:
    for _ in range(count):
        opt.step(state, delta, staleness=staleness)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="25M,200M", help=f"comma-separated, from {list(GEOMETRIES)}")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per optimizer (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--staleness", type=float, default=4, help="staleness of every delta (gate < 1 at 4)")
    parser.add_argument("--optimizers", default="all", help="comma-separated registry names, or 'all'")
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    names = list(STREAMS) if args.optimizers == "all" else args.optimizers.split(",")
    dtype = getattr(torch, args.state_dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, state {args.state_dtype}, "
        f"staleness {args.staleness:g}, median of {args.repeats}"
    )
    if dtype != torch.float32:
        print(
            f"{args.state_dtype} state: converted to FP32 and back in cache-sized chunks each step; the torch "
            "references run on FP32 copies, GB/s counts FP32 streams, and the targets (FP32) do not apply"
        )
    for size in args.sizes.split(","):
        d_model, layers, ffn, vocab = GEOMETRIES[size]
        state = llama_state(d_model, layers, ffn, vocab, dtype)
        delta = {k: torch.randn(v.shape).mul_(1e-3).to(dtype) for k, v in state.items()}
        numel = sum(v.numel() for v in state.values())
        # torch references: FP32 parameters with grad = delta (shared storage when the state is FP32)
        params = [
            torch.nn.Parameter(v if dtype == torch.float32 else v.float(), requires_grad=True) for v in state.values()
        ]
        for p, g in zip(params, delta.values()):
            p.grad = g if dtype == torch.float32 else g.float()
        references = {
            "adam": torch.optim.Adam(params, lr=1e-4, fused=True),
            "sgd": torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True, fused=True),
        }
        for ref in references.values():
            for _ in range(args.warmup):
                ref.step()
        print(
            f"\n{size}: {numel / 1e6:.1f}M parameters in {len(state)} tensors "
            f"({numel * 4 / 1e9:.2f} GB per FP32 buffer)"
        )
        print(f"{'optimizer':<17} {'ms':>8} {'torch':>6} {'ms':>8} {'ratio':>6} {'GB/s':>6} {'torch GB/s':>10}  target")
        for name in names:
            ref_name, streams = STREAMS[name]
            reference = references[ref_name]
            opt = build_outer_optimizer(name, state, **options_for(name, state))
            per_call = DN_BUFFER if name == "delayed_nesterov" else 1
            ours = functools.partial(run_steps, opt, state, delta, args.staleness, per_call)
            for _ in range(args.warmup):
                ours()
            ours_t, ref_t = [], []
            for _ in range(args.repeats):  # interleaved, so load drift hits both alike
                ref_t.append(timed(reference.step))
                ours_t.append(timed(ours) / per_call)
            t_ours, t_ref = statistics.median(ours_t), statistics.median(ref_t)
            ratio = t_ours / t_ref
            target = TARGETS.get(name, 1.5)
            gbs = streams * numel * 4 / t_ours / 1e9
            ref_gbs = REFERENCE_STREAMS[ref_name] * numel * 4 / t_ref / 1e9
            if dtype == torch.float32:
                verdict = f"<= {target:.2f} {'ok' if ratio <= target else 'SLOW'}"
            else:  # torch's reference runs on FP32 tensors: no target for a converted state
                verdict = "-"
            print(
                f"{name:<17} {t_ours * 1e3:8.2f} {ref_name:>6} {t_ref * 1e3:8.2f} {ratio:6.2f} {gbs:6.1f} "
                f"{ref_gbs:10.1f}  {verdict}"
            )
            del opt
            gc.collect()
        del references, params, state, delta
        gc.collect()


if __name__ == "__main__":
    main()
