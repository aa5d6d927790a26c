"""The memory budget: parsing ``300MiB`` / ``1.5GB`` / ``50%``, and the planner that splits a budget between what
stays resident and what streams from the layer store.

What the planner keeps resident, in this order of priority:

1. the parts every token needs: the embeddings, the final norm and the lm_head (one copy when tied);
2. the adapters (draft / shallow blocks, and the lm_head rows of a reduced draft vocabulary);
3. the KV cache for ``context_tokens`` tokens, and the activations of the largest tree verified in one pass;
4. the decoder layers every draft step runs, ``[0, L_sv)`` (``min_resident_layers``);
5. if anything streams: a pool of ``prefetch + 1`` layer buffers (the layer computing and ``prefetch`` read ahead);
6. as many further layers as still fit: R of them resident, the other ``L - R`` streamed.

The streamed layers are the deepest ones, ``[R, L)``, unless the method drafts by skipping the streamed layers and
the model has a calibrated stream order (``MemoryNeeds.stream_order``, `cats.model.weights.stream_order`): then they
are the first ``L - R`` layers of that order, the layers its draft skips best, and the lm_head may stream too, all but
the rows of the draft's vocabulary (``MemoryNeeds.head_draft_rows``, `cats.model.streamed_head`), where
`skip_draft_rate` rates that plan higher. Either way every forward pass reads them in one ascending sweep, once per
verification pass, however many tokens the pass verifies. Every byte count
comes from the model's real parameter sizes (`PartSizes.of`); KV cache and activations are estimates from the config
(`cats.model.weights.transient`). A budget below the minimum is refused with a message that names the minimum.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from cats.errors import InvalidArgumentError
from cats.model.kernels.gguf_modules import GGUFLinear, GGUFRows
from cats.model.weights.skip_rate import skip_draft_rate
from cats.model.weights.transient import prompt_text

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
    "k": KIB, "m": MIB, "g": GIB, "t": TIB,  # bare letters are binary, as in `ulimit` and docker's "300m"
}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")
DEFAULT_CONTEXT_TOKENS = 2048
DEFAULT_PREFETCH = 2
# Under a process budget the kernel also charges the page cache of the libraries' files (torch, CATS's kernels,
# Python): the pages a decode step runs or reads must stay cached, or every step faults them back in from disk. The
# runtime measurement leaves file pages out (most were touched once, at import), so the plan keeps this much for
# them. Measured on Qwen2.5-Coder-1.5B under a cgroup limit (`cats bench --memory-limit`, 4 x 32 tokens): a plan
# that left 1-4 MiB of the limit unplanned took 660-3,600 major faults, one that left 13 MiB up to 880, and 23-26
# MiB 160-180 (most of them while loading).
LIBRARY_PAGES = 32 << 20
END_ROWS = 8  # draft-vocabulary rows planned for end-of-sequence ids above its lowest ids (`cats.model.streamed_head`)
STORE_ALIGNMENT = 4096  # layer files and stream buffers are aligned to this (O_DIRECT needs it)


class BudgetTooSmallError(InvalidArgumentError):
    """The budget cannot hold the resident minimum; the message names the minimum."""


def parse_budget(text: str | int, weight_bytes: int) -> int:
    """Bytes of a budget given as bytes (``123456``), with a unit (``300MiB``, ``1.5GB``, ``300m``), as a
    percentage of the model's weight bytes in the format it runs in (``50%``: of a GGUF file's blocks), or as a sum
    of these (``50%+384MiB``: half the model plus room for the runtime)."""
    if isinstance(text, bool):
        raise InvalidArgumentError(f"memory budget must be bytes, a size like 300MiB or a percentage, got {text!r}")
    if isinstance(text, int):
        return _budget_term(text, str(text), weight_bytes)
    return sum(_budget_term(term, str(text), weight_bytes) for term in str(text).split("+"))


def _budget_term(term: str | int, text: str, weight_bytes: int) -> int:
    if isinstance(term, int):
        value, unit = float(term), ""
    else:
        match = _BUDGET.match(term)
        if not match:
            raise InvalidArgumentError(
                f"cannot read memory budget {text!r}: use bytes (123456), a size (300MiB, 1.5GB, 512m), a percentage "
                "of the model's bytes (50%), or a sum of these (50%+384MiB)")
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if value <= 0:
            raise InvalidArgumentError(f"memory budget {text!r}: a percentage must be positive")
        return int(weight_bytes * value / 100)
    if unit not in UNITS:
        raise InvalidArgumentError(f"memory budget {text!r}: unknown unit {unit!r}; use B, KB, MB, GB, KiB, MiB, GiB or %")
    budget = int(value * UNITS[unit])
    if budget <= 0:
        raise InvalidArgumentError(f"memory budget {text!r} must be positive")
    return budget


def mib(n: int | float) -> str:
    """A byte count for people: MiB, or KiB below one MiB."""
    return f"{n / MIB:.1f} MiB" if n >= MIB or n == 0 else f"{n / KIB:.1f} KiB"


def budget_text(n: int) -> str:
    """The smallest round budget of at least ``n`` bytes, as the user would type it (KiB below 10 MiB)."""
    return f"{-(-n // KIB)}KiB" if n < 10 * MIB else f"{-(-n // MIB)}MiB"


def round_up(n: int, alignment: int = STORE_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def numel(shape) -> int:
    """Elements of a tensor of ``shape``."""
    count = 1
    for dim in shape:
        count *= dim
    return count


@dataclass
class PartSizes:
    """Bytes of each part of a model's weights, from its real parameter sizes (tied weights counted once)."""

    embed: int
    norm: int
    lm_head: int  # 0 when tied to the embeddings
    layers: list[int]
    weight_bytes: int | None = None  # the model's weight bytes where ``embed`` counts less than the whole table
    embed_rows: bool = False  # ``embed`` is the rows a context reads of a table that stays in the mapped file
    head_row_bytes: int = 0  # one lm_head row as the model holds it (a reduced draft vocabulary gathers such rows)
    head_streams: bool = False  # the lm_head can stream under a plan: an untied head on GGUF blocks, in its stored row
    # order and without bias (`cats.model.streamed_head`)
    stored_layers: list[int] | None = None  # each layer's bytes as streaming reads them where that differs from its
    # size: a layer store's quantised blocks (`cats.model.weights.blocks`, fewer), a GGUF file's span of the layer
    # (aligned: a little more); None: the layers' own sizes

    def stored(self, layer: int) -> int:
        return self.layers[layer] if self.stored_layers is None else self.stored_layers[layer]

    @classmethod
    def of(cls, hf_model) -> "PartSizes":
        """Sizes of a transformers ``*ForCausalLM`` (its parameters may be on the meta device)."""
        def size(module) -> int:
            return sum(p.numel() * p.element_size() for p in module.parameters())

        decoder = hf_model.model
        head, embed = hf_model.lm_head, decoder.embed_tokens
        if isinstance(head, GGUFRows) and isinstance(embed, GGUFRows):  # one tensor of the file: the same rows
            tied = head.blocks.data_ptr() == embed.blocks.data_ptr() and head.blocks.shape == embed.blocks.shape
        else:
            tied = head.weight is embed.weight
        row = head.blocks[0] if isinstance(head, GGUFRows) else head.weight[0]
        streams = not tied and isinstance(head, GGUFLinear) and head.order is None and head.bias is None
        return cls(embed=size(decoder.embed_tokens), norm=size(decoder.norm),
                   lm_head=0 if tied else size(hf_model.lm_head), head_row_bytes=row.numel() * row.element_size(),
                   head_streams=streams,
                   layers=[size(layer) for layer in decoder.layers[: hf_model.config.num_hidden_layers]])

    @property
    def always_resident(self) -> int:
        return self.embed + self.norm + self.lm_head

    @property
    def weights(self) -> int:
        return self.weight_bytes if self.weight_bytes is not None else self.always_resident + sum(self.layers)

    def embed_rows_read(self, row_bytes: int, tokens: int) -> None:
        """Plan the embedding table for the rows ``tokens`` tokens read (each row's pages) instead of the whole table:
        for a table mapped from its file and not shared with the lm_head, a token reads only its row, and the kernel
        reads (and charges) only those pages."""
        if self.lm_head == 0 or self.embed_rows:
            return
        rows = tokens * (round_up(row_bytes) // STORE_ALIGNMENT + 1) * STORE_ALIGNMENT  # a row may cross a page
        if rows < self.embed:
            self.weight_bytes, self.embed, self.embed_rows = self.weights, rows, True


@dataclass
class MemoryNeeds:
    """What must fit besides the weights the planner chooses; see the module docstring."""

    context_tokens: int = DEFAULT_CONTEXT_TOKENS  # KV cache reservation: prompt + new tokens (+ the tree in flight)
    prompt_tokens: int | None = None  # the longest prompt (its prefill's activations); None: context_tokens
    min_resident_layers: int = 0  # layers [0, L_d) that every draft step runs stay resident
    shallow_layers: int = 0  # L_sv of the cascade: kept resident when they fit, else they stream (see describe)
    adapter_bytes: int = 0  # draft / shallow adapters' blocks and norms
    drafter_bytes: int = 0  # drafters' own tables (token recycling's candidates per token id)
    head_rows: int = 0  # lm_head rows the adapters' reduced draft vocabularies gather (each kept as the head holds it,
    # with its token id)
    max_tree_tokens: int = 1  # tokens verified in one pass (activations are reserved for this many)
    extra_cache_layers: int = 0  # adapters' own KV-cache layers
    speculation: str | None = None  # "chain", "tree" or "cascade" when the draft size is left to the budget: the plan
    # then reserves the largest speculation bucket that fits (max_tree_tokens), and the drafter picks among those
    pass_sizes: tuple[int, ...] = ()  # with speculation: the tokens of one pass of each bucket, the plan's candidates
    bare_passes: dict[int, int] = field(default_factory=dict)  # the cascade's: each pass size -> that of its bare tree,
    # the pass it verifies without corrections (while a shallow layer streams), planned where the first does not fit
    prefetch: int = DEFAULT_PREFETCH  # streamed layers read ahead of the one computing
    prefetch_fixed: bool = True  # False: the plan may read fewer ahead (down to 1) where the buffers would not fit
    runtime_bytes: int = 0  # the process's memory before any weight is read (interpreter, libraries, tokenizer), as
    # measured when the budget is the whole process's (`cats.config.MemoryConfig.process`); 0: the budget is the model's
    library_pages_bytes: int = 0  # with runtime_bytes: page cache kept for the libraries' pages every step reads
    # (code, tables), which the kernel charges to the process (`LIBRARY_PAGES`)
    skip_streamed: bool = False  # the method drafts by skipping the streamed layers: stream them in the model's
    # calibrated stream order where one is known (`cats.model.weights.stream_order`)
    stream_order: tuple[int, ...] = ()  # layers in the order they stream (the first n when n must); () = deepest first
    stream_agreement: tuple[float, ...] = ()  # with stream_order: a skip draft's calibrated agreement with its first n
    # layers skipped (``[n - 1]``)
    head_draft_rows: int = 0  # with stream_order: the lm_head rows a skip draft reads out through where the head itself
    # streams (its draft vocabulary); > 0 lets the plan stream the head after the last layer where that is estimated
    # to commit more tokens per time (`skip_draft_rate`); 0: the head stays resident
    draft_tokens: int = 4  # with head_draft_rows: the skip draft's chain length, for that estimate
    prompt_captures: bool = True  # a drafter keeps layers' states of the prompt: its prefill holds more (`transient`)
    prompt_chunk: int = 0  # without captures: a prompt runs (and is priced) this many tokens a forward; 0: all at once

    def validate(self, num_layers: int) -> None:
        if self.context_tokens < 1:
            raise InvalidArgumentError(f"context_tokens must be at least 1, got {self.context_tokens}")
        if not 0 <= self.min_resident_layers <= num_layers:
            raise InvalidArgumentError(f"min_resident_layers must lie in [0, {num_layers}], got {self.min_resident_layers}")
        if self.prefetch < 0 or self.prompt_chunk < 0:
            raise InvalidArgumentError(f"prefetch and prompt_chunk must not be negative, got {self.prefetch} and "
                                       f"{self.prompt_chunk}")
        if self.max_tree_tokens < 1:
            raise InvalidArgumentError(f"max_tree_tokens must be at least 1, got {self.max_tree_tokens}")
        if self.prompt_tokens is not None and not 1 <= self.prompt_tokens <= self.context_tokens:
            raise InvalidArgumentError(f"prompt_tokens must lie in [1, context_tokens], got {self.prompt_tokens}")
        if len(set(self.stream_order)) != len(self.stream_order) or not all(
                self.min_resident_layers <= i < num_layers for i in self.stream_order):
            raise InvalidArgumentError(f"stream_order must list distinct layers of [{self.min_resident_layers}, "
                                       f"{num_layers}) (the layers below min_resident_layers stay), got "
                                       f"{self.stream_order}")
        if self.stream_agreement and len(self.stream_agreement) != len(self.stream_order):
            raise InvalidArgumentError("stream_agreement holds one agreement per layer of stream_order")
        if self.head_draft_rows < 0 or self.draft_tokens < 1:
            raise InvalidArgumentError(f"head_draft_rows must not be negative and draft_tokens must be at least 1, got "
                                       f"{self.head_draft_rows} and {self.draft_tokens}")


@dataclass
class MemoryPlan:
    """Which parts stay resident and which layers stream, with the bytes of each."""

    budget: int
    parts: PartSizes
    needs: MemoryNeeds
    kv_bytes: int
    activation_bytes: int
    resident_layers: int  # R: how many layers stay resident; the rest stream (`streamed`)
    pool_slots: int  # stream buffers (0 when nothing streams)
    slot_bytes: int  # bytes of one stream buffer (the largest streamed layer, aligned)
    minimum: int  # the smallest budget that holds the resident minimum with this many stream buffers
    read_buffers: int = 2  # buffers for reading quantised blocks (2: the next layer is read while one decodes)
    head_streamed: bool = False  # the lm_head streams too, after the last layer, in `head_chunks` pieces of a stream
    # buffer each; drafts read out through its ``needs.head_draft_rows`` rows, kept resident

    @property
    def num_layers(self) -> int:
        return len(self.parts.layers)

    @property
    def streamed(self) -> tuple[int, ...]:
        """The streamed layers, ascending: the deepest ``L - R``, or the first ``L - R`` of ``needs.stream_order``
        (the deepest of the others after them, where it lists fewer)."""
        return streamed_layers(self.num_layers, self.resident_layers, self.needs.stream_order)

    @property
    def resident(self) -> tuple[int, ...]:
        streamed = set(self.streamed)
        return tuple(i for i in range(self.num_layers) if i not in streamed)

    @property
    def resident_prefix(self) -> int:
        """P: layers ``[0, P)`` are all resident (what runs every draft step of an early exit must be)."""
        return min(self.streamed, default=self.num_layers)

    @property
    def resident_layer_bytes(self) -> int:
        return sum(self.parts.layers[i] for i in self.resident)

    @property
    def read_buffer_bytes(self) -> int:
        """The reader's buffers for streamed layers stored as quantised blocks (read there, decoded into a stream
        buffer; with two, one is read while the other decodes); 0 when none is."""
        coded = [self.parts.stored(i) for i in self.coded_streamed]
        return self.read_buffers * round_up(max(coded)) if coded else 0

    @property
    def pool_bytes(self) -> int:
        return self.pool_slots * self.slot_bytes + self.read_buffer_bytes

    @property
    def head_chunk_rows(self) -> int:
        """lm_head rows per streamed piece: as many as a stream buffer holds from an aligned start (0: it stays)."""
        if not self.head_streamed:
            return 0
        return max(1, (self.slot_bytes - STORE_ALIGNMENT) // self.parts.head_row_bytes)

    @property
    def head_streamed_rows(self) -> int:
        """lm_head rows read per pass: all but the draft vocabulary's leading rows (0 when it stays resident)."""
        if not self.head_streamed:
            return 0
        return max(0, self.parts.lm_head // self.parts.head_row_bytes - self.needs.head_draft_rows)

    @property
    def head_chunks(self) -> int:
        """Pieces the streamed lm_head rows are read in (0 when it stays resident)."""
        rows = self.head_streamed_rows
        return -(-rows // self.head_chunk_rows) if rows else 0

    @property
    def streamed_units(self) -> int:
        """Reads per pass: the streamed layers and the streamed lm_head's pieces."""
        return len(self.streamed) + self.head_chunks

    @property
    def draft_rows_bytes(self) -> int:
        """The lm_head rows a skip draft reads out through while the head streams (row and token id each, with room
        for the end-of-sequence ids above them); the streamed head computes its leading rows there."""
        if not self.head_streamed:
            return 0
        return (self.needs.head_draft_rows + END_ROWS) * (self.parts.head_row_bytes + 8)

    @property
    def bytes_per_pass(self) -> int:
        """Bytes read from the store by one forward pass over every layer (one verification pass), the streamed
        lm_head's included."""
        head = self.head_streamed_rows * self.parts.head_row_bytes + self.head_chunks * STORE_ALIGNMENT
        return sum(self.parts.stored(i) for i in self.streamed) + head

    @property
    def coded_streamed(self) -> list[int]:
        """Streamed layers the store keeps (partly) as quantised blocks."""
        return [i for i in self.streamed if self.parts.stored(i) < self.parts.layers[i]]

    @property
    def coded_layers(self) -> int:
        return len(self.coded_streamed)

    @property
    def planned_bytes(self) -> int:
        head = self.draft_rows_bytes - self.parts.lm_head if self.head_streamed else 0
        return (self.needs.runtime_bytes + self.needs.library_pages_bytes + self.parts.always_resident + head
                + self.adapter_bytes + self.needs.drafter_bytes + self.kv_bytes
                + self.activation_bytes
                + self.resident_layer_bytes + self.pool_bytes)

    @property
    def adapter_bytes(self) -> int:
        """The adapters and the lm_head rows of their draft vocabularies (row and token id each)."""
        return self.needs.adapter_bytes + self.needs.head_rows * (self.parts.head_row_bytes + 8)

    def with_resident(self, resident: int) -> "MemoryPlan":
        """The same needs with ``resident`` layers resident (the others stream: `streamed`; the budget is not
        checked): its ``planned_bytes`` is the budget that plan needs. A streamed lm_head is read through buffers of
        the largest layer's size."""
        streamed = [max(self.parts.layers[i], self.parts.stored(i))
                    for i in streamed_layers(self.num_layers, resident, self.needs.stream_order)]
        if self.head_streamed:
            slot_bytes = round_up(max(max(layer, self.parts.stored(i)) for i, layer in enumerate(self.parts.layers)))
        else:
            slot_bytes = round_up(max(streamed)) if streamed else 0
        plan = MemoryPlan(self.budget, self.parts, self.needs, self.kv_bytes, self.activation_bytes, resident, 0,
                          slot_bytes, self.minimum, self.read_buffers, self.head_streamed)
        plan.pool_slots = min(self.needs.prefetch + 1, plan.streamed_units)
        return plan

    def rows(self) -> list[tuple[str, int]]:
        parts = self.parts
        head = ("embeddings + lm_head (tied)" if parts.lm_head == 0 else
                "embeddings (rows read; table mapped)" if parts.embed_rows else "embeddings")
        rows = [("runtime (measured before loading weights)", self.needs.runtime_bytes)] if self.needs.runtime_bytes else []
        if self.needs.library_pages_bytes:
            rows.append(("library pages read each step", self.needs.library_pages_bytes))
        rows.append((head, parts.embed))
        if self.head_streamed:
            rows.append((f"lm_head rows of the draft vocabulary ({self.needs.head_draft_rows})", self.draft_rows_bytes))
        elif parts.lm_head:
            rows.append(("lm_head", parts.lm_head))
        rows += [("final norm", parts.norm), ("adapters", self.adapter_bytes)]
        if self.needs.drafter_bytes:
            rows.append(("drafter tables", self.needs.drafter_bytes))
        rows += [(f"KV cache ({self.needs.context_tokens} + {self.needs.max_tree_tokens} tokens)", self.kv_bytes),
                 (f"activations ({self.needs.max_tree_tokens}-token pass or {prompt_text(self.needs)})",
                  self.activation_bytes),
                 (f"resident layers {layer_ranges(self.resident)}", self.resident_layer_bytes)]
        if self.pool_slots:
            rows.append((f"stream buffers ({self.pool_slots} x {mib(self.slot_bytes)})",
                         self.pool_slots * self.slot_bytes))
        if self.read_buffer_bytes:
            rows.append((f"block read buffers ({self.read_buffers} x "
                         f"{mib(self.read_buffer_bytes // self.read_buffers)})", self.read_buffer_bytes))
        return rows

    def describe(self) -> str:
        """The printable plan: bytes per part, which layers stream, bytes read per pass."""
        lines = [f"memory plan: budget {mib(self.budget)} (weights {mib(self.parts.weights)}, "
                 f"minimum {mib(self.minimum)})"]
        parts = self.rows()
        width = max(40, *(len(name) for name, _ in parts))
        lines += [f"  {name:<{width}} {mib(size):>12}" for name, size in parts]
        lines.append(f"  {'total planned':<{width}} {mib(self.planned_bytes):>12}")
        if self.streamed or self.head_streamed:
            rows = self.head_streamed_rows * self.parts.head_row_bytes
            head = (f" and the lm_head's rows past the draft's ({mib(rows)}, in {self.head_chunks} pieces)"
                    if self.head_streamed else "")
            lines.append(f"  streamed layers {layer_ranges(self.streamed)} "
                         f"({len(self.streamed)} of {self.num_layers}){head}: {mib(self.bytes_per_pass)} read per "
                         f"verification pass, {self.needs.prefetch} layer(s) read ahead")
            if self.head_streamed:
                lines.append(f"  the lm_head streams after the last layer: the skip draft reads out through its "
                             f"{self.needs.head_draft_rows} rows of the lowest token ids (and the end-of-sequence "
                             "ids), kept resident, and the head reads those from there")
            if self.needs.stream_order:
                lines.append("  the streamed layers are those the model's layer-skip draft skips "
                             "(its calibrated stream order): it drafts from the resident layers alone")
            if self.coded_layers:
                lines.append(f"  {self.coded_layers} streamed layer(s) stored as the GGUF file's quantised blocks, "
                             "decoded as they are read (the same weights, bit for bit)")
        else:
            lines.append("  every layer is resident: nothing streams")
        if self.needs.shallow_layers > self.resident_prefix:
            lines.append(f"  the shallow verifier's layers [{self.resident_prefix}, {self.needs.shallow_layers}) "
                         f"stream too (keeping [0, {self.needs.shallow_layers}) needs a larger budget); the cascade then "
                         "adds no correction branches, which would read them twice per pass")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "budget_mb": round(self.budget / MIB, 2), "minimum_mb": round(self.minimum / MIB, 2),
            "weights_mb": round(self.parts.weights / MIB, 2), "planned_mb": round(self.planned_bytes / MIB, 2),
            "parts_mb": {name: round(size / MIB, 2) for name, size in self.rows()},
            "resident_layers": self.resident_layers, "streamed_layers": list(self.streamed),
            "pool_slots": self.pool_slots, "bytes_per_pass": self.bytes_per_pass, "coded_layers": self.coded_layers,
            "head_streamed": self.head_streamed, "head_chunks": self.head_chunks,
            "needs": asdict(self.needs),
        }


def streamed_layers(num_layers: int, resident: int, order: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The ``num_layers - resident`` layers that stream: the first of ``order``, then the deepest others."""
    count = num_layers - resident
    chosen = list(order[:count])
    taken = set(chosen)
    chosen += [i for i in range(num_layers - 1, -1, -1) if i not in taken][: count - len(chosen)]
    return tuple(sorted(chosen))


def layer_ranges(layers) -> str:
    """``[2, 5) [7, 8)`` for layers 2, 3, 4, 7 (``none`` for none)."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return " ".join(f"[{a}, {b})" for a, b in runs) or "none"


def plan_memory(budget: int, parts: PartSizes, needs: MemoryNeeds, kv_bytes: int, activation: int) -> MemoryPlan:
    """Keep as many layers resident as the budget allows (bottom up, or the last of ``needs.stream_order`` first);
    stream the rest through ``prefetch + 1`` buffers. Raises `BudgetTooSmallError` naming the minimum when even ``[0, min_resident_layers)`` does not fit.
    Layers stored as quantised blocks are read through two buffers (one read ahead while the other decodes), or
    through one when the budget cannot hold the minimum with two.

    With ``needs.head_draft_rows`` (a skip draft over a stream order) on a head that streams (``parts.head_streams``)
    the plan with the lm_head streamed is made too, and the one `skip_draft_rate` rates higher is kept: the head's
    bytes then hold more layers, so the skip draft skips fewer and agrees more, for the head's read on every pass."""
    needs.validate(len(parts.layers))
    variants = (False, True) if needs.head_draft_rows and parts.head_streams and needs.stream_order else (False,)
    fitted = {head: _fit(budget, parts, needs, kv_bytes, activation, head) for head in variants}
    minimum = min(_lowest(parts, needs, kv_bytes, activation, head).planned_bytes for head in variants)
    kept, streaming = fitted[False], fitted.get(True)
    chosen = kept
    if streaming is not None and (kept is None or (kept.streamed and skip_draft_rate(streaming) > skip_draft_rate(kept))):
        chosen = streaming
    if chosen is not None:
        chosen.minimum = minimum
        return chosen
    lowest = _lowest(parts, needs, kv_bytes, activation, False)
    detail = ", ".join(f"{name} {mib(size)}" for name, size in lowest.rows() if size)
    raise BudgetTooSmallError(
        f"memory budget {mib(budget)} is below the minimum of {mib(minimum)} for this model and method ({detail}); "
        f"pass a budget of at least {budget_text(minimum)}, a shorter context, or a smaller tree"
        + (f" (the weights alone are {mib(parts.weights)})" if budget < parts.always_resident else ""))


def _lowest(parts: PartSizes, needs: MemoryNeeds, kv_bytes: int, activation: int, head_streamed: bool) -> MemoryPlan:
    """The plan with the fewest layers resident, one block read buffer: the least a budget must hold."""
    base = MemoryPlan(0, parts, needs, kv_bytes, activation, len(parts.layers), 0, 0, 0, 1, head_streamed)
    return min((base.with_resident(resident) for resident in range(needs.min_resident_layers, len(parts.layers) + 1)),
               key=lambda plan: plan.planned_bytes)


def _fit(budget: int, parts: PartSizes, needs: MemoryNeeds, kv_bytes: int, activation: int,
         head_streamed: bool) -> MemoryPlan | None:
    """The plan with the most layers resident that fits ``budget`` (two block read buffers, else one), or None; its
    ``minimum`` is set by `plan_memory`. With the head streamed at least one layer streams too (a skip draft that
    skips none is the model itself)."""
    num_layers, floor = len(parts.layers), needs.min_resident_layers
    most = num_layers - 1 if head_streamed else num_layers
    for read_buffers in (2, 1):
        base = MemoryPlan(budget, parts, needs, kv_bytes, activation, num_layers, 0, 0, 0, read_buffers, head_streamed)
        for resident in range(most, floor - 1, -1):
            if base.with_resident(resident).planned_bytes <= budget:
                return base.with_resident(resident)
    return None
