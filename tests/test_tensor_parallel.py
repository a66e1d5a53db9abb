"""Tensor parallelism on 8 fake CPU devices: TP = 2, 4, 8 generate what TP = 1 generates.

The device count must be set before jax starts, so the engines run in one child process (this file
run as a script with XLA_FLAGS) that prints its findings as JSON; the rest of the suite keeps its
single device. Fixtures: the HF checkpoint `llama3_tied` (8 query heads, 1 KV head: replicated at
every tp > 1; tied embedding split by vocabulary) from safetensors and from Orbax, and the
`tiny-llama` preset (8 query heads, 2 KV heads) with dummy weights. Data-parallel replicas
(`LLM(data_parallel_size=2)`) are checked in the same child.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from jengine.config import ModelConfig
from jengine.engine_config import EngineConfig

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "llama3_tied")
LLAMA4HEADS = os.path.join(os.path.dirname(FIXTURE), "llama")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 31))]
GUIDED_REGEX = "[a-z]{3,8} [0-9]+"
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32),
              seq_buckets=(4,), compilation_cache_dir=None, use_tqdm_on_load=False)
RUNS = [  # (name, model, load_format, tp)
    ("st", FIXTURE, "safetensors", 1), ("st", FIXTURE, "safetensors", 2), ("st", FIXTURE, "safetensors", 4),
    ("st", FIXTURE, "safetensors", 8), ("orbax", None, "orbax", 8),
    ("dummy", "jengine/tiny-llama", "dummy", 1), ("dummy", "jengine/tiny-llama", "dummy", 4),
]


def _child(out_dir: str) -> dict:
    """Runs in the child process with 8 devices: every run of RUNS, reported as plain data."""
    import jax

    from jengine import LLM, SamplingParams, StructuredOutputsParams
    from jengine.loader import convert_to_orbax

    assert jax.device_count() == 8
    orbax_dir = convert_to_orbax(FIXTURE, os.path.join(out_dir, "orbax"), dtype="float32")
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _d, **_kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    report = {}
    for name, model, load_format, tp in RUNS:
        llm = LLM(model or orbax_dir, load_format=load_format, tensor_parallel_size=tp, **ENGINE)
        compiles.clear()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runner = llm.engine.runner

        def spec(a, tp=tp):
            return [list(p) if isinstance(p, tuple) else p for p in a.sharding.spec] if tp > 1 else None

        report[f"{name}/{tp}"] = dict(
            tokens=[o.outputs[0].token_ids for o in outs],
            logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
            prompt_logprobs=[[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                             for o, p in zip(outs, PROMPTS)],
            shapes={k: list(v.shape) for k, v in runner.params.items()},
            param_specs={k: spec(v) for k, v in runner.params.items()},
            shard_shapes={k: sorted({tuple(s.data.shape) for s in v.addressable_shards})
                          for k, v in runner.params.items()},
            devices={k: len(v.sharding.device_set) for k, v in runner.params.items()},
            cache_specs=[spec(c) for c in runner.kv_caches],
            cache_shape=list(runner.kv_caches[0].shape),
            cache_shard_shapes=sorted({tuple(s.data.shape) for s in runner.kv_caches[0].addressable_shards}),
            compiles_after_warmup=len(compiles),
            logits_shape=_logits_shape(runner),
        )
    report["bf16_layout"] = _bf16_layout_mismatches()
    for dp, tp in ((2, 1), (2, 2)):  # data-parallel replicas on disjoint device groups
        llm = LLM(FIXTURE, load_format="safetensors", data_parallel_size=dp, tensor_parallel_size=tp, **ENGINE)
        compiles.clear()
        outs = llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
        report[f"dp{dp}/{tp}"] = dict(
            tokens=[o.outputs[0].token_ids for o in outs[:-1]], last=outs[-1].outputs[0].token_ids,
            devices=[sorted(d.id for p in r.runner.params.values() for d in p.sharding.device_set)
                     for r in llm.engine.replicas],
            steps=[r.stats["steps"] for r in llm.engine.replicas], compiles_after_warmup=len(compiles))
    for tp in (1, 2):  # a pool small enough to preempt by swapping; n=2 shares pages (copy-on-write)
        llm = LLM("jengine/tiny-llama", load_format="dummy", tensor_parallel_size=tp, preemption_mode="swap",
                  swap_space=0.05, num_gpu_blocks_override=12, **{**ENGINE, "max_model_len": 128})
        compiles.clear()
        shared = list(range(100, 140))
        prompts = [shared + list(range(i, i + 5 + 3 * i)) for i in range(8)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
                            use_tqdm=False)
        report[f"swap/{tp}"] = dict(tokens=[[c.token_ids for c in o.outputs] for o in outs],
                                    preemptions=llm.engine.stats["preemptions"], compiles_after_warmup=len(compiles))
        # structured outputs: the runner's masking program over the replicated logits, beside an unguided row
        guided = SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                structured_outputs=StructuredOutputsParams(regex=GUIDED_REGEX))
        outs = llm.generate(["Hello", "Once upon"], [guided, SamplingParams(temperature=0, max_tokens=12)],
                            use_tqdm=False)
        first = outs[0].outputs[0]
        report[f"swap/{tp}"].update(guided=[o.outputs[0].token_ids for o in outs], guided_text=first.text,
                                    guided_logprobs=[lp[t].logprob for lp, t in zip(first.logprobs, first.token_ids)],
                                    compiles_with_guided=len(compiles))
    return report


def _bf16_layout_mismatches() -> dict[str, list[str]]:
    """Params loaded at TP 2 in bfloat16 (qwen2: with a fused QKV bias) are, bit for bit, the TP 1
    params put in the TP layout; the names that are not, per load format."""
    import numpy as np

    from jengine.loader import load_model
    from jengine.models import get_model_family
    from jengine.sharding import fused_parts, make_mesh, to_tp_layout

    model, out = os.path.join(os.path.dirname(FIXTURE), "qwen2"), {}
    for load_format in ("safetensors", "dummy"):
        cfg, one = load_model(model, dtype="bfloat16", load_format=load_format)
        _, two = load_model(model, dtype="bfloat16", load_format=load_format, mesh=make_mesh(2))
        specs = get_model_family(cfg.architecture).weight_specs(cfg)
        out[load_format] = []
        for name, value in one.items():
            want, got = np.asarray(value), np.asarray(two[name])
            parts = fused_parts(specs[name], cfg, 2)
            want = to_tp_layout(want, parts, 2, cfg.head_dim) if parts else want
            if got.dtype != want.dtype or not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                out[load_format].append(name)
    return out


def _logits_shape(runner) -> list[int]:
    """The shape of a (padding-only) step's logits, as the sampler receives them."""
    import dataclasses

    from jengine.step_input import pack

    ints, floats, layout = pack(dataclasses.replace(runner.dummy_input(8, 4), sampling=None))
    runner.kv_caches, logits, _ = runner._forward(runner.params, runner.kv_caches, ints, floats, runner.prev_ids,
                                                  *runner.output_buffers((8, 4)), layout=layout)
    return list(logits.shape)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("tp"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    # 11 engines' warm-ups on 2 CPU cores: over 300 s on a loaded or slow machine (seen: session 36's dev
    # machine), inside pytest's 600 s per test
    proc = subprocess.run([sys.executable, __file__, out_dir], capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_tokens_of_tp_equal_tp1_from_safetensors(report, tp):
    assert report[f"st/{tp}"]["tokens"] == report["st/1"]["tokens"]


def test_greedy_tokens_of_tp8_from_orbax_and_tp4_dummy_equal_tp1(report):
    assert report["orbax/8"]["tokens"] == report["st/1"]["tokens"]
    assert report["dummy/4"]["tokens"] == report["dummy/1"]["tokens"]


@pytest.mark.parametrize("run", ["st/2", "st/4", "st/8", "orbax/8", "dummy/4"])
def test_logprobs_of_tp_match_tp1_within_tolerance(report, run):
    base = report[run.split("/")[0].replace("orbax", "st") + "/1"]
    for key in ("logprobs", "prompt_logprobs"):
        for got, want in zip(report[run][key], base[key]):
            assert got == pytest.approx(want, abs=2e-4), key


def test_tp2_swapping_and_copy_on_write_pages_generate_what_tp1_does(report):
    assert report["swap/2"]["preemptions"] > 0
    assert report["swap/2"]["tokens"] == report["swap/1"]["tokens"]


def test_tp2_masks_structured_outputs_as_tp1_does(report):
    one, two = report["swap/1"], report["swap/2"]
    assert two["guided"] == one["guided"] and two["guided_text"] == one["guided_text"]
    assert re.fullmatch(r"[a-z]{3,8}( [0-9]*)?", one["guided_text"]), one["guided_text"]  # the regex, or its start
    assert len(one["guided_logprobs"]) == len(one["guided"][0]) and all(x <= 0 for x in one["guided_logprobs"])
    assert max(abs(a - b) for a, b in zip(one["guided_logprobs"], two["guided_logprobs"])) < 1e-4
    assert one["compiles_with_guided"] == two["compiles_with_guided"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_replicas_on_disjoint_devices_generate_what_one_engine_does(report, tp):
    r = report[f"dp2/{tp}"]
    assert r["tokens"] == report["st/1"]["tokens"] and r["last"] == report["st/1"]["tokens"][0]
    assert [sorted(set(d)) for d in r["devices"]] == [list(range(tp)), list(range(tp, 2 * tp))]
    assert all(steps > 0 for steps in r["steps"])  # both replicas got requests


def test_bf16_weights_at_tp2_are_bit_identical_to_tp1_in_the_tp_layout(report):
    assert report["bf16_layout"] == {"safetensors": [], "dummy": []}


def test_step_outputs_have_the_shapes_of_tp1(report):
    for run in ("st/2", "st/4", "st/8"):
        assert report[run]["logits_shape"] == report["st/1"]["logits_shape"] == [4, 320]


def test_nothing_compiles_after_warmup(report):
    runs = {k: r["compiles_after_warmup"] for k, r in report.items() if "compiles_after_warmup" in r}
    assert len(runs) == len(RUNS) + 4 and set(runs.values()) == {0}, runs


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_weight_is_sharded_by_its_logical_axes(report, tp):
    r = report[f"st/{tp}"]
    q, d, hidden, inter, vocab = 8, 16, 128, 192, 320
    kv = tp  # 1 KV head, replicated to one per shard
    for name, spec in r["param_specs"].items():
        assert r["devices"][name] == tp
        kind = name.split(".")[-1]
        want = {"embed": ["tp", None], "qkv": [None, "tp"], "o": ["tp", None], "gate_up": [None, "tp"],
                "down": ["tp", None]}.get(kind, [None])
        assert spec == want, name
    assert r["shapes"]["layers.0.qkv"] == [hidden, (q + 2 * kv) * d]
    assert r["shard_shapes"]["layers.0.qkv"] == [[hidden, (q + 2 * kv) * d // tp]]
    assert r["shard_shapes"]["layers.0.gate_up"] == [[hidden, 2 * inter // tp]]
    assert r["shard_shapes"]["layers.1.down"] == [[inter // tp, hidden]]
    assert r["shard_shapes"]["embed"] == [[vocab // tp, hidden]]
    assert r["shard_shapes"]["final_norm"] == [[hidden]]


@pytest.mark.parametrize("run,kv_heads", [("st/2", 2), ("st/8", 8), ("dummy/4", 4), ("orbax/8", 8)])
def test_kv_cache_is_split_by_kv_heads_with_one_head_set_per_shard(report, run, kv_heads):
    r = report[run]
    assert all(spec == [None, "tp"] for spec in r["cache_specs"])
    assert r["cache_shape"][1] == kv_heads
    tp = int(run.split("/")[1])
    assert r["cache_shard_shapes"] == [[2, kv_heads // tp] + r["cache_shape"][2:]]


def test_tensor_parallel_size_is_validated_against_devices_and_heads():
    cfg = ModelConfig.from_model_dir(LLAMA4HEADS)  # 4 query heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the number of devices \(8\)"):
        EngineConfig(model=LLAMA4HEADS, tensor_parallel_size=3).resolve(cfg, "cpu", num_devices=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide the number of query heads \(4\)"):
        EngineConfig(model=LLAMA4HEADS, tensor_parallel_size=8).resolve(cfg, "cpu", num_devices=8)
    with pytest.raises(ValueError, match=r"data_parallel_size=4 replicas of tensor_parallel_size=4 devices need 16"):
        EngineConfig(model=LLAMA4HEADS, tensor_parallel_size=4, data_parallel_size=4).resolve(cfg, "cpu", 8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=LLAMA4HEADS, tensor_parallel_size=0)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_passes_tensor_parallel_size_to_the_engine(command):
    from jengine.cli import build_parser, engine_kwargs

    args = build_parser().parse_args([command, "jengine/tiny-llama", "--tensor-parallel-size", "4"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 4


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
