"""Choose the draft layer L_d and the shallow-verifier layer L_sv by measurement: for each candidate layer, train an
adapter for the same short budget (same data, steps and settings) and measure

* held-out top-1 agreement with the target (and the sum min(p, q) overlap, E[accepted] of a gamma-6 chain);
* the cost of one draft step at that layer (layers [0, L) + the adapter + its lm_head rows, one token) relative to
  one full forward of the target, timed in the decoding dtype;
* as a filter behind the draft (shallow candidates): keep rate of the draft's right and wrong tokens.

Writes ``OUT/layers.json``, ``OUT/layers.md`` and ``OUT/layers.png``. Example (the run behind
adapters/smollm2-135m-instruct/README.md):

    python benchmarks/adapter_layers.py --data ~/.cache/cats/train-data/smollm2-sharegpt-t07 \
        --eval-data ~/.cache/cats/train-data/smollm2-mtbench-eval --layers 2,3,4,6,12,15,18 --steps 300 \
        --draft-vocab 8192 --out adapters/smollm2-135m-instruct/layer-choice
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import cats
from cats.model.adapter import load_adapter
from cats.train.folder import DataMix, TrainingData
from cats.train.trainer import TrainConfig, train_adapter

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@torch.inference_mode()
def step_cost(model, adapter, repeats: int = 60, marginal: bool = False) -> tuple[float, ...]:
    """Median seconds of one draft step (one token through [0, L) + adapter + head; a feature adapter: its fc,
    block and head on one [feature, token] input; an early-exit feature adapter: [0, L) and then that) and of one
    full forward; with ``marginal`` also of the adapter's part alone (block, norm and head rows on a ready state:
    what drafting adds to a step whose layers [0, L) the verification reuses)."""
    layer, kind = adapter.config.layer, adapter.config.input
    cache = model.new_cache(extra_layers=1)
    adapter.cache_layer = model.num_layers
    prompt = torch.randint(100, 10000, (64,))
    if kind == "hidden":
        hidden = model.forward_layers(model.embed(prompt), 0, layer, cache)
        adapter(hidden, cache)
        model.forward_layers(hidden, layer, model.num_layers, cache)
    else:  # the adapter's cache holds the prompt's entries, as after a catch-up
        states = model.forward_layers(model.embed(prompt), 0, layer, cache) if kind == "features+hidden" else None
        final = model.forward_layers(states if states is not None else model.embed(prompt),
                                     layer if states is not None else 0, model.num_layers, cache)
        normed = model.decoder.norm(final)[0]
        adapter(adapter.feature_inputs(normed, states[0] if states is not None else prompt)[None], cache)

    def draft_once(token):
        if kind == "features":
            return adapter.logits(adapter(adapter.feature_inputs(normed[-1:], token)[None], cache)[0]).argmax()
        h = model.forward_layers(model.embed(token), 0, layer, cache)
        if kind == "features+hidden":
            return adapter.logits(adapter(adapter.feature_inputs(normed[-1:], h[0])[None], cache)[0]).argmax()
        return adapter.logits(adapter(h, cache)[0]).argmax()

    def full_once(token):
        h = model.forward_layers(model.embed(token), 0, model.num_layers, cache)
        return model.head(h[0]).argmax()

    ready = model.forward_layers(model.embed(torch.tensor([99])), 0, layer, cache) if kind != "features" else None
    cache.crop(64)

    def adapter_once(token):
        if kind == "features":
            return draft_once(token)
        if kind == "features+hidden":
            return adapter.logits(adapter(adapter.feature_inputs(normed[-1:], ready[0])[None], cache)[0]).argmax()
        return adapter.logits(adapter(ready, cache)[0]).argmax()

    parts = [("draft", draft_once), ("full", full_once)] + ([("adapter", adapter_once)] if marginal else [])
    timings = {}
    for name, fn in parts:
        samples = []
        for i in range(repeats):
            start = time.perf_counter()
            fn(torch.tensor([100 + i]))
            samples.append(time.perf_counter() - start)
            cache.crop(64)  # keep the context fixed
        timings[name] = statistics.median(samples[5:])
    return (timings["draft"], timings["full"]) + ((timings["adapter"],) if marginal else ())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DATA / "smollm2-135m-instruct-gguf"))
    parser.add_argument("--data", type=Path, required=True, action="append", help="data folder (repeat to mix)")
    parser.add_argument("--eval-data", type=Path, required=True)
    parser.add_argument("--layers", default="2,3,4,6,12,15,18")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--block", choices=("decoder", "attention"), default="decoder",
                        help="adapter block: decoder (attention + MLP) or attention only")
    parser.add_argument("--decode-dtype", default="bfloat16",
                        help="dtype of the timed model (float32 runs a GGUF file on its own blocks)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "layers.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}  # resumable per layer
    train_model = cats.load_model(args.model, dtype="float32")
    decode_model = cats.load_model(args.model, dtype=args.decode_dtype)
    data = DataMix.open(args.data, model=train_model)
    eval_data = TrainingData.open(args.eval_data, model=train_model)
    for layer in [int(x) for x in args.layers.split(",")]:
        if str(layer) in results:
            continue
        folder = args.out / f"layer-{layer}"
        config = TrainConfig(role="draft", layer=layer, out=folder, max_steps=args.steps, draft_vocab=args.draft_vocab,
                             block=args.block, eval_every=0, checkpoint_every=0, progress=False)
        started = time.perf_counter()
        train_adapter(train_model, data, config, eval_data=eval_data)
        train_s = time.perf_counter() - started
        final = json.loads((folder / "config.json").read_text())["training"]["final_eval"]
        adapter = load_adapter(folder, decode_model, role="draft")
        draft_s, full_s = step_cost(decode_model, adapter)
        results[str(layer)] = {"agreement": final["agreement"], "overlap": final["overlap"],
                               "expected_accepted_gamma6": final["expected_accepted_gamma6"],
                               "train_s": round(train_s, 1), "draft_step_ms": round(draft_s * 1e3, 2),
                               "full_forward_ms": round(full_s * 1e3, 2), "cost_ratio": round(draft_s / full_s, 3)}
        print(f"layer {layer}: {results[str(layer)]}", flush=True)
        results_path.write_text(json.dumps(results, indent=2))
    write_report(results, args)
    return 0


def write_report(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(results, key=int)
    lines = [f"Each layer: an adapter ({args.block} block) trained for {args.steps} steps on the same data and "
             f"settings (draft vocabulary {args.draft_vocab}); agreement on the held-out set; step cost in {args.decode_dtype}, "
             f"{args.threads} threads, one token after a 64-token context.", "",
             "| layer | agreement | overlap | E[accepted] gamma 6 | draft step ms | full forward ms | cost ratio |",
             "|---|---|---|---|---|---|---|"]
    for layer in layers:
        r = results[layer]
        lines.append(f"| {layer} | {r['agreement']:.3f} | {r['overlap']:.3f} | {r['expected_accepted_gamma6']:.2f} | "
                     f"{r['draft_step_ms']} | {r['full_forward_ms']} | {r['cost_ratio']:.3f} |")
    (args.out / "layers.md").write_text("\n".join(lines) + "\n")
    figure, axes = plt.subplots(figsize=(6, 3.5))
    xs = [int(layer) for layer in layers]
    axes.plot(xs, [results[layer]["agreement"] for layer in layers], marker="o", label="held-out agreement")
    axes.plot(xs, [results[layer]["cost_ratio"] for layer in layers], marker="s", label="draft step / full forward")
    axes.set_xlabel("layer L (adapter reads the state after it)")
    axes.set_title(f"Adapter layer choice ({args.steps} training steps each)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.out / "layers.png", dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
