#!/usr/bin/env bash
# DyTC against the best single training-free drafter and plain decoding on Spec-Bench's six
# categories (mt_bench, translation, summarization, qa, math_reasoning, rag), SmolLM2-135M-Instruct, bf16, greedy.
#   run 1 (training-free): ar, pld, layer-skip, dytc (prompt lookup + layer-skip cascades)
#   run 2 (with the trained adapters): ar, cats, dytc (the draft adapter joins its drafters)
# Questions: the first PER (default 2) of each of the five Spec-Bench task categories, and the first question of PER
# MT-Bench categories (writing, roleplay, ...) relabelled "mt_bench" (Spec-Bench's own name for that part).
# Needs a calibrated skip set first: cats calibrate --dtype bfloat16
# Usage: benchmarks/dytc_specbench.sh [OUT_DIR] [extra cats bench arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${CATS_DATA:-../shared/data}
MODEL=${MODEL:-$DATA/smollm2-135m-instruct-gguf}
OUT=${1:-bench-out/dytc}
shift || true
PER=${PER:-2}
mkdir -p "$OUT"
python - "$DATA/spec_bench/question.jsonl" "$OUT/questions.jsonl" "$PER" <<'PY'
import json, sys
source, target, per = sys.argv[1], sys.argv[2], int(sys.argv[3])
tasks = ("translation", "summarization", "qa", "math_reasoning", "rag")
seen, mt_bench, chosen = {}, set(), []
for line in open(source):
    question = json.loads(line)
    category = question["category"]
    if category in tasks:
        if seen.get(category, 0) < per:
            seen[category] = seen.get(category, 0) + 1
            chosen.append(question)
    elif category not in mt_bench and len(mt_bench) < per:
        mt_bench.add(category)
        chosen.append({**question, "category": "mt_bench"})
with open(target, "w") as out:
    for question in chosen:
        out.write(json.dumps(question) + "\n")
print(f"{len(chosen)} questions -> {target}")
PY
COMMON=(--model "$MODEL" --dtype bfloat16 --threads 2 --max-new-tokens "${TOKENS:-96}" --questions "$OUT/questions.jsonl")
cats bench "${COMMON[@]}" --methods ar,pld,layer-skip,dytc --out "$OUT/training-free" "$@"
cats bench "${COMMON[@]}" --methods ar,cats,dytc --adapters adapters/smollm2-135m-instruct --out "$OUT/adapters" "$@"
