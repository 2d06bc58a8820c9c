"""``moescope report --out DIR``: offline tables, figures and a summary a person reads first.

From the trace store: load per layer and expert; per domain, per tenant and per phase (prefill/decode);
co-activation of expert pairs; the drift between the window's earlier and later half attributed to the
domain/tenant/phase whose traffic share moved. From an import (SGLang/Megatron dumps): load and the per-pass
heatmaps (the dumps hold no domains, phases or token-level pairs).

Files: ``summary.md``, ``overview.png`` (layers x experts, every layer in one figure), ``load.csv``,
``load_by_domain.csv``, ``load_by_tenant.csv``, ``load_by_phase.csv``, ``coactivation.csv`` (the
``TOP_PAIRS`` most co-chosen pairs per layer; all of them at 256 experts would be millions of rows) and, for
the layers asked for (``layers``), ``heatmap_layer<L>.png`` (expert x pass) and ``domains_layer<L>.png``
(expert x domain). Every count is one ``np.bincount`` over the stored rows (``routing_counts``), so a report
of a 58-layer x 256-expert store takes seconds, not minutes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moescope import stats
from moescope.analysis import profile as profile_mod, report_figures as figures
from moescope.analysis.diagnose import judge_requests, judged_against, load_window, window_judgement
from moescope.analysis import routing_counts as rc
from moescope.analysis import step_experts
from moescope.config import DEFAULT_WINDOW_S
from moescope.progress import progress
from moescope.thresholds import DEFAULT
from moescope.traces import store
from moescope.traces.store import CorruptRows, select_layers

TOP_PAIRS = 50
KINDS = ("domain", "tenant", "phase")


def _frame(rows):
    import pandas as pd  # optional: pandas (the analysis extra)

    return pd.DataFrame(rows)


def attribute_drift(by_half: np.ndarray, names: list[str], by: str) -> dict[int, dict]:
    """How much of each layer's load shift between the window's halves the traffic mix along ``by`` (domain,
    tenant or phase) explains. ``by_half`` [2, G, L, E]: slots per half, group, layer, expert.

    The per-expert distribution is p = sum_g w_g p_g (w_g: group g's share of slots). Holding each group's
    own distribution at its whole-window value q_g, a change of mix alone moves p by m = sum_g dw_g q_g. The
    mix explains ||m|| / ||p_late - p_early|| (L1, capped at 1); a group's part of it is its term's norm.
    Returns {layer index: attribution}; groups are those with slots in the layer, in ``names`` order."""
    c = by_half.astype(float)
    per_half = c.sum(1)  # [2, L, E]
    totals = per_half.sum(-1)  # [2, L]
    group_tot = c.sum((0, 3))  # [G, L]
    q = np.divide(c.sum(0), np.maximum(1.0, group_tot)[..., None])  # [G, L, E]
    w = np.divide(c.sum(3), np.where(totals > 0, totals, 1.0)[:, None, :])  # [2, G, L]
    term = (w[1] - w[0])[..., None] * q  # [G, L, E]
    norms = np.abs(term).sum(-1)  # [G, L]
    with np.errstate(invalid="ignore", divide="ignore"):
        p = per_half / np.where(totals > 0, totals, 1.0)[..., None]
    shift = np.abs(p[1] - p[0]).sum(-1)  # [L]
    mix = np.abs(term.sum(0)).sum(-1)  # [L]
    out = {}
    for j in range(c.shape[2]):
        if not totals[0, j] or not totals[1, j]:
            out[j] = {"mix_explains": 0.0, "groups": []}
            continue
        present = [g for g in range(len(names)) if group_tot[g, j] > 0]
        z = sum(norms[g, j] for g in present) or 1.0
        groups = [{by: names[g], "share_before": round(float(w[0, g, j]), 4),
                   "share_after": round(float(w[1, g, j]), 4), "part_of_mix_effect": round(norms[g, j] / z, 4)}
                  for g in present]
        explains = min(1.0, float(mix[j] / shift[j])) if shift[j] > 0 else 0.0
        out[j] = {"mix_explains": round(explains, 4), "shift_l1": round(float(shift[j]), 4),
                  "groups": sorted(groups, key=lambda r: -r["part_of_mix_effect"])}
    return out


def _index(values: list) -> tuple[list[str], dict]:
    names = sorted({v or "-" for v in values})
    return names, {n: i for i, n in enumerate(names)}


def _long_table(counts: np.ndarray, layers: list[int], names: list[str], by: str):
    """Rows (layer, group, expert, slots, share) of ``counts`` [G, L, E] where slots > 0, ordered by layer,
    group, expert; share is within (layer, group)."""
    g_idx, l_idx, e_idx = np.nonzero(counts)
    order = np.lexsort((e_idx, g_idx, l_idx))
    g_idx, l_idx, e_idx = g_idx[order], l_idx[order], e_idx[order]
    slots = counts[g_idx, l_idx, e_idx]
    tot = counts.sum(-1)[g_idx, l_idx]
    return _frame({"layer": np.asarray(layers)[l_idx], by: np.asarray(names, dtype=object)[g_idx],
                   "expert": e_idx, "slots": slots, "share": slots / tot})


def _figure_layers(wanted: list[int] | str | None, layers: list[int]) -> list[int]:
    """The layers that get per-layer figures: none (None), every one (``"all"``) or ``wanted`` (ids)."""
    if wanted is None:
        return []
    return [layers[j] for j in select_layers(layers, None if wanted == "all" else wanted, "here")]


def build(out_dir: str | Path, *, traces_path: str | None = None, import_path: str | None = None,
          since: float | None = None, corrupt=None, layers: list[int] | str | None = None,
          model: str | None = None, baseline=None, hot_reference: str = "learned",
          learn_window_s: float = DEFAULT_WINDOW_S, prometheus: str | None = None) -> dict:
    """Write the report; returns its summary. ``layers``: the layers that get per-layer figures: None, ``"all"``
    or layer ids (``cli.layer_select.parse``). ``model``: only this model's stored requests (None: the shape
    most requests have). Corrupt trace-store rows are skipped into ``corrupt`` (``store.CorruptRows``). The
    directory is made only once the source is read and the layers are checked: bad input writes nothing.
    ``baseline``, ``hot_reference``, ``learn_window_s``: what a store's routing is judged against, as
    ``diagnose`` (``diagnose.window_judgement``): the baseline, else the reference learned from the first
    ``learn_window_s`` of requests (the later ones judged), else (``"fair"``, as asked) the fair share. An import
    has no request times: judged against the fair share."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    out = Path(out_dir)
    if import_path is not None:
        summary, files = _from_import(out, import_path, layers)
    else:
        summary, files = _from_store(out, traces_path, since, corrupt, layers, model,
                                     dict(baseline=baseline, hot_reference=hot_reference,
                                          learn_window_s=learn_window_s), prometheus)
    (out / "summary.md").write_text(_markdown(summary, files))
    files.append("summary.md")
    summary["files"] = files
    return summary


def _judged(j) -> dict[int, dict]:
    """Per layer, the judgement every view shares (``moescope.judge``): excess CV against the imbalance bar,
    hot experts against their reference, the dead experts the reference predicts (None: not judged), the alerts
    the rules would page (``Verdict.fires``) and, where the reference itself is uneven, the words saying so
    (information, never a problem)."""
    out = {}
    for i, layer in enumerate(j.layers):
        ok, v = bool(j.judged[i]), j.verdict(i)
        bar = j.bar[i]
        out[layer] = {
            "excess_cv": round(float(j.excess_cv[i]), 4) if ok else None,
            "bar": round(float(bar), 4) if np.isfinite(bar) else None,
            "over": v.imbalanced, "collapsed": v.collapsed, "reference": j.hot_reference[i],
            "hot": [{"expert": e, "factor": round(float(j.hot_factor[i, e]), 2), "reference": j.hot_reference[i]}
                    for e in v.hot_shown] if ok else [],  # hottest first; none on a collapsed layer
            "dead_judged": [int(e) for e in np.nonzero(j.dead_mask[i])[0]] if ok else None,
            "pages": v.fires() if ok or v.collapsed else [], "uneven": j.uneven_words(i) or None}
    return out


def _load_files(out: Path, load: dict[int, np.ndarray], model: str | None, source: str, j) -> tuple[dict, list]:
    """load.csv, overview.png and the per-layer summary, from {layer: [E] slots} and its judgement ``j``."""
    layers = sorted(load)
    m = np.stack([load[layer] for layer in layers])
    tot = m.sum(1, keepdims=True)
    n_exp = m.shape[1]
    _frame({"layer": np.repeat(layers, n_exp), "expert": np.tile(np.arange(n_exp), len(layers)),
            "slots": m.ravel(), "share": np.divide(m, np.maximum(tot, 1)).ravel()}).to_csv(out / "load.csv",
                                                                                       index=False)
    figures.overview(load, out / "overview.png", f"{model or source}: expert load per MoE layer")
    judged = _judged(j)
    # The busiest expert's share of the routed tokens, as judged (``stats.top_share_rows``: what the collapse bar
    # and moescope_expert_load_top_share_ratio are; once a per-slot share, up to 1/k, written beside the verdict
    # it is not judged by). None: no tokens.
    top = {layer: float(v) for layer, v in zip(j.layers, j.top_share.tolist())}
    per_layer = {layer: {"cv": round(stats.load_cv(load[layer].tolist()), 4), "slots": int(load[layer].sum()),
                         "hottest": int(np.argmax(load[layer])),
                         "top_share": round(top[layer], 4) if np.isfinite(top[layer]) else None,
                         "dead": [int(e) for e in np.nonzero(load[layer] == 0)[0]], **judged[layer]}
                 for layer in layers}
    summary = {"source": source, "model": model, "n_experts": n_exp, "layers": layers, "per_layer": per_layer,
               "judged": {"draws": int(np.nanmin(j.draws)) if len(j.draws) else 0,
                          "reference": j.reference if j.baseline_cv is not None or len(set(j.hot_reference)) != 1
                          else j.hot_reference[0], "against": judged_against(j),
                          "bar_from": "baseline" if j.baseline_cv is not None else "no baseline"}}
    return summary, ["overview.png", "load.csv"]


def _from_import(out: Path, import_path: str, wanted) -> tuple[dict, list]:
    with progress(f"report: reading {import_path}", 1):
        prof = profile_mod.load(None, import_path)
    layers = prof.layers
    n_pass = max(len(prof.passes[layer]) for layer in layers)
    per_pass = np.zeros((n_pass, len(layers), prof.n_experts))  # a recorder's pass is the draw (no requests)
    for i, layer in enumerate(layers):
        per_pass[: len(prof.passes[layer]), i] = prof.passes[layer]
    figure_layers = _figure_layers(wanted, prof.layers)
    out.mkdir(parents=True, exist_ok=True)
    with progress(f"report: tables and {1 + len(figure_layers)} figures", 1 + len(figure_layers)) as advance:
        j = judge_requests(per_pass, layers, 1)  # top-k unknown: the top share is per slot here
        summary, files = _load_files(out, prof.load(), prof.model, prof.source, j)
        advance()
        for layer in figure_layers:
            figures.layer_heatmap(prof.passes[layer].T, out / f"heatmap_layer{layer}.png",
                                  f"layer {layer}: expert load per pass", "pass (forward / recorder pass / iteration)")
            files.append(f"heatmap_layer{layer}.png")
            advance()
    return summary, files


def _from_store(out: Path, traces_path: str, since, corrupt, wanted, model, against: dict,
                prometheus: str | None = None) -> tuple[dict, list]:
    with progress(f"report: reading {traces_path}", 1):
        conn = store.open_store(traces_path)
        try:
            w = load_window(conn, since=since, limit=100000, corrupt=corrupt, model=model)
        finally:
            conn.close()
    n_rows = sum(len(r) for r in w.routing)
    # the steps: each chunk counted (at most this many), the tables with the overview, each layer's two figures
    n_figures = 1 + 2 * len(_figure_layers(wanted, w.layers))  # (a layer the window lacks: BadInput, nothing made)
    out.mkdir(parents=True, exist_ok=True)
    with progress(f"report: counting {n_rows} routed tokens, writing tables and {n_figures} figures",
                  -(-n_rows // rc.CHUNK_ROWS) + n_figures) as advance:
        summary, files = _store_files(out, w, wanted, advance, against)
    summary["expert_spread"] = _expert_spread(w, prometheus)
    return summary, files


def _store_files(out: Path, w, wanted, advance, against: dict) -> tuple[dict, list]:
    n_exp, n_layers = w.n_experts, len(w.layers)
    figure_layers = _figure_layers(wanted, w.layers)
    sel = [w.layers.index(layer) for layer in figure_layers]
    names, index = {}, {}
    for kind, values in (("domain", w.domain), ("tenant", w.tenant)):
        names[kind], index[kind] = _index(values)
    names["phase"] = ["prefill", "decode"]
    order = np.argsort(w.started, kind="stable")
    late = np.zeros(len(w.ids), bool)
    late[order[len(order) // 2:]] = True
    n_steps = len(w.steps)
    labels: dict[str, list[np.ndarray]] = {k: [] for k in (*KINDS, "half", "step")}
    for i, r in enumerate(w.routing):
        n = len(r)
        labels["domain"].append(np.full(n, index["domain"][w.domain[i] or "-"]))
        labels["tenant"].append(np.full(n, index["tenant"][w.tenant[i] or "-"]))
        labels["phase"].append((np.arange(n) >= w.n_prompt[i]).astype(np.int64))
        labels["half"].append(np.full(n, int(late[i])))
        labels["step"].append(w.step_of[i])
    load = np.zeros((n_layers, n_exp), np.int64)
    by = {k: np.zeros((2, len(names[k]), n_layers, n_exp), np.int64) for k in KINDS}  # [half, G, L, E]
    co = np.zeros((n_layers, n_exp, n_exp), np.int64)
    passes = np.zeros((max(1, n_steps), len(sel), n_exp), np.int64)
    for ch in rc.chunks(w.routing, labels):
        load += rc.count(ch.ids, n_exp)[0]
        for k in KINDS:
            g = len(names[k])
            by[k] += rc.count(ch.ids, n_exp, ch.groups["half"] * g + ch.groups[k], 2 * g).reshape(2, g, n_layers,
                                                                                                  n_exp)
        co += rc.pairs(ch.ids, n_exp)
        if sel:
            passes += rc.count(ch.ids[:, sel], n_exp, ch.groups["step"], max(1, n_steps))
        advance()

    j = window_judgement(w, against["baseline"], hot_reference=against["hot_reference"],
                         learn_window_s=against["learn_window_s"])
    summary, files = _load_files(out, dict(zip(w.layers, load)), w.model, "trace store", j)
    advance()
    for k in KINDS:
        _long_table(by[k].sum(0), w.layers, names[k], k).to_csv(out / f"load_by_{k}.csv", index=False)
        files.append(f"load_by_{k}.csv")
    co_rows, top_pairs = [], {}
    iu = np.triu_indices(n_exp, 1)
    for j, layer in enumerate(w.layers):
        v = co[j][iu]
        keep = np.argsort(-v, kind="stable")[:TOP_PAIRS]
        keep = keep[v[keep] > 0]
        rows = [{"layer": layer, "expert_a": int(iu[0][x]), "expert_b": int(iu[1][x]), "tokens": int(v[x])}
                for x in keep]
        co_rows += rows
        top_pairs[layer] = [{k: r[k] for k in ("expert_a", "expert_b", "tokens")} for r in rows[:3]]
    _frame(co_rows or {"layer": [], "expert_a": [], "expert_b": [], "tokens": []}).to_csv(out / "coactivation.csv",
                                                                                         index=False)
    files.append("coactivation.csv")
    step_order = sorted(range(n_steps), key=lambda i: (str(w.steps[i].get("run", "")), w.steps[i].get("index", i)))
    for j, layer in enumerate(figure_layers):
        figures.layer_heatmap(passes[step_order, j].T, out / f"heatmap_layer{layer}.png",
                              f"layer {layer}: expert load per engine step", "engine step")
        figures.layer_heatmap(by["domain"].sum(0)[:, sel[j]].T, out / f"domains_layer{layer}.png",
                              f"layer {layer}: expert load per domain", "domain", names["domain"])
        files += [f"heatmap_layer{layer}.png", f"domains_layer{layer}.png"]
        advance(2)
    attributions = {k: attribute_drift(by[k], names[k], k) for k in KINDS}
    summary["drift_attribution"] = {layer: {k: attributions[k][j] for k in KINDS} for j, layer in enumerate(w.layers)}
    summary["requests"] = len(w.ids)
    summary["top_pairs"] = {layer: p for layer, p in top_pairs.items() if p}
    return summary, files


def _expert_spread(w, prometheus: str | None) -> dict | None:
    """The seeds' pattern (issue 44): steps that touch more experts than the model's own band (its shape and the
    window's batches) with bandwidth binding (S-MBU > S-MFU from ``prometheus``, when given; else "not shown"):
    the one judgement diagnose's expert-spread finding makes (``step_experts.finding``), on the same window."""
    return step_experts.finding(w.routing, w.step_of, w.n_experts, w.top_k,
                                step_experts.utilisation_from(prometheus, w.model) if prometheus else None)


def _markdown(s: dict, files: list[str]) -> str:
    n_exp = s["n_experts"]
    lines = [f"# moescope report: {s.get('model') or s['source']}", ""]
    if "requests" in s:
        lines.append(f"{s['requests']} requests, {len(s['layers'])} MoE layers, {n_exp} experts each.")
    else:
        lines.append(f"{len(s['layers'])} MoE layers, {n_exp} experts each (an import: no domains, phases or "
                     "token-level pairs; each recorded pass is one draw).")
    lines += _load_section(s) + _verdict_section(s) + _spread_section(s.get("expert_spread"))
    lines += _drift_section(s.get("drift_attribution")) + _pairs_section(s.get("top_pairs"))
    lines += ["", "## Files", ""] + [f"- `{f}`" for f in files] + [""]
    return "\n".join(lines)


def _load_section(s: dict) -> list[str]:
    """The load per layer: what it is judged against, then one table row per layer."""
    t = DEFAULT
    against = s["judged"].get("against")
    if against:  # a store: the reference diagnose judges against (baseline, learned, or fair as asked)
        bar = f"its reference's bar ({against})"
    else:
        bar = ("the no-baseline bar " f"{t.imbalance_cv:g} (a baseline, `moescope baseline save`, judges smaller "
               "changes)" if s["judged"]["bar_from"] == "no baseline" else "the baseline's bar")
    lines = ["", "`overview.png`: every layer (rows) x expert (columns), load against the fair share 1/E "
             "(red over, blue under, black no slot). Per-layer figures: `moescope report --layers L,...`.",
             "", "## Load per layer", "",
             f"Judged as the alert rules judge (the same functions as the exporter and `moescope diagnose`, each "
             f"request one draw): excess CV, the load CV beyond sampling noise, against {bar}; hot, an expert "
             f"over {t.hot_factor:g}x its {s['judged']['reference']} share beyond noise; dead, experts with no "
             f"slot where the {s['judged']['reference']} share predicts at least {t.dead_min_expected_slots:g} "
             "effective slots. \"-\": too few draws to judge.", "",
             "| layer | load CV | excess CV (bar) | hottest expert (share of tokens) | hot | dead experts |",
             "|---|---|---|---|---|---|"]
    for layer, v in s["per_layer"].items():
        bar_text = "-" if v["bar"] is None else f"{v['bar']:.2f}"
        if v["excess_cv"] is None:
            excess = f"- ({bar_text})"
        else:
            excess = f"{v['excess_cv']:.3f} ({bar_text})" + (" **over**" if v["over"] else "")
        hot = ", ".join(f"**{h['expert']} {h['factor']:.1f}x**" for h in v["hot"]) or "-"
        top = "-" if v["top_share"] is None else f"{v['top_share']:.1%}"
        lines.append(f"| {layer} | {v['cv']:.3f} | {excess} | {v['hottest']} ({top}) | {hot} | "
                     f"{_dead_text(v['dead'], v['dead_judged'])} |")
    return lines


def _dead_text(dead: list, judged: list | None) -> str:
    """A layer's dead experts in the table: its zero-slot experts, and those judged dead (None: too few draws)."""
    if not dead:
        return "none"
    if not judged:
        return f"{len(dead)} with no slot (" + ("too few draws to judge" if judged is None else
                                                "not judged dead: too few slots for their share") + ")"
    shown = ", ".join(map(str, judged[:8])) + (f" ... ({len(judged)})" if len(judged) > 8 else "")
    return f"**{shown}**" + (f" (of {len(dead)} with no slot)" if len(dead) > len(judged) else "")


def _verdict_section(s: dict) -> list[str]:
    pages = {layer: v["pages"] for layer, v in s["per_layer"].items() if v.get("pages")}
    uneven = {layer: v["uneven"] for layer, v in s["per_layer"].items() if v.get("uneven")}
    lines = ["", "## Verdict", ""]
    lines += [f"- layer {layer}: **{', '.join(p)}**" for layer, p in pages.items()] or \
        ["No problem: nothing the alert rules would page for."]
    lines += [f"- layer {layer}: {words}" for layer, words in uneven.items()]
    return lines + ["", "`moescope diagnose` says what a problem is and which playbook to follow."]


def _spread_section(f: dict | None) -> list[str]:
    if not f:
        return []
    ev = f["evidence"]
    return ["", f"## {f['severity'].capitalize()}: {f['title']}", "",
            f"{ev['steps']} batched steps ({ev['mean_rows']:g} rows on average) touched "
            f"{ev['distinct_per_step_layer']:g} experts per step and layer; independent uniform routing touches "
            f"{ev['uniform_per_step_layer']:g} (band top {ev['band_top_per_step_layer']:g}, z = {ev['z']:g}): "
            "each step reads more expert weights than its batch needs (docs/metrics.md, \"Efficiency\")."]


def _drift_section(attribution: dict | None) -> list[str]:
    if not attribution:
        return []
    lines = ["", "## What moved between the window's earlier and later half", ""]
    for layer, by_kind in attribution.items():
        kind, att = max(by_kind.items(), key=lambda kv: kv[1]["mix_explains"])
        top = att["groups"][0] if att["groups"] else None
        others = ", ".join(f"{k} mix {v['mix_explains']:.0%}" for k, v in by_kind.items() if k != kind)
        what = (f": {kind} **{top[kind]}** {top['share_before']:.0%} -> {top['share_after']:.0%} of the traffic"
                if top else "")
        lines.append(f"- layer {layer} (load moved by {att.get('shift_l1', 0.0):.3f} L1): the {kind} mix "
                     f"explains {att['mix_explains']:.0%}{what} ({others})")
    return lines + ["", "When no mix explains the shift, the routing itself changed for the same traffic (a router"
                    " or weights change: see playbooks/MoERoutingDrift.md)."]


def _pairs_section(top_pairs: dict | None) -> list[str]:
    if not top_pairs:
        return []
    lines = ["", f"## Experts chosen together most (co-activation; {TOP_PAIRS} per layer in coactivation.csv)", ""]
    for layer, pairs in top_pairs.items():
        lines.append(f"- layer {layer}: " + ", ".join(f"{p['expert_a']}+{p['expert_b']} ({p['tokens']} tokens)"
                                                      for p in pairs))
    return lines
