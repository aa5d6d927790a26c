"""The AVX-512 kernels of `cats.model.kernels.avx512` against what they replace, in one process, interleaved round by round:

1. linears: all of the model's projections (one call per linear, as a forward makes them) on oneDNN's prepacked
   weights against the kernels' panels, for several row counts;
2. attention: packed SDPA (the lean forward's few-query path) against the kernel, for several query and key counts;
3. whole forwards of the packed model with the kernels off (oneDNN + SDPA), the linear kernels only, both, and
   the whole-layer kernel (`avx512.layer`: each decoder layer in one call).

    python benchmarks/avx512_kernels.py [--model M] [--dtype bfloat16] [--threads 2]

Medians in ms (attention: µs per layer call). Run it alone on the machine: ratios within one run are what to compare.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from cats.paths import default_model
from cats.model import load_model
from cats.model.kernels import avx512
from cats.model.kernels import packing as lean


def interleaved(candidates: dict, rounds: int) -> dict:
    """Median seconds of each callable, timed round by round in turn."""
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, function in candidates.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values[1:] if len(values) > 2 else values) for name, values in samples.items()}


def linears(model, rows_list, rounds: int) -> None:
    weights = [module.weight.detach() for layer in model.layers[: model.num_layers] for module in layer.modules()
               if isinstance(module, torch.nn.Linear)] + [model.hf_model.lm_head.weight.detach()]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(weight, 1) for weight in weights]
    panels = [avx512.pack(weight) for weight in weights]
    print(f"\n### Linears: all {len(weights)} projections of the model, ms\n")
    print("| rows | oneDNN | kernels | oneDNN / kernels |\n|---|---|---|---|")
    for rows in rows_list:
        inputs = {size: torch.randn(rows, size).to(model.dtype) for size in {w.shape[1] for w in weights}}

        def with_onednn():
            for weight, packed in zip(weights, onednn):
                torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], packed, None, "none", [], "")

        def with_kernels():
            for weight, packed in zip(weights, panels):
                avx512.linear(inputs[weight.shape[1]], packed, weight.shape[0])

        times = interleaved({"onednn": with_onednn, "kernels": with_kernels}, rounds)
        print(f"| {rows} | {times['onednn'] * 1e3:.2f} | {times['kernels'] * 1e3:.2f} | "
              f"{times['onednn'] / times['kernels']:.2f} |")


def attention(model, keys_list, queries_list, rounds: int) -> None:
    config = model.hf_model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups, dtype = heads // kv_heads, model.dtype
    print(f"\n### Attention: {heads} query / {kv_heads} KV heads of {dim}, µs per layer call\n")
    print("| keys | queries | packed SDPA | kernel | SDPA / kernel |\n|---|---|---|---|---|")
    for past in keys_list:
        for queries in queries_list:
            keys = past + queries
            key, value = (torch.randn(1, kv_heads, keys, dim).to(dtype) for _ in range(2))
            query = torch.randn(1, heads, queries, dim).to(dtype)
            visible = torch.ones(queries, keys, dtype=torch.bool).tril(past)
            mask = torch.zeros(queries, keys).masked_fill(~visible, torch.finfo(dtype).min)
            grouped = mask.to(dtype)[None, None, None].expand(1, 1, groups, queries, keys).reshape(1, 1, -1, keys)
            sdpa_mask = grouped if queries > 1 else None
            kernel_mask = mask if queries > 1 else None
            times = interleaved({
                "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                    query.reshape(1, kv_heads, groups * queries, dim), key, value, attn_mask=sdpa_mask,
                    scale=dim ** -0.5),
                "kernel": lambda: avx512.attention(query, key, value, kernel_mask, dim ** -0.5)}, rounds * 4)
            print(f"| {past} | {queries} | {times['sdpa'] * 1e6:.1f} | {times['kernel'] * 1e6:.1f} | "
                  f"{times['sdpa'] / times['kernel']:.2f} |")


def forwards(model, context: int, tokens_list, rounds: int) -> None:
    usable, fusable = avx512.attention_usable, list(model._fused_layers)
    never = [False] * len(fusable)
    states = {
        "kernels off": (True, lambda *args: False, never),
        "linear kernels": (False, lambda *args: False, never),
        "linear + attention kernels": (False, usable, never),
        "whole-layer kernel": (False, usable, fusable),
    }
    print(f"\n### Whole forwards, packed model, {context} cached tokens, ms\n")
    print("| tokens | " + " | ".join(states) + " |\n|---|" + "---|" * len(states))
    with torch.inference_mode():
        cache = model.new_cache(capacity=context + max(tokens_list) + 8)
        model.forward(torch.arange(context) % 1000 + 5, cache)
        for tokens in tokens_list:
            ids = torch.arange(tokens) + 100

            def run(state):
                def forward():
                    avx512.KERNELS["off"], avx512.attention_usable, model._fused_layers = state
                    model.forward(ids, cache)
                    cache.crop(context)
                return forward

            try:
                times = interleaved({name: run(state) for name, state in states.items()}, rounds)
            finally:
                avx512.KERNELS["off"], avx512.attention_usable, model._fused_layers = False, usable, fusable
            print(f"| {tokens} | " + " | ".join(f"{times[name] * 1e3:.2f}" for name in states) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reason = avx512.unavailable(getattr(torch, args.dtype))
    if reason is not None:
        print(f"the AVX-512 kernels cannot run here: {reason}")
        return 1
    model = load_model(args.model or default_model(), dtype=args.dtype)
    print(f"{args.dtype}, {args.threads} threads")
    linears(model, [1, 4, 8, 16, 32, 64], args.rounds)
    attention(model, [300, 1000, 2000], [1, 4, 8, 16, 32], args.rounds)
    lean.pack_linears(model)
    forwards(model, 300, [1, 4, 8, 16, 32], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
