"""The engine in a process of its own (`EngineProcess`) behind AsyncLLM: the same outputs as the engine in
this process, refused requests, aborts that free pages, embeddings, a child that dies, a child that cannot
start; data-parallel replicas in processes of their own (`EngineProcesses`). The same path runs under
every `jengine serve` test (the server's default)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jengine import RequestOutputKind, SamplingParams
from jengine.async_llm import AsyncLLM, EngineDeadError
from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.engine_core import EngineProcess, _pack, _unpack
from jengine.entrypoints.pooling import embed
from jengine.logprobs import FlatLogprobs
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.request import RequestMetrics

SMALL = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64),
             seq_buckets=(8,))
CONFIG = EngineConfig(model="jengine/tiny-llama", **SMALL)


@pytest.fixture(scope="module")
def process():
    engine = EngineProcess(CONFIG, progress=False, stats=True, startup_timeout=300)
    llm = AsyncLLM.from_engine(engine)
    yield llm
    llm.shutdown(drain=False, timeout=30)
    assert not engine._process.is_alive()


@pytest.fixture(scope="module")
def local():
    return LLMEngine(CONFIG, progress=False)


async def _collect(llm, prompt, params, rid):
    return [out async for out in llm.generate(prompt, params, rid)]


def _run_all(llm, params, prompts):
    async def main():
        return await asyncio.gather(*(_collect(llm, p, params, f"{params.output_kind.name}-{i}")
                                      for i, p in enumerate(prompts)))

    return asyncio.run(main())


def _run_local(engine, params, prompts):
    """`_run_all` through an AsyncLLM over `engine`, shut down afterwards: its loop thread must not be
    left stepping the shared engine, which later tests step directly (a race seen once in CI)."""
    llm = AsyncLLM.from_engine(engine)
    try:
        return _run_all(llm, params, prompts)
    finally:
        llm.shutdown(timeout=60)


def _merged(outs: list[RequestOutput], kind: RequestOutputKind) -> tuple:
    """One stream's result: its last output, or for DELTA outputs everything they carried, joined."""
    last, pieces = outs[-1], [o.outputs[0] for o in outs]
    if kind is not RequestOutputKind.DELTA:
        pieces = pieces[-1:]
    flat = FlatLogprobs()
    for c in pieces:
        flat.extend(c.logprobs)
    prompt_lps = outs[0].prompt_logprobs
    return (last.request_id, outs[0].prompt, outs[0].prompt_token_ids, last.finished,
            "".join(c.text for c in pieces), [t for c in pieces for t in c.token_ids], last.outputs[0].finish_reason,
            flat.token_ids, flat.ranks, prompt_lps.token_ids, last.metrics.first_token_time is not None,
            flat.logprobs, prompt_lps.logprobs)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_outputs_equal_those_of_the_engine_in_this_process(process, local, kind):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                            flat_logprobs=True, output_kind=kind)
    prompts = ["Hello there", [5, 6, 7, 8, 9], "abc"]
    got = [_merged(outs, kind) for outs in _run_all(process, params, prompts)]
    want = [_merged(outs, kind) for outs in _run_local(local, params, prompts)]
    for g, w in zip(got, want, strict=True):
        assert g[:11] == w[:11] and len(g[5]) == 12 and g[10]
        # the same programs in another process: float sums may differ in the last bits
        assert g[11] == pytest.approx(w[11], abs=1e-4) and g[12] == pytest.approx(w[12], abs=1e-4)


def test_refused_requests_raise_value_error_and_the_engine_keeps_serving(process, local):
    params = SamplingParams(temperature=0.0, max_tokens=4)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(process, "x" * 300, params, "too-long")
        with pytest.raises(ValueError, match="token ids"):
            await _collect(process, [10**6], params, "bad-ids")
        return await _collect(process, "ok", params, "fine")

    assert asyncio.run(main())[-1].finished
    assert not process.engine.has_unfinished_requests()
    assert list(process.tokenizer.encode("ok")) == list(local.tokenizer.encode("ok"))  # loaded when asked for


def test_breaking_out_of_a_stream_aborts_in_the_child_and_frees_its_pages(process):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        seen = 0
        async for _ in process.generate("Hello", params, "long"):
            seen += 1
            if seen == 2:
                break
        for _ in range(200):  # the child sends fresh gauges once it is idle
            s = process.engine.metrics_snapshot()
            if s["num_requests_running"] == 0 and s["kv_cache_usage_perc"] == 0:
                return s
            await asyncio.sleep(0.02)
        return process.engine.metrics_snapshot()

    s = asyncio.run(main())
    assert (s["num_requests_running"], s["num_requests_waiting"], s["kv_cache_usage_perc"]) == (0, 0, 0)
    assert s["stats"]["generation_tokens"] > 0


def test_an_id_used_again_right_after_an_abort_gets_only_its_own_outputs(process, local):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        gen = process.generate([9, 8, 7, 6], long, "same")
        await gen.__anext__()
        await gen.aclose()  # aborts; the child may still be sending the old request's outputs
        await process.run(lambda engine: None)  # after the abort (commands run in order): the id is free
        return await _collect(process, "Hello there", short, "same")

    outs = asyncio.run(main())
    want = _run_local(local, short, ["Hello there"])[0][-1]
    assert outs[-1].finished and outs[-1].prompt == "Hello there"
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids


def test_embeddings_run_in_the_child_and_equal_the_local_ones(process, local):
    async def main():
        return await process.run(lambda engine: embed(engine, [1, 2, 3, 4]))

    assert asyncio.run(main()) == pytest.approx(embed(local, [1, 2, 3, 4]), abs=1e-6)
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(process.run(lambda engine: embed(engine, [])))


def test_outputs_travel_as_tuples_with_the_prompt_once():
    announced, prompts = set(), {}

    def out(n, finished):
        c = CompletionOutput(0, "x" * n, list(range(n)), None, None, "length" if finished else None)
        return RequestOutput("r", "hi", [1, 2, 3], [c], finished, RequestMetrics(1.0, 2.0, 3.0))

    first, second, last = (_pack(out(n, n == 3), announced) for n in (1, 2, 3))
    assert first[3] == ("hi", [1, 2, 3]) and second[3] is None and last[3] is None and not announced
    for packed, n in ((first, 1), (second, 2)):
        got = _unpack(packed, prompts)
        assert (got.prompt, got.prompt_token_ids, got.outputs[0].token_ids) == ("hi", [1, 2, 3], list(range(n)))
    assert _unpack(last, prompts).finished and prompts == {}
    assert _unpack(first, prompts).metrics == RequestMetrics(1.0, 2.0, 3.0, None)


def test_a_child_that_dies_fails_every_request_instead_of_hanging():
    engine = EngineProcess(CONFIG, progress=False, startup_timeout=300)
    llm = AsyncLLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        gen = llm.generate("Hello", params, "doomed")
        await gen.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDeadError):
            await _collect(llm, "Hello", params, "after")

    asyncio.run(main())
    llm.shutdown(drain=False, timeout=10)


def test_an_engine_that_cannot_start_raises_its_error_here():
    with pytest.raises(ValueError, match="no-such-model"):
        EngineProcess(EngineConfig(model="/no-such-model", **SMALL), progress=False, startup_timeout=300)


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("serving", [False, True])
def test_ctrl_c_ends_the_server_and_its_engine_process_while_starting_or_serving(serving):
    # While the engine starts, the server exits at once and ends the child with a SIGTERM (multiprocessing
    # does so for daemonic children); a child that ignored SIGTERM kept the server waiting forever.
    from test_server_harness import SMALL_ENGINE, Server, free_port

    if serving:
        proc = Server(api_key=None).proc
    else:  # Ctrl-C once the child runs jengine's code (it logs the KV cache's size), before it is ready
        proc = subprocess.Popen([sys.executable, "-c", CLI_WITH_CTRL_C, "serve", "jengine/tiny-llama", "--port",
                                 str(free_port()), *SMALL_ENGINE], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if "KV cache:" in line:
                break
    # Read the rest as it comes: a pipe left full (64 KiB) would block the server's write of its traceback, and
    # the server would never exit (a suspected cause of 60 s running out in two of session 37's CI runs)
    tail: collections.deque = collections.deque(maxlen=60)
    if not serving:
        threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True).start()
    kids = _children(proc.pid)
    assert kids
    proc.send_signal(signal.SIGINT)
    try:
        # 60 s ran out twice in session 37's full-suite CI runs on the 2-core dev machine (never alone, also not
        # under 3 busy processes); the cause was not confirmed, so the output now comes with a failure
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *kids]:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError("the server did not exit within 180 s of SIGINT; its output's end:\n"
                             + "".join(tail)) from None
    assert (proc.returncode == 0) == serving
    deadline = time.monotonic() + 30
    while any(_alive(k) for k in kids):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)


# `python -m jengine.cli` with SIGINT as a terminal's Ctrl-C finds it: a suite run as a background job (`cmd &` in a
# script) ignores SIGINT, its children inherit that, and Python then leaves it ignored (session 37: the server never
# saw the Ctrl-C; /proc showed SigIgn with SIGINT's bit). Set in the child's own code: a `preexec_fn` would make
# subprocess fork this multithreaded (JAX) process, which Python warns against.
CLI_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('jengine.cli', run_name='__main__', alter_sys=True)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_NO_BACKEND = """
import uvicorn
from jax._src import xla_bridge

def report(self, *args, **kwargs):  # instead of serving: what the server process has initialized
    print("backends:", sorted(xla_bridge._backends))

uvicorn.Server.run = report
from jengine.cli import main

if __name__ == "__main__":
    main(["serve", "jengine/tiny-llama", "--max-model-len", "256", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "64", "--token-buckets", "16,64", "--seq-buckets", "8"])
"""


def test_the_server_process_initializes_no_jax_backend(tmp_path):
    # On a GPU the server process would take device memory the engine's KV cache counts on; on a TPU
    # it would hold the chips the engine process needs.
    script = tmp_path / "serve_without_serving.py"
    script.write_text(_NO_BACKEND)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backends: []" in out.stdout


# ---------------------------------------------------------------------- data-parallel replicas

def test_replica_device_groups():
    from jengine.engine_replicas import replica_devices

    assert [replica_devices(i, 2, None) for i in range(3)] == ["0,1", "2,3", "4,5"]
    assert replica_devices(1, 1, "4, 6,7") == "6"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        replica_devices(1, 2, "0,1,2")


def test_data_parallel_replicas_run_in_processes_of_their_own(monkeypatch, local):
    from jengine.engine_replicas import EngineProcesses

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # what the children see
    engine = EngineProcesses(EngineConfig(model="jengine/tiny-llama", data_parallel_size=2, **SMALL),
                             progress=False, stats=True, startup_timeout=300)
    llm = AsyncLLM.from_engine(engine)
    try:
        assert len({r._process.pid for r in engine.replicas}) == 2
        assert engine.kv_cache_tokens == 2 * local.kv_cache_tokens
        assert engine.model_config == local.model_config and engine.sampling_defaults == local.sampling_defaults == {}
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        prompts = [[1, 2, 3], [5, 4], [7, 7, 7, 7], [9], [3, 1, 4, 1, 5]]
        served = [outs[-1].outputs[0].token_ids for outs in _run_all(llm, params, prompts)]
        for i, p in enumerate(prompts):
            local.add_request(f"dp-{i}", p, params)
        expected = {}
        while local.has_unfinished_requests():
            expected.update((o.request_id, o.outputs[0].token_ids) for o in local.step() if o.finished)
        assert served == [expected[f"dp-{i}"] for i in range(len(prompts))]
        deadline = time.time() + 30
        while (snap := engine.metrics_snapshot())["stats"]["generation_tokens"] < 6 * len(prompts):
            assert time.time() < deadline
            time.sleep(0.05)
        assert len(snap["replica_generation_tokens"]) == 2 and min(snap["replica_generation_tokens"]) > 0
        async def embedded():
            return await llm.run(lambda engine: embed(engine, [1, 2, 3]))

        assert asyncio.run(embedded()) == pytest.approx(embed(local, [1, 2, 3]), abs=1e-5)  # on replica 0
    finally:
        llm.shutdown(drain=False, timeout=30)
    assert not any(r._process.is_alive() for r in engine.replicas)


def test_a_replica_that_cannot_start_stops_the_others(monkeypatch):
    import multiprocessing

    from jengine.engine_replicas import EngineProcesses

    before = set(multiprocessing.active_children())
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # replica 1 has no device
    with pytest.raises(ValueError, match="replica 1 needs 1 device"):
        EngineProcesses(EngineConfig(model="jengine/tiny-llama", data_parallel_size=2, **SMALL), progress=False,
                        startup_timeout=300)
    assert set(multiprocessing.active_children()) <= before  # replica 0, which started, was stopped
