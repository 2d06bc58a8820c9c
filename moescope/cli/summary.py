"""The demo's run summary: the JSON a script reads (``--json``) and the lines a person reads.

Compact at any shape: per MoE layer one line (load CV, experts with no slot, the experts judged dead, the
hottest and coldest few with their share of the layer's slots) whether the model has 8 experts or 256, and
one line for the whole model first. ``--json`` holds all of it (``expert_load_summary``, ``judged``) and every
count (``expert_load``). cli/demo.py calls ``build`` and ``print_human``; demo_parallel prints merged ranks
with ``print_human``. ``save_baseline`` writes a run's baseline file (``--save-baseline``) from its summary: here
so that both cli/demo.py (one process) and demo_parallel (the launcher, from every rank's summary) call it
without demo_parallel importing cli/demo.py back.

Imbalance, hot and dead experts are judged as the alert rules judge them: ``moescope.judge`` (the exporter's
``sampling`` functions and the ``Thresholds`` methods), against the reference the alerts judge against (the loaded
baseline, else the exporter's learned reference, ``learned_rows``; the fair share only with ``--hot-reference
fair``). The run's draws are its requests: given per request
(``draws``, a ``sampling.Draws``) they are used as they are; from totals alone the summary judges with the
most clustered draws the totals allow (``judge.worst_case_draws``: as if each request routed all its slots
alike), which can only hold a judgement back, and says so. An expert with no slot is "dead" only where its
reference share predicts enough effective slots (a few requests at 256 experts: none is).
"""

from __future__ import annotations

import click
import numpy as np

from moescope import stats
from moescope.analysis import baseline as bl
from moescope.analysis.diagnose import judge_counts, judged_against
from moescope.errors import BadInput
from moescope.judge import worst_case_draws
from moescope.thresholds import DEFAULT
from moescope.traces import store
from moescope.tui.routing_view import NAMED, named


def layer_summary(counts: list[int], n: int | None = None, dead: int | None = None,
                  hot: list[dict] | None = None) -> dict:
    """One layer's load: CV, experts with no slot, the ``n`` hottest and coldest as (expert, share of slots)
    (``n``: as many as `moescope top` names, by the same ranking); ``dead`` (the experts judged dead; None: not
    judged) and ``hot`` ([{expert, factor, reference}] over the hot bar) from ``judge_counts``."""
    n = NAMED if n is None else n
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    hottest, coldest = named(c, n)

    def shares(items):
        return [{"expert": e, "share": round(float(c[e] / total), 5) if total else 0.0} for e, _ in items]

    return {"cv": round(stats.load_cv(counts), 4), "no_slot": int((c == 0).sum()), "dead": dead,
            "slots": int(total), "hottest": shares(hottest), "coldest": shares(coldest), "hot": hot or []}


def learned_rows(metrics, layers) -> object | None:
    """The reference the exporter's alerts judge against where no baseline is loaded: its learned reference
    (``metrics.window.LearnedRows``, rows in ``layers``' order; ``has`` False on a layer it has not learned yet,
    e.g. a run shorter than a window or never scraped), or None where it learns none (a baseline, or
    ``--hot-reference fair``: then the run is judged against those)."""
    if metrics.baseline is not None:
        return None
    return metrics.learned_rows(layers)  # (read under the evaluation lock: the evaluator updates it)


def judgement(load: dict, requests: int, top_k: int, draws=None, baseline=None,
              learned=None) -> tuple[dict, dict]:
    """(the run's judgement in JSON, {layer: layer_summary}) from its load {layer: counts}: ``draws`` per
    request when known, else the most clustered draws ``requests`` allow. Against ``baseline``, else ``learned``
    (``learned_rows``: the exporter's learned reference, what its alerts judged against: a layer uneven in it is
    "uneven by design/traffic", information; a layer it has not learned is "learning": hot experts named, not
    paged, imbalance and dead not judged), else the fair share (None: ``--hot-reference fair``, or a merged or
    older summary). The whole run's draws are judged, those of the window the reference was learned from
    included (a fault switched on mid-run is diluted by the run before it)."""
    layers = list(load)
    counts = np.array([load[layer] for layer in layers], dtype=np.float64)
    how = "per request" if draws is not None else "from totals, requests as most clustered"
    j = judge_counts(counts, draws if draws is not None else worst_case_draws(counts, requests), layers, top_k,
                     baseline, learned=learned if baseline is None else None)
    per, judged = {}, {}
    for i, layer in enumerate(layers):
        ok, v = bool(j.judged[i]), j.verdict(i)
        hot = [{"expert": e, "factor": round(float(j.hot_factor[i, e]), 2), "reference": j.hot_reference[i],
                "paged": e in v.hot} for e in v.hot_shown] if ok else []  # hottest first; none on a collapsed layer
        dead = int(j.dead[i]) if ok and np.isfinite(j.dead[i]) else None  # NaN: too few draws to bound it
        per[str(layer)] = layer_summary(load[layer], dead=dead, hot=hot)
        bar = float(j.bar[i])
        judged[str(layer)] = {"excess_cv": round(float(j.excess_cv[i]), 4) if ok else None,
                              "bar": round(bar, 4) if np.isfinite(bar) else None, "imbalanced": v.imbalanced,
                              "collapsed": v.collapsed, "reference": j.hot_reference[i],
                              "pages": v.fires() if ok or v.collapsed else [],
                              "uneven": j.uneven_words(i) or None}
    kinds = sorted(set(j.hot_reference))
    return {"draws": how, "requests": requests,
            "reference": j.reference if j.baseline_cv is not None or len(kinds) != 1 else kinds[0],
            "against": judged_against(j),
            "bar_from": "baseline" if j.baseline_cv is not None else "no baseline", "layers": judged}, per


def latencies(records) -> tuple[list[float], list[float]]:
    """(time to first token of each request, every later token's latency)."""
    return [r.ttft_s for r in records], [x for r in records for x in r.token_latencies_s[1:]]


def latency(ttft: list[float], tpot: list[float]) -> dict:
    """The summary's latency percentiles from the raw latencies (one run's, or all ranks' together)."""
    return {"ttft_p50": round(stats.percentile(ttft, 50), 5), "ttft_p99": round(stats.percentile(ttft, 99), 5),
            "per_token_p50": round(stats.percentile(tpot, 50), 5) if tpot else None,
            "per_token_p99": round(stats.percentile(tpot, 99), 5) if tpot else None}


def build(records, load, dropped, wall_s, model, device, n_asked, draws=None, baseline=None,
          learned=None) -> dict:
    """The summary. ``draws``: the run's per-request routing as a ``sampling.Draws`` (layers in ``load``'s
    order) where the caller has it; ``baseline``: the profile the run is judged against; else ``learned``
    (``learned_rows``: the exporter's learned reference)."""
    out_tokens = sum(r.n_output for r in records)
    prompt_tokens = sum(len(r.prompt_tokens) for r in records)
    judged, per_layer = judgement(load, len(records), model.cfg.top_k, draws, baseline, learned) if load \
        else ({}, {})
    return {
        "model": model.cfg.name,
        "device": str(device),
        "requests": n_asked,
        "completed": len(records),
        "wall_s": round(wall_s, 3),
        "tokens": {"prompt": prompt_tokens, "output": out_tokens},
        "tokens_per_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "latency_s": latency(*latencies(records)),
        "request_ids": [r.request_id for r in records],
        "requests_detail": [
            {"request_id": r.request_id, "domain": r.domain, "tenant": r.tenant,
             "prompt_tokens": len(r.prompt_tokens), "output_tokens": r.n_output, "total_s": round(r.total_s, 4),
             "ttft_s": round(r.ttft_s, 5), "finish_reason": r.finish_reason} for r in records],
        "expert_load": {str(layer): counts for layer, counts in load.items()},
        "expert_load_cv": {str(layer): round(stats.load_cv(c), 4) for layer, c in load.items()},
        "expert_load_summary": per_layer,
        "judged": judged,
        "tokens_dropped": {str(layer): n for layer, n in dropped.items()},
        "top_k": model.cfg.top_k,
    }


def print_human(s: dict) -> None:
    lat = s["latency_s"]
    click.echo(f"served {s['completed']}/{s['requests']} requests on {s['model']} ({s['device']}) in "
               f"{s['wall_s']:.2f}s: {s['tokens']['output']} output tokens, {s['tokens_per_s']} tokens/s")
    click.echo(f"ttft p50 {lat['ttft_p50'] * 1e3:.1f} ms, p99 {lat['ttft_p99'] * 1e3:.1f} ms; per-token p50 "
               f"{(lat['per_token_p50'] or 0) * 1e3:.1f} ms, p99 {(lat['per_token_p99'] or 0) * 1e3:.1f} ms")
    drops = drop_line(s)
    if drops:
        click.echo(drops)
    for line in load_lines(s):
        click.echo(line)
    if "expert_cache" in s:
        c = s["expert_cache"]
        click.echo(f"expert cache: {c['policy']}, {c['size']} resident per layer, {c['tier']} tier")
        for layer, st in c["layers"].items():
            load = f", load p50 {st['load_p50_s'] * 1e3:.2f} ms p99 {st['load_p99_s'] * 1e3:.2f} ms" \
                if st["load_p50_s"] is not None else ""
            click.echo(f"  layer {layer}  hit rate {st['hit_rate']:.3f} ({st['hits']}/{st['lookups']}), "
                       f"{st['evictions']} evictions, {st['prefetch_hits']} prefetch hits{load}")
    ids = s["request_ids"]
    click.echo(f"request ids: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}")
    if s.get("traces"):
        click.echo(f"traces in {s['traces']}: `moescope requests`, `moescope trace {ids[0] if ids else 'ID'}`")
    if s.get("metrics_url"):
        click.echo(f"metrics were served on {s['metrics_url']} (--linger S keeps them up after the run)")


def drop_line(s: dict) -> str | None:
    """The slots the capacity limit dropped (``tokens_dropped``), or None when none was: the total, the share
    as `top`'s ``dropped`` tile counts it (dropped slots per routed token, ``thresholds.drop_ratio``) and the
    layers that dropped most."""
    dropped = {layer: n for layer, n in (s.get("tokens_dropped") or {}).items() if n}
    if not dropped:
        return None
    k = int(s.get("top_k") or 1)
    load = s.get("expert_load") or {}

    def per_token(layers) -> float:  # a routed token is k slots, each computed (in the load) or dropped
        slots = sum(sum(load.get(la, ())) + (s["tokens_dropped"].get(la) or 0) for la in layers)
        return sum(dropped.get(la, 0) for la in layers) * k / slots if slots else float("nan")

    most = sorted(dropped, key=lambda la: (-dropped[la], int(la)))[:3]
    return (f"dropped by the capacity limit: {sum(dropped.values())} slots, {per_token(s['tokens_dropped']):.1%} "
            "per routed token (top's dropped); most in "
            + ", ".join(f"L{la} {per_token([la]):.1%}" for la in most))


def load_lines(s: dict) -> list[str]:
    """The expert load part of the human summary: the model in one line, what was judged, then one line per
    MoE layer."""
    per = s.get("expert_load_summary")
    if per is None:  # a summary without the judgement (a merged or older one): judge its totals
        judged, per = judgement({int(k): v for k, v in s["expert_load"].items()}, int(s.get("completed") or 0),
                                int(s.get("top_k") or 1))
        per = {str(k): v for k, v in per.items()}
    else:
        judged = s.get("judged") or {}
    if not per:
        return []
    n_exp = len(next(iter(s["expert_load"].values())))
    cvs = {layer: v["cv"] for layer, v in per.items()}
    worst = max(cvs, key=cvs.get)
    not_judged = [layer for layer, v in per.items() if v["dead"] is None]
    dead = {layer: v["dead"] for layer, v in per.items() if v["dead"]}
    dead_text = (f"dead: not judged ({judged.get('requests', '?')} req)" if len(not_judged) == len(per)
                 else f"{sum(dead.values())} dead in {len(dead)} layers")
    lines = [f"expert load: {len(per)} MoE layers x {n_exp} experts (fair share {1 / n_exp:.2%}); CV median "
             f"{float(np.median(list(cvs.values()))):.3f}, max {cvs[worst]:.3f} (L{worst}); {dead_text}"]
    if judged:
        lines += _judged_lines(judged, per)
    lines.append(f"per layer: cv, no slot / judged dead, the {NAMED} hottest and coldest as expert:share "
                 "(counts: --json)")
    return lines + _layer_lines(per, n_exp)


def _judged_lines(judged: dict, per: dict) -> list[str]:
    """What was judged against what, what would page, and the layers uneven by design or traffic."""
    layers_j = judged.get("layers", {})
    imb = [layer for layer, v in layers_j.items() if v["imbalanced"]]
    hot = [(layer, h) for layer, v in per.items() for h in v.get("hot", [])]
    bar = {"baseline": "against the baseline", "learned": "against its learned reference",
           "learning": "reference still being learned: imbalance, dead wait",
           "fair": f"against the fair share: over excess CV {DEFAULT.imbalance_cv:g}"}.get(
        judged.get("reference"), judged.get("against") or "")
    hot_text = ", ".join(f"L{layer} E{h['expert']} {h['factor']:.1f}x {h['reference']}"
                         for layer, h in sorted(hot, key=lambda x: -x[1]["factor"])[:3]) or "none"
    lines = [f"judged ({judged.get('draws')}): imbalanced in {len(imb)} ({bar}); hot {hot_text}"]
    pages = [f"L{layer} {', '.join(v['pages'])}" for layer, v in layers_j.items() if v.get("pages")]
    uneven = [f"L{layer} {v['uneven']}" for layer, v in layers_j.items() if v.get("uneven")]
    lines.append("would page: " + ("; ".join(pages) if pages else "nothing"))
    return lines + uneven[:3] + ([f"... {len(uneven) - 3} more layers uneven by design/traffic (--json)"]
                                 if len(uneven) > 3 else [])


def _layer_lines(per: dict, n_exp: int) -> list[str]:
    """One line per MoE layer: its CV, experts with no slot and judged dead, its hottest and coldest experts."""
    width = max(len(str(layer)) for layer in per)
    digits = 1 if n_exp <= 64 else 2  # shares near 1/E must still differ on screen

    def few(items):
        return " ".join(f"{x['expert']}:{x['share']:.{digits}%}" for x in items)

    lines = []
    for layer, v in per.items():
        d = "-" if v["dead"] is None else v["dead"]
        lines.append(f"  L{layer:<{width}} cv {v['cv']:.3f} no slot {v['no_slot']:>3} dead {d:>3}  "
                     f"hot {few(v['hottest'])}  cold {few(v['coldest'])}")
    return lines


def save_baseline(path: str, summary: dict, model_name: str, run_started: float) -> None:
    """The run's baseline profile: from its own requests in the trace store (per-request routing: the
    structural CV, design effect and share spread), else from the run's totals (a v1-equivalent profile). An
    expert-parallel run's summary is every rank's: a store that holds only some ranks' requests (a SQLite store
    is rank 0's) gives way to the totals, which count every rank's tokens."""
    profile = None
    if summary.get("traces"):
        conn = store.open_store(summary["traces"])
        try:
            profile = bl.from_store(conn, since=run_started - 1.0, only=set(summary["request_ids"]))
            if summary.get("world_size", 1) > 1 and max(lp.draws for lp in profile.layers.values()) < len(
                    summary["request_ids"]):
                click.echo("baseline: the trace store holds only some ranks' requests", err=True)
                profile = None
        except BadInput as exc:
            click.echo(f"baseline: the trace store gave no profile ({exc})", err=True)
        finally:
            conn.close()
    if profile is None:
        profile = bl.from_loads({int(k): v for k, v in summary["expert_load"].items()}, model_name)
        click.echo("baseline: from the run's totals only (no per-request routing in a trace store): no share "
                   "spread or design effect, structural CV from the multinomial expectation", err=True)
    else:
        n = max(lp.draws for lp in profile.layers.values())
        click.echo(f"baseline: {n} of {len(summary['request_ids'])} requests from the trace store", err=True)
    bl.save(path, profile)
