"""moescope's work on the engine's thread is a constant per hook call, whatever the layers, experts, batch or request
length (issue [lean]): counted, not timed, so load cannot break it.

A real engine serves real requests on this (the engine's) thread, with counting on inside each hook it calls on the
instrumentation (``HookWork``): every Python call into moescope's observability code (the capture seam's fan-out,
the probe, the metrics, the trace capture: everything of ``moescope`` but the engine itself, ``moescope.runtime``,
the records and routing decision the engine builds, and the observer base class's no-op hooks the bare engine
calls too) is attributed to the hook the engine called. Per hook, every call must cost the same number of Python
calls and torch operations at 4 and 32 MoE layers, 1 and 16 concurrent requests, and requests of 3 to 24 tokens:
no hook grows with the layers (beyond being called once per layer), the batch or the tokens. The engine calls each
per-layer hook once per MoE layer per forward, ``on_step`` once per step.

The old capture path fails this (checked against fd38f58): its ``on_request`` observed a histogram once per output
token, and its ``on_step`` summarised all pending routing every interval on the engine's thread. Capture switched
off (the kill switch), the engine's thread makes no moescope call at all.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

import pytest
import torch
from torch.overrides import TorchFunctionMode

import moescope
from moescope.capture.observer import HOOKS, RUNTIME_HOOKS
from moescope.config import Config, Metrics, Traces
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.runtime.model_config import MoEConfig

# moescope code that is the engine's own work (a bare, uninstrumented engine runs it too)
ENGINE = ("moescope.runtime.", "moescope.capture.decision", "moescope.capture.records")


def _ours(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("moescope.") or name.startswith(ENGINE):
        return False
    # the observer base classes' no-op hooks: what the engine calls with nothing attached
    return not (name == "moescope.capture.observer"
                and frame.f_code.co_qualname.startswith(("Observer.", "RuntimeObserver.")))


class _Ops(TorchFunctionMode):
    def __init__(self, counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counter[0] += 1
        return func(*args, **(kwargs or {}))


class HookWork:
    """Per hook the engine called on the instrumentation's fan-out: the Python calls into moescope's observability
    code and the torch operations of each call. The hooks are wrapped on the fan-out instance (the engine calls
    ``model.observer.on_routing`` and the rest on it), and counting is on only inside them: the engine's own work
    is neither counted nor slowed."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._n = 0
        self._ops = [0]

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and _ours(frame):
            self._n += 1

    def wrap(self, fanout) -> None:
        for hook in HOOKS + RUNTIME_HOOKS:
            fn = getattr(fanout, hook)

            def counted(*args, _fn=fn, _hook=f"FanOut.{hook}"):
                n0, ops0 = self._n, self._ops[0]
                mode = _Ops(self._ops)
                mode.__enter__()
                sys.setprofile(self._profile)
                try:
                    return _fn(*args)
                finally:
                    sys.setprofile(None)
                    mode.__exit__(None, None, None)
                    self.calls[_hook].append((self._n - n0 + 1, self._ops[0] - ops0))  # + the hook itself

            setattr(fanout, hook, counted)


def _serve(n_layers: int, batch: int, tmp_path, traces: bool, off: bool = False) -> tuple[HookWork, int]:
    """A model of ``n_layers`` MoE layers (12 experts, top-3: no preset's shape) serving ``batch + 1`` requests of
    3 to 24 tokens at ``batch`` at a time, counted on this thread; returns the work and the steps."""
    cfg = MoEConfig(name=f"work-{n_layers}", hidden_size=16, n_layers=n_layers + 1, n_heads=2, n_experts=12, top_k=3,
                    ffn_size=16, dense_layers=(0,), max_seq_len=128, seed=1)
    model = MoETransformer(cfg).eval()
    config = Config(metrics=Metrics(interval_s=60),
                    traces=Traces(str(tmp_path / f"t{n_layers}-{batch}.sqlite")) if traces else None)
    with moescope.instrument(model, config) as inst:
        if off:
            inst.capture.set(False)
        engine = Engine(model, max_batch=batch)
        for i in range(batch + 1):
            engine.submit("abcdefgh"[: 1 + i % 8], max_new_tokens=3 + (i * 7) % 22)
        steps = 0
        work = HookWork()
        work.wrap(inst.observer)
        with torch.inference_mode():
            while engine.has_work:
                engine.step()
                steps += 1
    return work, steps


@pytest.mark.parametrize("traces", [False, True], ids=["metrics", "metrics+traces"])
def test_each_hook_costs_the_same_whatever_the_layers_batch_or_tokens(tmp_path, traces):
    seen: dict[str, set] = defaultdict(set)
    per_step: dict[tuple[int, int], Counter] = {}
    for n_layers in (4, 32):
        for batch in (1, 16):
            work, steps = _serve(n_layers, batch, tmp_path, traces)
            assert work.calls, "no moescope hook ran on the engine's thread"
            counts = Counter()
            for hook, costs in work.calls.items():
                seen[hook] |= set(costs)
                counts[hook] = len(costs)
            per_step[(n_layers, batch)] = counts
            # the engine calls the per-layer hooks once per MoE layer per forward, on_step once per step
            assert counts["FanOut.on_step"] == steps
            for hook in ("FanOut.on_routing", "FanOut.on_layer_time"):
                assert counts[hook] == n_layers * steps, hook
    varying = {hook: sorted(costs) for hook, costs in seen.items() if len(costs) > 1}
    assert not varying, f"hooks whose work depends on the layers, batch or tokens: {varying}"
    ops = {hook: next(iter(costs))[1] for hook, costs in seen.items()}
    assert not any(ops.values()), f"torch operations on the engine's thread: {ops}"
    # per layer: a handful of Python calls (the fan-out and an append), never a loop
    assert all(next(iter(seen[h]))[0] <= 4 for h in ("FanOut.on_routing", "FanOut.on_layer_time"))


def test_capture_switched_off_makes_no_moescope_call_on_the_engines_thread(tmp_path):
    work, steps = _serve(4, 16, tmp_path, traces=True, off=True)
    assert steps > 0 and not work.calls
