"""A calibration pass: the expert load of held-out traffic, measured outside any served run's instrumentation.

Used where a known-good reference is needed before serving: the ``static`` expert cache pins the most used
experts of such a pass; the drift scenario measures drift against the load of the normal mix.
"""

from __future__ import annotations

from moescope.runtime import traffic

# A seed offset so the calibration traffic is never the served traffic (which is seeded by the same seed).
HELD_OUT_SEED_OFFSET = 7919


def held_out_pass(model, seed: int, n_requests: int, observer) -> None:
    """Serve ``n_requests`` short held-out requests of the normal mix to ``observer`` alone; the model's
    observer is restored afterwards, so the pass reaches no metric, trace or log of the served run."""
    from moescope.runtime.engine import Engine  # start-up: torch (runtime.engine), only when held_out_pass() runs

    previous = model.observer
    try:
        Engine(model, max_batch=8, observer=[observer]).run(
            traffic.generate(traffic.TrafficConfig(seed=seed + HELD_OUT_SEED_OFFSET, output_tokens_median=8),
                             n_requests), realtime=False)
    finally:
        model.observer = previous


def calibration_load(model, seed: int, n_requests: int = 16) -> dict[int, list[int]]:
    """Slots per expert per MoE layer of ``n_requests`` short held-out requests (``held_out_pass``)."""
    # start-up: torch (capture.probes), only when calibration_load() runs
    from moescope.capture.probes import ExpertLoadProbe

    calib = ExpertLoadProbe()
    held_out_pass(model, seed, n_requests, calib)
    return calib.snapshot()
