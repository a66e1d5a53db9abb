"""Start-up: process start to first token, with an empty and then a warm compilation cache.

    python benchmarks/startup.py --model jengine/llama-3.1-8b --max-model-len 2048

Runs a child process twice (cold: a fresh temporary `compilation_cache_dir`; warm: the same dir again).
Each child builds the engine, generates one token, and reports the wall time from just before the parent
spawned it to that token, split into phases (process start, imports, GPU client, engine constructor and its
own phases, first request). It then runs a short randomised workload (prompt lengths, output lengths and
sampling options drawn at random) and counts the XLA compilations that happen after warm-up (the goal
is 0), with the listener tests/test_no_recompile.py uses. startup_programs counts the programs built
during start-up (compiled, or loaded from JAX's persistent cache: startup_cache_hits);
executable_cache_hits counts those loaded from jengine's executable cache (neither lowered nor compiled).
After the workload each child also traces and lowers the sampling variants of the largest sequence bucket once
more, alone (a jit of its own, so nothing is cached): a program's lowering on a quiet host, against warm-up's
per program while the compile pool ran beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time

from common import (
    CompileCounter,
    add_engine_flags,
    build_llm,
    child_argv,
    positive_float,
    positive_int,
    print_table,
    run_marked_child,
    save_results,
)

_MARK = "STARTUP_RESULT "


def random_params(rng: random.Random, max_tokens: int):
    from jengine import SamplingParams

    options = dict(max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.7:
        options.update(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 50]),
                       min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, rng.randrange(1000)]))
    else:
        options.update(temperature=0.0)
    if rng.random() < 0.3:
        options.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2)
    if rng.random() < 0.3:
        options.update(logprobs=rng.randint(0, 5), n=rng.randint(1, 2))
    return SamplingParams(**options)


def child(args) -> None:
    """One measured process: engine, first token, then the randomised workload under the compile counter."""
    marks = {"entry": time.time()}  # interpreter start and this script's imports end here
    import jax
    from compile_probe import timed_compiles

    import jengine.llm  # noqa: F401  (the engine's imports; jengine sets its XLA flags at import)
    from jengine import SamplingParams

    marks["imports"] = time.time()
    jax.devices()
    marks["backend"] = time.time()
    if args.cache_min_compile_secs is not None:  # set before the engine, which then leaves it alone
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", args.cache_min_compile_secs)
    with CompileCounter() as startup_compiles:
        cpu, threads, sched = _cpu_seconds(), _thread_cpu_seconds(), _sched_seconds()
        with timed_compiles() as compiles:
            llm = build_llm(args, compilation_cache_dir=args.cache_dir)
        marks["engine"] = time.time()
        sched_now = _sched_seconds()
        sched = None if sched is None or sched_now is None else [b - a for a, b in zip(sched, sched_now)]
        cpu = [after - before for before, after in zip(cpu, _cpu_seconds())]
        threads = {k: v - threads.get(k, 0.0) for k, v in _thread_cpu_seconds().items()}
        live_cpu = sum(max(0.0, secs) for secs in threads.values())  # the live threads' share of the constructor's
        threads = [[name, nice, secs] for (name, nice), secs in sorted(threads.items(), key=lambda kv: -kv[1])
                   if secs >= 0.5]
        compiling_by_program = {}  # program name: [seconds of its compiles in their threads, compiles]
        for name, start, end in compiles:
            spent = compiling_by_program.setdefault(name, [0.0, 0])
            spent[0] += end - start
            spent[1] += 1
        vocab = llm.engine.model_config.vocab_size
        llm.generate([[101, 102, 103, 104]], SamplingParams(max_tokens=1), use_tqdm=False)
        first_token = marks["request"] = time.time()
    rng = random.Random(args.seed)
    max_prompt = max(1, min(args.workload_max_prompt, args.max_model_len - args.workload_max_tokens))
    with CompileCounter() as later:
        for _ in range(args.workload_rounds):
            n = rng.randint(1, args.workload_requests)
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
            llm.generate(prompts, [random_params(rng, args.workload_max_tokens) for _ in prompts], use_tqdm=False)
    lowering_alone = sampling_lowering_alone(llm)
    print(_MARK + json.dumps({"first_token_wall": first_token, "marks": marks, "lowering_alone": lowering_alone,
                              "engine_startup_s": llm.engine.startup_seconds,
                              "engine_phases": llm.engine.startup_phases,
                              "lowering_s": llm.engine.builder.warmup_lowering_seconds,
                              "lowering_by_kind": llm.engine.builder.lowering_by_kind,
                              "compiling_by_program": compiling_by_program,
                              "first_runs_s": llm.engine.builder.warmup_first_runs_seconds,
                              "helpers_started": llm.engine.builder.build_helpers_started,
                              "helpers": llm.engine.builder.build_helpers_finished,
                              "helpers_wait_s": llm.engine.builder.build_helpers_wait_seconds,
                              "kv_cache_memory": llm.engine.kv_cache_memory,
                              "engine_cpu_s": cpu[0], "helpers_cpu_s": cpu[1], "cores": os.cpu_count(),
                              "threads_cpu_s": threads, "live_threads_cpu_s": live_cpu, "main_thread_sched_s": sched,
                              "buckets": llm.engine.num_compiled_buckets, "startup_programs": startup_compiles.count,
                              "startup_cache_hits": startup_compiles.cache_hits,
                              "executable_cache_hits": llm.engine.builder.executable_cache_hits,
                              "compilations_after_warmup": later.count}), flush=True)


def sampling_lowering_alone(llm) -> dict:
    """Seconds to trace and lower each sampling variant of the largest sequence bucket once more, with nothing
    else running (a jit of its own: none of warm-up's traces or lowerings is reused), and the bucket."""
    import functools

    import jax

    from jengine import runner as runner_module
    from jengine.sampling_tables import SamplerSwitches

    runner, builder = llm.engine.runner, llm.engine.builder
    s = max(runner.logits_buffers)
    fresh = jax.jit(functools.partial(runner_module._sample), donate_argnums=(3,),
                    static_argnames=("layout", *SamplerSwitches._fields))
    started = time.perf_counter()
    for variant in runner_module.SAMPLER_VARIANTS:
        ints, floats, layout = builder.dummy_sampling(s, variant)  # the inputs warm-up lowers the variant with
        fresh.trace(runner.logits_buffers[s], ints, floats, runner.prev_ids, layout=layout, **variant._asdict()).lower()
    return {"num_seqs": s, "programs": len(runner_module.SAMPLER_VARIANTS), "seconds": time.perf_counter() - started}


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process's threads, and of its waited-for children (the build
    helpers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _sched_seconds() -> tuple[float, float] | None:
    """This thread's seconds on a core and waiting in the run queue for one, from the scheduler's statistics
    (Linux with schedstats; elsewhere None). Its wall time beyond both it slept: on the GIL, a future, I/O."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_core, queued = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_core) / 1e9, int(queued) / 1e9


def _thread_cpu_seconds() -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) of this process's live threads by (name less its trailing number, nice level),
    from /proc (Linux; elsewhere empty). Threads that have exited (the compile pools') are not in it."""
    ticks, found = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:  # the thread ended meanwhile
            continue
        fields = rest.split()  # from the state field on: utime, stime, nice are fields 14, 15, 19 of stat
        key = (name.split("(", 1)[1].rstrip("0123456789_-"), int(fields[16]))
        found[key] = found.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return found


def run_child(argv: list[str], cache_dir: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", "--cache-dir", cache_dir]
    spawn = time.time()
    result = run_marked_child(cmd, _MARK, timeout)
    result["first_token_s"] = result.pop("first_token_wall") - spawn
    # seconds per phase: process start + script imports, jax + jengine imports, GPU client, engine, first request
    marks, last = result.pop("marks"), spawn
    for name in ("entry", "imports", "backend", "engine", "request"):
        result[f"{name}_s"], last = marks[name] - last, marks[name]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--cache-dir", default=None, help="compilation cache dir (default: a fresh temp dir)")
    parser.add_argument("--cache-min-compile-secs", type=float, default=None,
                        help="persist programs compiling at least this long (default: the engine's setting)")
    parser.add_argument("--workload-rounds", type=positive_int, default=4)
    parser.add_argument("--workload-requests", type=positive_int, default=16, help="most requests per round")
    parser.add_argument("--workload-max-prompt", type=positive_int, default=512)
    parser.add_argument("--workload-max-tokens", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-timeout", type=positive_float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}

    own = child_argv(argv)  # the children print; only the parent writes the file
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jengine-xla-cache-")
    if args.cache_dir is None or not os.path.isdir(cache_dir) or not os.listdir(cache_dir):
        print(f"compilation cache: {cache_dir} (empty)")
    else:
        print(f"warning: {cache_dir} is not empty, so the 'cold' run is not cold")
    rows = []
    for mode in ("cold", "warm"):
        row = {"cache": mode, **run_child(own, cache_dir, args.child_timeout)}
        files = [os.path.join(root, f) for root, _, names in os.walk(cache_dir) for f in names]
        row["cache_files"] = len(files)
        row["cache_mb"] = round(sum(os.path.getsize(f) for f in files) / 1e6, 1)  # JAX's cache (compressed) + jengine's
        rows.append(row)
        print(f"{mode}: first token after {row['first_token_s']:.1f}s")
    if args.cache_dir is None:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print_table(rows, ["cache", "first_token_s", "engine_startup_s", "buckets", "startup_programs",
                       "startup_cache_hits", "executable_cache_hits", "compilations_after_warmup", "cache_files",
                       "cache_mb"])
    print("seconds per phase (process start and script imports / jax and jengine imports / GPU client / "
          "engine constructor / first request; the constructor's own phases after it, and the part of compile "
          "this thread spent tracing and lowering while the pool compiled, and running every program once):")
    for row in rows:
        phases = " / ".join(f"{row[f'{n}_s']:.1f}" for n in ("entry", "imports", "backend", "engine", "request"))
        inner = ", ".join(f"{k} {v:.1f}" for k, v in row["engine_phases"].items())
        helpers = (f"; {row['helpers']} of {row.get('helpers_started', row['helpers'])} build helpers finished, "
                   f"waited for {row['helpers_wait_s']:.1f} after its own share" if row.get("helpers_started") else "")
        kinds = ", ".join(f"{n} {kind} {secs:.1f}" for kind, (secs, n) in row.get("lowering_by_kind", {}).items())
        print(f"  {row['cache']}: {phases}  ({inner}; tracing and lowering {row['lowering_s']:.1f}"
              f"{f' ({kinds})' if kinds else ''}{helpers}, every program's first run {row['first_runs_s']:.1f})")
        alone, (secs, n) = row["lowering_alone"], row.get("lowering_by_kind", {}).get("sample", (0.0, 0))
        in_warmup = f"; in warm-up {secs / n:.2f} s each" if n else ""
        print(f"    tracing and lowering {alone['programs']} sampling programs (S={alone['num_seqs']}) again alone: "
              f"{alone['seconds'] / alone['programs']:.2f} s each{in_warmup}")
        cores_busy = (row["engine_cpu_s"] + row["helpers_cpu_s"]) / row["engine_s"]
        compiles = ", ".join(f"{n} {name} {secs:.0f}" for name, (secs, n) in row["compiling_by_program"].items())
        if compiles:
            print(f"    XLA compiles, wall seconds in their threads: {compiles}")
        print(f"    CPU in the engine constructor: {row['engine_cpu_s']:.0f} s in this process, "
              f"{row['helpers_cpu_s']:.0f} s in its build helpers: {cores_busy:.1f} of {row['cores']} cores busy "
              "on average")
        if row.get("threads_cpu_s"):
            named = ", ".join(f"{name} (nice {nice}) {secs:.0f}" for name, nice, secs in row["threads_cpu_s"])
            ended = max(0.0, row["engine_cpu_s"] - row["live_threads_cpu_s"])
            print(f"    of this process's, by thread still alive after it (0.5 s or more): {named}; threads that "
                  f"ended (the compile pools) {ended:.0f}")
        if row.get("main_thread_sched_s"):
            on_core, queued = row["main_thread_sched_s"]
            asleep = max(0.0, row["engine_s"] - on_core - queued)
            print(f"    the constructor's thread over its {row['engine_s']:.1f} s: on a core {on_core:.1f}, waiting "
                  f"for a core {queued:.1f}, asleep {asleep:.1f} (the GIL, futures, the build helpers, I/O)")
    return save_results(args, rows)


if __name__ == "__main__":
    main()
