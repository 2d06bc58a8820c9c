"""`moescope top` against a live demo exporter (Textual Pilot at 80x24): the tiles show the values a scrape
of the same endpoint gives; an endpoint that goes away is shown unreachable and recovers when it returns."""

import asyncio
import subprocess
import sys
import time

import pytest
from helpers import popen_cli, wait_until
from metrics_util import parse, series
from servers import free_port, wait_http
from tmux_screen import wait_screen
from top_scale import (COLLAPSED, DEAD, DEAD_LAYER, HOT_EXPERT, HOT_LAYER, HOT_ONE, SKEWED, ScaleExporter,
                       tokens_to_judge)
from moescope.thresholds import DEFAULT
from moescope.tui.top_app import TopApp
from moescope.tui.top_data import Poller, _fmt, scrape


def _demo(port, *args):
    return popen_cli("demo", "--no-tui", "--metrics-port", port, "--traces", "none", "--canary-interval", "0",
                          *args)


def _served(url, n):
    wait_until(lambda: sum(v for (name, _), v in scrape(url).items() if name == "moescope_requests_total") >= n,
               timeout=120, what=f"the demo serving {n} requests")


def _plain(app, widget_id):
    return str(app.query_one(widget_id).render())


def test_top_shows_scraped_values_and_recovers_an_endpoint(tmp_path):
    port = free_port()
    url = f"127.0.0.1:{port}"
    # a finished run whose exporter lingers: its values hold still while we compare
    demo = _demo(port, "--requests", "16", "--rate", "0", "--linger", "120", "--cache-size", "6")
    try:
        wait_http(f"http://{url}/metrics", timeout=90)
        _served(url, 16)
        truth = parse(urllib_get(f"http://{url}/metrics"))
        excess = max(series(truth, "moescope_expert_load_excess_cv_ratio").values())  # 16 requests: judged
        # no baseline loaded: the bar of the reference the exporter says it judges against (learned from its first
        # full window), "learning" before that
        refs = {dict(labels)["reference"]: v for (name, labels), v in truth.items()
                if name == "moescope_reference_load_cv_ratio"}
        bar = "learning" if not refs else f"{max(DEFAULT.imbalance_bar_of(k, v) for k, v in refs.items()):.2f}"
        top = max(series(truth, "moescope_expert_load_top_share_ratio").values())
        hits = sum(series(truth, "moescope_expert_cache_hits_total").values())
        lookups = sum(series(truth, "moescope_expert_cache_lookups_total").values())

        async def drive():
            app = TopApp(Poller([url], timeout=10.0), interval_s=0.2)
            async with app.run_test(size=(80, 24)) as pilot:
                await _until(pilot, lambda: app.polls >= 2)
                tiles = _plain(app, "#tiles")
                assert f"excess CV {excess:.2f}/{bar}" in tiles, tiles  # the judged series, never raw CV
                assert f"top share {_fmt(top, 'pct')}" in tiles, tiles
                # rates are per poll interval: the finished run looks up nothing now (after the first poll,
                # which covers everything since the exporter started)
                assert "tokens/s 0 " in tiles and "cache hit -" in tiles, tiles
                assert app.first_frame is not None
                first = {t.name: t.text for t in app.first_frame.tiles}
                assert first["cache hit"] == f"{hits / lookups:.1%}"
                assert f"{url} ok" in _plain(app, "#status")
                demo.kill()
                demo.wait()
                await _until(pilot, lambda: "unreachable" in _plain(app, "#status"))
                assert "excess CV -" in _plain(app, "#tiles")
                live = _demo(port, "--rate", "8", "--duration", "60")  # it comes back, serving
                try:
                    await _until(pilot, lambda: f"{url} ok" in _plain(app, "#status"), timeout=90)
                    await _until(pilot, lambda: "3 layers x 8 experts" in _plain(app, "#heat"), timeout=30)
                    heat = _plain(app, "#heat").splitlines()
                    assert "a cell per expert" in heat[0]
                    # what is judged: a live run's first seconds may hold too few finished requests
                    assert heat[2].startswith(("no baseline: learning the reference", "no baseline: judged against",
                                               "too few requests in the window to judge")), heat[2]
                    assert [line[:2] for line in heat[3:6]] == ["L1", "L2", "L3"]  # one row per layer
                    await pilot.press("tab")  # the selected layer's experts x time
                    await _until(pilot, lambda: "e7" in _plain(app, "#heat"), timeout=30)
                    heat = _plain(app, "#heat")
                    assert heat.startswith("layer 1") and all(f"\ne{e} " in heat for e in range(8))
                    await pilot.press("right_square_bracket")
                    assert _plain(app, "#heat").startswith("layer 2")
                    await pilot.press("q")
                finally:
                    live.kill()
                    live.wait()

        asyncio.run(drive())
    finally:
        demo.kill()
        demo.wait()


def urllib_get(url):
    import urllib.request

    return urllib.request.urlopen(url, timeout=60).read().decode()  # (a 1.4 MB exposition at shape, loaded)


async def _until(pilot, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.2)


def test_a_poll_slower_than_the_interval_is_never_run_beside_the_next():
    """The poller keeps the previous scrape for rates: `top` runs one poll at a time, however slow a poll is
    against the interval (a loaded exporter, a 1.4 MB exposition at shape): the ticks in between wait."""
    import threading

    class Slow(Poller):
        def __init__(self):
            super().__init__(["127.0.0.1:1"], timeout=1.0)  # nothing listens: each poll is an unreachable frame
            self.now = self.most = self.calls = 0
            self.lock = threading.Lock()

        def poll(self):
            with self.lock:
                self.now += 1
                self.calls += 1
                self.most = max(self.most, self.now)
            time.sleep(0.3)  # 15 intervals
            try:
                return super().poll()
            finally:
                with self.lock:
                    self.now -= 1

    poller = Slow()

    async def drive():
        app = TopApp(poller, interval_s=0.02)
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: app.polls >= 3)
            assert "unreachable" in _plain(app, "#status")
            await pilot.press("q")

    asyncio.run(drive())
    assert poller.calls >= 3 and poller.most == 1, (poller.calls, poller.most)


def test_top_once_on_an_unreachable_endpoint_is_exit_2(capsys):
    from moescope.cli import main

    assert main(["top", "127.0.0.1:1", "--once", "--interval", "0.1"]) == 2
    err = capsys.readouterr().err  # the one-line error of every command's bad input, naming why
    assert err.startswith("moescope: error: no metrics source answered:") and err.count("\n") == 1
    assert "127.0.0.1:1" in err and "unreachable" in err


def test_top_once_cuts_lines_to_the_terminal_or_the_given_width_and_keeps_them_whole_when_piped(capsys,
                                                                                                  monkeypatch):
    """Piped (pytest captures stdout): every line whole, so the verdicts, the hot factor and the alert list past
    column 80 are there; `--width N` cuts to N; on a terminal the width is the terminal's (`$COLUMNS` first)."""
    from moescope.cli import main

    exp = ScaleExporter()
    try:
        exp.feed(tokens_to_judge())
        assert main(["top", exp.url, "--once", "--interval", "0.1"]) == 0
        whole = capsys.readouterr().out.splitlines()
        assert max(map(len, whole)) > 80 and not any(line.endswith("…") for line in whole)
        skewed = next(line for line in whole if line.startswith(f"L{SKEWED} "))
        assert "imbalanced" in skewed and "fair share); hot e" in skewed, skewed  # past column 80
        assert whole[-1].startswith(f"L{COLLAPSED} hot e{HOT_EXPERT} ") and f"E{HOT_EXPERT} " in whole[-1]
        assert main(["top", exp.url, "--once", "--interval", "0.1", "--width", "60"]) == 0
        cut = capsys.readouterr().out.splitlines()
        assert max(map(len, cut)) <= 60 and len(cut) == len(whole)
    finally:
        exp.stop()
    from moescope.cli.top_cmd import once_width

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "200")
    assert once_width(None, Terminal()) == 200 and once_width(100, Terminal()) == 100
    assert once_width(None, object()) is None  # not a terminal: no cut


def test_top_reads_prometheus_and_alertmanager(tmp_path):
    """The same tile values through a real Prometheus; firing alerts from a real Alertmanager."""
    import json
    import urllib.request

    from conftest import ROOT
    from servers import Alertmanager, Prometheus, Webhook

    port = free_port()
    url = f"127.0.0.1:{port}"
    demo = _demo(port, "--requests", "16", "--rate", "0", "--linger", "120")
    hook = Webhook()
    am = Alertmanager(tmp_path, ROOT / "collectors" / "alertmanager" / "alertmanager.yml", hook.port)
    prom = None
    try:
        wait_http(f"http://{url}/metrics", timeout=90)
        _served(url, 16)
        prom = Prometheus(tmp_path, [url])
        wait_until(lambda: prom.query("moescope_expert_load_cv_ratio"), timeout=30, what="the gauges in Prometheus")
        alert = [{"labels": {"alertname": "MoEExpertCollapse", "severity": "critical", "layer": "2",
                             "model": "tiny-demo"}}]
        req = urllib.request.Request(f"http://{am.address}/api/v2/alerts", data=json.dumps(alert).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=5).read()
        # The window gauges slide while the finished run lingers: compare with what Prometheus itself answers
        # just before and just after the poll, when both agree (no scrape landed in between).
        def bar():  # the bar of the reference Prometheus holds (none yet: the exporter is still learning it)
            refs = prom.query("moescope_reference_load_cv_ratio")
            return "learning" if not refs else f"{max(DEFAULT.imbalance_bar_of(r['metric']['reference'], float(r['value'][1])) for r in refs):.2f}"  # noqa: E501

        for _ in range(20):
            before, bar_before = prom.scalar("max(moescope_expert_load_excess_cv_ratio)"), bar()
            frame = Poller([], prometheus=prom.url, alertmanager=f"http://{am.address}").poll()
            if before is not None and prom.scalar("max(moescope_expert_load_excess_cv_ratio)") == before and \
                    bar() == bar_before:
                break  # (None: a scrape slower than its interval left the series stale for a moment)
        assert before is not None
        tiles = {t.name: t.text for t in frame.tiles}
        assert tiles["excess CV"] == f"{before:.2f}/{bar_before}"
        assert frame.endpoints[prom.url] == "ok"
        assert frame.alerts == ["critical: MoEExpertCollapse layer=2"]
    finally:
        if prom is not None:
            prom.stop()
        am.stop()
        hook.stop()
        demo.kill()
        demo.wait()


def test_top_prometheus_shows_the_live_token_rate(tmp_path):
    """Through Prometheus, tokens/s is the live rate from the first poll on, between scrapes too (counters change
    in Prometheus only at its scrapes: two polls a scrape apart differ by nothing), and it is the rate Prometheus
    itself computes over the same window of the same samples (the reference: its own rate())."""
    from servers import Prometheus

    window = 16  # s: eight scrapes; the reference's window lies wholly within the samples (rate() divides by the
    # whole window, so over a window longer than the series' life it reads low)

    port = free_port()
    url = f"127.0.0.1:{port}"
    demo = _demo(port, "--rate", "8", "--duration", "120")
    prom = None
    try:
        wait_http(f"http://{url}/metrics", timeout=90)
        prom = Prometheus(tmp_path, [url], scrape_interval="2s")
        first = wait_until(lambda: prom.query("moescope_router_tokens_total"), timeout=30, what="the counters")
        layer = min(int(s["metric"]["layer"]) for s in first)
        time.sleep(window + 6)
        poller = Poller([], prometheus=prom.url, rate_window_s=window)
        rate = f'sum(rate(moescope_router_tokens_total{{layer="{layer}"}}[{window}s]))'
        for _ in range(10):  # compare when no scrape lands between the reference and the poll
            want = prom.scalar(rate)
            got = [poller.poll(), poller.poll()]  # the first poll, then one at once after it (same samples)
            if prom.scalar(rate) == want:
                break
        rates = [next(t.value for t in f.tiles if t.name == "tokens/s") for f in got]
        assert want and want > 0
        # Prometheus extrapolates to the window's edges, we divide by the span the samples cover: the same rate
        # within the share of the window one scrape interval is
        assert all(r is not None and r == pytest.approx(want, rel=2 / window) for r in rates), (rates, want)
    finally:
        if prom is not None:
            prom.stop()
        demo.kill()
        demo.wait()


def test_tmux_80x24_screen_shows_tiles_heatmap_and_quits():
    """A real terminal (tmux, 80x24), as over SSH: the screen reads, nothing overflows, q quits."""
    import os

    from servers import require

    tmux = require("tmux", "tmux")
    port = free_port()
    demo = _demo(port, "--rate", "8", "--duration", "60")
    session = f"moescope-top-{os.getpid()}"
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=90)
        cmd = f"{sys.executable} -m moescope top 127.0.0.1:{port} --interval 0.5; echo EXITED; sleep 30"
        subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)

        # the footer (key help) is drawn after the first poll's rows: wait for the whole screen, not its first paint
        # (and a poll that answered: under load one poll may time out and show the endpoint unreachable a moment)
        text = wait_screen(tmux, session, lambda text: "L3 " in text and "excess CV 0." in text and "quit" in text
                           and f"127.0.0.1:{port} ok" in text and "3 layers x 8 experts" in text)
        assert f"127.0.0.1:{port} ok" in text and "excess CV 0." in text and "3 layers x 8 experts" in text, text
        assert all(f"L{la} " in text for la in (1, 2, 3)) and "quit" in text, text  # rows and key help fit
        assert all(len(line) <= 80 for line in text.splitlines())
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        wait_screen(tmux, session, "EXITED", timeout=20)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
        demo.kill()
        demo.wait()


# -- deepseek-v3 shape: 58 MoE layers x 256 experts, in 80x24 --------------------------------------------------


def _screen_lines(app) -> list[str]:
    """What the terminal shows, line by line (the app's widgets, stacked as drawn)."""
    lines = []
    for wid in ("#status", "#tiles", "#heat", "#details"):
        w = app.query_one(wid)
        lines += _plain(app, wid).splitlines()[: w.size.height]
    return lines


@pytest.mark.parametrize("budget,tier", [(64 * 256, "per-expert"), (1000, "reduced")])
def test_top_reads_deepseek_v3_shape_in_80x24(budget, tier):
    """Both exporter tiers: every layer is reachable, the known faults are named by layer and expert (the hot
    one with the exporter's own factor against the fair share), the hot and cold experts named equal the
    exporter's own counts, and nothing overflows 80x24."""
    exp = ScaleExporter(budget=budget)
    try:
        exp.feed(tokens_to_judge())  # then no more: the view's window is the whole run, the truth the test holds

        async def drive():
            app = TopApp(Poller([exp.url], timeout=30.0), interval_s=1.0)
            async with app.run_test(size=(80, 24)) as pilot:
                await _until(pilot, lambda: app.polls >= 2 and "58 layers" in _plain(app, "#heat"), timeout=60)
                heat = _plain(app, "#heat").splitlines()
                assert heat[0].startswith("58 layers x 256 experts, bands of 8") and tier in heat[0]
                assert ("sorted by load" in heat[0]) == (tier == "reduced")
                assert heat[1].startswith(f"worst L{COLLAPSED}: collapsed onto e{HOT_EXPERT} (100% of tokens)")
                assert all(len(line) <= 80 for line in _screen_lines(app))
                assert len(_screen_lines(app)) + 1 <= 24  # + the key help
                assert heat[2].startswith("no baseline: against the fair share (as asked), imbalance above excess CV")
                await pilot.press("s")  # worst first: the four faults lead, each in words
                rows = _plain(app, "#heat").splitlines()[3:]
                assert rows[0].startswith(f"L{COLLAPSED} ") and "collapsed onto e5" in rows[0]
                assert {r[:4].strip() for r in rows[1:4]} == {f"L{SKEWED}", f"L{DEAD_LAYER}", f"L{HOT_LAYER}"}
                dead_row = next(r for r in rows if r.startswith(f"L{DEAD_LAYER} "))
                assert f"{len(DEAD)} dead" in dead_row
                skew_row = next(r for r in rows if r.startswith(f"L{SKEWED} "))
                assert "imbalanced" in skew_row
                hot_row = next(r for r in rows if r.startswith(f"L{HOT_LAYER} "))
                factor = series(parse(urllib_get(f"http://{exp.url}/metrics")), "moescope_expert_hot_factor_ratio")
                hot = {dict(k)["expert"]: v for k, v in factor.items() if dict(k)["layer"] == str(HOT_LAYER)}
                assert f"hot L{HOT_LAYER} E{HOT_ONE} {hot[str(HOT_ONE)]:.1f}x fair" in hot_row, (hot_row, hot)
                assert all(f"hot L{la} " not in r for r in rows for la in range(61) if la != HOT_LAYER)
                if tier == "per-expert":  # cells by expert id: the dead band 96-103 and the hot bands 0-31
                    assert dead_row[5 + 100 // 8] == "_" and set(skew_row[5:9]) <= set("*#%@+")
                # the named experts of the selected layer equal the exporter's own counts
                await pilot.press("home")
                await pilot.press("down")
                layer = app.layer
                truth = exp.truth[layer]
                mean = truth.sum() / len(truth)
                hot = sorted(range(len(truth)), key=lambda e: (-truth[e], e))[:3]
                details = _plain(app, "#details")
                assert details.startswith(f"L{layer} hot " + " ".join(f"e{e} {truth[e] / mean:.1f}x" for e in hot))
                # scrolling reaches every layer; the selection stays on screen (paused: the exporter's window
                # slides past the fed traffic on a slow machine, and the order would change under the keys)
                await pilot.press("space")
                for _ in range(60):
                    await pilot.press("down")
                assert app.layer == app._order()[-1] and f"L{app.layer} " in _plain(app, "#heat")
                await pilot.press("home", "enter")  # the worst layer's experts
                view = _plain(app, "#heat")
                assert view.startswith(f"layer {COLLAPSED} ") and "collapsed onto e5" in view
                if tier == "per-expert":
                    assert "e0-15" in view and f"e{HOT_EXPERT} " in view.splitlines()[2]
                else:
                    assert "no per-expert series in this tier" in view
                await pilot.press("q")

        asyncio.run(drive())
    finally:
        exp.stop()


def test_parse_exposition_equals_prometheus_clients_parser():
    """The fast parser against the reference one, on a deepseek-v3-shaped exposition with escaped labels."""
    from moescope.tui.top_data import parse_exposition

    exp = ScaleExporter()
    try:
        exp.feed(500)
        text = urllib_get(f"http://{exp.url}/metrics")
        text += 'moescope_x_total{model="a\\\\b\\"c\\nd",rank="0"} 3.0\n'  # escapes in a label value
        assert len(text) > 10**6
        assert parse_exposition(text) == parse(text)
    finally:
        exp.stop()


def test_tmux_80x24_at_deepseek_v3_shape():
    """As a person would over SSH: a 58 x 256 model's screen reads in 80x24, worst first on `s`."""
    import os

    from servers import require

    tmux = require("tmux", "tmux")
    exp = ScaleExporter()
    session = f"moescope-top-dsv3-{os.getpid()}"
    try:
        exp.feed(tokens_to_judge())
        cmd = f"{sys.executable} -m moescope top {exp.url} --interval 0.5; echo EXITED; sleep 30"
        subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)

        text = wait_screen(tmux, session, "58 layers x 256 experts")
        subprocess.run([tmux, "send-keys", "-t", session, "s"], check=True)
        text = wait_screen(tmux, session, f"L{COLLAPSED}  ")
        lines = text.splitlines()
        assert all(len(line) <= 80 for line in lines) and len(lines) <= 24
        row = next(line for line in lines if line.startswith(f"L{COLLAPSED} "))
        assert "collapsed onto e5" in row and "quit" in text
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        wait_screen(tmux, session, "EXITED")
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
        exp.stop()

