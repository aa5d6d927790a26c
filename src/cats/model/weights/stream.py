"""Streaming the deep layers from the layer store while earlier layers compute.

A background thread reads streamed layers, in the order forward passes use them (ascending: ``R, R+1, .., L-1``
for the deepest layers, or the layers of a calibrated stream order; then the first again for the next pass), into a
fixed pool of page-aligned buffers allocated once. The decode loop calls ``acquire(i)`` just before layer ``i``
runs: the layer's parameters become views of the buffer holding it (waiting for the read if it is not done: that wait
is the *stall*); ``release(i)`` after it ran puts the meta placeholders back and frees the buffer, and the reader
refills it with the next layer in order. Between uses a streamed layer's
parameters are on the meta device: nothing of it stays allocated.

Reads and the page cache (memory counted is memory used):

* ``direct`` (default): ``O_DIRECT`` reads of whole 4096-byte blocks straight into the buffer (part files are laid
  out for it). The page cache is never involved and the kernel copies nothing, so the reader needs almost no CPU
  while compute uses every core. Falls back to ``buffered`` where the file system refuses O_DIRECT.
* ``buffered``: ``os.preadv`` into the buffer, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the whole layer
  file, so the kernel drops the pages it cached for the read: at most the layer being read sits in the page cache,
  and only until its read returns. Kernel read-ahead can make it faster on an idle machine, but the kernel's copy
  competes with compute for the CPU.

Both release the GIL for the whole read, so compute and I/O overlap. A layer the store keeps as quantised blocks
(`cats.model.weights.blocks`) is read into one of two extra buffers and decoded from there into its stream buffer by the
reader thread (the decoder releases the GIL too); while it decodes, a second thread reads the next block layer into
the other buffer, so reading and decoding overlap. Counters (`StreamCounters`): bytes and layers read, read
time (the reader loading layers: inside ``preadv``, plus decoding), decode time (its share spent decoding), stall
time (compute waiting in ``acquire``), and the fraction of the reader's time hidden behind compute,
``1 - stall / read``.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from cats.errors import InvalidArgumentError
from cats.model.weights.budget import STORE_ALIGNMENT, round_up
from cats.model.weights.parts import StoreError, pread_exact
from cats.model.weights.store import DecodedPart, LayerStore, part_name

IO_MODES = ("buffered", "direct")
FREE, LOADING, READY, IN_USE = "free", "loading", "ready", "in use"


@dataclass
class StreamCounters:
    bytes_read: int = 0
    layers_read: int = 0
    read_s: float = 0.0  # time the reader spent loading layers (reading, and decoding quantised blocks)
    decode_s: float = 0.0  # the part of read_s spent decoding
    stall_s: float = 0.0  # time compute waited for a layer
    stalls: int = 0  # acquires that had to wait
    acquires: int = 0
    out_of_order: int = 0  # acquires of a layer other than the next in access order (the reader restarts there)

    @property
    def hidden_fraction(self) -> float:
        """Fraction of read time hidden behind compute: ``1 - stall / read`` (clamped to [0, 1])."""
        return min(1.0, max(0.0, 1.0 - self.stall_s / self.read_s)) if self.read_s > 0 else 0.0

    @property
    def read_bandwidth(self) -> float:
        """Bytes per second of the reads so far (0 before the first)."""
        return self.bytes_read / self.read_s if self.read_s > 0 else 0.0

    def minus(self, earlier: "StreamCounters") -> "StreamCounters":
        return StreamCounters(**{key: getattr(self, key) - getattr(earlier, key) for key in asdict(self)})

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(read_s=round(self.read_s, 4), decode_s=round(self.decode_s, 4), stall_s=round(self.stall_s, 4),
                    hidden_fraction=round(self.hidden_fraction, 4), read_mb_per_s=round(self.read_bandwidth / 2**20, 1))
        return data


class _Slot:
    def __init__(self, size: int):
        self.memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous, page-aligned (as O_DIRECT needs)
        self.buffer = torch.frombuffer(self.memory, dtype=torch.uint8)
        # its pages made now (the plan holds them anyway): a first read into untouched pages runs at about half the
        # speed of later ones, and the first reads are the bandwidth the schedulers plan with (`wait_for_bandwidth`)
        self.buffer.zero_()
        self.state, self.layer, self.generation = FREE, None, 0
        self.parameters: dict[tuple, list[torch.nn.Parameter]] = {}  # layout -> parameter views of this buffer


def store_layouts(store: LayerStore, layers) -> dict:
    """Where ``layers`` lie in ``store``'s files, for `LayerStreamer`."""
    return {i: store.layout(part_name(i)) for i in layers}


class LayerStreamer:
    """Streams the decoder layers that ``layouts`` names (modules in ``layers``, their parameters on the meta device
    between uses) through ``slots`` buffers of ``slot_bytes``, from the files ``layouts`` name: per layer a
    `PartHeader` (its tensors as they lie in a file, read as they are: a layer store's part, or a GGUF file's layer)
    or a `DecodedPart` (a store's part holding quantised blocks that are decoded as read). A parameter of a layer that
    its layout does not name is resident and stays. ``LayeredModel.forward_layers`` calls ``acquire``/``release``
    around each layer; for resident layers they return at once."""

    def __init__(self, layers, num_layers: int, layouts: dict, slots: int, slot_bytes: int,
                 io: str = "direct", read_buffers: int = 2, store: LayerStore | None = None):
        if io not in IO_MODES:
            raise InvalidArgumentError(f"offload I/O mode must be one of {', '.join(IO_MODES)}, got {io!r}")
        if not layouts or slots < 1 or not all(0 <= i < num_layers for i in layouts):
            raise ValueError(f"nothing to stream: layers {sorted(layouts)} of {num_layers}, slots={slots}")
        self.streamed = tuple(sorted(layouts))  # in access order
        self.first, self.num_layers, self.io = self.streamed[0], num_layers, io
        self._streamed = set(self.streamed)
        self.store = store  # the layer store the layouts come from (None: a GGUF file's own layers)
        self.layouts = dict(layouts)  # the tensors as computed on
        self.headers = {i: layout.file if isinstance(layout, DecodedPart) else layout  # the files
                        for i, layout in self.layouts.items()}
        slot_bytes = max(slot_bytes, round_up(max(layout.data_bytes for layout in self.layouts.values())))
        self.slots = [_Slot(slot_bytes) for _ in range(slots)]
        coded = [self.headers[i].data_bytes for i, layout in self.layouts.items() if isinstance(layout, DecodedPart)]
        # quantised layers are read into one of two buffers, by a second thread, while the one before decodes
        self.read_buffers = [_Slot(round_up(max(coded))) for _ in range(read_buffers)] if coded else []
        self.block_reader = (ThreadPoolExecutor(1, thread_name_prefix="cats-block-reader")
                             if len(self.read_buffers) > 1 else None)
        self.pending: tuple | None = None  # (layer, future of its read, read buffer): the blocks read ahead
        # per streamed layer: (module, attribute) for each parameter name, and the meta placeholders
        self.bindings: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
        self.placeholders: dict[int, list[torch.nn.Parameter]] = {}
        for i in self.streamed:
            layer = layers[i]
            binding = []
            entries = self.layouts[i].entries
            for name, parameter in layer.named_parameters():
                if name not in entries:
                    if parameter.is_meta:
                        raise StoreError(f"layer file {self.headers[i].path} does not hold layer {i}'s {name}")
                    continue  # resident
                owner, _, attribute = name.rpartition(".")
                binding.append((layer.get_submodule(owner) if owner else layer, attribute, name))
            if len(binding) != len(entries):
                raise StoreError(f"layer file {self.headers[i].path} holds tensors that are not layer {i}'s parameters")
            self.bindings[i] = binding
            self.placeholders[i] = [getattr(module, attribute) for module, attribute, _ in binding]
        self.counters = StreamCounters()
        self.error: BaseException | None = None
        self.expected = self.first  # the layer the next acquire should ask for
        self.next_to_read = self.first
        self.generation = 0  # bumped when the access order restarts: reads in flight for the old order are dropped
        self.closed = False
        self.condition = threading.Condition()
        # started on first use, so that its first reads (which measure the bandwidth) do not compete with loading
        self.thread = threading.Thread(target=self._read_forever, name="cats-layer-reader", daemon=True)

    # ------------------------------------------------------------------------------------------ the compute side
    def is_streamed(self, layer: int) -> bool:
        return layer in self._streamed

    def acquire(self, layer: int) -> None:
        """Make layer ``layer``'s parameters real (views of the buffer holding it), waiting for its read if needed."""
        if layer not in self._streamed:
            return
        self._start()
        with self.condition:
            if layer != self.expected:
                self._restart_at(layer)
            slot = self._ready(layer)
            if slot is None:
                start = time.perf_counter()
                while (slot := self._ready(layer)) is None:
                    self._raise_if_failed()
                    self.condition.wait()
                self.counters.stall_s += time.perf_counter() - start
                self.counters.stalls += 1
            slot.state = IN_USE
            self.counters.acquires += 1
            self.expected = self._after(layer)
        layout = self.layouts[layer]
        parameters = slot.parameters.get(layout.layout)
        if parameters is None:
            views = layout.views(slot.buffer)
            parameters = [torch.nn.Parameter(views[name], requires_grad=False) for _, _, name in self.bindings[layer]]
            slot.parameters[layout.layout] = parameters
        for (module, attribute, _), parameter in zip(self.bindings[layer], parameters):
            module._parameters[attribute] = parameter

    def release(self, layer: int) -> None:
        """Put the meta placeholders back and hand the buffer to the reader."""
        if layer not in self._streamed:
            return
        for (module, attribute, _), placeholder in zip(self.bindings[layer], self.placeholders[layer]):
            module._parameters[attribute] = placeholder
        with self.condition:
            for slot in self.slots:
                if slot.state == IN_USE and slot.layer == layer:
                    slot.state, slot.layer = FREE, None
            self.condition.notify_all()

    def _ready(self, layer: int) -> _Slot | None:
        for slot in self.slots:
            if slot.state == READY and slot.layer == layer:
                return slot
        return None

    def _restart_at(self, layer: int) -> None:
        """An acquire out of access order: drop what was read ahead and read from ``layer`` on."""
        self.counters.out_of_order += 1
        self.generation += 1
        for slot in self.slots:
            if slot.state == READY:
                slot.state, slot.layer = FREE, None
        self.next_to_read = layer
        self.condition.notify_all()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise StoreError(f"streaming a layer failed: {self.error}") from self.error
        if self.closed:
            raise StoreError("the layer streamer is closed")

    # ------------------------------------------------------------------------------------------ the reader thread
    def _read_forever(self) -> None:
        while True:
            with self.condition:
                while not self.closed and (self._free_slot() is None or self._already_read(self.next_to_read)):
                    self.condition.wait()
                if self.closed:
                    return
                slot, layer, generation = self._free_slot(), self.next_to_read, self.generation
                slot.state, slot.layer = LOADING, layer
                self.next_to_read = self._after(layer)
            try:
                start = time.perf_counter()
                layout = self.layouts[layer]
                if isinstance(layout, DecodedPart):
                    raw = self._blocks_of(layer)
                    self._read_blocks_ahead(self._after(layer), raw)
                    decode_start = time.perf_counter()
                    layout.decode(raw.buffer, slot.buffer)
                    decoded = time.perf_counter() - decode_start
                else:
                    self._read(layer, slot)
                    decoded = 0.0
                elapsed = time.perf_counter() - start
            except BaseException as error:  # reported to the compute side by acquire
                with self.condition:
                    self.error = error
                    slot.state, slot.layer = FREE, None
                    self.condition.notify_all()
                return
            with self.condition:
                self.counters.read_s += elapsed
                self.counters.decode_s += decoded
                self.counters.bytes_read += self.headers[layer].data_bytes
                self.counters.layers_read += 1
                if generation == self.generation:
                    slot.state = READY
                else:
                    slot.state, slot.layer = FREE, None
                self.condition.notify_all()

    def _after(self, layer: int) -> int:
        """The streamed layer after ``layer`` in access order (the last one wraps around to the first)."""
        position = self.streamed.index(layer) + 1
        return self.streamed[position] if position < len(self.streamed) else self.first

    def _blocks_of(self, layer: int) -> _Slot:
        """The read buffer holding ``layer``'s blocks: the read started while the layer before decoded (waited
        for), or a read now. A read ahead for another layer (the order restarted) is dropped."""
        pending, self.pending = self.pending, None
        if pending is not None:
            ahead, future, raw = pending
            future.result()  # a failed read raises here
            if ahead == layer:
                return raw
            with self.condition:
                self.counters.bytes_read += self.headers[ahead].data_bytes  # read, not used
        raw = self.read_buffers[0]
        self._read(layer, raw)
        return raw

    def _read_blocks_ahead(self, layer: int, busy: _Slot) -> None:
        """Start reading ``layer``'s blocks into the other read buffer (while ``busy``'s are decoded), when there are
        two."""
        if self.block_reader is not None and isinstance(self.layouts.get(layer), DecodedPart):
            raw = self.read_buffers[1] if busy is self.read_buffers[0] else self.read_buffers[0]
            self.pending = (layer, self.block_reader.submit(self._read, layer, raw), raw)

    def _free_slot(self) -> _Slot | None:
        return next((slot for slot in self.slots if slot.state == FREE), None)

    def _already_read(self, layer: int) -> bool:
        """The next layer to read is still held (ready or in use): the pool has wrapped around onto itself."""
        return any(slot.layer == layer and slot.state in (READY, IN_USE, LOADING) for slot in self.slots)

    def _read(self, layer: int, slot: _Slot) -> None:
        header = self.headers[layer]
        if self.io == "direct":
            try:
                fd = os.open(header.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise StoreError(f"cannot open {header.path}: {error.strerror}") from None
                self.io = "buffered"  # the file system refuses O_DIRECT
            else:
                try:
                    length = round_up(header.data_bytes, STORE_ALIGNMENT)
                    pread_exact(fd, memoryview(slot.memory)[:length], header.data_start, header.data_bytes, header.path)
                    return
                finally:
                    os.close(fd)
        try:
            fd = os.open(header.path, os.O_RDONLY)
        except OSError as error:
            raise StoreError(f"cannot open {header.path}: {error.strerror}") from None
        try:
            pread_exact(fd, memoryview(slot.memory)[: header.data_bytes], header.data_start, header.data_bytes,
                        header.path)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ lifetime
    def _start(self) -> None:
        if not self.thread.is_alive() and not self.closed:
            with self.condition:
                if not self.thread.ident:
                    self.thread.start()

    def wait_for_bandwidth(self) -> float:
        """The read bandwidth (bytes/s) measured so far; before the first pass this waits, idle, for the reader to
        fill the pool, so that the reads measured did not compete with anything else in this process."""
        self._start()
        with self.condition:
            while self.counters.layers_read < len(self.slots) and self.counters.acquires == 0:
                self._raise_if_failed()
                self.condition.wait()
            return self.counters.read_bandwidth

    def snapshot(self) -> StreamCounters:
        with self.condition:
            return StreamCounters(**asdict(self.counters))

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()
        if self.thread.ident:
            self.thread.join()
        if self.block_reader is not None:
            self.block_reader.shutdown(wait=True)

    def store_files(self) -> list:
        """The streamed layers' files (to ask the kernel how much of them it caches)."""
        return sorted({header.path for header in self.headers.values()})

    @property
    def pool_bytes(self) -> int:
        return sum(len(slot.memory) for slot in self.slots + self.read_buffers)
