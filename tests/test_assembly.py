"""The one assembly point: a typed Config in, a wired model and engine out (moescope.instrument); the demo's
live view at a real terminal."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import moescope
from helpers import wait_until
from tmux_screen import screen
from moescope.config import Cache, Canary, Config, Metrics, Mitigations, Traces
from moescope.errors import BadInput, ConfigError
from moescope.runtime import traffic
from moescope.runtime.model import MoETransformer
from moescope.traces import store


def test_configs_check_themselves():
    with pytest.raises(ConfigError, match="cache policy"):
        Cache(policy="fifo")
    with pytest.raises(ConfigError, match="trace sample"):
        Traces("t.sqlite", sample=1.5)
    with pytest.raises(ConfigError, match="metrics port"):
        Metrics(port=70000)
    with pytest.raises(BadInput, match="unknown scenario"):
        Config(scenarios=("meltdown",))


def test_scenarios_fold_into_the_parts_they_change():
    thrash = Config(scenarios=("thrash",)).resolved()
    assert (thrash.cache.size, thrash.cache.policy) == (1, "lru")
    sj = Config(cache=Cache(prefetch=2), scenarios=("switch-jitter",)).resolved()
    assert (sj.cache.size, sj.cache.policy, sj.cache.tier, sj.cache.prefetch) == (7, "static", "disk", 2)
    assert sj.cache.disk_delay_s == (0.02, 0.06)
    assert Config(scenarios=("drop",)).model_overrides(capacity_factor=2.0) == {"capacity_factor": 0.5}
    assert Config().model_overrides(capacity_factor=2.0) == {"capacity_factor": 2.0}
    assert Config(scenarios=("leak",)).engine_settings() == {"leak_bytes": 256 * 1024}
    assert Config(scenarios=("healthy",)).resolved() == Config(scenarios=("healthy",))


def test_instrument_wires_every_part_and_undoes_it(tiny_cfg, tmp_path):
    model = MoETransformer(tiny_cfg).eval()
    before = model.observer
    cfg = Config(traces=Traces(tmp_path / "t.sqlite", seed=1), routing_log=tmp_path / "routing.json",
                 cache=Cache(size=3, policy="lfu"), canary=Canary(interval_s=0.0),
                 mitigations=Mitigations(smoothing_margin=0.02), scenarios=("jitter", "leak"))
    with moescope.instrument(model, cfg) as inst:
        engine = inst.engine(max_batch=4, seed=1)
        assert engine.canary is inst.canary and engine.leak == [] and engine.leak_bytes == 256 * 1024
        assert all(layer.router.fault is not None and layer.router.mitigation.smoothing_margin == 0.02
                   for layer in model.moe_layers())
        assert model.observer is inst.observer
        records = engine.run(traffic.generate(traffic.TrafficConfig(seed=4, output_tokens_median=4), 6),
                             realtime=False)
        lookups = sum(s.lookups for s in inst.cache.stats().values())
        inst.metrics.flush()
        assert inst.metrics.flips  # the canary ran and reached the metrics
    assert model.observer is before  # detached
    conn = store.open_store(tmp_path / "t.sqlite")  # flushed at close: every request stored
    assert len(store.list_requests(conn, limit=100)) == len(records) == 6
    log = json.loads((tmp_path / "routing.json").read_text())  # written last, after every forward
    assert log["layers"] and all(log["layers"].values())
    assert lookups == sum(len(set(fwd)) for fwds in log["layers"].values() for fwd in fwds)


def test_a_part_that_fails_undoes_the_parts_before_it(tiny_cfg, tmp_path):
    model = MoETransformer(tiny_cfg).eval()
    before = model.observer
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BadInput):
            moescope.instrument(model, Config(metrics=Metrics(port=port), traces=Traces(tmp_path / "t.sqlite")))
    assert model.observer is before
    conn = store.open_store(tmp_path / "t.sqlite")  # the recorder it had opened was closed cleanly
    assert store.list_requests(conn) == []


def test_the_metrics_shorthand_is_a_config_of_metrics_only(tiny_cfg):
    """... and leaves what its caller did to the model alone (a fault, the router path)."""
    from moescope.runtime import faults

    model = MoETransformer(tiny_cfg).eval()
    faults.apply(model, ["collapse"])
    for layer in model.moe_layers():
        layer.router.impl = "torch"
    with moescope.instrument(model, port=0, model_name="m") as inst:
        assert inst.exporter is not None and inst.config.metrics.model_name == "m"
        assert inst.recorder is None and inst.cache is None and inst.canary is None
        assert all(la.router.fault is not None and la.router.impl == "torch" for la in model.moe_layers())
    with pytest.raises(TypeError):
        moescope.instrument(model, Config(), port=0)


def test_demo_at_a_terminal_shows_the_live_view_then_the_summary():
    """`moescope demo` in a real terminal (tmux, 100x30): the live view of its own exporter while serving,
    then the plain summary once the workload is done."""
    from servers import require

    tmux = require("tmux", "tmux")
    session = f"moescope-demo-{os.getpid()}"
    cmd = (f"{sys.executable} -m moescope demo --requests 24 --rate 3 --metrics-port 0 --traces none; "
           "echo EXITED $?; sleep 30")
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "100", "-y", "30", cmd], check=True)

    try:
        views = []  # every screen seen until the command exits: the live view must be among them

        def shown():
            views.append(screen(tmux, session))
            return views[-1]

        text = wait_until(shown, until=lambda t: "EXITED" in t, timeout=240, what="the demo exiting in tmux")
        assert any("excess CV" in v and " ok" in v for v in views), text
        assert "EXITED 0" in text and "served 24/24 requests" in text, text
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
