"""The kill switch (issue [lean]): capture turned off and on in a running engine, without a restart.

References: the slots a plain observer (no moescope in the way) counts when the same greedy requests are served
again on the same model; the steps the engine reports; the exposition read back. Off, the engine's thread makes no
moescope call (tests/test_step_work.py counts it); here: nothing is counted while off, everything after is, nothing
twice, and no step in part.
"""

from __future__ import annotations

import threading

import numpy as np

import moescope
from helpers import wait_until
from metrics_util import by_label, parse
from moescope.capture import switch
from moescope.capture.observer import Observer
from moescope.config import Config, Metrics
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer


class Count(Observer):
    """Slots per (layer, expert) and steps, counted by a plain observer: the reference."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts, self.slots, self.steps = n_experts, {}, 0

    def on_routing(self, layer, decision) -> None:
        ids = decision.active_ids.reshape(-1)
        c = np.bincount(ids.numpy(), minlength=self.n_experts + 1)[: self.n_experts]
        self.slots[layer] = self.slots.get(layer, 0) + c

    def on_step(self, step) -> None:
        self.steps += 1


def _phase(seed: int):
    return traffic.generate(traffic.TrafficConfig(seed=seed, output_tokens_median=6), 5)


def _exported(inst) -> dict:
    parsed = parse(inst.exporter.exposition().decode())
    got = by_label(parsed, "moescope_expert_tokens_total", "layer", "expert")
    return {"slots": {int(la): np.array([got.get((la, str(e)), 0.0) for e in range(8)])
                      for la in {la for la, _ in got}},
            "steps": sum(by_label(parsed, "moescope_steps_total", "phase").values()),
            "enabled": by_label(parsed, "moescope_capture_enabled", "model")[inst.metrics.info.name],
            "switches": sum(by_label(parsed, "moescope_capture_switches_total", "model").values())}


def test_off_counts_nothing_and_on_again_counts_every_step_once(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(n_experts=8)
    model = MoETransformer(cfg).eval()
    with moescope.instrument(model, Config(metrics=Metrics(port=0, capture_control=tmp_path / "ctl"))) as inst:
        Engine(model, max_batch=4).run(_phase(1), realtime=False)
        first = _exported(inst)
        inst.capture.set(False)
        Engine(model, max_batch=4).run(_phase(2), realtime=False)
        inst.metrics.flush()
        off = _exported(inst)
        inst.capture.set(True)
        Engine(model, max_batch=4).run(_phase(3), realtime=False)
        after = _exported(inst)
    ref = {seed: Count(8) for seed in (1, 2, 3)}
    for seed, count in ref.items():  # the same greedy requests again, counted by a plain observer
        model.observer = count
        Engine(model, max_batch=4).run(_phase(seed), realtime=False)
    assert (first["enabled"], off["enabled"], after["enabled"]) == (1.0, 0.0, 1.0)
    assert off["switches"] == 1 and after["switches"] == 2
    for layer, slots in off["slots"].items():  # nothing counted while off
        np.testing.assert_array_equal(slots, first["slots"][layer])
    assert off["steps"] == first["steps"] == ref[1].steps
    for layer, slots in after["slots"].items():  # on again: every step of phase 3, once
        np.testing.assert_array_equal(slots, ref[1].slots[layer] + ref[3].slots[layer])
    assert after["steps"] == ref[1].steps + ref[3].steps


def test_switched_at_random_while_the_engine_steps_no_step_is_counted_in_part(tiny_cfg, tmp_path):
    """Flipped from another thread at arbitrary points of the engine's forwards: every step counted is whole (each
    MoE layer routed the same tokens), and nothing is counted twice (never more than was routed)."""
    model = MoETransformer(tiny_cfg).eval()
    routed = Count(tiny_cfg.n_experts)
    config = Config(metrics=Metrics(capture_control=tmp_path / "ctl"), observers=())
    with moescope.instrument(model, config) as inst:
        engine = Engine(model, max_batch=4)
        for r in traffic.generate(traffic.TrafficConfig(seed=7, output_tokens_median=16), 12):
            engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
        done = threading.Event()

        def flipper():
            on = True
            while not done.is_set():
                on = not on
                inst.capture.set(on)
                done.wait(0.003)
            inst.capture.set(True)

        t = threading.Thread(target=flipper, daemon=True)
        t.start()
        while engine.has_work:
            engine.step()
        done.set()
        t.join()
        snap = inst.metrics.flush()
    # (a second pass of the same greedy requests, counted by a plain observer)
    model.observer = routed
    engine = Engine(model, max_batch=4)
    for r in traffic.generate(traffic.TrafficConfig(seed=7, output_tokens_median=16), 12):
        engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
    while engine.has_work:
        engine.step()
    tokens = snap.layer_counters["moescope_router_tokens_total"]
    assert inst.capture.switches > 10
    assert len(set(tokens.values())) == 1, tokens  # every layer saw the same steps: none counted in part
    for layer, slots in snap.expert_tokens.items():
        assert (slots <= routed.slots[layer]).all()  # nothing counted twice
        assert 0 < slots.sum() < routed.slots[layer].sum()


def test_the_control_file_turns_capture_off_and_on_in_a_running_process(tiny_cfg, tmp_path):
    """What ``moescope capture off`` writes, a running process follows within its evaluation interval."""
    model = MoETransformer(tiny_cfg).eval()
    ctl = tmp_path / "capture"
    with moescope.instrument(model, Config(metrics=Metrics(port=0, interval_s=0.05, capture_control=ctl))) as inst:
        assert inst.capture.on
        switch.write_control(False, ctl)
        wait_until(lambda: inst.capture.on, until=lambda on: not on, timeout=30, what="capture off")
        wait_until(lambda: parse(inst.exporter.exposition().decode()), timeout=30, what="the gauge at 0",
                   until=lambda p: by_label(p, "moescope_capture_enabled", "model") == {"test-tiny": 0.0})
        switch.write_control(True, ctl)
        wait_until(lambda: inst.capture.on, timeout=30, what="capture on")
    # a process started while the file says off never captures
    switch.write_control(False, ctl)
    with moescope.instrument(model, Config(metrics=Metrics(interval_s=60, capture_control=ctl))) as inst:
        assert not inst.capture.on
        Engine(model, max_batch=4).run(_phase(1), realtime=False)
        assert not inst.metrics.flush().expert_tokens
