"""One benchmark run: load the model once, warm every method up, then answer each question with every method in
turn (methods interleaved per question, so machine drift hits all alike), and write the answer files, summary,
report and plots.

Under ``--memory-budget`` every method runs alone in its own process (`cats.bench.worker`), one after the other,
with its page cache dropped first: a method's peak RSS is then its own (in one process the methods would share, and
count, each other's memory), and no method reads weights the previous one left in the page cache. The layer store
is made once before the first worker, and the runtime baseline (a fresh process with torch, transformers, CATS, the
tokenizer and a weightless model skeleton) is measured first.

Output files appear only when complete: answers go to ``<method>.jsonl.partial`` and are renamed at the end; the
summary, report and plots are written to temporary names and renamed; outputs of an earlier run that this run
would write are removed first, so a crash never leaves a stale file looking like this run's result.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cats.bench.answers import (
    PARTIAL_SUFFIX,
    AnswerWriter,
    finish_file,
    new_answer,
    read_answers,
)
from cats.bench.catalog import make_method
from cats.bench.memory import PeakRssSampler
from cats.bench.methods import (
    HF_METHODS,
    LLAMA_CPP_METHODS,
    UNBUDGETED,
    BenchContext,
    BenchMethod,
    MethodSettings,
    MethodUnavailableError,
)
from cats.bench.plots import (
    ACCEPT_PLOT,
    SPEEDUP_PLOT,
    plot_accept_lengths,
    plot_speedup,
)
from cats.bench.prompts import Conversation, check_prompt_format
from cats.bench.report import render_report
from cats.bench.summary import summarize
from cats.errors import InvalidArgumentError
from cats.model import load_model
from cats.model.gguf_model import tensor_index
from cats.model.load import runnable_gguf
from cats.model.kernels.packing import check_packing
from cats.model.source import gguf_metadata, load_tokenizer, local_folder, resolve_dtype
from cats.model.weights.budget import MIB, PartSizes, parse_budget
from cats.model.weights.offload import build_skeleton, checkpoint_store
from cats.model.weights.rss import evict_page_cache
from cats.model.weights.rss import runtime_baseline as measure
from cats.paths import IMPORT_ROOT
from cats.prompts import Question, read_questions, select_questions
from cats.sampling import check_sampling
from cats.verify.acceptance import make_acceptance

SUMMARY_FILE, REPORT_FILE = "summary.json", "report.md"
TURN_MODES = ("first", "all")


@dataclass
class BenchConfig:
    model: str
    questions: Path
    out: Path
    methods: list[str]
    max_new_tokens: int = 256
    dtype: str = "float32"
    threads: int | None = None  # None: torch's current setting
    turns: str = "first"  # "first" or "all"
    prompt_format: str = "chat"
    limit: int | None = None
    per_category: int | None = None
    warmup: int = 1  # warm-up runs per method (on the first question, not recorded)
    settings: MethodSettings = field(default_factory=MethodSettings)  # its .sampling: temperature, acceptance, ..
    seed: int | None = None  # sampled runs: base of the per-turn seeds (None: 0); must stay None when greedy
    progress: bool = True
    memory_budget: str | None = None  # e.g. "50%", "300MiB": every method runs under it, each in its own process
    prefetch: int = 2  # with memory_budget: streamed layers read ahead
    offload_io: str = "direct"  # with memory_budget: "direct" or "buffered"
    pack_weights: bool = False  # bf16: CATS's methods run on prepacked linears (transformers baselines do not)
    kernels: str = "auto"  # "auto": a GGUF runs on its own blocks; "aten": dequantised to float weights of dtype

    def validate(self) -> None:
        sampling = self.settings.sampling
        sampling.validate()
        check_sampling(sampling.temperature, sampling.top_p, sampling.top_k, self.seed)
        if self.pack_weights:
            check_packing(resolve_dtype(self.dtype), self.memory_budget)
        self.settings.drafting().validate()
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.turns not in TURN_MODES:
            raise InvalidArgumentError(f"--turns must be one of {', '.join(TURN_MODES)}, got {self.turns!r}")
        for flag, value in (("--limit", self.limit), ("--per-category", self.per_category), ("--warmup", self.warmup)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{flag} must not be negative, got {value}")


def prepare_out_dir(out: Path, methods: list[str]) -> None:
    """Create ``out``, check that it is writable, and remove the files of an earlier run that this run writes."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".cats-write-check-"):
            pass
    except OSError as error:
        raise InvalidArgumentError(f"--out {str(out)!r} is not writable: {error.strerror or error}") from None
    stale = [SUMMARY_FILE, REPORT_FILE, SPEEDUP_PLOT, ACCEPT_PLOT]
    stale += [f"{name}.jsonl{suffix}" for name in methods for suffix in ("", PARTIAL_SUFFIX)]
    for name in stale:
        (out / name).unlink(missing_ok=True)


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def turn_seed(config: BenchConfig, question: Question, turn: int) -> int | None:
    """The seed of one turn of a sampled run: the same for every method (paired runs), different per question and
    turn, independent of which questions were selected. None for greedy runs."""
    if not config.settings.sampling.sampled:
        return None
    return zlib.crc32(f"{config.seed or 0}/{question.question_id}/{turn}".encode())


def answer_question(method: BenchMethod, question: Question, tokenizer, config: BenchConfig, model_id: str) -> dict:
    """Every selected turn of ``question``, each after the method's own earlier answers. An exception is recorded
    in the answer's ``error`` (the turns answered before it are kept); the run goes on."""
    answer = new_answer(question, model_id, method.name)
    choice = answer["choices"][0]
    conversation = Conversation(tokenizer, config.prompt_format)
    turns = question.turns if config.turns == "all" else question.turns[:1]
    try:
        for number, turn in enumerate(turns):
            prompt_ids = conversation.prompt_ids(turn)
            start = time.perf_counter()
            result = method.generate(prompt_ids, config.max_new_tokens, seed=turn_seed(config, question, number))
            wall_s = time.perf_counter() - start
            choice["turns"].append(tokenizer.decode(result.token_ids, skip_special_tokens=True))
            choice["token_ids"].append(result.token_ids)
            choice["new_tokens"].append(len(result.token_ids))
            choice["wall_time"].append(wall_s)
            choice["accept_lengths"].extend(result.accept_lengths)
            choice["decoding_steps"].append(result.target_forwards)
            if result.shallow is not None:
                choice.setdefault("shallow", []).append(result.shallow)
            if result.scheduler is not None:
                choice.setdefault("scheduler", []).append(result.scheduler)
            if result.offload is not None:
                choice.setdefault("offload", []).append(result.offload)
            conversation.add_answer(prompt_ids, result.token_ids)
    except Exception as error:  # a method's crash on one question must not end the run
        answer["error"] = f"{type(error).__name__}: {error}"
    answer["tstamp"] = time.time()
    return answer


def run_bench(config: BenchConfig) -> dict:
    """Run the benchmark; return the summary (also written to ``out/summary.json``)."""
    config.validate()
    questions = select_questions(read_questions(config.questions), config.per_category, config.limit)
    out = Path(config.out)
    prepare_out_dir(out, config.methods)
    if config.threads:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    config.settings.threads = threads
    model_id = f"{Path(config.model).name or config.model}-{config.dtype}"
    # measured under a budget only (a fresh process costs seconds): that is where the bound uses it
    baseline = runtime_baseline(config.model, threads) if config.memory_budget is not None else {"peak_rss_mb": None}
    if config.memory_budget is None:
        answers, peaks, settings, skipped, acceptance = run_in_process(config, questions, out, model_id)
        memory = {}
    else:
        answers, peaks, settings, skipped, acceptance, memory = run_in_workers(config, questions, out, model_id)
    sampling = config.settings.sampling
    run = {
        "model": config.model, "dtype": config.dtype, "threads": threads, "questions": len(questions),
        "max_new_tokens": config.max_new_tokens, "question_file": str(config.questions), "turns": config.turns,
        "prompt_format": config.prompt_format, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "seed": (config.seed or 0) if sampling.sampled else None,
        "acceptance": sampling.label(), "warmup": config.warmup, "methods_requested": list(config.methods),
        "pack_weights": config.pack_weights,
        "memory_budget": config.memory_budget, "memory_budget_mb": memory.get("budget_mb"),
        "runtime_baseline_mb": baseline["peak_rss_mb"],
        "peak_rss_method": ("each method in its own process: VmHWM, loading included" if config.memory_budget
                            else "one process, RSS sampled while each method ran (shared weights included)"),
    }
    if sampling.acceptance == "typical":
        rule = make_acceptance(sampling.acceptance, sampling.temperature, sampling.typical_tau, sampling.typical_alpha)
        run.update(typical_tau=rule.tau, typical_alpha=rule.alpha)
    if memory:
        run.update(context_tokens=memory["context_tokens"], prompt_tokens=memory["prompt_tokens"],
                   prefetch=config.prefetch, offload_io=config.offload_io)
    summary = summarize(answers, run, peak_rss_mb=peaks, settings=settings, skipped=skipped,
                        acceptance=acceptance, memory=memory.get("methods"))
    write_plots(summary, answers, out)
    write_atomically(out / REPORT_FILE, render_report(summary, config.methods))
    write_atomically(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")  # last: its presence means done
    return summary


def runtime_baseline(model: str, threads: int) -> dict:

    return measure(model, threads)


def run_in_process(config: BenchConfig, questions: list[Question], out: Path, model_id: str):
    """Every method in this process on one loaded model, interleaved per question."""

    model = load_model(config.model, dtype=config.dtype, pack_weights=config.pack_weights, kernels=config.kernels)
    check_prompt_format(model, config.prompt_format)
    context = BenchContext(model, config.model, config.settings, progress=config.progress)

    methods: dict[str, BenchMethod] = {}
    skipped: dict[str, str] = {}
    for name in config.methods:
        try:
            methods[name] = make_method(name, context)
        except MethodUnavailableError as error:
            skipped[name] = str(error)
            print(f"cats bench: skipping {name}: {error}", file=sys.stderr)
    if not methods:
        raise InvalidArgumentError("none of the requested methods can run here: " + "; ".join(skipped.values()))

    answers: dict[str, list[dict]] = {name: [] for name in methods}
    writers = {name: AnswerWriter(out / f"{name}.jsonl") for name in methods}
    try:
        with PeakRssSampler() as rss:
            for name, method in methods.items():
                for _ in range(config.warmup):
                    with rss.measuring(name):
                        answer_question(method, questions[0], model.tokenizer, config, model_id)
            with tqdm(total=len(questions) * len(methods), unit="run", disable=not config.progress,
                      file=sys.stderr) as progress:
                for question in questions:
                    for name, method in methods.items():
                        progress.set_description(f"{name} q{question.question_id}")
                        with rss.measuring(name):
                            answer = answer_question(method, question, model.tokenizer, config, model_id)
                        if answer["error"]:
                            progress.write(f"cats bench: {name} failed on question {question.question_id}: "
                                           f"{answer['error']}")
                        writers[name].write(answer)
                        answers[name].append(answer)
                        progress.update()
        own_peaks = {name: method.own_peak_rss_mb() for name, method in methods.items()}  # servers, before they stop
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    finally:
        for method in methods.values():
            method.close()
    for writer in writers.values():
        writer.finish()
    peaks = {name: own_peaks[name] if own_peaks[name] is not None else rss.peak_mb(name) for name in methods}
    return (answers, peaks, {name: method.describe() for name, method in methods.items()}, skipped,
            {name: method.acceptance for name, method in methods.items()})



def context_tokens(tokenizer, questions: list[Question], config: BenchConfig) -> tuple[int, int]:
    """``(context, prompt)`` tokens a budgeted run plans for: the longest prompt (of a later turn: with the earlier
    answers counted as ``max_new_tokens`` tokens each, plus 16 for their chat markup), and that plus
    ``max_new_tokens`` for the KV cache."""
    longest = 0
    for question in questions:
        conversation = Conversation(tokenizer, config.prompt_format)
        turns = question.turns if config.turns == "all" else question.turns[:1]
        for turn in turns:
            prompt_ids = conversation.prompt_ids(turn)
            conversation.add_answer(prompt_ids, [])
        longest = max(longest, len(prompt_ids) + (len(turns) - 1) * (config.max_new_tokens + 16))
    return longest + config.max_new_tokens, longest


def run_in_workers(config: BenchConfig, questions: list[Question], out: Path, model_id: str):
    """Every method alone in its own process under the budget, one after the other (see the module docstring)."""
    import subprocess
    from dataclasses import asdict
    from types import SimpleNamespace

    from transformers import AutoConfig


    tokenizer = load_tokenizer(config.model)
    check_prompt_format(SimpleNamespace(tokenizer=tokenizer, name=config.model), config.prompt_format)
    dtype = resolve_dtype(config.dtype)
    gguf = runnable_gguf(config.model, config.kernels, float_settings=dtype != torch.float32 or config.pack_weights)
    if gguf is not None:  # on its blocks: the workers stream from the file itself, no layer store
        tensors = tensor_index(gguf_metadata(gguf))["tensors"].values()
        budget = parse_budget(config.memory_budget, sum(entry["bytes"] for entry in tensors))
        weight_files = [gguf]
    else:
        folder = local_folder(config.model)
        skeleton = build_skeleton(AutoConfig.from_pretrained(folder), dtype)
        budget = parse_budget(config.memory_budget, PartSizes.of(skeleton).weights)
        store = checkpoint_store(folder, skeleton, dtype)
        del skeleton
        weight_files = sorted(Path(folder).glob("*.safetensors")) + sorted(store.folder.glob("*.safetensors"))
    context, prompt = context_tokens(tokenizer, questions, config)
    answers, peaks, settings, skipped, acceptance, measured = {}, {}, {}, {}, {}, {}
    jobs = Path(tempfile.mkdtemp(prefix=".cats-bench-jobs-", dir=out))
    try:
        for name in config.methods:
            if name in HF_METHODS + LLAMA_CPP_METHODS:  # known not to run under a budget: no process needed
                skipped[name] = UNBUDGETED.format(name=name)
                continue
            job = {
                "model": config.model, "method": name, "dtype": config.dtype, "kernels": config.kernels,
                "threads": config.settings.threads, "settings": asdict(config.settings),
                "memory_budget": config.memory_budget,
                "prefetch": config.prefetch, "offload_io": config.offload_io, "context_tokens": context,
                "prompt_tokens": prompt,
                "questions": [{"question_id": q.question_id, "category": q.category, "turns": list(q.turns)}
                              for q in questions],
                "question_file": str(config.questions), "turns": config.turns,
                "prompt_format": config.prompt_format, "max_new_tokens": config.max_new_tokens,
                "warmup": config.warmup, "seed": config.seed, "model_id": model_id, "progress": config.progress,
                "answers": str(out / f"{name}.jsonl"), "result": str(jobs / f"{name}.result.json"),
            }
            (jobs / f"{name}.json").write_text(json.dumps(job))
            evict_page_cache(weight_files)
            if config.progress:
                print(f"cats bench: {name} under a memory budget of {config.memory_budget} "
                      f"({budget / MIB:.1f} MiB), in its own process", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-m", "cats.bench.worker", str(jobs / f"{name}.json")],
                                  env=_worker_environment())
            result_file = jobs / f"{name}.result.json"
            if done.returncode != 0 or not result_file.is_file():
                skipped[name] = f"its worker process failed (exit status {done.returncode}); see the log above"
                print(f"cats bench: {name} failed: exit status {done.returncode}", file=sys.stderr)
                continue
            result = json.loads(result_file.read_text())
            if "skipped" in result:
                skipped[name] = result["skipped"]
                print(f"cats bench: skipping {name}: {result['skipped']}", file=sys.stderr)
                continue
            answers[name] = read_answers(out / f"{name}.jsonl{PARTIAL_SUFFIX}")
            peaks[name], settings[name] = result["peak_rss_mb"], result["settings"]
            acceptance[name] = result["acceptance"]
            measured[name] = {key: result[key] for key in ("plan", "storage_read_mb", "page_cache_mb")}
        if not answers:
            raise InvalidArgumentError("none of the requested methods can run under this budget: "
                                       + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        for name in answers:
            finish_file(out / f"{name}.jsonl")
    finally:
        shutil.rmtree(jobs, ignore_errors=True)
    memory = {"budget_mb": round(budget / MIB, 1), "context_tokens": context, "prompt_tokens": prompt,
              "methods": measured}
    return answers, peaks, settings, skipped, acceptance, memory


def _worker_environment() -> dict:
    """The worker imports this same CATS (a worktree's src/ too)."""
    environment = dict(os.environ)
    source = str(IMPORT_ROOT)
    environment["PYTHONPATH"] = source + os.pathsep + environment.get("PYTHONPATH", "")
    return environment


def write_plots(summary: dict, answers: dict[str, list[dict]], out: Path) -> None:
    for filename, draw in ((SPEEDUP_PLOT, lambda path: plot_speedup(summary, path)),
                           (ACCEPT_PLOT, lambda path: plot_accept_lengths(answers, path))):
        temporary = out / f".{filename}.tmp.png"
        if draw(temporary):
            os.replace(temporary, out / filename)
