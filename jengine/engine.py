"""The engine loop: scheduler -> StepInput -> jitted step -> scheduler update -> detokenized outputs.

`LLMEngine.step()` is one iteration. Requests with n > 1 run as n child requests that share the
prompt's full pages through the prefix cache; their completions are gathered into one RequestOutput.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import time

import jax

from jengine.bad_words import bad_words_token_ids, last_tokens, needs_history
from jengine.buckets import pick_bucket, seq_bucket
from jengine.detokenizer import IncrementalDetokenizer
from jengine.engine_config import EngineConfig
from jengine.executable_cache import ExecutableCache, enable_jax_cache
from jengine.generate import padded_lengths
from jengine.generation_config import load_generation_config
from jengine.kv_cache import device_memory, num_device_pages, num_host_pages
from jengine.loader import load_model
from jengine.logprobs import FlatLogprobs, append_positions
from jengine.models import get_model_family
from jengine.outputs import RequestOutput
from jengine.penalty_window import PenaltyWindow
from jengine.prompts import tokenize_prompt, truncated
from jengine.quantization import linear_weights, quantize, scale_name
from jengine.request import PLACEHOLDER, Request
from jengine.request_groups import Child, Group, make_output
from jengine.runner import ModelRunner, to_host
from jengine.sampling_params import RequestOutputKind, SamplingParams
from jengine.sampling_tables import (
    DEFAULT_PENALTY_WINDOW,
    SamplingRow,
    bias_row,
    build_sampling_tensors,
    check_bias_table,
    check_token_ids,
)
from jengine.scheduler import Scheduler, SchedulerOutput
from jengine.sharding import log_memory, make_mesh, sharded_model_config
from jengine.step_input import build_step_input
from jengine.structured_output import GuidedRequests
from jengine.tokenizer import load_tokenizer
from jengine.warmup import ProgramBuilder

logger = logging.getLogger(__name__)


def _kv_memory_report(mem: dict | None, kv_caches) -> dict | None:
    """Bytes of KV pages on one device against that device's memory (None without memory statistics)."""
    if mem is None:
        return None
    kv = sum(x.addressable_shards[0].data.nbytes for x in kv_caches)
    free = mem["limit"] - mem["in_use"]  # what JAX's allocator had left once the weights were placed
    report = {"kv_bytes": kv, "free_after_weights": free, "device_total": mem["total"],
              "kv_fraction_of_free": kv / free if free > 0 else 0.0}
    logger.info("KV pages take %.1f GiB per device: %.1f%% of the %.1f GiB free after the weights (device %.1f GiB)",
                kv / 2**30, 100 * report["kv_fraction_of_free"], free / 2**30, mem["total"] / 2**30)
    return report


class _Phases:
    """Seconds spent in each named phase since the last mark (the engine constructor's breakdown)."""

    def __init__(self, t0: float):
        self.last, self.seconds = t0, {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now


class LLMEngine:
    """Owns the model runner (and the builder of its programs), the scheduler and the tokenizer; turns
    requests into outputs."""

    def __init__(self, config: EngineConfig, *, warmup: bool = True, progress: bool = True, devices=None,
                 embedding_programs: bool = False):
        """`devices`: the device group of this engine (a data-parallel replica); default all devices.
        `embedding_programs`: the caller will compile the embedding programs (`jengine serve`), which
        warm-up's build helpers then store for it when they run (`ProgramBuilder.warmup`)."""
        t0 = time.perf_counter()
        if config.compilation_cache_dir:
            enable_jax_cache(config.compilation_cache_dir)
        tp = config.tensor_parallel_size
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: one LLMEngine is one replica; "
                             "replicas run behind LLM(...) and jengine serve (jengine.data_parallel)")
        config.check_tensor_parallel(None, jax.device_count())
        mesh = make_mesh(tp, devices)
        phases = _Phases(t0)
        # read before the weights load, so that a bad file fails at once
        generation = load_generation_config(config.generation_config, config.model, config.override_generation_config)
        checkpoint_cfg, params = load_model(config.model, dtype=config.dtype, load_format=config.load_format,
                                            seed=config.seed, mesh=mesh)
        if config.quantization is not None:  # what a pre-quantized checkpoint left in 16 bits (`loader`)
            specs = get_model_family(checkpoint_cfg.architecture).weight_specs(checkpoint_cfg)
            plain = [name for name in linear_weights(specs) if scale_name(name) not in params]
            if plain:
                params = quantize(params, plain, config.quantization)
        # The generation config's EOS ids end requests too (scheduler, sampler, beam search, the server's
        # checks); the compiled programs never read them, so they are built from (and cached under) the
        # checkpoint's config alone.
        self.model_config = generation.with_eos_of(checkpoint_cfg)
        # Defaults of the sampling fields a request leaves unset (`LLM.get_default_sampling_params`, the server)
        self.sampling_defaults = generation.sampling_defaults
        if generation.path is not None or config.override_generation_config:
            logger.info("generation config %s (overrides %s): EOS ids %s, sampling defaults %s (generation_config="
                        "'vllm' ignores the file)", generation.path, config.override_generation_config,
                        list(self.model_config.eos_token_ids), self.sampling_defaults)
        self.config = config.resolve(self.model_config, jax.default_backend(), jax.device_count())
        cfg, ecfg = self.model_config, self.config
        phases.mark("weights")
        self.tokenizer = load_tokenizer(ecfg.model)
        phases.mark("tokenizer")
        device_cfg = sharded_model_config(checkpoint_cfg, tp)  # KV heads replicated when tp exceeds them
        log_memory(f"weights per device (tensor_parallel_size={tp})", params)
        device = None if mesh is None else next(
            (d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)
        mem = device_memory(device)
        kv_dtype = jax.numpy.dtype(ecfg.cache_dtype(cfg.dtype))
        num_pages = num_device_pages(device_cfg, ecfg, kv_dtype, device=device, tp=tp)
        num_cpu_pages = num_host_pages(device_cfg, ecfg, kv_dtype)
        executables = None if not config.compilation_cache_dir else ExecutableCache(
            os.path.join(config.compilation_cache_dir, "jengine-executables"))
        self.runner = ModelRunner(device_cfg, ecfg, params, num_pages, num_cpu_pages, mesh=mesh)
        self.builder = ProgramBuilder(self.runner, executables)
        self.scheduler = Scheduler(
            num_blocks=num_pages, block_size=ecfg.block_size, max_num_batched_tokens=ecfg.max_num_batched_tokens,
            max_num_seqs=ecfg.max_num_seqs, max_model_len=ecfg.max_model_len, eos_token_ids=cfg.eos_token_ids,
            enable_chunked_prefill=ecfg.enable_chunked_prefill, prefill_first=ecfg.prefill_first,
            enable_prefix_caching=ecfg.enable_prefix_caching, policy=ecfg.scheduling_policy,
            preemption_mode=ecfg.preemption_mode, num_cpu_blocks=num_cpu_pages)
        self.kv_cache_tokens = (num_pages - 1) * ecfg.block_size
        logger.info("KV cache: %d pages of %d tokens (%d tokens), %d host pages", num_pages, ecfg.block_size,
                    self.kv_cache_tokens, num_cpu_pages)
        lengths = tuple(padded_lengths(ecfg.max_model_len)) if embedding_programs else ()
        self.num_compiled_buckets = self.builder.warmup(progress, embedding_lengths=lengths) if warmup else 0
        self.runner.allocate_kv_cache()  # warm-up allocates it after compiling (autotuning needs the memory)
        log_memory("KV cache per device", self.runner.kv_caches)
        self.kv_cache_memory = _kv_memory_report(mem, self.runner.kv_caches)
        phases.mark("compile")  # every program compiled, the KV cache allocated, one checking step
        _freeze_heap()
        self.startup_seconds = time.perf_counter() - t0
        self.startup_phases = phases.seconds  # where the constructor's time went, for start-up reports
        logger.info("engine start-up %.1fs: %s", self.startup_seconds,
                    ", ".join(f"{k} {v:.1f}s" for k, v in self.startup_phases.items()))
        self._groups: dict[str, Group] = {}
        self._children: dict[str, Child] = {}  # by the child's (scheduler) request id
        self._rng_counter = 0
        self._guided = GuidedRequests(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        # (scheduler) ids of the unfinished children whose sampling tables need their previous token on the host
        # (`_needs_history`); empty, the usual case, costs a step nothing
        self._history: set[str] = set()
        self._inflight = None  # (SchedulerOutput, (SamplerOutput, prompt logprobs)) of the step on the device
        self.timings: collections.Counter = collections.Counter()  # seconds per phase of step()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "computed_prompt_tokens": 0, "steps": 0,
                      "preemptions": 0}
        # Set to a list (while no step is in flight) to record every step: its tokens and sequences,
        # real and padded, its prompt tokens and decode rows, and when its result reached the host
        # (`done`, perf_counter seconds). Benchmarks read it to see where a workload's time goes.
        self.step_log: list[dict] | None = None
        self._unresolved_log: collections.deque[dict] = collections.deque()

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt as text, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        return tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    priority: int = 0, arrival_time: float | None = None) -> list[int]:
        """Queue a request; returns its prompt's token ids."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        bad_words = self._check_token_params(params)
        bias = bias_row(params, self.model_config.vocab_size)  # one for the n sequences (their params differ in seeds)
        matchers = self._guided.new_matchers(params)  # raises for a bad grammar before anything is kept
        text, ids = self.tokenize_prompt(prompt)
        ids = truncated(ids, params.truncate_prompt_tokens, self.config.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(child_id, ids, child_params, arrival_time=arrival, priority=priority)
            self.scheduler.add_request(request)  # validates lengths; raises before anything is kept
            detok = IncrementalDetokenizer(self.tokenizer, child_params, ids) if self.tokenizer else None
            keep_dicts = params.output_kind is RequestOutputKind.CUMULATIVE and not params.flat_logprobs
            children.append(Child(request, request_id, detok, self._rng_counter,
                                   FlatLogprobs() if params.logprobs is not None else None, bad_words,
                                   PenaltyWindow(ids, self.model_config.vocab_size, DEFAULT_PENALTY_WINDOW)
                                   if params.uses_penalties else None, bias,
                                   logprob_dicts=[] if keep_dicts else None))
            self._rng_counter += 1
        self._children.update((c.request.request_id, c) for c in children)
        for child, matcher in zip(children, matchers):
            self._guided.add(child.request.request_id, matcher)
        if params.uses_penalties or params.structured_outputs or needs_history(bad_words):
            self._history.update(c.request.request_id for c in children)
        group = Group(request_id, text, ids, params, children)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = FlatLogprobs([None])
            children[0].request.skip_prefix_cache = True  # every prompt position must be computed
        self._groups[request_id] = group
        self.stats["prompt_tokens"] += len(ids) * params.n
        return ids

    def _check_token_params(self, params: SamplingParams) -> tuple:
        """Token ids in the params must exist in this model's vocabulary (the sampler would fail mid-step),
        and fit the sampler's bias table. Returns the bad words' token sequences."""
        vocab = self.model_config.vocab_size
        check_token_ids(params, vocab)
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer, vocab)
        check_bias_table(params, self.model_config.eos_token_ids, last_tokens(bad_words))
        return bad_words

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            self.scheduler.abort(child.request.request_id)
            self._children.pop(child.request.request_id, None)
            self._guided.discard(child.request.request_id)
            self._history.discard(child.request.request_id)

    def prepare_structured_outputs(self) -> None:
        """Make the grammar compiler now, on a worker thread, instead of at the first request with structured
        outputs, whose making would stall the running requests ~1.5 s (`GuidedRequests.prepare`)."""
        self._guided.prepare()

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._inflight is not None

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that advanced (cumulative text).

        Asynchronous: step N+1 is scheduled, prepared and launched before step N's tokens are read
        back, so the device never waits for Python. Tokens not known on the host yet are filled in on
        the device from step N's output; the outputs returned are those of step N.
        """
        clock = time.perf_counter
        t0 = clock()
        sched = self.scheduler.schedule()
        self._move_pages(sched)
        self.timings["schedule"] += clock() - t0
        outputs: list[RequestOutput] = []
        inflight, self._inflight = self._inflight, None
        launched = None
        if sched.scheduled:
            late = inflight is not None and self._needs_history(sched)
            t1 = clock()
            inp, prompt_tokens = self._step_input(sched, inflight[0] if inflight else None, sampling=not late)
            t2 = clock()
            if late:  # the forward runs while the previous step's tokens come back for the sampling tables
                forward = self.runner.launch_forward(inp)
                t3 = clock()
                outputs += self._resolve(*inflight, upcoming=(sched.scheduled, inp.logits_indices.shape[0]))
                inflight = None
                t4 = clock()
                inp = dataclasses.replace(inp, sampling=self._sampling_tensors(sched, inp.logits_indices.shape[0]))
                t5 = clock()
                launched = (sched, self.runner.launch_sample(forward, inp.sampling))
                self.timings["prepare"] += (t2 - t1) + (t5 - t4)
                self.timings["launch"] += (t3 - t2) + (clock() - t5)
            else:
                launched = (sched, self.runner.execute(inp))
                self.timings["prepare"] += t2 - t1
                self.timings["launch"] += clock() - t2
            self.stats["steps"] += 1
            self.stats["preemptions"] += len(sched.preempted)
            self.stats["computed_prompt_tokens"] += prompt_tokens
            if self.step_log is not None:
                self._log_step(sched, inp, prompt_tokens, host_s=clock() - t0)
        if inflight is not None:
            outputs += self._resolve(*inflight)
        if launched is not None:
            self.scheduler.commit(sched)
            self._inflight = launched
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Resolve the step still on the device, if any (e.g. one that ran ahead of a finish)."""
        inflight, self._inflight = self._inflight, None
        return self._resolve(*inflight) if inflight is not None else []

    def _needs_history(self, sched: SchedulerOutput) -> bool:
        """Whether a row's sampling reads its last output while that is still on the device: penalties (the
        token counts), bad words of more than one token, structured outputs (the matcher's next allowed
        tokens)."""
        history = self._history
        return bool(history) and any(e.request_id in history and PLACEHOLDER in e.request.output_token_ids[-1:]
                                     for e in sched.scheduled)

    def _resolve(self, sched: SchedulerOutput, pending, upcoming: tuple | None = None) -> list[RequestOutput]:
        """Read a launched step's results, apply them to the requests, and build their outputs. `upcoming`:
        the scheduled entries and row count of the step being built, whose token bitmask (structured outputs)
        is then filled on a worker thread, once the grammars have their tokens, while this goes on."""
        t0 = time.perf_counter()
        result = to_host(pending[0])
        plp = None if pending[1] is None else to_host(pending[1])  # this step computed prompt logprobs
        t1 = time.perf_counter()
        logged = self._unresolved_log.popleft() if self._unresolved_log else {}
        logged["done"], logged["wait_s"] = t1, t1 - t0
        if plp is not None:
            self._record_prompt_logprobs(sched, plp)
        finished = {r.request_id for r in self.scheduler.resolve(sched, result.next_ids.tolist())}
        sampled_logprobs = result.sampled_logprobs.tolist()
        recorded, with_logprobs = 0, []  # with_logprobs: (row, child) of the rows that want logprobs
        recording = [(i, child) for i, entry in enumerate(sched.scheduled)
                     if entry.produces_token and (child := self._children.get(entry.request.request_id)) is not None
                     # a request that ended in an earlier step: this row ran ahead of that news
                     and not (entry.request.is_finished and entry.request.request_id not in finished)]
        guided = None  # the grammars of the guided rows still running take their tokens on a worker thread
        if self._guided:
            guided = self._guided.advance_many([(c.request.request_id, c.request.output_token_ids[-1])
                                                for _, c in recording if not c.request.is_finished], upcoming)
        for i, child in recording:
            if child.logprobs is not None:
                with_logprobs.append((i, child))
            self._record_token(child, sampled_logprobs[i], child.request.request_id in finished)
            recorded += 1
        for request_id in guided.result() if guided is not None else ():  # their grammars are complete
            if not self._children[request_id].request.is_finished:
                self.scheduler.finish_request(request_id, "stop")
        touched: dict[str, Group] = {}  # in batch order
        for _, child in recording:
            group = self._groups[child.group_id]
            if group.params.output_kind is not RequestOutputKind.FINAL_ONLY or child.request.is_finished:
                touched[child.group_id] = group
        if with_logprobs:  # the sampled token with its rank, then the row's top logprobs
            rows, children = zip(*with_logprobs)
            append_positions([c.logprobs for c in children], [c.request.output_token_ids[-1] for c in children],
                             [c.request.sampling_params.logprobs for c in children], list(rows),
                             result.sampled_logprobs, result.sampled_ranks, result.topk_ids, result.topk_logprobs)
        self.stats["generation_tokens"] += recorded
        # A FINAL_ONLY group is touched only by a child that just ended (its last token, or a stop string).
        outputs = [self._make_output(gid) for gid, group in touched.items()
                   if group.params.output_kind is not RequestOutputKind.FINAL_ONLY
                   or all(c.request.is_finished for c in group.children)]
        logged["update_s"] = time.perf_counter() - t1
        self.timings["wait"] += t1 - t0
        self.timings["update"] += logged["update_s"]
        return outputs

    def _log_step(self, sched: SchedulerOutput, inp, prompt_tokens: int, host_s: float) -> None:
        """One step's shape, and its host seconds: scheduling to launch (`host_s`, here); when resolved,
        blocked on its results (`wait_s`: near 0 where the host, not the device, is the bottleneck) and
        applying them (`update_s`)."""
        entry = {"host_s": host_s, "tokens": sched.num_scheduled_tokens, "seqs": len(sched.scheduled),
                 "padded_tokens": int(inp.model.token_ids.shape[0]), "padded_seqs": int(inp.logits_indices.shape[0]),
                 "prompt_tokens": prompt_tokens, "decodes": sum(e.num_new_tokens == 1 and e.produces_token
                                                                 for e in sched.scheduled)}
        self.step_log.append(entry)
        self._unresolved_log.append(entry)

    def _move_pages(self, sched: SchedulerOutput) -> None:
        if sched.blocks_to_swap_out:
            self.runner.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.runner.copy_pages(sched.blocks_to_copy)

    def _step_input(self, sched: SchedulerOutput, previous: SchedulerOutput | None, sampling: bool = True):
        """The step's device input, and how many of the step's tokens are prompt tokens (computed, not
        found in the prefix cache). Without `sampling` the input has no sampling tensors yet (they are
        built once the previous step's tokens are back: `_sampling_tensors`)."""
        ecfg = self.config
        num_tokens = pick_bucket(sched.num_scheduled_tokens, ecfg.token_buckets)
        num_seqs = seq_bucket(len(sched.scheduled), num_tokens, ecfg.seq_buckets)
        prev_rows = {e.request.request_id: i for i, e in enumerate(previous.scheduled)} if previous else {}
        rows, prompt_tokens = [], 0
        for entry in sched.scheduled:
            request = entry.request
            if entry.start_position < request.num_prompt_tokens:
                prompt_tokens += entry.num_new_tokens
            rows.append((entry.token_ids, entry.start_position, entry.block_table,
                         prev_rows.get(request.request_id, -1), self._prompt_targets(entry)))
        tensors = self._sampling_tensors(sched, num_seqs) if sampling else None
        inp = build_step_input(rows, num_tokens, num_seqs, ecfg.pages_per_seq, ecfg.block_size, tensors)
        return inp, prompt_tokens

    def _sampling_tensors(self, sched: SchedulerOutput, num_seqs: int):
        """The step's sampling tensors, from each row's options and its tokens so far."""
        rows = []
        for entry in sched.scheduled:
            request = entry.request
            child = self._children.get(request.request_id)
            rows.append(SamplingRow(request.sampling_params, request.prompt_token_ids, request.output_token_ids,
                                    child.rng_counter if child else 0, child.bad_words if child else (),
                                    child.penalties if child else None, child.bias if child else None))
        return build_sampling_tensors(rows, num_seqs, self.model_config.vocab_size, engine_seed=self.config.seed,
                                      eos_token_ids=self.model_config.eos_token_ids,
                                      token_bitmask=self._guided.bitmask(sched.scheduled, num_seqs))

    def _prompt_targets(self, entry) -> list[int] | None:
        """Next prompt token after each of the entry's tokens, for a request that wants prompt logprobs."""
        request = entry.request
        child = self._children.get(request.request_id)
        group = None if child is None else self._groups.get(child.group_id)
        if group is None or group.prompt_logprobs is None or group.children[0].request is not request:
            return None
        prompt = request.prompt_token_ids
        start, end = entry.start_position, entry.start_position + entry.num_new_tokens
        if start >= len(prompt) - 1:
            return None
        return [prompt[p + 1] if p + 1 < len(prompt) else -1 for p in range(start, end)]

    def _record_prompt_logprobs(self, sched: SchedulerOutput, plp) -> None:
        """Add the step's prompt positions to their groups' prompt logprobs. Positions already there (a
        prompt computed again after preemption) are skipped: a prompt's chunks run in order, so the new
        positions of a request always start where its list ends."""
        into, rows, targets, ks, t = [], [], [], [], 0
        for entry in sched.scheduled:
            chunk = self._prompt_targets(entry)
            if chunk is not None:
                group = self._groups[self._children[entry.request.request_id].group_id]
                have = len(group.prompt_logprobs) - (entry.start_position + 1)  # of the chunk, already there
                assert have >= 0, "prompt logprobs arrive in position order"
                for j in range(have, len(chunk)):
                    if chunk[j] >= 0:
                        into.append(group.prompt_logprobs)
                        rows.append(t + j)
                        targets.append(chunk[j])
                        ks.append(group.params.prompt_logprobs)
            t += entry.num_new_tokens
        if rows:
            append_positions(into, targets, ks, rows, plp.token_logprobs, plp.token_ranks, plp.topk_ids,
                             plp.topk_logprobs)

    def _record_token(self, child: Child, logprob: float, finished: bool) -> None:
        """Apply a row's sampled token: logprob, stop reason, text (a stop string ends the request)."""
        request = child.request
        token = request.output_token_ids[-1]
        child.cumulative_logprob += logprob
        if finished and request.stop_reason is not None:
            child.stop_reason = request.stop_reason
        if child.detok is not None:
            stop_str = child.detok.update([token], stop_terminated=finished and request.stop_reason is not None)
            if stop_str is not None and not finished:
                self.scheduler.finish_request(request.request_id, "stop")
                child.stop_reason = stop_str

    def _make_output(self, group_id: str) -> RequestOutput:
        """The group's output (`request_groups.make_output`); a finished group's bookkeeping goes with it."""
        group = self._groups[group_id]
        out = make_output(group)
        if out.finished:
            del self._groups[group_id]
            for child in group.children:
                self._children.pop(child.request.request_id, None)
                self._guided.discard(child.request.request_id)
                self._history.discard(child.request.request_id)
        return out


def _freeze_heap() -> None:
    """Move every object alive after start-up (JAX, XLA executables, weights' Python wrappers: ~10^5
    objects) out of the garbage collector's reach. Otherwise each full collection walks them all:
    50-70 ms of the engine loop stalled, twice per 8B throughput run on an H200 (benchmarks/RESULTS.md,
    session 7). Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
