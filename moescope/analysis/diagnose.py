"""``moescope diagnose``: ranked findings from the trace store (and, when given, a Prometheus server).

Each check reads what the store really holds and names one cause, with evidence (numbers, layers, experts,
ranks, example request ids) and the playbook to follow. Every bar is the model's in the thresholds object the
alert rules are generated from (``moescope.thresholds``), and each check judges what its alert judges (the
load CV beyond sampling noise, dead experts only where uniform routing would have sent enough slots, a slow
peer by its share of the wait and its wait per dispatch), so a finding here and an alert there mean the same
thing. Checks, in the store's terms:

- non-finite router output: token-layers whose stored entropy is NaN/Inf; the token that triggered it;
- collapse / imbalance: per layer, the share of tokens choosing the top expert, and the load CV;
- drift: Jensen-Shannon divergence of the load between the earlier and later half of the window (or against
  a baseline file), attributed to the domains/tenants whose share moved;
- non-deterministic routing: positions with an identical prefix (same token ids from the start) must route
  identically in any deterministic model; the share of such positions whose expert set differs;
- dropped slots: stored expert id == E (capacity overflow);
- cache thrash: per forward and layer, the experts used and which of them were misses (the miss bitmask);
- slow expert fetches: expert time of forwards with misses against forwards without, per miss;
- slow rank: per-peer wait recorded at each dispatch (entry skew between ranks);
- memory growth: resident memory sampled per step, its linear trend.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moescope import stats
from moescope.thresholds import Thresholds

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
    entropy: list[np.ndarray]  # [n, L] float32
    miss: list[np.ndarray]  # [n, L] uint8
    step_of: list[np.ndarray]  # [n] -> global step key index
    steps: list[dict]  # unique steps (by run, index)
    n_prompt: list[int] = field(default_factory=list)


def load_window(conn, *, since: float | None = None, limit: int = 5000, corrupt=None) -> Window:
    """The newest ``limit`` routed requests (one model); corrupt rows are skipped into ``corrupt``."""
    from moescope.traces.store import CorruptRows, iter_routed

    corrupt = CorruptRows() if corrupt is None else corrupt
    rows = list(iter_routed(conn, since=since, limit=limit, newest=True, corrupt=corrupt))
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
        started.append(r.started)
        w.domain.append(r.domain)
        w.tenant.append(r.tenant)
        w.tokens.append(r.tokens)
        w.routing.append(r.ids)
        w.entropy.append(r.entropy)
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


def _request_counts(w: Window) -> np.ndarray:
    """[R, L, E] slots per expert per request (dropped slots and non-finite positions excluded)."""
    out = np.zeros((len(w.ids), len(w.layers), w.n_experts), dtype=np.int64)
    for i, r in enumerate(w.routing):
        r = r.astype(np.int64)[np.isfinite(w.entropy[i]).all(1)]  # NaN logits route arbitrarily
        for j in range(len(w.layers)):
            out[i, j] = np.bincount(r[:, j].ravel(), minlength=w.n_experts + 1)[: w.n_experts]
    return out


def _cv(counts: np.ndarray) -> np.ndarray:
    """Load CV over the last axis (population std / mean, as ``stats.load_cv``)."""
    mean = counts.mean(-1)
    return np.where(mean > 0, counts.std(-1) / np.maximum(mean, 1e-12), 0.0)


RNG_SEED = 0  # resampling is seeded: a diagnosis of the same store is the same diagnosis


def _check_nonfinite(w: Window) -> list[Finding]:
    bad_layers: Counter = Counter()
    examples: list[str] = []
    in_bad, in_clean = Counter(), Counter()  # requests containing each token id
    from moescope.runtime import tokenizer
    from moescope.traces.sanitize import sanitize

    total = 0
    for rid, ent, tok, n_prompt in zip(w.ids, w.entropy, w.tokens, w.n_prompt):
        bad = ~np.isfinite(ent)
        total += ent.size
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


def _check_load(w: Window, t: Thresholds, drift_found: bool, per_request: np.ndarray) -> list[Finding]:
    b = t.for_model(w.model)
    counts = per_request.sum(0)
    tokens = counts.sum(1) / max(1, w.top_k)
    slots = counts.sum(1)  # [L] computed slots per layer: the sample the sampling noise depends on
    out = []
    cv_bar = b.load_cv
    share = counts.max(1) / np.maximum(tokens, 1)
    collapsed = [j for j in range(len(w.layers)) if share[j] > b.collapse_top_share]
    if collapsed:
        out.append(Finding(
            "collapse", "critical", "Routing collapsed onto one expert", 5.0 + float(share.max()),
            {"layers": {w.layers[j]: {"expert": int(counts[j].argmax()), "top_share": round(float(share[j]), 3)}
                        for j in collapsed}, "threshold": b.collapse_top_share},
            [], "MoEExpertCollapse"))
    cvs = [stats.load_cv(c.tolist()) for c in counts]
    # As the alert: the CV beyond the multinomial noise of the window's slots (a 256-expert layer with a few
    # thousand slots has a CV of ~0.3 from chance alone).
    noise = np.array([b.noise_cv(w.n_experts, n) for n in slots.tolist()])
    excess = [b.excess_cv(cv, w.n_experts, n) for cv, n in zip(cvs, slots.tolist())]
    # A few dozen requests of a skewed domain mix make a noisy CV too: call it imbalance only when the excess
    # CV stays above the bar in 90% of bootstrap resamples of the requests.
    rng = np.random.default_rng(RNG_SEED)
    boot = np.stack([_cv(per_request[rng.integers(0, len(per_request), len(per_request))].sum(0))
                     for _ in range(200)])  # [200, L]
    with np.errstate(invalid="ignore"):
        low = np.percentile(np.sqrt(np.clip(boot ** 2 - noise ** 2, 0, None)), 10, axis=0)
    # As the alert: judged only where the window holds enough slots per expert (ModelThresholds.judges_imbalance)
    over = [j for j in range(len(cvs)) if low[j] > cv_bar and j not in collapsed
            and b.judges_imbalance(w.n_experts, float(slots[j]))]
    if over and not drift_found:
        out.append(Finding(
            "imbalance", "warning", "Expert load is imbalanced", max(excess[j] for j in over) / cv_bar,
            {"layers": {w.layers[j]: {"cv": round(cvs[j], 3), "noise_cv": round(float(noise[j]), 3),
                                      "excess_cv": round(excess[j], 3), "excess_cv_p10": round(float(low[j]), 3),
                                      "hot": [int(e) for e in np.argsort(-counts[j])[:2]],
                                      "cold": [int(e) for e in np.argsort(counts[j])[:2]]} for j in over},
             "threshold": cv_bar, "stationary": True},
            [], "MoEExpertLoadImbalance"))
    # As the alert: an empty expert is dead only where uniform routing would have sent it enough slots.
    dead = {w.layers[j]: [int(e) for e in np.nonzero(counts[j] == 0)[0]] for j in range(len(w.layers))
            if (counts[j] == 0).any() and b.judges_dead(w.n_experts, float(slots[j]))}
    if dead and not collapsed:
        out.append(Finding("dead-experts", "warning", "Experts receive no tokens", 1.0 + len(dead),
                           {"layers": dead, "min_expected_slots": b.dead_min_expected_slots}, [], "MoEDeadExperts"))
    return out


def _mix(labels: list[str | None], idx: np.ndarray) -> dict[str, float]:
    c = Counter(labels[i] or "-" for i in idx)
    n = sum(c.values())
    return {k: v / n for k, v in sorted(c.items())}


def _check_drift(w: Window, t: Thresholds, baseline: dict | None, per_request: np.ndarray) -> list[Finding]:
    bar = t.for_model(w.model).drift_jsd_bits
    n = len(w.ids)
    order = np.argsort(w.started, kind="stable")
    early, late = order[: n // 2], order[n // 2:]
    if baseline is None and n < 8:
        return []
    late_counts = per_request[late].sum(0)
    if baseline is not None:
        ref = {layer: np.asarray(baseline[layer], float) for layer in w.layers if layer in baseline}
        against = "baseline"
    else:
        early_counts = per_request[early].sum(0)
        ref = {layer: early_counts[j] for j, layer in enumerate(w.layers)}
        against = "earlier half of the window"
    jsd = {layer: stats.jensen_shannon(late_counts[j].tolist(), ref[layer].tolist())
           for j, layer in enumerate(w.layers) if layer in ref and ref[layer].sum() > 0}
    over = {layer: round(v, 4) for layer, v in jsd.items() if v > bar}
    if over and baseline is None:
        # Two halves of a few dozen requests differ by chance. One permutation test for the model (the sum of
        # the layers' divergences against the same sum over random splits of the same requests, at 95%), then
        # per layer the same test to name the layers: 58 layers each tested alone at 95% would find "drift" in
        # about three of them by chance every time.
        rng = np.random.default_rng(RNG_SEED)
        tested = [j for j, layer in enumerate(w.layers) if layer in jsd]
        null = np.empty((100, len(tested)))
        for i in range(100):
            perm = rng.permutation(n)
            a, b = per_request[perm[: n // 2]].sum(0), per_request[perm[n // 2:]].sum(0)
            null[i] = [stats.jensen_shannon(b[j].tolist(), a[j].tolist()) for j in tested]
        if sum(jsd.values()) <= np.percentile(null.sum(1), 95):
            return []
        p95 = dict(zip((w.layers[j] for j in tested), np.percentile(null, 95, axis=0)))
        over = {layer: v for layer, v in over.items() if v > p95[layer]}
    if not over:
        return []
    evidence: dict[str, Any] = {"jsd_bits": over, "threshold": bar, "against": against}
    for name, labels in (("domain", w.domain), ("tenant", w.tenant)):
        before, after = _mix(labels, early), _mix(labels, late)
        moved = {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in set(before) | set(after)}
        tvd = sum(abs(v) for v in moved.values()) / 2
        if tvd > 0.1:
            evidence[f"{name}_shift"] = dict(sorted(moved.items(), key=lambda kv: -abs(kv[1])))
    cause = ("traffic mix changed: " + ", ".join(f"{k} {v:+.0%}" for k, v in list(
        evidence["domain_shift"].items())[:3])) if "domain_shift" in evidence else \
        "routing changed with an unchanged traffic mix (router or weights changed?)"
    evidence["explanation"] = cause
    examples = [w.ids[i] for i in late[-3:]]
    return [Finding("drift", "warning", "Routing drifted", max(over.values()) / bar, evidence, examples,
                    "MoERoutingDrift")]


def _check_jitter(w: Window, t: Thresholds) -> list[Finding]:
    """Identical prefixes must route identically: compare every position whose whole prefix (from the first
    token) another stored request shares."""
    first: dict[tuple, tuple[int, int]] = {}  # prefix hash -> (request, position) seen first
    compared = flipped = 0
    by_layer = np.zeros(len(w.layers), dtype=np.int64)
    examples: list[str] = []
    for i, toks in enumerate(w.tokens):
        finite = np.isfinite(w.entropy[i]).all(1)
        h = 0
        sets = np.sort(w.routing[i], axis=2)
        for pos, tok in enumerate(toks.tolist()):
            h = hash((h, tok))
            seen = first.get(h)
            if seen is None:
                first[h] = (i, pos)
                continue
            j, p = seen
            if not (finite[pos] and np.isfinite(w.entropy[j][p]).all()):
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
    if compared < 50:
        return []
    ratio = flipped / compared
    bar = t.for_model(w.model).flip_ratio
    if ratio <= bar:
        return [Finding("jitter", "info", "Routing is deterministic on shared prefixes", 0.0,
                        {"positions_compared": compared, "flipped": flipped, "flip_ratio": round(ratio, 4)})]
    return [Finding("jitter", "warning", "Routing is not deterministic: identical prefixes route differently",
                    ratio / bar,
                    {"positions_compared": compared, "flipped": flipped, "flip_ratio": round(ratio, 4),
                     "by_layer": {w.layers[j]: int(v) for j, v in enumerate(by_layer)}, "threshold": bar},
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
    bar = t.for_model(w.model).drop_ratio
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
    hit_rate = 1 - misses / np.maximum(lookups, 1)
    b = t.for_model(w.model)
    bar = b.cache_hit_rate
    low = {w.layers[j]: round(float(h), 3) for j, h in enumerate(hit_rate) if h < bar}
    examples = [rid for rid, m in zip(w.ids, w.miss) if m.any()][:5]
    if low:
        out.append(Finding("thrash", "warning", "The expert cache thrashes", bar / max(0.01, min(low.values())),
                           {"hit_rate": low, "threshold": bar, "lookups": int(lookups.sum()),
                            "note": "lookups counted per forward and layer from the stored miss bits"},
                           examples, "MoEExpertCacheHitRateLow"))
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
    if len(per_miss) >= 5:
        med, p90 = float(np.median(per_miss)), float(np.percentile(per_miss, 90))
        # As the alert (p99 of the fetch time above the bar, i.e. over 1% of fetches slower than it), on the
        # store's per-miss estimate: the share of forwards whose misses cost more than the bar each.
        slow_bar = b.fetch_p99_s
        over = float(np.mean(np.array(per_miss) > slow_bar))
        if over > 0.01:
            out.append(Finding("switch-jitter", "warning", "Expert fetches are slow", over / 0.01,
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
    b = t.for_model(w.model)
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


MEMORY_MIN_SPAN_S = 10.0


def _check_memory(w: Window, t: Thresholds) -> list[Finding]:
    pts = sorted((st["t"], st["rss"]) for st in w.steps if st.get("t") and st.get("rss"))
    if len(pts) < 30:
        return []
    ts = np.array([p[0] for p in pts])
    rss = np.array([p[1] for p in pts], dtype=float)
    ts, rss = ts[len(ts) // 5:], rss[len(rss) // 5:]  # skip start-up (allocator and caches warming)
    if ts[-1] - ts[0] < MEMORY_MIN_SPAN_S:  # a process' first seconds grow and shrink: too short to call a trend
        return [Finding("leak", "info", f"Memory: {ts[-1] - ts[0]:.0f} s of steps, too short to judge a trend "
                        f"(needs {MEMORY_MIN_SPAN_S:.0f} s)", 0.0, {"over_s": round(float(ts[-1] - ts[0]), 1)})]
    slope, _ = np.polyfit(ts - ts[0], rss, 1)
    r = float(np.corrcoef(ts, rss)[0, 1]) if rss.std() > 0 else 0.0
    per_step = (rss[-1] - rss[0]) / max(1, len(rss) - 1)
    growth = rss[-1] - rss[0]
    half = len(rss) // 2
    first, second = rss[half] - rss[0], rss[-1] - rss[half]
    # A warming process grows and then plateaus (its second half flat or shrinking); a leak keeps growing with
    # traffic: steadily (r near 1), by real amounts, and still in the second half.
    if not (r > 0.9 and growth > 16 * 2**20 and per_step > 64 * 2**10 and second / (len(rss) - half) > 32 * 2**10):
        return []
    capacity = t.for_model(w.model).memory_capacity_bytes
    hours_left = (capacity - rss[-1]) / slope / 3600 if slope > 0 else math.inf
    return [Finding("leak", "warning", "Memory grows with traffic", slope / (1 * 2**20),
                    {"rss_bytes_per_s": int(slope), "bytes_per_step": int(per_step), "correlation": round(r, 3),
                     "grew_bytes": int(growth), "first_half_bytes": int(first), "second_half_bytes": int(second),
                     "over_s": round(float(ts[-1] - ts[0]), 1),
                     "capacity_bytes": capacity, "hours_to_capacity": round(hours_left, 2)}, [],
                    "MoEMemoryGrowth")]


def diagnose(conn, *, since: float | None = None, limit: int = 5000, baseline: dict | None = None,
             thresholds: Thresholds = Thresholds(), prometheus: str | None = None, corrupt=None) -> dict:
    w = load_window(conn, since=since, limit=limit, corrupt=corrupt)
    per_request = _request_counts(w)
    drift = _check_drift(w, thresholds, baseline, per_request)
    findings = [*_check_nonfinite(w), *_check_load(w, thresholds, bool(drift), per_request), *drift,
                *_check_jitter(w, thresholds), *_check_drop(w, thresholds), *_check_cache(w, thresholds),
                *_check_ranks(w, thresholds), *_check_memory(w, thresholds)]
    if prometheus:
        from moescope.analysis import prom_evidence

        findings += [Finding(**f) for f in prom_evidence.findings(prometheus, w.model)]
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -f.score))
    for f in findings:
        if f.playbook:
            f.playbook = f"{PLAYBOOKS}/{f.playbook}.md"
    n_tokens = sum(len(x) for x in w.tokens)
    return {"model": w.model, "requests": len(w.ids), "routed_tokens": n_tokens, "layers": w.layers,
            "window": {"from": float(w.started.min()), "to": float(w.started.max())},
            "alarming": sum(f.severity != "info" for f in findings),
            "findings": [f.as_dict() for f in findings]}
