#!/bin/bash
# The adapters of adapters/qwen2.5-coder-1.5b-instruct in three regimes, beside the training-free methods and
# llama.cpp, on Qwen2.5-Coder-1.5B-Instruct Q4_K_M (GGUF blocks, 2 threads, greedy, the first question of 6 Spec-Bench
# categories): resident (48 new tokens), and each method in its own memory cgroup at 50 % and 25 % of the GGUF file
# + 384 MiB (4 questions x 32 new tokens: a streamed pass takes about half a second). Run alone.
#   bash benchmarks/qwen_adapters.sh [OUT]     (default docs/results/qwen-adapters)
set -euo pipefail
OUT=${1:-docs/results/qwen-adapters}
MODEL=$(../shared/tools/get-model qwen2.5-coder-1.5b-instruct | tail -1)
COMMON=(--model "$MODEL" --threads 2 --questions ../shared/data/spec_bench/question.jsonl --per-category 1
        --adapters adapters/qwen2.5-coder-1.5b-instruct --no-progress)
METHODS=ar,recycle,dytc-free,dytc,eagle3,cats-no-shallow,cats
cats bench "${COMMON[@]}" --limit 6 --max-new-tokens 48 --out "$OUT/resident" \
  --methods "$METHODS,pld,eagle,early-exit,llama-server,llama-server-ngram,llama-server-eagle3"
cats bench "${COMMON[@]}" --limit 4 --max-new-tokens 32 --methods "$METHODS,llama-server" \
  --memory-limit 50%+384MiB,25%+384MiB --out "$OUT/limits"
