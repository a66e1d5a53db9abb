"""Per-request sampling options, with vLLM's `SamplingParams` names, defaults and meaning.

Host side, plain Python (no jax): the scheduler reads `n`, `max_tokens`, `min_tokens`, `ignore_eos`,
`stop_token_ids`; `jengine.sampling_tables.build_sampling_tensors` turns the rest into fixed-shape device
arrays; `jengine.detokenizer` uses the stop strings and the text options.

Every value a user can get wrong is checked here, at the edge, with a message naming the field and
what is allowed, so that nothing past this point has to handle a bad option.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from jengine.structured_output import StructuredOutputsParams

# Below this temperature a request is greedy (argmax), as in vLLM (`_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5
# The sampler always returns this many top logprobs per row (fixed shape); requests ask for <= this.
MAX_LOGPROBS = 20
# OpenAI's API allows up to 300 logit_bias entries; the sampler's bias table is sized from this.
MAX_LOGIT_BIAS_ENTRIES = 300
# vLLM clamps logit_bias values to this range (OpenAI documents [-100, 100]).
LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step()` returns for a request (vLLM's names): every step's cumulative
    text and tokens, only what is new since the last output, or one output when it finishes (what
    `LLM.generate` asks for: no per-step copies of every sequence's tokens)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plain_scalar(x: Any) -> Any:
    """A numpy scalar (a notebook's `np.float32(0.7)`, `np.int64(5)`, `np.True_`) as the Python value it
    holds, so that the checks below and everything downstream see plain ints, floats and bools; other
    values unchanged."""
    if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0:
        return x.item()
    return x


def _as_list(name: str, values: Any) -> list:
    """A list field given as a list, tuple or 1-D numpy array, as a list of plain values; a bare string or
    any other type is a ValueError naming the field (a string would otherwise be taken letter by letter)."""
    if type(values).__module__ == "numpy" and getattr(values, "ndim", None) == 1:
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    return [plain_scalar(v) for v in values]


def check_bool(name: str, value: Any) -> None:
    """An on/off option must be a bool: a truthy string such as "no" would otherwise switch it on."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request; see vLLM's `SamplingParams` for the full semantics.

    Normalisation done at construction (so readers never branch on spellings):
    `top_k` -1 becomes 0 (off); `stop` becomes a list; `stop_token_ids` a list of ints;
    `logit_bias` keys become ints and values are clamped to [-100, 100]; `allowed_token_ids` and
    `bad_words` lose repeats (`bad_words` None becomes []); greedy requests
    (temperature < 1e-5) get top_k/top_p/min_p switched off, since they do not apply to argmax.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: consider all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); None keeps it whole
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be sampled (None: any); checked against the vocabulary by the engine
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to be generated (each word's last token is banned where the output so far ends
    # with its other tokens); tokenized by the engine (`jengine.bad_words`)
    bad_words: list[str] | None = None
    # vLLM's: constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar (a
    # StructuredOutputsParams, or a dict of its fields)
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    flat_logprobs: bool = False  # outputs carry logprobs as FlatLogprobs (few objects) instead of dicts

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()
        if self.is_greedy:
            # Argmax ignores these; switching them off keeps the device arrays of greedy rows inert.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    # ------------------------------------------------------------------ validation

    def _normalize(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, plain_scalar(getattr(self, field.name)))
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [plain_scalar(t) for t in self.stop_token_ids]
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is None:
            self.logit_bias = {}
        else:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                try:
                    tok = int(k)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids (ints), got {k!r}") from None
                v = plain_scalar(v)
                if not _is_number(v) or math.isnan(v):  # NaN would compare past the clamp as +100
                    raise ValueError(f"logit_bias[{tok}] must be a number, got {v!r}")
                bias[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        self.bad_words = [] if self.bad_words is None else _as_list("bad_words", self.bad_words)
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)

    def _verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        # Finite: an infinite temperature turns masked (-inf) logits into NaN (-inf / inf), an infinite
        # repetition penalty positive ones into 0 and negative ones into -inf.
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                                 or self.truncate_prompt_tokens == -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got "
                             f"{self.truncate_prompt_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
            )
        for tok in self.logit_bias:
            if tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must name at least one token (None allows every token)")
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must be token ids (ints >= 0), got {t!r}")
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise ValueError(f"bad_words must be non-empty strings, got {w!r}")
        self.bad_words = list(dict.fromkeys(self.bad_words))
        for field in dataclasses.fields(self):
            if field.type == "bool":  # the annotation's text (postponed annotations)
                check_bool(field.name, getattr(self, field.name))
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(k.name for k in RequestOutputKind)
            raise ValueError(f"output_kind must be a RequestOutputKind ({kinds}), got {self.output_kind!r}")

    # ------------------------------------------------------------------ derived

    @property
    def is_greedy(self) -> bool:
        """Greedy (argmax) requests: temperature below vLLM's epsilon."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def max_stop_str_len(self) -> int:
        """Longest stop string; streaming holds back this many chars minus one (partial match)."""
        return max((len(s) for s in self.stop), default=0)

    def bias_table_entries(self, eos_token_ids: tuple[int, ...] | list[int] = (),
                           banned_token_ids: set[int] | frozenset[int] = frozenset()) -> int:
        """The most entries this request can need in the sampler's per-row bias table in any step: with
        allowed_token_ids, those ids (everything else is masked out anyway); otherwise logit_bias, the stop
        ids suppressed while fewer than min_tokens are out, and `banned_token_ids` (bad words' last tokens)."""
        if self.allowed_token_ids is not None:
            return len(self.allowed_token_ids)
        stops = self.all_stop_token_ids(eos_token_ids) if self.min_tokens > 0 else set()
        return len(set(self.logit_bias) | stops | set(banned_token_ids))

    def all_stop_token_ids(self, eos_token_ids: tuple[int, ...] | list[int] = ()) -> set[int]:
        """Token ids that finish this request: its stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed (e.g. a child of n > 1 with seed + index)."""
        return dataclasses.replace(self, **changes)
