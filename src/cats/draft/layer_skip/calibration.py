"""Finding which sublayers a layer-skip draft should skip, once per model and sparsity, cached in a JSON file.

Objective: *agreement*, the fraction of positions at which the skip model's argmax equals the full model's, on the
full model's own greedy continuations of calibration prompts (teacher forcing). It is the per-token acceptance
rate a skip draft would get from greedy verification right after committed tokens.

How a skip set is scored (`AgreementProbe`): every calibration sequence (prompt + continuation) is packed into one
KV cache with the full model's K/V (positions restart per sequence, a block-diagonal causal mask keeps sequences
apart). A skip set is then scored by ONE skip-model forward over all continuation positions at once, each query
seeing its own sequence's exact K/V up to and including its own position, as a draft token right after committed
tokens would. The probe's new slots are cropped off again, so the packed cache is reused for every evaluation.

Search (`search_skip_set`), for ``size = round(sparsity * 2 * num_layers)`` skipped sublayers:

1. scan: score skipping each sublayer alone (``2 * num_layers`` evaluations, shared by all sparsities);
2. start from the ``size`` sublayers whose single skip hurts agreement least;
3. stochastic local search (``budget`` evaluations): swap one skipped sublayer for a kept one (half the time a
   uniformly random one, half the time one that hurt little alone); keep the swap if agreement does not drop.
   Sets already scored are not rescored.

This is greedy-by-importance plus random local search; CAS-Spec/SWIFT use random search plus Bayesian
optimisation over the same space. The scan captures most of the signal on the models we tried (a sublayer that is
nearly an identity scores ~1 alone), and the local search fixes interactions at a fixed, predictable cost.

Cache: ``$CATS_CACHE/skip-sets/<model fingerprint>.json``, written atomically with a CRC-32 of its content
(`cats.cache_files`: a file that does not match it is removed, with a notice, and calibrated again); where it has
no entry for a sparsity, the skip sets shipped in ``skip_sets/`` beside this module (the default model's, and
Qwen2.5-Coder-1.5B-Instruct Q4_K_M's, calibrated with the default settings) are used before calibrating. A file holds one entry per sparsity with the
settings and prompts digest it was calibrated with; a file made for another fingerprint (`cats.model.identity`) is
ignored.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cats.cache_files import Damaged, clean_stale, discard, notice, read_json, write_json
from cats.draft.layer_skip.drafter import SkipModel, SkipSet
from cats.errors import InvalidArgumentError, NoTokenizerError
from cats.model import LayeredModel
from cats.model.identity import model_fingerprint, model_identity
from cats.paths import cache_root, shared_path
from cats.prompts import chat_prompt_ids, encode_prompt, read_prompt_file
from cats.sampling import greedy_tokens

FORMAT = "cats-skip-sets/1"
SHIPPED = Path(__file__).with_name("skip_sets")  # skip sets shipped with CATS, by model fingerprint
DEFAULT_SPARSITIES = (0.4, 0.6)
SHAREGPT_SAMPLE = Path("shared") / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
MAX_PROMPT_TOKENS = 256

# a small, varied default set (never MT-Bench or Spec-Bench: those are evaluation sets)
BUILTIN_PROMPTS = (
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize the plot of a story about a lost dog that finds its way home.",
    "What are three tips for staying focused while studying?",
    "Translate 'The weather is nice today, let's go for a walk' into French and explain the grammar.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "List the planets of the solar system with one fact about each.",
    "Write a short, polite email asking a colleague to review a document by Friday.",
)


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration depends on besides the model (stored with each cached skip set)."""

    tokens: int = 32  # greedy continuation tokens per prompt (the positions scored)
    budget: int = 200  # local-search evaluations per sparsity, after the scan
    seed: int = 0
    prompts: str = "builtin"  # where the prompts came from (a file path, or "builtin")
    prompts_sha256: str = ""  # digest of the prompt token ids

    def validate(self) -> None:
        if self.tokens < 2:
            raise InvalidArgumentError(f"calibration needs at least 2 continuation tokens per prompt, got {self.tokens}")
        if self.budget < 0:
            raise InvalidArgumentError(f"the calibration budget must not be negative, got {self.budget}")


@dataclass
class CalibrationResult:
    sparsity: float
    skip: SkipSet
    agreement: float  # of the skip model with the full model, on the calibration positions
    evaluations: int  # skip sets scored for this sparsity (the shared scan included)
    seconds: float
    settings: CalibrationSettings

    def to_dict(self) -> dict:
        return {"sparsity": self.sparsity, "skipped": self.skip.to_dict(), "agreement": round(self.agreement, 6),
                "evaluations": self.evaluations, "seconds": round(self.seconds, 3), "settings": asdict(self.settings)}

    @staticmethod
    def from_dict(data: dict) -> "CalibrationResult":
        return CalibrationResult(float(data["sparsity"]), SkipSet.from_dict(data["skipped"]), float(data["agreement"]),
                                 int(data["evaluations"]), float(data["seconds"]), CalibrationSettings(**data["settings"]))


# ---------------------------------------------------------------------------------------------- prompts
def default_prompt_source() -> Path | None:
    """The ShareGPT sample in ``../shared/data`` (next to the working directory or the project), if present."""
    candidate = shared_path(SHAREGPT_SAMPLE)
    return candidate if candidate is not None and candidate.is_file() else None


def calibration_prompts(model: LayeredModel, source: str | Path | None = None, count: int = 8) -> tuple[list[list[int]], str]:
    """Token ids of ``count`` calibration prompts and a label of their source: the prompt file ``source`` (ShareGPT
    JSON or question JSON lines, see `cats.prompts`), else the ShareGPT sample in ``../shared/data`` when
    present, else the built-in prompts. Chat-template models get each prompt as one user message."""
    if model.tokenizer is None:
        raise NoTokenizerError(f"model {model.name!r} has no tokenizer: pass calibration prompts as token ids",
                               model.name)
    if count < 1:
        raise InvalidArgumentError(f"calibration needs at least one prompt, got {count}")
    path = Path(source) if source is not None else default_prompt_source()
    texts = [t for t in read_prompt_file(path).texts if t] if path is not None else list(BUILTIN_PROMPTS)
    if not texts:
        raise InvalidArgumentError(f"prompt file {str(path)!r} holds no prompts")
    chat = bool(getattr(model.tokenizer, "chat_template", None))
    prompts = []
    for text in texts:
        if len(prompts) == count:
            break
        if chat:
            ids, _ = chat_prompt_ids(model, text, MAX_PROMPT_TOKENS)
        else:
            ids = encode_prompt(model, text)[-MAX_PROMPT_TOKENS:]
        if ids:
            prompts.append(ids)
    return prompts, str(path) if path is not None else "builtin"


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- the objective
@torch.inference_mode()
def greedy_continuation(model: LayeredModel, prompt: list[int], tokens: int) -> list[int]:
    """The full model's greedy continuation of ``prompt``, ``tokens`` long (end of sequence ignored): plain decoding,
    a prefill and then one forward per token, the same operations as method ``ar``."""
    cache = model.new_cache(capacity=len(prompt) + tokens)
    hidden = model.forward_layers(model.embed(torch.tensor(prompt)), 0, model.num_layers, cache)
    continuation = [int(greedy_tokens(model.head(hidden[0, -1])))]
    while len(continuation) < tokens:
        hidden = model.forward_layers(model.embed(torch.tensor(continuation[-1:])), 0, model.num_layers, cache)
        continuation.append(int(greedy_tokens(model.head(hidden[0]))[0]))
    return continuation


class AgreementProbe:
    """Scores skip sets by agreement with the full model on teacher-forced calibration sequences (module docs)."""

    def __init__(self, model: LayeredModel, prompts: Sequence[Sequence[int]], tokens: int):
        self.model = model
        tokens_in, positions, owners, query_rows, targets = [], [], [], [], []
        for owner, prompt in enumerate(prompts):
            continuation = greedy_continuation(model, list(prompt), tokens)
            sequence = list(prompt) + continuation[:-1]  # inputs; the last continuation token is a target only
            start = len(tokens_in)
            # a query per continuation token: the input before it predicts it
            query_rows += [start + len(prompt) - 1 + i for i in range(len(continuation))]
            targets += continuation
            tokens_in += sequence
            positions += range(len(sequence))
            owners += [owner] * len(sequence)
        self.tokens = torch.tensor(tokens_in, dtype=torch.long)
        self.positions = torch.tensor(positions, dtype=torch.long)
        owners_t = torch.tensor(owners)
        self.cache = model.new_cache()
        same = owners_t[:, None] == owners_t[None, :]
        causal = self.positions[:, None] >= self.positions[None, :]
        with torch.inference_mode():
            hidden = model.forward_layers(model.embed(self.tokens), 0, model.num_layers, self.cache,
                                          position_ids=self.positions, attend=same & causal)
            rows = torch.tensor(query_rows)
            full = model.head(hidden[0, rows]).argmax(-1)
        self.query_rows, self.targets = rows, torch.tensor(targets)
        self.query_tokens, self.query_positions = self.tokens[rows], self.positions[rows]
        # a query sees its own sequence's slots up to its own position (its own exact slot included), none of the
        # probe's new slots
        past = (same & causal)[rows]
        self.attend = torch.cat([past, torch.zeros(len(rows), len(rows), dtype=torch.bool)], dim=1)
        self.full_agreement = float((full == self.targets).double().mean())  # 1 up to floating-point ties
        self.evaluations = 0

    @property
    def num_positions(self) -> int:
        return int(self.targets.numel())

    @torch.inference_mode()
    def agreement(self, skip: SkipSet) -> float:
        """Fraction of calibration positions where the skip model's argmax is the full model's greedy token."""
        model, length = self.model, self.tokens.numel()
        try:
            hidden = SkipModel(model, skip).forward(self.query_tokens, self.cache, self.query_positions, self.attend)
            predicted = model.head(hidden[0]).argmax(-1)
        finally:
            self.cache.crop(length)
        self.evaluations += 1
        return float((predicted == self.targets).double().mean())


# ---------------------------------------------------------------------------------------------- the search
def skip_size(sparsity: float, num_layers: int) -> int:
    if not 0.0 < sparsity < 1.0:
        raise InvalidArgumentError(f"sparsity must lie in (0, 1), got {sparsity:g}")
    return max(1, round(sparsity * 2 * num_layers))


def scan_sublayers(score: Callable[[SkipSet], float], num_layers: int, progress=None) -> list[float]:
    """Agreement with each single sublayer skipped (index = sublayer number, see `SkipSet.sublayers`)."""
    scores = []
    for sublayer in range(2 * num_layers):
        scores.append(score(SkipSet.from_sublayers([sublayer])))
        if progress is not None:
            progress.update()
    return scores


def search_skip_set(score: Callable[[SkipSet], float], num_layers: int, size: int, scan: Sequence[float],
                    budget: int, seed: int = 0, progress=None) -> tuple[SkipSet, float, int]:
    """The best skip set of ``size`` sublayers found (module docs); returns it, its agreement and the number of
    sets scored."""
    total = 2 * num_layers
    if not 1 <= size < total:
        raise InvalidArgumentError(f"cannot skip {size} of {total} sublayers")
    order = sorted(range(total), key=lambda j: (-scan[j], -j))  # least harmful first; ties: deeper first
    rank = {j: r for r, j in enumerate(order)}
    scored: dict[frozenset, float] = {}

    def evaluate(sublayers: frozenset) -> float:
        if sublayers not in scored:
            scored[sublayers] = score(SkipSet.from_sublayers(sublayers))
        return scored[sublayers]

    current = frozenset(order[:size])
    best = evaluate(current)
    rng = random.Random(seed)
    for _ in range(budget):
        if progress is not None:
            progress.update()
        kept = sorted(set(range(total)) - current, key=rank.get)
        removed = rng.choice(sorted(current))
        if rng.random() < 0.5:  # prefer sublayers that hurt little alone, but try any of them
            added = kept[min(int(rng.expovariate(4.0 / len(kept))), len(kept) - 1)]
        else:
            added = rng.choice(kept)
        trial = (current - {removed}) | {added}
        if trial in scored:
            continue
        value = evaluate(trial)
        if value >= best:
            current, best = trial, value
    return SkipSet.from_sublayers(current), best, len(scored)


# ---------------------------------------------------------------------------------------------- the cache
def skip_set_file(model: LayeredModel) -> Path:
    return cache_root() / "skip-sets" / f"{model_fingerprint(model)}.json"


def _sparsity_key(sparsity: float) -> str:
    return f"{sparsity:g}"


def shipped_skip_set_file(model: LayeredModel) -> Path:
    """Skip sets that ship with CATS, calibrated with the default settings (for the default model)."""
    return SHIPPED / f"{model_fingerprint(model)}.json"


def load_cached(model: LayeredModel, path: Path | None = None) -> dict[str, CalibrationResult]:
    """The cached skip sets of this model by sparsity key (``"0.4"``); empty when none (or the file belongs to
    another model fingerprint, or is unreadable). ``path``: another skip-set file (default: the cache's, whose
    checksum is checked: a damaged one is removed with a notice, and its skip sets are calibrated again)."""
    cached = path is None
    path = path or skip_set_file(model)
    try:
        if cached:
            clean_stale(path.parent)
        data = read_json(path) if cached else json.loads(path.read_text())
        if data.get("format") != FORMAT or data["model"]["fingerprint"] != model_fingerprint(model):
            return {}
        results = {key: CalibrationResult.from_dict(entry) for key, entry in data["skip_sets"].items()}
    except Damaged as damage:
        notice(f"the cached skip sets are damaged: {damage}; removed, they are calibrated again when needed")
        discard(path)
        return {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    for result in results.values():
        result.skip.validate(model.num_layers)
    return results


def store(model: LayeredModel, results: Sequence[CalibrationResult]) -> Path:
    """Add (or replace) these sparsities' entries in the model's skip-set file; returns the file."""
    path = skip_set_file(model)
    entries = {key: result.to_dict() for key, result in load_cached(model).items()}
    for result in results:
        entries[_sparsity_key(result.sparsity)] = result.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "model": model_identity(model), "skip_sets": dict(sorted(entries.items()))}
    write_json(path, data)
    return path


# ---------------------------------------------------------------------------------------------- entry points
def calibrate(model: LayeredModel, sparsities: Sequence[float] = DEFAULT_SPARSITIES,
              prompts: Sequence[Sequence[int]] | None = None, prompt_source: str | Path | None = None,
              tokens: int = 32, budget: int = 200, seed: int = 0, num_prompts: int = 8, force: bool = False,
              progress: bool = False, save: bool = True) -> list[CalibrationResult]:
    """Find (or reuse from the cache) a skip set for each sparsity.

    ``prompts``: token-id prompts; None = `calibration_prompts` from ``prompt_source`` (``num_prompts`` of them).
    A cached entry calibrated with the same settings and prompts is reused unless ``force``. ``progress`` shows a
    tqdm bar on stderr."""
    from tqdm import tqdm

    sizes = [skip_size(s, model.num_layers) for s in sparsities]
    source = "token ids"
    if prompts is None:
        prompts, source = calibration_prompts(model, prompt_source, num_prompts)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgumentError("calibration prompts must be non-empty")
    settings = CalibrationSettings(tokens=tokens, budget=budget, seed=seed, prompts=source,
                                   prompts_sha256=prompts_digest(prompts))
    settings.validate()
    cached = {} if force else load_cached(model)
    results: dict[float, CalibrationResult] = {}
    todo = []
    for sparsity, size in zip(sparsities, sizes):
        hit = cached.get(_sparsity_key(sparsity))
        if hit is not None and hit.settings == settings:
            results[sparsity] = hit
        else:
            todo.append((sparsity, size))
    if todo:
        start = time.perf_counter()
        with tqdm(total=2 * model.num_layers + budget * len(todo), unit="set", disable=not progress,
                  file=sys.stderr, desc="calibrating: continuations") as bar:
            probe = AgreementProbe(model, prompts, tokens)
            bar.set_description("calibrating: scan")
            scan = scan_sublayers(probe.agreement, model.num_layers, bar)
            scan_seconds = time.perf_counter() - start
            for sparsity, size in todo:
                bar.set_description(f"calibrating: sparsity {sparsity:g}")
                began = time.perf_counter()
                skip, agreement, evaluations = search_skip_set(probe.agreement, model.num_layers, size, scan, budget,
                                                               seed, bar)
                results[sparsity] = CalibrationResult(sparsity, skip, agreement, evaluations + len(scan),
                                                      scan_seconds + time.perf_counter() - began, settings)
        if save:
            store(model, [results[s] for s, _ in todo])
    return [results[s] for s in sparsities]


def load_or_calibrate(model: LayeredModel, sparsity: float, progress: bool = True) -> CalibrationResult:
    """The cached skip set of this model at ``sparsity`` (whatever prompts it was calibrated with); calibrated with
    the default settings, and cached, when there is none."""
    skip_size(sparsity, model.num_layers)
    hit = load_cached(model).get(_sparsity_key(sparsity))
    if hit is None:  # the skip sets shipped for this model, if any: first use without a calibration
        hit = load_cached(model, shipped_skip_set_file(model)).get(_sparsity_key(sparsity))
    if hit is not None:
        return hit
    if progress:
        print(f"cats: no cached skip set for {model.name or 'this model'} at sparsity {sparsity:g}; calibrating "
              f"(once; run 'cats calibrate' to choose prompts and budget)", file=sys.stderr)
    prompts = None
    if model.tokenizer is None:  # a model without a tokenizer: a fixed pseudo-random prompt set of token ids
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, model.vocab_size, (16,), generator=generator).tolist() for _ in range(4)]
    return calibrate(model, [sparsity], prompts=prompts, progress=progress)[0]

