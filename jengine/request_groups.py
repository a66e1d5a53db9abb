"""A request as the engine keeps it: its n sequences (`Child`: scheduler request, detokenizer, logprobs) in a
`Group`, and the `RequestOutput` a group gives at each step (`make_output`)."""

from __future__ import annotations

import dataclasses

from jengine.detokenizer import IncrementalDetokenizer
from jengine.logprobs import FlatLogprobs, for_output
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.penalty_window import PenaltyWindow
from jengine.request import Request
from jengine.sampling_params import RequestOutputKind, SamplingParams
from jengine.sampling_tables import BiasRow


@dataclasses.dataclass
class Child:
    """One of the n sequences of a request: its scheduler request, detokenizer and logprobs."""

    request: Request
    group_id: str
    detok: IncrementalDetokenizer | None
    rng_counter: int
    logprobs: FlatLogprobs | None
    bad_words: tuple  # the request's bad words as token sequences (`jengine.bad_words`)
    penalties: PenaltyWindow | None  # with penalties: the sequence's penalty window, kept across steps
    bias: BiasRow | None = None  # with logit_bias or allowed_token_ids: the entries every step has (`bias_row`)
    cumulative_logprob: float = 0.0
    logprob_dicts: list | None = None  # dicts of `logprobs` made so far (CUMULATIVE outputs without flat_logprobs)
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # output tokens already returned (DELTA outputs)


@dataclasses.dataclass
class Group:
    """A request: its n sequences (`Child`) and what its outputs have carried so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Child]
    prompt_logprobs: FlatLogprobs | None = None  # per prompt position; [0] has no entries
    prompt_logprobs_out: list | FlatLogprobs | None = None  # as outputs carry them, once complete
    sent_any: bool = False  # an output was returned (DELTA: prompt logprobs go with the first only)


def make_output(group: Group) -> RequestOutput:
    """The group's output, of its `output_kind`: DELTA carries only the text, tokens and logprobs
    new since the group's last output (the prompt logprobs with the first); the others carry all.
    Its token and logprob lists are new lists, never the engine's own, which later steps extend."""
    delta = group.params.output_kind is RequestOutputKind.DELTA
    outputs = []
    for i, child in enumerate(group.children):
        request = child.request
        text = child.detok.get_next_output_text(request.is_finished, delta=delta) if child.detok else ""
        first = child.sent_tokens if delta else 0
        child.sent_tokens = len(request.output_token_ids)
        outputs.append(CompletionOutput(
            index=i, text=text, token_ids=request.output_token_ids[first:],
            cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
            logprobs=None if child.logprobs is None else for_output(
                child.logprobs, first, as_flat=group.params.flat_logprobs, built=child.logprob_dicts),
            finish_reason=request.finish_reason, stop_reason=child.stop_reason))
    finished = all(o.finish_reason is not None for o in outputs)
    metrics = group.children[0].request.metrics
    prompt_logprobs = None if delta and group.sent_any else _output_prompt_logprobs(group)
    group.sent_any = True
    return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                         outputs=outputs, finished=finished, metrics=metrics, prompt_logprobs=prompt_logprobs)


def _output_prompt_logprobs(group: Group):
    """The group's prompt logprobs as outputs carry them, one entry per prompt position; built once when
    complete (positions not computed yet, as after a preemption of the child computing them, read None)."""
    if group.prompt_logprobs_out is not None or group.prompt_logprobs is None:
        return group.prompt_logprobs_out
    out = for_output(group.prompt_logprobs, 0, as_flat=group.params.flat_logprobs)
    missing = len(group.prompt_token_ids) - len(out)
    out.extend([None] * missing)
    if not missing:
        group.prompt_logprobs_out = out
    return out
