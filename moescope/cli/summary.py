"""The demo's run summary: the JSON a script reads (``--json``) and the lines a person reads.

Moved out of cli/demo.py (which calls ``build`` and ``print_human``); demo_parallel prints merged ranks
with ``print_human`` too.
"""

from __future__ import annotations

import click

from moescope import stats


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
        "tokens_dropped": {str(layer): n for layer, n in dropped.items()},
    }


def print_human(s: dict) -> None:
    lat = s["latency_s"]
    click.echo(f"served {s['completed']}/{s['requests']} requests on {s['model']} ({s['device']}) in "
               f"{s['wall_s']:.2f}s: {s['tokens']['output']} output tokens, {s['tokens_per_s']} tokens/s")
    click.echo(f"ttft p50 {lat['ttft_p50'] * 1e3:.1f} ms, p99 {lat['ttft_p99'] * 1e3:.1f} ms; per-token p50 "
               f"{(lat['per_token_p50'] or 0) * 1e3:.1f} ms, p99 {(lat['per_token_p99'] or 0) * 1e3:.1f} ms")
    click.echo("expert load (share of slots) per MoE layer:")
    for layer, counts in s["expert_load"].items():
        share = stats.shares(counts)
        bars = " ".join(f"{e}:{p:5.1%}" for e, p in enumerate(share))
        click.echo(f"  layer {layer}  cv {s['expert_load_cv'][layer]:.3f}  {bars}")
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
