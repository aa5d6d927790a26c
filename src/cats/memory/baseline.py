"""The runtime baseline, measured in a fresh process: ``python -m cats.memory.baseline MODEL [THREADS]`` prints
``{"peak_rss_mb", "rss_mb"}`` after importing torch, transformers and CATS, reading the tokenizer, building the
weightless model skeleton and running one small matrix product and attention call (see `cats.memory.rss`)."""

from __future__ import annotations

import json
import sys

from cats.memory.rss import MIB, current_rss_bytes, peak_rss_bytes


def measure_baseline(model: str, threads: int | None = None) -> dict:
    import torch
    import transformers  # noqa: F401
    from transformers import AutoConfig

    import cats  # noqa: F401
    from cats.memory.offload import build_skeleton
    from cats.model.load import _local_folder, load_tokenizer

    folder = _local_folder(model)
    load_tokenizer(model)
    build_skeleton(AutoConfig.from_pretrained(folder), torch.float32)
    if threads:
        torch.set_num_threads(threads)
    x = torch.randn(1, 4, 64, 64)
    torch.nn.functional.linear(x, torch.randn(64, 64))
    torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=torch.zeros(64, 64))
    return {"peak_rss_mb": round(peak_rss_bytes() / MIB, 1), "rss_mb": round(current_rss_bytes() / MIB, 1)}


if __name__ == "__main__":
    print(json.dumps(measure_baseline(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)))
