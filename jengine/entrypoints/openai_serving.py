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
from jengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, check_fits_engine
from jengine.outputs import CompletionOutput, RequestOutput
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
    """The generate streams of one API request, merged into one queue of (prompt index, item)."""

    def __init__(self, llm: AsyncLLM, prompts: list, params: SamplingParams, base_id: str):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, llm.generate(p, params, f"{base_id}-{i}")))
                      for i, p in enumerate(prompts)]
        self.pending: list[tuple[int, RequestOutput]] = []

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
    tokenizer's; a request's own is accepted only with `trust_request_chat_template`."""

    def __init__(self, llm: AsyncLLM, model_name: str, tokenizer, *, chat_template: str | None = None,
                 trust_request_chat_template: bool = False):
        self.llm, self.model_name, self.tokenizer = llm, model_name, tokenizer
        self.chat_template, self.trust_request_chat_template = chat_template, trust_request_chat_template
        self.engine_config = llm.engine.config
        self.model_config = llm.engine.model_config
        self.sampling_defaults = llm.engine.sampling_defaults  # from the model's generation config
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

    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._token_strs.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self._token_strs[tid] = s
        return s

    async def _start(self, prompts: list, params: SamplingParams, base_id: str) -> _Run:
        run = _Run(self.llm, prompts, params, base_id)
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
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def _stream(self, run: _Run, n: int, include_usage: bool, make_chunk, make_head=None,
                      usage_chunk=None) -> AsyncIterator[str]:
        """SSE events: per choice, new text/tokens since the previous event; then usage and [DONE]."""
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        latest: dict[int, RequestOutput] = {}
        try:
            if make_head is not None:
                for index in range(len(run.tasks) * n):
                    yield self._sse(make_head(index))
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
                    yield self._sse(make_chunk(index, out, c, delta, k0))
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

    def _with_echo(self, out: RequestOutput, c: CompletionOutput, start: int, as_ids: bool) -> dict | None:
        """Completion logprobs from token `start`, preceded by the prompt's when echo asked for them."""
        if out.prompt_logprobs is None or start > 0:
            return self._completion_logprobs(c, start, 0, as_ids)
        head = self._echo_logprobs(out, as_ids)
        tail = self._completion_logprobs(c, 0, sum(len(t) for t in head["tokens"]), as_ids)
        return {key: head[key] + (tail[key] if tail else []) for key in head}

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    async def create_completion(self, req: CompletionRequest):
        self.check_model(req.model)
        params = self._params(req)
        prompts = req.prompts()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        run = await self._start(prompts, params, rid)
        ids = req.return_tokens_as_token_ids
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if req.stream:
            def chunk(index, out, c, delta, k0):
                if req.echo and k0 == 0:
                    delta = self._prompt_text(out) + delta
                return {**head, "choices": [{"index": index, "text": delta,
                                             "logprobs": self._with_echo(out, c, k0, ids),
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(run, params.n, include_usage, chunk,
                                usage_chunk=lambda usage: {**head, "choices": [], "usage": usage})
        finals = await self._final(run, len(prompts))
        choices = []
        for i, out in enumerate(finals):
            prefix = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                choices.append({"index": i * params.n + c.index, "text": prefix + c.text,
                                "logprobs": self._with_echo(out, c, 0, ids) if req.echo
                                else self._completion_logprobs(c, 0, 0, ids),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
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

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """The prompt ids of a chat request's messages (or /tokenize's), rendered with its template options."""
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
                           chat_template_kwargs=req.chat_template_kwargs)

    async def create_chat_completion(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        params = self._params(req)
        prompt = self.chat_prompt(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        run = await self._start([prompt], params, rid)
        ids, top = req.return_tokens_as_token_ids, req.top_logprobs or 0
        head = {"id": rid, "created": created, "model": self.model_name}
        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}

            def first(index):
                return {**chunk_head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]}

            def chunk(index, out, c, delta, k0):
                return {**chunk_head, "choices": [{"index": index, "delta": {"content": delta} if delta else {},
                                                   "logprobs": self._chat_logprobs(c, k0, top, ids),
                                                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(run, params.n, include_usage, chunk, make_head=first,
                                usage_chunk=lambda usage: {**chunk_head, "choices": [], "usage": usage})
        finals = await self._final(run, 1)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c, 0, top, ids), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in finals[0].outputs]
        return {**head, "object": "chat.completion", "choices": choices, "usage": self._usage(finals)}
