"""The method registry: every decoding method ``cats bench`` can run, CATS's own and the baselines.

A method turns prompt token ids into new token ids (greedy, or sampled with the run's `SamplingSettings` and the
turn's seed; stopping at an end-of-sequence token, which is kept, or at ``max_new_tokens``) and reports how many
tokens each target forward committed. The runner times it.

* CATS methods (every name in `cats.methods.METHODS`: ``ar``, ``pld``, ``early-exit``, and each new one as it lands):
  `cats.loop.generator.Generator` with the drafter from `cats.methods.make_drafter`.
* ``hf-ar``, ``hf-pld``, ``hf-early-exit``: transformers ``generate`` on the same weights (``model.hf_model``).
* ``hf-offload``: transformers + accelerate's own offloading under ``--memory-budget`` (``device_map="auto"``,
  ``max_memory``, ``offload_folder``) with plain greedy ``generate``: what a user would reach for without CATS.
* ``llama-cpp``, ``llama-cpp-pld``: llama-cpp-python (optional extra ``[baselines]``) on the GGUF file the model
  came from. llama.cpp computes with the quantised weights as stored (e.g. Q4_1 blocks), while CATS and
  transformers run the weights dequantised to float (``--dtype``), so its tokens may differ from theirs.

``accept_lengths`` follows `cats.loop.stats.GenerationStats`: tokens committed by each target forward *after* the first
one (the first forward reads the prompt); plain decoding gives all ones.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from cats.api import generator_for
from cats.bench.cgroup import MemoryCgroup
from cats.config import DraftConfig, GenerationConfig
from cats.draft import default_draft_layer
from cats.errors import CatsError, InvalidArgumentError
from cats.methods import memory_needs, method
from cats.model import LayeredModel, load_model
from cats.model.kernels.packing import packing_off
from cats.model.source import local_folder, resolve_dtype
from cats.model.weights.budget import PartSizes, mib, parse_budget
from cats.model.weights.offload import build_skeleton, plan_for
from cats.model.weights.rss import anonymous_rss_bytes, bound_heap
from cats.sampling import check_sampling
from cats.verify.acceptance import check_acceptance, make_acceptance
from cats.verify.cascade import SV_THRESHOLD

HF_METHODS = ("hf-ar", "hf-pld", "hf-early-exit")
OFFLOAD_METHODS = ("hf-offload",)
UNBUDGETED = ("{name} holds the whole model in memory and cannot run under --memory-budget (hf-offload is "
              "transformers' own offloading under the budget)")
NEEDS_LIMIT = ("{name} has no memory planner of its own: it runs under --memory-limit (a memory cgroup, the "
               "kernel's limit), not under --memory-budget alone")
LLAMA_CPP_METHODS = ("llama-cpp", "llama-cpp-pld")
DEFAULT_PLD_TOKENS = 10  # the defaults of `cats.methods.make_drafter`, used for the baselines' equivalents too
DEFAULT_EARLY_EXIT_TOKENS = 4
LLAMA_CPP_MAX_CONTEXT = 4096  # llama.cpp preallocates its KV cache for n_ctx tokens; Spec-Bench prompts fit easily
LLAMA_CPP_WEIGHTS_NOTE = (
    "llama.cpp and CATS's methods on GGUF blocks both compute on the file's quantised blocks with 8-bit activations, "
    "but with different kernels, summation orders and attention, so their tokens can differ; the transformers "
    "baselines run the weights dequantised to float ({dtype}). The weights column names each method's format and "
    "kernel path."
)


class MethodUnavailableError(CatsError):
    """A known method that cannot run here (an optional package is missing, or the model is not a GGUF file).
    The runner skips it and the summary and report say why."""


@dataclass
class TurnResult:
    token_ids: list[int]  # new tokens, including a final end-of-sequence token if one was generated
    accept_lengths: list[int]  # tokens committed per target forward after the first
    target_forwards: int
    shallow: dict | None = None  # the cascade's shallow-verifier counters for this turn (method cats)
    scheduler: dict | None = None  # the DyTC scheduler's decisions and estimates for this turn (method dytc)
    offload: dict | None = None  # layer streaming counters for this turn (under --memory-budget)
    drafts: tuple[int, int] | None = None  # (drafted, accepted) draft tokens of this turn, where the method drafts


@dataclass
class SamplingSettings:
    """How every method of a run chooses tokens (greedy at temperature 0, else sampling with the same warping), and
    the acceptance rule of CATS's speculative methods. Typical acceptance (lossy) applies to those only: ``ar`` and
    the baselines always decode exactly."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    acceptance: str = "exact"
    typical_tau: float | None = None
    typical_alpha: float | None = None

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def validate(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, None)
        check_acceptance(self.acceptance, self.typical_tau, self.typical_alpha)
        make_acceptance(self.acceptance, self.temperature, self.typical_tau, self.typical_alpha)  # range checks

    def label(self) -> str:
        """What the run's reports say about acceptance: ``exact`` or ``typical (lossy)``."""
        return make_acceptance(self.acceptance, self.temperature, self.typical_tau, self.typical_alpha).label


@dataclass
class MethodSettings:
    """Drafting settings shared by each CATS method and its baseline equivalents (None: the method's default)."""

    num_draft_tokens: int | None = None
    draft_layer: int | None = None
    max_ngram: int = 3
    adapters: str | None = None  # trained adapters folder: early-exit drafts through its draft adapter
    threshold: float | None = None  # early-exit / eagle / tree confidence stop (None: the method's default)
    tree_topk: int | None = None  # None: the default, or chosen from the budget (cats.draft.sizing)
    total_tokens: int | None = None
    depth: int | None = None
    sv_threshold: float = SV_THRESHOLD  # the cascade's pruning threshold (method cats)
    sv_passes: int = 1  # the cascade's shallow passes per deep pass (method cats)
    sparsity: tuple[float, ...] | None = None  # layer-skip / dytc sparsities (None: their defaults)
    threads: int = 1
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def drafting(self, applies: frozenset[str] | None = None) -> DraftConfig:
        """The `DraftConfig` of these settings; ``applies``: only the fields a method takes (None: all)."""
        return DraftConfig(**{f.name: getattr(self, f.name) for f in fields(DraftConfig)
                              if applies is None or f.name in applies})


@dataclass
class BenchContext:
    model: LayeredModel | None  # None in a budgeted run's hf-offload worker (it loads its own)
    model_source: str  # what the user passed as --model (llama.cpp needs the GGUF file behind it)
    settings: MethodSettings = field(default_factory=MethodSettings)
    memory_budget: str | None = None  # --memory-budget: every method runs under it
    cgroup: MemoryCgroup | None = None  # --memory-limit: the memory cgroup a method's own process runs in
    process_memory: bool = False  # the budget is the whole process's memory (a bench worker's), not the model's
    dtype: str = "float32"
    context_tokens: int | None = None  # KV cache tokens the budgeted methods plan for
    prompt_tokens: int | None = None  # the longest prompt (its prefill's activations)
    progress: bool = True  # progress bars (a calibration on first use of layer-skip or dytc); --no-progress: none
    _float_model: LayeredModel | None = None

    def float_model(self) -> LayeredModel | None:
        """The model on float weights, as transformers runs it: ``model`` itself, or, when that runs on GGUF blocks,
        the same file dequantised by transformers (`--kernels aten`), loaded once on first use."""
        if self.model is None or not self.model.kernel_path.startswith("gguf-blocks"):
            return self.model
        if self._float_model is None:
            self._float_model = load_model(self.model_source, dtype=self.dtype, kernels="aten")
        return self._float_model


class BenchMethod(ABC):
    name: str
    acceptance: str = "exact"  # what reports say about its output: "exact" or "typical (lossy)"

    @abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> TurnResult:
        """New tokens after ``prompt_ids``: greedy, or sampled with the run's settings and ``seed``."""

    def describe(self) -> dict:
        """Settings shown in the summary and report."""
        return {}

    def own_peak_rss_mb(self) -> float | None:
        """The peak resident memory of the process this method runs in, when it runs in a process of its own (a
        server); None: it runs in the bench's process, whose memory is sampled while it runs."""
        return None

    def close(self) -> None:
        """Release what the method holds (restore shared state)."""


class CatsMethod(BenchMethod):
    """A CATS method: the one decode loop with this method's drafter."""

    def __init__(self, name: str, context: BenchContext):
        settings = context.settings
        self.name = name
        drafting = settings.drafting(method(name).settings)  # the shared settings this method takes
        self.generator = generator_for(context.model, name, drafting, progress=context.progress)
        self.drafter, self.scorer = self.generator.drafter, self.generator.scorer
        self.sampling = settings.sampling
        if self.drafter is None:  # typical acceptance is about drafts: ar decodes exactly
            self.sampling = SamplingSettings(self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        self.acceptance = self.sampling.label()

    def generate(self, prompt_ids, max_new_tokens, seed=None):
        sampling = self.sampling
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=sampling.top_k, seed=seed if sampling.sampled else None,
                                  acceptance=sampling.acceptance, typical_tau=sampling.typical_tau,
                                  typical_alpha=sampling.typical_alpha)
        result = self.generator.generate(prompt_ids, config)
        stats = result.stats
        drafts = (stats.drafted_tokens, stats.accepted_draft_tokens) if self.drafter is not None else None
        return TurnResult(result.token_ids, list(stats.accept_lengths), stats.target_forwards, stats.shallow,
                          stats.scheduler, stats.offload, drafts)

    def describe(self):
        info = self.drafter.describe() if self.drafter is not None else {"name": self.name}
        if hasattr(self.scorer, "describe"):
            info["cascade"] = self.scorer.describe()
        model = self.generator.model
        info["weights"] = f"{model.weight_format}, {model.kernel_path}"
        if model.large_pages is not None:
            info["weights"] += f", {model.large_pages.share:.0%} in 2 MiB pages"
        if model.memory_plan is not None:
            info["streamed_layers"] = list(model.memory_plan.streamed)
            if model.memory_plan.head_streamed:
                info["head_streamed"] = True
        if self.drafter is not None and self.drafter.speculation is not None:
            info["speculation"] = self.drafter.speculation
        return info


class _ChunkRecorder:
    """A transformers streamer that records the size of each chunk ``generate`` commits: the first ``put`` is the
    prompt, then one chunk per target forward (one token for plain decoding, accepted + 1 for assisted decoding)."""

    def __init__(self):
        self.prompt_seen, self.chunks = False, []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
        else:
            self.chunks.append(int(value.numel()))

    def end(self) -> None:
        pass


class HfGenerateMethod(BenchMethod):
    """transformers ``generate`` on ``model.hf_model``: greedy (``do_sample=False`` explicitly: real checkpoints
    often ship ``do_sample=True`` in their generation config), or sampled with the run's temperature, top-p and
    top-k (passed explicitly, over the checkpoint's defaults) after ``torch.manual_seed(seed)``.

    Assistant settings (draft length, confidence threshold, schedule) are read by transformers from the
    *assistant's* generation config, which for ``assistant_early_exit`` is the target's own; passed as ``generate``
    keywords they would be silently ignored. They are set on ``hf_model.generation_config`` for the call and
    restored afterwards. Target forwards are counted with a forward hook on the last decoder layer, which the
    early-exit draft (layers ``[0, E)``) never runs."""

    def __init__(self, name: str, context: BenchContext, generate_kwargs: dict, assistant_settings: dict):
        self.name, self.model = name, context.float_model()
        self.generate_kwargs, self.assistant_settings = generate_kwargs, assistant_settings
        sampling = context.settings.sampling
        self.sampling_kwargs = (dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                     top_k=sampling.top_k) if sampling.sampled else dict(do_sample=False))

    def generate(self, prompt_ids, max_new_tokens, seed=None):
        model = self.model
        hf_model, config = model.hf_model, model.hf_model.generation_config
        device = model.device if model.device.type != "meta" else torch.device("cpu")  # embeddings offloaded
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        eos = sorted(model.eos_token_ids)
        recorder, forwards = _ChunkRecorder(), [0]
        hook = model.layers[-1].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        saved = {key: getattr(config, key, None) for key in self.assistant_settings}
        try:
            for key, value in self.assistant_settings.items():
                setattr(config, key, value)
            if self.sampling_kwargs["do_sample"]:
                torch.manual_seed(0 if seed is None else seed)  # transformers samples with torch's global generator
            with torch.inference_mode(), packing_off():  # transformers as it runs, not on CATS's packed linears
                output = hf_model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                    eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                    streamer=recorder, **self.sampling_kwargs, **self.generate_kwargs,
                )
        finally:
            hook.remove()
            for key, value in saved.items():
                setattr(config, key, value)
        new_tokens = [int(t) for t in output[0, input_ids.shape[1]:]]
        return TurnResult(new_tokens, recorder.chunks[1:], forwards[0])

    def describe(self):
        return {"name": self.name, "weights": f"{self.model.weight_format}, transformers (aten)",
                **self.generate_kwargs, **self.assistant_settings}  # sampling: in the run


def hf_method(name: str, context: BenchContext) -> HfGenerateMethod:
    settings = context.settings
    if name == "hf-ar":
        return HfGenerateMethod(name, context, {}, {})
    if name == "hf-pld":
        kwargs = {"prompt_lookup_num_tokens": settings.num_draft_tokens or DEFAULT_PLD_TOKENS,
                  "max_matching_ngram_size": settings.max_ngram}
        return HfGenerateMethod(name, context, kwargs, {})
    if name == "hf-early-exit":
        model = context.model
        layer = default_draft_layer(model) if settings.draft_layer is None else settings.draft_layer
        if not 1 <= layer < model.num_layers:
            raise InvalidArgumentError(f"draft layer {layer} is outside [1, {model.num_layers}) for this model")
        assistant = {"num_assistant_tokens": settings.num_draft_tokens or DEFAULT_EARLY_EXIT_TOKENS,
                     "assistant_confidence_threshold": 0.0, "num_assistant_tokens_schedule": "constant"}
        return HfGenerateMethod(name, context, {"assistant_early_exit": layer}, assistant)
    raise AssertionError(f"{name!r} is not a transformers baseline")


class HfOffloadMethod(HfGenerateMethod):
    """transformers + accelerate's own offloading under the same budget: ``from_pretrained(device_map="auto",
    max_memory={"cpu": the budget less the KV cache and activations CATS plans for}, offload_folder=...)``; what
    does not fit goes to "disk" (accelerate reads each offloaded Linear's weights from the checkpoint when it runs),
    then plain greedy ``generate``."""

    def __init__(self, name: str, context: BenchContext):
        if context.memory_budget is None:
            raise MethodUnavailableError(f"{name} is transformers + accelerate offloading under a memory budget; "
                                         "pass --memory-budget")
        import shutil
        import tempfile

        from transformers import AutoConfig, AutoModelForCausalLM


        dtype = resolve_dtype(context.dtype)
        folder = local_folder(context.model_source)
        config = AutoConfig.from_pretrained(folder)
        skeleton = build_skeleton(config, dtype)
        budget = parse_budget(context.memory_budget, PartSizes.of(skeleton).weights)
        needs = memory_needs(config, dtype, "ar", context_tokens=context.context_tokens,
                             prompt_tokens=context.prompt_tokens)
        plan = plan_for(skeleton, max(budget, 10**15), needs)  # the same KV cache and activation estimates as ar
        # a worker's budget is the process's (as for CATS's methods): the runtime's share is measured and set aside
        runtime = (anonymous_rss_bytes() or 0) if context.process_memory else 0
        self.max_memory = budget - runtime - plan.kv_bytes - plan.activation_bytes
        if self.max_memory <= 0:
            raise MethodUnavailableError(f"{name}: the budget {mib(budget)} leaves nothing for weights after the "
                                         f"runtime ({mib(runtime)}), KV cache ({mib(plan.kv_bytes)}) and "
                                         f"activations ({mib(plan.activation_bytes)})")

        bound_heap()  # the same allocator setting as CATS under a budget
        self.offload_folder = tempfile.mkdtemp(prefix="cats-hf-offload-")
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, device_map="auto", max_memory={"cpu": self.max_memory},
                offload_folder=self.offload_folder)
        except BaseException:
            shutil.rmtree(self.offload_folder, ignore_errors=True)
            raise
        self.device_map = dict(getattr(hf_model, "hf_device_map", {}) or {})
        self.files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
        model = LayeredModel(hf_model, tokenizer=None, name=context.model_source)
        super().__init__(name, BenchContext(model, context.model_source, context.settings), {}, {})

    def cached_files(self) -> list[str]:
        """The files its weights are read from (to ask the kernel how much of them it caches)."""
        return self.files + sorted(str(p) for p in Path(self.offload_folder).rglob("*") if p.is_file())

    def describe(self):
        placed = {}
        for device in self.device_map.values():
            placed[str(device)] = placed.get(str(device), 0) + 1
        return {"name": self.name, "device_map": "auto", "max_memory_cpu_mb": round(self.max_memory / 2**20, 1),
                "modules_placed": placed}

    def close(self):
        import shutil

        shutil.rmtree(self.offload_folder, ignore_errors=True)


def find_gguf(model_source: str) -> Path | None:
    """The GGUF file behind ``--model``: the file itself, the single ``.gguf`` in a folder, or the source recorded
    in a folder that `cats.model.source.convert_gguf` wrote. None when the model did not come from a GGUF file."""
    path = Path(model_source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        record = path / "cats-source.json"
        if record.is_file():
            source = Path(json.loads(record.read_text()).get("gguf", ""))
            if source.is_file():
                return source
    return None


class LlamaCppMethod(BenchMethod):
    """llama-cpp-python's ``Llama.generate``, greedy or sampled with the run's temperature, top-p and top-k (its own
    min-p filter off) after ``Llama.set_seed(seed)``, optionally with its prompt-lookup drafter.

    The prompt is the same token ids the other methods get (the GGUF's vocabulary is the tokenizer's).
    ``Llama.reset()`` before each run stops llama.cpp from reusing the KV cache of an earlier prompt with the same
    prefix, so every run prefills its whole prompt like the other methods. Target forwards are the calls of
    ``Llama.eval`` (one per verification round; the prompt is the first)."""

    def __init__(self, name: str, context: BenchContext, prompt_lookup: bool):
        try:
            llama_cpp = importlib.import_module("llama_cpp")
        except ImportError:
            raise MethodUnavailableError(
                f"{name} needs llama-cpp-python, which is not installed (pip install 'cats[baselines]')") from None
        gguf = find_gguf(context.model_source)
        if gguf is None:
            raise MethodUnavailableError(
                f"{name} needs a GGUF model; {context.model_source!r} is neither a .gguf file nor converted from one")
        settings, model = context.settings, context.model
        self.name, self.gguf, self.eos = name, gguf, model.eos_token_ids
        sampling = settings.sampling
        self.sampling_kwargs = (dict(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=0.0,
                                     typical_p=1.0) if sampling.sampled else dict(temp=0.0))
        self.settings = {"name": name, "gguf": str(gguf), "threads": settings.threads}
        draft_model = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            num_tokens = settings.num_draft_tokens or DEFAULT_PLD_TOKENS
            draft_model = LlamaPromptLookupDecoding(max_ngram_size=settings.max_ngram, num_pred_tokens=num_tokens)
            self.settings.update(num_pred_tokens=num_tokens, max_ngram_size=settings.max_ngram)
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=min(model.context_length, LLAMA_CPP_MAX_CONTEXT), n_threads=settings.threads,
            n_threads_batch=settings.threads, draft_model=draft_model, seed=0, verbose=False,
        )

    def generate(self, prompt_ids, max_new_tokens, seed=None):
        llm, tokens, eval_starts = self.llm, [], []
        original_eval = llm.eval

        def counting_eval(batch):
            eval_starts.append(len(tokens))  # tokens yielded before this forward
            return original_eval(batch)

        llm.reset()
        if self.sampling_kwargs["temp"] > 0:
            llm.set_seed(0 if seed is None else seed)
        llm.eval = counting_eval
        try:
            for token in llm.generate(list(prompt_ids), repeat_penalty=1.0, reset=True, **self.sampling_kwargs):
                tokens.append(int(token))
                if tokens[-1] in self.eos or len(tokens) >= max_new_tokens:
                    break
        finally:
            del llm.eval  # back to the class's method
        bounds = eval_starts + [len(tokens)]
        per_forward = [end - start for start, end in zip(bounds, bounds[1:])]
        return TurnResult(tokens, per_forward[1:], len(eval_starts))

    def describe(self):
        return dict(self.settings)

    def close(self):
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()

