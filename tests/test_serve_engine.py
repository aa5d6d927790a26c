"""The server's generation slot and engine, without HTTP: arrival order, the bounded queue, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from cats.config import GenerationConfig
from cats.loop.generator import Generator
from cats.serve.engine import Engine, GenerationSlot, QueueFullError, ShuttingDownError
from tests.conftest import tiny_model


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_slot_serves_in_arrival_order_and_refuses_beyond_the_queue():
    async def main():
        slot, order = GenerationSlot(max_queue=2), []

        async def take(name):
            await slot.acquire()
            order.append(name)

        await take("a")
        waiting = [asyncio.create_task(take(name)) for name in "bc"]
        await settle()
        assert slot.queued == 2 and order == ["a"]
        with pytest.raises(QueueFullError):
            await slot.acquire()
        for expected in (["a", "b"], ["a", "b", "c"]):
            slot.release()
            await settle()
            assert order == expected
        await asyncio.gather(*waiting)
        slot.release()
        assert not slot.busy and slot.queued == 0

    asyncio.run(main())


def test_a_waiter_that_gives_up_leaves_the_queue_and_passes_a_handed_over_slot_on():
    async def main():
        slot = GenerationSlot(max_queue=3)
        await slot.acquire()
        b, c, d = (asyncio.create_task(slot.acquire()) for _ in range(3))
        await settle()
        b.cancel()  # gave up while waiting
        await settle()
        assert slot.queued == 2
        slot.release()  # hands the slot to c ...
        c.cancel()  # ... which gives up before it runs: d must get it
        await settle()
        assert c.cancelled() and d.done() and slot.busy and slot.queued == 0
        slot.release()
        assert not slot.busy

    asyncio.run(main())


def test_closing_the_slot_fails_the_queue_and_new_requests():
    async def main():
        slot = GenerationSlot(max_queue=2)
        await slot.acquire()
        waiter = asyncio.create_task(slot.acquire())
        await settle()
        slot.close()
        with pytest.raises(ShuttingDownError):
            await waiter
        with pytest.raises(ShuttingDownError):
            await slot.acquire()

    asyncio.run(main())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_engine_runs_match_the_generator_and_a_cancelled_run_frees_the_slot(model):
    prompt = [1, 5, 9, 13, 5, 9]
    expected = Generator(model).generate(prompt, GenerationConfig(max_new_tokens=12)).token_ids

    async def main():
        engine = Engine(Generator(model), max_queue=1)
        run = await engine.start(prompt, GenerationConfig(max_new_tokens=12))
        tokens = [t async for chunk in run.chunks() for t in chunk]
        assert tokens == expected and run.outcome == "completed" and run.stats.new_tokens == 12

        long = await engine.start(prompt, GenerationConfig(max_new_tokens=200, ignore_eos=True))
        queued = asyncio.create_task(engine.start(prompt, GenerationConfig(max_new_tokens=3)))
        chunks = long.chunks()
        await chunks.__anext__()  # the first token is out
        long.cancel()
        rest = [chunk async for chunk in chunks]
        assert long.outcome == "cancelled" and len(rest) < 150
        next_run = await queued  # the slot went to the queued request
        assert [t async for chunk in next_run.chunks() for t in chunk] == expected[:3]
        await settle()
        assert engine.health() | {"queued": 0} == {"busy": False, "shutting_down": False, "queued": 0, "max_queue": 1,
                                                   "completed": 2, "cancelled": 1, "failed": 0}

    asyncio.run(main())


def test_engine_reports_a_failing_run_and_goes_on(model):
    async def main():
        engine = Engine(Generator(model), max_queue=1)
        run = await engine.start([1, 2, 3], GenerationConfig(max_new_tokens=4, stop=("x",)))  # no tokenizer
        with pytest.raises(Exception, match="tokenizer"):
            [chunk async for chunk in run.chunks()]
        await settle()
        assert engine.health()["failed"] == 1 and not engine.health()["busy"]

    asyncio.run(main())
