"""One benchmark run: load the model once, warm every method up, then answer each question with every method in
turn (methods interleaved per question, so machine drift hits all alike), and write the answer files, summary,
report and plots.

Output files appear only when complete: answers go to ``<method>.jsonl.partial`` and are renamed at the end; the
summary, report and plots are written to temporary names and renamed; outputs of an earlier run that this run
would write are removed first, so a crash never leaves a stale file looking like this run's result.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cats.acceptance import make_acceptance
from cats.bench.answers import PARTIAL_SUFFIX, AnswerWriter, new_answer
from cats.bench.memory import PeakRssSampler
from cats.bench.methods import BenchContext, BenchMethod, MethodSettings, MethodUnavailableError, make_method
from cats.bench.plots import ACCEPT_PLOT, SPEEDUP_PLOT, plot_accept_lengths, plot_speedup
from cats.bench.prompts import Conversation, check_prompt_format
from cats.bench.questions import Question, read_questions, select_questions
from cats.bench.report import render_report
from cats.bench.summary import summarize
from cats.errors import InvalidArgumentError
from cats.sampling import check_sampling

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

    def validate(self) -> None:
        sampling = self.settings.sampling
        sampling.validate()
        check_sampling(sampling.temperature, sampling.top_p, sampling.top_k, self.seed)
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
            conversation.add_answer(prompt_ids, result.token_ids)
    except Exception as error:  # a method's crash on one question must not end the run
        answer["error"] = f"{type(error).__name__}: {error}"
    answer["tstamp"] = time.time()
    return answer


def run_bench(config: BenchConfig) -> dict:
    """Run the benchmark; return the summary (also written to ``out/summary.json``)."""
    import cats

    config.validate()
    questions = select_questions(read_questions(config.questions), config.per_category, config.limit)
    out = Path(config.out)
    prepare_out_dir(out, config.methods)
    if config.threads:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    config.settings.threads = threads
    model = cats.load(config.model, dtype=config.dtype)
    check_prompt_format(model, config.prompt_format)
    context = BenchContext(model, config.model, config.settings)

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

    model_id = f"{Path(config.model).name or config.model}-{config.dtype}"
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
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    finally:
        for method in methods.values():
            method.close()
    for writer in writers.values():
        writer.finish()

    sampling = config.settings.sampling
    run = {
        "model": config.model, "dtype": config.dtype, "threads": threads, "questions": len(questions),
        "max_new_tokens": config.max_new_tokens, "question_file": str(config.questions), "turns": config.turns,
        "prompt_format": config.prompt_format, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "seed": (config.seed or 0) if sampling.sampled else None,
        "acceptance": sampling.label(), "warmup": config.warmup, "methods_requested": list(config.methods),
    }
    if sampling.acceptance == "typical":
        rule = make_acceptance(sampling.acceptance, sampling.temperature, sampling.typical_tau, sampling.typical_alpha)
        run.update(typical_tau=rule.tau, typical_alpha=rule.alpha)
    summary = summarize(answers, run, peak_rss_mb={name: rss.peak_mb(name) for name in methods},
                        settings={name: method.describe() for name, method in methods.items()}, skipped=skipped,
                        acceptance={name: method.acceptance for name, method in methods.items()})
    write_plots(summary, answers, out)
    write_atomically(out / REPORT_FILE, render_report(summary, config.methods))
    write_atomically(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")  # last: its presence means done
    return summary


def write_plots(summary: dict, answers: dict[str, list[dict]], out: Path) -> None:
    for filename, draw in ((SPEEDUP_PLOT, lambda path: plot_speedup(summary, path)),
                           (ACCEPT_PLOT, lambda path: plot_accept_lengths(answers, path))):
        temporary = out / f".{filename}.tmp.png"
        if draw(temporary):
            os.replace(temporary, out / filename)
