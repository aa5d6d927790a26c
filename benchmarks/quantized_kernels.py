"""The linears on GGUF blocks (`cats.model.kernels.quantized`): milliseconds per call by tokens per call, for the
shapes of Qwen2.5-Coder-1.5B Q4_K_M (an MLP up-projection, its down-projection, the lm_head) and SmolLM2-135M Q4_1,
fastest of repeated calls, and the weight bytes streamed per second at one token.

    python benchmarks/quantized_kernels.py --threads 2 --isa avx512 amx avx2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from cats.model.kernels import quantized

SHAPES = [("Q4_K", 8960, 1536, "Qwen 1.5B gate/up"), ("Q4_K", 1536, 8960, "Qwen 1.5B down"),
          ("Q6_K", 1536, 8960, "Qwen 1.5B down"),
          ("Q6_K", 151936, 1536, "Qwen 1.5B lm_head"), ("Q4_1", 1536, 576, "SmolLM2 gate/up"),
          ("Q8_0", 49152, 576, "SmolLM2 lm_head")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", nargs="+", default=list(quantized.ISAS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    for isa in args.isa:
        quantized.use(isa)
        print(f"## {isa}, {args.threads} threads\n")
        print("| shape | type | " + " | ".join(f"{m} tok ms" for m in args.tokens) + " | GB/s at 1 |")
        print("|---|---|" + "---|" * (len(args.tokens) + 1))
        for name, rows, columns, label in SHAPES:
            kind = GGMLQuantizationType[name]
            values, size = GGML_QUANT_SIZES[kind]
            raw = torch.from_numpy(rng.integers(0, 256, size=(rows, columns // values * size), dtype=np.uint8))
            cells, one = [], None
            for tokens in args.tokens:
                x = torch.randn(tokens, columns)
                quantized.linear(x, raw, kind.value, columns)
                best = float("inf")
                for _ in range(max(3, int(3e8 / raw.numel() / tokens))):
                    start = time.perf_counter()
                    quantized.linear(x, raw, kind.value, columns)
                    best = min(best, time.perf_counter() - start)
                one = best if one is None else one
                cells.append(f"{best * 1e3:.2f}")
            print(f"| {label} {rows}x{columns} | {name} | " + " | ".join(cells) + f" | {raw.numel() / one / 1e9:.1f} |")
        print()


if __name__ == "__main__":
    main()
