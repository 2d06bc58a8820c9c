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
front end; ties go round-robin (a rotating start), so sequential requests alternate over the ranks and a rank
that answers slowly (the slow-rank fault) is dealt fewer. ``x-request-id`` duplicates are refused per rank (a
request id in flight on another rank is not seen there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moescope.serve.errors import APIError

RANK_HEADER = "x-moescope-rank"
HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection"}
HOP_OUT = HOP | {"date", "server"}  # uvicorn writes its own
HEALTH_TIMEOUT_S = 5.0


def address_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes the URL of its own server."""
    return Path(run_dir) / f"rank{rank}.addr"


class Fleet:
    """The ranks behind the front end: their addresses, what is in flight on each, the dealing rule."""

    def __init__(self, world_size: int, run_dir: Path) -> None:
        self.world = world_size
        self.run_dir = Path(run_dir)
        self.urls: list[str | None] = [None] * world_size
        self.outstanding = [0] * world_size  # requests forwarded and not yet answered in full
        self.dealt = [0] * world_size  # requests forwarded, ever
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

    def pick(self) -> int | None:
        """The rank the next request goes to (None: no rank has an address yet)."""
        ready = [r for r, url in enumerate(self.discover()) if url is not None]
        if not ready:
            return None
        order = sorted(ready, key=lambda r: (self.outstanding[r], (r - self._turn) % self.world))
        self._turn = (order[0] + 1) % self.world
        return order[0]


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _unavailable(why: str) -> JSONResponse:
    return _error(APIError(503, why, type="service_unavailable", code="rank_unavailable",
                           headers={"retry-after": "1"}))


def create_app(fleet: Fleet) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        fleet.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            yield
        finally:
            await fleet.client.aclose()

    async def forward(request: Request) -> Response:
        rank = fleet.pick()
        if rank is None:
            return _unavailable("the ranks are starting: retry shortly")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        url = fleet.urls[rank] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        fleet.outstanding[rank] += 1
        fleet.dealt[rank] += 1
        try:
            upstream = await fleet.client.send(
                fleet.client.build_request(request.method, url, headers=headers, content=request.stream()),
                stream=True)
        except httpx.HTTPError as exc:
            fleet.outstanding[rank] -= 1
            return _unavailable(f"rank {rank} is not answering ({type(exc).__name__}): the server may be shutting "
                                "down")

        async def done() -> None:
            fleet.outstanding[rank] -= 1
            await upstream.aclose()

        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_OUT}
        out[RANK_HEADER] = str(rank)
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out,
                                 background=BackgroundTask(done))

    async def any_rank(request: Request) -> Response:
        """Answers every rank gives alike (models, version): the first rank with an address."""
        urls = [u for u in fleet.discover() if u is not None]
        if not urls:
            return _unavailable("the ranks are starting: retry shortly")
        try:
            r = await fleet.client.get(urls[0] + request.url.path, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return _unavailable(f"no rank is answering ({type(exc).__name__})")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def rank_health(r: int, path: str) -> tuple[int, dict]:
        url = fleet.urls[r]
        if url is None:
            return 503, {"rank": r, "status": "starting"}
        try:
            got = await fleet.client.get(url + path, timeout=HEALTH_TIMEOUT_S)
            body = got.json()
        except (httpx.HTTPError, ValueError) as exc:
            return 503, {"rank": r, "status": "unreachable", "error": type(exc).__name__}
        return got.status_code, {"rank": r, **body, "outstanding": fleet.outstanding[r], "dealt": fleet.dealt[r]}

    async def health(request: Request) -> Response:
        """/health and /ready: every rank's own, 200 when all ranks answer 200."""
        fleet.discover()
        answers = await asyncio.gather(*(rank_health(r, request.url.path) for r in range(fleet.world)))
        ok = all(code == 200 for code, _ in answers)
        status = "ok" if ok else next(b["status"] for code, b in answers if code != 200)
        return JSONResponse({"status": status, "world_size": fleet.world, "dealing": "least-outstanding",
                             "ranks": [b for _, b in answers], "time": time.time()}, status_code=200 if ok else 503)

    async def debug(request: Request) -> Response:
        """Fault injection (``--debug-endpoints``): to every rank (a request id is poisoned wherever it runs)."""
        body = await request.body()
        answers = []
        for url in fleet.discover():
            if url is not None:
                r = await fleet.client.post(url + request.url.path, content=body,
                                            headers={"content-type": "application/json"})
                answers.append(r.json() if r.headers.get("content-type", "").startswith("application/json")
                               else r.text)
        return JSONResponse({"ranks": answers})

    async def not_found(request: Request, exc) -> Response:
        return _error(APIError(404, f"no route {request.method} {request.url.path}", type="not_found_error",
                               code="not_found"))

    routes = [Route(p, forward, methods=["POST"]) for p in
              ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")]
    routes += [Route(p, any_rank, methods=["GET"]) for p in ("/v1/models", "/version")]
    routes += [Route("/health", health, methods=["GET"]), Route("/ready", health, methods=["GET"]),
               Route("/debug/{what}", debug, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
