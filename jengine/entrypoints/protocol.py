"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to `SamplingParams`.

Field names, types and defaults follow OpenAI's API plus vLLM's extra sampling fields. Unknown fields
are ignored, as vLLM does. Everything a client can get wrong raises ValueError (-> HTTP 400) here, so
no bad value reaches the engine thread.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jengine.entrypoints.tool_choice import ToolChoice, output_schema, resolve_tool_choice
from jengine.sampling_params import MAX_LOGPROBS, SamplingParams
from jengine.sampling_tables import check_bias_table, check_token_ids
from jengine.structured_output import CONSTRAINTS, StructuredOutputsParams, grammar_text

# OpenAI allows at most 5 logprobs for completions; vLLM accepts up to the sampler's width.
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS
MAX_STOP_STRINGS = 16
_I64 = 2**63

Int64 = Annotated[int, Field(ge=-_I64, lt=_I64)]


def _check_encodable(value, depth: int = 0) -> None:
    """JSON may carry lone surrogates ("\\ud800"); no tokenizer can encode them, so reject them here."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    elif depth < 8 and isinstance(value, dict):
        for k, v in value.items():
            _check_encodable(k, depth + 1)
            _check_encodable(v, depth + 1)
    elif depth < 8 and isinstance(value, list):
        for v in value:
            _check_encodable(v, depth + 1)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _check_encodable(data)
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too (with include_usage)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's extra fields
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras: prompt_logprobs per prompt position (not when streaming); priority under the "priority"
    # scheduling policy; request_id (or an X-Request-Id header) names the response
    prompt_logprobs: int | None = None
    priority: Int64 = 0
    request_id: str | None = None
    return_token_ids: bool = False  # vLLM's: token ids beside the text (the prompt's too)
    # vLLM's extras jengine cannot honour; refused when set (`check_extras`) rather than silently ignored
    use_beam_search: bool = False
    logprob_token_ids: list[int] | None = None
    cache_salt: str | None = None
    truncation_side: Literal["left", "right"] | None = None
    kv_transfer_params: dict | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens spelled "token_id:N"
    # Structured outputs: OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs
    # (StructuredOutputsParams' fields) and the guided_* fields older vLLM versions took (`_structured_outputs`)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """`defaults` (the model's generation config, by SamplingParams field) fill the sampling fields and
        `max_tokens` the request leaves unset (None); what is still unset keeps SamplingParams' default."""
        structured_outputs = self._structured_outputs()
        defaults = defaults or {}
        kw = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            value = defaults.get(name) if value is None else value
            if value is not None:
                kw[name] = value
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        return SamplingParams(
            n=self.n, seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs, logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured_outputs, **kw)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's constraint, checked, as vLLM reads it: `structured_outputs`, whose constraint a
        json_object or json_schema `response_format` replaces (its options stay); the older guided_* fields
        name one constraint each. A ValueError names the request field at fault."""
        fields, source = dict(self.structured_outputs or {}), "structured_outputs"
        legacy = {name: value for name, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                                  ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None}
        if legacy:
            fields.update(legacy)
            source = "guided_" + next(iter(legacy))
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                override = {"json_object": True}
            elif fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                    raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
                override = {"json": fmt.json_schema.json_schema}
            else:
                raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                                 f"{fmt.type!r}")
            fields.update(override)
            source = "response_format"
        if not fields:
            return None
        try:
            params = StructuredOutputsParams.of(fields)
            grammar_text(params)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        return params

    def check_extras(self) -> None:
        """vLLM's extra fields: its rules for what only a stream, or only a whole response, can carry, and
        a 400 for those jengine cannot honour."""
        unsupported = {
            "use_beam_search": "beam search is offline only in jengine (LLM.beam_search)",
            "logprob_token_ids": "logprobs come for the top tokens only",
            "cache_salt": "the prefix cache is not salted per request",
            "kv_transfer_params": "jengine has no KV transfer (disaggregated serving)"}
        for name, why in unsupported.items():
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{name} is not supported: {why}")
        if self.truncation_side == "right":
            raise ValueError("truncation_side 'right' is not supported: truncate_prompt_tokens keeps the prompt's "
                             "last tokens ('left')")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs == -1:
                raise ValueError(f"prompt_logprobs=-1 (the whole vocabulary) is not supported; at most "
                                 f"{MAX_LOGPROBS}")
            if self.stream and self.prompt_logprobs > 0:
                raise ValueError("prompt_logprobs are not available when stream is true")

    def with_prompt_logprobs(self, params: SamplingParams, fallback: int | None) -> SamplingParams:
        """`params` asking for the request's prompt_logprobs, else for `fallback` (what echo implies)."""
        self.check_extras()
        k = self.prompt_logprobs if self.prompt_logprobs is not None else fallback
        return params if k is None else params.clone(prompt_logprobs=k)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: BOS and the like around a text prompt
    prompt_embeds: Any = None  # vLLM's; refused (the engine takes token ids)

    @property
    def echo_only(self) -> bool:
        """vLLM's: echo with max_tokens 0 returns the prompt alone (one token is generated and dropped)."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int:
        """vLLM's: a null max_tokens is OpenAI's default of 16, as an absent one."""
        if self.echo_only:
            return 1
        return 16 if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        return _as_prompt_list(self.prompt, "prompt")

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: as `sampling_params` takes them (never max_tokens: OpenAI's default of 16 is a value,
        and so is null, as in vLLM)."""
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt_embeds is not None:
            raise ValueError("prompt_embeds is not supported: send the prompt as text or token ids")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n when given)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}")
        params = self.sampling_params(self.requested_max_tokens(), self.logprobs, defaults)
        # echoed prompt tokens carry their logprobs too
        return self.with_prompt_logprobs(params, self.logprobs if self.echo else None)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: Any = None  # OpenAI's: JSON text; a dict or list is taken as the parsed arguments


class ToolCallParam(_Body):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict:
        """The call as chat templates read it: its arguments parsed to a dict, as vLLM passes them (JSON
        text that does not parse, or none, is `{}`)."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        call = {"type": self.type, "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a "tool" message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict:
        """The message as the chat template gets it (vLLM's fields: no content is "")."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.role == "assistant" and self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.role == "tool" and self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """Tools as a chat template gets them (vLLM's: every field, null where not given); a ValueError where two
    functions share a name."""
    if tools is None:
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        j = seen.setdefault(tool.function.name, i)
        if j != i:
            raise ValueError(f"tools[{i}].function.name {tool.function.name!r} repeats tools[{j}]'s: function "
                             "names must be unique")
    return [tool.model_dump() for tool in tools]


class _ChatTemplateOptions(_Body):
    """How a conversation is rendered (vLLM's names); `OpenAIServing.chat_prompt` reads them. A request's own
    chat_template is refused unless the server trusts request templates."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    def conversation(self) -> list[dict]:
        return [m.template_message() for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template gets them (`template_tools`)."""
        return template_tools(self.tools)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The extra template variables."""
        return self.chat_template_kwargs


class ChatCompletionRequest(_Sampling, _ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # "none", "auto", "required" or a named function (`jengine.entrypoints.tool_choice`); the output's calls
    # are read by `jengine.entrypoints.tool_calls`. parallel_tool_calls false keeps the first call only.
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras: echo prepends the last message when the reply continues its role; special tokens on
    # top of the template's; documents for templates that take them (RAG)
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """vLLM's: reasoning_effort reaches the template as a variable, and switches thinking on (off for
        "none") unless the request's chat_template_kwargs set enable_thinking themselves."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {"enable_thinking": self.reasoning_effort != "none", **(self.chat_template_kwargs or {})}
        return {**kwargs, "reasoning_effort": self.reasoning_effort}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def reply_role(self) -> str:
        """vLLM's: the assistant's turn after a generation prompt, else the last message's role continued."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def resolved_tool_choice(self) -> ToolChoice:
        return resolve_tool_choice(self.tool_dicts(), self.tool_choice)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """As vLLM: tool_choice "required" or a named function constrains the output to calls (the options
        of structured_outputs, such as disable_any_whitespace, still apply); no other constraint may come
        with it."""
        choice = self.resolved_tool_choice()
        if not choice.constrained:
            return super()._structured_outputs()
        legacy = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        if ((self.response_format is not None and self.response_format.type != "text")
                or any(v is not None for v in legacy) or set(self.structured_outputs or {}) & set(CONSTRAINTS)):
            what = "'required'" if choice.mode == "required" else "naming a function"
            raise ValueError(f"tool_choice {what} constrains the output to tool calls; it cannot be combined with "
                             "response_format, a structured_outputs constraint or guided_*")
        schema = output_schema(self.tool_dicts(), choice, self.parallel_tool_calls)
        try:
            params = StructuredOutputsParams.of({**(self.structured_outputs or {}), "json": schema})
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        try:
            grammar_text(params)
        except ValueError as e:
            raise ValueError(f"tools: the function parameters cannot constrain the output: {e}") from None
        return params

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: as `sampling_params` takes them (max_tokens where the request gives neither
        max_tokens nor max_completion_tokens)."""
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(self.requested_max_tokens(), logprobs, defaults)
        # vLLM scores the prompt of an echoed reply; a stream has no place for those scores
        return self.with_prompt_logprobs(params, (self.top_logprobs or 0) if self.echo and not self.stream else None)


class TokenizeRequest(_ChatTemplateOptions):
    """Either `prompt` (encoded with `add_special_tokens`) or `messages` (rendered as a chat request's)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return _as_prompt_list(self.input, "input")


def check_fits_engine(params: SamplingParams, vocab_size: int, eos_token_ids, max_num_seqs: int) -> None:
    """Limits the sampler enforces only inside a step (where an error would stop the engine)."""
    if params.n > max_num_seqs:
        raise ValueError(f"n must be <= {max_num_seqs} (max_num_seqs), got {params.n}")
    check_token_ids(params, vocab_size)
    check_bias_table(params, eos_token_ids)  # bad words, which need the tokenizer, are checked by the engine


def _as_prompt_list(value, field: str) -> list[str | list[int]]:
    """OpenAI's prompt forms (a string, token ids, or a list of either) as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ValueError(f"{field} must not be empty")
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)
