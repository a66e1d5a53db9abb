"""Structured outputs (vLLM's guided decoding) on the host: the request's constraint, its grammar, and a
matcher per sequence that says which tokens may come next.

`StructuredOutputsParams` holds one constraint with vLLM's names (`json`, `json_object`, `regex`,
`choice`, `grammar`); `grammar_text` turns it into an llguidance grammar and checks it, so that a bad
schema or regex is a ValueError at the edge. `GrammarCompiler` binds grammars to the model's tokenizer
and makes one `llguidance.LLMatcher` per sequence; `fill_bitmask` writes the allowed next tokens of
several sequences into the sampler's `[S, ceil(V / 32)]` int32 table (bit j of word w allows token
32 w + j). The engine feeds each sampled token back to its matcher (`consume`) and ends a sequence whose
grammar is complete.

Plain Python and numpy (no jax); llguidance is the grammar engine, as vLLM's "guidance" backend.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

logger = logging.getLogger(__name__)

# The constraint fields of StructuredOutputsParams: exactly one is set.
CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
# Rows at or above this many are filled (and advanced) on llguidance's thread pool rather than one after another.
_PARALLEL_ROWS = 4
_MAX_CHOICES = 1024
# Distinct constraints whose checked grammar a compiler keeps (least recently used out).
_CACHED_GRAMMARS = 256


@dataclasses.dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, with vLLM's names and meaning:

    - `json`: a JSON schema (a dict, or its JSON text) the output must match;
    - `json_object`: True for any JSON object;
    - `regex`: a regular expression the whole output must match;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (or GBNF, which llguidance converts) the output must match.

    `disable_any_whitespace` makes JSON compact (no whitespace between tokens); with
    `disable_additional_properties` objects of a schema that do not say otherwise take no properties
    beyond those listed (`additionalProperties: false`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        set_ = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; got "
                             f"{', '.join(set_) if set_ else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or JSON text), got "
                             f"{type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if len(self.choice) > _MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice may hold at most {_MAX_CHOICES} strings, "
                                 f"got {len(self.choice)}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """The constraint field that is set."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """`value` as StructuredOutputsParams: one already, a dict of its fields (the JSON form of params),
        or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, got "
                             f"{type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**value)


def _no_additional_properties(schema: Any) -> None:
    """Give every object schema that lists properties and says nothing of others `additionalProperties:
    false`, in place, through every place a schema can nest a schema."""
    if isinstance(schema, list):
        for item in schema:
            _no_additional_properties(item)
        return
    if not isinstance(schema, dict):
        return
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _no_additional_properties(sub)
    for key in ("items", "prefixItems", "additionalProperties", "anyOf", "allOf", "oneOf", "not", "if", "then",
                "else", "contains", "propertyNames"):
        if isinstance(schema.get(key), (dict, list)):
            _no_additional_properties(schema[key])
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def _schema(so: StructuredOutputsParams) -> dict:
    if so.json_object:
        return {"type": "object"}
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    if so.disable_additional_properties:
        schema = copy.deepcopy(schema)
        _no_additional_properties(schema)
    return schema


def grammar_text(so: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar of a constraint, checked (against `tokenizer` where given): a ValueError
    names the constraint and says what is wrong with it."""
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = _schema(so)
            text = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": not so.disable_any_whitespace})
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(so.regex)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", so.choice)
        else:
            text = llguidance.grammar_from("grammar", so.grammar)
    except (TypeError, ValueError) as e:  # e.g. a schema that json cannot write, GBNF that does not convert
        raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_one_line(error)}")
    return text


class GrammarCompiler:
    """Grammars bound to one model's tokenizer: makes a matcher per sequence. `vocab_size` is the model's
    (the logits' width), which may exceed the tokenizer's; `eos_token_ids` are the ids that end a request,
    which a complete grammar allows.

    Requests often repeat a constraint (one schema for a whole batch), so the compiler keeps each constraint's
    checked grammar. Each sequence gets a matcher of its own, built from the grammar: copies of one matcher
    (`deep_copy`, ~500x faster to make) share its tables, and 256 of them filled their masks ~3x and advanced
    ~3x slower than 256 built ones on an H100 host's 16 cores (RESULTS.md, session 36)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids=(), cache_size: int = _CACHED_GRAMMARS):
        import llguidance.hf  # imports transformers: only once a request has structured outputs

        # llguidance takes end ids among the tokenizer's own tokens only; a model's config may name ids past
        # them (e.g. a tokenizer smaller than the embedding), which then end requests without the grammar
        eos = [int(t) for t in eos_token_ids if 0 <= int(t) < len(hf_tokenizer)] or None
        if eos is None and hf_tokenizer.eos_token_id is None:
            raise ValueError("structured_outputs needs an end-of-sequence token in the tokenizer; this model's "
                             f"EOS ids {list(eos_token_ids)} are outside its {len(hf_tokenizer)} tokens")
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, max(vocab_size, len(hf_tokenizer)), eos)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()
        self._grammars: _Lru = _Lru(cache_size)  # constraint key -> grammar text

    def grammar(self, so: StructuredOutputsParams) -> str:
        key = _constraint_key(so)
        text = self._grammars.get(key)
        if text is None:
            text = self._grammars.put(key, grammar_text(so, self.tokenizer))
        return text

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar` (from `grammar()`)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs is invalid: {_one_line(matcher.get_error())}")
        return matcher

    def fill_bitmask(self, rows: list[tuple[int, llguidance.LLMatcher]], num_rows: int) -> np.ndarray:
        """The `[num_rows, ceil(V / 32)]` int32 table of allowed next tokens: each `(row, matcher)`'s row from
        its matcher, every other row all ones (everything allowed)."""
        words = bitmask_words(self.vocab_size)
        full = llguidance.numpy.allocate_token_bitmask(num_rows, self.tokenizer.vocab_size)  # all ones
        if len(rows) >= _PARALLEL_ROWS:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m, row) for row, m in rows], full)
        else:
            for row, matcher in rows:
                llguidance.numpy.fill_next_token_bitmask(matcher, full, row)
        return np.ascontiguousarray(full[:, :words])

    def consume(self, pairs: list[tuple[llguidance.LLMatcher, int]]) -> list[bool]:
        """`consume` for each `(matcher, token)` (on llguidance's thread pool for many): whether each
        sequence must end."""
        if len(pairs) < _PARALLEL_ROWS:
            return [consume(m, t) for m, t in pairs]
        live = [(m, int(t)) for m, t in pairs if not m.is_stopped()]
        if live:
            llguidance.numpy.consume_token_par(self.executor, live)  # a refused token leaves its matcher in error
        return [m.is_stopped() or m.is_error() for m, _ in pairs]


class _Lru:
    """A dict of at most `size` entries; the least recently used goes first."""

    def __init__(self, size: int):
        self._size, self._items = size, OrderedDict()

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value):
        self._items[key] = value
        if len(self._items) > self._size:
            self._items.popitem(last=False)
        return value


def _constraint_key(so: StructuredOutputsParams) -> str:
    """What makes two constraints the same grammar: their fields, a schema dict in canonical JSON."""
    return json.dumps(dataclasses.asdict(so), sort_keys=True, default=repr)


def _one_line(message: str) -> str:
    """llguidance's multi-line error (with a source excerpt) as one line, as an HTTP error body carries it."""
    return " ".join(message.split())


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per row of a token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def consume(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advance `matcher` past a sampled token; True when the sequence must end here: its grammar is
    complete (nothing may follow), or the token broke it (the matcher is in error and allows nothing but
    EOS from now on)."""
    if not matcher.is_stopped():
        matcher.consume_token(int(token))
    return matcher.is_stopped() or matcher.is_error()


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (`new_matchers`' check of allowed_token_ids, tests)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class GuidedRequests:
    """An engine's structured-output state: the grammar compiler, made at the first guided request, and the
    matcher of every unfinished guided sequence by its (scheduler) request id.

    The matchers take each step's tokens, and the next step's bitmask is filled, on one worker thread
    (`advance_many`), while the engine thread applies the rest of the step's results. llguidance runs both on
    its own pool; filling ran beside a busy Python thread without holding Python's lock (dev CPU), advancing was
    not checked for that. Only the worker touches the matchers in between."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._building: Future | None = None  # the compiler, made on the worker (`prepare`)
        self._worker: ThreadPoolExecutor | None = None
        self._filling: tuple | None = None  # (entries, num_rows, future bitmask) started by advance_many
        self.matchers: dict[str, llguidance.LLMatcher] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def new_matchers(self, params) -> list:
        """One fresh matcher per sequence of a request (`params.n`) with structured outputs, else Nones. Its
        grammar is checked against the tokenizer here: a ValueError names what is wrong."""
        so = params.structured_outputs
        if so is None:
            return [None] * params.n
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        if self._compiler is None:
            self.prepare()
            self._compiler = self._building.result()  # its ValueError (a tokenizer without EOS) is the request's
        grammar = self._compiler.grammar(so)
        matchers = [self._compiler.matcher(grammar) for _ in range(params.n)]
        if params.allowed_token_ids is not None:  # with nothing in common the first token would be drawn from none
            first = allowed_tokens(self._compiler.fill_bitmask([(0, matchers[0])], 1)[0], self._vocab_size)
            if not np.isin(params.allowed_token_ids, first).any():
                raise ValueError("allowed_token_ids and structured_outputs have no token in common for the first "
                                 "output token: no output could follow both")
        return matchers

    def prepare(self) -> None:
        """Start making the grammar compiler on the worker thread, unless started (or there is no tokenizer).
        llguidance's view of a tokenizer takes ~1.5 s for a 128k vocabulary, holding Python's lock (RESULTS.md,
        session 36): made at the first guided request, on the engine thread, it stalls every running request. A
        server starts it once its engine is built (`LLMEngine.prepare_structured_outputs`); otherwise the first
        guided request does, and waits for it."""
        if self._tokenizer is None or self._building is not None:
            return
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jengine-grammar")
        self._building = self._worker.submit(GrammarCompiler, self._tokenizer, self._vocab_size, self._eos)

    def add(self, request_id: str, matcher) -> None:
        if matcher is not None:
            self.matchers[request_id] = matcher

    def discard(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def advance_many(self, tokens: list[tuple[str, int]], upcoming: tuple | None = None) -> Future:
        """Feed each `(request_id, token)` to the request's matcher (requests without one are passed over), on
        the worker thread: a future of the ids of the sequences that must end, their grammar complete or broken
        (that is logged). `upcoming` (`bitmask`'s entries and num_rows): then fill that step's bitmask there too,
        which `bitmask` of the same entries takes."""
        self._wait_filling()
        pairs = [(rid, m, t) for rid, t in tokens if (m := self.matchers.get(rid)) is not None]
        ended = self._worker.submit(self._consume, pairs)
        if upcoming is not None:
            entries, num_rows = upcoming
            rows = self._rows(entries)
            if rows:
                self._filling = (entries, num_rows, self._worker.submit(self._compiler.fill_bitmask, rows, num_rows))
        return ended

    def _consume(self, pairs) -> set[str]:
        done = self._compiler.consume([(m, t) for _, m, t in pairs]) if pairs else []
        ended = {rid for (rid, _, _), end in zip(pairs, done) if end}
        for rid, matcher, _ in pairs:
            if rid in ended and matcher.is_error():  # a token the mask allowed always advances the grammar
                logger.warning("request %s: structured output ended early: %s", rid,
                               _one_line(matcher.get_error())[:500])
        return ended

    def bitmask(self, entries, num_rows: int) -> np.ndarray | None:
        """The allowed next tokens `[num_rows, ceil(V / 32)]` of a step's scheduled `entries` (row i is entry
        i) where a row that samples is guided, else None (the unguided sampling program)."""
        filling, self._filling = self._filling, None
        if filling is not None and filling[0] is entries and filling[1] == num_rows:
            return filling[2].result()
        if filling is not None:
            filling[2].result()  # another step's: the matchers are the engine thread's again once it is done
        if not self.matchers:
            return None
        rows = self._rows(entries)
        return self._compiler.fill_bitmask(rows, num_rows) if rows else None

    def _rows(self, entries) -> list[tuple[int, llguidance.LLMatcher]]:
        return [(i, m) for i, e in enumerate(entries) if (m := self.matchers.get(e.request_id)) is not None
                and e.produces_token and not e.request.is_finished]

    def _wait_filling(self) -> None:
        if self._filling is not None:
            self._filling[2].result()
            self._filling = None
