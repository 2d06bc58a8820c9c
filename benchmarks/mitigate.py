"""What each routing mitigation buys and costs, side by side on the demo model (the README quotes it).

Load-aware routing (bound 0.85 of capacity): load CV per layer off vs on under healthy, imbalance and
collapse traffic, read from the exported counters, and the share of output tokens identical to the
unmitigated run. Router smoothing (margin 0.02): canary flip rate under jitter off vs on (mean over repeated
canary runs, per layer), and output tokens identical on the healthy model.

    python benchmarks/mitigate.py            # -> benchmarks/results/mitigate.json
    python benchmarks/mitigate.py --quick    # 16 requests, 3 canary runs (CI) -> mitigate-quick.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

import moescope  # noqa: E402
from moescope import stats  # noqa: E402
from moescope.runtime import faults, loader, traffic  # noqa: E402
from moescope.runtime.canary import Canary  # noqa: E402
from moescope.runtime.engine import Engine  # noqa: E402
from moescope.runtime.router import Mitigation  # noqa: E402


def _model(scenario: str, mitigation: Mitigation | None):
    model = loader.build_model("tiny-demo")
    faults.apply(model, [scenario] if scenario != "healthy" else [])
    for layer in model.moe_layers():
        layer.router.mitigation = mitigation
    return model


def serve(scenario: str, mitigation: Mitigation | None, n: int = 96):
    model = _model(scenario, mitigation)
    with moescope.instrument(model, port=None) as inst:
        records = Engine(model, max_batch=16).run(traffic.generate(traffic.TrafficConfig(seed=0), n),
                                                  realtime=False, id_prefix="r-")
        inst.metrics.flush()
        cv = {layer: round(stats.load_cv(c.tolist()), 3) for layer, c in sorted(inst.metrics.expert_tokens.items())}
        rerouted = {layer[0]: int(v) for (name, layer), v in inst.metrics.counters.items()
                    if name == "moescope_rerouted_slots_total"}
    return cv, {r.request_id: r.output_tokens for r in records}, rerouted


def agreement(a, b) -> float:
    pairs = [(x, y) for rid in a for x, y in zip(a[rid], b[rid])]
    return round(sum(x == y for x, y in pairs) / len(pairs), 4)


def canary_flips(scenario: str, mitigation: Mitigation | None, runs: int = 11) -> dict:
    canary = Canary(_model(scenario, mitigation), interval_s=0)
    got = [canary.run() for _ in range(runs)][1:]
    return {layer: round(float(np.mean([g[layer] for g in got])), 4) for layer in got[0]}


def main(argv: list[str] | None = None) -> None:
    ap = _results.parser(__doc__, quick="16 requests, 3 canary runs (CI keeps the script working)")
    args = _results.parse(ap, argv, "mitigate")
    n, runs = (16, 3) if args.quick else (96, 11)
    report: dict = {"load_aware": {}, "smoothing": {}, "requests": n, "canary_runs": runs}
    for scenario in _results.track(("healthy", "imbalance", "collapse"), "mitigate: load-aware routing off and on"):
        cv_off, out_off, _ = serve(scenario, None, n)
        cv_on, out_on, rerouted = serve(scenario, Mitigation(load_bound=0.85), n)
        report["load_aware"][scenario] = {"cv_off": cv_off, "cv_on": cv_on, "rerouted_slots": rerouted,
                                          "tokens_identical": agreement(out_off, out_on)}
        print(f"load-aware {scenario:9s} CV max {max(cv_off.values()):.3f} -> {max(cv_on.values()):.3f}  "
              f"({max(cv_on.values()) / max(cv_off.values()):.2f}x), tokens identical "
              f"{report['load_aware'][scenario]['tokens_identical']:.1%}")
    with _results.progress("mitigate: smoothing off and on (canary, healthy serving)", 4) as advance:
        off = canary_flips("jitter", None, runs)
        advance()
        on = canary_flips("jitter", Mitigation(smoothing_margin=0.02), runs)
        advance()
        _, h_off, _ = serve("healthy", None, n)
        advance()
        _, h_on, _ = serve("healthy", Mitigation(smoothing_margin=0.02), n)
        advance()
    report["smoothing"] = {"margin": 0.02, "jitter_flip_off": off, "jitter_flip_on": on,
                           "healthy_tokens_identical": agreement(h_off, h_on)}
    print(f"smoothing jitter flip rate max {max(off.values()):.2%} -> {max(on.values()):.2%}; healthy tokens "
          f"identical {report['smoothing']['healthy_tokens_identical']:.1%}")
    _results.save(report, args.out)


if __name__ == "__main__":
    main()
