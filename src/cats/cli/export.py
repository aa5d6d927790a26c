"""``cats export``: write a trained EAGLE-3 head in the layout vLLM, SGLang or llama.cpp loads (`cats.export`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cats.errors import InvalidArgumentError
from cats.export import ENGINES, export_head
from cats.export.hf_folder import DTYPES
from cats.export.llama_graph import REWRITTEN, gguf_architecture, write_llama_graph
from cats.model import load_model
from cats.model.adapter import find_adapter
from cats.model.source import gguf_file
from cats.paths import default_model


def add_export_parser(commands) -> None:
    parser = commands.add_parser(
        "export", help="write a trained EAGLE-3 head for vLLM, SGLang or llama.cpp",
        description="Writes the EAGLE-3 head (cats train adapter --arch eagle3) in an engine's layout: a folder with "
                    "config.json and model.safetensors for vllm and sglang, one GGUF file for llama.cpp "
                    "(llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3). The head's lm_head is "
                    "the target's rows of its draft vocabulary, read from --model.")
    parser.add_argument("adapter", type=Path, help="the head's folder, or an adapters folder holding eagle3/")
    parser.add_argument("--to", required=True, choices=ENGINES, help="the engine")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder (vllm, sglang) or .gguf file (llama.cpp; a folder gets eagle3-head.gguf)")
    parser.add_argument("--model", default=None,
                        help="the target the head was trained for (default: the model its config names)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="weights' dtype (default bfloat16)")
    parser.add_argument("--target-out", type=Path, default=None,
                        help="llama.cpp, with a Qwen2 target: also write the target GGUF rewritten for llama.cpp's Llama "
                             "graph here (its qwen2 graph lacks the layer inputs EAGLE-3 drafting reads; the same "
                             "quantised blocks, answers equal up to rounding)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.set_defaults(run=run_export_command)


def run_export_command(args: argparse.Namespace) -> int:
    folder = find_adapter(args.adapter, "eagle3")
    named = json.loads((folder / "config.json").read_text()).get("base_model", {}).get("name")
    model_path = args.model or (named if named and Path(named).exists() else default_model())
    target_file = gguf_file(model_path)  # the file, or the one GGUF in a folder
    rewrite = target_file is not None and args.to == "llama.cpp" and gguf_architecture(target_file) in REWRITTEN
    if args.target_out is not None and not rewrite:
        raise InvalidArgumentError("--target-out applies to --to llama.cpp with a Qwen2 GGUF target "
                                   f"({model_path} is not one; llama.cpp runs it as it is)")
    model = load_model(model_path, dtype="float32")
    out = export_head(folder, model, args.to, args.out, args.dtype)
    print(f"wrote {out} ({args.to})")
    if args.target_out is not None:
        print(f"wrote {write_llama_graph(target_file, args.target_out)} (the target for llama.cpp's Llama graph)")
    elif rewrite:
        print(f"note: llama.cpp's qwen2 graph cannot run EAGLE-3 drafting; add --target-out TARGET.gguf to write "
              f"{target_file.name} for its Llama graph and serve that file")
    return 0
