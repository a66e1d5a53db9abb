"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE chunks out.

Each prompt (completions may carry several) runs as one `AsyncLLM.generate` stream in its own task;
the tasks feed one queue, so a response is built from whichever finishes first, and cancelling the
tasks (client gone) aborts every request. Choice index = prompt index * n + sample index.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from jengine.async_llm import AsyncLLM
from jengine.entrypoints.errors import APIError
from jengine.entrypoints.max_tokens import generation_ceiling, max_tokens_for
from jengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, check_fits_engine
from jengine.entrypoints.tool_calls import ToolCallingConfig
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.prompts import truncated
from jengine.sampling_params import RequestOutputKind, SamplingParams
from jengine.tokenizer import render_chat

_DONE = object()


def _accumulate(previous: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """A streamed request's cumulative output: `previous` (the stream's own) extended in place by the
    engine's next DELTA output. The engine sends only what is new, so a long stream costs it O(new) per
    step; the prompt logprobs come with the first output and stay."""
    if previous is None:
        return delta
    for c in delta.outputs:
        into = previous.outputs[c.index]
        into.text += c.text
        into.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            into.logprobs.extend(c.logprobs)
        into.cumulative_logprob, into.finish_reason, into.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                         c.stop_reason)
    previous.finished, previous.metrics = delta.finished, delta.metrics
    return previous


class _Run:
    """The generate streams of one API request (a prompt and its params each), merged into one queue of
    (prompt index, item)."""

    def __init__(self, llm: AsyncLLM, requests: list[tuple], base_id: str, priority: int = 0):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, llm.generate(p, params, f"{base_id}-{i}", priority=priority)))
                      for i, (p, params) in enumerate(requests)]
        self.pending: list[tuple[int, RequestOutput]] = []
        self.prompt_lens: dict[int, int] = {}

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self.queue.put_nowait((i, out))
            self.queue.put_nowait((i, _DONE))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait((i, e))

    async def start(self) -> None:
        """Wait until every prompt was accepted (its first output came), so bad input fails before
        any response byte is sent."""
        started: set[int] = set()
        while len(started) < len(self.tasks):
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            started.add(i)
            self.pending.append((i, item))
            self.prompt_lens[i] = len(getattr(item, "prompt_token_ids", None) or ())

    async def items(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        done = 0
        for i, item in self.pending:  # a prompt may already have finished while the others started
            if item is _DONE:
                done += 1
            else:
                yield i, item
        self.pending = []
        while done < len(self.tasks):
            i, item = await self.queue.get()
            if item is _DONE:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


class OpenAIServing:
    """`chat_template`: the server's template for every chat request (`--chat-template`), else the
    tokenizer's; a request's own is accepted only with `trust_request_chat_template`. `tool_calling`: how
    chat requests' tools are read (`jengine.entrypoints.tool_calls`)."""

    def __init__(self, llm: AsyncLLM, model_name: str, tokenizer, *, chat_template: str | None = None,
                 trust_request_chat_template: bool = False, tool_calling: ToolCallingConfig | None = None):
        self.llm, self.model_name, self.tokenizer = llm, model_name, tokenizer
        self.chat_template, self.trust_request_chat_template = chat_template, trust_request_chat_template
        self.tool_calling = tool_calling or ToolCallingConfig()
        self.engine_config = llm.engine.config
        self.model_config = llm.engine.model_config
        self.sampling_defaults = llm.engine.sampling_defaults  # from the model's generation config
        self.max_tokens_ceiling = generation_ceiling(self.engine_config.generation_config, self.sampling_defaults,
                                                     self.engine_config.override_generation_config)
        self._token_strs: dict[int, str] = {}

    # ------------------------------------------------------------------ shared

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def _params(self, req) -> SamplingParams:
        """The request's sampling params. A response that is not streamed reads only the finished output,
        so the engine is asked for that one alone; a streamed one gets what is new each step (`_accumulate`).
        Logprobs come flat: the positions' dicts are built only while a response is written, and dropped."""
        params = req.to_sampling_params(self.sampling_defaults)
        check_fits_engine(params, self.model_config.vocab_size, self.model_config.eos_token_ids,
                          self.engine_config.max_num_seqs)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        return params.clone(output_kind=kind, flat_logprobs=True)

    def _with_max_tokens(self, req, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
        """`params` with vLLM's max_tokens for this prompt (`jengine.entrypoints.max_tokens`)."""
        prompt_len = len(truncated(prompt_ids, params.truncate_prompt_tokens, self.engine_config.max_model_len))
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        n = max_tokens_for(prompt_len, req.requested_max_tokens(), max_model_len=self.engine_config.max_model_len,
                           default=self.sampling_defaults.get("max_tokens"), ceiling=self.max_tokens_ceiling,
                           param=param)
        return params if n == params.max_tokens else params.clone(max_tokens=n)

    def _priority(self, req) -> int:
        if req.priority != 0 and self.engine_config.scheduling_policy != "priority":
            raise ValueError(f"priority={req.priority} needs priority scheduling; this server schedules first "
                             f"come, first served (scheduling_policy={self.engine_config.scheduling_policy!r})")
        return req.priority

    @staticmethod
    def _ids(prefix: str, req, header_id: str | None) -> tuple[str, str]:
        """(the response's id, the engine's base id): vLLM's X-Request-Id header, else the body's request_id,
        else a random one. A client's id may repeat, so the engine's gets a random tail."""
        given = header_id or req.request_id
        if not given:
            rid = f"{prefix}-{uuid.uuid4().hex}"
            return rid, rid
        return f"{prefix}-{given}", f"{prefix}-{given}-{uuid.uuid4().hex[:8]}"

    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._token_strs.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self._token_strs[tid] = s
        return s

    async def _start(self, requests: list[tuple], base_id: str, priority: int) -> _Run:
        run = _Run(self.llm, requests, base_id, priority)
        try:
            await run.start()
        except BaseException:
            run.cancel()
            raise
        return run

    async def _final(self, run: _Run, num_prompts: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * num_prompts
        try:
            async for i, out in run.items():
                finals[i] = out
        finally:
            run.cancel()
        return finals

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return _usage(prompt, completion)

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def _stream(self, run: _Run, n: int, stream_options, make_chunk, make_heads=None,
                      usage_chunk=None) -> AsyncIterator[str]:
        """SSE events: per choice, its opening chunks (`make_heads`), then new text/tokens since the previous
        event; then usage and [DONE]. With vLLM's continuous_usage_stats every chunk carries its choice's
        usage so far (the prompt's tokens and the choice's own completion tokens)."""
        include_usage = bool(stream_options and stream_options.include_usage)
        continuous = include_usage and stream_options.continuous_usage_stats
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        latest: dict[int, RequestOutput] = {}
        try:
            if make_heads is not None:
                for index in range(len(run.tasks) * n):
                    for head in make_heads(index):
                        if continuous:
                            head["usage"] = _usage(run.prompt_lens.get(index // n, 0), 0)
                        yield self._sse(head)
            async for i, out in run.items():
                out = latest[i] = _accumulate(latest.get(i), out)
                for c in out.outputs:
                    index = i * n + c.index
                    if index in finished:
                        continue
                    t0, k0 = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    delta, new_tokens = c.text[t0:], len(c.token_ids) - k0
                    if not delta and c.finish_reason is None and (new_tokens == 0 or c.logprobs is None):
                        continue
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(index)
                    chunk = make_chunk(index, out, c, delta, k0)
                    if chunk is None:  # nothing to send yet (a tool-call parser holds the text back)
                        continue
                    if continuous:
                        chunk["usage"] = _usage(len(out.prompt_token_ids), len(c.token_ids))
                    yield self._sse(chunk)
            if include_usage:
                finals = [latest[i] for i in sorted(latest)]
                yield self._sse(usage_chunk(self._usage(finals)))
        except APIError as e:
            yield self._sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream has started; report in-band
            yield self._sse(APIError.from_exception(e).body())
        finally:
            run.cancel()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ completions

    def _completion_logprobs(self, c: CompletionOutput, start: int, text_offset: int, as_ids: bool) -> dict | None:
        if c.logprobs is None:
            return None
        flat = c.logprobs  # a FlatLogprobs: `_params` asks for flat logprobs
        tokens, token_lps, tops, offsets = [], [], [], []
        for j, tid in enumerate(c.token_ids[start:], start):
            ids, lps, _ = flat.position(j)
            s = self.token_str(tid, as_ids)
            tokens.append(s)
            token_lps.append(lps[ids.index(tid)])
            tops.append({self.token_str(t, as_ids): lp for t, lp in zip(ids, lps)})
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, out: RequestOutput, as_ids: bool) -> dict:
        """OpenAI's logprobs of echoed prompt tokens: the first token has none."""
        flat = out.prompt_logprobs or None
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for pos, tid in enumerate(out.prompt_token_ids):
            s = self.token_str(tid, as_ids)
            ids, lps, _ = flat.position(pos) if flat is not None else ((), (), ())
            tokens.append(s)
            token_lps.append(lps[ids.index(tid)] if ids else None)
            tops.append({self.token_str(t, as_ids): lp for t, lp in zip(ids, lps)} if ids else None)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, start: int,
                         as_ids: bool, text_offset: int = 0) -> dict | None:
        """Completion logprobs from token `start`, preceded by the prompt's when echo asked for them (and
        only those when echo came with max_tokens 0). `text_offset`: where the choice's text sent so far ends
        (a stream's later chunks), which the tokens' offsets count from, as in vLLM."""
        if c.logprobs is None:  # prompt_logprobs alone do not make echo return logprobs
            return None
        if req.echo_only and start > 0:
            return None
        if not req.echo or out.prompt_logprobs is None or start > 0:
            return self._completion_logprobs(c, start, text_offset, as_ids)
        head = self._echo_logprobs(out, as_ids)
        tail = None if req.echo_only else self._completion_logprobs(c, 0, sum(len(t) for t in head["tokens"]), as_ids)
        return {key: head[key] + (tail[key] if tail else []) for key in head}

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: per prompt position, {token id: {logprob, rank, decoded_token}} for the
        prompt's token and the top k; None at the first position, which nothing predicts."""
        flat = out.prompt_logprobs  # a FlatLogprobs: `_params` asks for flat logprobs
        if flat is None:
            return None
        positions = []
        for pos in range(len(out.prompt_token_ids)):
            ids, lps, ranks = flat.position(pos) if pos < len(flat) else ((), (), ())
            positions.append({str(t): {"logprob": max(lp, -9999.0), "rank": r,
                                       "decoded_token": self.token_str(t) if self.tokenizer is not None else None}
                              for t, lp, r in zip(ids, lps, ranks)} or None)
        return positions

    def _completion_prompt(self, prompt, add_special_tokens: bool) -> tuple:
        """(what the engine gets, the prompt's token ids): a text prompt is tokenized here, as in vLLM, so
        that its length sets max_tokens; the engine keeps the text for echo."""
        if not isinstance(prompt, str):
            return prompt, list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; send token ids")
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return {"prompt": prompt, "prompt_token_ids": ids}, ids

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    async def create_completion(self, req: CompletionRequest, header_id: str | None = None):
        self.check_model(req.model)
        params = self._params(req)
        requests = []
        for prompt in req.prompts():
            engine_prompt, ids = self._completion_prompt(prompt, req.add_special_tokens)
            requests.append((engine_prompt, self._with_max_tokens(req, params, ids)))
        (rid, base_id), created = self._ids("cmpl", req, header_id), int(time.time())
        run = await self._start(requests, base_id, self._priority(req))
        ids = req.return_tokens_as_token_ids
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if req.stream:
            sent = {}  # choice index -> length of the text streamed so far (its logprobs' text offsets go on)

            def chunk(index, out, c, delta, k0):
                if req.echo_only:
                    delta = ""
                if req.echo and k0 == 0 and not req.return_token_ids:  # vLLM echoes ids, not text, then
                    delta = self._prompt_text(out) + delta
                offset = sent.get(index, 0)
                sent[index] = offset + len(delta)
                choice = {"index": index, "text": delta,
                          "logprobs": self._choice_logprobs(req, out, c, k0, ids, offset),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids[k0:]
                    if k0 == 0:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                return {**head, "choices": [choice]}

            return self._stream(run, params.n, req.stream_options, chunk,
                                usage_chunk=lambda usage: {**head, "choices": [], "usage": usage})
        finals = await self._final(run, len(requests))
        choices = []
        for i, out in enumerate(finals):
            prefix = self._prompt_text(out) if req.echo and not req.return_token_ids else ""
            prompt_logprobs = self._prompt_logprobs(out)
            given = req.return_token_ids
            for c in out.outputs:
                choices.append({"index": i * params.n + c.index, "text": prefix + ("" if req.echo_only else c.text),
                                "logprobs": self._choice_logprobs(req, out, c, 0, ids),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "token_ids": c.token_ids if given else None, "prompt_logprobs": prompt_logprobs,
                                "prompt_token_ids": out.prompt_token_ids if given else None})
        return {**head, "choices": choices, "usage": self._usage(finals)}

    # ------------------------------------------------------------------ chat

    def _chat_logprobs(self, c: CompletionOutput, start: int, top: int, as_ids: bool) -> dict | None:
        """OpenAI's chat logprobs: each token's, and the `top` most likely tokens at its position (the
        sampled token among them only where its rank is within `top`)."""
        if c.logprobs is None:
            return None
        flat = c.logprobs  # a FlatLogprobs: `_params` asks for flat logprobs
        content = []
        for j, tid in enumerate(c.token_ids[start:], start):
            ids, lps, ranks = flat.position(j)
            s = self.token_str(tid, as_ids)
            ranked = sorted(((r, t, lp) for t, lp, r in zip(ids, lps, ranks) if r is not None and r <= top),
                            key=lambda x: x[0])
            tops = [(self.token_str(t, as_ids), lp) for _, t, lp in ranked]
            content.append({"token": s, "logprob": lps[ids.index(tid)], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": ts, "logprob": lp, "bytes": list(ts.encode())}
                                             for ts, lp in tops]})
        return {"content": content}

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest, *, add_special_tokens: bool = False,
                    documents: list[dict] | None = None, exclude_tools: bool = False) -> list[int]:
        """The prompt ids of a chat request's messages (or /tokenize's), rendered with its template options
        and its tools (unless `exclude_tools`)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            # a template is code the server runs: by default only its operator chooses it, as in vLLM
            raise ValueError("chat_template in a request is refused: the server was not started with "
                             "--trust-request-chat-template")
        template = req.chat_template if req.chat_template is not None else self.chat_template
        if self.tokenizer is None or (template is None and getattr(self.tokenizer, "chat_template", None) is None):
            raise ValueError("this model has no chat template; use /v1/completions (or start the server with "
                             "--chat-template)")
        return render_chat(self.tokenizer, req.conversation(), add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, chat_template=template,
                           chat_template_kwargs=req.template_kwargs(), add_special_tokens=add_special_tokens,
                           documents=documents, tools=None if exclude_tools else req.tool_dicts())

    async def create_chat_completion(self, req: ChatCompletionRequest, header_id: str | None = None):
        self.check_model(req.model)
        params = self._params(req)
        choice = req.resolved_tool_choice()
        reading = self.tool_calling.reading(choice, req.parallel_tool_calls)  # None: the text is all content
        if reading is not None and reading.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)  # as vLLM: the call tags may be special tokens
        prompt = self.chat_prompt(req, add_special_tokens=req.add_special_tokens, documents=req.documents,
                                  exclude_tools=self.tool_calling.excludes_tools(choice))
        params = self._with_max_tokens(req, params, prompt)
        (rid, base_id), created = self._ids("chatcmpl", req, header_id), int(time.time())
        run = await self._start([(prompt, params)], base_id, self._priority(req))
        ids, top = req.return_tokens_as_token_ids, req.top_logprobs or 0
        head = {"id": rid, "created": created, "model": self.model_name}
        role, last = req.reply_role(), req.messages[-1]
        echoed = last.text() if req.echo and last.role == role else ""  # vLLM's echo
        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}

            def opening(index):
                chunks = [{**chunk_head, "choices": [{"index": index, "delta": {"role": role, "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}]
                if req.return_token_ids:
                    chunks[0]["prompt_token_ids"] = prompt
                if echoed:
                    chunks.append({**chunk_head, "choices": [{"index": index, "delta": {"content": echoed},
                                                              "logprobs": None, "finish_reason": None}]})
                return chunks

            streams = {}  # choice index -> its StreamedToolCalls

            def chunk(index, out, c, delta, k0):
                fields, finish_reason = ({"content": delta} if delta else {}), c.finish_reason
                if reading is not None:
                    stream = streams.setdefault(index, reading.stream())
                    fields = stream.delta(delta, finished=finish_reason is not None)
                    finish_reason = reading.finish_reason(stream.called, finish_reason)
                logprobs = self._chat_logprobs(c, k0, top, ids)
                if not fields and finish_reason is None and logprobs is None and not req.return_token_ids:
                    return None
                choice = {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids[k0:]
                return {**chunk_head, "choices": [choice]}

            return self._stream(run, params.n, req.stream_options, chunk, make_heads=opening,
                                usage_chunk=lambda usage: {**chunk_head, "choices": [], "usage": usage})
        finals = await self._final(run, 1)
        given = req.return_token_ids
        choices = []
        for c in finals[0].outputs:
            message, finish_reason = {"role": role, "content": echoed + c.text}, c.finish_reason
            if reading is not None:
                content, calls = reading.message(c.text)
                message["content"] = echoed + (content or "") if echoed else content
                if calls:
                    message["tool_calls"] = calls
                finish_reason = reading.finish_reason(bool(calls), finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": self._chat_logprobs(c, 0, top, ids),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids if given else None})
        return {**head, "object": "chat.completion", "choices": choices, "usage": self._usage(finals),
                "prompt_logprobs": self._prompt_logprobs(finals[0]),
                "prompt_token_ids": finals[0].prompt_token_ids if given else None}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
