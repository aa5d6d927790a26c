"""Held-out agreement of trained adapter folders on one data folder: the metrics `cats train adapter --eval-data`
records at the end of training (top-1 agreement with the target, overlap, E[accepted] of a gamma-6 chain), for
adapters trained on other data or evaluated on a new held-out set, so that old and new adapters are compared on
the same positions.

    python benchmarks/adapter_agreement.py --model Q.gguf --eval-data ~/.cache/cats/train-data/qwen-mtbench-eval \
        adapters/qwen2.5-coder-1.5b-instruct/{draft,shallow,feature,eagle3} --out agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cats.model import load_model
from cats.model.adapter import load_adapter
from cats.model.eagle3 import is_eagle3_folder, load_eagle3_head
from cats.train.folder import TrainingData
from cats.train.trainer import evaluate


def vocab_index_of(subset: list[int] | None, vocab_size: int) -> torch.Tensor | None:
    if subset is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[torch.tensor(subset)] = torch.arange(len(subset))
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--eval-data", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("adapters", nargs="+", type=Path, help="adapter or EAGLE-3 head folders")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="float32")
    data = TrainingData.open(args.eval_data, model=model)
    results = {}
    for folder in args.adapters:
        if is_eagle3_folder(folder):
            adapter, layer = load_eagle3_head(folder, model), model.num_layers
        else:
            adapter = load_adapter(folder, model)
            layer = adapter.config.layer
        adapter = adapter.float()
        metrics = evaluate(adapter, data, layer, vocab_index_of(adapter.config.vocab_subset, model.vocab_size), "cpu")
        results[str(folder)] = {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
        print(f"{folder}: {results[str(folder)]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"eval_data": str(args.eval_data), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
