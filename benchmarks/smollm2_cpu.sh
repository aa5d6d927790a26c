#!/usr/bin/env bash
# The runs behind docs/benchmarks.md: SmolLM2-135M-Instruct on CPU, 2 threads, bfloat16 and float32, greedy,
# 256 new tokens, first turn of each question, chat template applied, on
#   * MT-Bench: all 80 questions (8 categories x 10);
#   * Spec-Bench: a stratified subset, the first 5 questions of each of its 13 categories in file order
#     (8 MT-Bench categories + translation, summarization, qa, math_reasoning, rag): 65 of 480.
# llama-cpp / llama-cpp-pld run only when the optional extra is installed (pip install -e '.[baselines]');
# otherwise they are skipped and the summary and report say so.
#
# Usage: benchmarks/smollm2_cpu.sh [OUT_DIR] [extra cats bench arguments, e.g. --limit 2 for a dry run]
# Expect several hours per dtype on a 2-core machine; keep the machine otherwise idle while it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${CATS_DATA:-../shared/data}
MODEL=$DATA/smollm2-135m-instruct-gguf
OUT=${1:-bench-out}
shift || true
METHODS=ar,hf-ar,hf-pld,hf-early-exit,pld,early-exit,llama-cpp,llama-cpp-pld

for dtype in bfloat16 float32; do
    cats bench --model "$MODEL" --dtype "$dtype" --threads 2 --max-new-tokens 256 --methods "$METHODS" \
        --questions "$DATA/mt_bench/question.jsonl" \
        --out "$OUT/smollm2-135m-$dtype-mt_bench" "$@"
    cats bench --model "$MODEL" --dtype "$dtype" --threads 2 --max-new-tokens 256 --methods "$METHODS" \
        --questions "$DATA/spec_bench/question.jsonl" --per-category 5 \
        --out "$OUT/smollm2-135m-$dtype-spec_bench" "$@"
done
