"""``moescope report --out DIR``: offline tables, heatmaps and a summary a person reads first.

From the trace store: load per layer and expert; per domain, per tenant and per phase (prefill/decode);
co-activation of expert pairs; the drift between the window's earlier and later half attributed to the
domain/tenant/phase whose traffic share moved. From an import (SGLang/Megatron dumps): load and the
per-pass heatmap (the dumps hold no domains, phases or token-level pairs).

Files: ``load.csv``, ``load_by_domain.csv``, ``load_by_tenant.csv``, ``load_by_phase.csv``,
``coactivation.csv``, ``heatmap_layer<L>.png`` (expert x pass), ``domains_layer<L>.png`` (expert x domain)
and ``summary.md``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moescope import stats


def _frame(rows: list[dict]):
    import pandas as pd

    return pd.DataFrame(rows)


def token_rows(window) -> list[dict]:
    """One row per (request, layer, expert) with slot counts split by phase: the base of the group tables."""
    rows = []
    for i, rid in enumerate(window.ids):
        r = window.routing[i].astype(np.int64)
        n_prompt = window.n_prompt[i]
        for j, layer in enumerate(window.layers):
            for phase, sel in (("prefill", r[:n_prompt, j]), ("decode", r[n_prompt:, j])):
                counts = np.bincount(sel.ravel(), minlength=window.n_experts + 1)[: window.n_experts]
                for e in np.nonzero(counts)[0]:
                    rows.append({"request_id": rid, "domain": window.domain[i] or "-",
                                 "tenant": window.tenant[i] or "-", "phase": phase, "layer": layer,
                                 "expert": int(e), "slots": int(counts[e]), "half": 0})
    return rows


def _heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, xticks=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    im = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest", origin="lower")
    ax.set_ylabel("expert")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.set_yticks(range(matrix.shape[0]))
    if xticks is not None:
        ax.set_xticks(range(len(xticks)))
        ax.set_xticklabels(xticks, rotation=30, ha="right")
    fig.colorbar(im, ax=ax, label="share of the column's slots")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _shares(m: np.ndarray) -> np.ndarray:
    """Column-normalised: each column (a pass, a domain) sums to 1."""
    tot = m.sum(0, keepdims=True)
    return np.divide(m, tot, out=np.zeros_like(m, dtype=float), where=tot > 0)


def attribute_drift(df, layer: int, by: str) -> dict:
    """How much of the load shift between the window's halves the traffic mix along ``by`` (domain, tenant
    or phase) explains.

    The per-expert distribution is p = sum_g w_g p_g (w_g: group g's share of slots). Holding each group's
    own distribution at its whole-window value q_g, a change of mix alone moves p by m = sum_g dw_g q_g. The
    mix explains ||m|| / ||p_late - p_early|| (L1, capped at 1); a group's part of it is its term's norm."""
    d = df[df.layer == layer]
    n_exp = int(df.expert.max()) + 1

    def dist(part):
        v = np.zeros(n_exp)
        np.add.at(v, part.expert.to_numpy(), part.slots.to_numpy())
        return v

    halves = {h: d[d.half == h] for h in (0, 1)}
    totals = {h: halves[h].slots.sum() for h in (0, 1)}
    if not totals[0] or not totals[1]:
        return {"mix_explains": 0.0, "groups": []}
    shift = np.abs(dist(halves[1]) / totals[1] - dist(halves[0]) / totals[0]).sum()
    mix = np.zeros(n_exp)
    groups = []
    for g, sub in d.groupby(by):
        q = dist(sub) / max(1, sub.slots.sum())
        w = {h: sub[sub.half == h].slots.sum() / totals[h] for h in (0, 1)}
        term = (w[1] - w[0]) * q
        mix += term
        groups.append({by: g, "share_before": round(float(w[0]), 4), "share_after": round(float(w[1]), 4),
                       "_norm": float(np.abs(term).sum())})
    z = sum(gr["_norm"] for gr in groups) or 1.0
    for gr in groups:
        gr["part_of_mix_effect"] = round(gr.pop("_norm") / z, 4)
    explains = min(1.0, float(np.abs(mix).sum() / shift)) if shift > 0 else 0.0
    return {"mix_explains": round(explains, 4), "shift_l1": round(float(shift), 4),
            "groups": sorted(groups, key=lambda r: -r["part_of_mix_effect"])}


def build(out_dir: str | Path, *, traces_path: str | None = None, import_path: str | None = None,
          since: float | None = None) -> dict:
    from moescope.analysis import profile as profile_mod

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prof = profile_mod.load(traces_path, import_path, since=since)
    files, summary = [], {"source": prof.source, "n_experts": prof.n_experts, "layers": prof.layers}

    load_rows = []
    for layer, tot in prof.load().items():
        s = tot.sum()
        for e, v in enumerate(tot):
            load_rows.append({"layer": layer, "expert": e, "slots": int(v), "share": float(v / s) if s else 0.0})
    load = _frame(load_rows)
    load.to_csv(out / "load.csv", index=False)
    files.append("load.csv")
    per_layer = {}
    for layer, tot in prof.load().items():
        per_layer[layer] = {"cv": round(stats.load_cv(tot.tolist()), 4), "hottest": int(np.argmax(tot)),
                            "hottest_share": round(float(tot.max() / max(1, tot.sum())), 4),
                            "dead": [int(e) for e in np.nonzero(tot == 0)[0]]}
        _heatmap(_shares(prof.passes[layer].T.astype(float)), out / f"heatmap_layer{layer}.png",
                 f"layer {layer}: expert share per pass", "pass (forward / recorder pass / iteration)")
        files.append(f"heatmap_layer{layer}.png")
    summary["per_layer"] = per_layer

    attributions = {}
    if import_path is None:
        from moescope.analysis.diagnose import load_window
        from moescope.traces import store

        conn = store.open_store(traces_path)
        try:
            window = load_window(conn, since=since, limit=100000)
        finally:
            conn.close()
        df = _frame(token_rows(window))
        order = np.argsort(window.started, kind="stable")
        late = {window.ids[i] for i in order[len(order) // 2:]}
        df["half"] = df.request_id.isin(late).astype(int)
        for by in ("domain", "tenant", "phase"):
            t = df.groupby(["layer", by, "expert"], as_index=False).slots.sum()
            t["share"] = t.slots / t.groupby(["layer", by]).slots.transform("sum")
            t.to_csv(out / f"load_by_{by}.csv", index=False)
            files.append(f"load_by_{by}.csv")
        for layer in window.layers:
            t = df[df.layer == layer].groupby(["domain", "expert"]).slots.sum().unstack(fill_value=0)
            t = t.reindex(columns=range(window.n_experts), fill_value=0)
            _heatmap(_shares(t.to_numpy().T.astype(float)), out / f"domains_layer{layer}.png",
                     f"layer {layer}: expert share per domain", "domain", list(t.index))
            files.append(f"domains_layer{layer}.png")
            attributions[layer] = {by: attribute_drift(df, layer, by) for by in ("domain", "tenant", "phase")}
        co_rows = []
        for layer, m in sorted(prof.coactivation.items()):
            iu = np.triu_indices(m.shape[0], 1)
            for a, b in zip(*iu):
                if m[a, b]:
                    co_rows.append({"layer": layer, "expert_a": int(a), "expert_b": int(b), "tokens": int(m[a, b])})
        co = _frame(co_rows)
        co.to_csv(out / "coactivation.csv", index=False)
        files.append("coactivation.csv")
        summary["requests"] = len(window.ids)
        summary["top_pairs"] = {int(layer): g.nlargest(3, "tokens")[["expert_a", "expert_b", "tokens"]]
                                .to_dict("records") for layer, g in co.groupby("layer")} if len(co) else {}
        summary["drift_attribution"] = attributions
    (out / "summary.md").write_text(_markdown(summary, files))
    files.append("summary.md")
    summary["files"] = files
    return summary


def _markdown(s: dict, files: list[str]) -> str:
    lines = [f"# moescope report: {s['source']}", ""]
    if "requests" in s:
        lines.append(f"{s['requests']} requests, {len(s['layers'])} MoE layers, {s['n_experts']} experts each.")
    else:
        lines.append(f"{len(s['layers'])} MoE layers, {s['n_experts']} experts each (an import: no domains, "
                     "phases or token-level pairs).")
    lines += ["", "## Load per layer", "", "| layer | load CV | hottest expert (share) | dead experts |",
              "|---|---|---|---|"]
    for layer, v in s["per_layer"].items():
        lines.append(f"| {layer} | {v['cv']:.3f} | {v['hottest']} ({v['hottest_share']:.1%}) | "
                     f"{', '.join(map(str, v['dead'])) or 'none'} |")
    lines += ["", "A healthy layer's CV sits under 0.10-0.15; `moescope diagnose` says whether it is a problem."]
    if s.get("drift_attribution"):
        lines += ["", "## What moved between the window's earlier and later half", ""]
        for layer, by_kind in s["drift_attribution"].items():
            kind, att = max(by_kind.items(), key=lambda kv: kv[1]["mix_explains"])
            top = att["groups"][0] if att["groups"] else None
            others = ", ".join(f"{k} mix {v['mix_explains']:.0%}" for k, v in by_kind.items() if k != kind)
            what = (f": {kind} **{top[kind]}** {top['share_before']:.0%} -> {top['share_after']:.0%} of the traffic"
                    if top else "")
            lines.append(f"- layer {layer} (load moved by {att['shift_l1']:.3f} L1): the {kind} mix explains "
                         f"{att['mix_explains']:.0%}{what} ({others})")
        lines += ["", "When no mix explains the shift, the routing itself changed for the same traffic (a router"
                  " or weights change: see playbooks/MoERoutingDrift.md)."]
    if s.get("top_pairs"):
        lines += ["", "## Experts chosen together most (co-activation)", ""]
        for layer, pairs in s["top_pairs"].items():
            lines.append(f"- layer {layer}: " + ", ".join(f"{p['expert_a']}+{p['expert_b']} ({p['tokens']} tokens)"
                                                          for p in pairs))
    lines += ["", "## Files", ""] + [f"- `{f}`" for f in files] + [""]
    return "\n".join(lines)
