"""One method of a ``cats bench --memory-budget`` run, alone in a fresh process, so that the peak RSS it reports
(``VmHWM``, loading included) is that method's own: ``python -m cats.bench.worker JOB.json``.

The parent (`cats.bench.runner`) writes the job (model, method, settings, budget, questions, output paths), runs
the workers one after the other, and merges their answer files and results into one summary. A worker writes its
answers to ``<method>.jsonl.partial`` (the parent renames it when the run completes) and its measurements to the
job's ``result`` file: peak RSS, the memory plan, the bytes it read from storage and how much of its weight files
the kernel still caches at the end. A method that cannot run under the budget reports why (``skipped``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cats.api import prepare, quiet_transformers
from cats.bench.answers import AnswerWriter
from cats.bench.catalog import make_method
from cats.bench.methods import (
    BenchContext,
    CatsMethod,
    MethodSettings,
    MethodUnavailableError,
    SamplingSettings,
)
from cats.bench.runner import BenchConfig, answer_alone, answer_question
from cats.config import KernelConfig, MemoryConfig
from cats.errors import CatsError
from cats.methods import METHODS as CATS_METHODS
from cats.methods import method as cats_method
from cats.model.source import load_tokenizer
from cats.model.weights.rss import page_cache_bytes, peak_rss_bytes, storage_read_bytes
from cats.prompts import Question

MIB = 1 << 20


def run_job(job: dict) -> dict:
    import torch


    torch.set_num_threads(job["threads"])
    settings = MethodSettings(**{**job["settings"],
                                 "sampling": SamplingSettings(**job["settings"].get("sampling", {}))})
    name, source = job["method"], job["model"]
    questions = [Question(q["question_id"], q["category"], tuple(q["turns"])) for q in job["questions"]]
    config = BenchConfig(model=source, questions=Path(job["question_file"]), out=Path(job["answers"]).parent,
                         methods=[name], max_new_tokens=job["max_new_tokens"], dtype=job["dtype"],
                         turns=job["turns"], prompt_format=job["prompt_format"], warmup=job["warmup"],
                         seed=job.get("seed"), settings=settings)
    try:
        model, tokenizer = None, None
        if name in CATS_METHODS:
            drafting = settings.drafting(cats_method(name).settings)  # what the method's drafter gets, planned for
            memory = MemoryConfig(budget=job["memory_budget"], offload_io=job["offload_io"], prefetch=job["prefetch"],
                                  process=bool(job.get("process_memory", False)))
            tokenizer = load_tokenizer(source)  # before planning: the runtime the process budget measures holds it
            model = prepare(source, name, drafting, memory, KernelConfig(dtype=job["dtype"], kernels=job["kernels"]),
                            context_tokens=job["context_tokens"], prompt_tokens=job.get("prompt_tokens"),
                            tokenizer=tokenizer)  # one tokenizer in the process, as in the runtime baseline
            if job.get("progress") and model.memory_plan is not None:
                print(model.memory_plan.describe(), file=sys.stderr, flush=True)
        else:  # hf-offload loads its model without one; first, as the runtime baseline does
            tokenizer = load_tokenizer(source)
        context = BenchContext(model, source, settings, memory_budget=job["memory_budget"], dtype=job["dtype"],
                               process_memory=bool(job.get("process_memory", False)),
                               context_tokens=job["context_tokens"], prompt_tokens=job.get("prompt_tokens"),
                               progress=bool(job.get("progress", True)))
        method = make_method(name, context)
    except (MethodUnavailableError, CatsError) as error:
        return {"skipped": str(error)}
    writer = AnswerWriter(Path(job["answers"]))
    try:
        for _ in range(config.warmup):
            answer_question(method, questions[0], tokenizer, config, job["model_id"])
        read_before = storage_read_bytes()
        answer_alone(method, name, questions, tokenizer, config, job["model_id"], writer, bool(job.get("progress")))
        read_after = storage_read_bytes()
        if isinstance(method, CatsMethod) and model.weights is not None:
            cached = page_cache_bytes(model.weights.store_files())
        elif hasattr(method, "cached_files"):
            cached = page_cache_bytes(method.cached_files())
        else:
            cached = None
        result = {
            "peak_rss_mb": round(peak_rss_bytes() / MIB, 1),
            "settings": method.describe(),
            "acceptance": method.acceptance,
            "plan": model.memory_plan.to_dict() if model is not None and model.memory_plan is not None else None,
            "storage_read_mb": round((read_after - read_before) / MIB, 1) if read_before is not None else None,
            "page_cache_mb": round(cached / MIB, 1) if cached is not None else None,
            "process_read_mb": round(read_after / MIB, 1) if read_after is not None else None,  # loading included
        }
    finally:
        writer.close()
        method.close()
        if model is not None:
            model.close()
    return result


def main(argv: list[str]) -> int:

    quiet_transformers()
    job = json.loads(Path(argv[0]).read_text())
    result = run_job(job)
    Path(job["result"]).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
