"""Which decoder layers a memory budget streams first: a model's *stream order*, where one was calibrated.

Under a budget the deepest layers stream by default. A layer-skip draft that skips exactly the streamed layers,
though, drafts from the resident layers alone: no draft token reads anything from disk, and each deep pass then
verifies several tokens for the one read of its streamed layers. Which whole layers a draft can skip with the least
harm is measured, not assumed (`cats.draft.layer_skip.stream_order`): the order lists the layers so that its first
``n`` are the ``n`` a draft skips best, for every ``n`` (nested, so that whatever count a budget streams, the streamed
set is a calibrated skip set), with the draft's agreement with the full model at each ``n``.

Files: ``$CATS_CACHE/stream-orders/<model fingerprint>.json`` (checked JSON, `cats.cache_files`), or the orders
shipped beside this module in ``stream_orders/`` (the default model's and Qwen2.5-Coder-1.5B-Instruct Q4_K_M's).
A model with neither streams its deepest layers, and its layer-skip drafts wait for a budget that keeps every
layer resident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cats.cache_files import Damaged, clean_stale, discard, notice, read_json, write_json
from cats.errors import InvalidArgumentError
from cats.paths import cache_root

FORMAT = "cats-stream-order/1"
SHIPPED = Path(__file__).with_name("stream_orders")


@dataclass(frozen=True)
class StreamOrder:
    """Layers in the order a budget streams them, and a skip draft's agreement with the full model when it skips the
    first ``n`` of them (``agreement[n - 1]``)."""

    layers: tuple[int, ...]
    agreement: tuple[float, ...]
    settings: dict

    def validate(self, num_layers: int) -> None:
        if len(set(self.layers)) != len(self.layers) or not all(0 <= i < num_layers for i in self.layers):
            raise InvalidArgumentError(f"a stream order lists distinct layers of [0, {num_layers}), got {self.layers}")
        if len(self.agreement) != len(self.layers):
            raise InvalidArgumentError("a stream order has one agreement per layer it lists")

    def skipped(self, count: int) -> tuple[int, ...]:
        """The first ``count`` layers, sorted: the layers streamed (and skipped by the draft) when ``count`` stream."""
        if not 0 <= count <= len(self.layers):
            raise InvalidArgumentError(f"the stream order lists {len(self.layers)} layers, not {count}")
        return tuple(sorted(self.layers[:count]))

    def agreement_at(self, count: int) -> float | None:
        return self.agreement[count - 1] if 0 < count <= len(self.agreement) else None

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "agreement": [round(a, 6) for a in self.agreement],
                "settings": self.settings}

    @staticmethod
    def from_dict(data: dict) -> "StreamOrder":
        return StreamOrder(tuple(int(i) for i in data["layers"]), tuple(float(a) for a in data["agreement"]),
                           dict(data.get("settings", {})))


def stream_order_file(fingerprint: str) -> Path:
    return cache_root() / "stream-orders" / f"{fingerprint}.json"


def _read(path: Path, fingerprint: str, num_layers: int, checked: bool) -> StreamOrder | None:
    try:
        if checked:
            clean_stale(path.parent)
        data = read_json(path) if checked else json.loads(path.read_text())
        if data.get("format") != FORMAT or data["model"]["fingerprint"] != fingerprint:
            return None
        order = StreamOrder.from_dict(data["order"])
        order.validate(num_layers)
        return order
    except Damaged as damage:
        notice(f"the cached stream order is damaged: {damage}; removed")
        discard(path)
    except (OSError, ValueError, KeyError, TypeError, InvalidArgumentError):
        pass
    return None


def load_stream_order(fingerprint: str, num_layers: int) -> StreamOrder | None:
    """The model's calibrated stream order: the cache's, else the one shipped for it, else None."""
    return (_read(stream_order_file(fingerprint), fingerprint, num_layers, checked=True)
            or _read(SHIPPED / f"{fingerprint}.json", fingerprint, num_layers, checked=False))


def apply_stream_order(needs, fingerprint: str, num_layers: int) -> None:
    """Where ``needs`` (`cats.model.weights.budget.MemoryNeeds`) asks for it (``skip_streamed``) and the model of
    ``fingerprint`` has a stream order none of whose layers must stay resident anyway, plan with it (an order that
    names one of them is not used: a prefix of it would no longer be a calibrated skip set)."""
    if not needs.skip_streamed or needs.stream_order:
        return
    order = load_stream_order(fingerprint, num_layers)
    if order is not None and min(order.layers) >= needs.min_resident_layers:
        needs.stream_order, needs.stream_agreement = order.layers, order.agreement


def store_stream_order(identity: dict, order: StreamOrder) -> Path:
    """Write ``order`` to the cache for the model of ``identity`` (`cats.model.identity.model_identity`)."""
    order.validate(identity["num_layers"])
    path = stream_order_file(identity["fingerprint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"format": FORMAT, "model": identity, "order": order.to_dict()})
    return path
