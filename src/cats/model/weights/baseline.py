"""The runtime baseline, measured in a fresh process: ``python -m cats.model.weights.baseline MODEL [THREADS]`` prints
``{"peak_rss_mb", "rss_mb", "anonymous_mb"}`` after importing torch, transformers and CATS, reading the tokenizer, building the
weightless model skeleton (a GGUF file's as its blocks run: `cats.model.decoder.skeleton`) and running one small
matrix product and attention call (see `cats.model.weights.rss`)."""

from __future__ import annotations

import json
import sys

import torch
import transformers  # noqa: F401  (imported as every run imports it: part of the baseline)
from transformers import AutoConfig

from cats.model.decoder import skeleton
from cats.model.source import config_folder, gguf_file, load_tokenizer
from cats.model.weights.offload import build_skeleton
from cats.model.weights.rss import MIB, anonymous_rss_bytes, current_rss_bytes, peak_rss_bytes, return_freed_memory


def measure_baseline(model: str, threads: int | None = None) -> dict:
    folder = config_folder(model)  # a GGUF file's metadata folder: no weights converted
    load_tokenizer(model)
    config = AutoConfig.from_pretrained(folder)
    if gguf_file(model) is not None:
        skeleton(config)
    else:
        build_skeleton(config, torch.float32)
    if threads:
        torch.set_num_threads(threads)
    x = torch.randn(1, 4, 64, 64)
    torch.nn.functional.linear(x, torch.randn(64, 64))
    torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=torch.zeros(64, 64))
    return_freed_memory()  # as `cats.api.prepare` does before it measures the runtime
    return {"peak_rss_mb": round(peak_rss_bytes() / MIB, 1), "rss_mb": round(current_rss_bytes() / MIB, 1),
            "anonymous_mb": round(anonymous_rss_bytes() / MIB, 1)}


if __name__ == "__main__":
    print(json.dumps(measure_baseline(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)))
