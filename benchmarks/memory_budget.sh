#!/usr/bin/env bash
# Tokens/s against the memory budget: SmolLM2-135M-Instruct, greedy, MT-Bench first turns, every method
# under the same budget in its own process (`cats bench --memory-budget`), for each budget in BUDGETS; then
# benchmarks/budget_plot.py draws tokens/s against the budget and writes the combined table.
#
# Usage: benchmarks/memory_budget.sh [OUT_DIR] [extra cats bench arguments]
#   BUDGETS (default "100% 75% 50% 30%"), METHODS (default ar,tree,cats,hf-offload), DTYPE (default float32),
#   KERNELS (default aten: the float path, streamed from a layer store; auto: the GGUF on its own blocks, streamed
#   from the file), ADAPTERS (default adapters/smollm2-135m-instruct), LIMIT (default 4 questions), TOKENS (default 64),
#   RUNTIME (default 420MiB): added to each budget, since a command-line budget is the whole process's memory and
#   the percentages are meant for the model's part (SmolLM2's runtime before loading measured about 420 MiB).
# Keep the machine otherwise idle while it runs: streamed reads and compute both need it.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${CATS_DATA:-../shared/data}
MODEL=${MODEL:-$DATA/smollm2-135m-instruct-gguf}
OUT=${1:-bench-out/memory-budget}
shift || true
BUDGETS=${BUDGETS:-"100% 75% 50% 30%"}
METHODS=${METHODS:-ar,tree,cats,hf-offload}
DTYPE=${DTYPE:-float32}
KERNELS=${KERNELS:-aten}
ADAPTERS=${ADAPTERS:-adapters/smollm2-135m-instruct}

runs=()
for budget in $BUDGETS; do
    run="$OUT/budget-${budget%\%}"
    cats bench --model "$MODEL" --dtype "$DTYPE" --kernels "$KERNELS" --threads 2 --max-new-tokens "${TOKENS:-64}" \
        --limit "${LIMIT:-4}" --methods "$METHODS" --adapters "$ADAPTERS" --memory-budget "$budget+${RUNTIME:-420MiB}" \
        --questions "$DATA/mt_bench/question.jsonl" --out "$run" "$@" || true  # a budget below a minimum: skipped
    runs+=("$run")
done
python benchmarks/budget_plot.py --out "$OUT" "${runs[@]}" | tee "$OUT/memory_budget.md"
