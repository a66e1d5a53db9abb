"""Beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each round asks the engine for one more token of every live beam with the top `2 * beam_width`
logprobs, then keeps the best `beam_width` continuations per prompt. The prefix cache makes a beam's
shared history cost nothing to re-run, so the engine needs no beam-specific scheduling.
"""

from __future__ import annotations

import dataclasses
import math

from jengine.sampling_params import MAX_LOGPROBS, SamplingParams, _is_int, _is_number, check_bool


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an int in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        check_bool("ignore_eos", self.ignore_eos)
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def score(self, length_penalty: float) -> float:
        """Cumulative logprob normalised by length**length_penalty (longer beams are not unfairly low)."""
        return self.cum_logprob / max(len(self.output_tokens), 1) ** length_penalty


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text or token ids); returns `beam_width` sequences per prompt."""
    engine = llm.engine
    eos = set(engine.model_config.eos_token_ids)
    live, done = [], []
    for prompt in prompts:
        _, ids = engine.tokenize_prompt(prompt)
        live.append([BeamSearchSequence(list(ids), len(ids))])
        done.append([])
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)
    for _ in range(params.max_tokens):
        flat = [beam for beams in live for beam in beams]
        if not flat:
            break
        outputs = llm.generate([beam.tokens for beam in flat], step, use_tqdm=False)
        candidates: dict[int, list[BeamSearchSequence]] = {id(beam): [] for beam in flat}
        for beam, out in zip(flat, outputs):
            for token, logprob in out.outputs[0].logprobs[0].items():
                candidates[id(beam)].append(BeamSearchSequence(
                    beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + logprob.logprob,
                    beam.logprobs + [logprob.logprob]))
        for i, beams in enumerate(live):
            pool = sorted((c for beam in beams for c in candidates[id(beam)]), key=lambda b: -b.cum_logprob)
            kept = []
            for cand in pool[: params.beam_width]:
                if cand.tokens[-1] in eos and not params.ignore_eos:
                    cand.finish_reason = "stop"
                    done[i].append(cand)
                else:
                    kept.append(cand)
            live[i] = kept
    results = []
    for beams, finished in zip(live, done):
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(finished + beams, key=lambda b: -b.score(params.length_penalty))[: params.beam_width]
        if engine.tokenizer is not None:
            for beam in best:
                beam.text = engine.tokenizer.decode(beam.output_tokens, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
