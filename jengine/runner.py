"""The device side of one engine iteration: the programs run over a bucket-padded `StepInput`
(`jengine.step_input`), and `ModelRunner`, which launches them.

The forward runs the model over the ragged batch, writes new K/V into the pages and takes the logits
of each sequence's last scheduled token; the sampling program samples on the device. The cache is
donated, so XLA updates it in place. Every (tokens, sequences) bucket is compiled at start-up
(`jengine.warmup`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jengine import kv_cache, sharding
from jengine.buckets import shape_pairs
from jengine.config import ModelConfig
from jengine.engine_config import EngineConfig
from jengine.executable_cache import stores_loaded_executables
from jengine.models import get_model_family
from jengine.sampler import apply_token_bitmask, compute_logprobs, sample
from jengine.sampling_params import MAX_LOGPROBS
from jengine.sampling_tables import (
    SMALL_TOP_K,
    WIDE_TOP_K,
    SamplerSwitches,
    build_sampling_tensors,
    program_inputs,
    sampler_switches,
)
from jengine.step_input import StepInput, build_step_input, pack, unpack


class PromptLogprobs(NamedTuple):
    token_logprobs: jax.Array  # [T] f32, logprob of prompt_targets
    token_ranks: jax.Array  # [T] int32, their ranks (tokens at least as likely)
    topk_ids: jax.Array  # [T, MAX_LOGPROBS] int32
    topk_logprobs: jax.Array  # [T, MAX_LOGPROBS] f32


# Steps of at least this many tokens compile their GEMMs with cuBLAS only; smaller ones let XLA's
# autotuner also try its Triton GEMMs. On an H200 (8B, benchmarks/RESULTS.md, session 4) the autotuner
# picks split-K Triton GEMMs at 64 tokens, faster alone but leaving f32 partial sums that the next
# fusions reduce: cuBLAS made the 64-token decode step 6.03 -> 5.77 ms, and the 16- and 32-token steps
# slower (4.62 -> 4.84 ms; 4.81 -> 4.95 ms in session 5).
CUBLAS_GEMM_MIN_TOKENS = 64
CUBLAS_OPTIONS = {"xla_gpu_enable_triton_gemm": False}  # GEMMs through cuBLAS (benchmarks/gemm.py uses it too)


def forward_compiler_options(num_tokens: int) -> dict | None:
    """XLA options for the forward program of a `num_tokens` bucket (None: the defaults). Only on GPUs,
    and never over a choice the user made in XLA_FLAGS. Quantized weights (`jengine.quantization`) are
    multiplied by 8-bit activations, which cuBLASLt's fp8 GEMMs take as they are."""
    if (jax.default_backend() != "gpu" or num_tokens < CUBLAS_GEMM_MIN_TOKENS
            or "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", "")):
        return None
    return dict(CUBLAS_OPTIONS)


# Loaded copies of each decode bucket's forward, which take the bucket's steps in turn. XLA re-records a
# CUDA graph (~3 µs of host time per command, 1.4 ms for the 8B forward's 422) whenever a buffer it uses
# moved since its last run, and a step's temporaries are allocated per run: while earlier steps are still
# on the device, they cycle through a few places. A copy whose turn comes every `FORWARD_COPIES` steps finds
# them where it left them when the cycle's length divides it. On an H100 (RESULTS.md, session 39) the 8B
# batch-1 forward re-recorded in 88% of its steps with 2 copies (and with 3 or 6), in 4% with 4: the
# temporaries' cycle was 4 steps long there (2 at batch 64, session 22, and for the fp8 forward).
FORWARD_COPIES = 4

PROMPT_LOGPROBS_CHUNK = 256  # tokens whose [C, V] logits exist at once when prompt logprobs are asked for


def _prompt_logprobs(params, hidden, targets, *, cfg: ModelConfig) -> PromptLogprobs:
    """Logprobs of the next prompt token at every position `[T]`, in chunks so [T, V] never exists whole.

    Its own small program, launched only for steps where a request asks for prompt logprobs. Buckets
    above one chunk loop over their chunks on the device (`lax.map`, a static trip count): one chunk's
    LM head and top-k in the program, whatever T, which keeps its start-up lowering and compile small.
    """
    family = get_model_family(cfg.architecture)

    def chunk(rows):
        h, t = rows
        return compute_logprobs(family.compute_logits(params, cfg, h), jnp.maximum(t, 0))

    num_tokens, size = hidden.shape[0], PROMPT_LOGPROBS_CHUNK
    if num_tokens <= size:
        return PromptLogprobs(*chunk((hidden, targets)))
    chunks = -(-num_tokens // size)
    pad = chunks * size - num_tokens
    rows = (jnp.pad(hidden, ((0, pad), (0, 0))).reshape(chunks, size, hidden.shape[1]),
            jnp.pad(targets, (0, pad)).reshape(chunks, size))
    out = jax.lax.map(chunk, rows)
    return PromptLogprobs(*(x.reshape(chunks * size, *x.shape[2:])[:num_tokens] for x in out))


def _forward(params, kv_caches, ints, floats, prev_ids, logits_buffer, hidden_buffer, *, layout, cfg: ModelConfig,
             mesh=None):
    """The model over one ragged batch: new K/V into the pages, logits of each sequence's last token.

    Tokens the host did not know yet (sampled by the step still running when this one was prepared)
    are taken from that step's output `prev_ids [max_seqs]` on the device. Returns the cache, the
    logits `[S, V]` f32 and the final hidden states `[T, H]` (read only for prompt logprobs), written
    over the donated `logits_buffer` and `hidden_buffer` (same shapes), so that they keep their
    addresses from step to step (see `ModelRunner`).
    """
    del logits_buffer, hidden_buffer  # donated: XLA writes the outputs of their shapes into them
    inp = unpack(ints, floats, layout)
    known = inp.prev_token_index < 0
    token_ids = jnp.where(known, inp.model.token_ids, prev_ids[jnp.maximum(inp.prev_token_index, 0)])
    model_input = dataclasses.replace(inp.model, token_ids=token_ids)
    family = get_model_family(cfg.architecture)
    kv_caches, hidden = family.forward(params, cfg, model_input, kv_caches, mesh=mesh)  # hidden [T, H]
    return kv_caches, family.compute_logits(params, cfg, hidden[inp.logits_indices]), hidden


# (filter_k, filter_p, random, k_bound, small_p) a batch can need: the filters only come
# with the general (random) program, which greedy batches with logit_bias or penalties also take, and
# top-k only with top-p: with any k; every k <= SMALL_TOP_K, with or without a top-p-only row; every k <=
# WIDE_TOP_K without one (`sampler_switches`).
_FILTERS = ((False, False, False, 0, False), (False, False, True, 0, False), (False, True, True, 0, False),
            (True, True, True, 0, False), (True, True, True, SMALL_TOP_K, False),
            (True, True, True, SMALL_TOP_K, True), (True, True, True, WIDE_TOP_K, True))
# Top logprobs are a program of their own (`_top_logprobs`), and so is structured outputs' masking of the logits
# (`_mask_logits`): the sampling variants have no twins with either.
SAMPLER_VARIANTS = tuple(SamplerSwitches(k, p, r, False, bound, small_p) for k, p, r, bound, small_p in _FILTERS)


def _sample(logits, ints, floats, ids_buffer, *, layout, filter_k: bool, filter_p: bool, random: bool,
            top_logprobs: bool, k_bound: int, small_p: bool):
    """Sampling as its own program per (S, filter_k, filter_p, random, top_logprobs, k_bound, small_p): the
    host knows which of top-k and top-p (and which select), the general program (random draws, logit_bias,
    penalties) and top logprobs the batch needs, so no data-dependent branch is needed.
    Also writes the ids into the first rows of the donated `ids_buffer [max_seqs]`, which the next step's
    forward reads as its `prev_ids`."""
    out = sample(logits, unpack(ints, floats, layout), filter_k=filter_k, filter_p=filter_p, random=random,
                 top_logprobs=top_logprobs, k_bound=k_bound, small_p=small_p)
    # First: jit gives a donated input to the first output of its shape, and `out.next_ids` has this
    # one's when S is the largest bucket.
    return jax.lax.dynamic_update_slice(ids_buffer, out.next_ids, (0,)), out


def _top_logprobs(logits, next_ids):
    """The sampled tokens' raw logprobs and ranks and each row's top MAX_LOGPROBS, as `compute_logprobs`
    gives them: a small program of its own per S, launched after the sampling program on the steps where a
    row asks for logprobs. So the sampling variants have no top-logprobs twins (17 programs per S before it;
    each sampling program is ~0.37 s of a cold start's one-thread lowering on an H200 host and ~5 s of
    compile; the 8B's cold start 57-62 -> 47-51 s, RESULTS.md sessions 46-47)."""
    return compute_logprobs(logits, next_ids, MAX_LOGPROBS)


def _mask_logits(logits, bitmask):
    """Structured outputs: the logits `[S, V]` with the tokens each row's bitmask `[S, ceil(V / 32)]` does not
    allow at -inf, written over the donated logits (which keep their buffer). A small program of its own per
    S, launched before the sampling program on the steps where a row is guided, so that guided batches take
    the sampling variants unguided ones do (they had three programs of their own per S, each ~0.37 s of a cold
    start's one-thread lowering on an H200 host and ~5 s of compile, RESULTS.md sessions 46-47); what follows
    sees the masked logits, raw logprobs included, as in vLLM."""
    return apply_token_bitmask(logits, bitmask)


class ModelRunner:
    """Owns the params, the KV cache and the compiled step; executes one StepInput at a time. Its
    programs are built before serving by `warmup.ProgramBuilder`.

    XLA re-records the commands of a CUDA graph whose buffers moved since the graph's last run: on an
    H200 1.4-2.1 ms of host time per 8B batch-64 step, every step (benchmarks/RESULTS.md, sessions
    21-22). So the buffers the forward's kernels use stay put from step to step: the logits and
    hidden states are written over donated buffers per bucket, and the sampled ids over one donated
    `[max_seqs]` buffer. A program's temporaries are allocated per run, and while one step runs the
    next one's take another place, the two places alternating; so on GPUs the forward of each bucket
    that decode steps can use (T <= the largest S) is loaded twice (from its executable-cache entry, or
    `executable_cache.reload` of the copy compiled at warm-up) and the
    bucket's steps take the two copies in turn, each with its own graph, which then finds its
    temporaries where it left them. Prefill buckets run long enough to hide re-recording, and each
    copy costs start-up time. The packed inputs, fresh arrays each step, mostly land where the last
    ones were; copying them into fixed buffers cost 0.16 ms per step on the device (cause not found).

    `mesh`: the tensor-parallel mesh (None: one device). `cfg` is then the model the devices hold
    (`sharding.sharded_model_config`); params arrive sharded; the cache is split by KV heads, and
    every program's output shardings are pinned so that no step sees a new input sharding (no recompiles).
    """

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, params: dict, num_pages: int, num_host_pages: int,
                 mesh=None):
        self.cfg, self.ecfg, self.params, self.mesh = cfg, ecfg, params, mesh
        self.embedding_programs: dict[int, jax.stages.Compiled] = {}  # by padded length (pooling.warmup)
        self.num_pages = num_pages
        cache_sharding = None if mesh is None else sharding.kv_cache_sharding(mesh)
        self._cache_sharding = cache_sharding
        # Allocated after warm-up's compilations (`allocate_kv_cache`): XLA's GEMM autotuning borrows
        # device memory while compiling, which a cache sized to most of the free memory would not leave.
        self.kv_caches: list[jax.Array] | None = None
        self.kv_dtype = jnp.dtype(ecfg.cache_dtype(cfg.dtype))
        self.host_pool = kv_cache.HostPagePool(cfg, num_host_pages, ecfg.block_size, self.kv_dtype)
        self.max_seqs = max(ecfg.seq_buckets)
        fwd, smp, plp = {}, {}, {}
        if mesh is not None:
            rep = sharding.replicated(mesh)
            caches = [cache_sharding] * cfg.num_hidden_layers  # inputs are committed arrays or host numpy
            fwd = dict(out_shardings=(caches, rep, rep))  # logits and hidden gathered onto every device
            smp = plp = dict(out_shardings=rep)
        self._replicated = rep if mesh is not None else None  # where step inputs and outputs live
        # The ids the last step sampled, `[max_seqs]`: the next forward reads them, the next sampling
        # program writes its own over them (donated).
        self.prev_ids = self._put(np.zeros(self.max_seqs, np.int32))
        self.logits_buffers: dict[int, jax.Array] = {}  # S -> the buffer the forward writes its logits over
        self.hidden_buffers: dict[int, jax.Array] = {}  # T -> the same for its hidden states
        # Whether programs run as CUDA graphs (GPUs). Only then are decode buckets' forwards loaded
        # `FORWARD_COPIES` times (elsewhere a program has no graph, and on the CPU a copy of one JAX loaded
        # from its cache would not run), and does warm-up run every program once (a first run records the
        # graphs, tens of ms of host time, `ProgramBuilder._run_every_program`; on the CPU running the
        # largest buckets costs more than it saves).
        self.graphs = stores_loaded_executables()
        self.copies: dict[tuple, tuple] = {}  # layout -> the forward's other loaded copies (`FORWARD_COPIES`)
        self._runs: collections.Counter = collections.Counter()  # layout -> steps so far
        self._forward = jax.jit(functools.partial(_forward, cfg=cfg, mesh=mesh), donate_argnums=(1, 5, 6),
                                keep_unused=True, static_argnames=("layout",), **fwd)  # kept: the output buffers
        # Each jit wraps a function object of this runner's own (a partial), so that jit's trace and
        # lowering caches are never shared between engines of one process: a lowering shared with an
        # earlier engine compiles to that engine's executable without a compile, which on the CPU can
        # be one JAX loaded from its persistent cache, and ExecutableCache would store it without its
        # kernels (see `stores_loaded_executables`).
        self.sample_jit = jax.jit(functools.partial(_sample), donate_argnums=(3,),
                                  static_argnames=("layout", *SamplerSwitches._fields), **smp)
        self.prompt_logprobs_jit = jax.jit(functools.partial(_prompt_logprobs, cfg=cfg), **plp)
        self.top_logprobs_jit = jax.jit(functools.partial(_top_logprobs), **smp)
        self.mask_jit = jax.jit(functools.partial(_mask_logits), donate_argnums=(0,), **smp)
        self.compiled: dict[tuple, jax.stages.Compiled] = {}  # filled at warm-up (`ProgramBuilder`), in parallel

    def allocate_kv_cache(self) -> None:
        if self.kv_caches is None:
            self.kv_caches = kv_cache.allocate(self.cfg, self.num_pages, self.ecfg.block_size, self.kv_dtype,
                                               self._cache_sharding)

    def _put(self, x):
        """Host arrays copied onto the device (every device of the mesh, replicated). Copied, never
        aliased: the CPU client can wrap a numpy array's memory instead, which a program that is
        donated it cannot write over, so its output would take a new buffer."""
        return jax.device_put(x, self._replicated, may_alias=False)

    def _output_specs(self, bucket: tuple[int, int]) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The shapes of a (T, S) bucket's logits `[S, V]` f32 and hidden states `[T, H]`."""
        logits = jax.ShapeDtypeStruct((bucket[1], self.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        hidden = jax.ShapeDtypeStruct((bucket[0], self.cfg.hidden_size), self.cfg.dtype, sharding=self._replicated)
        return logits, hidden

    def forward_args(self, bucket: tuple[int, int]) -> tuple[tuple, tuple]:
        """A (T, S) bucket's forward: its static layout, and its arguments (the cache's shapes before it
        is allocated)."""
        caches = self.kv_caches if self.kv_caches is not None else kv_cache.specs(
            self.cfg, self.num_pages, self.ecfg.block_size, self.kv_dtype, self._cache_sharding)
        ints, floats, layout = pack(dataclasses.replace(self.dummy_input(*bucket), sampling=None))
        return layout, (self.params, caches, ints, floats, self.prev_ids, *self._output_specs(bucket))

    def trace_forward(self, bucket: tuple[int, int]) -> tuple[tuple, jax.stages.Traced]:
        """The forward program of a (T, S) bucket, traced: its key in the compiled programs, and the
        traced program."""
        layout, args = self.forward_args(bucket)
        traced = self._forward.trace(*args, layout=layout)
        _, logits, hidden = traced.out_info
        if (logits.shape, logits.dtype, hidden.shape, hidden.dtype) != tuple(
                x for spec in self._output_specs(bucket) for x in (spec.shape, spec.dtype)):
            raise AssertionError(f"forward outputs {logits}, {hidden} differ from the buffers given for them")
        return ("forward", layout), traced

    def buckets(self) -> list[tuple[int, int]]:
        """Every (T, S) pair a step can be padded to: S sequences need at least S tokens."""
        return shape_pairs(self.ecfg.token_buckets, self.ecfg.seq_buckets)

    def execute(self, inp: StepInput, *, prompt_logprobs: bool | None = None):
        """Launch one step (asynchronously): (sampler output, prompt logprobs or None). Results stay
        on the device until read. Placeholder tokens are taken from the ids the previous `execute`
        sampled. The sampling program's variant is what the batch's sampling tensors need
        (`sampler_switches`); `prompt_logprobs` defaults to whether the input asks for them."""
        return self.launch_sample(self.launch_forward(inp, prompt_logprobs=prompt_logprobs), inp.sampling)

    def launch_forward(self, inp: StepInput, *, prompt_logprobs: bool | None = None) -> tuple:
        """`execute`'s first half: the forward (`inp.sampling` is not read). Returns what `launch_sample`
        takes, so that the host can build the sampling tensors while the forward runs (the engine does
        when they need the previous step's tokens)."""
        if prompt_logprobs is None:
            prompt_logprobs = bool(np.any(inp.prompt_targets >= 0))
        bucket = (inp.model.token_ids.shape[0], inp.logits_indices.shape[0])
        ints, floats, layout = pack(dataclasses.replace(inp, sampling=None))
        forward = self.program("forward", layout)
        copies = self.copies.get(layout)
        if copies:  # the copies take the bucket's steps in turn
            forward = (forward, *copies)[self._runs[layout] % (1 + len(copies))]
        self._runs[layout] += 1
        self.kv_caches, logits, hidden = forward(self.params, self.kv_caches, ints, floats, self.prev_ids,
                                                 *self.output_buffers(bucket))
        self.logits_buffers[bucket[1]], self.hidden_buffers[bucket[0]] = logits, hidden
        return logits, hidden, inp.prompt_targets if prompt_logprobs else None

    def launch_sample(self, forward: tuple, sampling):
        """`execute`'s second half: the sampling program (and prompt logprobs) over a launched forward; on a
        guided step the masking program before it, and on a logprobs step the top-logprobs program after."""
        logits, hidden, prompt_targets = forward
        bitmask = np.asarray(sampling.token_bitmask)
        if bitmask.shape[1]:  # structured outputs
            logits = self.mask_logits(logits, bitmask)
        switches = sampler_switches(sampling, self.cfg.vocab_size)
        separate = switches.top_logprobs  # top logprobs in `_top_logprobs`
        if separate:
            switches = switches._replace(top_logprobs=False)
        s_ints, s_floats, s_layout = pack(program_inputs(sampling, switches))
        self.prev_ids, out = self.program("sample", s_layout, *switches)(logits, s_ints, s_floats, self.prev_ids)
        if separate:
            chosen, ranks, top_ids, top_lp = self.program("top_logprobs", logits.shape[0])(logits, out.next_ids)
            out = out._replace(sampled_logprobs=chosen, sampled_ranks=ranks, topk_ids=top_ids, topk_logprobs=top_lp)
        plp = None
        if prompt_targets is not None:
            plp = self.program("prompt_logprobs", prompt_targets.shape[0])(self.params, hidden, prompt_targets)
        return out, plp

    def mask_logits(self, logits: jax.Array, bitmask: np.ndarray) -> jax.Array:
        """Launch the masking program (`_mask_logits`) over a step's logits `[S, V]` (donated: this S's logits
        buffer) with the numpy token bitmask `[S, ceil(V / 32)]`; the masked logits are the buffer again."""
        masked = self.program("mask", logits.shape[0])(logits, self._put(bitmask))
        self.logits_buffers[logits.shape[0]] = masked
        return masked

    def output_buffers(self, bucket: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
        """The buffers a (T, S) bucket's forward writes its logits and hidden states over, made on first
        use (warm-up makes every bucket's) or after a failed step consumed them."""
        logits, hidden = self.logits_buffers.get(bucket[1]), self.hidden_buffers.get(bucket[0])
        if logits is None or hidden is None or logits.is_deleted() or hidden.is_deleted():  # not per step
            logits, hidden = self._put(tuple(np.zeros(spec.shape, spec.dtype) for spec in self._output_specs(bucket)))
            self.logits_buffers[bucket[1]], self.hidden_buffers[bucket[0]] = logits, hidden
        return logits, hidden

    def program(self, kind: str, *key):
        """The executable compiled at warm-up for this program and static key, else its jit (which
        compiles on first use: only for shapes warm-up did not cover, e.g. in tests)."""
        compiled = self.compiled.get((kind, *key))
        if compiled is not None:
            return compiled
        if kind == "forward":
            return functools.partial(self._forward, layout=key[0])
        if kind == "sample":
            layout, *switches = key
            return functools.partial(self.sample_jit, layout=layout, **SamplerSwitches(*switches)._asdict())
        return {"top_logprobs": self.top_logprobs_jit, "mask": self.mask_jit}.get(kind, self.prompt_logprobs_jit)

    def dummy_input(self, num_tokens: int, num_seqs: int) -> StepInput:
        """A padding-only StepInput of the given bucket (writes nothing, reads nothing)."""
        sampling = build_sampling_tensors([], num_seqs, self.cfg.vocab_size)
        return build_step_input([], num_tokens, num_seqs, self.ecfg.pages_per_seq, self.ecfg.block_size, sampling)

    def copy_pages(self, pairs):
        self.kv_caches = kv_cache.copy_pages(self.kv_caches, pairs)

    def swap_out(self, pairs):
        self.host_pool.swap_out(self.kv_caches, pairs)

    def swap_in(self, pairs):
        self.kv_caches = self.host_pool.swap_in(self.kv_caches, pairs)


def to_host(out):
    """Bring a step's results (a NamedTuple of arrays) to numpy; blocks until the device is done."""
    return type(out)(*(np.asarray(x) for x in jax.device_get(tuple(out))))


__all__ = ["ModelRunner", "to_host"]
