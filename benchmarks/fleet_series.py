"""The series a fleet exports: N replicas x W expert-parallel ranks (data-parallel attention: every rank exports
its own routing), counted in a real Prometheus, and the same count for larger fleets from one formula.

The run: N replicas of ``moescope demo --world-size W`` at once (rank r of replica i exports on its replica's
metrics port + r), one Prometheus scraping every rank. Once every rank's series are in and the runs linger,
every ``moescope_*`` series is counted and classed by what it scales with, per rank:

- ``expert``: the full tier's per-(layer, expert) families (a family with an ``expert`` label and L x E series on
  a rank);
- ``held``: ``moescope_expert_physical_slots_total``: the experts the rank holds (full tier: L x E / W), or their
  sum per layer (reduced tier: L);
- ``peer``: families with a ``peer`` label (all-to-all bytes and waits: W per label set);
- ``layer``: the other families with a ``layer`` label (window gauges, counters, the load distribution, the 8 + 8
  extremes and the hot factors: per layer);
- ``rank``: the rest (timings, all-to-all histograms, cache, memory, build info).

The formula, per rank (a coefficient is the class's measured series per rank over its unit):

    series per rank = full x L x E x c_expert + held x c_held + L x c_layer + W x c_peer + c_rank
    held            = L x E / W in the full tier, L in the reduced one
    full            = 1 when L x E <= 16,384 / W (each rank's share of the per-expert budget), else 0
    series in all   = replicas x W x series per rank

The hot factors (0-8 per layer) depend on the traffic: ``c_layer`` is the measured one.

The formula is then checked on a fleet it was not fitted on: one replica of twice the ranks (``held_out``: its
measured count beside the formula's, class by class; tests/test_fleet.py asserts they agree, the ``layer`` class
within the hot factors' range of 0-8 per layer and rank).

    python benchmarks/fleet_series.py             # deepseek-v3-shape, 2 replicas x 2 ranks -> results/fleet_series.json
    python benchmarks/fleet_series.py --quick     # tiny-demo (the full tier) -> fleet_series-quick.json
    python benchmarks/fleet_series.py --markdown benchmarks/results/fleet_series.json   # the docs' table
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/servers.py: the real Prometheus the tests start
import _results  # noqa: E402
from servers import Prometheus, free_port  # noqa: E402

BUDGET = 16_384  # moescope.metrics.state.EXPERT_SERIES_BUDGET (read below; here for the docstring's formula)
CLASSES = ("expert", "held", "layer", "peer", "rank")
# Deployments the docs quote: (label, replicas, ranks per replica, MoE layers, experts)
DEPLOYMENTS = (("58 x 256, 8 replicas x 8 ranks", 8, 8, 58, 256), ("58 x 256, 1 replica x 72 ranks", 1, 72, 58, 256))


def series(prom_url: str) -> list[dict]:
    q = urllib.parse.urlencode({"match[]": '{__name__=~"moescope_.+"}', "start": time.time() - 30})
    with urllib.request.urlopen(f"{prom_url}/api/v1/series?{q}", timeout=60) as r:
        return json.load(r)["data"]


def classify(rows: list[dict], n_layers: int, n_experts: int) -> dict:
    """Series per class, per rank (instance) and in all, and per family."""
    per_family_rank = Counter((s["__name__"], s["instance"]) for s in rows)
    ranks = sorted({s["instance"] for s in rows})
    out = {c: 0 for c in CLASSES}
    # per family, its series by class: one family may hold series of two classes (moescope_judgement_bar: per layer
    # for the routing judgements, per model for the model-wide ones)
    families: dict[str, dict] = defaultdict(lambda: {"series": 0, "by_class": Counter()})
    for s in rows:
        name = s["__name__"]
        if name == "moescope_expert_physical_slots_total":
            c = "held"
        elif "expert" in s and per_family_rank[(name, s["instance"])] == n_layers * n_experts:
            c = "expert"
        elif "peer" in s:
            c = "peer"
        elif "layer" in s:
            c = "layer"
        else:
            c = "rank"
        out[c] += 1
        families[name]["by_class"][c] += 1
        families[name]["series"] += 1
    return {"by_class": out, "ranks": len(ranks), "total": len(rows),
            "per_rank": dict(sorted(Counter(s["instance"] for s in rows).items())),
            "families": {name: {"series": f["series"], "by_class": dict(sorted(f["by_class"].items()))}
                         for name, f in sorted(families.items())}}


def coefficients(measured: dict, world: int, n_layers: int, n_experts: int) -> dict:
    """Each class's series per rank over its unit (what the formula multiplies)."""
    n = measured["ranks"]
    by = measured["by_class"]
    return {"expert": by["expert"] / n / (n_layers * n_experts),
            "held": by["held"] / n / _held(world, n_layers, n_experts), "layer": by["layer"] / n / n_layers,
            "peer": by["peer"] / n / world, "rank": by["rank"] / n}


def _full(world: int, n_layers: int, n_experts: int, budget: int = BUDGET) -> bool:
    """Whether a rank exports the full tier: its share of the per-expert budget holds L x E."""
    return n_layers * n_experts <= budget // world


def _held(world: int, n_layers: int, n_experts: int) -> float:
    """A rank's physical-slot series: its held experts per layer (full tier), one per layer (reduced)."""
    return n_layers * n_experts / world if _full(world, n_layers, n_experts) else n_layers


def predict(coef: dict, replicas: int, world: int, n_layers: int, n_experts: int) -> dict:
    full = _full(world, n_layers, n_experts)
    per_rank = {"expert": (n_layers * n_experts * coef["expert"]) if full else 0.0,
                "held": _held(world, n_layers, n_experts) * coef["held"], "layer": n_layers * coef["layer"],
                "peer": world * coef["peer"], "rank": coef["rank"]}
    return {"tier": "full" if full else "reduced", "per_rank": round(sum(per_rank.values()), 1),
            "total": round(replicas * world * sum(per_rank.values())),
            "by_class": {c: round(replicas * world * v) for c, v in per_rank.items()}}


def run(model: str, replicas: int, world: int, requests: int, linger: float) -> dict:
    from moescope.metrics.state import EXPERT_SERIES_BUDGET
    from moescope.runtime import loader

    assert EXPERT_SERIES_BUDGET == BUDGET, "the formula's budget is the exporter's"
    cfg = loader.build_model(model).cfg if model == "tiny-demo" else None
    ports = [free_port(world) for _ in range(replicas)]
    tmp = Path(tempfile.mkdtemp(prefix="fleet-series-"))
    prom = Prometheus(tmp, [f"127.0.0.1:{p + r}" for p in ports for r in range(world)])
    procs = []
    try:
        for i, p in enumerate(ports):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "moescope", "demo", "--no-tui", "--model", model, "--world-size", str(world),
                 "--requests", str(requests), "--rate", "0", "--metrics-port", str(p), "--traces", "none",
                 "--seed", str(i), "--linger", str(linger), "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        n_targets = replicas * world
        deadline = time.time() + linger + 900
        rows: list[dict] = []
        while time.time() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            up = json.load(urllib.request.urlopen(
                prom.url + "/api/v1/query?" + urllib.parse.urlencode({"query": "count(moescope_steps_total)"}),
                timeout=30))["data"]["result"]
            if up and int(up[0]["value"][1]) >= n_targets:  # every rank has stepped: its routing families exist
                time.sleep(5)  # a few more scrapes: each rank's families as they are while it lingers
                rows = series(prom.url)
                break
            time.sleep(1)
        outs = [p.communicate(timeout=linger + 900) for p in procs]
        if any(p.returncode for p in procs) or not rows:
            raise SystemExit("a replica failed or Prometheus saw too few ranks:\n"
                             + "\n".join(e[-2000:] for _, e in outs))
        summary = json.loads(outs[0][0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        prom.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # Prometheus' TSDB: tens of MB a run
    n_layers = len(summary["expert_load"])
    n_experts = len(next(iter(summary["expert_load"].values())))
    if cfg is not None:
        assert n_experts == cfg.n_experts
    measured = classify(rows, n_layers, n_experts)
    coef = coefficients(measured, world, n_layers, n_experts)
    check = predict(coef, replicas, world, n_layers, n_experts)
    return {"model": model, "replicas": replicas, "world_size": world, "moe_layers": n_layers, "experts": n_experts,
            "requests_per_replica": requests, "measured": measured, "coefficients": coef,
            "formula_at_measured": check,
            "deployments": {label: {"replicas": r, "world_size": w, "moe_layers": L, "experts": E,
                                    **predict(coef, r, w, L, E)} for label, r, w, L, E in DEPLOYMENTS}}


def markdown(path: str) -> str:
    d = json.loads(Path(path).read_text())
    m = d["measured"]
    lines = ["| deployment | tier | series per rank | series in all | of which per peer | of which per layer |",
             "|---|---|---|---|---|---|",
             f"| {d['moe_layers']} x {d['experts']}, {d['replicas']} replicas x {d['world_size']} ranks (measured: "
             f"{m['total']:,} series, per rank {', '.join(f'{v:,}' for v in m['per_rank'].values())}) | "
             f"{d['formula_at_measured']['tier']} | {d['formula_at_measured']['per_rank']:,} | {m['total']:,} | "
             f"{m['by_class']['peer']:,} | {m['by_class']['layer']:,} |"]
    h = d.get("held_out")
    if h:
        hm, hf = h["measured"], h["formula"]
        lines.append(f"| {d['moe_layers']} x {d['experts']}, {h['replicas']} replica x {h['world_size']} ranks (held "
                     f"out: measured {hm['total']:,} series) | {hf['tier']} | {hf['per_rank']:,} | {hf['total']:,} | "
                     f"{hf['by_class']['peer']:,} (measured {hm['by_class']['peer']:,}) | {hf['by_class']['layer']:,} "
                     f"(measured {hm['by_class']['layer']:,}) |")
    for label, p in d["deployments"].items():
        lines.append(f"| {label} (formula) | {p['tier']} | {p['per_rank']:,} | {p['total']:,} | "
                     f"{p['by_class']['peer']:,} | {p['by_class']['layer']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="tiny-demo, few requests (CI keeps the script working)")
    ap.add_argument("--markdown", metavar="RESULTS", help="print the docs' table from a results file")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=2)
    args = _results.parse(ap, argv, "fleet_series")
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    model = "tiny-demo" if args.quick else "deepseek-v3-shape"
    requests, linger = (4, 10) if args.quick else (8, 20)
    report = run(model, args.replicas, args.world_size, requests=requests, linger=linger)
    world = 2 * args.world_size  # the held-out fleet: one replica of twice the ranks
    other = run(model, 1, world, requests=requests, linger=linger)
    report["held_out"] = {"replicas": 1, "world_size": world, "measured": other["measured"],
                          "formula": predict(report["coefficients"], 1, world, report["moe_layers"],
                                             report["experts"])}
    _results.save(report, args.out)
    print(markdown(str(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
