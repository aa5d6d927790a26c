"""The data folder ``cats train data`` writes and ``cats train features`` adds to, and `TrainingData`, its lazy
reader.

Folder format ``cats-train-data/1``:

* ``meta.json``: the settings the data depends on (model identity and dtype, layers, top_k, prompt file and its
  SHA-256, generation settings, seed, prompts per shard), ``num_prompts`` (prompts selected), ``shards`` (the
  complete shards, in order: ``file``, ``first_prompt``, ``num_prompts``, ``samples``, ``tokens``,
  ``response_tokens``), ``skipped_prompts`` (``{"prompt", "reason"}``) and ``truncated_prompts`` (indices).
  Prompt indices count entries of the prompt file, from 0.
* ``shard-NNNNN.safetensors``: shard k holds the samples of prompts ``[k * shard_prompts, ...)``, prompt by prompt,
  sample by sample, concatenated along one token axis of length N:

  ==================  ===========  =====================================================================
  ``input_ids``       int64 [N]    prompt + response of each sample (response cut after its first EOS)
  ``sample_starts``   int64 [S+1]  sample s is rows ``sample_starts[s] : sample_starts[s+1]``
  ``prompt_lengths``  int64 [S]    prompt tokens of each sample (chat template included)
  ``prompt_index``    int64 [S]    the prompt each sample answers (index in the prompt file)
  ``loss_mask``       uint8 [N]    1 at position t iff token t+1 is a response token
  ``hidden.{L}``      bf16 [N, H]  hidden state after L decoder layers (the input of 0-based layer L)
  ``topk_ids``        int32 [N, K] the target's K most likely next tokens at each position
  ``topk_probs``      fp16 [N, K]  their probabilities (softmax of the final logits, temperature 1)
  ==================  ===========  =====================================================================

Final features (for feature draft adapters, ``cats train features``): ``features-NNNNN.safetensors`` beside shard
NNNNN holds ``features`` bf16 [N, H], the target's final normed state at each position (what its lm_head reads),
from a teacher-forced forward of each unpadded sample in the data's dtype; files are written under temporary names
and renamed, so a killed run resumes at the first shard without one.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from pathlib import Path

import torch

from cats.errors import InvalidArgumentError
from cats.model.identity import model_fingerprint

FORMAT = "cats-train-data/1"
META = "meta.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def features_name(shard_file: str) -> str:
    """``shard-00003.safetensors`` -> ``features-00003.safetensors``."""
    return "features-" + shard_file.removeprefix("shard-")


def read_meta(path: Path) -> dict:
    meta_path = path / META
    if not meta_path.is_file():
        raise InvalidArgumentError(f"{path} is not a CATS training-data folder: it has no {META}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{meta_path} is not valid JSON ({error.msg})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InvalidArgumentError(f"{meta_path} has format {found!r}; expected {FORMAT!r}")
    return meta


def check_same_model(meta: dict, identity: dict, path: Path) -> None:
    made_from = meta["model"]
    if made_from.get("fingerprint") != identity["fingerprint"]:
        raise InvalidArgumentError(
            f"the training data in {path} was made from model {made_from.get('name')!r} (fingerprint "
            f"{made_from.get('fingerprint')}), not from {identity['name']!r} (fingerprint {identity['fingerprint']})")


def check_shards_exist(meta: dict, path: Path) -> None:
    for shard in meta["shards"]:
        if not (path / shard["file"]).is_file():
            raise InvalidArgumentError(f"{path}: shard {shard['file']} listed in {META} is missing")


class TrainingData:
    """A data folder made by ``cats train data``, read lazily: shards are opened with safetensors ``safe_open``
    (memory-mapped; at most two held open) and each `sample` reads only its own rows."""

    MAX_OPEN_SHARDS = 2

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.shards = meta["shards"]
        self._first_sample = [0]
        for shard in self.shards:
            self._first_sample.append(self._first_sample[-1] + shard["samples"])
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._features: OrderedDict[int, object] = OrderedDict()
        self._lengths: list[int] | None = None

    @classmethod
    def open(cls, path: str | Path, model=None) -> "TrainingData":
        """Open a data folder; with ``model``, refuse data made from another model (by fingerprint)."""
        path = Path(path)
        meta = read_meta(path)
        check_shards_exist(meta, path)
        if model is not None:
            check_same_model(meta, {"name": model.name, "fingerprint": model_fingerprint(model)}, path)
        return cls(path, meta)

    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    @property
    def hidden_size(self) -> int:
        return self.meta["hidden_size"]

    @property
    def num_samples(self) -> int:
        return self._first_sample[-1]

    @property
    def num_response_tokens(self) -> int:
        return sum(shard["response_tokens"] for shard in self.shards)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        for i in range(self.num_samples):
            yield self.sample(i)

    @property
    def has_features(self) -> bool:
        """Whether every shard has its final-feature file (``cats train features``)."""
        return all((self.path / features_name(shard["file"])).is_file() for shard in self.shards)

    def sample(self, i: int, layers: list[int] | None = None, features: bool = False) -> dict:
        """Sample ``i``: ``input_ids`` [T] long, ``loss_mask`` [T] bool, ``prompt_length``, ``prompt_index``,
        ``hidden`` {L: [T, H] bf16} (``layers``: only these, default all), ``topk_ids`` [T, K] long,
        ``topk_probs`` [T, K] float32; with ``features``, also ``features`` [T, H] bf16 (the final normed states)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range: {self.path} holds {self.num_samples} samples")
        layers = self.layers if layers is None else layers
        unknown = sorted(set(layers) - set(self.layers))
        if unknown:
            raise InvalidArgumentError(f"{self.path} stores hidden states after layers {self.layers}, not {unknown}")
        shard_index = bisect.bisect_right(self._first_sample, i) - 1
        handle, starts, prompt_lengths, prompt_index = self._shard(shard_index)
        local = i - self._first_sample[shard_index]
        rows = slice(int(starts[local]), int(starts[local + 1]))

        def read(name):
            return handle.get_slice(name)[rows]

        record = {
            "input_ids": read("input_ids").long(),
            "loss_mask": read("loss_mask").bool(),
            "prompt_length": int(prompt_lengths[local]),
            "prompt_index": int(prompt_index[local]),
            "hidden": {layer: read(f"hidden.{layer}") for layer in layers},
            "topk_ids": read("topk_ids").long(),
            "topk_probs": read("topk_probs").float(),
        }
        if features:
            record["features"] = self._feature_handle(shard_index).get_slice("features")[rows]
        return record

    def _feature_handle(self, index: int):
        from safetensors import safe_open

        if index not in self._features:
            file = self.path / features_name(self.shards[index]["file"])
            if not file.is_file():
                raise InvalidArgumentError(f"{self.path} has no final features for {self.shards[index]['file']}; "
                                           f"compute them with `cats train features --data {self.path}`")
            self._features[index] = safe_open(str(file), framework="pt")
            while len(self._features) > self.MAX_OPEN_SHARDS:
                self._features.popitem(last=False)
        return self._features[index]

    def shard_input_ids(self, index: int) -> list[torch.Tensor]:
        """The token ids ``[T]`` of every sample of shard ``index``, in order (one read of its ``input_ids``)."""
        handle, starts = self._shard(index)[:2]
        ids = handle.get_tensor("input_ids").long()
        return [ids[a:b] for a, b in zip(starts, starts[1:])]

    def sample_length(self, i: int) -> int:
        """Tokens of sample ``i`` (prompt + response), without reading its tensors."""
        if self._lengths is None:
            self._lengths = []
            for index in range(len(self.shards)):
                starts = self._shard(index)[1]
                self._lengths.extend(b - a for a, b in zip(starts, starts[1:]))
        return self._lengths[i]

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """``LongTensor[vocab_size]``: how often each token occurs as a response token (for a reduced draft
        vocabulary). Position t with ``loss_mask[t] = 1`` predicts token t+1, which always lies in the same sample."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in range(len(self.shards)):
            handle = self._shard(index)[0]
            ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask").bool()
            responses = ids[1:][mask[:-1]]
            if responses.numel() and int(responses.max()) >= vocab_size:
                raise InvalidArgumentError(f"{self.path} holds token id {int(responses.max())}, outside a "
                                           f"{vocab_size}-token vocabulary")
            counts += torch.bincount(responses, minlength=vocab_size)
        return counts

    def _shard(self, index: int) -> tuple:
        """``(safe_open handle, sample_starts, prompt_lengths, prompt_index)`` of shard ``index``, opened on demand."""
        from safetensors import safe_open

        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        shard = self.shards[index]
        handle = safe_open(str(self.path / shard["file"]), framework="pt")
        starts = handle.get_tensor("sample_starts")
        if len(starts) != shard["samples"] + 1:
            raise InvalidArgumentError(f"{self.path}: {shard['file']} holds {len(starts) - 1} samples but {META} "
                                       f"lists {shard['samples']}")
        entry = (handle, starts.tolist(), handle.get_tensor("prompt_lengths").tolist(),
                 handle.get_tensor("prompt_index").tolist())
        self._open[index] = entry
        while len(self._open) > self.MAX_OPEN_SHARDS:
            self._open.popitem(last=False)
        return entry


class DataMix:
    """Several data folders of the same model read as one (``cats train adapter --data A --data B``): samples are
    numbered folder after folder; only the layers every folder stores are offered."""

    def __init__(self, parts: list[TrainingData]):
        if not parts:
            raise InvalidArgumentError("no training data folder given")
        fingerprints = {part.meta["model"]["fingerprint"] for part in parts}
        if len(fingerprints) > 1 or len({part.hidden_size for part in parts}) > 1:
            raise InvalidArgumentError("the data folders " + ", ".join(str(p.path) for p in parts) + " were made from "
                                       "different models; mix only data of one model")
        self.parts = parts
        self.meta = parts[0].meta
        self.path = ",".join(str(part.path) for part in parts) if len(parts) > 1 else parts[0].path
        self._first = [0]
        for part in parts:
            self._first.append(self._first[-1] + part.num_samples)

    @classmethod
    def open(cls, paths: list[str | Path], model=None) -> "DataMix":
        return cls([TrainingData.open(path, model=model) for path in paths])

    @property
    def layers(self) -> list[int]:
        return [layer for layer in self.parts[0].layers if all(layer in part.layers for part in self.parts)]

    @property
    def hidden_size(self) -> int:
        return self.parts[0].hidden_size

    @property
    def num_samples(self) -> int:
        return self._first[-1]

    @property
    def num_response_tokens(self) -> int:
        return sum(part.num_response_tokens for part in self.parts)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def has_features(self) -> bool:
        return all(part.has_features for part in self.parts)

    def _locate(self, i: int) -> tuple[TrainingData, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range: {self.path} holds {self.num_samples} samples")
        index = bisect.bisect_right(self._first, i) - 1
        return self.parts[index], i - self._first[index]

    def sample(self, i: int, layers: list[int] | None = None, features: bool = False) -> dict:
        part, local = self._locate(i)
        return part.sample(local, layers=self.layers if layers is None else layers, features=features)

    def sample_length(self, i: int) -> int:
        part, local = self._locate(i)
        return part.sample_length(local)

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        return sum(part.response_token_counts(vocab_size) for part in self.parts)


__all__ = ["FORMAT", "META", "DataMix", "TrainingData", "check_same_model", "check_shards_exist", "features_name", "read_meta",
           "shard_name"]
