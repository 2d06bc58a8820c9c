"""Readers never change what is learned (issue [lean]): two real Prometheus servers (an HA pair) and ``moescope top``'s
poller scraping one exporter as fast as they like learn exactly what no reader learns: the same learned reference,
updated at the same evaluations, judged the same. Before, a scrape folded the learned reference, so learning ran
only while someone scraped, and a second scraper or ``top`` changed when folds happened.

The evaluator is driven by hand on a fake clock (an evaluation per fake second, routing fed in between, identical
in both runs); the readers run in real time against the exporter's HTTP endpoint meanwhile. Reference: the same
feed with no reader at all.
"""

from __future__ import annotations

import threading

import numpy as np

from moescope.capture.routing_probe import DrawCounts, LayerStats, StepStats
from moescope.metrics.exporter import Exporter
from moescope.metrics.state import MetricsObserver, ModelInfo
from moescope.tui import top_data
from servers import Prometheus, require

E, LAYERS, SECONDS = 16, (1, 2, 3), 200  # a 60 s window: the reference is learned, then followed


def _feed(readers: bool, tmp_path) -> list[tuple]:
    """SECONDS fake seconds of routing (a drift in layer 2's mix from second 120), an evaluation each second; the
    learned reference after every evaluation."""
    clock = [1000.0]
    st = MetricsObserver(ModelInfo("ha", E, 2, LAYERS, 1000, 50), window_s=60, clock=lambda: clock[0])
    exporter = Exporter(st, port=0).start()
    stop = threading.Event()
    proms, threads, reads = [], [], {"top": 0, "scrape": 0}
    if readers:
        require("prometheus", "prometheus")
        for i in range(2):
            (tmp_path / f"p{i}").mkdir()
            proms.append(Prometheus(tmp_path / f"p{i}", [f"127.0.0.1:{exporter.port}"], scrape_interval="1s"))
        for p in proms:
            p.wait_scraping(1)
        poller = top_data.Poller([exporter.url])

        def top():
            while not stop.is_set():
                poller.poll()
                reads["top"] += 1

        def scrape():
            while not stop.is_set():
                exporter.exposition(openmetrics=True)
                reads["scrape"] += 1

        threads = [threading.Thread(target=f, daemon=True) for f in (top, scrape)]
        for t in threads:
            t.start()
    rng = np.random.default_rng(3)
    trail = []
    try:
        for sec in range(SECONDS):
            if readers and sec % 20 == 0:
                stop.wait(0.5)  # real time for the servers' scrapes to land between evaluations
            clock[0] = 1000.0 + sec
            p = np.full(E, 1.0 / E)
            p[:4] *= 3 if sec >= 120 else 1
            p /= p.sum()
            rids = [f"r{sec}-{j}" for j in range(6)]
            counts = np.stack([np.stack([rng.multinomial(40, p) for _ in LAYERS]) for _ in rids]).astype(np.int64)
            layers = tuple(LayerStats(layer, 120, counts[:, i].sum(0), 0, 0, 10.0, 5.0)
                           for i, layer in enumerate(LAYERS))
            st.on_stats(StepStats(1, layers, E, 2, DrawCounts(tuple(rids), counts, tuple(rids))))
            snap = st.evaluate()
            learned = st.counts.learned
            trail.append((snap.seq, learned.updates, learned.share.copy(), learned.cv.copy(), learned.top.copy(),
                          snap.gauges.hot_reference, np.nan_to_num(snap.gauges.excess_cv, nan=-1.0)))
        if readers:  # the readers did read, all through the run
            assert reads["top"] >= 10 and reads["scrape"] >= 10, reads
            for p in proms:
                assert p.scalar('sum(count_over_time(up{job="moescope"}[10m]))') >= 3
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for p in proms:
            p.stop()
        exporter.stop()
    return trail


def test_two_prometheus_servers_and_top_learn_exactly_what_no_reader_learns(tmp_path):
    quiet = _feed(False, tmp_path)
    read = _feed(True, tmp_path)
    assert quiet[-1][1] >= 2  # the reference was learned and then followed at least once
    assert len(quiet) == len(read)
    for a, b in zip(quiet, read):
        assert a[0] == b[0] and a[1] == b[1] and a[5] == b[5]  # same evaluation, same folds, same reference kinds
        for x, y in zip(a[2:5] + a[6:], b[2:5] + b[6:]):
            np.testing.assert_array_equal(x, y)
