"""The demo's run summary: the JSON a script reads (``--json``) and the lines a person reads.

Compact at any shape: per MoE layer one line (load CV, experts with no slot, the hottest and coldest few
with their share of the layer's slots) whether the model has 8 experts or 256, and one line for the whole
model first. ``--json`` holds all of it (``expert_load_summary``) and every count (``expert_load``).
cli/demo.py calls ``build`` and ``print_human``; demo_parallel prints merged ranks with ``print_human``.
"""

from __future__ import annotations

import click
import numpy as np

from moescope import stats


def layer_summary(counts: list[int], n: int | None = None) -> dict:
    """One layer's load: CV, experts with no slot, the ``n`` hottest and coldest as (expert, share of slots)
    (``n``: as many as `moescope top` names, by the same ranking)."""
    from moescope.tui.routing import NAMED, named  # imported here: every CLI start imports this module

    n = NAMED if n is None else n
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    hot, cold = named(c, n)

    def shares(items):
        return [{"expert": e, "share": round(float(c[e] / total), 5) if total else 0.0} for e, _ in items]

    return {"cv": round(stats.load_cv(counts), 4), "dead": int((c == 0).sum()), "slots": int(total),
            "hottest": shares(hot), "coldest": shares(cold)}


def build(records, load, dropped, wall_s, model, device, n_asked) -> dict:
    out_tokens = sum(r.n_output for r in records)
    prompt_tokens = sum(len(r.prompt_tokens) for r in records)
    ttft = [r.ttft_s for r in records]
    tpot = [x for r in records for x in r.token_latencies_s[1:]]
    return {
        "model": model.cfg.name,
        "device": str(device),
        "requests": n_asked,
        "completed": len(records),
        "wall_s": round(wall_s, 3),
        "tokens": {"prompt": prompt_tokens, "output": out_tokens},
        "tokens_per_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "latency_s": {
            "ttft_p50": round(stats.percentile(ttft, 50), 5), "ttft_p99": round(stats.percentile(ttft, 99), 5),
            "per_token_p50": round(stats.percentile(tpot, 50), 5) if tpot else None,
            "per_token_p99": round(stats.percentile(tpot, 99), 5) if tpot else None,
        },
        "request_ids": [r.request_id for r in records],
        "requests_detail": [
            {"request_id": r.request_id, "domain": r.domain, "tenant": r.tenant,
             "prompt_tokens": len(r.prompt_tokens), "output_tokens": r.n_output, "total_s": round(r.total_s, 4),
             "finish_reason": r.finish_reason} for r in records],
        "expert_load": {str(layer): counts for layer, counts in load.items()},
        "expert_load_cv": {str(layer): round(stats.load_cv(c), 4) for layer, c in load.items()},
        "expert_load_summary": {str(layer): layer_summary(c) for layer, c in load.items()},
        "tokens_dropped": {str(layer): n for layer, n in dropped.items()},
    }


def print_human(s: dict) -> None:
    lat = s["latency_s"]
    click.echo(f"served {s['completed']}/{s['requests']} requests on {s['model']} ({s['device']}) in "
               f"{s['wall_s']:.2f}s: {s['tokens']['output']} output tokens, {s['tokens_per_s']} tokens/s")
    click.echo(f"ttft p50 {lat['ttft_p50'] * 1e3:.1f} ms, p99 {lat['ttft_p99'] * 1e3:.1f} ms; per-token p50 "
               f"{(lat['per_token_p50'] or 0) * 1e3:.1f} ms, p99 {(lat['per_token_p99'] or 0) * 1e3:.1f} ms")
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


def load_lines(s: dict) -> list[str]:
    """The expert load part of the human summary: the model in one line, then one line per MoE layer."""
    from moescope.tui.routing import NAMED

    per = s.get("expert_load_summary") or {k: layer_summary(v) for k, v in s["expert_load"].items()}
    if not per:
        return []
    n_exp = len(next(iter(s["expert_load"].values())))
    cvs = {layer: v["cv"] for layer, v in per.items()}
    worst = max(cvs, key=cvs.get)
    dead = {layer: v["dead"] for layer, v in per.items() if v["dead"]}
    lines = [f"expert load: {len(per)} MoE layers x {n_exp} experts (fair share {1 / n_exp:.2%}); CV median "
             f"{float(np.median(list(cvs.values()))):.3f}, max {cvs[worst]:.3f} (L{worst}); "
             f"{sum(dead.values())} dead in {len(dead)} layers",
             f"per layer: cv, dead (no slot), the {NAMED} hottest and coldest as expert:share (counts: --json)"]
    width = max(len(str(layer)) for layer in per)
    digits = 1 if n_exp <= 64 else 2  # shares near 1/E must still differ on screen

    def few(items):
        return " ".join(f"{x['expert']}:{x['share']:.{digits}%}" for x in items)

    for layer, v in per.items():
        lines.append(f"  L{layer:<{width}} cv {v['cv']:.3f} dead {v['dead']:>3}  hot {few(v['hottest'])}  "
                     f"cold {few(v['coldest'])}")
    return lines
