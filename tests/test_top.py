"""`moescope top` against a live demo exporter (Textual Pilot at 80x24): the tiles show the values a scrape
of the same endpoint gives; an endpoint that goes away is shown unreachable and recovers when it returns."""

import asyncio
import subprocess
import sys
import time

from metrics_util import parse, series
from servers import free_port, wait_http
from moescope.tui.top_app import TopApp
from moescope.tui.top_data import Poller, scrape


def _demo(port, *args):
    return subprocess.Popen([sys.executable, "-m", "moescope", "demo", "--no-tui", "--metrics-port", str(port),
                             "--traces", "none", "--canary-interval", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _served(url, n):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            got = scrape(url)
            if sum(v for (name, _), v in got.items() if name == "moescope_requests_total") >= n:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("the demo did not serve its requests")


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
        cv = max(series(truth, "moescope_expert_load_cv_ratio").values())
        top = max(series(truth, "moescope_expert_load_top_share_ratio").values())
        hits = sum(series(truth, "moescope_expert_cache_hits_total").values())
        lookups = sum(series(truth, "moescope_expert_cache_lookups_total").values())

        async def drive():
            app = TopApp(Poller([url], timeout=1.0), interval_s=0.2)
            async with app.run_test(size=(80, 24)) as pilot:
                await _until(pilot, lambda: app.polls >= 2)
                tiles = _plain(app, "#tiles")
                assert f"load CV {cv:.3f}" in tiles, tiles
                assert f"top share {top:.1%}" in tiles, tiles
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
                assert "load CV -" in _plain(app, "#tiles")
                live = _demo(port, "--rate", "8", "--duration", "60")  # it comes back, serving
                try:
                    await _until(pilot, lambda: f"{url} ok" in _plain(app, "#status"), timeout=90)
                    await _until(pilot, lambda: "e0" in _plain(app, "#heat"), timeout=30)
                    heat = _plain(app, "#heat")
                    assert heat.startswith("layer 1") and heat.count("\n") >= 8  # one row per expert
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

    return urllib.request.urlopen(url, timeout=5).read().decode()


async def _until(pilot, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.2)


def test_top_once_on_an_unreachable_endpoint_is_exit_2(capsys):
    from moescope.cli import main

    assert main(["top", "127.0.0.1:1", "--once", "--interval", "0.1"]) == 2
    assert "unreachable" in capsys.readouterr().out


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
        truth = parse(urllib_get(f"http://{url}/metrics"))
        cv = max(series(truth, "moescope_expert_load_cv_ratio").values())
        prom = Prometheus(tmp_path, [url])
        deadline = time.monotonic() + 30
        while not prom.query("moescope_expert_load_cv_ratio") and time.monotonic() < deadline:
            time.sleep(0.5)
        alert = [{"labels": {"alertname": "MoEExpertCollapse", "severity": "critical", "layer": "2",
                             "model": "tiny-demo"}}]
        req = urllib.request.Request(f"http://{am.address}/api/v2/alerts", data=json.dumps(alert).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=5).read()
        frame = Poller([], prometheus=prom.url, alertmanager=f"http://{am.address}").poll()
        tiles = {t.name: t.text for t in frame.tiles}
        assert tiles["load CV"] == f"{cv:.3f}" and frame.endpoints[prom.url] == "ok"
        assert frame.alerts == ["critical: MoEExpertCollapse layer=2"]
    finally:
        if prom is not None:
            prom.stop()
        am.stop()
        hook.stop()
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

        def screen():
            return subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True,
                                  text=True).stdout

        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = screen()
            if "e7" in text and "load CV 0." in text:
                break
            time.sleep(0.5)
        assert f"127.0.0.1:{port} ok" in text and "load CV 0." in text and "layer 1" in text, text
        assert "e7" in text and "quit" in text, text  # every expert row and the key help fit in 24 lines
        assert all(len(line) <= 80 for line in text.splitlines())
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 20
        while "EXITED" not in text and time.monotonic() < deadline:
            time.sleep(0.3)
            text = screen()
        assert "EXITED" in text
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
        demo.kill()
        demo.wait()
