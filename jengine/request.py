"""One generation request as the scheduler sees it: its tokens, its progress and its state.

Progress is a single number, `num_computed_tokens`: how many of `all_token_ids` already have K/V in the
cache. Prefill and decode are the same thing seen through it (vLLM v1's model): the tokens still to run
are `all_token_ids[num_computed_tokens:]`, a whole prompt at first, one sampled token afterwards, the
prompt plus every output again after a preemption by recompute.

Sampling options are read once from any object with vLLM's field names (`n`, `max_tokens`,
`min_tokens`, `ignore_eos`, `stop_token_ids`), normally a `jengine.sampling_params.SamplingParams`;
duck typing keeps this module free of imports. End-of-sequence ids belong to the model, so they are
given to the scheduler, not stored here.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable
from typing import Any

# An output token whose step is still running on the device (asynchronous scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* values say why it ended."""

    WAITING = "waiting"  # never scheduled yet, in the waiting queue
    RUNNING = "running"  # holds device KV blocks, scheduled every step until it finishes
    PREEMPTED = "preempted"  # blocks given back, in the waiting queue, will recompute its tokens
    SWAPPED = "swapped"  # KV copied to the host pool, waiting to be swapped back in
    FINISHED_STOPPED = "finished_stopped"  # eos or a stop token (or a stop string, via finish_request)
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the caller

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's spelling of why a request ended ("stop", "length", "abort"), None while alive."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, `time.time()` clock) for latency metrics: TTFT, TPOT, E2E."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class Request:
    """A prompt, the tokens sampled so far, and how far the KV cache has caught up with them."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: Any = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(map(int, prompt_token_ids))
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else float(arrival_time)
        # Lower value runs first under the "priority" policy (vLLM's convention).
        self.priority = int(priority)

        self.output_token_ids: list[int] = []
        # prompt + outputs, kept as one list so slicing the next chunk never concatenates.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the latest admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the stop/eos token id that ended it, if one did
        self.num_preemptions = 0
        # Prompt logprobs need every prompt position computed, so such a request takes no prefix hits.
        self.skip_prefix_cache = False
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

        sp = sampling_params
        self.n: int = int(getattr(sp, "n", 1) or 1)
        max_tokens = getattr(sp, "max_tokens", None)
        self.max_tokens: int | None = None if max_tokens is None else int(max_tokens)
        self.min_tokens: int = int(getattr(sp, "min_tokens", 0) or 0)
        self.ignore_eos: bool = bool(getattr(sp, "ignore_eos", False))
        self.stop_token_ids: frozenset[int] = frozenset(int(t) for t in getattr(sp, "stop_token_ids", None) or ())

    # ------------------------------------------------------------------ tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens whose K/V is not in the cache yet (1 for a decode)."""
        return len(self._all_token_ids) - self.num_computed_tokens

    def set_output_token(self, index: int, token_id: int) -> None:
        """Fill in output `index`, appended earlier as PLACEHOLDER while its step was still running."""
        self.output_token_ids[index] = int(token_id)
        self._all_token_ids[self.num_prompt_tokens + index] = int(token_id)

    def truncate_output(self, length: int) -> None:
        """Drop outputs past `length` (placeholders of a step that ran after the request ended)."""
        del self.output_token_ids[length:]
        del self._all_token_ids[self.num_prompt_tokens + length :]

    def append_output_token(self, token_id: int) -> None:
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # ------------------------------------------------------------------ state

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
