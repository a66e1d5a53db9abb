"""AsyncLLM: streams from a background engine thread to asyncio, aborts free pages, errors reach callers."""

from __future__ import annotations

import asyncio
import time

import pytest

from jengine import LLM, RequestOutputKind, SamplingParams
from jengine.async_llm import AsyncLLM, EngineDeadError
from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig

SMALL = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
             seq_buckets=(8,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="jengine/tiny-llama", **SMALL), progress=False)


@pytest.fixture
def llm(engine):
    llm = AsyncLLM.from_engine(engine)
    yield llm
    llm.shutdown(drain=False, timeout=10)


@pytest.fixture
def slow_steps(engine, monkeypatch):
    """Steps of >= 5 ms, so a 200-token request is surely still running when the test acts on it."""
    step = engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def _pages_all_free(engine) -> bool:
    bm = engine.scheduler.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_usable_blocks


async def _collect(llm, prompt, params, rid):
    outs = [out async for out in llm.generate(prompt, params, rid)]
    return outs


def test_generate_streams_cumulative_outputs_matching_the_offline_engine(llm, engine):
    async def main():
        return await asyncio.gather(*(_collect(llm, p, GREEDY, f"r{i}") for i, p in enumerate(["Hello", "abc"])))

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 8
    offline = LLM.__new__(LLM)  # reuse the engine: the offline path on the same weights
    offline.engine, offline._ids = engine, iter(range(10**6))
    llm.shutdown()
    expected = offline.generate(["Hello", "abc"], GREEDY, use_tqdm=False)
    assert [r[-1].outputs[0].token_ids for r in results] == [e.outputs[0].token_ids for e in expected]


def test_delta_outputs_are_never_coalesced_and_final_only_yields_once(llm, engine):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def slow_reader(kind):  # lets several outputs queue up between reads
        outs = []
        async for out in llm.generate("Hello", params.clone(output_kind=kind), f"kind-{kind.name}"):
            outs.append(out)
            await asyncio.sleep(0.02)
        return outs

    async def main():
        return await asyncio.gather(*(slow_reader(kind) for kind in RequestOutputKind))

    cumulative, delta, final = asyncio.run(main())
    full = cumulative[-1].outputs[0]
    assert len(full.token_ids) == 24 and len(final) == 1 and final[0].outputs[0].token_ids == full.token_ids
    assert sum((o.outputs[0].token_ids for o in delta), []) == full.token_ids
    assert "".join(o.outputs[0].text for o in delta) == full.text == final[0].outputs[0].text
    assert _pages_all_free(engine)


def test_breaking_out_of_a_stream_aborts_the_request_and_frees_its_pages(llm, engine, slow_steps):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in llm.generate("Hello", params, "long"):
            seen += 1
            if seen == 2:
                break
        return await _eventually_all_free(llm)

    assert asyncio.run(main())


async def _eventually_all_free(llm) -> bool:
    """The step launched before an abort is still on the device for one more iteration; wait for it."""
    for _ in range(100):
        if await llm.run(_pages_all_free):
            return True
        await asyncio.sleep(0.02)
    return False


def test_abort_from_another_task_ends_the_stream_quietly(llm, engine, slow_steps):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        outs = []

        async def consume():
            async for out in llm.generate("Hi", params, "victim"):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.01)
        llm.abort("victim")
        await asyncio.wait_for(task, 10)
        return outs, await _eventually_all_free(llm)

    outs, freed = asyncio.run(main())
    assert not outs[-1].finished and freed


def test_bad_requests_raise_value_error_and_leave_the_engine_serving(llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(llm, "x" * 300, GREEDY, "too-long")
        with pytest.raises(ValueError, match="token ids"):
            await _collect(llm, [10**6], GREEDY, "bad-ids")
        return await _collect(llm, "ok", GREEDY, "fine")

    assert asyncio.run(main())[-1].finished


def test_an_engine_failure_reaches_every_caller_instead_of_hanging(engine, monkeypatch):
    llm = AsyncLLM.from_engine(engine)

    def broken_step():
        raise RuntimeError("device on fire")

    monkeypatch.setattr(engine, "step", broken_step)

    async def main():
        with pytest.raises(EngineDeadError, match="device on fire"):
            await asyncio.wait_for(_collect(llm, "Hello", GREEDY, "doomed"), 10)
        with pytest.raises(EngineDeadError):
            await _collect(llm, "Hello", GREEDY, "after")

    asyncio.run(main())
    llm.shutdown()
    monkeypatch.undo()
    assert _pages_all_free(engine)


def test_shutdown_without_drain_fails_requests_in_flight(engine, slow_steps):
    llm = AsyncLLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = llm.generate("Hello", params, "cut")
        await gen.__anext__()
        await asyncio.to_thread(llm.shutdown, False, 10)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    asyncio.run(main())
    assert _pages_all_free(engine)
