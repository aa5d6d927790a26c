#!/bin/bash
# Feature drafting (eagle) under a memory budget: every pass streams the layers that do not fit once, and drafting
# reads none of them. float32 (the float path, --kernels aten), 3 MT-Bench questions x 48 new tokens, 2 threads, each method in its own process under
# the budget (as benchmarks/memory_budget.sh). Run alone.
#   bash benchmarks/eagle_budget.sh [BUDGET] [OUT]   (BUDGET is the model's part; RUNTIME, default 420MiB, is added:
#   a command-line budget is the whole process's memory)
set -euo pipefail
B=${1:-50%}
OUT=${2:-bench-out/smollm2-135m-float32-budget-${B%\%}-eagle}
cats bench --model ../shared/data/smollm2-135m-instruct-gguf --dtype float32 --kernels aten --threads 2 --max-new-tokens 48 \
    --limit 3 --methods ar,tree,eagle,hf-offload --adapters adapters/smollm2-135m-instruct --memory-budget "$B+${RUNTIME:-420MiB}" \
    --questions ../shared/data/mt_bench/question.jsonl --out "$OUT"
