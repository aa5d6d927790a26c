"""The draft adapters' step cost relative to a full forward (with the reduced draft
vocabulary): the early-exit draft adapter (draft/), the early-exit feature adapter (early-exit/: it also reads the
final features), and the feature draft adapter (feature/, method eagle), with and without packed weights
(``--pack-weights``), in one process:

    python benchmarks/draft_step.py [--adapters adapters/smollm2-135m-instruct] [--dtype bfloat16 float32]

One draft step = one token through layers [0, L_d) + the draft adapter's block, norm and head rows (feature adapter:
its fc, block, norm and head rows on one [feature, token] input, no target layer); one full forward
= one token through every layer + the final norm and the whole lm_head (what `ar` pays per token). "Adapter part"
= the draft step without layers [0, L_d) (the adapter's block, norm and head rows on a ready state): what drafting
adds, since CATS's verification reuses those layers' KV instead of running them again. Context 64 tokens, medians of
``--repeats`` steps (the first 5 dropped), the three in turn per packing state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_layers import step_cost  # noqa: E402

from cats.paths import default_model  # noqa: E402
from cats.model.adapter import load_adapter  # noqa: E402
from cats.model import load_model  # noqa: E402
from cats.model.kernels import packing as lean  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--adapters", default="adapters/smollm2-135m-instruct")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=80)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| dtype | adapter | weights | draft step ms | full forward ms | draft / full | adapter part ms | "
          "adapter part / full |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        model = load_model(args.model or default_model(), dtype=dtype)
        adapters = [(role, load_adapter(Path(args.adapters) / role, model).eval())
                    for role in ("draft", "early-exit", "feature") if (Path(args.adapters) / role / "config.json").is_file()]
        states = [("plain", None)]
        if lean.pack_available(model.dtype) is None:
            states.append(("packed", lean.pack_linears))
        for name, apply in states:
            if apply is not None:
                apply(model)
            for role, adapter in adapters:
                draft, full, alone = step_cost(model, adapter, args.repeats, marginal=True)
                print(f"| {dtype} | {role} | {name} | {draft * 1e3:.2f} | {full * 1e3:.2f} | {draft / full:.3f} | "
                      f"{alone * 1e3:.2f} | {alone / full:.3f} |", flush=True)
        lean.unpack_linears(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
