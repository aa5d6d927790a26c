#!/usr/bin/env bash
# CATS on GGUF blocks against llama.cpp's llama-server on the same files, same run, 2 threads, greedy: SmolLM2-135M
# (the default model, with transformers' hf-ar) on MT-Bench, and Qwen2.5-Coder-1.5B Q4_K_M (fetched once by
# ../shared/tools/get-model) on Spec-Bench, the first question of each of its 13 categories; then the figure.
#   benchmarks/gguf_vs_llama_server.sh docs/results      # writes gguf-smollm2-mtbench/, gguf-qwen-specbench/, the PNG
set -euo pipefail
out=${1:-bench-out}
shared=${CATS_SHARED:-../shared}
qwen=$("$shared/tools/get-model" qwen2.5-coder-1.5b-instruct | tail -1)
cats bench --model "$shared/data/smollm2-135m-instruct-gguf" --threads 2 --max-new-tokens 96 --per-category 1 \
  --methods ar,hf-ar,pld,recycle,dytc,llama-server,llama-server-ngram --questions "$shared/data/mt_bench/question.jsonl" \
  --out "$out/gguf-smollm2-mtbench" --no-progress
cats bench --model "$qwen" --threads 2 --max-new-tokens 96 --per-category 1 \
  --methods ar,pld,recycle,dytc,llama-server,llama-server-ngram --questions "$shared/data/spec_bench/question.jsonl" \
  --out "$out/gguf-qwen-specbench" --no-progress
python benchmarks/gguf_plot.py --out "$out/gguf-tokens-per-s.png" \
  "SmolLM2-135M Q4_1 (MT-Bench)=$out/gguf-smollm2-mtbench/summary.json" \
  "Qwen2.5-Coder-1.5B Q4_K_M (Spec-Bench)=$out/gguf-qwen-specbench/summary.json"
