"""Iteration-level scheduler: every step, which requests run and how many of their tokens.

There is no prefill phase and decode phase. Each request has `num_tokens` known tokens of which
`num_computed_tokens` have K/V in the cache; a step gives it `num_new_tokens` more (a whole prompt, a
chunk of one, or the single token sampled last step), as in vLLM v1. One step can mix all of these.

Order within a step, under a budget of `max_num_batched_tokens` tokens and `max_num_seqs` requests:
  1. running requests, in queue order (decodes, and the next chunk of a partly prefilled prompt);
     when pages run out, the last request of the running queue (latest arrival, or lowest priority
     under policy="priority") is preempted, by recompute or by swap;
  2. if nobody was preempted this step: swapped-out requests and waiting requests, oldest first (by
     the policy's key), admitted until one does not fit. Admission never skips ahead of a request
     that does not fit, so nobody starves, and preempted requests regain their place by arrival.
     Admission never lets more than `max_num_seqs` requests run (forks of a running request, for
     parallel sampling or beam search, may add more).

With `prefill_first`, while the prompts that could start (queued, within `max_num_seqs`) and the
unfinished ones hold a full step's budget of tokens, a step runs only prompt work: step 1 skips the
running requests that decode, and they wait. A burst of prompts (an offline batch) then ends sooner and
every request decodes in full batches after it, as in vLLM v0 without chunked prefill or SGLang without
mixed chunks; with less prompt work queued, steps mix as above, so a few arrivals do not stall the
decodes. Prompt-only steps preempt nobody: one ends at a prompt whose next chunk finds no free pages,
and one that would hold nothing gives way to the mixed order, which preempts as usual (and may start
a smaller chunk of that prompt in the budget the decodes leave). Swapped-out requests (decodes) may return in a
prompt-only step, in their turn. The queued prompts are counted at full length (prefix-cache hits not
subtracted), and under policy="priority" a burst of low-priority prompts stalls urgent decodes too.
The cost: decodes stall while a burst or a long prompt is prefilled (inter-token latency).

Prefix caching: a waiting request starts after the longest run of cached full pages matching its
tokens, always leaving at least its last token to compute. Pages are registered as soon as a step
that fills them is scheduled, so identical prompts admitted in the same step (parallel sampling
fanned out as n requests, a shared system prompt) compute the shared part once; this relies on the
step writing the whole batch's K/V before attention reads it in each layer.

`schedule()` and `update()` alternate: `update` advances `num_computed_tokens`, appends the sampled
tokens and applies the stop rules. Stop strings need text, so the detokenizer ends those requests
through `finish_request`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from bisect import insort
from collections.abc import Iterable, Sequence

from jengine.block_manager import BlockManager
from jengine.request import PLACEHOLDER, Request, RequestStatus

_STATUS_BY_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


def _decodes(request: Request) -> bool:
    """Whether the request's next step is a decode: one sampled token to run, its prompt done."""
    return request.num_tokens_to_compute == 1 and request.num_output_tokens > 0


@dataclasses.dataclass
class ScheduledRequest:
    """One request's share of a step, in batch order."""

    request: Request
    num_new_tokens: int  # tokens run this step for this request
    start_position: int  # num_computed_tokens before the step: position of its first new token
    block_table: list[int]  # device pages of the request after this step's allocation (a copy)
    produces_token: bool  # the chunk reaches the end of the known tokens, so its last logits are sampled

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The `num_new_tokens` input ids, positions start_position ... start_position+num_new_tokens-1."""
        return self.request.all_token_ids[self.start_position:self.start_position + self.num_new_tokens]


@dataclasses.dataclass
class SchedulerOutput:
    """What one step runs. The runner first does the swap-outs, then swap-ins, then copies."""

    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0  # sum of num_new_tokens
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) device
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (cpu, device)
    preempted: list[str] = dataclasses.field(default_factory=list)  # request ids preempted this step
    # Requests that ended (finished, stopped, aborted) since the previous schedule(): a runner that
    # keeps per-request state can drop it.
    finished_ids: list[str] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_sampling(self) -> int:
        return sum(1 for s in self.scheduled if s.produces_token)


class Scheduler:
    """Waiting, running and swapped queues over one `BlockManager`; see the module docstring."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_chunked_prefill: bool = True,
        prefill_first: bool = False,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        reserve_null_block: bool = True,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={policy!r} is not supported; use 'fcfs' or 'priority'")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={preemption_mode!r} is not supported; use 'recompute' or 'swap'")
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                          enable_prefix_caching=enable_prefix_caching,
                                          reserve_null_block=reserve_null_block)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_first = prefill_first
        self.policy = policy
        self.preemption_mode = preemption_mode
        # Longest sequence the pool can hold at all; growing past it would preempt itself forever.
        self.max_seq_len = min(max_model_len, self.block_manager.num_usable_blocks * block_size)

        # Each queue stays sorted by `_sort_key`: the head is the oldest (or most urgent) request.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finishing: list[Request] = []  # committed their last token; finish when it is resolved
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._seq_no: dict[str, int] = {}  # admission-order tie-break for equal arrival times
        self._next_seq_no = 0
        self.num_preemptions = 0  # since start, both kinds
        self._finished_ids: list[str] = []  # ended since the last schedule()

    # ------------------------------------------------------------------ queues

    def _sort_key(self, request: Request) -> tuple:
        seq_no = self._seq_no[request.request_id]
        if self.policy == "priority":
            return (request.priority, request.arrival_time, seq_no)
        return (request.arrival_time, seq_no)

    def _enqueue(self, queue: list[Request], request: Request) -> None:
        if queue and self._sort_key(queue[-1]) > self._sort_key(request):
            insort(queue, request, key=self._sort_key)
        else:
            queue.append(request)  # the common case: it is the newest

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError if it could never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty; at least one token is required")
        room = request.max_tokens if request.max_tokens is not None else 1
        if n + room > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {n} tokens plus max_tokens={room} is {n + room}, more than "
                f"max_model_len={self.max_model_len}"
            )
        if n + room > self.max_seq_len:
            raise ValueError(
                f"request {rid!r}: {n + room} tokens (prompt {n} + max_tokens {room}) need "
                f"{-(-(n + room) // self.block_size)} KV blocks but the cache holds only "
                f"{self.block_manager.num_usable_blocks} blocks of {self.block_size} tokens"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: prompt of {n} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is disabled"
            )
        self.requests[rid] = request
        self._seq_no[rid] = self._next_seq_no
        self._next_seq_no += 1
        request.status = RequestStatus.WAITING
        self._enqueue(self.waiting, request)

    def fork_request(self, parent_id: str, child: Request) -> Request:
        """Start `child` (a new id, same prompt) as a copy of a running parent sharing all its pages.

        For parallel sampling or beam search: the child gets the parent's outputs and progress, and
        its pages are copied only when it first writes into a shared one.
        """
        parent = self.requests[parent_id]
        if parent.status != RequestStatus.RUNNING:
            raise ValueError(f"request {parent_id!r} can only be forked while running, not {parent.status.value}")
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        for token in parent.output_token_ids[child.num_output_tokens:]:
            child.append_output_token(token)
        assert child.all_token_ids == parent.all_token_ids, "a fork child must start from the parent's tokens"
        child.num_computed_tokens = parent.num_computed_tokens
        child.arrival_time = child.metrics.arrival_time = parent.arrival_time
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.status = RequestStatus.RUNNING
        self.block_manager.fork(parent, child)
        self.requests[child.request_id] = child
        self._seq_no[child.request_id] = self._next_seq_no
        self._next_seq_no += 1
        self._enqueue(self.running, child)
        return child

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> dict[str, float]:
        """Gauges and counters for logging and /metrics (vLLM's names where it has one)."""
        bm = self.block_manager
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_requests_swapped": len(self.swapped),
            "kv_cache_usage_perc": bm.usage,
            "prefix_cache_queries": bm.prefix_cache_queries,  # tokens looked up
            "prefix_cache_hits": bm.prefix_cache_hits,  # tokens found
            "num_preemptions": self.num_preemptions,
        }

    # ------------------------------------------------------------------ scheduling

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device: swap its pages to the host if asked and possible,
        otherwise drop them and recompute later."""
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request.request_id)
        bm = self.block_manager
        if self.preemption_mode == "swap" and bm.can_swap_out(request):
            out.blocks_to_swap_out.extend(bm.swap_out(request))
            request.status = RequestStatus.SWAPPED
            self._enqueue(self.swapped, request)
        else:
            bm.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self._enqueue(self.waiting, request)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        # Pages this step fills become prefix-cache hits for requests admitted after this one.
        self.block_manager.cache_full_blocks(request, start + num_new)
        out.scheduled.append(ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            start_position=start,
            block_table=list(self.block_manager.block_table(request)),
            produces_token=start + num_new == request.num_tokens,
        ))
        out.num_scheduled_tokens += num_new

    def _chunk(self, request: Request, remaining: int, budget: int) -> int:
        """Tokens to run for a request with `remaining` uncomputed tokens; 0 if it must wait."""
        if remaining <= budget:
            return remaining
        # Recompute after preemption may exceed the budget even without chunked prefill: split it.
        if self.enable_chunked_prefill or request.num_output_tokens > 0:
            return budget
        return 0

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their pages."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        if self.prefill_first and self._prompts_fill_a_step():
            self._fill(out, prompts_only=True)
            if out.scheduled:
                return out
        self._fill(out, prompts_only=False)
        return out

    def _prompts_fill_a_step(self) -> bool:
        """Whether the prompts that could start and the unfinished ones hold `max_num_batched_tokens` tokens.
        Runs every step: it stops counting as soon as they do, the queued requests (a burst's) first."""
        budget = self.max_num_batched_tokens
        seats = self.max_num_seqs - len(self.running)
        tokens = 0
        for request in itertools.chain(self.swapped, self.waiting):
            if seats <= 0 or tokens >= budget:
                break
            tokens += request.num_tokens_to_compute
            seats -= 1
        for request in self.running:
            if tokens >= budget:
                break
            if not _decodes(request):
                tokens += request.num_tokens_to_compute
        return tokens >= budget

    def _fill(self, out: SchedulerOutput, prompts_only: bool) -> None:
        """Schedule running requests (all, or only those with prompt tokens left), then admit queued
        ones unless that preempted anybody. Prompt-only steps preempt nobody: where a prompt's next chunk
        finds no pages they stop there, and if they hold nothing the mixed step runs instead (a prompt
        that preempted itself there would be readmitted and preempted again while no decode ran)."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_num_seqs:
            request = self.running[i]
            num_new = 0 if prompts_only and _decodes(request) else self._chunk(
                request, request.num_tokens_to_compute, budget)
            if num_new == 0:
                i += 1
                continue
            # Later entries of `running` are not scheduled yet, so the queue's tail is the victim.
            fits = bm.can_append_slots(request, num_new)
            if not fits and prompts_only:
                return
            while not fits and self.running[-1] is not request:
                self._preempt(self.running[-1], out)
                fits = bm.can_append_slots(request, num_new)
            if not fits:
                self._preempt(request, out)
                break
            out.blocks_to_copy.extend(bm.append_slots(request, num_new))
            self._emit(out, request, num_new)
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit(out, budget)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Swap in or start queued requests, oldest first, until the first one that does not fit."""
        bm = self.block_manager
        while (budget > 0 and len(out.scheduled) < self.max_num_seqs and len(self.running) < self.max_num_seqs
               and (self.waiting or self.swapped)):
            from_swapped = bool(self.swapped) and (
                not self.waiting or self._sort_key(self.swapped[0]) < self._sort_key(self.waiting[0]))
            if from_swapped:
                request = self.swapped[0]
                num_new = self._chunk(request, request.num_tokens_to_compute, budget)
                if num_new == 0 or not bm.can_swap_in(request, num_new):
                    return
                self.swapped.pop(0)
                out.blocks_to_swap_in.extend(bm.swap_in(request))
                out.blocks_to_copy.extend(bm.append_slots(request, num_new))
            else:
                request = self.waiting[0]
                computed_blocks, num_hit = bm.get_computed_blocks(request)
                num_new = self._chunk(request, request.num_tokens - num_hit, budget)
                if num_new == 0 or not bm.can_allocate(request, num_new, computed_blocks):
                    return
                self.waiting.pop(0)
                bm.allocate(request, num_new, computed_blocks)
                request.num_computed_tokens = request.num_cached_tokens = num_hit
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self._enqueue(self.running, request)
            self._emit(out, request, num_new)
            budget -= num_new

    # ------------------------------------------------------------------ after the step

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Record a finished step; returns the requests that finished in it (`commit` + `resolve`).

        `sampled_token_ids` holds one id per scheduled request in batch order (entries of requests
        that did not sample, and any padding past the batch, are ignored), or exactly one id per
        request that sampled, in batch order.
        """
        self.commit(output)
        return self.resolve(output, sampled_token_ids)

    def commit(self, output: SchedulerOutput) -> None:
        """Advance past a launched step before its tokens are known (asynchronous scheduling).

        The KV of the scheduled tokens is now being computed, and each sampling request gets a
        PLACEHOLDER output token, so the next step can be scheduled while this one runs. A request
        that reaches its length limit leaves the running queue here: it has nothing left to run.
        """
        for entry in output.scheduled:
            request = entry.request
            if request.is_finished:  # aborted since it was scheduled
                continue
            assert request.num_computed_tokens == entry.start_position, "schedule/commit out of step"
            request.num_computed_tokens += entry.num_new_tokens
            if not entry.produces_token:
                continue
            request.append_output_token(PLACEHOLDER)
            at_limit = (request.max_tokens is not None and request.num_output_tokens >= request.max_tokens) or (
                request.num_tokens >= self.max_seq_len)
            if at_limit and request in self.running:
                self.running.remove(request)
                self.finishing.append(request)

    def resolve(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Fill in a committed step's sampled tokens and apply the stop rules; returns finished requests."""
        entries = output.scheduled
        if len(sampled_token_ids) >= len(entries):
            tokens = iter(sampled_token_ids[:len(entries)])
            per_entry = True
        elif len(sampled_token_ids) == output.num_sampling:
            tokens = iter(sampled_token_ids)
            per_entry = False
        else:
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled ids for {len(entries)} scheduled requests of "
                f"which {output.num_sampling} sample"
            )
        finished: list[Request] = []
        now = time.time()
        for entry in entries:
            token = next(tokens) if per_entry or entry.produces_token else None
            request = entry.request
            if request.is_finished or not entry.produces_token:
                continue
            index = entry.start_position + entry.num_new_tokens - request.num_prompt_tokens
            request.set_output_token(index, token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            status = self._stop_status(request, int(token), index + 1)
            if status is not None:
                if status == RequestStatus.FINISHED_STOPPED:
                    request.stop_reason = int(token)
                request.truncate_output(index + 1)
                self._finish(request, status, now)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int, num_outputs: int) -> RequestStatus | None:
        """Whether output number `num_outputs` (this `token`) ends the request."""
        if num_outputs >= request.min_tokens:
            if (token in self.eos_token_ids and not request.ignore_eos) or token in request.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.max_tokens is not None and num_outputs >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_prompt_tokens + num_outputs >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float | None = None) -> None:
        for queue in (self.running, self.waiting, self.swapped, self.finishing):
            if request in queue:
                queue.remove(request)
                break
        self.block_manager.free(request)
        request.status = status
        request.metrics.finished_time = time.time() if now is None else now
        del self.requests[request.request_id]
        del self._seq_no[request.request_id]
        self._finished_ids.append(request.request_id)

    def finish_request(self, request_id: str, reason: str | RequestStatus = "stop") -> Request | None:
        """End a request from outside (stop string, client gone). Returns it, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        status = _STATUS_BY_REASON.get(reason) if isinstance(reason, str) else reason
        if status is None or not status.is_finished:
            raise ValueError(f"reason={reason!r} is not a finish reason; use 'stop', 'length' or 'abort'")
        self._finish(request, status)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
