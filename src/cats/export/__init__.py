"""``cats export``: a trained EAGLE-3 head in the layout each serving engine loads.

- ``vllm``: a folder with ``config.json`` (architectures ``Eagle3LlamaForCausalLM``) and ``model.safetensors``
  (`cats.export.hf_folder`);
- ``sglang``: the same tensors, with architectures ``LlamaForCausalLMEagle3`` and its aux layer convention;
- ``llama.cpp``: one GGUF file of architecture ``eagle3`` that ``llama-server -md FILE --spec-type draft-eagle3``
  loads (`cats.export.gguf_file`).

What the engines read, and where they differ, is in `cats.export.layout`.
"""

from __future__ import annotations

from pathlib import Path

from cats.errors import InvalidArgumentError
from cats.export.gguf_file import write_gguf
from cats.export.hf_folder import DTYPES, write_hf_folder
from cats.export.layout import ENGINES
from cats.model import LayeredModel
from cats.model.eagle3 import load_eagle3_head


def export_head(folder: str | Path, model: LayeredModel, engine: str, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the EAGLE-3 head in ``folder`` (trained for ``model``) for ``engine``; return what was written."""
    if engine not in ENGINES:
        raise InvalidArgumentError(f"--to must be one of {', '.join(ENGINES)}, got {engine!r}")
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    head = load_eagle3_head(folder, model, on_blocks=False)  # the weights as tensors, whatever the model runs on
    if engine == "llama.cpp":
        return write_gguf(head, model, Path(out), dtype)
    return write_hf_folder(head, model, engine, Path(out), dtype)


__all__ = ["ENGINES", "export_head"]
