"""A deepseek-v3-shaped trace store for the trace viewer's, `trace --json`'s and `requests`' tests and for
benchmarks/scale.py: the real model (58 MoE layers x 256 experts, top-8; random init, so no balance build)
served by the real engine into the real ``TraceRecorder``, with one request of ``tokens`` positions
(prompt + output) and a few short ones."""

from __future__ import annotations

from pathlib import Path

PRESET = "deepseek-v3-shape"


def long_prompt(n_bytes: int) -> str:
    text = "def route(tokens, experts):\n    return sorted(experts, key=lambda e: -e.score)[:8]\n"
    return (text * (n_bytes // len(text) + 1))[:n_bytes]


def build(path: str | Path, *, tokens: int = 300, short: int = 3) -> list:
    """Serve into the store at ``path``; returns the finished request records (the long one first)."""
    import moescope
    from moescope.runtime import loader
    from moescope.runtime.engine import Engine
    from moescope.traces.recorder import TraceRecorder

    model = loader.build_model(PRESET, weights=None)
    recorder = TraceRecorder(str(path), model=PRESET)
    with moescope.instrument(model, observers=[recorder]):
        engine = Engine(model, max_batch=4)
        n_out = tokens // 3
        engine.submit(long_prompt(tokens - n_out - 1), max_new_tokens=n_out, domain="code", tenant="tenant-a")
        for i in range(short):
            engine.submit(long_prompt(24 + 8 * i), max_new_tokens=4, domain="prose", tenant="tenant-b")
        while engine.has_work:
            engine.step()
    return sorted(engine.finished, key=lambda r: -(len(r.prompt_tokens) + r.n_output))
