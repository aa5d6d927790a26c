"""Where a decode step's time goes, per decoder layer, and what the lean forward buys.

For each dtype and each k (tokens per forward) it times, on a cache pre-filled with ``--context`` tokens and
rolled back after every call (medians over ``--repeats``, all variants interleaved in the same process so
that ratios are comparable on a shared machine):

* ``hf``: the model's own ``forward`` with a transformers ``DynamicCache`` (what ``hf-ar`` pays per step, logits
  for the last position only),
* ``cats-dynamic``: `LayeredModel.forward_layers` + head over a `KVCache` whose layers are ``DynamicLayer``s
  (torch.cat per append),
* ``cats``: the same over the preallocated `KVCache` (``SlotLayer``s), each layer its module's own forward,
* ``cats-lean``: ``cats`` with the lean layer forward (`cats.model.kernels.layer_forward`, the default),
* ``cats-packed`` (``--pack``): ``cats`` with `cats.model.kernels.packing.pack_linears` (oneDNN-prepacked weights), and
  ``cats-lean-packed``: both (what ``--pack-weights`` runs),
* ``cats-compiled`` (``--compile``): ``cats`` with `cats.model.kernels.packing.compile_layers` (inductor; toggled on for
  its calls only).

Then a per-layer breakdown of one ``cats`` step, timed with forward hooks on the HF submodules (hooks add a few
microseconds per module; the breakdown shows shares, the step times above are hook-free), and the top aten
ops from the PyTorch profiler.

    PYTHONPATH=src python benchmarks/forward_profile.py --dtype bfloat16 float32 --k 1 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cats.paths import default_model
from cats.model import load_model


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def step_fns(model, context: torch.Tensor, k: int):
    """name -> a callable doing one k-token forward (+ the head on the positions a verifier needs) and rolling back."""
    ids = torch.randint(100, 40000, (k,), generator=torch.Generator().manual_seed(k))
    past = context.numel()
    fns = {}

    hf_cache = DynamicCache()
    model.hf_model(context[None], cache=hf_cache, use_cache=True, logits_to_keep=1)

    def hf():
        model.hf_model(ids[None], cache=hf_cache, use_cache=True, logits_to_keep=k)
        hf_cache.crop(-k)
    fns["hf"] = hf

    def ours(cache, lean=False):
        def step():
            model.lean = lean
            try:
                hidden = model.forward_layers(model.embed(ids), 0, model.num_layers, cache)
                model.head(hidden)
            finally:
                model.lean = False
            cache.crop(past)
        return step

    dynamic = model.new_cache()
    dynamic.hf_cache.layers = [DynamicLayer() for _ in range(model.num_layers)]
    model.forward_layers(model.embed(context), 0, model.num_layers, dynamic)
    fns["cats-dynamic"] = ours(dynamic)
    static = model.new_cache(capacity=past + 64)
    model.forward_layers(model.embed(context), 0, model.num_layers, static)
    fns["cats"] = ours(static)
    fns["cats-lean"] = ours(static, lean=True)
    return fns


def layer_breakdown(model, step, repeats: int) -> dict[str, float]:
    """Mean ms per layer and step spent in each HF submodule of the decoder layers (inclusive times; `rest` =
    what the parent spends outside its timed children)."""
    totals: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}
    handles = []
    for layer in model.layers[: model.num_layers]:
        for name, module in layer.named_modules():
            key = name or "layer"

            def pre(mod, *_):
                starts[id(mod)] = time.perf_counter()

            def post(mod, *_, key=key):
                totals[key] += time.perf_counter() - starts[id(mod)]

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    try:
        step()  # warm
        totals.clear()
        wall = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            wall += time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    scale = 1e3 / (repeats * model.num_layers)
    ms = {key: value * scale for key, value in totals.items()}
    attn = sum(ms.get(f"self_attn.{p}_proj", 0) for p in "qkvo")
    mlp = sum(ms.get(f"mlp.{p}_proj", 0) for p in ("gate", "up", "down"))
    return {
        "step (hooked, per layer)": wall * scale,
        "layer call": ms["layer"],
        "  input_layernorm": ms.get("input_layernorm", 0),
        "  self_attn": ms.get("self_attn", 0),
        "    q/k/v/o projections": attn,
        "    rotary + cache write + SDPA + reshapes": ms.get("self_attn", 0) - attn,
        "  post_attention_layernorm": ms.get("post_attention_layernorm", 0),
        "  mlp": ms.get("mlp", 0),
        "    gate/up/down projections": mlp,
        "    act_fn(gate) * up (elementwise)": ms.get("mlp", 0) - mlp,
        "  residual adds + layer glue": ms["layer"] - sum(ms.get(n, 0) for n in ("input_layernorm", "self_attn",
                                                                                 "post_attention_layernorm", "mlp")),
        "outside the layers (embed, masks, rotary, head, crop)": wall * scale - ms["layer"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the SmolLM2 GGUF in ../shared/data)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--k", nargs="+", type=int, default=[1, 16], help="tokens per forward")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before each forward")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--compile", action="store_true", help="also time cats.model.kernels.packing.compile_layers")
    parser.add_argument("--pack", action="store_true", help="also time cats.model.kernels.packing.pack_linears")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-layer breakdown and the profiler")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} context={args.context} repeats={args.repeats}")
    context = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    for dtype in args.dtype:
        model = load_model(args.model or default_model(), dtype=dtype)
        with torch.inference_mode():
            for k in args.k:
                fns = step_fns(model, context, k)
                if args.compile:
                    from cats.model.kernels.packing import compile_layers

                    state = compile_layers(model)["state"]
                    state["off"] = True

                    def toggled(step, on):
                        def run():
                            state["off"] = not on
                            try:
                                step()
                            finally:
                                state["off"] = True
                        return run

                    start = time.perf_counter()
                    toggled(fns["cats"], True)()
                    print(f"  {dtype} k={k}: first compiled call (compile or inductor-cache load) "
                          f"{time.perf_counter() - start:.1f} s")
                    fns["cats-compiled"] = toggled(fns["cats"], True)
                if args.pack:
                    from cats.model.kernels import packing as lean

                    outcome = lean.pack_linears(model)
                    if outcome["reason"]:
                        print(f"  {dtype}: not packing ({outcome['reason']})")
                    else:
                        lean.PACKING["off"] = True

                        def packed(step):
                            def run():
                                lean.PACKING["off"] = False
                                try:
                                    step()
                                finally:
                                    lean.PACKING["off"] = True
                            return run
                        fns["cats-packed"] = packed(fns["cats"])
                        fns["cats-lean-packed"] = packed(fns["cats-lean"])
                for fn in fns.values():
                    fn()  # warm
                times = {name: [] for name in fns}
                for _ in range(args.repeats):  # interleaved: each round times every variant once
                    for name, fn in fns.items():
                        times[name].append(median_ms(fn, 1))
                med = {name: statistics.median(t) for name, t in times.items()}
                line = "  ".join(f"{name} {ms:7.2f} ms" for name, ms in med.items())
                ratios = "  ".join(f"hf/{name} {med['hf'] / ms:4.2f}x" for name, ms in med.items() if name != "hf")
                print(f"{dtype} k={k:<3} {line}   ({ratios}; cats per layer {med['cats'] / model.num_layers:.3f} ms)")
                if not args.no_profile:
                    for name, ms in layer_breakdown(model, fns["cats"], max(5, args.repeats // 2)).items():
                        print(f"    {name:55s} {ms:7.3f} ms")
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(5):
                            fns["cats"]()
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
