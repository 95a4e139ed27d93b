"""The OpenAI-compatible HTTP server: app factory, request intake, routes, error bodies.

| route | auth | what |
|---|---|---|
| GET  /                    | no  | chat page (static/index.html): streaming, drafts lit, live tau |
| GET  /health              | no  | {"status": "ok" or "degraded", "speculative", "spec" (the tree), "draft" (its own acceptance), ...} (the acceptance monitor; degraded also when the draft's own acceptance collapses) |
| GET  /metrics             | no  | Prometheus text (see metrics.py) |
| GET  /v1/models           | yes | the one served model |
| POST /v1/chat/completions | yes | chat; `stream` = SSE ending in `data: [DONE]` |
| POST /v1/completions      | yes | raw-text completion (no chat template) |
| POST /reset_prefix_cache  | yes | empty the prefix cache before the next step (vLLM's route; benchmarks) |

Every response carries its speculation stats in an extra field `eagle3`; stream chunks carry the
text split into runs [[text, drafted], ...] and the running tau. No request field is ever used as a
file path: `model` is only compared with the served name.

Request intake, in order: API key (401); Content-Type application/json (415); the body, read as a
stream up to max_body_bytes (413 once past it; 499, quietly, if the client leaves mid-body); strict
parsing (400); a prompt over max_model_len x chars_per_token characters is refused before it is
tokenized (400), the rest is tokenized in a tokenizer thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import Eagle3Error, InputError
from ..generate import encode_prompt
from ..generate.batch import PREFILL_CHUNK, PREFIX_CACHE_TOKENS, BatchScheduler
from ..generate.serial import SerialScheduler
from ..speculative.monitor import DRAFT_COLLAPSED_MESSAGE, DraftWatch
from ..speculative.policy import DRAFT_MEASURE_STEPS, DRAFT_PROBE_EVERY
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_body, parse_request,
                       requested_max_tokens, sampling_params)
from .queue import EngineWorker, Job, QueueFull
from .response import EventStream, Generation

log = logging.getLogger("eagle3.serve")

MAX_BODY_BYTES = 4 << 20
MIN_CHARS_PER_TOKEN = 32     # floor of the per-token character bound (see chars_per_token)
DEGRADED_HINT = (
    "speculation is not paying off: the rolling accepted length sits at 1.0 (the target rejects "
    "every draft token). Output is still exactly the target's, only slower. Likely causes: the "
    "draft was trained for another target or tokenizer; aux layer ids shifted by one ('input to "
    "layer i' vs 'output of layer i'); an EAGLE-3 draft run as EAGLE-1/2 or the reverse; prompts "
    "far from the training data (chat template, system prompt, language); a high temperature.")


def create_app(engine, *, model_name: str = "eagle3", api_key: Optional[str] = None,
               max_queue: int = 64, max_body_bytes: int = MAX_BODY_BYTES,
               max_batch: int = 1, prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
               learn=None) -> FastAPI:
    """An app serving `engine` (an eagle3.generate.Engine). Start it with its lifespan (uvicorn or
    `with TestClient(app)`): the lifespan starts and stops the engine worker. max_batch > 1 decodes
    up to that many requests together (continuous batching, generate.batch.BatchScheduler); with a
    speculative engine a greedy request that runs alone decodes speculatively (batch_mode), and a
    prompt that starts like a recent one reuses those tokens' k/v (prefix_cache_tokens, 0: off).
    learn: an eagle3.learn.LearnController (`--learn`): finished requests are captured, the learner
    paused while the engine is busy, new draft versions swapped in between steps."""
    server = Server(engine, model_name, api_key, max_queue, max_body_bytes, max_batch,
                    prefix_cache_tokens, learn)
    app = FastAPI(title="eagle3", lifespan=server.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    add_error_handlers(app)
    add_routes(app, server)
    return app


def chars_per_token(tokenizer) -> int:
    """Characters one token can stand for, at most: its vocabulary entry's length (byte-level BPE
    spells each byte as one character, SentencePiece each character as itself), floored at
    MIN_CHARS_PER_TOKEN for normalizers that fold several characters into one. A prompt longer than
    max_model_len times this cannot fit the context, so it is refused without being tokenized."""
    return max(MIN_CHARS_PER_TOKEN, max(map(len, tokenizer.get_vocab()), default=0))


def prompt_chars(req, chat: bool) -> int:
    """Characters of text in a request's prompt (a token-id prompt has none)."""
    if chat:
        return sum(len(m.text()) for m in req.messages)
    prompt = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    return sum(len(p) for p in prompt if isinstance(p, str))


def spec_depth(engine) -> int:
    """Draft depth of the engine's tree settings; a draftless engine's (`--draft suffix`, a model
    with no shipped draft): its suffix-only blocks' tokens; 0 without speculation."""
    if not engine.speculative:
        return 0
    if engine.spec is not None:
        return int(engine.spec.depth)
    return max((p.suffix_only_tokens for p in getattr(engine, "policies", {}).values()), default=0)


def batch_mode(engine, max_batch: int) -> tuple[int, str]:
    """The sequences decoded together (max_batch, or 1 where batching does not apply) and the
    startup line that says which and why."""
    if max_batch < 1:
        raise InputError(f"max_batch must be >= 1, got {max_batch}")
    if max_batch == 1:
        return 1, "serving one sequence at a time (--max-batch 1)"
    if not hasattr(engine.target, "forward_rows"):
        return 1, (f"serving one sequence at a time: {type(engine.target).__name__} has no batched "
                   f"forward (--max-batch {max_batch} needs the native inference layout)")
    batching = (f"continuous batching: up to {max_batch} sequences per step, "
                f"prompts prefilled in chunks of {PREFILL_CHUNK} tokens")
    if not engine.speculative:
        return max_batch, batching
    return max_batch, (f"{batching}; speculative decoding for a greedy request that runs alone "
                       "(it joins the batch when another arrives)")


# ---------------------------------------------------------------------------- server state
class Server:
    """Per-app state: the engine worker, metrics, auth, request validation and encoding."""

    def __init__(self, engine, model_name: str, api_key: Optional[str], max_queue: int,
                 max_body_bytes: int, max_batch: int = 1,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS, learn=None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes = max_body_bytes
        self.tokenizer = copy.deepcopy(engine.tokenizer)   # the event loop's own (engine's is busy)
        self.prompt_tokenizer = copy.deepcopy(engine.tokenizer)   # the tokenizer thread's own
        self.max_prompt_chars = engine.max_model_len * chars_per_token(engine.tokenizer)
        self.tokenize_pool: Optional[ThreadPoolExecutor] = None
        self.vocab_size = int(engine.target.config.vocab_size)
        self.depth = spec_depth(engine)
        self.metrics = ServerMetrics(max(self.depth, 1))
        # speculation counters take every decode step in the engine thread, cancelled requests'
        # included, like the acceptance monitor behind /health: the two always agree
        self.max_batch, self.mode = batch_mode(engine, max_batch)
        log.info("%s", self.mode)
        self.draft_watch = DraftWatch()             # the draft's own acceptance (engine thread)
        on_step = lambda step: self.observe_step(step)     # noqa: E731
        if self.max_batch > 1:
            scheduler = BatchScheduler.from_engine(engine, self.max_batch,
                                                   prefix_cache_tokens=prefix_cache_tokens)
            log.info("prefix cache: %s", prefix_cache_state(scheduler, prefix_cache_tokens))
            log.info("speculation inside the batch: %s", scheduler.chain_mode())
        else:
            scheduler = SerialScheduler(engine)
        measure_draft(engine, scheduler)
        self.worker = EngineWorker(scheduler, max_queue, self.after_job, on_step)
        self.metrics.watch_queue(lambda: self.worker.waiting, lambda: self.worker.busy,
                                 lambda: self.degraded)
        if isinstance(scheduler, BatchScheduler) and scheduler.gate is not None:
            self.metrics.watch_gate(scheduler.gate.summary)
        self.created = int(time.time())
        self.acceptance: Optional[dict] = None      # monitor snapshot after the last job
        self.learn = learn
        if learn is not None:
            self.attach_learn(learn, scheduler)

    def attach_learn(self, learn, scheduler) -> None:
        """Learning from traffic (eagle3.learn): the worker's hooks and the /metrics gauges."""
        self.worker.on_finished = lambda job, req: learn.finished(
            job.prompt_ids, req.output.ids, job.params.temperature, job.learn)
        self.worker.on_busy = learn.set_busy
        learn.attach(self.engine, scheduler, self.worker.run_between_steps, learn_first_policy(self.engine))
        self.metrics.watch_learn(learn.snapshot)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        # one thread: prompts are tokenized in arrival order, off the event loop
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-tokenize")
        await self.worker.start()
        if self.learn is not None:
            self.learn.start()
        try:
            yield
        finally:
            await self.worker.stop()
            if self.learn is not None:
                self.learn.stop()
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ health
    def after_job(self) -> None:
        """Runs in the engine thread after each job, the only thread that touches the monitor:
        keep a snapshot for /health and /metrics; log when it turns degraded or recovers."""
        monitor = self.engine.monitor
        if monitor is None:
            return
        was = self.monitor_degraded
        self.acceptance = monitor.snapshot()
        if self.monitor_degraded and not was:
            log.warning("%s /health reports degraded until acceptance returns.", DEGRADED_HINT)
        elif was and not self.monitor_degraded:
            log.info("speculation recovered: window tau %.2f", self.acceptance["window_tau"])

    def observe_step(self, step) -> None:
        """Engine thread, every decode step: the counters and the draft's own acceptance."""
        self.metrics.observe_steps([step])
        was = self.draft_watch.collapsed
        self.draft_watch.observe(step)
        if self.draft_watch.collapsed and not was:
            w = self.draft_watch
            log.warning(DRAFT_COLLAPSED_MESSAGE.format(accepted=w.accepted, steps=w.steps, tau=w.tau))

    @property
    def monitor_degraded(self) -> bool:
        return bool(self.acceptance is not None and self.acceptance["degraded"])

    @property
    def degraded(self) -> bool:
        """The acceptance monitor's degraded, or the draft's own acceptance collapsed."""
        return self.monitor_degraded or self.draft_watch.collapsed

    def draft_health(self) -> Optional[dict]:
        """/health's "draft": the draft's own acceptance, apart from suffix-only blocks."""
        name = getattr(self.engine, "draft_name", None)
        if getattr(self.engine, "draft", None) is None and name is None and not self.draft_watch.steps:
            return None
        return {"name": name, **self.draft_watch.snapshot()}

    def health(self) -> dict:
        body = {"status": "degraded" if self.degraded else "ok", "model": self.model_name,
                "speculative": self.engine.speculative,
                "queue": {"waiting": self.worker.waiting, "running": self.worker.busy,
                          "max_batch": self.max_batch}}
        spec = self.engine.spec if self.engine.speculative else None
        if spec is not None:              # the draft tree (eagle3 doctor --server compares offline)
            body["spec"] = {"top_k": spec.top_k, "depth": spec.depth,
                            "num_draft_tokens": spec.num_draft_tokens}
        elif self.engine.speculative:     # draftless: suffix-only blocks, no tree
            body["suffix_only_tokens"] = self.depth
        if self.acceptance is not None:
            body["acceptance"] = self.acceptance
        if self.draft_health() is not None:
            body["draft"] = self.draft_health()
        if self.degraded:
            body["reason"] = DEGRADED_HINT if self.monitor_degraded else DRAFT_COLLAPSED_MESSAGE.format(
                accepted=self.draft_watch.accepted, steps=self.draft_watch.steps, tau=self.draft_watch.tau)
        return body

    # ------------------------------------------------------------------ request intake
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_content_type(self, request: Request) -> None:
        """Only JSON bodies: a form or text/plain POST is a "simple" cross-origin request that any
        web page can send without a CORS preflight, so accepting it would let pages use the server."""
        given = request.headers.get("content-type", "")
        media, charset = parse_content_type(given)
        if media != "application/json" or charset not in ("utf-8", "utf8"):
            raise APIError(415, f"Content-Type is {given or 'missing'!r}; send the body as "
                                "'Content-Type: application/json' (UTF-8)",
                           code="unsupported_media_type")

    async def read_body(self, request: Request) -> bytes:
        """The body, read as it arrives: 413 as soon as it passes the limit (a chunked upload has
        no Content-Length to check first); 499 if the client goes away before it is complete."""
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(f"{int(declared)} bytes")
        body = bytearray()
        try:
            async for piece in request.stream():
                body += piece
                if len(body) > self.max_body_bytes:
                    raise self._too_large(f"over {self.max_body_bytes} bytes (stopped reading at "
                                          f"{len(body)})")
        except ClientDisconnect:
            self.metrics.body_disconnects.inc()
            raise APIError(499, "client disconnected while sending the request body",
                           code="client_disconnected") from None
        return bytes(body)

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"request body is {size}; the limit is {self.max_body_bytes} bytes",
                        code="body_too_large")

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")

    async def tokenize(self, req, chat: bool) -> list[int]:
        """Prompt token ids. Tokenizing megabytes of text takes seconds: it runs in the tokenizer
        thread, and only after a character bound that no prompt fitting the context can exceed."""
        self.check_prompt_chars(req, chat)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.encode,
                                                                req, chat)

    def check_prompt_chars(self, req, chat: bool) -> None:
        n = prompt_chars(req, chat)
        if n > self.max_prompt_chars:
            limit = self.engine.max_model_len
            raise APIError(400, f"the prompt has {n} characters; a {limit}-token context holds at "
                                f"most {self.max_prompt_chars} (a token stands for at most "
                                f"{self.max_prompt_chars // limit} characters here): shorten it",
                           param="messages" if chat else "prompt", code="context_length_exceeded")

    def encode(self, req, chat: bool) -> list[int]:
        """Runs in the tokenizer thread."""
        try:
            if chat:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                return encode_prompt(self.prompt_tokenizer, messages=messages, chat=True)
            return self._completion_ids(req.prompt)
        except Eagle3Error as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt",
                           code="invalid_value") from None

    def _completion_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.prompt_tokenizer, prompt=prompt, chat=False)
        if prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a batch of {len(prompt)} strings; this server "
                                    "takes one prompt per request", param="prompt",
                               code="unsupported_value")
            return encode_prompt(self.prompt_tokenizer, prompt=prompt[0], chat=False)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                                f"[0, {self.vocab_size})", param="prompt", code="invalid_value")
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        return list(prompt)

    def params(self, req, prompt_len: int, chat: bool):
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                f"{limit} tokens (prompt + max_tokens)",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        max_new = requested_max_tokens(req) or limit - prompt_len
        try:
            self.engine.check_length(prompt_len, max_new)
            return sampling_params(req, max_new)
        except Eagle3Error as e:
            raise APIError(400, str(e), param="max_tokens", code="invalid_value") from None

    def submit(self, prompt_ids: list[int], params, learn: bool = True) -> Job:
        job = Job(prompt_ids, params, asyncio.get_running_loop(), learn=learn)
        try:
            self.worker.submit(job)
        except QueueFull:
            wait = self.worker.retry_after_s()
            raise APIError(503, f"the server is busy ({self.worker.max_queue} requests queued); "
                                f"retry in {wait} s", type="server_error", code="queue_full",
                           headers={"Retry-After": str(wait)}) from None
        return job

    # ------------------------------------------------------------------ endpoints
    async def handle(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            self.check_auth(request)
            self.check_content_type(request)
            body = await self.read_body(request)
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            self.check_model(req.model)
            prompt_ids = await self.tokenize(req, chat)
            job = self.submit(prompt_ids, self.params(req, len(prompt_ids), chat), req.learn)
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            raise
        gen = Generation(self, job, req, chat, endpoint)
        if req.stream:
            return EventStream(gen.sse(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await gen.collect(request))


def learn_first_policy(engine):
    """For a target served without a draft: the adaptive policy over a first learned draft's
    costs (api.adaptive_policy), made when that draft arrives. None for an engine with a draft."""
    if engine.draft is not None or engine.policy_factory is None:
        return None
    from ..api import adaptive_policy
    return lambda layout: adaptive_policy(engine.target, layout)


def parse_content_type(header: str) -> tuple[str, str]:
    """'application/json; charset=UTF-8' -> ('application/json', 'utf-8'); no charset = utf-8."""
    media, *params = header.split(";")
    charset = "utf-8"
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    return media.strip().lower(), charset


def prefix_cache_state(scheduler, tokens: int) -> str:
    """What --prefix-cache-tokens gave, in words (it is off where copied rows would not be exact)."""
    if scheduler.prefixes is not None:
        return f"up to {tokens} prompt tokens"
    if tokens == 0:
        return "off (--prefix-cache-tokens 0)"
    return ("off: this layout is not row-stable, so a copied k/v row would not equal the row a "
            "prefill writes (every --weights but fp32 builds a row-stable target)")


# ---------------------------------------------------------------------------- wiring
def add_routes(app: FastAPI, server: Server) -> None:
    page = resources.files("eagle3.serve").joinpath("static/index.html").read_text("utf-8")

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(server.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.check_auth(request)
        card = {"id": server.model_name, "object": "model", "created": server.created,
                "owned_by": "eagle3", "max_model_len": server.engine.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        server.check_auth(request)
        return JSONResponse({"reset": server.worker.reset_prefix_cache()})


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", None, code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error", None, "invalid_value"),
                            status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error",
                                       None, "internal_error"), status_code=500)


def measure_draft(engine, scheduler) -> None:
    """The server judges its draft early: its first DRAFT_MEASURE_STEPS own steps come densely
    (policy.draft_interval), solo and in the batch, so /health and `eagle3 doctor --server` see a
    broken draft within a few hundred steps even where the adaptive step would not ask it; then
    at least every DRAFT_PROBE_EVERY steps, so a draft lost mid-run is seen too."""
    if getattr(engine, "draft", None) is None:
        return
    for policy in getattr(engine, "policies", {}).values():
        policy.measure_steps, policy.draft_probe_every = DRAFT_MEASURE_STEPS, DRAFT_PROBE_EVERY
    if isinstance(scheduler, BatchScheduler):
        scheduler.draft_measure = DRAFT_MEASURE_STEPS
