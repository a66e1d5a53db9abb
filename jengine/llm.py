"""`LLM`: the offline Python API with vLLM's names (`generate`, `chat`)."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence

from tqdm.auto import tqdm

from jengine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jengine.data_parallel import build_engine
from jengine.engine_config import EngineConfig
from jengine.outputs import RequestOutput
from jengine.presets import DEFAULT_MODEL
from jengine.sampling_params import RequestOutputKind, SamplingParams
from jengine.tokenizer import render_chat


def _is_token_ids(prompts) -> bool:
    """Whether `prompts` is one prompt of token ids (a list, tuple or 1-D array of integers) rather than
    a list of prompts."""
    if getattr(prompts, "ndim", None) == 1:
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], numbers.Integral)


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `LLM(model="path/to/hf_dir" or a preset, dtype=..., max_model_len=..., ...)`; every keyword is a
    field of `EngineConfig` (vLLM's engine argument names). Unset, `prefill_first` is on here: a batch's
    prompts run first, in full steps, and its decodes after them (EngineConfig.prefill_first).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, use_tqdm_on_load: bool = True, **engine_args):
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; allowed: {sorted(fields - {'model'})}")
        progress = use_tqdm_on_load
        if engine_args.get("prefill_first") is None:  # the offline default (EngineConfig.prefill_first)
            engine_args["prefill_first"] = True
        config = EngineConfig(model=model, **engine_args)
        self.engine = build_engine(config, progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling params: jengine's defaults, with the fields
        the model's generation_config.json sets (EngineConfig.generation_config) taken from it."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token-id lists, or prompt dicts); outputs in input order."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise ValueError("prompts must be a prompt (text, token ids or a prompt dict) or a list of them, got "
                             f"{type(prompts).__name__}") from None
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        # Only the finished outputs are read here. (Anything but SamplingParams goes to the engine as is,
        # which rejects it.)
        final_only = {id(sp): sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                      for sp in params if isinstance(sp, SamplingParams)}
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, params)):
                self.engine.add_request(rid, prompt, final_only.get(id(sp), sp),
                                        priority=0 if priority is None else priority[i])
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them.

        `continue_final_message`: leave the final message open for the model to continue (with
        add_generation_prompt=False); `chat_template_kwargs`: extra variables for the template; `tools`:
        OpenAI's tool dicts (`{"type": "function", "function": {"name", "description", "parameters"}}`), which
        the template renders for the model (its replies are returned as text: parse tool calls with
        `jengine.entrypoints.tool_parsers`). An assistant message of the history may hold `tool_calls` with
        no content."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        if not isinstance(messages, (list, tuple)):
            raise ValueError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                             f"list of conversations, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tool_dicts = _checked_tools(tools)
        prompts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and (isinstance(m.get("content"), (str, list)) or m.get("content") is None and m.get("tool_calls"))
                    for m in conv):
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts (role a string, "
                                 "content a string or a list of parts, or None in a message with tool_calls)")
            prompts.append({"prompt_token_ids": render_chat(
                tokenizer, _template_messages(conv), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs, tools=tool_dicts)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): `params.beam_width` sequences per prompt, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine went idle with requests still unfinished")
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
            self.engine.drain()
        except BaseException:
            for rid in wanted - set(done):
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _template_messages(conversation) -> list[dict]:
    """The messages as the chat template gets them: an assistant's tool_calls checked and their arguments parsed
    to dicts, as the server passes them (JSON text that does not parse is `{}`)."""
    if not any(m.get("tool_calls") for m in conversation):
        return list(conversation)
    from pydantic import ValidationError

    from jengine.entrypoints.protocol import ToolCallParam

    messages = []
    for i, m in enumerate(conversation):
        if m.get("tool_calls"):
            try:
                calls = [ToolCallParam.model_validate(c).template_call() for c in m["tool_calls"]]
            except ValidationError as e:
                raise ValueError(f"messages[{i}].tool_calls: {_first_error(e)}") from None
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        messages.append(m)
    return messages


def _first_error(e) -> str:
    error = e.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def _checked_tools(tools) -> list[dict] | None:
    """`LLM.chat`'s tools as the template gets them, checked as the server checks a request's: a ValueError
    names the tool and field that are wrong."""
    if tools is None:
        return None
    from pydantic import ValidationError

    from jengine.entrypoints.protocol import Tool, template_tools

    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    parsed = []
    for i, tool in enumerate(tools):
        try:
            parsed.append(Tool.model_validate(tool))
        except ValidationError as e:
            raise ValueError(f"tools[{i}]: {_first_error(e)}") from None
    return template_tools(parsed)
