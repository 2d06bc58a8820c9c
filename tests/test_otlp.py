"""Per-request spans over OTLP/HTTP: the real OpenTelemetry exporter posts protobuf to a receiver that decodes
it with OpenTelemetry's own protocol definitions (what a Collector's otlp receiver does); the spans must
match the trace store's requests one for one."""

import http.server
import json
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # the `otel` extra: a test dependency
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from helpers import run_cli
from moescope.traces import store
from servers import free_port


class Receiver:
    def __init__(self):
        self.requests, self.paths = [], []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.requests.append(req)
                outer.paths.append(self.path)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self):
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append((resource, s))
        return out

    def stop(self):
        self.server.shutdown()


def _attrs(span):
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else \
            v.int_value if v.HasField("int_value") else v.double_value
    return out


def test_demo_exports_one_span_tree_per_stored_request(tmp_path):
    rx = Receiver()
    path = tmp_path / "t.sqlite"
    try:
        proc = run_cli("demo", "--no-tui", "--requests", "5", "--rate", "0", "--metrics-port", "-1", "--traces",
                       str(path), "--json", "--otlp-endpoint", f"http://127.0.0.1:{rx.port}", timeout=300)
        assert proc.returncode == 0, proc.stderr
    finally:
        rx.stop()
    assert set(rx.paths) == {"/v1/traces"}
    spans = rx.spans()
    roots = {s.span_id: s for _, s in spans if s.name == "moescope.request"}
    assert {res["service.name"] for res, _ in spans} == {"moescope"}
    conn = store.open_store(path)
    stored = {r.request_id: r for r in store.list_requests(conn)}
    by_request = {_attrs(s)["moescope.request_id"]: s for s in roots.values()}
    assert set(by_request) == set(stored) == set(json.loads(proc.stdout)["request_ids"])
    for rid, root in by_request.items():
        doc = store.load_request(conn, rid)
        assert root.trace_id.hex() == doc["trace_id"]  # the store links each request to its trace
        a = _attrs(root)
        assert a["moescope.output_tokens"] == sum(t["phase"] == "decode" for t in doc["tokens"])
        kids = sorted((s for _, s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano)
        assert [k.name for k in kids] == ["moescope.queue", "moescope.prefill", "moescope.decode"]
        assert kids[0].start_time_unix_nano == root.start_time_unix_nano
        assert kids[-1].end_time_unix_nano == root.end_time_unix_nano
        assert all(k.trace_id == root.trace_id for k in kids)
        total_s = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
        assert total_s == pytest.approx(doc["timings"]["total_s"], abs=1e-6)


@pytest.mark.parametrize("args,msg", [
    (["--otlp-endpoint", "http://127.0.0.1:{port}"], "cannot reach the OTLP endpoint"),
    (["--otlp-endpoint", "localhost:4318"], "must be an http(s) URL"),
    (["--otlp-endpoint", "http://127.0.0.1:4318", "--traces", "none"], "needs --traces"),
])
def test_bad_otlp_endpoints_are_one_line_errors(tmp_path, args, msg):
    args = [a.replace("{port}", str(free_port())) for a in args]
    if "--traces" not in args:
        args += ["--traces", str(tmp_path / "t.sqlite")]
    proc = run_cli("demo", "--no-tui", "--requests", "2", "--rate", "0", "--metrics-port", "-1", *args, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], proc.stderr
