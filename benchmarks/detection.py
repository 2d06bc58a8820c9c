"""Detection power and false alarms through the real alerting path, on models no code knows by name.

Each shape (tiny-demo, qwen3-moe-shape, deepseek-v3-shape; and five shapes no preset has, ``CUSTOM``: wide-384,
top6-64, grouped-160, interleaved-128, top10-512) runs under a new name (a YAML ``preset: X`` or the whole config, +
``name: acme-X``; tiny-demo keeps its trained weights). ``--traffic broad,narrow`` runs the healthy rows on the
demo's broad mix and on narrow traffic (``demo --prompts 4``: four prompts repeated, the same four in the baseline
run and after).
Every run is the end-to-end path of the detection
matrix (tests/pipeline.py): ``moescope demo`` -> its exporter -> a real Prometheus evaluating the generated
rules with every ``for`` shrunk 30-fold -> a real Alertmanager with the repo's routing and inhibitions -> a
webhook. Times to detect count from Prometheus' first scrape, which starts 12 s after the exporter answers.

- False alarms: healthy traffic for ``--healthy-s`` seconds per shape (5 minutes by default) with a trace
  store, then ``moescope baseline save`` from that store and another healthy run (another traffic seed) with
  ``--baseline``: every alert delivered other than the Watchdog is a false alarm.
- Power: per shape and fault, magnitudes from the largest down, one run each, until one is not detected
  within the watch (smaller ones are then not run: the sweep assumes detection is monotone in the magnitude).
  Faults and what detects them: ``hot=L:E:Fx`` (one expert of the middle MoE layer at F times its fair share on
  calibration traffic) -> MoEExpertHot naming that layer and expert; ``imbalance=S`` (the graded bias x S) ->
  MoEExpertLoadImbalance; ``collapse=B`` (bias B on expert 0) -> MoEExpertCollapse; ``drop=CF`` (capacity
  factor) -> MoETokensDropped. Each run's realised size is measured from its own trace store (the hot expert's
  share over the fair share, the worst layer's load CV, the busiest expert's share of a layer's slots, the
  dropped share of the slots), never assumed.

Results: benchmarks/results/detection.json (``--quick``: detection-quick.json, tiny-demo only, about a minute).
docs/alerts.md ("Detection power") quotes the full run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # the matrix's alerting path: tests/pipeline.py, tests/servers.py
import _results  # noqa: E402
import pipeline  # noqa: E402
from pipeline import SHAPE_HOT_WATCH_S, SHAPE_HOT_WINDOW_S  # noqa: E402

# Settings per shape. The shapes serve ~35 tokens/s on 2 shared cores: thin traffic (a request every 2 s), 2 s
# scrapes (a 58 x 256 exposition is ~1.6 MB), minutes to start several at once.
# window_s: the exporter's window in the healthy and hot runs (None: the default 60 s); hot_watch_s: the hot
# runs' watch (None: watch_s). At the shapes both are the detection matrix's (tests/pipeline.py SHAPE_HOT_*: why
# there), so false alarms are counted at the settings power is measured at.
SHAPES = {
    "tiny-demo": {"rate": 8.0, "scrape": "1s", "start_s": 120, "watch_s": 60, "window_s": None, "hot_watch_s": None},
    **{shape: {"rate": 0.5, "scrape": "2s", "start_s": 300, "watch_s": 100, "window_s": SHAPE_HOT_WINDOW_S,
               "hot_watch_s": SHAPE_HOT_WATCH_S} for shape in ("qwen3-moe-shape", "deepseek-v3-shape")},
}
# Shapes no preset has (issue [judge]: healthy traffic paged popular experts of a 384-expert model), written as
# whole configs under their acme- names: a 384-expert sigmoid model in groups with a shared expert, a 64-expert
# top-6 softmax model with two shared experts, a 160-expert grouped softmax model. Small widths (CPU); the
# routing shape (E, k, groups, shared experts, layers) is what the judgement sees.
CUSTOM = {
    "wide-384": {"hidden_size": 32, "n_layers": 9, "n_heads": 2, "n_experts": 384, "top_k": 8, "ffn_size": 16,
                 "dense_layers": [0], "scoring": "sigmoid", "n_group": 8, "topk_group": 4, "correction_bias": True,
                 "routed_scaling_factor": 2.5, "n_shared_experts": 1, "max_seq_len": 512, "seed": 3},
    "top6-64": {"hidden_size": 32, "n_layers": 9, "n_heads": 2, "n_experts": 64, "top_k": 6, "ffn_size": 16,
                "dense_layers": [0], "n_shared_experts": 2, "max_seq_len": 512, "seed": 4},
    "grouped-160": {"hidden_size": 32, "n_layers": 9, "n_heads": 2, "n_experts": 160, "top_k": 6, "ffn_size": 16,
                    "dense_layers": [0], "n_group": 8, "topk_group": 3, "max_seq_len": 512, "seed": 5},
    # Issue [learned]: top-1 sigmoid routing with MoE on every other block (dense FFNs between) and a shared
    # expert, 128 experts (the Llama-4 family's routing shape); and top-10 of 512 softmax with a shared expert
    # (Qwen3-Next's). Under top-1 or narrow traffic most experts idle and the load is uneven by design.
    "interleaved-128": {"hidden_size": 32, "n_layers": 8, "n_heads": 2, "n_experts": 128, "top_k": 1,
                        "ffn_size": 16, "dense_layers": [0, 2, 4, 6], "scoring": "sigmoid", "n_shared_experts": 1,
                        "max_seq_len": 512, "seed": 6},
    "top10-512": {"hidden_size": 32, "n_layers": 6, "n_heads": 2, "n_experts": 512, "top_k": 10, "ffn_size": 16,
                  "n_shared_experts": 1, "max_seq_len": 512, "seed": 8},
}
SHAPES.update({shape: {"rate": 4.0, "scrape": "1s", "start_s": 180, "watch_s": 60, "window_s": None,
                       "hot_watch_s": None} for shape in CUSTOM})
# Narrow traffic (--traffic narrow): a few prompts repeated (demo --prompts), as a product with fixed templates.
NARROW_PROMPTS = 4
# Magnitudes, largest first. hot: factors over the fair share (those a model can reach: below E/k).
SWEEP = {
    "hot": [8.0, 6.0, 4.5, 3.0, 2.0],
    "imbalance": [4.0, 2.0, 1.0, 0.5],
    "collapse": [8.0, 4.0, 2.0, 1.0],
    "drop": [0.5, 0.75, 1.0, 1.5],
}
EXPECTED = {"hot": "MoEExpertHot", "imbalance": "MoEExpertLoadImbalance", "collapse": "MoEExpertCollapse",
            "drop": "MoETokensDropped"}
HOT_EXPERT = 5
# Routing alerts that page for a fault in its expected alert's place (the Alertmanager inhibits the imbalance
# and hot alerts under a collapse): a run that delivers one is not a miss, and the sweep goes on down.
PAGES_INSTEAD = ("MoEExpertCollapse", "MoEExpertLoadImbalance", "MoEExpertHot")
SETTLE_S = 5
# --hot-reference learned (the product's default without a baseline): the hot fault switches on mid-run
# (``demo --fault-after``), once the exporter has learned its reference from a first full window. These runs use a
# LEARN_WINDOW_S window (the custom shapes serve 4 requests/s: ~80 a window); learning starts at the first scrape
# that sees routing (Prometheus starts pipeline.WARMUP_S after the exporter answers) and ends a window later, so
# the fault comes a window after that (FAULT_AFTER_S from instrumenting), and the watch runs a minute past it.
LEARN_WINDOW_S = 20
FAULT_AFTER_S = 60
LEARNED_WATCH_S = FAULT_AFTER_S + 60


def learned_timing(window_s: float) -> tuple[float, float]:
    """(fault after, watch) for a ``--learn-window`` of ``window_s``: the reference is learned a window after the
    first scrape, so the switch moves with the window (the same margin as at LEARN_WINDOW_S), and the watch runs
    three windows past it (at 20 s: a minute), time for a window of the fault's requests, the alert's scaled
    ``for`` and its delivery."""
    fault_after = FAULT_AFTER_S + (window_s - LEARN_WINDOW_S)
    return fault_after, fault_after + 3 * window_s
# (rate: the quick run's five demos start at once beside the rest of CI's suite: at 4 requests/s each asks for ~0.4
# of a core, as the detection matrix's tiny rows, tests/test_detection_matrix.py TINY_RATE)
QUICK = {"shapes": ["tiny-demo"], "healthy_s": 30, "watch_s": 30, "baseline": False, "rate": 4.0,
         "sweep": {"hot": [3.0], "imbalance": [4.0], "collapse": [8.0], "drop": [0.5]}, "chain": False}


def renamed(shape: str, out: Path) -> tuple[str, list[str]]:
    """(model spec, demo args) for ``shape`` under a name no code knows."""
    import yaml

    from moescope.runtime import weights

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"acme-{shape}.yaml"
    if not path.exists():  # (threads share it: written once, atomically)
        tmp = out / f".acme-{shape}.{os.getpid()}.{threading.get_ident()}"
        body = {"name": f"acme-{shape}", **CUSTOM[shape]} if shape in CUSTOM else {"preset": shape,
                                                                                   "name": f"acme-{shape}"}
        tmp.write_text(yaml.safe_dump(body, sort_keys=False))
        tmp.replace(path)
    args = ["--weights", str(weights.DEMO_WEIGHTS)] if shape == "tiny-demo" else []
    return str(path), args


def thresholds():
    from moescope.alerts import rules

    # Every `for` / 30, and the memory trend's window (30 min, 60 s scaled) x3 as the matrix at shape: a young
    # process's start-up growth is not a leak (production's 30 min window never sees a process this young).
    return rules.Thresholds(for_scale=1 / 30, memory_window_s=3 * 1800)


def hot_layer(spec: str) -> int:
    """The middle MoE layer (the label metrics use: the block index)."""
    from moescope.runtime.model_config import resolve

    cfg = resolve(spec)
    layers = [i for i in range(cfg.n_layers) if i not in cfg.dense_layers]
    return layers[len(layers) // 2]


def store_figures(store: Path, fault: str, layer: int | None, fault_after_s: float | None = None) -> dict:
    """The realised size of the fault from the run's own trace store. ``fault_after_s``: the fault switched on
    mid-run; the hot expert's share after it is also given over its share before it (requests that started
    more than a second before or after the switch, reckoned from the first stored request's start)."""
    from moescope.traces.store import CorruptRows, iter_routed, open_store

    if not store.exists():
        return {"requests_stored": 0}
    conn = open_store(store)
    totals: dict[int, np.ndarray] = {}
    split: dict[str, np.ndarray] = {}  # before / after the fault switched on: the hot layer's slots
    n_req, n_exp, first = 0, None, None
    try:
        for r in iter_routed(conn, corrupt=CorruptRows(warn=None)):
            n_req, n_exp = n_req + 1, r.n_experts
            first = r.started if first is None else first
            for j, lay in enumerate(r.layers):
                c = np.bincount(r.ids[:, j].ravel(), minlength=r.n_experts + 1)  # id E: a dropped slot
                totals[lay] = totals.get(lay, 0) + c
                if fault_after_s is not None and lay == layer:
                    at = r.started - first - fault_after_s
                    if abs(at) > 1.0:
                        side = "after" if at > 0 else "before"
                        split[side] = split.get(side, 0) + c
    finally:
        conn.close()
    out: dict = {"requests_stored": n_req}
    if not totals:
        return out
    kept = {lay: c[:n_exp].astype(np.float64) for lay, c in totals.items()}
    cv = {lay: float(k.std() / k.mean()) for lay, k in kept.items() if k.sum() > 0}
    out["worst_layer_load_cv"] = round(max(cv.values()), 3)
    out["median_layer_load_cv"] = round(float(np.median(list(cv.values()))), 3)
    if fault == "collapse":
        out["max_expert_slot_share"] = round(max(float(k.max() / k.sum()) for k in kept.values()), 3)
    if fault == "drop":
        dropped = sum(float(c[n_exp]) for c in totals.values())
        out["dropped_slot_share"] = round(dropped / sum(float(c.sum()) for c in totals.values()), 4)
    if fault == "hot" and layer in kept:
        k = kept[layer]
        out["hot_factor_measured"] = round(float(k[HOT_EXPERT] / k.sum() * n_exp), 2)
        others = [float(v[HOT_EXPERT] / v.sum() * n_exp) for lay, v in kept.items() if lay != layer]
        out["same_expert_other_layers_median_factor"] = round(float(np.median(others)), 2) if others else None
        if "before" in split and "after" in split:
            before, after = (split[x][:n_exp].astype(np.float64) for x in ("before", "after"))
            b, a = before[HOT_EXPERT] / max(before.sum(), 1), after[HOT_EXPERT] / max(after.sum(), 1)
            out["hot_share_before_over_fair"] = round(float(b * n_exp), 2)
            out["hot_factor_after_over_fair"] = round(float(a * n_exp), 2)
            # what the learned reference judges: the share after over the share before (never below 1/E)
            out["hot_factor_over_before"] = round(float(a / max(b, 1.0 / n_exp)), 2)
    return out


def _alert_key(a: dict) -> str:
    labels = a["labels"]
    extra = [f"{k}={labels[k]}" for k in ("layer", "expert", "reference", "peer") if k in labels]
    return labels["alertname"] + (f"{{{','.join(extra)}}}" if extra else "")


def _delivered(got) -> list[str]:
    return sorted({_alert_key(a) for _, a in got.alerts if a["status"] == "firing"
                   and a["labels"]["alertname"] != "Watchdog"})


def _watchdog(got) -> bool:
    return any(a["labels"]["alertname"] == "Watchdog" for _, a in got.alerts)


def run_one(base: Path, shape: str, scenario: str, watch_s: float, *, matches=None, demo_args=(),
            seed: int = 0, window_s: float | None = None) -> dict:
    """One demo through the alerting path; ``matches(alert)`` marks the expected alert (None: healthy)."""
    import pipeline

    cfg = SHAPES[shape]
    spec, model_args = renamed(shape, base.parent.parent)
    if window_s is not None:
        model_args = [*model_args, "--metrics-window", f"{window_s:g}"]
    store = base / "traces.sqlite"
    stop = None if matches is None else (lambda alerts: any(a["status"] == "firing" and matches(a)
                                                            for _, a in alerts))
    started = time.time()
    try:
        got = pipeline.run(base, scenario, watch_s, stop_when=stop, settle_s=SETTLE_S, model=spec,
                           rate=cfg["rate"], traces=str(store), scrape_interval=cfg["scrape"],
                           start_timeout_s=cfg["start_s"], thresholds=thresholds(),
                           demo_args=[*model_args, "--seed", str(seed), *demo_args])
    except Exception as exc:  # a run that broke is a row saying so, not a lost sweep
        return {"scenario": scenario, "error": f"{type(exc).__name__}: {str(exc)[-600:]}",
                "wall_s": round(time.time() - started, 1)}
    row = {"scenario": scenario, "watch_s": watch_s, "window_s": window_s or 60, "watchdog": _watchdog(got),
           "delivered": _delivered(got), "wall_s": round(time.time() - started, 1)}
    if matches is not None:
        hits = [t for t, a in got.timeline if a["status"] == "firing" and matches(a)]
        row["detected"] = bool(hits)
        row["seconds_to_detect"] = min(hits) if hits else None
    return row


def healthy(out: Path, shape: str, seconds: float, with_baseline: bool, traffic: str = "broad") -> dict:
    """Healthy runs, no baseline then with one saved from the first. ``traffic``: broad (the demo's mix), or
    narrow (``NARROW_PROMPTS`` prompts repeated: the second run repeats the same prompts in another order)."""
    narrow = ["--prompts", str(NARROW_PROMPTS)] if traffic == "narrow" else []
    suffix = "" if traffic == "broad" else f"-{traffic}"
    base = out / shape / f"healthy{suffix}"
    window = SHAPES[shape]["window_s"]
    row = {"traffic": traffic, "no_baseline": run_one(base, shape, "healthy", seconds, window_s=window,
                                                      demo_args=narrow)}
    row["no_baseline"].update(store_figures(base / "traces.sqlite", "healthy", None))
    if with_baseline and "error" not in row["no_baseline"]:
        bl = out / shape / f"baseline{suffix}.json"
        save_run = subprocess.run([sys.executable, "-m", "moescope", "baseline", "save", "--traces",
                                   str(base / "traces.sqlite"), "--out", str(bl)], capture_output=True, text=True)
        if save_run.returncode != 0:
            row["with_baseline"] = {"error": "baseline save failed: " + save_run.stderr[-600:]}
        else:
            row["baseline_saved"] = save_run.stdout.strip()[-300:]
            b2 = out / shape / f"healthy-baseline{suffix}"
            row["with_baseline"] = run_one(b2, shape, "healthy", seconds, demo_args=["--baseline", str(bl), *narrow],
                                          seed=1, window_s=window)
            row["with_baseline"].update(store_figures(b2 / "traces.sqlite", "healthy", None))
    for part in ("no_baseline", "with_baseline"):
        if part in row and "delivered" in row[part]:
            row[part]["false_alerts"] = len(row[part]["delivered"])
    return row


def _scenario(fault: str, magnitude: float, layer: int) -> str:
    return f"hot={layer}:{HOT_EXPERT}:{magnitude:g}x" if fault == "hot" else f"{fault}={magnitude:g}"


def _matcher(fault: str, layer: int):
    name = EXPECTED[fault]
    if fault == "hot":
        return lambda a: (a["labels"]["alertname"] == name and a["labels"].get("layer") == str(layer)
                          and a["labels"].get("expert") == str(HOT_EXPERT))
    return lambda a: a["labels"]["alertname"] == name


def sweep(out: Path, shape: str, fault: str, magnitudes: list[float], watch_s: float, chain: bool,
          traffic: str = "broad", hot_reference: str = "fair", learn_window_s: float = LEARN_WINDOW_S) -> dict:
    """One fault's magnitudes, largest first; with ``chain``, stop after the first one not detected.
    ``hot_reference`` (hot only): fair (the fault on from the start, judged against 1/E) or learned (the default
    reference; the fault switched on mid-run, FAULT_AFTER_S). ``traffic``: broad or narrow (hot only)."""
    learned = fault == "hot" and hot_reference == "learned"
    narrow = ["--prompts", str(NARROW_PROMPTS)] if traffic == "narrow" else []
    spec, _ = renamed(shape, out)
    layer = hot_layer(spec)
    from moescope.runtime.model_config import resolve

    cfg = resolve(spec)
    reach = cfg.n_experts / cfg.top_k
    rows, skipped = [], []
    for m in magnitudes:
        if fault == "hot" and m >= 0.95 * reach:
            skipped.append({"magnitude": m, "why": f"out of reach: E/k = {reach:g} (every token choosing it)"})
            continue
        scenario = _scenario(fault, m, layer)
        tag = "" if fault != "hot" or (traffic, hot_reference) == ("broad", "fair") else f"-{traffic}-{hot_reference}"
        base = out / shape / (scenario.replace("=", "-").replace(":", "_") + tag)
        hot = fault == "hot"
        if learned:
            fault_after, learned_watch = learned_timing(learn_window_s)
            row = run_one(base, shape, scenario, learned_watch, matches=_matcher(fault, layer),
                          window_s=learn_window_s, demo_args=["--fault-after", f"{fault_after:g}", *narrow])
            row.update(fault_after_s=fault_after, traffic=traffic)
            if row.get("detected"):  # the watch starts WARMUP_S (+ Prometheus' start) after instrumenting
                row["seconds_after_fault_at_least"] = round(row["seconds_to_detect"] + pipeline.WARMUP_S
                                                            - fault_after, 1)
        else:
            # The fault is on from the first request: judged against the fair share (the default reference is
            # learned from the first window, fault included)
            row = run_one(base, shape, scenario, (hot and SHAPES[shape]["hot_watch_s"]) or watch_s,
                          matches=_matcher(fault, layer), window_s=SHAPES[shape]["window_s"] if hot else None,
                          demo_args=["--hot-reference", "fair", *narrow] if hot else ())
            row["traffic"] = traffic
        row["magnitude"] = m
        if hot:
            row["hot_reference"] = hot_reference
        row.update(store_figures(base / "traces.sqlite", fault, layer, row.get("fault_after_s") if learned else None))
        row["others_delivered"] = [d for d in row.get("delivered", []) if not d.startswith(EXPECTED[fault])]
        # Paged at all: the expected alert, or a routing alert that inhibits it (a strong imbalance or hot
        # expert on a small model is a collapse: MoEExpertCollapse pages and holds the imbalance alert back).
        row["paged"] = bool(row.get("detected")) or any(d.split("{")[0] in PAGES_INSTEAD
                                                        for d in row.get("delivered", []))
        rows.append(row)
        print(f"  {shape} {scenario}: detected={row.get('detected')} in {row.get('seconds_to_detect')} s "
              f"{row.get('delivered')} {row.get('error', '')}", flush=True)
        if chain and not row["paged"]:
            break
    detected = [r["magnitude"] for r in rows if r.get("detected")]
    knob_larger = fault != "drop"  # drop: a smaller capacity factor is the larger fault
    smallest = (min(detected) if knob_larger else max(detected)) if detected else None
    # switched on mid-run: from the switch (at least); else from Prometheus' first scrape
    ttd = [r.get("seconds_after_fault_at_least", r["seconds_to_detect"]) for r in rows if r.get("detected")]
    return {"fault": fault, "traffic": traffic, "hot_reference": hot_reference if fault == "hot" else None,
            "expected_alert": EXPECTED[fault], "hot_layer": layer if fault == "hot" else None,
            "hot_expert": HOT_EXPERT if fault == "hot" else None, "runs": rows, "not_run": skipped,
            "smallest_detected": smallest, "seconds_to_detect_median": float(np.median(ttd)) if ttd else None,
            "magnitude_means": {"hot": "target factor over the fair share (calibration traffic)",
                                "imbalance": "scale of the graded bias (1 = 0.8 on e0 .. 0 on the last)",
                                "collapse": "logit bias on expert 0", "drop": "capacity factor"}[fault]}


def prebuild(shapes: list[str], out: Path) -> None:
    """Build each renamed model once here (its balanced routers are cached under its own name): demos
    starting at once would each build them within the exporter's start-up wait."""
    from moescope.runtime import loader

    for shape in shapes:
        spec, args = renamed(shape, out)
        t = time.time()
        loader.build_model(spec, weights=args[1] if args else "auto")
        print(f"built {spec} in {time.time() - t:.0f} s", flush=True)


def main() -> None:
    ap = _results.parser(__doc__, quick="tiny-demo only, one magnitude per fault (about a minute; CI)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--faults", default=",".join(SWEEP))
    ap.add_argument("--healthy-s", type=float, default=300.0, help="seconds of healthy traffic per run")
    ap.add_argument("--parallel", type=int, default=3, help="demos at once")
    ap.add_argument("--traffic", default="broad", help="healthy traffic: broad, narrow (a few prompts repeated) "
                                                        "or both (broad,narrow)")
    ap.add_argument("--hot-reference", default="fair", choices=("fair", "learned"),
                    help="the hot sweep: fair (the fault on from the start, judged against 1/E: --hot-reference "
                         "fair) or learned (the default reference; the fault switched on mid-run)")
    ap.add_argument("--magnitudes", default=None, help="comma-separated magnitudes for every fault asked, largest "
                                                        "first (default: each fault's SWEEP)")
    ap.add_argument("--learn-window", type=float, default=LEARN_WINDOW_S,
                    help="--hot-reference learned: the exporter's window in the hot runs, from which the reference "
                         "is learned and the fault judged (the switch and the watch move with it: learned_timing)")
    ap.add_argument("--work", default=None, help="directory for the runs' files (default: a temporary one)")
    ap.add_argument("--markdown", metavar="RESULTS", default=None,
                    help="print the docs' tables from a results file and exit (no run)")
    args = _results.parse(ap, None, "detection")
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="moescope-detection-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        _run(args, work)
    finally:
        if args.work is None:  # the runs' Prometheus TSDBs and logs: tens to hundreds of MB
            shutil.rmtree(work, ignore_errors=True)


def _run(args, work: Path) -> None:
    if args.quick:
        shapes, healthy_s, baseline, chain = QUICK["shapes"], QUICK["healthy_s"], QUICK["baseline"], QUICK["chain"]
        sweeps = QUICK["sweep"]
        for s in shapes:  # (read by run_one and written into the results file)
            SHAPES[s] = {**SHAPES[s], "rate": QUICK["rate"]}
    else:
        shapes, healthy_s, baseline, chain = args.shapes.split(","), args.healthy_s, True, True
        sweeps = {f: SWEEP.get(f, []) for f in args.faults.split(",") if f}
        if args.magnitudes:
            try:
                sweeps = {f: [float(m) for m in args.magnitudes.split(",")] for f in sweeps}
            except ValueError:
                print(f"--magnitudes must be numbers, got {args.magnitudes!r}", file=sys.stderr)
                sys.exit(2)
    traffics = ["broad"] if args.quick else args.traffic.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [f for f in sweeps if f not in SWEEP] + \
        [t for t in traffics if t not in ("broad", "narrow")]
    if unknown:
        print(f"unknown shape(s)/fault(s): {', '.join(unknown)}", file=sys.stderr)
        sys.exit(2)
    if not args.learn_window > 0:
        print(f"--learn-window must be > 0 seconds, got {args.learn_window:g}", file=sys.stderr)
        sys.exit(2)
    t0 = time.time()
    # the code measured is the code at the start (the runs take half an hour: a commit meanwhile is not it)
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = [x for x in _git("status", "--porcelain", "-uno").split("\n") if x]
    prebuild(shapes, work)
    # the hot sweep runs on every traffic asked for; the other faults on the broad mix
    jobs = [(s, f, t) for f in sweeps for s in shapes for t in (traffics if f == "hot" else ["broad"])]
    watch = {s: QUICK["watch_s"] if args.quick else SHAPES[s]["watch_s"] for s in shapes}
    # Full runs: the healthy runs first (false alarms on their own, not beside fault runs), then the sweeps.
    # Quick: all at once (one tiny-demo each).
    parallel = len(jobs) + len(shapes) if args.quick else max(1, args.parallel)
    healthy_jobs = [(s, t) for s in shapes for t in traffics] if healthy_s > 0 else []  # 0: sweeps only
    with ThreadPoolExecutor(parallel) as pool, _results.progress(
            f"detection: {len(healthy_jobs)} healthy runs, then {len(jobs)} fault sweeps, {parallel} at once",
            len(healthy_jobs) + len(jobs)) as advance:
        def submit(*job):
            future = pool.submit(*job)
            future.add_done_callback(lambda _: advance())
            return future

        healthy_futures = [submit(healthy, work, s, healthy_s, baseline, t) for s, t in healthy_jobs]
        if not args.quick:
            for f in healthy_futures:
                f.result()
            print(f"healthy done at {time.time() - t0:.0f} s", flush=True)
        sweep_futures = [submit(sweep, work, s, f, sweeps[f], watch[s], chain, t, args.hot_reference,
                                args.learn_window)
                         for s, f, t in jobs]
        healthy_rows = dict(zip(healthy_jobs, (f.result() for f in healthy_futures)))
        swept = [f.result() for f in sweep_futures]
    results = {s: {"model": f"acme-{s} ({_shape_words(s)})", **SHAPES[s], "faults": {},
                   **{"healthy" if t == "broad" else f"healthy_{t}": healthy_rows[(s, t)] for t in traffics
                      if (s, t) in healthy_rows}}
               for s in shapes}
    for (s, f, t), row in zip(jobs, swept):
        learned = f == "hot" and args.hot_reference == "learned"
        results[s]["faults"][f + ("" if t == "broad" else f"_{t}") + ("_learned" if learned else "")] = row
    report = {
        "benchmark": "detection", "quick": args.quick,
        "how": "moescope demo (renamed preset) -> exporter -> Prometheus (generated rules, for / 30, memory window "
               "x3) -> Alertmanager (repo routing) -> webhook; times from Prometheus' first scrape (12 s after the "
               "exporter answers)",
        "healthy_s": healthy_s, "hot_reference": args.hot_reference, "learn_window_s": args.learn_window,
        "parallel_demos": parallel,
        "chain_stops_at_first_miss": chain,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "note": "shared 2-core VM: other test runs share the cores"},
        "commit": commit, "uncommitted_changes_in": dirty,
        "wall_s": None, "shapes": results,
    }
    report["wall_s"] = round(time.time() - t0, 1)
    _results.save(report, args.out)
    print(json.dumps(summary(report), indent=1))


def _shape_words(shape: str) -> str:
    if shape not in CUSTOM:
        return f"preset {shape}"
    c = CUSTOM[shape]
    groups = f", {c['n_group']} groups (top-{c['topk_group']})" if c.get("n_group") else ""
    shared = f", {c['n_shared_experts']} shared" if c.get("n_shared_experts") else ""
    dense = c.get("dense_layers", [])
    moe = c["n_layers"] - len(dense)
    # dense blocks between MoE ones (not only a dense prefix): interleaved
    between = ", MoE on every other block" if any(b - a > 1 for a, b in zip(dense, dense[1:])) else ""
    scoring = c.get("scoring", "softmax")
    return f"{moe} MoE layers x {c['n_experts']} experts, top-{c['top_k']} {scoring}{groups}{shared}{between}"


def _top_k(shape: str) -> int:
    from moescope.runtime.model_config import preset

    return CUSTOM[shape]["top_k"] if shape in CUSTOM else preset(shape).top_k


REALISED = {"hot": ("hot_factor_measured", "{:g}x"), "imbalance": ("worst_layer_load_cv", "CV {:g}"),
            "collapse": ("max_expert_slot_share", "top expert in {:.0%} of tokens"),
            "drop": ("dropped_slot_share", "{:.1%} dropped")}


def _run_cell(fault: str, r: dict, top_k: int) -> str:
    key, fmt = REALISED[fault]
    value = r.get(key)
    if value is not None and fault == "collapse":  # a share of the slots; each token has k of them
        value = value * top_k
    size = fmt.format(value) if value is not None else "no request finished"
    if r.get("hot_factor_over_before") is not None:  # switched on mid-run: also over its share before
        size += f", {r['hot_factor_over_before']:g}x its share before"
    if "error" in r:
        return f"{r['scenario']}: error"
    after = r.get("seconds_after_fault_at_least")
    also = f" (also paged: {_by_name(r['others_delivered'])})" if r.get("others_delivered") else ""
    verdict = (f"{after:g} s after the switch" if after is not None else f"{r['seconds_to_detect']:g} s") + also \
        if r.get("detected") else \
        ("paged as " + _by_name(r["others_delivered"]) if r.get("paged") else
         "missed" + (f" (delivered: {_by_name(r['delivered'])})" if r.get("delivered") else ""))
    return f"`{r['scenario'].split('=', 1)[1]}` ({size}): {verdict}"


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    return run.stdout.strip() if run.returncode == 0 else ""


def _by_name(delivered: list[str]) -> str:
    """'MoEExpertHot x51, MoEDeadExperts x7': alert instances per alert name."""
    names = [d.split("{")[0] for d in delivered]
    return ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names), key=lambda n: (-names.count(n), n)))


def markdown(report: dict) -> str:
    """The docs' tables, every figure from the results file."""
    lines = [f"Healthy traffic, {report['healthy_s']:g} s per run: alerts delivered other than the Watchdog.", "",
             "| model | no baseline | with a baseline saved from healthy traffic |", "|---|---|---|"] \
        if report.get("healthy_s", 1) > 0 else []
    for r, healthy_row, traffic in [(r, r[k], k.partition("_")[2] or "broad") for r in report["shapes"].values()
                                    for k in ("healthy", "healthy_narrow") if k in r]:
        cells = []
        for part in ("no_baseline", "with_baseline"):
            h = healthy_row.get(part)
            if h is None:
                cells.append("not run")
            elif "error" in h:
                cells.append("error: " + h["error"][:80])
            else:
                cells.append(f"{len(h['delivered'])}" + (f" ({_by_name(h['delivered'])})" if h["delivered"] else "")
                             + f"; {h.get('requests_stored', 0)} requests; {h.get('window_s', 60):g} s window")
        words = f" (narrow: {NARROW_PROMPTS} prompts repeated)" if traffic == "narrow" else ""
        lines.append(f"| {r['model']}{words} | {cells[0]} | {cells[1]} |")
    if not any(r["faults"] for r in report["shapes"].values()):
        return "\n".join(lines) + "\n"
    lines += [""] * bool(lines) + [
        "Faults, largest magnitude first (each run: the magnitude (its realised size in the run's trace store): "
        "seconds to detect, or what paged instead, or missed):", "",
              "| model | fault (magnitude) | runs | smallest detected | median seconds to detect (detected runs) |",
              "|---|---|---|---|---|"]
    for s, r in report["shapes"].items():
        for name, v in r["faults"].items():
            f = v.get("fault", name)
            runs = "; ".join(_run_cell(f, x, _top_k(s)) for x in v["runs"])
            if v["runs"]:
                first = v["runs"][0]
                runs = f"({first.get('window_s', 60):g} s window, {first.get('watch_s', 0):g} s watch) {runs}"
            if v["not_run"]:
                runs += "; " + "; ".join(f"{x['magnitude']:g}: {x['why']}" for x in v["not_run"])
            smallest = "none" if v["smallest_detected"] is None else f"{v['smallest_detected']:g}"
            after = [x["seconds_after_fault_at_least"] for x in v["runs"] if x.get("detected")
                     and x.get("seconds_after_fault_at_least") is not None]
            median = float(np.median(after)) if after else v["seconds_to_detect_median"]
            ttd = "-" if median is None else f"{median:g}" + (" after the switch" if after else "")
            how = ""
            if f == "hot":
                how = (f", {v.get('traffic', 'broad')} traffic, " +
                       ("switched on mid-run, against the learned reference" if v.get("hot_reference") == "learned"
                        else "on from the start, against 1/E"))
            lines.append(f"| {s} | {f}{how} ({v['magnitude_means']}) | {runs} | {smallest} | {ttd} |")
    return "\n".join(lines) + "\n"


def summary(report: dict) -> dict:
    out = {}
    for s, r in report["shapes"].items():
        out[s] = {**{f"false_alerts{key[7:]}": {k: r[key][k].get("delivered", r[key][k].get("error"))
                                                for k in ("no_baseline", "with_baseline") if k in r[key]}
                     for key in ("healthy", "healthy_narrow") if key in r},
                  **{f: (v["smallest_detected"], v["seconds_to_detect_median"]) for f, v in r["faults"].items()}}
    return out


if __name__ == "__main__":
    main()
