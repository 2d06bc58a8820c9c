"""uvicorn around the app, with the shutdown a deployment expects.

SIGTERM (or Ctrl-C): the service starts draining (new requests get 503, ``/health`` says "draining"), uvicorn
closes the listening socket and waits for in-flight responses; requests still queued or running
``shutdown_timeout_s`` after the signal are cancelled by the engine loop (stored as "cancelled"; a whole
response answers 503, a stream ends with an error event and ``[DONE]``), so every client gets an answer.
uvicorn's own graceful timeout, which would cancel handlers mid-response (a 500), is only a backstop a few
seconds later. ``run`` then returns normally so
the caller closes the engine loop and flushes the trace store: uvicorn re-raises the signal it caught after
its shutdown, and the handlers installed here ignore it (the default SIGTERM action would kill the process
before the flush).
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import TYPE_CHECKING

from moescope.errors import BadInput

if TYPE_CHECKING:  # the app imports the engine (torch): binding the port must not wait for that
    from moescope.serve.app import Service


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow starts (port 0: any free port). Raises BadInput."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; without
    # it every response written in two parts (headers, body) waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


BACKSTOP_S = 5.0  # after the drain deadline: time for the cancelled requests' answers to go out


def _ignore(signum, frame) -> None:
    pass


def run(app, service: "Service", sock: socket.socket, *, shutdown_timeout_s: float, log_level: str = "info",
        access_log: bool = False) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM/SIGINT; returns after the graceful shutdown."""
    import uvicorn  # optional: uvicorn (the serve extra)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not service.draining:
                service.draining = True
                service.loop.drain(shutdown_timeout_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S, timeout_keep_alive=5)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore)
    Server(config).run(sockets=[sock])


def start_in_thread(app, sock: socket.socket, *, log_level: str = "info", access_log: bool = False):
    """Serve ``app`` on ``sock`` from a thread of its own (the main thread runs something else: the ranks'
    launcher, which owns the signals). Returns (thread, server); ``server.should_exit = True`` stops it."""
    import uvicorn  # optional: uvicorn (the serve extra)

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on", timeout_keep_alive=5,
                            timeout_graceful_shutdown=BACKSTOP_S)
    userver = uvicorn.Server(config)
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, name="moescope-front-end", daemon=True)
    thread.start()
    return thread, userver
