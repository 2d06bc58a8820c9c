"""``moescope diagnose``: ranked findings from the trace store (and, when given, a Prometheus server).

Each check reads what the store really holds and names one cause, with evidence (numbers, layers, experts,
ranks, example request ids) and the playbook to follow. Routing is judged by ``judge``: the window's
per-request counts become the exporter's quantities through the same ``moescope.sampling`` functions (each
request one draw: noise CV, excess CV, hot factor, unexpected dead experts, drift noise), and the verdicts are
the alert rules' through the same ``Thresholds`` methods, so a finding here and an alert there mean the same
thing (tests/test_views_agree.py feeds both). An info finding says what was judged against what (baseline or
the no-baseline bar) and where the traffic seen cannot tell. Checks, in the store's terms:

- non-finite router output: token-layers whose stored entropy is NaN/Inf; the token that triggered it;
- collapse / imbalance / hot / dead: ``judge`` (top share; excess CV against the imbalance bar; an expert's
  share over its baseline or fair share; zero-slot experts the reference predicts);
- drift: Jensen-Shannon divergence against the baseline (else the window's earlier half) beyond its sampling
  noise, attributed to the domains/tenants whose share moved;
- non-deterministic routing: positions with an identical prefix (same token ids from the start) must route
  identically in any deterministic model; the share of such positions whose expert set differs, compared within
  one writer run only (another run may serve another router: a fault, a new checkpoint);
- dropped slots: stored expert id == E (capacity overflow);
- cache thrash: per forward and layer, the experts used and which of them were misses (the miss bitmask);
- slow expert fetches: expert time of forwards with misses against forwards without, per miss;
- slow rank: per-peer wait recorded at each dispatch (entry skew between ranks);
- memory growth: resident memory sampled per step, its linear trend.

Which requests: a store often holds several writer runs (each process that wrote it: a healthy run, then a
fault run; an old run that dropped tokens). ``select_runs`` picks the latest by default (the run of the most
recent request, with any run written alongside it), one given run, or all of them; the report says which and
what it left out.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from moescope import sampling
from moescope import judge as judging
from moescope.judge import Judgement, draws_of
from moescope.analysis import baseline as bl, prom_evidence
from moescope.analysis import ep_advice, step_experts
from moescope.config import DEFAULT_WINDOW_S
from moescope.errors import BadInput
from moescope.metrics.window import LearnedRows
from moescope.runtime import tokenizer
from moescope.thresholds import DEFAULT, Thresholds
from moescope.traces.sanitize import sanitize
from moescope.traces.store import CorruptRows, iter_routed, routed_runs

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
PLAYBOOKS = "playbooks"


@dataclass
class Finding:
    cause: str  # a stable id: collapse, imbalance, drift, jitter, nonfinite, drop, thrash, switch-jitter, ...
    severity: str  # critical | warning | info
    title: str
    score: float  # how far past its threshold (1.0 = at the threshold); ranks findings of one severity
    evidence: dict[str, Any] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # request ids
    playbook: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Window:
    """The stored requests a diagnosis reads, as arrays."""

    ids: list[str]
    started: np.ndarray  # [R]
    domain: list[str | None]
    tenant: list[str | None]
    model: str | None
    n_experts: int
    top_k: int
    layers: list[int]
    tokens: list[np.ndarray]  # per request: the routed positions' token ids
    routing: list[np.ndarray]  # per request [n, L, k] int16
    entropy: list[np.ndarray]  # [n, L] float32 (NaN: non-finite router output, or unknown: see nonfinite)
    miss: list[np.ndarray]  # [n, L] uint8
    step_of: list[np.ndarray]  # [n] -> global step key index
    steps: list[dict]  # unique steps (by run, index)
    n_prompt: list[int] = field(default_factory=list)
    run: list[str | None] = field(default_factory=list)  # per request: the writer run that stored it
    # per request [n, L] bool: non-finite router output (``Routed.nonfinite``: an engine that gives no router
    # scores, vLLM, stores NaN meaning unknown, which is never read as a non-finite router)
    nonfinite: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.nonfinite and self.entropy:  # a window built from entropy alone: every step scored
            self.nonfinite = [~np.isfinite(e) for e in self.entropy]


def load_window(conn, *, since: float | None = None, limit: int = 5000, corrupt=None, runs=None,
                model: str | None = None) -> Window:
    """The newest ``limit`` routed requests (one model); corrupt rows are skipped into ``corrupt``. ``runs``:
    only the requests of these writer runs (``select_runs``; None: every run); ``model``: only this model's
    (None: the shape most of the window's requests have)."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    rows = list(iter_routed(conn, since=since, limit=limit, newest=True, corrupt=corrupt, runs=runs, model=model))
    if not rows:
        raise corrupt.nothing_left("the trace store holds no routed requests in this window (run `moescope demo`, "
                                   "or widen --since)")
    keys: dict[tuple, int] = {}
    steps: list[dict] = []
    started: list[float] = []
    last = rows[-1]
    w = Window([], np.zeros(0), [], [], last.model, last.n_experts, last.top_k, last.layers, [], [], [], [], [],
               steps)
    for r in rows:
        if r.layers != w.layers or r.top_k != w.top_k or r.n_experts != w.n_experts:
            continue  # another model's requests: diagnose one model at a time
        w.ids.append(r.request_id)
        w.n_prompt.append(r.n_prompt)
        w.run.append(r.run)
        started.append(r.started)
        w.domain.append(r.domain)
        w.tenant.append(r.tenant)
        w.tokens.append(r.tokens)
        w.routing.append(r.ids)
        w.entropy.append(r.entropy)
        w.nonfinite.append(r.nonfinite)
        w.miss.append(r.miss)
        index = []
        for st in r.steps:
            key = (st.get("run"), st.get("index"))
            if key not in keys or key == (None, None):
                keys[key] = len(steps)
                steps.append(st)
            index.append(keys[key])
        w.step_of.append(np.array(index, dtype=np.int64)[r.step_of] if index else np.zeros(r.n_routed, np.int64))
    w.started = np.array(started)
    return w


def _request_counts(w: Window, rows: range | None = None) -> np.ndarray:
    """[R, L, E] slots per expert per request (dropped slots and non-finite positions excluded); ``rows``: only
    those requests."""
    rows = range(len(w.ids)) if rows is None else rows
    out = np.zeros((len(rows), len(w.layers), w.n_experts), dtype=np.int32)
    for k, i in enumerate(rows):
        r = w.routing[i].astype(np.int64)[~w.nonfinite[i].any(1)]  # NaN logits route arbitrarily
        for j in range(len(w.layers)):
            out[k, j] = np.bincount(r[:, j].ravel(), minlength=w.n_experts + 1)[: w.n_experts]
    return out


def _draws_of_rows(w: Window, rows, chunk: int = 256) -> sampling.Draws:
    """The draws of the requests ``rows`` (indices), a ``chunk`` at a time (never every request's counts at once)."""
    rows = list(rows)
    draws = sampling.Draws.zeros(len(w.layers), w.n_experts)
    for lo in range(0, len(rows), chunk):
        draws.add(sampling.Draws.of(_request_counts(w, rows[lo: lo + chunk])))
    return draws


def window_judgement(w: Window, baseline=None, t: Thresholds = DEFAULT, chunk: int = 256,
                     hot_reference: str = "learned", learn_window_s: float = DEFAULT_WINDOW_S) -> Judgement:
    """``judge`` of a whole window without holding every request's counts at once (``report`` reads up to
    100,000 requests), against the reference ``diagnose`` judges against: ``baseline``, else (``hot_reference``
    "learned") the reference learned from the requests of the window's first ``learn_window_s``, the later ones
    judged (``first_window``), else the fair share ("fair": only as asked)."""
    rows, learned = range(len(w.ids)), None
    if baseline is None and hot_reference == "learned":
        first, later = first_window(w, learn_window_s)
        if first is None:
            learned = not_learned(len(w.layers), w.n_experts)
        else:
            learned = learned_from(_draws_of_rows(w, first, chunk), w.layers, w.top_k, t,
                                   _routed_tokens(_subset(w, first)))
            rows = later
    draws = _draws_of_rows(w, rows, chunk)
    judged = w if len(rows) == len(w.ids) else _subset(w, np.asarray(rows))
    return judge_counts(draws.counts, draws, w.layers, w.top_k, baseline, t, tokens=_routed_tokens(judged),
                 learned=learned)


def _routed_tokens(w: Window) -> np.ndarray:
    """[L] the tokens each layer routed (positions with finite router output, as ``_request_counts`` counts;
    dropped slots included, as the exporter's token count includes them)."""
    n = sum(int((~bad.any(1)).sum()) for bad in w.nonfinite)
    return np.full(len(w.layers), float(n))


def judge_counts(counts: np.ndarray, draws: sampling.Draws, layers: list[int], top_k: int, baseline=None,
                 t: Thresholds = DEFAULT, tokens=None, learned=None) -> Judgement:
    """``moescope.judge.judge_window`` with ``baseline`` as a ``baseline.Profile``, a path or {layer: load};
    ``learned``: without a baseline, the reference learned from the run's first window (``learned_reference``)."""
    return judging.judge_window(counts, draws, layers, top_k, bl.coerce(baseline) if baseline is not None else None,
                                t, tokens=tokens, learned=learned)


def judge_requests(per_request: np.ndarray, layers: list[int], top_k: int, baseline=None,
                   t: Thresholds = DEFAULT, tokens=None, learned=None) -> Judgement:
    """``judge`` of per-request counts [R, L, E] (each request one draw, as the exporter folds them)."""
    per_request = np.asarray(per_request)
    return judge_counts(per_request.sum(0), draws_of(per_request), layers, top_k, baseline, t, tokens, learned)


def learned_reference(per_request: np.ndarray, layers: list[int], top_k: int, t: Thresholds = DEFAULT,
                      tokens=None):
    """The reference the exporter learns from its first full window (``metrics.window.LearnedReference``), from
    that window's per-request counts [R, L, E]: each layer's draw shares, excess CV and top share, learned where
    the window judged the layer (at least ``sampling.MIN_DRAWS`` requests)."""
    return learned_from(draws_of(np.asarray(per_request)), layers, top_k, t, tokens)


def learned_from(draws: sampling.Draws, layers: list[int], top_k: int, t: Thresholds = DEFAULT, tokens=None):
    """``learned_reference`` from the first window's draws (``sampling.Draws``: the demo's summary keeps no
    per-request counts)."""
    j = judge_counts(draws.counts, draws, layers, top_k, None, t, tokens)
    has = (draws.draws >= sampling.MIN_DRAWS) & np.isfinite(j.excess_cv) & np.isfinite(j.top_share)
    return LearnedRows(sampling.draw_shares(draws), has, np.nan_to_num(j.excess_cv), np.nan_to_num(j.top_share))


def not_learned(n_layers: int, n_experts: int):
    """A reference still being learned on every layer (``judge``'s "learning": hot experts named, not paged;
    imbalance and dead not judged; collapse only over ``Thresholds.collapse_ceiling``)."""
    return LearnedRows(np.zeros((n_layers, n_experts)), np.zeros(n_layers, dtype=bool), np.zeros(n_layers),
                       np.zeros(n_layers))


def first_window(w: Window, learn_window_s: float) -> tuple[np.ndarray | None, np.ndarray]:
    """(the requests that started within ``learn_window_s`` of the first, the later ones): indices; the first is
    None when either holds fewer than ``sampling.MIN_DRAWS`` (nothing learned: every request judged)."""
    first = w.started < (w.started.min() if len(w.started) else 0.0) + learn_window_s
    early, later = np.nonzero(first)[0], np.nonzero(~first)[0]
    if len(early) < sampling.MIN_DRAWS or len(later) < sampling.MIN_DRAWS:
        return None, np.arange(len(w.ids))
    return early, later


def _against_learned(w: Window, per_request: np.ndarray, t: Thresholds, learn_window_s: float):
    """(the requests judged, their counts, the learned reference): the reference learned from the requests that
    started within ``learn_window_s`` of the first (``learned_reference``), the later ones judged against it;
    when fewer than ``sampling.MIN_DRAWS`` came later (or first), every request is judged and the reference is
    still being learned (``has`` all False)."""
    early, later = first_window(w, learn_window_s)
    if early is None:
        return w, per_request, not_learned(len(w.layers), w.n_experts)
    learned = learned_reference(per_request[early], w.layers, w.top_k, t, _routed_tokens(_subset(w, early)))
    return _subset(w, later), per_request[later], learned


def _subset(w: Window, rows: np.ndarray) -> Window:
    """``w`` with only the requests ``rows`` (the per-request lists; the steps stay shared)."""
    pick = rows.tolist()
    per = {f.name: [getattr(w, f.name)[i] for i in pick] for f in fields(w)
           if isinstance(getattr(w, f.name), list) and f.name not in ("layers", "steps")
           and len(getattr(w, f.name)) == len(w.ids)}
    return replace(w, started=w.started[rows], **per)


def _check_nonfinite(w: Window) -> list[Finding]:
    bad_layers: Counter = Counter()
    examples: list[str] = []
    in_bad, in_clean = Counter(), Counter()  # requests containing each token id

    total = 0
    for rid, bad, tok, n_prompt in zip(w.ids, w.nonfinite, w.tokens, w.n_prompt):
        total += bad.size
        prompt = set(tok[:n_prompt].tolist())  # outputs sampled from NaN logits are a consequence
        if bad.any():
            for j in np.nonzero(bad.any(0))[0]:
                bad_layers[w.layers[j]] += int(bad[:, j].sum())
            examples.append(rid)
            in_bad.update(prompt)
        else:
            in_clean.update(prompt)
    if not examples:
        return []
    # Masked attention spreads an Inf to a whole sequence (0 * Inf = NaN), so the first non-finite position
    # is not the culprit: the prompt tokens present in failing requests and in no clean one are.
    suspects = sorted((t for t in in_bad if in_clean[t] == 0), key=lambda t: (-in_bad[t], t))
    triggers = {sanitize(tokenizer.token_text(t)): f"{in_bad[t]}/{len(examples)} failing requests"
                for t in suspects[:5]}
    n = sum(bad_layers.values())
    return [Finding("nonfinite", "critical", "The router produced NaN/Inf logits", 10.0 + n / max(1, total),
                    {"token_layers": n, "share": round(n / total, 6), "requests": len(examples),
                     "by_layer": dict(sorted(bad_layers.items())),
                     "tokens_only_in_failing_requests": triggers},
                    examples[:5], "MoERouterNonFiniteLogits")]


def _check_load(w: Window, t: Thresholds, j: Judgement, per_request: np.ndarray) -> list[Finding]:
    """Collapse, imbalance, hot and dead experts, and what the window could not judge: ``judge``'s verdicts
    (the rules' expressions over the exporter's quantities), with their evidence."""
    out = []
    collapsed = j.collapsed
    if collapsed.any():
        out.append(Finding(
            "collapse", "critical", "Routing collapsed onto one expert", 5.0 + float(j.top_share[collapsed].max()),
            {"layers": {w.layers[i]: {"expert": int(j.counts[i].argmax()),
                                      "top_share": round(float(j.top_share[i]), 3),
                                      "bar": round(float(j.collapse_bar[i]), 3), "reference": j.hot_reference[i]}
                        for i in np.nonzero(collapsed)[0]},
             "threshold": t.collapse_top_share},
            [], "MoEExpertCollapse"))
    over = [i for i in np.nonzero(j.imbalanced & ~collapsed)[0]]
    if over:
        out.append(Finding(
            "imbalance", "warning", "Expert load is imbalanced", max(j.excess_cv[i] / j.bar[i] for i in over),
            {"layers": {w.layers[i]: {"cv": round(float(j.cv[i]), 3), "noise_cv": round(float(j.noise_cv[i]), 3),
                                      "excess_cv": round(float(j.excess_cv[i]), 3), "bar": round(float(j.bar[i]), 3),
                                      "hot": [int(e) for e in np.argsort(-j.counts[i], kind="stable")[:2]],
                                      "cold": [int(e) for e in np.argsort(j.counts[i], kind="stable")[:2]]}
                        for i in over},
             "bar_from": _bar_source(j), "requests": len(w.ids)},
            [], "MoEExpertLoadImbalance"))
    hot = [(i, e) for i, v in enumerate(j.verdicts) for e in v.hot_shown]  # none on a collapsed layer
    if hot:
        hot.sort(key=lambda x: -j.hot_factor[x])
        experts = [_hot_evidence(w, j, int(i), int(e), per_request) for i, e in hot]
        first = experts[0]
        # while every layer's reference is still being learned the alert pages none of them: named, not paged
        paged = any(v.hot for v in j.verdicts)
        out.append(Finding(
            "hot-expert", "warning" if paged else "info",
            f"Hot expert: L{first['layer']} E{first['expert']} at {first['factor']:.1f}x its "
            f"{j.hot_reference[hot[0][0]] if paged else 'fair'} share" + ("" if paged else
                                                                           " (reference being learned: not paged)"),
            max(h["factor"] for h in experts) / t.hot_factor,
            {"experts": experts, "threshold": t.hot_factor, "reference": j.reference},
            first.pop("examples"), "MoEExpertHot"))
        for h in experts[1:]:
            h.pop("examples")
    dead = {w.layers[i]: [int(e) for e in np.nonzero(j.dead_mask[i])[0]] for i in range(len(w.layers))
            if j.dead[i] > 0 and not collapsed[i]}
    if dead:
        out.append(Finding("dead-experts", "warning", "Experts receive no tokens where traffic predicts them",
                           1.0 + len(dead), {"layers": dead, "reference": j.reference,
                                             "min_expected_slots": t.dead_min_expected_slots}, [], "MoEDeadExperts"))
    out.append(_what_was_judged(w, j))
    return out


def _bar_source(j: Judgement) -> str:
    if j.baseline_cv is not None:
        return (f"baseline: {j.t.imbalance_baseline_factor:g} x its structural CV + "
                f"{j.t.imbalance_baseline_margin:g}")
    if "learned" in j.hot_reference:
        return (f"learned from the run's first window: {j.t.imbalance_baseline_factor:g} x its structural CV + "
                f"{j.t.imbalance_baseline_margin:g}")
    return f"the fair share (as asked): excess CV {j.t.imbalance_cv:g}"


def judged_against(j: Judgement) -> str:
    """What imbalance (and collapse, dead) was judged against, in words (the views' one phrasing)."""
    kinds = set(j.hot_reference)
    if j.baseline_cv is not None:
        return "judged against baseline"
    if kinds == {"learned"}:
        return "no baseline: judged against the reference learned from the run's first window"
    if kinds == {"learning"}:
        return (f"no baseline: the reference is still being learned (every request within the run's first window): "
                f"imbalance and dead experts wait, collapse only over {j.t.collapse_ceiling:g}")
    return (f"no baseline: against the fair share (as asked), imbalance above excess CV {j.t.imbalance_cv:g} "
            "(moescope baseline save)")


def _hot_evidence(w: Window, j: Judgement, i: int, e: int, per_request: np.ndarray) -> dict:
    share = j.counts[i, e] / max(1.0, j.counts[i].sum())
    on = per_request[:, i, e]
    return {"layer": w.layers[i], "expert": e, "factor": round(float(j.hot_factor[i, e]), 2),
            "reference": j.reference, "share": round(float(share), 5),
            "reference_share": round(float(j.ref_share[i, e]), 5),
            "slots": int(j.counts[i, e]), "z": round(float((share - j.ref_share[i, e]) / j.hot_sd[i, e]), 1),
            "z_bar": round(j.t.hot_z(len(w.layers), w.n_experts), 2),
            "requests": int((on > 0).sum()), "of_requests": len(w.ids),
            "examples": [w.ids[r] for r in np.argsort(-on, kind="stable")[:3] if on[r] > 0]}


def _what_was_judged(w: Window, j: Judgement) -> Finding:
    """An info finding: what the window could judge, against what, and where the traffic cannot tell."""
    judged = j.judged
    ev: dict[str, Any] = {"imbalance": judged_against(j),
                          "hot_and_dead_against": j.reference if j.baseline_cv is not None else
                          sorted(set(j.hot_reference))[0] if len(set(j.hot_reference)) == 1 else j.reference,
                          "requests": len(w.ids), "layers_judged": int(judged.sum()), "layers": len(w.layers)}
    uneven = {w.layers[i]: j.uneven_words(i) for i in range(len(w.layers)) if j.uneven_words(i)}
    if uneven:  # information, never a finding that needs attention (the rules do not page it)
        ev["uneven"] = uneven
    if not judged.all():
        counted = int(np.min(j.draws)) if len(j.draws) else 0
        with_tokens = f", {counted} with counted tokens in a layer" if counted < len(w.ids) else ""
        ev["not_judged"] = (f"{len(w.ids)} request(s){with_tokens}: too few requests in the window to judge "
                            f"(needs {sampling.MIN_DRAWS})")
    quiet = [i for i in range(len(w.layers)) if judged[i] and j.noise_cv[i] >= j.cv[i]]
    if quiet:
        i = max(quiet, key=lambda x: j.cv[x])
        ev["cannot_tell"] = (f"{len(quiet)} layer(s) within sampling noise, e.g. L{w.layers[i]}: {len(w.ids)} "
                             f"requests: noise CV {j.noise_cv[i]:.2f} >= observed {j.cv[i]:.2f}")
    with np.errstate(invalid="ignore", divide="ignore"):
        share = j.counts / np.maximum(j.counts.sum(1, keepdims=True), 1.0)
        raw = np.where(judged[:, None] & ~j.hot, share / j.ref_share, 0.0)
    if raw.size and np.nanmax(raw) > j.t.hot_factor:  # as hot as the bar, but not beyond this window's noise
        i, e = np.unravel_index(np.nanargmax(raw), raw.shape)
        z = (share[i, e] - j.ref_share[i, e]) / j.hot_sd[i, e]
        ev["hot_cannot_tell"] = (f"L{w.layers[i]} E{e} at {raw[i, e]:.1f}x its {j.reference} share, z {z:.1f} < "
                                 f"{j.t.hot_z(len(w.layers), w.n_experts):.2f} over {int(j.draws[i])} requests: "
                                 "not beyond sampling noise yet")
    title = "Judged: " + ev["imbalance"] + (f"; {ev['not_judged']}" if "not_judged" in ev else "")
    return Finding("judged", "info", title, 0.0, ev)


def _mix(labels: list[str | None], idx: np.ndarray) -> dict[str, float]:
    c = Counter(labels[i] or "-" for i in idx)
    n = sum(c.values())
    return {k: v / n for k, v in sorted(c.items())}


def _check_drift(w: Window, t: Thresholds, j: Judgement, per_request: np.ndarray) -> list[Finding]:
    """As the drift rule: JS divergence beyond its sampling noise by more than ``drift_bits``; against the
    baseline where one is given (``judge``'s), else the window's later half against its earlier half (the
    noise of both halves added)."""
    n = len(w.ids)
    order = np.argsort(w.started, kind="stable")
    early, late = order[: n // 2], order[n // 2:]
    if j.jsd is not None:
        jsd, noise, against = j.jsd, j.drift_noise, "baseline"
    else:
        if n < 2 * sampling.MIN_DRAWS:
            return []
        jsd, noise = judging.drift_between(per_request[early].sum(0), draws_of(per_request[early]),
                                           per_request[late].sum(0), draws_of(per_request[late]), t)
        against = "earlier half of the window"
    over = {w.layers[i]: {"jsd_bits": round(float(jsd[i]), 4), "noise_bits": round(float(noise[i]), 4)}
            for i in range(len(w.layers)) if t.drifted(float(jsd[i]), float(noise[i]))}
    if not over:
        return []
    evidence: dict[str, Any] = {"layers": over, "threshold_bits_over_noise": t.drift_bits, "against": against}
    held = {w.layers[i]: {"excess_cv": round(float(j.excess_cv[i]), 3), "bar": round(float(j.bar[i]), 3),
                          "hot": [int(e) for e in np.argsort(-j.counts[i], kind="stable")[:2]]}
            for i, v in enumerate(j.verdicts) if v.drifted and v.over_bar}
    if held:  # as the rules: a drifted layer's imbalance is not alerted on its own (the drift names it)
        evidence["imbalanced_too"] = held
    for name, labels in (("domain", w.domain), ("tenant", w.tenant)) if j.jsd is None else ():
        before, after = _mix(labels, early), _mix(labels, late)
        moved = {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in set(before) | set(after)}
        if t.mix_shifted(before, after, len(early), len(late)):
            evidence[f"{name}_shift"] = dict(sorted(moved.items(), key=lambda kv: -abs(kv[1])))
    cause = ("traffic mix changed: " + ", ".join(f"{k} {v:+.0%}" for k, v in list(
        evidence["domain_shift"].items())[:3])) if "domain_shift" in evidence else \
        "routing changed with an unchanged traffic mix (router or weights changed?)" if j.jsd is None else \
        "routing moved from the baseline (a router or weights change, or traffic unlike the baseline's)"
    evidence["explanation"] = cause
    examples = [w.ids[i] for i in late[-3:]]
    score = max(v["jsd_bits"] - v["noise_bits"] for v in over.values()) / t.drift_bits
    return [Finding("drift", "warning", "Routing drifted", score, evidence, examples, "MoERoutingDrift")]


def _check_jitter(w: Window, t: Thresholds) -> list[Finding]:
    """Identical prefixes must route identically: compare every position whose whole prefix (from the first
    token) another stored request of the same writer run shares. Determinism is a property of one model state:
    two runs may serve different routers (a fault, a new checkpoint), so prefixes are never compared across
    runs."""
    first: dict[tuple, tuple[int, int]] = {}  # (run, prefix hash) -> (request, position) seen first
    compared = flipped = 0
    by_layer = np.zeros(len(w.layers), dtype=np.int64)
    examples: list[str] = []
    runs = w.run if len(w.run) == len(w.ids) else [None] * len(w.ids)
    for i, toks in enumerate(w.tokens):
        finite = ~w.nonfinite[i].any(1)
        h = 0
        run = runs[i]
        sets = np.sort(w.routing[i], axis=2)
        for pos, tok in enumerate(toks.tolist()):
            h = hash((h, tok))
            seen = first.get((run, h))
            if seen is None:
                first[(run, h)] = (i, pos)
                continue
            j, p = seen
            if not (finite[pos] and not w.nonfinite[j][p].any()):
                continue
            other = np.sort(w.routing[j][p], axis=1)
            if (sets[pos] == w.n_experts).any() or (other == w.n_experts).any():
                continue  # a capacity drop depends on the batch, not on the token: not a routing flip
            diff = (sets[pos] != other).any(1)
            compared += 1
            if diff.any():
                flipped += 1
                by_layer += diff
                if len(examples) < 5 and w.ids[i] not in examples:
                    examples.append(w.ids[i])
    if compared < t.flip_min_compared():
        return []
    ratio = flipped / compared
    bar = t.flip_ratio
    n_runs = len(set(runs))
    within = {"compared_within": "one run" if n_runs == 1 else f"each of {n_runs} runs (never across)"}
    if ratio <= bar:
        return [Finding("jitter", "info", "Routing is deterministic on shared prefixes", 0.0,
                        {"positions_compared": compared, "flipped": flipped, "flip_ratio": round(ratio, 4),
                         **within})]
    return [Finding("jitter", "warning", "Routing is not deterministic: identical prefixes route differently",
                    ratio / bar,
                    {"positions_compared": compared, "flipped": flipped, "flip_ratio": round(ratio, 4),
                     "by_layer": {w.layers[j]: int(v) for j, v in enumerate(by_layer)}, "threshold": bar, **within},
                    examples, "MoERoutingFlips")]


def _check_drop(w: Window, t: Thresholds) -> list[Finding]:
    dropped = np.zeros(len(w.layers), dtype=np.int64)
    total = 0
    examples = []
    for rid, r in zip(w.ids, w.routing):
        d = (r == w.n_experts).sum(axis=(0, 2))
        dropped += d
        total += r.shape[0]
        if d.any() and len(examples) < 5:
            examples.append(rid)
    if total == 0:
        return []
    ratio = dropped / total  # slots dropped per routed token, as the alert computes it
    bar = t.drop_ratio
    over = {w.layers[j]: round(float(v), 4) for j, v in enumerate(ratio) if v > bar}
    if not over:
        return []
    return [Finding("drop", "warning", "The capacity limit drops tokens", max(over.values()) / bar,
                    {"dropped_per_token": over, "threshold": bar, "slots_dropped": int(dropped.sum())},
                    examples, "MoETokensDropped")]


def _step_usage(w: Window) -> tuple[dict, dict]:
    """Per (step, layer): experts used and experts missed (union over the step's stored requests)."""
    used: dict[tuple[int, int], set] = defaultdict(set)
    missed: dict[tuple[int, int], set] = defaultdict(set)
    for r, m, s in zip(w.routing, w.miss, w.step_of):
        for j in range(len(w.layers)):
            for key in np.unique(s):
                rows = s == key
                ids = r[rows, j]
                bits = m[rows, j]
                used[(int(key), j)].update(int(e) for e in np.unique(ids) if e != w.n_experts)
                if bits.any():
                    for slot in range(w.top_k):
                        hit = ((bits >> slot) & 1).astype(bool)
                        missed[(int(key), j)].update(int(e) for e in np.unique(ids[hit, slot]))
    return used, missed


def _check_cache(w: Window, t: Thresholds) -> list[Finding]:
    if not any(m.any() for m in w.miss):
        return []
    used, missed = _step_usage(w)
    out = []
    lookups = np.zeros(len(w.layers))
    misses = np.zeros(len(w.layers))
    for (key, j), experts in used.items():
        lookups[j] += len(experts)
        misses[j] += len(missed.get((key, j), ()))
    # The store does not hold the cache's size: at least as many experts are resident as one forward found
    # resident (used and not missed); a lower capacity means a lower floor, so the estimate errs towards quiet.
    resident = np.zeros(len(w.layers))
    for (key, j), experts in used.items():
        resident[j] = max(resident[j], len(experts) - len(missed.get((key, j), ())))
    capacity = np.maximum(resident, 1) / w.n_experts
    hit_rate, floor, thrash = judging.cache_thrash(lookups - misses, lookups, capacity, t)
    low = {w.layers[j]: round(float(hit_rate[j]), 3) for j in np.nonzero(thrash)[0].tolist()}
    examples = [rid for rid, m in zip(w.ids, w.miss) if m.any()][:5]
    if low:
        worst = min(low, key=low.get)
        bar = float(floor[w.layers.index(worst)])
        out.append(Finding("thrash", "warning", "The expert cache thrashes", bar / max(0.001, low[worst]),
                           {"hit_rate": low, "floor": {w.layers[j]: round(float(floor[j]), 4) for j in range(
                               len(w.layers)) if w.layers[j] in low},
                            "capacity_ratio_at_least": {w.layers[j]: round(float(capacity[j]), 4)
                                                        for j in range(len(w.layers)) if w.layers[j] in low},
                            "lookups": int(lookups.sum()),
                            "note": "lookups counted per forward and layer from the stored miss bits; the floor is "
                                    f"{t.cache_floor_of_capacity:g} x the capacity ratio (a random resident set's "
                                    "hit rate)"},
                           examples, "MoEExpertCacheHitRateLow"))
    return out + _check_switch_jitter(w, t, used, missed, examples)


def _check_switch_jitter(w: Window, t: Thresholds, used: dict, missed: dict, examples: list[str]) -> list[Finding]:
    """As MoEExpertSwitchJitter, from the store: the cost per miss of a forward's expert time with misses against
    the same layer's forwards without (``used`` / ``missed``: ``_step_usage``)."""
    out = []
    # cost per miss: a forward's expert time with n misses against forwards of the same layer without
    per_miss = []
    for j, layer in enumerate(w.layers):
        clean, costly = [], []
        for (key, jj), _ in used.items():
            if jj != j:
                continue
            ls = (w.steps[key].get("layer_s") or {}).get(str(layer))
            if not ls or ls[1] is None:
                continue
            n_miss = len(missed.get((key, j), ()))
            (costly if n_miss else clean).append((ls[1], n_miss))
        if clean and costly:
            base = float(np.median([s for s, _ in clean]))
            per_miss += [(s - base) / n for s, n in costly]
    if len(per_miss) >= t.fetch_min_forwards:
        med, p90 = float(np.median(per_miss)), float(np.percentile(per_miss, 90))
        # As the alert (p99 of the fetch time above the bar, i.e. over 1% of fetches slower than it), on the
        # store's per-miss estimate: the share of forwards whose misses cost more than the bar each.
        slow_bar = t.fetch_p99_s
        over, allowed = float(np.mean(np.array(per_miss) > slow_bar)), 1 - t.fetch_quantile
        if over > allowed:
            out.append(Finding("switch-jitter", "warning", "Expert fetches are slow", over / allowed,
                               {"seconds_per_miss_p50": round(med, 4), "seconds_per_miss_p90": round(p90, 4),
                                "share_over_threshold": round(over, 3),
                                "threshold_s": slow_bar, "forwards_with_misses": len(per_miss),
                                "note": "expert time of forwards with misses minus the median without, per miss"},
                               examples, "MoEExpertSwitchJitter"))
    return out


def _check_ranks(w: Window, t: Thresholds) -> list[Finding]:
    waits: dict[int, list[float]] = defaultdict(list)
    a2a_share = []
    for st in w.steps:
        pw = st.get("peer_wait") or {}
        per_peer: dict[int, float] = defaultdict(float)
        for vals in pw.values():
            for peer, v in enumerate(vals):
                per_peer[peer] += v
        for peer, v in per_peer.items():
            waits[peer].append(v / max(1, len(pw)))
        ls = st.get("layer_s") or {}
        a2a = sum(v[2] for v in ls.values() if v and len(v) > 2 and v[2] is not None)
        if a2a and st.get("seconds"):
            a2a_share.append(a2a / st["seconds"])
    if not waits:
        return []
    # As the alert: a slow peer takes over its share of all the wait on peers and makes a rank wait longer than
    # the bar per dispatch (the store holds the recording rank's waits).
    b = t
    med = {peer: float(np.median(v)) for peer, v in waits.items()}
    mean = {peer: float(np.mean(v)) for peer, v in waits.items()}
    total = sum(mean.values())
    peer = max(mean, key=mean.get)
    share = mean[peer] / total if total > 0 else 0.0
    if not (share > b.slow_rank_share and mean[peer] > b.slow_rank_wait_s):
        return []
    return [Finding("slow-rank", "warning", f"Rank {peer} makes its peers wait in the all-to-all",
                    mean[peer] / b.slow_rank_wait_s,
                    {"peer": peer, "wait_per_dispatch_p50_s": {p: round(v, 5) for p, v in sorted(med.items())},
                     "wait_per_dispatch_mean_s": {p: round(v, 5) for p, v in sorted(mean.items())},
                     "share_of_wait": round(share, 3), "threshold_share": b.slow_rank_share,
                     "threshold_s": b.slow_rank_wait_s,
                     "all_to_all_share_of_step": round(float(np.median(a2a_share)), 3) if a2a_share else None},
                    [], "MoESlowRank")]


def _check_memory(w: Window, t: Thresholds) -> list[Finding]:
    pts = sorted((st["t"], st["rss"], st.get("kv")) for st in w.steps if st.get("t") and st.get("rss"))
    if len(pts) < t.memory_min_points:
        return []
    # The working set: the running requests' KV caches fill as they decode (a busy engine holds more at once).
    # Some of that memory comes back when they end; some the allocator keeps, up to the largest working set so far
    # (RSS steps up at each new peak of the tokens held and stays). A leak is what grows beyond both.
    kv = np.array([p[2] if p[2] is not None else np.nan for p in pts], dtype=float)
    peak = np.fmax.accumulate(kv)
    start = len(pts) // 5  # skip start-up (allocator and caches warming); the peak counts it
    pts, kv, peak = pts[start:], kv[start:], peak[start:]
    ts = np.array([p[0] for p in pts])
    rss = np.array([p[1] for p in pts], dtype=float)
    if ts[-1] - ts[0] < t.memory_min_span_s:  # a process' first seconds grow and shrink: too short for a trend
        return [Finding("leak", "info", f"Memory: {ts[-1] - ts[0]:.0f} s of steps, too short to judge a trend "
                        f"(needs {t.memory_min_span_s:.0f} s)", 0.0, {"over_s": round(float(ts[-1] - ts[0]), 1)})]
    # With the tokens held at each step (stores written since the steps carry "kv"), the trend is fitted on time,
    # the tokens held and their running peak together (rss ~ a + b t + c kv + d peak) and judged on what time
    # alone explains, rss - c kv - d peak.
    per_kv_token = None
    if np.isfinite(kv).all() and kv.std() > 0:
        t_rel = ts - ts[0]
        working = [col for col in (kv, peak) if col.std() > 0]
        x = np.column_stack([np.ones_like(t_rel), *working])
        t_alone = t_rel - x @ np.linalg.lstsq(x, t_rel, rcond=None)[0]  # time, less what the working set follows
        if t_alone.std() < t.memory_time_apart * t_rel.std():  # memory rose with the tokens held: time
            # cannot be told apart from them
            return [Finding("leak", "info", "Memory: the working set (KV-cache tokens held, and their peak) grew "
                            "with time; not judged as a trend", 0.0, {"over_s": round(float(ts[-1] - ts[0]), 1)})]
        coef = np.linalg.lstsq(np.column_stack([x, t_rel]), rss, rcond=None)[0]
        per_kv_token = float(coef[1])
        rss = rss - sum(c * (col - col[0]) for c, col in zip(coef[1:-1], working))
    # Judged as the alert judges it (MoEMemoryGrowth: predict_linear over the window, horizon and capacity from
    # the thresholds): the least-squares line of what time alone explains, extended from the last step by the
    # horizon, over the capacity; and the slope real, not the noise of a short window (noise_z standard errors
    # above zero: the alert's window is 30 minutes, a store's may be seconds).
    t_rel = ts - ts[0]
    capacity = t.memory_capacity_bytes
    slope, se, now = _trend(t_rel, rss)
    predicted = now + slope * t.memory_horizon_s
    if not (slope > t.noise_z * se and predicted > capacity):
        return []
    # The alert extrapolates the latest window's rate (predict_linear over memory_window_s) and skips a process
    # younger than one window: memory that grew and stopped growing (a warm-up: allocator pools, compiled graphs,
    # caches touched once) is not what it pages on. A store's steps may span seconds of a young process, so the
    # same question is asked of the span's latest half, the store's "latest window": a leak keeps its rate there
    # (a line's halves have one slope), a warm-up's rate falls. Named only where the latest half alone also grows
    # beyond its noise and towards capacity within the horizon.
    late = t_rel >= t_rel[-1] / 2
    slope2, se2, now2 = _trend(t_rel[late], rss[late])
    if not (slope2 > t.noise_z * se2 and now2 + slope2 * t.memory_horizon_s > capacity):
        return [Finding("leak", "info", "Memory grew, then slowed: warm-up, not a steady growth", 0.0,
                        {"rss_bytes_per_s": int(slope), "latest_half_rss_bytes_per_s": int(slope2),
                         "latest_half_slope_z": round(slope2 / se2, 1) if se2 > 0 else None,
                         "over_s": round(float(t_rel[-1]), 1),
                         "note": "judged as MoEMemoryGrowth: the latest half's rate extended by the horizon stays "
                                 "under capacity"})]
    r = float(np.corrcoef(ts, rss)[0, 1]) if rss.std() > 0 else 0.0
    per_step = (rss[-1] - rss[0]) / max(1, len(rss) - 1)
    growth = rss[-1] - rss[0]
    half = len(rss) // 2
    first, second = rss[half] - rss[0], rss[-1] - rss[half]
    hours_left = (capacity - now) / slope / 3600
    return [Finding("leak", "warning", "Memory grows with traffic", slope / (1 * 2**20),
                    {"rss_bytes_per_s": int(slope), "bytes_per_step": int(per_step), "correlation": round(r, 3),
                     "grew_bytes": int(growth), "first_half_bytes": int(first), "second_half_bytes": int(second),
                     "over_s": round(float(ts[-1] - ts[0]), 1),
                     "working_set_bytes_per_kv_token": None if per_kv_token is None else int(per_kv_token),
                     "latest_half_rss_bytes_per_s": int(slope2),
                     "capacity_bytes": capacity, "hours_to_capacity": round(hours_left, 2),
                     "horizon_s": t.memory_horizon_s, "slope_z": round(slope / se, 1)}, [],
                    "MoEMemoryGrowth")]


def _trend(t_rel: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """The least-squares line of ``y`` over ``t_rel``: its slope, the slope's standard error (inf with fewer than
    three points or no spread in time) and the line's value at the last point."""
    if len(y) < 3:
        return 0.0, math.inf, float(y[-1]) if len(y) else 0.0
    slope, intercept = np.polyfit(t_rel, y, 1)
    resid = y - (intercept + slope * t_rel)
    spread = float(((t_rel - t_rel.mean()) ** 2).sum())
    se = math.sqrt(float((resid ** 2).sum()) / max(1, len(y) - 2) / spread) if spread > 0 else math.inf
    return float(slope), se, float(intercept + slope * t_rel[-1])


# -- which runs a diagnosis judges ----------------------------------------------------------------------------

ALL_RUNS = "all"


@dataclass
class RunChoice:
    """The writer runs a diagnosis judges, out of those stored in its window (``store.routed_runs``)."""

    how: str  # "latest" | "given" | "all"
    judged: list  # [store.RunSpan] judged
    stored: list  # [store.RunSpan] every run in the window, newest first
    alongside: int = 0  # (latest) runs written while the latest one was: a launch's ranks, a fleet's replicas

    @property
    def ids(self) -> list[str] | None:
        """The ``runs`` filter of ``load_window`` (None: every run)."""
        return None if self.how == "all" else [r.run for r in self.judged]

    @property
    def left_out(self) -> list:
        judged = {r.run for r in self.judged}
        return [r for r in self.stored if r.run not in judged]

    def as_dict(self, requests: int) -> dict:
        """``requests``: those the window judged (read and checked; other runs' rows are counted as stored)."""
        left = self.left_out
        return {"selected": self.how, "judged": [r.run for r in self.judged], "alongside": self.alongside,
                "left_out": {"runs": len(left), "requests": sum(r.requests for r in left)},
                "other_runs": [{"run": r.run, "requests": r.requests, "from": r.first, "to": r.last} for r in left],
                "line": self.line(requests)}

    def line(self, requests: int) -> str:
        """One line: which run(s) were judged (``requests`` of them), and what was left out."""
        n = f"{requests} request{'s' * (requests != 1)}"
        if self.how == "all":
            k = len(self.stored)
            if not k:
                return f"judged {n} (their steps name no writer run)"
            return f"judged all {k} run{'s' * (k != 1)} ({n}); identical prefixes compared within each run"
        first = self.judged[0].run
        if self.how == "given":
            head = f"judged run {first} (--run; {n})"
        elif self.alongside:
            names = ", ".join(r.run for r in self.judged[1:])
            head = f"judged the latest run {first} and {self.alongside} written alongside it ({names}; {n})"
        else:
            head = f"judged the latest run {first} ({n})"
        left = self.left_out
        if not left:
            return head + "; no other run in the window"
        m = sum(r.requests for r in left)
        return (f"{head}; left out {m} request{'s' * (m != 1)} of {len(left)} other run{'s' * (len(left) != 1)} "
                "(--run ID for another, --run all for every run)")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def select_runs(conn, run: str | None = None, *, since: float | None = None, model: str | None = None) -> RunChoice:
    """The runs to judge: ``run`` None, the latest (the run of the most recent request, with any run written
    alongside it: its span overlaps the latest's); ``ALL_RUNS``, every run; else that run id (or a unique prefix
    of one). ``model``: the runs of this model's requests only (None: every model). An id the window does not
    hold is ``BadInput`` naming the stored runs."""
    stored = routed_runs(conn, since=since, model=model)
    if run == ALL_RUNS:
        return RunChoice("all", list(stored), stored)
    if run is None:
        if not stored:  # load_window says the window holds nothing
            return RunChoice("all", [], stored)
        latest = stored[0]
        judged = [latest] + [r for r in stored[1:] if r.last >= latest.first]
        return RunChoice("latest", judged, stored, len(judged) - 1)
    match = [r for r in stored if r.run == run] or [r for r in stored if r.run.startswith(run)]
    if len(match) == 1:
        return RunChoice("given", match, stored)
    window = " in this window" if since is not None else ""
    if not stored:
        raise BadInput(f"--run {run}: the trace store holds no routed requests{window}")
    shown = match if match else stored
    listed = ", ".join(f"{r.run} ({r.requests} requests, {_when(r.first)} to {_when(r.last)})"
                       for r in shown[:8]) + (f", and {len(shown) - 8} more" if len(shown) > 8 else "")
    what = f"--run {run} matches {len(match)} runs" if match else f"no run {run} in the trace store{window}"
    raise BadInput(f"{what}; stored runs, newest first: {listed} (or --run all)")


def diagnose(conn, *, since: float | None = None, limit: int = 5000, baseline=None,
             thresholds: Thresholds = DEFAULT, prometheus: str | None = None, corrupt=None,
             run: str | None = None, model: str | None = None, hot_reference: str = "learned",
             learn_window_s: float = DEFAULT_WINDOW_S) -> dict:
    """Ranked findings. ``baseline``: a ``baseline.Profile`` (or a path, or {layer: load}): the reference of
    imbalance, collapse, hot and dead experts and drift, as the exporter's. Without one, ``hot_reference``
    "learned" (the exporter's default): the reference is learned, as the exporter learns it, from the requests of
    the run's first ``learn_window_s`` (the exporter's window, ``--metrics-window``), and the later requests are
    judged against it (all of them in that first window: the reference is still being learned, as the
    exporter's is: hot experts named, not paged; imbalance and dead not judged; collapse over the ceiling only);
    "fair": against uniform routing. ``run``: which writer run to judge (``select_runs``): None the latest,
    ``ALL_RUNS`` every run, else a run id. ``model``: only this model's requests (None: the shape most of the
    window's requests have)."""
    choice = select_runs(conn, run, since=since, model=model)
    w = load_window(conn, since=since, limit=limit, corrupt=corrupt, runs=choice.ids, model=model)
    per_request = _request_counts(w)
    wj, pj, learned = w, per_request, None
    if baseline is None and hot_reference == "learned":
        wj, pj, learned = _against_learned(w, per_request, thresholds, learn_window_s)
    j = judge_requests(pj, w.layers, w.top_k, baseline, thresholds, _routed_tokens(wj), learned)
    findings = [*_check_nonfinite(w), *_check_load(wj, thresholds, j, pj),
                *_check_drift(w, thresholds, j, per_request),
                *_check_jitter(w, thresholds), *_check_drop(w, thresholds), *_check_cache(w, thresholds),
                *_check_ranks(w, thresholds), *_check_memory(w, thresholds)]
    if prometheus:
        findings += [Finding(**f) for f in prom_evidence.findings(prometheus, w.model, thresholds)]
    spread = step_experts.finding(w.routing, w.step_of, w.n_experts, w.top_k,
                                  step_experts.utilisation_from(prometheus, w.model) if prometheus else None)
    findings += [Finding(**spread)] if spread else []
    balance = ep_advice.diagnose_finding(w)  # [eplb]: would EP and EPLB pay, from the steps' own routing
    findings += [Finding(**balance)] if balance else []
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -f.score))
    for f in findings:
        if f.playbook:
            f.playbook = f"{PLAYBOOKS}/{f.playbook}.md"
    n_tokens = sum(len(x) for x in w.tokens)
    return {"model": w.model, "requests": len(w.ids), "routed_tokens": n_tokens, "layers": w.layers,
            "window": {"from": float(w.started.min()), "to": float(w.started.max())},
            "runs": choice.as_dict(len(w.ids)),
            "alarming": sum(f.severity != "info" for f in findings),
            "findings": [f.as_dict() for f in findings]}
