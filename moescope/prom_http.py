"""The one HTTP client for the servers moescope reads metrics and alerts from: an exporter's exposition
(``/metrics``), the Prometheus query API (``/api/v1/query``) and Alertmanager's alert list
(``/api/v2/alerts``). Used by ``moescope top`` (its poller) and ``moescope diagnose --prometheus``.

stdlib ``urllib`` (no extra dependency for two GET requests), a timeout on every request, and one error
type: ``Unreachable``, a ``BadInput`` (exit 2 at the CLI) whose message is one line naming the server and
why; ``.reason`` holds the why alone, for callers that show a status instead of failing (``top``).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

from moescope.errors import BadInput


class Unreachable(BadInput):
    """A server did not answer, or answered with something that is not what it should serve."""

    def __init__(self, what: str, url: str, reason) -> None:
        self.reason = " ".join(str(reason).split())[:200]
        super().__init__(f"{what} at {url} is unreachable or not {what}: {self.reason}")


def get(url: str, what: str, timeout: float, *, error_body: bool = False) -> bytes:
    """The body of ``GET url``; ``what`` names the server in errors. ``error_body``: an HTTP error's body is
    returned too (Prometheus explains a refused query in a JSON body with status 400 or 422)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        if error_body:
            try:
                return exc.read()
            except OSError:
                pass
        raise Unreachable(what, url, f"HTTP {exc.code} {exc.reason}") from None
    # refused, DNS, timeout, a malformed URL (OSError, ValueError); a server that died mid-answer or does not
    # speak HTTP (http.client's IncompleteRead, BadStatusLine: neither is an OSError)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise Unreachable(what, url, getattr(exc, "reason", exc)) from None


def metrics_url(endpoint: str) -> str:
    """``host:port`` or a URL -> the exporter's ``.../metrics`` URL."""
    url = endpoint if endpoint.startswith("http") else "http://" + endpoint
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def exposition(endpoint: str, timeout: float = 2.0) -> str:
    """An exporter's exposition text (``endpoint``: ``host:port`` or a URL)."""
    return get(metrics_url(endpoint), "a metrics endpoint", timeout).decode("utf-8", "replace")


def query(prometheus: str, promql: str, timeout: float = 5.0, at: float | None = None) -> list[dict]:
    """An instant query's result vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``; ``at``: evaluation
    time (Unix seconds), else now."""
    params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode(params)}"
    body = get(url, "Prometheus", timeout, error_body=True)
    try:
        doc = json.loads(body)
    except ValueError:
        raise Unreachable("Prometheus", prometheus, "the answer is not JSON") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        err = doc.get("error") if isinstance(doc, dict) else None
        raise BadInput(f"Prometheus at {prometheus} refused the query {promql!r}: {err}")
    return doc["data"]["result"]


def alerts(alertmanager: str, timeout: float = 2.0) -> list[dict]:
    """Alertmanager's active alerts, neither silenced nor inhibited."""
    url = alertmanager.rstrip("/") + "/api/v2/alerts?active=true&silenced=false&inhibited=false"
    body = get(url, "Alertmanager", timeout)
    try:
        doc = json.loads(body)
    except ValueError:
        raise Unreachable("Alertmanager", alertmanager, "the answer is not JSON") from None
    if not isinstance(doc, list):
        raise Unreachable("Alertmanager", alertmanager, "the answer is not a list of alerts")
    return doc
