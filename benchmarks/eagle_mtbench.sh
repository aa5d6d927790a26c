#!/bin/bash
# Feature drafting (method eagle) against ar, pld, the early-exit draft adapter and its trees, and dytc, on MT-Bench
# (the first question of each category, 96 new tokens, bfloat16, 2 threads). Run alone: timings share nothing.
#   bash benchmarks/eagle_mtbench.sh [OUT_PREFIX]
set -euo pipefail
OUT=${1:-bench-out/smollm2-135m-bfloat16-mt_bench-pc1-96-eagle}
COMMON=(--model ../shared/data/smollm2-135m-instruct-gguf --dtype bfloat16 --threads 2 --max-new-tokens 96
        --adapters adapters/smollm2-135m-instruct --questions ../shared/data/mt_bench/question.jsonl --per-category 1)
# trees: 4/16/5 for tree (early-exit draft adapter) and eagle
cats bench "${COMMON[@]}" --methods ar,pld,early-exit,tree,eagle,dytc --out "$OUT"
# eagle chains: depth 3 (a chain of 3 tokens per step)
cats bench "${COMMON[@]}" --methods ar,eagle --tree-topk 1 --depth 3 --out "$OUT-chain3"
