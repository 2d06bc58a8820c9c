"""moescope.prom_http, the one client for the servers moescope reads, against a real Prometheus."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moescope import prom_http
from moescope.errors import BadInput
from servers import Prometheus, free_port


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    prom = Prometheus(tmp_path_factory.mktemp("prom"), [])
    yield prom
    prom.stop()


def test_a_query_is_evaluated_at_the_time_asked(prometheus):
    got = prom_http.query(prometheus.url, "vector(time()) * 2", at=1000.0)
    assert [(r["metric"], float(r["value"][0]), float(r["value"][1])) for r in got] == [({}, 1000.0, 2000.0)]


def test_a_refused_query_names_prometheus_reason_in_one_line(prometheus):
    with pytest.raises(BadInput) as err:
        prom_http.query(prometheus.url, "sum(")
    msg = str(err.value)
    assert msg.startswith(f"Prometheus at {prometheus.url} refused the query 'sum('") and "parse error" in msg
    assert "\n" not in msg


def test_exposition_reads_an_endpoint_given_as_host_port(prometheus):
    text = prom_http.exposition(f"127.0.0.1:{prometheus.port}")  # Prometheus exports its own /metrics
    assert "prometheus_build_info" in {f.name for f in text_string_to_metric_families(text)}


def test_an_unreachable_server_is_one_line_and_keeps_its_reason():
    port = free_port()  # nothing listens there
    for call in (lambda: prom_http.query(f"http://127.0.0.1:{port}", "up"),
                 lambda: prom_http.exposition(f"127.0.0.1:{port}"),
                 lambda: prom_http.alerts(f"http://127.0.0.1:{port}")):
        with pytest.raises(prom_http.Unreachable) as err:
            call()
        assert "\n" not in str(err.value) and "refused" in err.value.reason.lower()
        assert isinstance(err.value, BadInput)  # exit 2 at the CLI


def test_a_server_that_is_not_prometheus_is_unreachable(prometheus):
    with pytest.raises(prom_http.Unreachable, match="not JSON"):
        prom_http.query(prometheus.url + "/metrics#", "up")  # text, not the query API's JSON


def _dies_mid_answer(answer: bytes):
    """A server that answers ``answer`` once, then closes the connection: what an exporter killed in the middle of
    a scrape leaves the client reading."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nmoescope_",  # IncompleteRead: cut in the body
    b"",  # RemoteDisconnected: closed before answering
    b"garbage\r\n\r\n",  # BadStatusLine: not HTTP at all
])
def test_a_server_that_dies_mid_answer_is_unreachable_not_a_crash(answer):
    """`top` polls every interval; an exporter killed in the middle of a scrape must read as unreachable (the
    CI once saw `top` stop polling: http.client raised past the client's error type)."""
    endpoint = _dies_mid_answer(answer)
    with pytest.raises(prom_http.Unreachable) as err:
        prom_http.exposition(endpoint, timeout=5)
    assert "\n" not in str(err.value) and err.value.reason


def test_the_top_poller_shows_a_scrape_cut_short_as_a_status():
    from moescope.tui.top_data import Poller

    endpoint = _dies_mid_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nmoescope_")
    frame = Poller([endpoint], timeout=5).poll()
    assert frame.endpoints[endpoint].startswith("unreachable: ")
