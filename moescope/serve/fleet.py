"""The front end of ``moescope serve --world-size N``: one OpenAI-compatible HTTP endpoint over N expert-parallel
ranks (data-parallel attention: each rank serves the requests dealt to it; the experts are sharded over all).

Transport: each rank runs the single-process server (``serve.app`` over its own ``EngineLoop``, stepping in
rank mode: ``serve/loop.py``) on a loopback port of its own, and writes its address to the launcher's run
directory; the front end, in the launcher's process, forwards each request over HTTP/1.1 to one rank and
streams the answer back as the rank writes it (``x-moescope-rank`` says which rank answered). Why HTTP on
loopback rather than requests broadcast and tokens gathered on the ranks' per-step exchange: every rule the
single-process server has (validation, the admission bound and 429, timeouts, cancellation on disconnect, a
failing request ending alone, the trace id) holds per rank unchanged, because it is the same code; the
exchange stays what the experts need (no request text or tokens on it, no step waits on a client); and a
slow client costs the front end a socket, never a step. The price is a loopback hop per request (well under a
millisecond beside a decode step).

Dealing rule: least outstanding. A request goes to the rank with the fewest requests in flight through this
front end; ties go round-robin (a rotating start), so sequential requests alternate over the ranks. (A slow rank
is not dealt fewer: every exchange waits for it, so every rank is as slow.) A rank that refuses the connection or
answers 503 before admitting (``engine_unhealthy``, ``shutting_down``) leaves the rotation and the request goes
to another rank; it comes back once its ``/health`` answers 200 (asked every ``RECHECK_S``). A client that goes
away cancels its request on the rank (the front end closes that connection, which the rank's server sees); a
rank lost mid-stream ends the client's event stream with an error event and ``[DONE]``. ``x-request-id`` is
unique across the ranks: the front end refuses an id in flight on any (409).

Metrics: the front end's ``/metrics`` is one scrape for the fleet's serving: its own series per rank (dealt,
outstanding, in rotation, whether the rank's metrics were read) and every rank's serving series (each rank's
``/metrics``, read at scrape time; they carry their rank label, so the families merge without collision). The
engine's metrics (routing, all-to-all) stay on ``--metrics-port`` + rank, one target per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moescope.metrics import catalogue
from moescope.serve.app import disconnected, read_body
from moescope.serve.openai_errors import APIError
from moescope.serve.responses import sse

log = logging.getLogger("moescope.serve")

RANK_HEADER = "x-moescope-rank"
HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection"}
HOP_OUT = HOP | {"date", "server"}  # uvicorn writes its own
HEALTH_TIMEOUT_S = 5.0
RECHECK_S = 1.0  # how often the /health of a rank out of rotation is asked again
REFUSED = {"engine_unhealthy", "shutting_down"}  # a rank's 503 codes that come before admission
TEXT = "text/plain; version=0.0.4; charset=utf-8"
FLEET_SERIES = ("moescope_fleet_requests_dealt_total", "moescope_fleet_requests_outstanding",
                "moescope_fleet_rank_in_rotation", "moescope_fleet_rank_metrics_up")


def _headers_out(upstream: httpx.Response, rank: int) -> dict[str, str]:
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_OUT}
    out[RANK_HEADER] = str(rank)
    return out


def address_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes the URL of its own server."""
    return Path(run_dir) / f"rank{rank}.addr"


class Fleet:
    """The ranks behind the front end: their addresses, what is in flight on each, the dealing rule, and which
    ranks are out of rotation (they refused a request as unhealthy, or refused the connection)."""

    def __init__(self, world_size: int, run_dir: Path, model: str = "") -> None:
        self.world = world_size
        self.model = model  # the model label of the front end's own series (the ranks' serving series carry theirs)
        self.run_dir = Path(run_dir)
        self.urls: list[str | None] = [None] * world_size
        self.outstanding = [0] * world_size  # requests forwarded and not yet answered in full
        self.dealt = [0] * world_size  # requests forwarded, ever
        self.in_flight: set[str] = set()  # x-request-ids in flight through the front end (unique across ranks)
        self.benched: dict[int, str] = {}  # rank -> why it is out of rotation (until its /health answers 200)
        self._turn = 0  # the rotating start of the tie-break
        self.client: httpx.AsyncClient | None = None

    def discover(self) -> list[str | None]:
        """Read the address files of ranks not seen yet."""
        for r, url in enumerate(self.urls):
            if url is None:
                try:
                    self.urls[r] = address_file(self.run_dir, r).read_text().strip() or None
                except OSError:
                    pass
        return self.urls

    def pick(self, skip: set[int] = frozenset()) -> int | None:
        """The rank the next request goes to (None: no rank in rotation has an address yet)."""
        ready = [r for r, url in enumerate(self.discover())
                 if url is not None and r not in self.benched and r not in skip]
        if not ready:
            return None
        order = sorted(ready, key=lambda r: (self.outstanding[r], (r - self._turn) % self.world))
        self._turn = (order[0] + 1) % self.world
        return order[0]

    def bench(self, rank: int, why: str) -> None:
        if rank not in self.benched:
            log.warning("rank %d out of rotation: %s (back when its /health answers 200)", rank, why)
        self.benched[rank] = why

    async def recheck(self) -> None:
        """Put back in rotation the benched ranks whose /health now answers 200."""
        for r in list(self.benched):
            try:
                ok = (await self.client.get(self.urls[r] + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                log.warning("rank %d back in rotation", r)
                self.benched.pop(r, None)


def fleet_exposition(fleet: Fleet, texts: list[str | None]) -> bytes:
    """The text exposition of the front end's own series (catalogue ``moescope_fleet_*``, per rank) and of the
    ranks' own ``texts`` (None: not read), their families merged by name."""
    # optional: prometheus_client (the metrics extra)
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.parser import text_string_to_metric_families

    spec = catalogue.BY_NAME
    own = {name: (CounterMetricFamily if spec[name].kind == "counter" else GaugeMetricFamily)(
        spec[name].family, spec[name].help, labels=list(spec[name].all_labels)) for name in FLEET_SERIES}
    merged: dict[str, object] = {}
    for r, text in enumerate(texts):
        base = [fleet.model, str(r)]
        for name, value in zip(FLEET_SERIES, (fleet.dealt[r], fleet.outstanding[r], r not in fleet.benched,
                                              text is not None)):
            own[name].add_metric(base, float(value))
        for family in text_string_to_metric_families(text or ""):
            have = merged.setdefault(family.name, family)
            if have is not family:
                have.samples.extend(family.samples)

    class Families:
        def collect(self):
            yield from own.values()
            yield from merged.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _unavailable(why: str) -> JSONResponse:
    return _error(APIError(503, why, type="service_unavailable", code="rank_unavailable",
                           headers={"retry-after": "1"}))


class _Relay(StreamingResponse):
    """A rank's answer streamed through; ``release`` runs however the response ends (done, client gone, error)."""

    def __init__(self, content, *, status_code: int, headers: dict[str, str], release) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._release, self._after = release, []

    def also(self, fn) -> None:
        """Run ``fn`` too when the response ends."""
        self._after.append(fn)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for fn in self._after:
                fn()
            await self._release()


async def _relay(upstream: httpx.Response, rank: int, event_stream: bool):
    """The rank's bytes as they come; a rank gone mid-stream ends an event stream with an error event and [DONE]
    (a whole answer is cut short: the client sees a truncated body)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("rank %d stopped answering mid-response (%r)", rank, exc)
        if event_stream:
            err = APIError(503, f"rank {rank} stopped answering mid-response ({type(exc).__name__})",
                           type="service_unavailable", code="rank_unavailable")
            yield sse(err.body())
            yield sse("[DONE]")


def _refusal(upstream: httpx.Response, body: bytes) -> str | None:
    """Why a rank's 503 came before admission (the rank is unhealthy or shutting down: take it out of rotation
    and try another), or None."""
    if upstream.status_code != 503:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if code in REFUSED else None


class _FrontEnd:
    """The front end's handlers over one ``Fleet``: deal each request to a rank (least outstanding first), relay
    its answer; gather /health, /ready and /metrics from every rank."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.fleet.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

        async def rechecks() -> None:
            while True:
                await asyncio.sleep(RECHECK_S)
                await self.fleet.recheck()

        task = asyncio.ensure_future(rechecks())
        try:
            yield
        finally:
            task.cancel()
            await self.fleet.client.aclose()

    async def send_to(self, rank: int, request: Request, body: bytes) -> httpx.Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP | {"content-length"}]
        url = self.fleet.urls[rank] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        client = self.fleet.client
        return await client.send(client.build_request(request.method, url, headers=headers, content=body), stream=True)

    async def forward(self, request: Request) -> Response:
        """Deal the request to a rank and relay its answer. A rank that refuses the connection or answers 503
        before admitting (unhealthy, shutting down) leaves rotation and the request goes to another; a client that
        goes away before the answer starts cancels it on the rank (the connection to the rank is closed)."""
        rid = request.headers.get("x-request-id")
        if rid is not None and rid in self.fleet.in_flight:  # a rank sees only its own: the front end sees all
            return _error(APIError(409, f"a request with id {rid!r} (x-request-id) is already in flight",
                                   param="x-request-id", code="duplicate_request_id"))
        if rid is not None:
            self.fleet.in_flight.add(rid)  # (no await since the check: a second request with it is refused)
        response = None
        try:
            try:
                body = await read_body(request)
            except APIError as exc:
                return _error(exc)
            response = await self.deal(request, body)
        finally:
            if rid is not None and isinstance(response, _Relay):  # in flight until the relayed answer ends
                response.also(lambda: self.fleet.in_flight.discard(rid))
            elif rid is not None:
                self.fleet.in_flight.discard(rid)
        return response

    async def deal(self, request: Request, body: bytes) -> Response:
        tried: set[int] = set()
        while True:
            rank = self.fleet.pick(tried)
            if rank is None:
                return _unavailable("no rank is ready (starting, unhealthy or shutting down): retry shortly"
                                    + (f"; tried rank(s) {sorted(tried)}" if tried else ""))
            tried.add(rank)
            self.fleet.outstanding[rank] += 1
            self.fleet.dealt[rank] += 1
            released = False

            async def release(rank=rank, upstream=None) -> None:
                nonlocal released
                if not released:
                    released = True
                    self.fleet.outstanding[rank] -= 1
                if upstream is not None:
                    await upstream.aclose()

            sending = asyncio.ensure_future(self.send_to(rank, request, body))
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not sending.done():  # the client went away (or this handler is cancelled): close it upstream
                    sending.cancel()
                    await asyncio.gather(sending, return_exceptions=True)
                    await release()
            if sending.cancelled():
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
            try:
                upstream = sending.result()
            except httpx.ConnectError as exc:  # never reached the rank: another may take it
                await release()
                self.fleet.bench(rank, f"connection refused ({type(exc).__name__})")
                continue
            except httpx.HTTPError as exc:
                await release()
                return _unavailable(f"rank {rank} is not answering ({type(exc).__name__})")
            if upstream.status_code == 503:
                try:
                    head = await upstream.aread()
                except httpx.HTTPError:
                    head = b""
                why = _refusal(upstream, head)
                if why is not None:  # refused before admission: out of rotation, try another rank
                    await release(upstream=upstream)
                    self.fleet.bench(rank, why)
                    continue
                await release(upstream=upstream)
                return Response(head, status_code=503, headers=_headers_out(upstream, rank))
            out = _headers_out(upstream, rank)
            event_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
            return _Relay(_relay(upstream, rank, event_stream), status_code=upstream.status_code, headers=out,
                          release=lambda rank=rank, upstream=upstream: release(rank, upstream))

    async def any_rank(self, request: Request) -> Response:
        """Answers every rank gives alike (models, version): the first rank with an address."""
        urls = [u for u in self.fleet.discover() if u is not None]
        if not urls:
            return _unavailable("the ranks are starting: retry shortly")
        try:
            r = await self.fleet.client.get(urls[0] + request.url.path, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return _unavailable(f"no rank is answering ({type(exc).__name__})")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def rank_health(self, r: int, path: str) -> tuple[int, dict]:
        fleet = self.fleet
        url = fleet.urls[r]
        mine = {"outstanding": fleet.outstanding[r], "dealt": fleet.dealt[r], "in_rotation": r not in fleet.benched}
        if url is None:
            return 503, {"rank": r, "status": "starting", **mine}
        try:
            got = await self.fleet.client.get(url + path, timeout=HEALTH_TIMEOUT_S)
            body = got.json()
        except (httpx.HTTPError, ValueError) as exc:
            return 503, {"rank": r, "status": "unreachable", "error": type(exc).__name__, **mine}
        if not isinstance(body, dict):
            body = {"body": body}
        return got.status_code, {"rank": r, "status": "unknown", **body, **mine}

    async def health(self, request: Request) -> Response:
        """/health and /ready: every rank's own, 200 when all ranks answer 200."""
        self.fleet.discover()
        answers = await asyncio.gather(*(self.rank_health(r, request.url.path) for r in range(self.fleet.world)))
        ok = all(code == 200 for code, _ in answers)
        status = "ok" if ok else next(b["status"] for code, b in answers if code != 200)
        return JSONResponse({"status": status, "world_size": self.fleet.world, "dealing": "least-outstanding",
                             "ranks": [b for _, b in answers], "time": time.time()}, status_code=200 if ok else 503)

    async def debug(self, request: Request) -> Response:
        """Fault injection (``--debug-endpoints``): to every rank (a request id is poisoned wherever it runs), or
        to the one rank ``?rank=R`` names."""
        body = await request.body()
        only = request.query_params.get("rank")
        answers = []
        for r, url in enumerate(self.fleet.discover()):
            if url is not None and (only is None or only == str(r)):
                r = await self.fleet.client.post(url + request.url.path, content=body,
                                            headers={"content-type": "application/json"})
                answers.append(r.json() if r.headers.get("content-type", "").startswith("application/json")
                               else r.text)
        return JSONResponse({"ranks": answers})

    async def rank_metrics(self, r: int, url: str | None) -> str | None:
        if url is None:
            return None
        try:
            got = await self.fleet.client.get(url + "/metrics", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return got.text if got.status_code == 200 else None

    async def metrics(self, request: Request) -> Response:
        """The front end's series and every rank's serving series, in one exposition (module doc)."""
        texts = await asyncio.gather(*(self.rank_metrics(r, u) for r, u in enumerate(self.fleet.discover())))
        return Response(fleet_exposition(self.fleet, texts), media_type=TEXT)


async def _not_found(request: Request, exc) -> Response:
    return _error(APIError(404, f"no route {request.method} {request.url.path}", type="not_found_error",
                           code="not_found"))


def create_app(fleet: Fleet, *, debug: bool = False) -> Starlette:
    h = _FrontEnd(fleet)
    routes = [Route(p, h.forward, methods=["POST"]) for p in
              ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")]
    routes += [Route(p, h.any_rank, methods=["GET"]) for p in ("/v1/models", "/version")]
    routes += [Route("/health", h.health, methods=["GET"]), Route("/ready", h.health, methods=["GET"]),
               Route("/metrics", h.metrics, methods=["GET"])]
    if debug:
        routes.append(Route("/debug/{what}", h.debug, methods=["POST"]))
    return Starlette(routes=routes, lifespan=h.lifespan, exception_handlers={404: _not_found})
