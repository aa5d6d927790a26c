#!/usr/bin/env bash
# First use of every method on the default model, from an empty cache: the wall time of
# `cats generate --max-new-tokens 1` (load, any conversion, calibration or kernel build, prefill, first token).
# The first run (ar) also reads the GGUF file's metadata and compiles the kernels; the others find both cached, as
# a user's second command would. Prints one "method seconds" line each and writes them to OUT (default bench-out/first-use.txt).
#
# Usage: benchmarks/first_use.sh [OUT] ; METHODS (default: every method), ADAPTERS (for the adapter methods).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench-out/first-use.txt}
METHODS=${METHODS:-"ar pld recycle layer-skip dytc early-exit eagle tree cats-no-shallow cats"}
ADAPTERS=${ADAPTERS:-adapters/smollm2-135m-instruct}
export CATS_CACHE
CATS_CACHE=$(mktemp -d)
trap 'rm -rf "$CATS_CACHE"' EXIT
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for method in $METHODS; do
    adapters=()
    case $method in early-exit|eagle|tree|cats|cats-no-shallow) adapters=(--adapters "$ADAPTERS") ;; esac
    if [ "$method" = cats-no-shallow ]; then method_args=(--method cats --no-shallow); else method_args=(--method "$method"); fi
    start=$(date +%s.%N)
    cats generate --threads 2 --chat --prompt "What is the capital of France?" "${method_args[@]}" "${adapters[@]}" \
        --max-new-tokens 1 > /dev/null
    end=$(date +%s.%N)
    printf '%s %.1f\n' "$method" "$(echo "$end - $start" | bc)" | tee -a "$OUT"
done
