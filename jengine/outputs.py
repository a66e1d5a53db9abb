"""What callers get back: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

import dataclasses

from jengine.logprobs import FlatLogprobs, Logprob
from jengine.request import RequestMetrics

__all__ = ["CompletionOutput", "FlatLogprobs", "Logprob", "RequestOutput"]


@dataclasses.dataclass
class CompletionOutput:
    """One of the n sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | FlatLogprobs | None  # per generated token: {token id: Logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | FlatLogprobs | None = None
