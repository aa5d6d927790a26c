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
import subprocess
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm
from transformers import AutoConfig

from cats.bench.answers import (
    PARTIAL_SUFFIX,
    AnswerWriter,
    finish_file,
    new_answer,
    read_answers,
)
from cats.bench.catalog import make_method
from cats.bench.cgroup import MemoryCgroup, find_hierarchy
from cats.bench.llama_server import LLAMA_SERVER_METHODS
from cats.bench.memory import PeakRss, how_measured
from cats.bench.methods import (
    HF_METHODS,
    LLAMA_CPP_METHODS,
    NEEDS_LIMIT,
    UNBUDGETED,
    BenchContext,
    BenchMethod,
    MethodSettings,
    MethodUnavailableError,
    find_gguf,
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
from cats.model.weights.rss import evict_page_cache, page_cache_bytes
from cats.model.weights.rss import runtime_baseline as measure
from cats.paths import IMPORT_ROOT
from cats.prompts import Question, read_questions, select_questions
from cats.sampling import check_sampling
from cats.verify.acceptance import make_acceptance

SUMMARY_FILE, REPORT_FILE = "summary.json", "report.md"
TURN_MODES = ("first", "all")


class NothingRanError(InvalidArgumentError):
    """No requested method could run under the budget or limit; ``skipped`` says why for each (a point of a memory
    curve where nothing runs)."""

    def __init__(self, skipped: dict[str, str], limit_mb: float | None):
        super().__init__("none of the requested methods can run under this budget: "
                         + "; ".join(f"{name}: {why}" for name, why in skipped.items()))
        self.skipped, self.limit_mb = skipped, limit_mb


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
    memory_limit: str | None = None  # e.g. "50%+384MiB": each method's process in a memory cgroup with this limit;
    # CATS's methods plan for it as their process budget (unless memory_budget says otherwise)
    prefetch: int | None = None  # with memory_budget: streamed layers read ahead (None: `cats.config.MemoryConfig`'s)
    offload_io: str = "direct"  # with memory_budget: "direct" or "buffered"
    pack_weights: bool = False  # bf16: CATS's methods run on prepacked linears (transformers baselines do not)
    kernels: str = "auto"  # "auto": a GGUF runs on its own blocks; "aten": dequantised to float weights of dtype

    def validate(self) -> None:
        sampling = self.settings.sampling
        sampling.validate()
        check_sampling(sampling.temperature, sampling.top_p, sampling.top_k, self.seed)
        if self.pack_weights:
            check_packing(resolve_dtype(self.dtype), self.memory_budget or self.memory_limit)
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
            if result.drafts is not None:
                choice.setdefault("drafts", []).append(list(result.drafts))
            conversation.add_answer(prompt_ids, result.token_ids)
    except Exception as error:  # a method's crash on one question must not end the run
        answer["error"] = f"{type(error).__name__}: {error}"
    answer["tstamp"] = time.time()
    return answer


def answer_alone(method: BenchMethod, name: str, questions: list[Question], tokenizer, config: BenchConfig,
                 model_id: str, writer: AnswerWriter, progress: bool) -> None:
    """Every question in turn by one method alone in its process (a budgeted run's worker, or a server under the
    limit), each answer written as it comes; failures and progress on stderr."""
    start = time.perf_counter()
    for number, question in enumerate(questions, start=1):
        answer = answer_question(method, question, tokenizer, config, model_id)
        if answer["error"]:
            print(f"cats bench: {name} failed on question {question.question_id}: {answer['error']}", file=sys.stderr)
        writer.write(answer)
        if progress:
            print(f"cats bench: {name} {number}/{len(questions)} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)


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
    budgeted = config.memory_budget is not None or config.memory_limit is not None
    # measured under a budget only (a fresh process costs seconds): that is where the bound uses it
    baseline = runtime_baseline(config.model, threads) if budgeted else {"peak_rss_mb": None}
    if not budgeted:
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
        "memory_budget": config.memory_budget or config.memory_limit, "memory_budget_mb": memory.get("budget_mb"),
        "memory_limit": config.memory_limit, "memory_limit_mb": memory.get("limit_mb"),
        "runtime_baseline_mb": baseline["peak_rss_mb"],
        "peak_rss_method": ("each method in its own process: VmHWM, loading included" if budgeted
                            else f"one process, {how_measured()} (shared weights included)"),
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
        with PeakRss() as rss:
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
    """Every method alone in its own process under the budget, one after the other (see the module docstring); under
    a memory limit each in its own memory cgroup (`cats.bench.cgroup`), llama-server included."""
    tokenizer = load_tokenizer(config.model)
    check_prompt_format(SimpleNamespace(tokenizer=tokenizer, name=config.model), config.prompt_format)
    dtype = resolve_dtype(config.dtype)
    gguf = runnable_gguf(config.model, config.kernels, float_settings=dtype != torch.float32 or config.pack_weights)
    if gguf is not None:  # on its blocks: the workers stream from the file itself, no layer store
        tensors = tensor_index(gguf_metadata(gguf))["tensors"].values()
        weight_bytes = sum(entry["bytes"] for entry in tensors)
        weight_files = [gguf]
    else:
        folder = local_folder(config.model)
        skeleton = build_skeleton(AutoConfig.from_pretrained(folder), dtype)
        weight_bytes = PartSizes.of(skeleton).weights
        store = checkpoint_store(folder, skeleton, dtype)
        del skeleton
        weight_files = sorted(Path(folder).glob("*.safetensors")) + sorted(store.folder.glob("*.safetensors"))
    server_gguf = find_gguf(config.model)
    if server_gguf is not None and server_gguf not in weight_files:
        weight_files.append(server_gguf)
    process_budget = config.memory_budget or config.memory_limit
    budget = parse_budget(process_budget, weight_bytes)
    limit = parse_budget(config.memory_limit, weight_bytes) if config.memory_limit is not None else None
    if limit is not None:
        find_hierarchy()  # no cgroup: one clear error before any method runs
    context, prompt = context_tokens(tokenizer, questions, config)
    answers, peaks, settings, skipped, acceptance, measured = {}, {}, {}, {}, {}, {}
    jobs = Path(tempfile.mkdtemp(prefix=".cats-bench-jobs-", dir=out))
    try:
        for name in config.methods:
            if name in HF_METHODS + LLAMA_CPP_METHODS:  # known not to run under a budget: no process needed
                skipped[name] = UNBUDGETED.format(name=name)
                continue
            if name in LLAMA_SERVER_METHODS and limit is None:
                skipped[name] = NEEDS_LIMIT.format(name=name)
                continue
            evict_page_cache(weight_files)  # every method starts cold
            warm = page_cache_bytes(weight_files)  # pages another process keeps mapped cannot be dropped
            if warm > 16 * MIB:
                print(f"cats bench: warning: {warm / MIB:.0f} MiB of the model files stay in the page cache before "
                      f"{name} (another process maps them?); its run does not start cold", file=sys.stderr)
            if config.progress:
                held = f"a memory limit of {config.memory_limit} ({limit / MIB:.1f} MiB, a cgroup)" if limit else (
                    f"a memory budget of {process_budget} ({budget / MIB:.1f} MiB)")
                print(f"cats bench: {name} under {held}, in its own process", file=sys.stderr, flush=True)
            with (MemoryCgroup(name, limit) if limit is not None else nullcontext()) as cgroup:
                if name in LLAMA_SERVER_METHODS:
                    outcome = run_server(name, config, questions, tokenizer, model_id, context, prompt, cgroup, out)
                else:
                    job = {
                        "model": config.model, "method": name, "dtype": config.dtype, "kernels": config.kernels,
                        "threads": config.settings.threads, "settings": asdict(config.settings),
                        "memory_budget": process_budget, "process_memory": True,
                        "prefetch": config.prefetch, "offload_io": config.offload_io, "context_tokens": context,
                        "prompt_tokens": prompt,
                        "questions": [{"question_id": q.question_id, "category": q.category, "turns": list(q.turns)}
                                      for q in questions],
                        "question_file": str(config.questions), "turns": config.turns,
                        "prompt_format": config.prompt_format, "max_new_tokens": config.max_new_tokens,
                        "warmup": config.warmup, "seed": config.seed, "model_id": model_id,
                        "progress": config.progress,
                        "answers": str(out / f"{name}.jsonl"), "result": str(jobs / f"{name}.result.json"),
                    }
                    outcome = run_worker(name, job, jobs, cgroup)
                usage = cgroup.usage().to_dict() if cgroup is not None else None
            if "skipped" in outcome:
                reason = outcome["skipped"]
                if usage is not None and usage["oom_kills"]:
                    reason = (f"killed by the kernel's OOM killer under the {usage['memory_limit_mb']:.0f} MiB limit "
                              f"(peak charged {usage['peak_memory_mb']:.0f} MiB); {reason}")
                skipped[name] = reason
                print(f"cats bench: skipping {name}: {reason}", file=sys.stderr)
                continue
            answers[name] = read_answers(out / f"{name}.jsonl{PARTIAL_SUFFIX}")
            peaks[name], settings[name] = outcome["peak_rss_mb"], outcome["settings"]
            acceptance[name] = outcome["acceptance"]
            measured[name] = {key: outcome.get(key) for key in ("plan", "storage_read_mb", "page_cache_mb",
                                                                "process_read_mb")}
            measured[name]["cached_at_start_mb"] = round(warm / MIB, 1)
            if usage is not None:
                measured[name]["cgroup"] = usage
        if not answers:
            raise NothingRanError(skipped, round(limit / MIB, 1) if limit else None)
        for name in answers:
            finish_file(out / f"{name}.jsonl")
    finally:
        shutil.rmtree(jobs, ignore_errors=True)
    memory = {"budget_mb": round(budget / MIB, 1), "limit_mb": round(limit / MIB, 1) if limit else None,
              "context_tokens": context, "prompt_tokens": prompt, "methods": measured}
    return answers, peaks, settings, skipped, acceptance, memory


def run_worker(name: str, job: dict, jobs: Path, cgroup: MemoryCgroup | None) -> dict:
    """One CATS method (or hf-offload) in a fresh worker process (in ``cgroup`` from its first instruction): its
    result, or ``{"skipped": why}``."""
    (jobs / f"{name}.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, "-m", "cats.bench.worker", str(jobs / f"{name}.json")],
                          env=_worker_environment(), preexec_fn=cgroup.enter if cgroup is not None else None)
    result_file = jobs / f"{name}.result.json"
    if done.returncode != 0 or not result_file.is_file():
        return {"skipped": f"its worker process failed (exit status {done.returncode}); see the log above"}
    return json.loads(result_file.read_text())


def run_server(name: str, config: BenchConfig, questions: list[Question], tokenizer, model_id: str, context: int,
               prompt: int, cgroup: MemoryCgroup, out: Path) -> dict:
    """llama-server under the memory limit: the server in ``cgroup``, this process only sending the requests (it
    never touches the model file). Its result, or ``{"skipped": why}``."""
    bench_context = BenchContext(None, config.model, config.settings, memory_budget=config.memory_limit,
                                 dtype=config.dtype, context_tokens=context, prompt_tokens=prompt,
                                 progress=config.progress, cgroup=cgroup)
    try:
        method = make_method(name, bench_context)
    except MethodUnavailableError as error:
        return {"skipped": str(error)}
    writer = AnswerWriter(out / f"{name}.jsonl")
    try:
        for _ in range(config.warmup):
            answer_question(method, questions[0], tokenizer, config, model_id)
        answer_alone(method, name, questions, tokenizer, config, model_id, writer, config.progress)
        read = method.storage_read_bytes()
        result = {"peak_rss_mb": method.own_peak_rss_mb(), "settings": method.describe(),
                  "acceptance": method.acceptance, "plan": None, "storage_read_mb": None, "page_cache_mb": None,
                  "process_read_mb": round(read / MIB, 1) if read is not None else None}
    finally:
        writer.close()
        method.close()
    return result


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
