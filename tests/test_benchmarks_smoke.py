"""Every benchmark program runs end to end on the tiny preset and writes valid JSON (sizes tiny, CPU).
`kernels.py`'s parts have their own file, test_benchmarks_kernels.py."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
ENGINE = ["--model", "jengine/tiny-llama", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "64", "--token-buckets", "16", "64", "--seq-buckets", "8"]


def _run(name: str, argv: list[str], tmp_path) -> dict:
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    out = tmp_path / f"{name}.json"
    importlib.import_module(name).main([*argv, "--output-json", str(out)])
    with open(out) as f:
        return json.load(f)


# Benchmarks that start engines in child processes (startup's runs, serving's server, compile_variance's
# rounds). On a GPU this process may hold most of the device by then (an earlier test's engine; jengine sets
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 at import), so the children neither preallocate nor size their KV cache
# from the device's whole memory.
CHILD_ENGINE = ["--gpu-memory-utilization", "0.03"]


@pytest.fixture
def children_share_the_device(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _run_apart(name: str, argv: list[str], tmp_path) -> dict:
    """`_run` in a process of its own: for benchmarks that time with CUPTI (JAX's Mosaic GPU profiler). In this
    file's process on an H200 it aborted the process, likely because the earlier traces (latency --trace,
    profile_step) had used CUPTI there (RESULTS.md, session 47)."""
    import subprocess

    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), *argv, "--output-json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_throughput_random_and_chat_like_write_results_and_bound(tmp_path):
    data = _run("throughput", [*ENGINE, "--num-prompts", "8", "--input-len", "16", "--output-len", "4"], tmp_path)
    (row,) = data["results"]
    assert row["backend"] == "jengine" and row["output_tokens"] == 32 and data["bound"]["bound_s"] > 0
    data = _run("throughput", [*ENGINE, "--dataset", "chat-like", "--num-prompts", "6"], tmp_path)
    assert data["results"][0]["output_tokens"] > 0
    # ShareGPT's first exchanges: prompts of 38-39 bytes, replies of 25-26 (the byte tokenizer's tokens)
    data = _run("throughput", [*ENGINE, "--dataset", "sharegpt", "--dataset-path", _sharegpt(tmp_path, 12),
                               "--num-prompts", "5"], tmp_path)
    assert data["args"]["dataset"] == "sharegpt" and 5 * 25 <= data["results"][0]["output_tokens"] <= 5 * 26
    with pytest.raises(SystemExit):  # a flag error before any engine starts
        _run("throughput", [*ENGINE, "--dataset", "sharegpt"], tmp_path)
    data = _run("throughput", [*ENGINE, "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                               "--allowed-token-ids", "5"], tmp_path)
    assert data["results"][0]["output_tokens"] == 12 and data["args"]["allowed_token_ids"] == 5
    data = _run("throughput", [*ENGINE, "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                               "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5", "--logprobs", "2",
                               "--flat-logprobs"], tmp_path)
    assert data["results"][0]["output_tokens"] == 12 and data["args"]["top_p"] == 0.9 and data["args"]["flat_logprobs"]
    assert data["results"][0]["gc"]["collections"] >= data["results"][0]["gc"]["full"] >= 0


def test_throughput_step_log_accounts_for_every_token(tmp_path):
    log_path = tmp_path / "steps.json"
    # --no-prefill-first: decodes beside prompt chunks, so the log holds all three kinds of step (the offline
    # default runs the 320 prompt tokens in prompt-only steps first)
    data = _run("throughput", [*ENGINE, "--num-prompts", "8", "--input-len", "40", "--output-len", "5",
                               "--no-prefill-first", "--step-log", str(log_path)], tmp_path)
    with open(log_path) as f:
        log = json.load(f)
    steps = log["steps"]
    assert len(steps) == data["results"][0]["steps"]
    assert sum(e["prompt_tokens"] for e in steps) == 8 * 40  # chunked prefill: 64-token steps
    assert sum(e["tokens"] - e["prompt_tokens"] for e in steps) == 8 * 4  # the first token comes from prefill
    assert all(e["tokens"] <= e["padded_tokens"] in (16, 64) and e["seqs"] <= e["padded_seqs"] for e in steps)
    assert all(e["seconds"] > 0 for e in steps)
    assert all(e[k] >= 0 for e in steps for k in ("host_s", "wait_s", "update_s"))
    assert all(r["host_ms"] > 0 for r in log["summary"])
    kinds = {r["kind"] for r in log["summary"]}
    assert kinds == {"prefill", "mixed", "decode"}
    assert sum(r["steps"] for r in log["summary"]) == len(steps)
    assert abs(sum(r["seconds"] for r in log["summary"]) - sum(e["seconds"] for e in steps)) < 1e-9


@pytest.mark.skipif(not _has_torch(), reason="torch / transformers not installed")
def test_throughput_hf_backend_reports_ratio(tmp_path):
    data = _run("throughput", [*ENGINE, "--backend", "both", "--num-prompts", "4", "--input-len", "8",
                               "--output-len", "4", "--hf-batch-size", "4"], tmp_path)
    assert data["ratios"]


def test_latency_reports_each_batch_size(tmp_path):
    data = _run("latency", [*ENGINE, "--batch-sizes", "1", "2", "--input-len", "8", "--output-len", "4",
                            "--num-iters", "1"], tmp_path)
    assert [r["batch"] for r in data["results"]] == [1, 2]
    assert all(r["ms_per_step"] > 0 for r in data["results"])


def test_latency_trace_reads_the_engines_own_steps(tmp_path):
    """--trace profiles one more run per batch size; its summary reads GPU kernels, so elsewhere it
    stops with a message instead of reporting an empty trace."""
    import jax

    argv = [*ENGINE, "--batch-sizes", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
            "--trace", "--host-events", "3", "--gaps", "2"]
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="no GPU kernels"):
            _run("latency", argv, tmp_path)
        return
    trace = _run("latency", argv, tmp_path)["results"][0]["trace"]
    assert trace["steps"] >= 4 and trace["busy_ms"] > 0 and len(trace["host_events"]) == 3
    assert len(trace["widest_gaps"]) == 2


@pytest.mark.parametrize("name, argv, message", [
    ("latency", ["--batch-sizes", "0"], "must be a positive integer, got 0"),
    ("latency", ["--num-iters", "0"], "must be a positive integer, got 0"),
    ("latency", ["--host-events", "-1"], "must be an integer >= 0, got -1"),
    ("throughput", ["--input-len", "-1"], "must be a positive integer, got -1"),
    ("throughput", ["--peak-tb-s", "0"], "must be a number > 0, got 0"),
    ("throughput", ["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    ("throughput", ["--logprobs", "21"], "logprobs must be"),
    ("prefix", ["--suffix-len", "-2"], "must be an integer >= 0, got -2"),
    ("long_context", ["--long-input-lens", "100", "0"], "must be a positive integer, got 0"),
    ("serving", ["--request-rate", "-1"], "must be a number > 0, got -1"),
    ("serving", ["--burstiness", "inf"], "--burstiness must be finite"),
    ("gemm", ["--split-k", "3"], "each S must be a power of two, got [3]"),
])
def test_bad_counts_and_lengths_are_usage_errors(name, argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(name, argv, tmp_path)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_prefix_caching_on_computes_fewer_prompt_tokens(tmp_path):
    data = _run("prefix", [*ENGINE, "--num-prompts", "8", "--prefix-len", "48", "--suffix-len", "8",
                           "--output-len", "2"], tmp_path)
    on, off = data["results"]
    assert off["computed_prompt_tokens"] == off["prompt_tokens"] == 8 * 56
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]


def test_long_context_runs_chunked_on_and_off(tmp_path):
    argv = [*ENGINE, "--num-decodes", "2", "--decode-input-len", "8", "--decode-output-len", "48",
            "--warmup-tokens", "2", "--long-input-lens", "160", "200", "--long-output-len", "2",
            "--long-interval-steps", "2"]
    data = _run("long_context", argv, tmp_path)
    assert [r["chunked_prefill"] for r in data["results"]] == ["on", "off"]
    assert all(r["long_ttft_mean_ms"] > 0 and r["decode_tpot_ms"] > 0 for r in data["results"])


def test_startup_cold_and_warm_cache(tmp_path, children_share_the_device):
    data = _run("startup", [*ENGINE, *CHILD_ENGINE, "--workload-rounds", "1", "--workload-requests", "3",
                            "--workload-max-prompt", "32", "--workload-max-tokens", "4",
                            "--cache-min-compile-secs", "0"], tmp_path)
    cold, warm = data["results"]
    assert cold["first_token_s"] > 0 and warm["first_token_s"] > 0
    assert warm["startup_cache_hits"] > 0 and cold["startup_cache_hits"] == 0
    assert isinstance(warm["compilations_after_warmup"], int)
    assert 0 < cold["cache_mb"] <= warm["cache_mb"] and cold["cache_files"] > 0
    for row in (cold, warm):  # the phases tile the time to first token; the engine's own phases tile its part
        phases = [row[f"{n}_s"] for n in ("entry", "imports", "backend", "engine", "request")]
        assert min(phases) >= 0 and abs(sum(phases) - row["first_token_s"]) < 1e-6
        assert set(row["engine_phases"]) == {"weights", "tokenizer", "compile"}
        assert sum(row["engine_phases"].values()) <= row["engine_startup_s"] + 1e-6
        assert 0 < row["lowering_s"] <= row["engine_phases"]["compile"]
        # the constructor's CPU time: at most every core all along
        assert 0 < row["engine_cpu_s"] <= row["cores"] * row["engine_s"] * 1.05 + 0.1 and row["helpers_cpu_s"] >= 0
        # the live threads' share of it, by name and nice level (Linux): within it
        assert all(secs >= 0.5 for _, _, secs in row["threads_cpu_s"])
        listed = sum(secs for _, _, secs in row["threads_cpu_s"])
        assert listed <= row["live_threads_cpu_s"] <= row["engine_cpu_s"] * 1.02 + 0.5  # /proc counts in clock ticks
        # the constructor's thread: on a core plus queued for one within its wall time (Linux with schedstats)
        if row["main_thread_sched_s"] is not None:
            on_core, queued = row["main_thread_sched_s"]
            assert 0 < on_core and 0 <= queued and on_core + queued <= row["engine_s"] * 1.02 + 0.05
    if sys.platform.startswith("linux"):  # the cold start's main thread traced and lowered for seconds
        assert any(isinstance(name, str) and isinstance(nice, int) for name, nice, _ in cold["threads_cpu_s"])
    # the cold start lowered forwards and sampling programs on warm-up's thread, inside its lowering phase
    kinds = cold["lowering_by_kind"]
    assert kinds["forward"][1] >= 1 and kinds["sample"][1] >= 1
    assert 0 < sum(secs for secs, _ in kinds.values()) <= cold["lowering_s"] + 1e-6
    # and XLA compiled each program this thread lowered (none on the warm start: all loaded)
    assert sum(n for _, n in cold["compiling_by_program"].values()) == sum(n for _, n in kinds.values())
    assert {"jit(_forward)", "jit(_sample)"} <= set(cold["compiling_by_program"])
    assert warm["compiling_by_program"] == {}
    for row in (cold, warm):  # the sampling programs lowered again alone, after the workload
        assert row["lowering_alone"]["num_seqs"] == 8 and row["lowering_alone"]["programs"] >= 1
        assert row["lowering_alone"]["seconds"] > 0


def _sharegpt(tmp_path, n: int) -> str:
    """A ShareGPT-format file of `n` first exchanges (and a third turn, which the benchmarks ignore)."""
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human", "value": f"{i} is the number I want to hear about."},  # no two share a page
        {"from": "gpt", "value": f"The number {i} is a number."}, {"from": "human", "value": "Thanks"}]}
        for i in range(n)]))
    return str(path)


def test_serving_launches_a_server_and_measures_streams(tmp_path, children_share_the_device):
    """ShareGPT prompts (the tiny model's byte tokenizer) arriving in gamma-distributed bursts."""
    pytest.importorskip("uvicorn", reason="the server's dependencies are not installed (a `--no-deps` install)")
    argv = ["--launch-server", "--model", "jengine/tiny-llama", "--max-model-len", "256", "--num-prompts", "6",
            "--dataset", "sharegpt", "--dataset-path", _sharegpt(tmp_path, 8), "--sharegpt-output-len", "4",
            "--request-rate", "100", "--burstiness", "0.5", "--goodput", "ttft:60000",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "16,64", "--seq-buckets", "8",
            "--dtype", "float32", *CHILD_ENGINE]
    data = _run("serving", argv, tmp_path)
    result = data["result"]
    assert result["completed"] == 6 and result["failed"] == 0 and result["output_tokens"] == 24
    assert result["ttft_mean_ms"] > 0 and result["goodput_req_s"] > 0
    assert result["prefix_cache_hit_rate"] == 0  # a new server has seen none of the prompts
    assert data["sweep"] is None and data["args"]["burstiness"] == 0.5


def test_serving_sweeps_concurrency_against_one_server_and_plots(tmp_path, children_share_the_device):
    pytest.importorskip("uvicorn", reason="the server's dependencies are not installed (a `--no-deps` install)")
    plot = tmp_path / "cdf.png"
    argv = ["--launch-server", "--model", "jengine/tiny-llama", "--max-model-len", "256", "--num-prompts", "4",
            "--input-len", "40", "--output-len", "3", "--max-concurrency", "1", "4", "--plot", str(plot),
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "16", "64", "--seq-buckets",
            "8", "--dtype", "float32", *CHILD_ENGINE]
    data = _run("serving", argv, tmp_path)
    assert [row["max_concurrency"] for row in data["sweep"]] == [1, 4]
    assert all(row["completed"] == 4 and row["output_tokens"] == 12 for row in data["sweep"])
    # 40-token prompts fill two pages the prefix cache could serve again; the second point's prompts are new
    assert [row["prefix_cache_hit_rate"] for row in data["sweep"]] == [0, 0]
    assert data["result"] == data["sweep"][-1]
    assert plot.stat().st_size > 0 and (tmp_path / "cdf_sweep.png").stat().st_size > 0


@pytest.mark.parametrize("block_size", [None, 8])
def test_profile_step_builds_its_engine_and_runs_steps(block_size, tmp_path):
    """The engine's default page size when --block-size is not given; elsewhere than a GPU the run
    stops at the trace's summary (it reads GPU kernels only), after the steps ran."""
    import jax

    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import profile_step

    argv = ["--model", "jengine/tiny-llama", "--batch-sizes", "2", "--token-buckets", "8", "--context", "16",
            "--max-model-len", "64", "--steps", "2", "--trace-dir", str(tmp_path / "trace"),
            "--output-json", str(tmp_path / "p.json")]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="no GPU kernels"):
            profile_step.main(argv)
        return
    profile_step.main(argv)
    with open(tmp_path / "p.json") as f:
        assert json.load(f)["results"][0]["step_ms"] > 0


@pytest.mark.parametrize("flag,value", [("--gpu-memory-utilization", "0"), ("--block-size", "12"),
                                        ("--steps", "0"), ("--sequence", "-1 2")])
def test_profile_step_refuses_bad_flags_as_usage_errors(flag, value, capsys):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import profile_step

    with pytest.raises(SystemExit) as exit_info:
        profile_step.main([flag, *value.split()])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_tp_check_compares_tensor_parallel_with_one_device():
    import subprocess

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, os.path.join(BENCH, "tp_check.py"), "--tensor-parallel-sizes", "2",
                          "--max-tokens", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["tp"] == 2 and row["tokens_equal"] and row["max_logprob_diff"] < 1e-3


def test_gemm_bench_times_each_projection_and_the_swiglu_product(tmp_path):
    data = _run("gemm", ["--model", "jengine/tiny-llama", "--m", "1", "8", "--calls", "2", "--no-pallas"], tmp_path)
    ops = {(r["m"], r["op"], r["impl"]) for r in data["rows"]}
    for m in (1, 8):
        assert {(m, op, "xla cublas") for op in ("qkv", "o", "gate_up", "down")} <= ops
        assert {(m, "qkv", impl) for impl in ("xla autotuned", "xla cublaslt", "xla cublas, w as [N, K]")} <= ops
        assert {(m, "gate_up", "xla cublas + swiglu"), (m, "swiglu", "xla"), (m, "down", "swiglu, then cublas"),
                (m, "down", "swiglu into autotuned")} <= ops
    # (The program timer reports nan, with a warning, for calls too short for its clock.)
    assert all(not r["us"] <= 0 for r in data["rows"]) and any(r["us"] > 0 for r in data["rows"])


def test_gemm_bench_times_an_explicit_split_k_and_checks_it(tmp_path):
    data = _run("gemm", ["--model", "jengine/tiny-llama", "--m", "8", "--calls", "2", "--no-pallas", "--ops", "qkv",
                         "down", "--split-k", "2", "4", "--only", "split-k"], tmp_path)
    got = {(r["op"], r["impl"]) for r in data["rows"]}
    assert got == {(op, f"xla split-k {s}{suffix}") for op in ("qkv", "down") for s in (2, 4)
                   for suffix in ("", " + sum")}


def test_serving_fails_loudly_when_no_request_succeeds(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SystemExit, match="every request failed"):
        _run("serving", ["--base-url", f"http://127.0.0.1:{port}", "--model", "jengine/tiny-llama",
                         "--num-prompts", "3", "--input-len", "8", "--output-len", "2"], tmp_path)


def test_compile_variance_reports_each_fresh_compile(tmp_path, children_share_the_device):
    data = _run("compile_variance", [*ENGINE, *CHILD_ENGINE, "--bucket", "16", "8", "--rounds", "1", "--alongside",
                                     "0", "1", "--calls", "2", "--warmup-calls", "1", "--repeats", "2"], tmp_path)
    assert [(row["alongside"], row["round"]) for row in data["results"]] == [(0, 0), (1, 0)]
    assert all(row["ms_per_call"] > 0 and row["serial_ms"] > 0 and row["compile_s"] > 0 for row in data["results"])
    assert all(row["cache"] is None for row in data["results"])  # every round compiles: no cache serves it
    from compile_variance import selected_algorithms

    hlo = ('%g = (bf16[256,6144]{1,0}, s8[4]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
           'metadata={op_name="x"}, backend_config={"gemm_backend_config":{"epilogue":"DEFAULT",'
           '"selected_algorithm":"7"}}\n%h = f32[2]{0} add(%c, %d)\n'
           '%l = custom-call(%a), custom_call_target="__cublas$lt$matmul", backend_config={"selected_algorithm":"-1"}')
    assert selected_algorithms(hlo) == [7, -1]
    with pytest.raises(SystemExit):
        _run("compile_variance", [*ENGINE, "--bucket", "64", "64"], tmp_path)  # not one of the buckets


def test_compile_probe_times_the_warmups_compiles_per_program_kind(tmp_path):
    from jengine import buckets

    args = ["--model", "jengine/tiny-llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--workers", "2"]
    data = _run("compile_probe", [*args, "--warmup", "--tokens-per-seq-row", "8"], tmp_path)
    assert buckets.TOKENS_PER_SEQ_ROW == 4  # the override lasts for the run only
    assert set(data["kinds"]) == {"jit(_forward)", "jit(_sample)", "jit(_top_logprobs)", "jit(_mask_logits)",
                                  "jit(_prompt_logprobs)"}
    assert sum(kind["n"] for kind in data["kinds"].values()) == data["compiles"]
    assert 0 < data["lowering_s"] <= data["warmup_s"]
    data = _run("compile_probe", [*args, "--token-buckets", "16", "32", "--seq-buckets", "8"], tmp_path)
    assert data["one"]["bucket"] == [16, 8] and data["rest"]["buckets"] == 1


def test_step_probe_runs_each_batch_in_the_engines_buckets(capsys):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import step_probe

    step_probe.main(["--model", "jengine/tiny-llama", "--batch-sizes", "1", "2", "--num-tokens", "8", "--context",
                     "16"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "sync step" in line]
    assert len(lines) == 2 and "B=  1" in lines[0] and "B=  2" in lines[1]


def test_step_probe_ablations_take_the_models_calls(capsys, monkeypatch):
    """--ablate swaps the layer's RoPE + K/V write and attention for no-ops with the same signatures (the
    module's functions are restored after)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import step_probe

    from jengine.models import llama

    for name in ("rope_and_write_kv", "ragged_paged_attention"):
        monkeypatch.setattr(llama, name, getattr(llama, name))
    step_probe.main(["--model", "jengine/tiny-llama", "--batch-sizes", "1", "--num-tokens", "8", "--context", "16",
                     "--ablate", "both"])
    assert sum("sync step" in line for line in capsys.readouterr().out.splitlines()) == 1


def test_sampler_filter_times_every_select_and_checks_them_against_the_radix_one(tmp_path):
    data = _run_apart("sampler_filter", ["--batch-sizes", "3", "--vocab", "3000", "--calls", "2"], tmp_path)
    assert len(data["results"]) == 5 and all(row["same_as_radix"] for row in data["results"])
    with pytest.raises(SystemExit):
        _run("sampler_filter", ["--top-p", "1.5"], tmp_path)


def test_grammar_host_times_fills_and_advances_of_built_and_copied_matchers(tmp_path):
    data = _run("grammar_host", ["--model", "jengine/tiny-llama", "--rows", "5", "--steps", "3", "--copies",
                                 "--transfer-mb", "0.01"], tmp_path)
    assert [(r["constraint"], r["matchers"]) for r in data["results"]] == [
        ("regex", "built"), ("regex", "copies"), ("json", "built"), ("json", "copies")]
    assert all(r["fill_ms"] > 0 and r["advance_pool_ms"] > 0 for r in data["results"])
    assert data["transfers"][0]["megabytes"] == 0.01 and data["transfers"][0]["device_put_ms"] > 0


def test_bench_model_dir_trains_a_tokenizer_the_engine_loads(tmp_path):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import bench_model_dir

    from jengine.tokenizer import load_tokenizer

    files = bench_model_dir.corpus_files()[:8]
    summary = bench_model_dir.make(str(tmp_path), "jengine/tiny-llama", 300, files)
    tok = load_tokenizer(str(tmp_path))
    assert summary["tokens"] == len(tok) == 300  # the trained one, not the preset's byte tokenizer
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    with pytest.raises(ValueError, match="exceeds the model's vocabulary"):
        bench_model_dir.make(str(tmp_path), "jengine/tiny-llama", 10**6, files)
    # a guided throughput run on it (a request whose regex may end finishes at an EOS, ignore_eos or not)
    model = ["--model", str(tmp_path), "--load-format", "dummy", *ENGINE[2:]]
    data = _run("throughput", [*model, "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                               "--structured-outputs", '{"regex": "[a-z ]+"}'], tmp_path)
    assert 4 <= data["results"][0]["output_tokens"] <= 24 and data["args"]["structured_outputs"] == {"regex": "[a-z ]+"}
