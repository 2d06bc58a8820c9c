"""A real Prometheus scrapes `moescope demo` and reads back what the runtime counted."""

import json

import pytest

from helpers import run_cli, wait_until
from servers import Prometheus, free_port

pytestmark = pytest.mark.integration


def test_prometheus_reads_back_the_runtime_total(tmp_path):
    port = free_port()
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    try:
        prom.wait_scraping(1)  # the demo's exporter lives ~5 s: scraped from its first second
        proc = run_cli("demo", "--no-tui", "--requests", "12", "--rate", "0", "--metrics-port", str(port), "--linger",
                       "4", "--json", timeout=300)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        runtime_total = sum(sum(c) for c in summary["expert_load"].values())
        assert runtime_total > 0
        # The demo has exited: read the last scraped values (max over the last minute per series).
        wait_until(lambda: prom.scalar('sum(max_over_time(moescope_expert_tokens_total{model="tiny-demo"}[1m]))'),
                   until=lambda got: got == runtime_total, timeout=20, what=f"{runtime_total} slots in Prometheus",
                   interval=0.5)
        tokens = prom.scalar('sum(max_over_time(moescope_router_tokens_total[1m]))')
        assert tokens * 2 == runtime_total  # top-2, no capacity limit: every routed token has 2 slots
        # Histograms and the ratio gauges arrived too.
        assert prom.scalar('sum(max_over_time(moescope_step_seconds_count[1m]))') > 0
        assert prom.query('max_over_time(moescope_expert_load_cv_ratio[1m])')
    finally:
        prom.stop()
