"""``GET /metrics`` on ``moescope serve``'s API port, against references: the trace store's record of every
request served (counts, sums and finish reasons), the HTTP statuses the clients saw (rejections by cause),
``/health`` (running and waiting), and the served request ids (exemplars). Real server subprocess, the
``openai`` SDK, httpx."""

from __future__ import annotations

import asyncio
import subprocess
import threading

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from moescope.metrics import catalogue
from test_serve import MODEL, Serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]
P = "moescope_serve_"


def scrape(s: Serve) -> dict[tuple[str, tuple], float]:
    """{(sample name, (label, value) pairs besides model and rank): value} of the API port's exposition."""
    text = httpx.get(s.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            assert smp.labels.pop("model") == MODEL and smp.labels.pop("rank") == "0", smp
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(P + name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one batch slot, two waiting: running, waiting and 429s are easy to set up
    s = Serve(tmp_path_factory.mktemp("serve-metrics"), "--max-batch", "1", "--max-queue", "2")
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


def test_metrics_agree_with_the_trace_store(server):
    before = scrape(server)
    client = server.client()
    ids = []
    for i in range(4):  # whole and streamed, completions and chat; greedy and sampled
        ids.append(client.completions.create(model=MODEL, prompt=f"def f{i}(x):", max_tokens=6 + i,
                                             temperature=0 if i % 2 else 0.8, seed=i).id)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                                max_tokens=5, stream=True)
        ids.append(next(iter(stream)).id)
        for _ in stream:
            pass
    ids.append(client.completions.create(model=MODEL, prompt="a", max_tokens=8, stop=["e"]).id)  # may stop early
    bad = 0
    for body in ({"model": MODEL}, {"model": "nope", "prompt": "x"}, {"model": MODEL, "prompt": "x", "n": 2}):
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert 400 <= r.status_code < 500
        bad += 1
    docs = [server.stored(rid) for rid in ids]
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    n_out = [sum(t["phase"] == "decode" for t in d["tokens"]) for d in docs]
    n_prompt = [sum(t["phase"] == "prefill" for t in d["tokens"]) for d in docs]
    assert delta("time_to_first_token_seconds_count") == sum(n > 0 for n in n_out)
    assert delta("inter_token_latency_seconds_count") == sum(max(0, n - 1) for n in n_out)
    assert delta("generation_tokens_total") == sum(n_out)
    assert delta("prompt_tokens_total") == sum(n_prompt)
    assert delta("e2e_request_latency_seconds_count") == len(ids)
    assert delta("e2e_request_latency_seconds_sum") == pytest.approx(sum(d["timings"]["total_s"] for d in docs),
                                                                     rel=1e-6, abs=1e-9)
    assert delta("request_queue_time_seconds_sum") == pytest.approx(sum(d["timings"]["queue_s"] for d in docs),
                                                                    rel=1e-6, abs=1e-9)
    # the first token is observed on the event loop, stamped right after the engine's step: never before the
    # engine's own time of it, and not long after
    ttft = delta("time_to_first_token_seconds_sum")
    engine_ttft = sum(d["timings"]["ttft_s"] for d in docs)
    assert engine_ttft <= ttft + 1e-9 <= engine_ttft + 0.25 * len(ids), (ttft, engine_ttft)
    # ITL: the sum of the gaps is each request's last-token time minus its first
    itl = delta("inter_token_latency_seconds_sum")
    engine_itl = sum(sum(t["latency_s"] for t in d["tokens"] if t["phase"] == "decode"
                         and t["index"] > n) for d, n in zip(docs, n_prompt))
    assert abs(itl - engine_itl) <= 0.25 * len(ids), (itl, engine_itl)
    reasons = {"stop": 0, "length": 0, "abort": 0}
    for d in docs:
        reasons[{"eos": "stop", "stop": "stop", "length": "length", "max_seq_len": "length"}
                .get(d["finish_reason"], "abort")] += 1
    for reason, n in reasons.items():
        assert delta("request_success_total", finished_reason=reason) == n, reason
    assert delta("request_rejected_total", cause="invalid") == bad
    # every bucket reaches minutes; cumulative counts end at the count
    les = sorted(float(dict(k[1])["le"]) for k in after if k[0] == P + "time_to_first_token_seconds_bucket")
    assert les[-2] >= 600 and les[-1] == float("inf")


def test_running_waiting_and_429_are_counted_and_match_health(server):
    before, rejected = scrape(server), server.health()["rejected"]
    long = threading.Thread(target=lambda: server.client().completions.create(
        model=MODEL, prompt="x", max_tokens=400, temperature=0))
    long.start()
    server.wait_health(lambda h: h["running"] == 1)

    async def flood():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*[c.completions.create(model=MODEL, prompt="y", max_tokens=400, temperature=0)
                                      for _ in range(6)], return_exceptions=True)

    results = []
    t = threading.Thread(target=lambda: results.extend(asyncio.run(flood())))
    t.start()
    h = server.wait_health(lambda h: h["queued"] == 2 and h["rejected"] - rejected == 4)
    m = scrape(server)
    assert value(m, "num_requests_running") == h["running"] == 1
    assert value(m, "num_requests_waiting") == h["queued"] == 2
    t.join(300)
    long.join(300)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 4 and len(results) == 6, results
    after = scrape(server)
    assert value(after, "request_rejected_total", cause="queue_full") - \
        value(before, "request_rejected_total", cause="queue_full") == len(refused)
    assert value(after, "num_requests_running") == value(after, "num_requests_waiting") == 0


def test_openmetrics_exemplars_are_served_request_ids(server):
    rid = server.client().completions.create(model=MODEL, prompt="exemplar", max_tokens=4).id
    out = subprocess.run(["curl", "-si", "-H", "Accept: application/openmetrics-text", server.url + "/metrics"],
                         capture_output=True, text=True, timeout=30, check=True)
    head, _, text = out.stdout.replace("\r\n", "\n").partition("\n\n")
    assert "content-type: application/openmetrics-text" in head.lower(), head
    exemplars = {}
    for fam in parse_openmetrics(text):
        for smp in fam.samples:
            if smp.exemplar is not None:
                exemplars.setdefault(fam.name, set()).add(smp.exemplar.labels["request_id"])
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert rid in exemplars[P + name], (name, exemplars.get(P + name))
    for ids in exemplars.values():  # every exemplar is a request the store holds
        for other in ids:
            assert server.stored(other)["request_id"] == other


def test_every_serving_series_is_in_the_catalogue(server):
    names = {k[0] for k in scrape(server)}
    declared = {m.name for m in catalogue.CATALOGUE if m.name.startswith(P)}
    exposed = {n for n in names if not n.endswith("_created")}
    assert exposed <= catalogue.exposed_sample_names(), exposed - catalogue.exposed_sample_names()
    assert {n.removesuffix("_count") for n in exposed if n.endswith("_count")} | \
        {n for n in exposed if not n.endswith(("_bucket", "_sum", "_count"))} == declared


# The serving queries of vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana/
# grafana.json), in its forms: quantiles and means of the histograms, rates of the counters, the gauges, the
# per-request heatmaps, the finish reasons.
VLLM_SERIES_HIST = ("e2e_request_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds")
VLLM_QUERIES = (
    *(f'histogram_quantile(0.99, sum by(le) (rate(vllm:{h}_bucket{{model_name="$m"}}[30s])))'
      for h in VLLM_SERIES_HIST),
    *(f'rate(vllm:{h}_sum{{model_name="$m"}}[30s]) / rate(vllm:{h}_count{{model_name="$m"}}[30s])'
      for h in VLLM_SERIES_HIST),
    'rate(vllm:prompt_tokens_total{model_name="$m"}[30s])', 'rate(vllm:generation_tokens_total{model_name="$m"}[30s])',
    'vllm:num_requests_running{model_name="$m"}', 'vllm:num_requests_waiting{model_name="$m"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$m"}[30s]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$m"}[30s]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$m"}[30s]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$m"}[30s])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$m"}[30s])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$m"}[30s])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$m"}[30s])',
)


def test_vllm_dashboard_queries_answer_through_the_documented_relabel(server, tmp_path):
    import re

    import yaml

    from conftest import ROOT
    from moescope.serve.metrics import VLLM_RELABEL
    from servers import Prometheus

    doc = (ROOT / "docs" / "serve.md").read_text()
    block = re.search(r"```yaml\n(metric_relabel_configs:.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block)["metric_relabel_configs"] == list(VLLM_RELABEL)  # the docs show the rule tested

    prom = Prometheus(tmp_path, [f"127.0.0.1:{server.port}"], metric_relabel=list(VLLM_RELABEL))
    try:
        client = server.client()
        def traffic_scraped():  # traffic across several scrapes: rates need two samples
            client.completions.create(model=MODEL, prompt="relabel", max_tokens=6)
            return prom.scalar(f'count(vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}) '
                               f'and on() (count_over_time(vllm:generation_tokens_total{{model_name="{MODEL}"}}[30s]) '
                               '> 4)')

        wait_until(traffic_scraped, timeout=60, what="the renamed series over several scrapes", interval=0)
        missing = [q for q in VLLM_QUERIES if not prom.query(q.replace("$m", MODEL))]
        assert not missing, missing
        assert not prom.query('{__name__=~"moescope_serve_.+"}')  # every serving series was renamed
        # idle now: Prometheus's next scrapes hold the exporter's total (the server's own, read directly)
        served = value(scrape(server), "generation_tokens_total")
        wait_until(lambda: prom.scalar(f'vllm:generation_tokens_total{{model_name="{MODEL}"}}'),
                   until=lambda total: total == served, timeout=30, what="Prometheus's total = the exporter's")
    finally:
        prom.stop()
