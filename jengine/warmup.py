"""Before serving: compile, or load from the executable cache, every program a `ModelRunner` will run.

`ProgramBuilder.warmup` builds the step programs of every bucket into the runner and runs each once,
so that no step compiles or pays an executable's first run; `compile_programs` builds programs outside
the buckets (the embedding programs), and `build_jobs` a build helper's share (`jengine.build_helpers`).
Each program is keyed in the executable cache (`executable_cache.py`) and loaded where it is stored,
else traced, lowered and compiled, then stored there.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jengine import build_helpers
from jengine.executable_cache import ExecutableCache, describe, reload, source_digest
from jengine.generate import hidden_states_program
from jengine.models import get_model_family
from jengine.runner import FORWARD_COPIES, SAMPLER_VARIANTS, ModelRunner, forward_compiler_options
from jengine.sampling_tables import SamplerSwitches, build_sampling_tensors, program_inputs
from jengine.step_input import pack
from jengine.structured_output import bitmask_words

logger = logging.getLogger(__name__)


def _default_workers() -> int:
    """Threads that compile at once (XLA compiles without the GIL): the cores, at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


class ProgramBuilder:
    """Builds `runner`'s programs, filling its compiled programs (and the other copies of copied
    forwards, see `FORWARD_COPIES`) before the first step; keeps warm-up's report.

    `executable_cache`: where warm-up loads compiled programs from and stores them (None: compile all).
    """

    def __init__(self, runner: ModelRunner, executable_cache: ExecutableCache | None = None):
        self.runner = runner
        self.executable_cache = executable_cache
        self.executable_cache_hits = 0  # programs warm-up loaded instead of lowering and compiling
        self._key_context = None  # (params described, closure) of every program's cache key, made once (`_key`)
        self.warmup_lowering_seconds = 0.0  # warm-up's time tracing and lowering (one thread), for reports
        # this thread's tracing and lowering per kind of program ("forward", "sample", ...): [seconds, programs]
        self.lowering_by_kind: dict[str, list] = {}
        self.warmup_first_runs_seconds = 0.0  # warm-up's time running every program once, for reports
        self.build_helpers_started = 0  # build helper processes warm-up started
        self.build_helpers_finished = 0  # of those, how many finished cleanly
        self.build_helpers_wait_seconds = 0.0  # how long warm-up waited for them after its own share

    def _key(self, program: str, args: tuple, statics: tuple = (), compiler_options: dict | None = None
             ) -> str | None:
        """The executable cache's key of a program over `args` (None: no cache). Every program closes
        over the model config, the mesh and the model family's source; the params are described once."""
        cache, runner = self.executable_cache, self.runner
        if cache is None:
            return None
        if self._key_context is None:
            family = get_model_family(runner.cfg.architecture)
            closure = (runner.cfg, runner.mesh, source_digest((family.forward, family.compute_logits)))
            self._key_context = describe(runner.params), closure
        params_text, closure = self._key_context
        inputs = [params_text if arg is runner.params else describe(arg) for arg in args]
        return cache.key(program, inputs, closure=closure, statics=statics, compiler_options=compiler_options)

    def _start_builds(self, programs, pool: concurrent.futures.Executor, copied=frozenset()) -> list[tuple]:
        """Starts each `(name, key, trace, compiler options)` of `programs` in `pool` (`name`: a tuple that
        starts with the program's kind, `lowering_by_kind`'s key): a load where the
        executable cache holds the key (and one per other copy for a name in `copied`), else a compile of
        the program that `trace()` traces. This thread traces and lowers those, one at a time in the
        given order, while the pool loads and compiles: lowering is Python (it holds the GIL anyway),
        and the module text must not depend on what other threads lower meanwhile, since the persistent
        compilation cache keys on it (concurrent lowerings of the Mosaic GPU attention kernel missed an
        earlier process's cache). Returns the builds for `_finish_builds`."""
        cache, builds = self.executable_cache, []
        for name, key, trace, opts in programs:
            stored = key is not None and cache.contains(key)
            copies = FORWARD_COPIES - 1 if name in copied else 0
            if stored:  # a copied forward's other copies load from the entry too, alongside the first
                job = pool.submit(cache.load, key)
                others = [pool.submit(cache.load, key) for _ in range(copies)]
            else:
                lowered = self._lower(name[0], trace)
                job, others = pool.submit(self._compile_lowered, lowered, opts, key), [None] * copies
            builds.append((name, key, trace, opts, stored, job, others))
        return builds

    def _lower(self, kind: str, trace) -> jax.stages.Lowered:
        """`trace().lower()`, its time counted under `kind` in `lowering_by_kind`."""
        started = time.perf_counter()
        lowered = trace().lower()
        spent = self.lowering_by_kind.setdefault(kind, [0.0, 0])
        spent[0] += time.perf_counter() - started
        spent[1] += 1
        return lowered

    def _finish_builds(self, builds: list[tuple], pool: concurrent.futures.Executor):
        """`(name, executable, futures of its other copies)` per build, in order. An entry that would not
        load is compiled (and stored again) after all; a copy that did not load (or of a program compiled
        here) is made by `reload`."""
        for name, key, trace, opts, stored, job, others in builds:
            compiled = job.result()
            if stored and compiled is not None:
                self.executable_cache_hits += 1
            elif stored:
                compiled = self._compile_lowered(trace().lower(), opts, key)
            yield name, compiled, [pool.submit(reload, compiled) if f is None or f.result() is None else f
                                   for f in others]

    def _compile_lowered(self, lowered: jax.stages.Lowered, compiler_options: dict | None, key: str | None):
        cache = self.executable_cache
        return lowered.compile(compiler_options) if key is None else cache.compile(key, lowered, compiler_options)

    def compile_programs(self, programs: dict) -> dict:
        """Programs outside the step buckets (the embedding programs), `{name: (program, args, trace)}`:
        loaded from the executable cache where it holds them, else traced (`trace()`), lowered,
        compiled and stored there; loads and compiles in parallel, as at warm-up."""
        with concurrent.futures.ThreadPoolExecutor(_default_workers()) as pool:  # built as (program, name)
            builds = self._start_builds((((program, name), self._key(program, args), trace, None)
                                         for name, (program, args, trace) in programs.items()), pool)
            return {name[1]: compiled for name, compiled, _ in self._finish_builds(builds, pool)}

    def _forward_build(self, bucket: tuple[int, int], layout, args) -> tuple:
        """A (T, S) bucket's forward as `_start_builds` takes it: (name, key, trace, compiler options)."""
        opts = forward_compiler_options(bucket[0])
        return (("forward", layout), self._key("forward", args, (layout,), opts),
                functools.partial(lambda b: self.runner.trace_forward(b)[1], bucket), opts)

    def job_build(self, job: tuple) -> tuple:
        """A build helper's job as `_start_builds` takes it, (name, key, trace, compiler options):
        `("forward", (T, S))`, or `("hidden_states", n)` (the embedding program of padded length n, as
        `pooling.warmup` builds it)."""
        kind, what = job
        runner = self.runner
        if kind == "forward":
            return self._forward_build(what, *runner.forward_args(what))
        args, trace = hidden_states_program(runner.cfg, runner.params, what, runner.mesh)
        return (kind, what), self._key("hidden_states", args), trace, None

    def build_jobs(self, jobs: list[tuple], workers: int) -> None:
        """Build the jobs' programs into the executable cache (`build_helpers`), `workers` compiling while
        this thread traces and lowers, as at warm-up."""
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            for _ in self._finish_builds(self._start_builds(map(self.job_build, jobs), pool), pool):
                pass

    def warmup(self, progress: bool = True, workers: int | None = None, helpers: int | None = None,
               embedding_lengths: tuple[int, ...] = ()) -> int:
        """Compile every program before serving, `workers` at a time (XLA compiles without the GIL):
        the forward per (T, S) bucket, sampling per S in each of its variants and its top logprobs, prompt
        logprobs per T (their input shapes come from the forwards' outputs), and the page moves.
        A program found in the executable cache is loaded instead, with no tracing, lowering or compile;
        forwards it lacks are shared with `helpers` build helper processes (default: `build_helpers.
        helper_count`), which store them there while this thread builds its own share. Helpers also
        store the embedding programs of `embedding_lengths` (`jengine serve`'s, which `pooling.warmup`
        then loads); without helpers those are left to it.
        Every step then runs an executable made here; the KV cache is allocated once they are
        compiled. Returns the number of buckets."""
        runner = self.runner
        buckets = runner.buckets()
        workers = workers or _default_workers()
        bar = tqdm(total=len(buckets), desc="Compiling buckets", disable=not progress)
        cache = self.executable_cache
        # The sampling and prompt-logprob programs, quick to lower but 1-5 s of XLA compile each, go to
        # the pool first and compile while this thread lowers the forwards (~1-2 s each on an H200, their
        # Mosaic GPU kernels most of it). Lowered last instead, their compiles piled up after the
        # forwards': the engine started ~10 s later (RESULTS.md, session 25).
        started = time.perf_counter()
        forwards, logits_of, hidden_of, copied = [], {}, {}, set()
        for bucket in buckets:
            layout, args = runner.forward_args(bucket)
            if self._copied(bucket):
                copied.add(("forward", layout))
            logits_of.setdefault(bucket[1], args[-2])
            hidden_of.setdefault(bucket[0], args[-1])
            forwards.append(self._forward_build(bucket, layout, args))
        handle, forwards, later = build_helpers.start(self, buckets, forwards, embedding_lengths, helpers)

        words = bitmask_words(runner.cfg.vocab_size)  # of a token bitmask row

        def samplers():
            for s, logits in logits_of.items():
                for variant in SAMPLER_VARIANTS:
                    s_ints, s_floats, s_layout = self.dummy_sampling(s, variant)
                    args = (logits, s_ints, s_floats, runner.prev_ids)
                    trace = functools.partial(runner.sample_jit.trace, *args, layout=s_layout, **variant._asdict())
                    yield ("sample", s_layout, *variant), self._key("sample", args, (s_layout, *variant)), trace, None
                args = (logits, jax.ShapeDtypeStruct((s,), np.int32, sharding=logits.sharding))
                trace = functools.partial(runner.top_logprobs_jit.trace, *args)
                yield ("top_logprobs", s), self._key("top_logprobs", args), trace, None
                args = (logits, jax.ShapeDtypeStruct((s, words), np.int32, sharding=logits.sharding))
                trace = functools.partial(runner.mask_jit.trace, *args)
                yield ("mask", s), self._key("mask", args), trace, None

        def prompt_logprobs():
            for t, hidden in hidden_of.items():
                args = (runner.params, hidden, np.zeros(t, np.int32))
                trace = functools.partial(runner.prompt_logprobs_jit.trace, *args)
                yield ("prompt_logprobs", t), self._key("prompt_logprobs", args), trace, None

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            try:
                builds = self._start_builds(itertools.chain(samplers(), prompt_logprobs(), forwards), pool, copied)
            except BaseException:
                if handle is not None:
                    handle.stop()
                raise
            self.warmup_lowering_seconds = time.perf_counter() - started
            if handle is not None:  # then load what the helpers stored (and build what they did not)
                self.build_helpers_started = handle.count
                self.build_helpers_finished = handle.wait()
                self.build_helpers_wait_seconds = time.perf_counter() - started - self.warmup_lowering_seconds
                builds += self._start_builds(later, pool, copied)
            copies = {}
            for name, compiled, others in self._finish_builds(builds, pool):
                runner.compiled[name] = compiled
                if others:
                    copies[name[1]] = others
                if name[0] == "forward":
                    bar.update()
            runner.copies.update((layout, tuple(f.result() for f in jobs)) for layout, jobs in copies.items())
        bar.close()
        if cache is not None:
            logger.info("executable cache: %d of %d programs loaded from %s", self.executable_cache_hits,
                        len(runner.compiled), cache.directory)
        runner.allocate_kv_cache()
        for bucket in buckets:  # every bucket's output buffers, before the first step
            runner.output_buffers(bucket)
        self._run_every_program(buckets if runner.graphs else buckets[:1])
        runner.copy_pages([(0, 0)])
        if runner.host_pool.pages is not None:
            runner.swap_out([(0, 0)])
            runner.swap_in([(0, 0)])
        jax.block_until_ready(runner.kv_caches)
        return len(buckets)

    def _copied(self, bucket: tuple[int, int]) -> bool:
        """Whether warm-up loads `FORWARD_COPIES` copies of this bucket's forward (decode-sized buckets on
        GPUs)."""
        return self.runner.graphs and bucket[0] <= self.runner.max_seqs

    def dummy_sampling(self, num_seqs: int, variant: SamplerSwitches):
        """Packed sampling inputs `(ints, floats, layout)` of a padding-only batch for a sampler variant."""
        tensors = build_sampling_tensors([], num_seqs, self.runner.cfg.vocab_size)
        return pack(program_inputs(tensors, variant))

    def _run_every_program(self, buckets: list[tuple[int, int]]) -> None:
        """Run every program of `buckets` once, on padding-only inputs (which read and write no page):
        each bucket's forward (every copy of a copied one) with prompt logprobs once per T, and every
        sampler variant, the top-logprobs program and the masking program per S. An executable's first run
        costs the host tens of ms (XLA records and instantiates its CUDA graphs); run here, that is start-up
        time instead of a stall at the first step of each bucket (on an H200 the throughput run lost ~0.1 s to
        them, RESULTS.md session 23). Also checks that the executables run."""
        runner = self.runner
        started = time.perf_counter()
        with_logprobs = set()
        for bucket in buckets:
            inp = runner.dummy_input(*bucket)
            for _ in range(FORWARD_COPIES if self._copied(bucket) else 1):
                runner.execute(inp, prompt_logprobs=bucket[0] not in with_logprobs)
                with_logprobs.add(bucket[0])
        for num_seqs in sorted({s for _, s in buckets}):
            for variant in SAMPLER_VARIANTS:
                s_ints, s_floats, s_layout = self.dummy_sampling(num_seqs, variant)
                runner.prev_ids, out = runner.program("sample", s_layout, *variant)(
                    runner.logits_buffers[num_seqs], s_ints, s_floats, runner.prev_ids)
            runner.program("top_logprobs", num_seqs)(runner.logits_buffers[num_seqs], out.next_ids)
            every_token = np.full((num_seqs, bitmask_words(runner.cfg.vocab_size)), -1, np.int32)
            runner.mask_logits(runner.logits_buffers[num_seqs], every_token)
        jax.block_until_ready(runner.prev_ids)
        self.warmup_first_runs_seconds = time.perf_counter() - started


__all__ = ["ProgramBuilder"]
