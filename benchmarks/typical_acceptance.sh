#!/usr/bin/env bash
# Typical acceptance (Medusa's posterior threshold, the paper's "soft acceptance"; LOSSY, opt-in) against exact
# acceptance, SmolLM2-135M-Instruct on CPU (float32, 2 threads), MT-Bench first turns, 256 new tokens:
#
#   1. temperature 0: exact (= plain greedy) vs typical. Speedup and mean accepted tokens per method, and the drift:
#      prefix agreement and exact match with ar's greedy tokens.
#   2. sampled, temperature 0.7, per-turn seeds shared by all methods: exact vs typical. Speedup and mean accepted
#      (exact: the sampled-run figures of `cats bench --temperature`), and a quality proxy for the drift: the
#      target's mean log-likelihood per answer token and distinct bigrams (benchmarks/typical_report.py).
#
# Typical settings: TYPICAL_ARGS (default: the defaults, --typical-tau 0.09 --typical-alpha 0.3).
# Methods: METHODS (default ar,pld,early-exit,tree); with trained adapters add cats and pass --adapters DIR.
#
# Usage: benchmarks/typical_acceptance.sh [OUT_DIR] [extra cats bench arguments, e.g. --limit 8 for a dry run]
# (MODEL=... overrides the model; a dry run on the tiny stories model:
#  MODEL=../shared/data/stories260k-gguf/hf benchmarks/typical_acceptance.sh OUT --limit 2 --max-new-tokens 16 \
#      --prompt-format raw --threads 1)
# Writes OUT_DIR/<run>/ (cats bench outputs) and OUT_DIR/typical_acceptance.md (the combined table).
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${CATS_DATA:-../shared/data}
MODEL=${MODEL:-$DATA/smollm2-135m-instruct-gguf}
OUT=${1:-bench-out/typical}
shift || true
METHODS=${METHODS:-ar,pld,early-exit,tree}
TYPICAL_ARGS=${TYPICAL_ARGS:-}
COMMON=(--model "$MODEL" --dtype float32 --threads 2 --max-new-tokens 256 --methods "$METHODS"
        --questions "$DATA/mt_bench/question.jsonl")

runs=()
for temperature in 0 0.7; do
    sampling=(--temperature "$temperature")
    if [ "$temperature" != 0 ]; then sampling+=(--seed 0); fi
    for acceptance in exact typical; do
        extra=()
        # shellcheck disable=SC2206
        if [ "$acceptance" = typical ]; then extra=(--acceptance typical $TYPICAL_ARGS); fi
        run="$OUT/t$temperature-$acceptance"
        cats bench "${COMMON[@]}" "${sampling[@]}" "${extra[@]}" --out "$run" "$@"
        runs+=("$run")
    done
done
python benchmarks/typical_report.py "${runs[@]}" | tee "$OUT/typical_acceptance.md"
