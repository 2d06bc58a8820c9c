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

from moescope.runtime import tokenizer
from moescope.serve import ids, protocol, responses
from moescope.serve.errors import APIError, http_error
from moescope.serve.loop import EngineLoop, Job, asyncio_waker, now
from moescope.serve.text import FINISH_REASONS, TextAssembler, whole_text

log = logging.getLogger("moescope.serve")


@dataclass
class Service:
    """What the handlers share: the engine loop, the served model's limits, and whether we are draining."""

    loop: EngineLoop
    limits: protocol.ModelLimits
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish


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
    return APIError(503, "the request was cancelled: the server is shutting down or the engine failed",
                    type="service_unavailable", code="cancelled")


async def _read_body(request: Request) -> bytes:
    """The body, refused past ``protocol.MAX_BODY_BYTES`` without reading the rest."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > protocol.MAX_BODY_BYTES:
            raise APIError(413, f"request body is larger than {protocol.MAX_BODY_BYTES} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _JobResponse(StreamingResponse):
    """A streamed response that cancels its request if the request has not ended when the response does."""

    def __init__(self, content, *, job: Job, loop: EngineLoop, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        self._job, self._loop = job, loop

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._job.stream.ended:
                self._loop.cancel(self._job)


async def _events(service: Service, job: Job, created: int):
    kind, p, model = job.params.kind, job.params, job.params.model or service.limits.name
    asm = TextAssembler(p.stop)
    first = kind == "chat"  # the role chunk goes with the first token (after admission), as vLLM sends it
    while True:
        tokens, record = await job.stream.next()
        text = "".join(asm.feed(t) for t in tokens)
        if first and (tokens or record is not None):
            first = False
            yield responses.sse(responses.chunk(kind, job.request_id, created, model, text, first=True))
            text = ""
        if record is None and not job.stream.failed:
            if text:
                yield responses.sse(responses.chunk(kind, job.request_id, created, model, text))
            continue
        if record is None or record.finish_reason not in FINISH_REASONS:
            yield responses.sse(_ended_error(record).body())  # mid-stream errors: an error event, then [DONE]
        else:
            text += asm.finish(record.finish_reason)
            yield responses.sse(responses.chunk(kind, job.request_id, created, model, text,
                                                FINISH_REASONS[record.finish_reason]))
            if p.include_usage:
                yield responses.sse(responses.chunk(kind, job.request_id, created, model, record=record))
        yield responses.sse("[DONE]")
        return


async def _whole(service: Service, job: Job, request: Request, created: int, headers: dict[str, str]) -> Response:
    done = asyncio.ensure_future(job.stream.done())
    gone = asyncio.ensure_future(_disconnected(request))
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
    return JSONResponse(responses.body(job.params.kind, job.request_id, created, job.params.model, text,
                                       FINISH_REASONS[record.finish_reason], record), headers=headers)


async def _handle(service: Service, request: Request, parse) -> Response:
    rid = ids.request_id(request.headers.get("x-request-id"))
    headers = {"x-request-id": rid}
    try:
        if service.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        params = parse(protocol.decode_json(await _read_body(request)), service.limits)
        job = Job(rid, params, now())
        offered = service.loop.offer(job)
        for _ in range(8):  # an id already in flight: this request gets a distinct store key (echoed)
            if offered != "duplicate":
                break
            job = Job(ids.distinct(rid), params, job.arrival)
            offered = service.loop.offer(job)
        headers = {"x-request-id": job.request_id}
        if offered == "full":
            wait = service.loop.retry_after_s()
            raise APIError(429, f"the server's queue is full ({service.loop.admission.capacity} waiting); retry "
                           f"in {wait}s", type="rate_limit_error", code="queue_full",
                           headers={"retry-after": str(wait)})
        if offered == "duplicate":
            raise APIError(409, f"a request with id {rid!r} (x-request-id) is already in flight",
                           param="x-request-id", code="duplicate_request_id")
    except APIError as exc:
        return _error(exc, headers)
    created = int(time.time())
    if params.stream:
        return _JobResponse(_events(service, job, created), job=job, loop=service.loop, headers=headers)
    return await _whole(service, job, request, created, headers)


def create_app(service: Service) -> FastAPI:
    """The application; its lifespan starts the engine loop on the running event loop."""

    async def lifespan(app):
        service.loop.start(asyncio_waker(asyncio.get_running_loop()))
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
        import moescope

        return {"version": moescope.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        tokens, strs = protocol.parse_tokenize(protocol.decode_json(await _read_body(request)), service.limits)
        out = {"count": len(tokens), "max_model_len": service.limits.max_seq_len, "tokens": tokens}
        return {**out, "token_strs": [tokenizer.token_text(t) for t in tokens]} if strs else out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = protocol.parse_detokenize(protocol.decode_json(await _read_body(request)), service.limits)
        return {"prompt": tokenizer.decode(tokens)}

    @app.get("/health")
    async def health():
        loop = service.loop
        doc = {"status": "draining" if service.draining else "ok", "model": service.limits.name,
               "running": loop.running, "queued": len(loop.admission), "max_batch": loop.engine.max_batch,
               "max_queue": loop.admission.capacity, "rejected": loop.admission.rejected, "served": loop.served,
               "step_errors": loop.step_errors}
        return JSONResponse(doc, status_code=503 if service.draining else 200)

    return app
