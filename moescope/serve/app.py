"""The FastAPI application: OpenAI's completions and chat completions (whole or streamed), models, health.

Handlers never touch the engine: they validate (``protocol``), offer a ``Job`` to the ``EngineLoop`` (429 with
``Retry-After`` when the admission queue is full) and await its ``TokenStream``. A client that goes away
cancels its request: a stream's response is wrapped so that however it ends (finished, disconnected,
cancelled by the server's shutdown) an unfinished request is cancelled; a whole response races the tokens
against the connection's ``http.disconnect``. Every error is an ``APIError`` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import moescope
from moescope.runtime import tokenizer
from moescope.serve import ids, protocol, responses, routed_experts
from moescope.serve.openai_errors import APIError, http_error
from moescope.serve.loop import EngineLoop, Job, now
from moescope.serve.metrics import ServeMetrics
from moescope.serve.text import FINISH_REASONS, TextAssembler, whole_text

log = logging.getLogger("moescope.serve")


@dataclass
class Service:
    """What the handlers share: the engine loop, the served model's limits, and whether we are draining."""

    loop: EngineLoop
    limits: protocol.ModelLimits
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
    debug: bool = False  # --debug-endpoints: POST /debug/kill-engine and /debug/poison (fault injection)
    metrics: ServeMetrics | None = None  # GET /metrics (create_app makes it)
    routed: routed_experts.RoutedExperts | None = None  # return_routed_experts (create_app attaches it)
    distribution: routed_experts.DistributionRecorder | None = None  # the expert-distribution endpoints


NO_RETRY = {"x-should-retry": "false"}  # the openai SDKs honour it: a retry of the same request cannot succeed


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    final = 400 <= exc.status < 500 and exc.status not in (408, 409, 429)  # the client's own request is at fault
    return JSONResponse(exc.body(), status_code=exc.status,
                        headers={**(headers or {}), **(NO_RETRY if final else {}), **exc.headers})


def _ended_error(record) -> APIError:
    """The answer for a request that ended without finishing (timeout, cancelled by shutdown or a failure)."""
    if record is not None and record.finish_reason == "timeout":
        return APIError(408, f"the request timed out after {record.total_s:.1f}s ({record.n_output} tokens made; "
                        "stored with finish_reason 'timeout')", type="timeout_error", code="request_timeout")
    if record is not None and record.finish_reason == "error":  # retrying the same request cannot help
        return APIError(500, "the engine failed on this request (stored with finish_reason 'error'; GET /health "
                        "says whether the engine still serves)", type="server_error", code="engine_error",
                        headers={"x-should-retry": "false"})
    return APIError(503, "the request was cancelled: the server is shutting down or the engine failed",
                    type="service_unavailable", code="cancelled")


async def read_body(request: Request) -> bytes:
    """The body, refused past ``protocol.MAX_BODY_BYTES`` without reading the rest."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > protocol.MAX_BODY_BYTES:
            raise APIError(413, f"request body is larger than {protocol.MAX_BODY_BYTES} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _JobResponse(StreamingResponse):
    """A streamed response that cancels its request if the request has not ended when the response does."""

    def __init__(self, content, *, job: Job, loop: EngineLoop, headers: dict[str, str], routed=None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        self._job, self._loop, self._routed = job, loop, routed

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._job.stream.ended:
                self._loop.cancel(self._job)
            if self._routed is not None:
                self._routed.forget(self._job.request_id)


async def _events(service: Service, job: Job, created: int, routed_from: int | None = None):
    """The event stream: one chunk per generated token, sent when the handler sees it. A token's chunk carries
    the text that token completes (empty while a character's bytes, or a held-back stop string, are incomplete:
    vLLM sends such chunks too); the last token's chunk carries the finish reason and whatever was held. When the
    handler falls behind the engine (many streams on a busy machine) the tokens of several steps reach it
    together: they still go out as one chunk each, never merged. A chat stream's first chunk also carries the
    role."""
    kind, p, model = job.params.kind, job.params, job.params.model or service.limits.name
    asm = TextAssembler(p.stop)
    first = kind == "chat"  # the role chunk goes with the first token (after admission), as vLLM sends it

    def event(text: str, finish: str | None = None) -> dict:
        nonlocal first
        doc = responses.chunk(kind, job.request_id, created, model, text, finish, first=first)
        first = False
        return doc

    while True:
        tokens, record = await job.stream.next()
        last = tokens[-1:] if record is not None else []  # the final token goes out with the finish reason
        for t in tokens[:len(tokens) - len(last)]:
            yield responses.sse(event(asm.feed(t)))
        if record is None and not job.stream.failed:
            continue
        if record is None or record.finish_reason not in FINISH_REASONS:
            yield responses.sse(_ended_error(record).body())  # mid-stream errors: an error event, then [DONE]
        else:
            text = "".join(asm.feed(t) for t in last) + asm.finish(record.finish_reason)
            if first:  # a chat answer that ended at its first chunk: the role first, alone, as before
                yield responses.sse(event(""))
            doc = event(text, FINISH_REASONS[record.finish_reason])
            _add_routed(service, job, doc, routed_from)
            yield responses.sse(doc)
            if p.include_usage:
                yield responses.sse(responses.chunk(kind, job.request_id, created, model, record=record))
        yield responses.sse("[DONE]")
        return


def _add_routed(service: Service, job: Job, doc: dict, routed_from: int | None) -> None:
    """The request's routed experts in its choice's ``sgl_ext`` (SGLang's place), when it asked."""
    if routed_from is not None:
        ext = service.routed.take(job.request_id, routed_from)
        if ext is not None:
            doc["choices"][0]["sgl_ext"] = ext


async def _whole(service: Service, job: Job, request: Request, created: int, headers: dict[str, str],
                 routed_from: int | None = None) -> Response:
    done = asyncio.ensure_future(job.stream.done())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not done.done()
        if left:  # the client went away (or this handler is being cancelled)
            done.cancel()
            service.loop.cancel(job)
    if left:  # nobody is there to read an answer (499: nginx's "client closed request")
        return Response(status_code=499, headers=headers)
    record = done.result()
    if record is None or record.finish_reason not in FINISH_REASONS:
        return _error(_ended_error(record), headers)
    text = whole_text(record.output_tokens, job.params.stop, record.finish_reason)
    doc = responses.body(job.params.kind, job.request_id, created, job.params.model or service.limits.name, text,
                         FINISH_REASONS[record.finish_reason], record)
    _add_routed(service, job, doc, routed_from)
    return JSONResponse(doc, headers=headers)


async def _handle(service: Service, request: Request, parse) -> Response:
    rid = ids.request_id(request.headers.get("x-request-id"))
    headers = {"x-request-id": rid}
    try:
        if service.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        body = protocol.decode_json(await read_body(request))
        params = parse(body, service.limits)
        routed_from = routed_experts.wanted(body)
        # An id already in flight: this request gets a distinct store key (echoed in the header and the body).
        # No await between this check and the offer: no other handler can take the key meanwhile.
        for _ in range(8):
            if not service.loop.holds(rid):
                break
            rid = ids.distinct(rid)
        headers = {"x-request-id": rid}
        job = Job(rid, params, now())
        if routed_from is not None:  # before the engine can see the job: its prefill is recorded too
            service.routed.watch(job.request_id)
        offered = service.loop.offer(job)
        if offered != "ok" and routed_from is not None:
            service.routed.forget(job.request_id)
        if offered == "full":
            wait = service.loop.retry_after_s()
            raise APIError(429, f"the server's queue is full ({service.loop.admission.capacity} waiting); retry "
                           f"in {wait}s", type="rate_limit_error", code="queue_full",
                           headers={"retry-after": str(wait)})
        if offered == "unhealthy":
            raise APIError(503, f"the engine cannot serve: {service.loop.unhealthy}", type="service_unavailable",
                           code="engine_unhealthy")
        if offered == "duplicate":
            raise APIError(409, f"a request with id {rid!r} (x-request-id) is already in flight",
                           param="x-request-id", code="duplicate_request_id")
    except APIError as exc:
        service.metrics.rejected(exc.status)
        return _error(exc, headers)
    service.metrics.admitted(job)
    created = int(time.time())
    if params.stream:
        return _JobResponse(_events(service, job, created, routed_from), job=job, loop=service.loop, headers=headers,
                            routed=service.routed if routed_from is not None else None)
    try:
        return await _whole(service, job, request, created, headers, routed_from)
    finally:
        if routed_from is not None:
            service.routed.forget(job.request_id)


def _defaults(service: Service) -> None:
    """The parts a ``Service`` was not given: its serving metrics, the routed-experts observer, the expert
    distribution recorder (None without the metrics state)."""
    engine = service.loop.engine
    if service.metrics is None:
        ranks = service.loop.ranks  # an expert-parallel rank labels its serving series with its rank
        service.metrics = ServeMetrics(service.limits.name, service.loop, rank=ranks.rank if ranks is not None else 0)
    if service.routed is None:
        service.routed = routed_experts.RoutedExperts.attach(engine)
    if service.distribution is None:
        state = routed_experts.metrics_state(engine)
        service.distribution = state and routed_experts.DistributionRecorder(state, engine.model.cfg.n_layers)


def create_app(service: Service) -> FastAPI:
    """The application; its lifespan starts the engine loop on the running event loop."""
    _defaults(service)

    async def lifespan(app):
        service.loop.start(service.metrics.waker(asyncio.get_running_loop()))
        yield

    app = FastAPI(title="moescope serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return _error(http_error(exc.status_code, str(exc.detail)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(service, request, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(service, request, protocol.parse_chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": service.started,
                                            "owned_by": "moescope", "root": service.limits.name,
                                            "max_model_len": service.limits.max_seq_len}
                                           for name in service.limits.names]}

    @app.get("/version")
    async def version():
        return {"version": moescope.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        tokens, strs = protocol.parse_tokenize(protocol.decode_json(await read_body(request)), service.limits)
        out = {"count": len(tokens), "max_model_len": service.limits.max_seq_len, "tokens": tokens}
        return {**out, "token_strs": [tokenizer.token_text(t) for t in tokens]} if strs else out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = protocol.parse_detokenize(protocol.decode_json(await read_body(request)), service.limits)
        return {"prompt": tokenizer.decode(tokens)}

    _health_routes(app, service)
    if service.debug:
        _debug_routes(app, service)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, kind = service.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=kind)

    _distribution_routes(app, service)
    return app


def _health_routes(app: FastAPI, service: Service) -> None:
    """/health (liveness) and /ready (readiness), one document."""

    def _state() -> tuple[dict, str | None]:
        loop = service.loop
        why = loop.unhealthy or (None if loop.alive else "the engine thread is not running")
        doc = {"status": "unhealthy" if why else "draining" if service.draining else "ok", "model": service.limits.name,
               "running": loop.running, "queued": len(loop.admission), "max_batch": loop.engine.max_batch,
               "max_queue": loop.admission.capacity, "rejected": loop.admission.rejected, "served": loop.served,
               "step_errors": loop.step_errors, "failed_requests": loop.failed_requests,
               "peer_failed_steps": loop.peer_failed_steps}
        if why:
            doc["reason"] = why
        return doc, why

    @app.get("/health")
    async def health():
        """Liveness: 503 only when the engine cannot serve (its thread died, or steps keep failing)."""
        doc, why = _state()
        return JSONResponse(doc, status_code=503 if why else 200)

    @app.get("/ready")
    async def ready():
        """Readiness: 503 also while draining (SIGTERM), so a load balancer stops sending new requests."""
        doc, why = _state()
        return JSONResponse(doc, status_code=503 if why or service.draining else 200)


def _debug_routes(app: FastAPI, service: Service) -> None:
    """Fault injection (``--debug-endpoints``): end the engine thread; poison a request id."""

    @app.post("/debug/kill-engine")
    async def kill_engine():
        service.loop.kill()
        return {"killed": True}

    @app.post("/debug/poison")
    async def poison(request: Request):
        body = protocol.decode_json(await read_body(request))
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "request_id: a request id (string) to poison", param="request_id",
                           code="invalid_value")
        service.loop.engine.poison.add(rid)
        return {"poisoned": rid}


def _distribution_routes(app: FastAPI, service: Service) -> None:
    """SGLang's expert distribution recorder endpoints (start, stop, dump)."""

    def _distribution() -> routed_experts.DistributionRecorder:
        if service.distribution is None:
            raise APIError(503, "expert distribution recording needs the metrics state (this engine has none)",
                           type="service_unavailable", code="unavailable")
        return service.distribution

    @app.post("/start_expert_distribution_record")
    async def start_expert_distribution_record():
        await asyncio.to_thread(_distribution().start)  # a probe flush: never on the event loop
        return {"message": "Start recording the expert distribution"}

    @app.post("/stop_expert_distribution_record")
    async def stop_expert_distribution_record():
        await asyncio.to_thread(_distribution().stop)
        return {"message": "Stop recording the expert distribution"}

    @app.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record():
        return await asyncio.to_thread(_distribution().dump)
