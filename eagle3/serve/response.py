"""One request's response: engine chunks -> an OpenAI body (whole) or SSE events, plus metrics.

Chat stream: a first chunk with the assistant role, one chunk per engine step that produced text,
the finish_reason on the last, an optional usage chunk (stream_options.include_usage), then
`data: [DONE]`. The extra field `eagle3` carries, per chunk, `segments` ([[text, drafted], ...],
concatenating to the chunk's text), the running `tau`, `tokens` and `drafted_tokens`; the last chunk
(and every whole response) carries the request's speculation `stats`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import Eagle3Error, InputError
from ..generate import Chunk, GenerationResult
from .highlight import DraftSpans
from .protocol import APIError
from .queue import END, Job

class Served(Protocol):
    """What a response needs of the server (serve.app.Server has it)."""
    metrics: Any          # serve.metrics.ServerMetrics
    tokenizer: Any        # the event loop's tokenizer
    engine: Any           # generate.Engine (its `speculative`)
    depth: int            # draft positions reported per step
    model_name: str


class Generation:
    """Turns one job's chunks into an OpenAI response (whole or SSE) and records its metrics."""

    def __init__(self, server: Served, job: Job, req, chat: bool, endpoint: str):
        self.server, self.job, self.req, self.chat, self.endpoint = server, job, req, chat, endpoint
        self.metrics = server.metrics
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.spans = DraftSpans(server.tokenizer) if req.stream else None
        self.emitted = 0                    # characters of text handed out so far
        self.chunks_seen = 0
        self.tokens = self.from_draft = 0     # emitted tokens; of them, accepted draft proposals
        self.decode_tokens = self.decode_steps = 0
        self.done = False

    # ------------------------------------------------------------------ the job's chunks
    async def chunks(self) -> AsyncIterator[Chunk]:
        """Engine chunks in order; if the consumer stops early, the generation is cancelled."""
        try:
            while True:
                item = await self.job.out.get()
                if item is END:
                    self.done = True
                    return
                if isinstance(item, Exception):
                    self.done = True
                    raise self._engine_error(item)
                self._account(item)
                yield item
        finally:
            if not self.done:
                self.cancel()

    def cancel(self) -> None:
        if not self.done and not self.job.cancelled.is_set():
            self.job.cancel()
            self.metrics.cancelled.inc()
            self.metrics.requests.labels(self.endpoint, "499").inc()

    def _engine_error(self, e: Exception) -> APIError:
        """InputError is the client's (400); anything else is the server's (500). Our own errors
        carry a message meant for people; a foreign exception is named by its type only."""
        if isinstance(e, InputError):
            error = APIError(400, str(e), code="invalid_value")
        else:
            detail = str(e) if isinstance(e, Eagle3Error) else type(e).__name__
            error = APIError(500, f"generation failed: {detail}", type="server_error",
                             code="internal_error")
        self.metrics.requests.labels(self.endpoint, str(error.status)).inc()
        return error

    def _account(self, chunk: Chunk) -> None:
        m, now = self.metrics, time.perf_counter()
        self.chunks_seen += 1
        if self.chunks_seen == 1:
            m.prompt_tokens.inc(len(self.job.prompt_ids))
            m.ttft.observe(now - self.job.arrived)
        else:
            self.decode_steps += 1
            self.decode_tokens += len(chunk.token_ids)
        m.generation_tokens.inc(len(chunk.token_ids))
        self.tokens += len(chunk.token_ids)
        self.from_draft += sum(chunk.from_draft)
        if self.spans is not None:
            self.spans.push(chunk.token_ids, chunk.from_draft)
        if chunk.result is not None:
            m.success.labels(chunk.finish_reason).inc()
            m.cached_prompt_tokens.inc(chunk.result.cached_tokens)
            m.latency.observe(now - self.job.arrived)
            m.requests.labels(self.endpoint, "200").inc()

    # ------------------------------------------------------------------ payload pieces
    def live(self, text: str) -> dict:
        """The per-chunk extra field: text runs with drafted flags, running tau and counts."""
        segments = [[t, d] for t, d in self.spans.segments(self.emitted, text)]
        self.emitted += len(text)
        tau = self.decode_tokens / self.decode_steps if self.decode_steps else 1.0
        return {"segments": segments, "tau": round(tau, 4), "tokens": self.tokens,
                "drafted_tokens": self.from_draft}

    def stats(self, result: GenerationResult) -> dict:
        steps = result.decode_steps
        return {"speculative": self.server.engine.speculative, "tau": round(result.tau, 4),
                "decode_steps": len(steps), "tokens": len(result.token_ids),
                "drafted_tokens": self.from_draft,          # emitted tokens that were draft proposals
                "draft_tokens_proposed": sum(s.proposed for s in steps),
                "draft_tokens_accepted": sum(s.accepted for s in steps),
                "draft_tokens_accepted_suffix": sum(s.accepted_suffix for s in steps),  # suffix-only
                "arms": result.arms,                        # decode steps by adaptive choice
                "acceptance_per_position": [round(a, 4) for a in
                                            result.acceptance_per_position(self.server.depth)],
                "tokens_per_s": round(result.tokens_per_s, 2), "ttft_s": round(result.ttft_s, 4),
                "wall_s": round(result.wall_s, 4)}

    def usage(self, result: GenerationResult) -> dict:
        n_out = len(result.token_ids)
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n_out,
                "total_tokens": result.prompt_tokens + n_out,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.server.model_name}

    def choice(self, text: Optional[str], finish: Optional[str], delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"content": text} if text else {}
        if not delta:
            body = {"role": "assistant", "content": text or ""}
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish}

    # ------------------------------------------------------------------ whole response
    async def collect(self, request: Request) -> dict:
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            result = None
            async for chunk in self.chunks():
                result = chunk.result or result
        finally:
            watcher.cancel()
        if result is None:          # cancelled: the client is gone, nobody reads this
            raise APIError(499, "client disconnected", code="client_disconnected")
        obj = "chat.completion" if self.chat else "text_completion"
        choice = self.choice(result.text, result.finish_reason, False)
        if self.req.return_token_ids:      # as vLLM: the prompt's and the output's token ids
            choice.update(prompt_token_ids=list(self.job.prompt_ids), token_ids=list(result.token_ids))
        return {**self.head(obj), "choices": [choice], "usage": self.usage(result),
                "eagle3": self.stats(result)}

    async def _watch_disconnect(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return

    # ------------------------------------------------------------------ streaming response
    async def sse(self) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            first = self.choice(None, None, True)
            first["delta"] = {"role": "assistant", "content": ""}
            yield event({**self.head(obj), "choices": [first]})
        try:
            async for chunk in self.chunks():
                if not chunk.text and chunk.result is None:
                    continue
                payload = {**self.head(obj), "choices": [self.choice(chunk.text, chunk.finish_reason,
                                                                     True)],
                           "eagle3": self.live(chunk.text)}
                if chunk.result is not None:
                    payload["eagle3"]["stats"] = self.stats(chunk.result)
                yield event(payload)
                if chunk.result is not None and self._include_usage():
                    yield event({**self.head(obj), "choices": [], "usage": self.usage(chunk.result)})
        except APIError as e:
            yield event(e.body())
        yield "data: [DONE]\n\n"

    def _include_usage(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage


class EventStream(StreamingResponse):
    """SSE response that always closes its generator, so a disconnect cancels the job at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
