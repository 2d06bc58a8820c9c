"""``moescope baseline save`` / ``show``: the profile of the user's own healthy traffic that the bars use."""

from __future__ import annotations

import math

import click

from moescope.cli.options import echo, emit_json, json_option, model_option, read_store, since_option, traces_option


@click.group("baseline")
def baseline() -> None:
    """Routing baselines: a profile of healthy traffic per MoE layer (structural load CV, each expert's share
    and its spread) that imbalance, hot experts, dead experts and drift are judged against."""


def _median(values) -> float | None:
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


@baseline.command("save")
@traces_option()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Baseline file to write (JSON).")
@since_option
@model_option
@click.option("--window", "window_s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds per window for each expert's share spread (the exporter's window).")
def save(traces_path: str, out: str, since: float | None, model: str | None, window_s: float) -> None:
    """Save a baseline profile of the stored requests (save it from healthy traffic)."""
    # start-up: numpy (analysis.baseline), only when the command runs, not for --help
    from moescope.analysis import baseline as bl

    with read_store(traces_path) as (conn, corrupt):
        profile = bl.from_store(conn, since, corrupt=corrupt, window_s=window_s, model=model)
    bl.save(out, profile)
    layers = profile.layers.values()
    requests = max(lp.draws for lp in layers)
    slots = int(sum(lp.load.sum() for lp in layers))
    cv, deff = _median(lp.structural_cv for lp in layers), _median(lp.design_effect for lp in layers)
    skipped = f"; skipped {corrupt.count} corrupt rows" if corrupt.count else ""
    echo(f"wrote {out}: {len(profile.layers)} layers, {requests} requests, {slots} slots; median structural CV "
         f"{cv:.3f}, median design effect {_fmt(deff, '.2f')}{skipped}")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _document(path: str, profile, top: int) -> dict:
    layers = []
    for layer, lp in sorted(profile.layers.items()):
        order = sorted(range(len(lp.share)), key=lambda e: (-lp.share[e], e))[:top]
        layers.append({
            "layer": layer, "structural_cv": round(lp.structural_cv, 5),
            "design_effect": None if lp.design_effect is None else round(lp.design_effect, 4),
            "draws": lp.draws, "slots": int(lp.load.sum()), "windows": lp.windows,
            "top": [{"expert": e, "share": round(float(lp.share[e]), 6),
                     "share_sd": None if lp.share_sd is None else round(float(lp.share_sd[e]), 6)} for e in order]})
    return {"file": path, "model": profile.model, "n_experts": profile.n_experts, "window_s": profile.window_s,
            "window_draws": profile.window_draws, "layers": layers}


@baseline.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True,
              help="Experts listed per layer, by share.")
@json_option
def show(path: str, top: int, as_json: bool) -> None:
    """Print a baseline file: per layer its structural CV, design effect, requests and top experts by share."""
    # start-up: numpy (analysis.baseline), only when the command runs, not for --help
    from moescope.analysis import baseline as bl

    doc = _document(path, bl.load(path), top)
    if as_json:
        emit_json(doc)
        return
    n_req = max((la["draws"] for la in doc["layers"]), default=0)
    if doc["window_s"] is not None:
        spread = f"spread over {doc['window_s']:g} s windows (~{doc['window_draws']:g} requests each)"
    elif doc["window_draws"] is not None:
        spread = f"spread over groups of ~{doc['window_draws']:g} consecutive requests"
    else:
        spread = "no spread (too few requests, or a file of totals only)"
    echo(f"baseline {path}: model {doc['model'] or '-'}, {doc['n_experts']} experts, {len(doc['layers'])} layers, "
         f"{n_req} requests; {spread}")
    echo(f"{'layer':>5}  {'struct CV':>9}  {'deff':>6}  {'requests':>8}  top experts: share ± sd")
    for la in doc["layers"]:
        tops = ", ".join(f"e{t['expert']} {t['share'] * 100:.1f}%"
                         + ("" if t["share_sd"] is None else f" ±{t['share_sd'] * 100:.1f}") for t in la["top"])
        echo(f"{la['layer']:>5}  {la['structural_cv']:>9.3f}  {_fmt(la['design_effect'], '>6.2f'):>6}  "
             f"{la['draws']:>8}  {tops}")
