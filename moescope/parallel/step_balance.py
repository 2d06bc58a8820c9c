"""Would expert parallelism, and EPLB, help? Each MoE layer's busiest rank over its mean rank, per engine step,
predicted from the step's measured routing for the placements a user could run (issue [eplb]).

An expert-parallel layer's all-to-all and expert compute end when its busiest rank ends: what a step waits on is
that step's busiest rank, not the run's average. The routing probe hands over, per summary, the per-expert slots of
up to 64 evenly spaced steps (``capture.routing_probe.StepSample``); for each placement this module computes each
sampled step's load per rank and keeps, per (EP size, placement, redundant experts):

- the distribution over steps of busiest / mean rank, of the worst layer and of the mean over layers (per layer only
  when asked: 58 layers x 256 experts would multiply the series), in fixed buckets (the catalogue's: bounded memory,
  exported as a Prometheus histogram, quantiles by ``histogram_quantile`` or ``quantile``);
- the straggler factor: the sum over sampled steps and layers of the busiest rank over the sum of the mean rank
  (what a run's MoE time is against a perfectly balanced one, each layer waiting on its busiest rank), with its
  standard error from the sample (a ratio estimator over steps: ``stderr``);
- the average-load figure that hides it: busiest / mean rank of the same steps' counts added up, per layer, summed
  over layers alike (what balancing on whole-run counts sees).

Placements (``Layout``: a physical-to-logical map, physical expert p on rank p // (P / ranks), as vLLM lays them):
- ``linear`` and ``round_robin``: vLLM's ``expert_placement_strategy`` (``expert_map_manager.determine_expert_map``:
  contiguous blocks, the remainder to the first ranks; or expert e on rank e mod N);
- ``eplb``: vLLM's EPLB with R redundant experts: vLLM's initial map until the first rearrangement, then its default
  policy (``parallel.eplb_policy``, a port) on the load of the last ``window`` steps, every ``every`` steps, the
  first after ``every // 4`` (vLLM starts its counter at 3/4 of the interval: ``EplbState.add_model``);
- ``plan``: moescope's planner (``parallel.planner.plan_layer``) on the same schedule, with the same slots;
- ``in_use``: the placement the engine runs now (the reference runtime's ``Placement``, vLLM's EPLB maps), where it
  has one; a change of it is a rearrangement, with its balance before and after (``Rearrangement``).

A replicated expert's slots are split evenly over its replicas (1/R each). vLLM picks a replica per token by a hash
of the token's row in the rank's batch (``fused_moe/router/base_router.py``: ``(row * 2654435769 mod 2^32) mod R``,
0.31-0.33): over a step's tokens every replica gets 1/R of them in expectation; the reference runtime deals them in
turn (``ExpertParallel._destinations``), within one slot per routing rank of 1/R. Steps are the engine's: with
data-parallel attention over D ranks an EP step carries D ranks' batches, larger than the one measured here, and
per-step imbalance shrinks with the batch; the prediction is for a step of the batch measured (exact for
tensor-parallel attention over the EP group, and for one process).

Cost per summary: for each placement one gather of [S, L, P] (static placements: one reshape-sum of [S, L, E]), one
reduction, one bincount; ``cost_s`` measures it. Sampling: 64 of N steps per summary, evenly spaced; a quantile's
error is the sample's (``sampled_steps`` says how many), the straggler factor's is ``stderr``.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from moescope.errors import BadInput
from moescope.parallel import eplb_policy
from moescope.parallel.eplb import MIN_GAIN
from moescope.parallel.layouts import (InUse, Layout, _fold, _shares, deal, from_ranks, max_mean,  # noqa: F401
                                       per_rank, rank_loads, static_layout)
from moescope.parallel.planner import plan_or_keep

PLACEMENTS = ("linear", "round_robin", "eplb", "plan")
MAX_EP = 64
WORST, MEAN = "worst", "mean"  # the layer label of the worst layer's and of the mean over layers' distributions
EVENTS_KEPT = 64  # in-use rearrangements kept (one line each)
# Multiply-adds per summary: ~1-3 ms of float32 matmul on one core of this project's machines. At DeepSeek-V3's shape
# (58 x 256, default placements: 3.7M per step) that judges 8 of a summary's 64 sampled steps; at 8 experts all 64.
WORK_BUDGET = 32_000_000
# moescope's planner (``planner.plan_layer``) is a Python loop over replicas x ranks: at 58 layers x (256 + 64) replicas
# on 64 ranks about a second per rearrangement on this project's machines (vLLM's policy: ~0.05 s a size). By default
# the ``plan`` entry is kept to EP sizes up to 16 (a rearrangement of all default entries then ~0.3 s, every
# ``Schedule.every`` steps); name larger sizes with ``ep_sizes`` and ``plan_max_ep``.
PLAN_MAX_EP = 16


@dataclass(frozen=True)
class Schedule:
    """When EPLB recomputes its placement, as vLLM's ``EPLBConfig``: from the load of the last ``window`` steps
    (``window_size``), every ``every`` steps (``step_interval``), the first after ``first`` steps (vLLM: every // 4)."""

    window: int = 1000
    every: int = 3000
    first: int | None = None

    def __post_init__(self) -> None:
        if self.window < 1 or self.every < 1:
            raise BadInput(f"EPLB's window and interval are steps >= 1, got {self.window} and {self.every}")

    @property
    def start(self) -> int:
        return self.every // 4 if self.first is None else self.first


@dataclass
class _Acc:
    """One (placement, EP size, redundant) entry's accumulators (bounded: buckets x stats, L x N)."""

    layout: Layout
    hist: np.ndarray  # [stats, buckets + 1] steps per bucket (last: above the top bucket)
    total: np.ndarray  # [stats] sum of the observed ratios
    n: np.ndarray  # [stats] steps observed
    ratio_sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # sum b, m, b^2, m^2, b*m over steps
    rank_sum: np.ndarray | None = None  # [L, N] slots per rank over the sampled steps
    values: list | None = None  # kept per step (offline: exact quantiles)
    dealt: np.ndarray | None = None  # ``deal(layout)``, kept until the layout changes


@dataclass(frozen=True)
class Entry:
    """One placement's figures (``Snapshot.entries``)."""

    placement: str
    ep: int
    redundant: int
    stats: tuple[str, ...]  # "worst", "mean", then layer ids as strings where per-layer is on
    buckets: tuple[float, ...]  # the histogram's upper bounds (``hist`` has one more: above the last)
    hist: np.ndarray  # [stats, buckets + 1] (not cumulative)
    total: np.ndarray
    count: np.ndarray
    straggler: float  # sum of busiest / sum of mean, over sampled steps and layers (NaN: nothing yet)
    stderr: float  # its standard error from the sample of steps
    average: float  # busiest / mean of the same steps' counts added up, over layers alike
    values: np.ndarray | None = None  # [steps, stats] per-step ratios where kept (offline)

    def quantile(self, q: float, stat: str = WORST) -> float:
        """The ``q`` quantile of the per-step ratio (exact from ``values`` where kept, else interpolated in its
        bucket as Prometheus' ``histogram_quantile``); NaN without a step."""
        j = self.stats.index(stat)
        if self.values is not None:
            v = self.values[:, j]
            v = v[np.isfinite(v)]
            return float(np.quantile(v, q)) if len(v) else float("nan")
        return histogram_quantile(q, self.hist[j], self.buckets)


def histogram_quantile(q: float, counts: np.ndarray, buckets) -> float:
    """Prometheus' ``histogram_quantile`` over ``buckets`` (``counts`` per bucket, the last above the top one)."""
    total = counts.sum()
    if total <= 0:
        return float("nan")
    rank = q * total
    cum = np.cumsum(counts)
    b = int(np.searchsorted(cum, rank))
    if b >= len(buckets):
        return float(buckets[-1])
    lo = buckets[b - 1] if b > 0 else 0.0
    below = cum[b - 1] if b > 0 else 0.0
    q_value = lo + (buckets[b] - lo) * ((rank - below) / counts[b] if counts[b] else 1.0)
    return float(max(1.0, q_value))  # (a ratio to the mean is never under 1: the lowest bucket interpolates from 0)


@dataclass(frozen=True)
class Rearrangement:
    """The placement in use changed (a rearrangement of the runtime's EPLB or of vLLM's): straggler factors
    ``before`` (the old placement, the steps since the last change), ``predicted_old`` / ``predicted_new`` (both
    placements on the window's counts: what the new one should gain) and ``after`` (the new placement, the steps
    since; NaN until a step), all sums over layers."""

    step: int
    before: float
    predicted_old: float
    predicted_new: float
    after: float
    after_steps: int


@dataclass(frozen=True)
class Snapshot:
    """What the exporter, ``top`` and the CLI read (immutable)."""

    steps: int  # engine steps the samples were drawn from
    sampled: int  # steps sampled
    schedule: Schedule
    entries: tuple[Entry, ...]
    rearrangements: tuple[Rearrangement, ...] = ()
    in_use_rank_slots: tuple[float, ...] = ()  # the placement in use: slots per rank, every step, summed over layers
    in_use_physical: np.ndarray | None = None  # [L, P] the same per physical expert slot
    cost_s: float = 0.0  # host seconds spent in ``observe`` so far
    observed: int = 0  # summaries observed
    layers: tuple[int, ...] = ()  # MoE layers (``in_use_physical``'s rows)
    rearranged: int = 0  # changes of the placement in use (``rearrangements`` keeps the last ``EVENTS_KEPT``)

    def entry(self, placement: str, ep: int, redundant: int | None = None) -> Entry | None:
        for e in self.entries:
            if e.placement == placement and e.ep == ep and (redundant is None or e.redundant == redundant):
                return e
        return None


def default_ep_sizes(n_experts: int) -> tuple[int, ...]:
    """EP sizes that divide the experts, 2 to ``MAX_EP``."""
    return tuple(n for n in range(2, min(MAX_EP, n_experts) + 1) if n_experts % n == 0)


class StepBalance:
    """Accumulates the step-level prediction from the routing summaries (``observe``; one thread at a time) and
    hands out immutable ``Snapshot``s (``snapshot``; any thread).

    Args:
        moe_layers: the model's MoE layers (rows in this order).
        n_experts: logical experts per layer.
        buckets: upper bounds of the per-step ratio's histogram (the catalogue's ``STEP_BALANCE_BUCKETS``).
        ep_sizes: EP sizes to predict (default: every size that divides E, up to 64).
        placements: of ``PLACEMENTS``.
        redundant: redundant experts R for ``eplb`` and ``plan`` per EP size (default: one per rank, R = N; a size
            whose E + R the ranks do not divide is left out).
        schedule: EPLB's window and interval (vLLM's defaults: 1000 and 3000 steps).
        groups, nodes: vLLM's policy's expert groups and nodes (hierarchical when groups divide over nodes).
        per_layer: also keep each layer's distribution (cardinality: layers x entries x buckets).
        keep_values: keep every step's ratios (offline, for exact quantiles; unbounded).
        in_use_source: () -> ``Layout`` or None, the placement the engine runs now (read once per summary).
        budget: multiply-adds per summary (``WORK_BUDGET``); the steps judged are as many of the sample as it pays.
        plan_min_gain: the ``plan`` entry moves a layer only for a gain over this, as the runtime's EPLB in the loop
            (``parallel.eplb.Rebalancer.min_gain``).
        plan_max_ep: the ``plan`` entry at EP sizes up to this only (``PLAN_MAX_EP``).
        warm: [L, E] a load EPLB and the plan start from (instead of vLLM's initial map): offline, the steps before
            the ones judged, so that a short trace judges EPLB's steady state, out of sample.
    """

    def __init__(self, moe_layers, n_experts: int, *, buckets, ep_sizes=None, placements=PLACEMENTS, redundant=None,
                 schedule: Schedule = Schedule(), groups: int = 1, nodes: int = 1, per_layer: bool = False,
                 keep_values: bool = False, in_use_source=None, budget: int = WORK_BUDGET, warm=None,
                 plan_min_gain: float = MIN_GAIN, plan_max_ep: int = PLAN_MAX_EP) -> None:
        self.layers = tuple(moe_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.n_experts, self.schedule = n_experts, schedule
        self.groups, self.nodes = groups, nodes
        self.per_layer, self.keep_values = per_layer, keep_values
        self.in_use_source = in_use_source
        self.budget = budget
        self.plan_min_gain = plan_min_gain
        self.buckets = tuple(float(b) for b in buckets)
        bad = [p for p in placements if p not in PLACEMENTS]
        if bad:
            raise BadInput(f"unknown placement {bad[0]!r}; choose of {', '.join(PLACEMENTS)}")
        sizes = default_ep_sizes(n_experts) if ep_sizes is None else tuple(ep_sizes)
        for n in sizes:
            if not 1 <= n <= n_experts:
                raise BadInput(f"an EP size is 1 to the experts ({n_experts}), got {n}")
        self.stats = (WORST, MEAN) + (tuple(str(layer) for layer in self.layers) if per_layer else ())
        self._lock = threading.Lock()
        self._acc: dict[tuple, _Acc] = {}
        n_layers = len(self.layers)
        for n in sizes:
            for p in placements:
                if p in ("linear", "round_robin"):
                    self._add(static_layout(p, n_experts, n, n_layers))
                    continue
                r = n if redundant is None else redundant if isinstance(redundant, int) else redundant.get(n)
                if r is None or (n_experts + r) % n or (p == "plan" and n > plan_max_ep):
                    continue
                self._add(self._initial(p, n, r))
        self._window: collections.deque = collections.deque()  # (steps, [L, E] counts), oldest first
        self._window_steps = 0
        self.steps = 0  # engine steps observed (the samples' population)
        self.sampled = 0
        self.observed = 0
        self.cost_s = 0.0
        self._next = schedule.start  # the step count at which EPLB rearranges next
        self._in_use: _Acc | None = None  # the engine's own placement (its entry in ``_acc``)
        self._in_use_since: _Acc | None = None  # the same since its last change
        self._in_use_rank: np.ndarray | None = None
        self._in_use_phys: np.ndarray | None = None
        self.rearrangements: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
        self.rearranged = 0
        if warm is not None:  # EPLB and the plan start from the placement this load gives (offline: held out)
            self._rearrange(warm)

    def _initial(self, placement: str, n: int, r: int) -> Layout:
        """EPLB's map before its first rearrangement (vLLM's ``initial``; the planner's entry starts from it too)."""
        phy = np.tile(eplb_policy.initial(self.n_experts, r), (len(self.layers), 1))
        return Layout(placement, n, r, phy)

    def start_from(self, placement: str, ep: int, redundant: int, phy2log: np.ndarray) -> None:
        """The entry's placement until its first rearrangement is ``phy2log`` [L, P] (an engine's starting
        placement, as the runtime's EPLB in the loop starts from its own)."""
        acc = self._acc[(placement, ep, redundant)]
        acc.layout, acc.dealt = Layout(placement, ep, redundant, np.asarray(phy2log, dtype=np.int64)), None

    def _new(self, layout: Layout | None) -> _Acc:
        k = len(self.stats)
        return _Acc(layout, np.zeros((k, len(self.buckets) + 1)), np.zeros(k), np.zeros(k),
                    values=[] if self.keep_values else None)

    def _add(self, layout: Layout) -> None:
        self._acc[layout.key] = self._new(layout)

    # -- engine side (one thread) -----------------------------------------------------------------------------
    def observe(self, st) -> None:
        """One routing summary (``StepStats`` with its ``sample``; without one, nothing to do)."""
        sample = st.sample
        if sample is None or not st.layers:
            return
        rows = [self.row.get(ls.layer) for ls in st.layers]
        keep = [j for j, r in enumerate(rows) if r is not None]
        n_layers, e = len(self.layers), self.n_experts
        counts = np.zeros((len(sample.index), n_layers, e), dtype=np.float32)
        totals = np.zeros((n_layers, e), dtype=np.float64)
        for j in keep:
            counts[:, rows[j]] = sample.counts[:, j, :e]
            totals[rows[j]] = st.layers[j].slots[:e]
        self.observe_counts(counts, sample.steps, totals)

    def observe_counts(self, counts: np.ndarray, steps: int, totals: np.ndarray) -> None:
        """``counts`` [S, L, E] the sampled steps' slots (layers in ``moe_layers`` order) of a summary of ``steps``
        engine steps whose slots add up to ``totals`` [L, E]. Every placement is judged on the same steps (paired:
        their difference is not sampling noise): an evenly spaced subset of the sample, as many as ``budget``
        multiply-adds allow (``work_per_step``)."""
        start = time.perf_counter()
        counts = np.asarray(counts, dtype=np.float32)
        with self._lock:
            self._check_in_use()
            use = max(1, min(len(counts), self.budget // max(1, self.work_per_step())))
            if use < len(counts):
                counts = counts[np.unique(np.linspace(0, len(counts) - 1, use).round().astype(np.int64))]
            self._judge(counts)
            if self._in_use is not None:
                self._in_use_totals(totals)
            self.steps += steps
            self.sampled += len(counts)
            self.observed += 1
            self._window.append([steps, np.asarray(totals, dtype=np.float64)])
            self._window_steps += steps
            self._trim_window()
            if self.steps >= self._next:
                self._rearrange()
                while self._next <= self.steps:
                    self._next += self.schedule.every
            self.cost_s += time.perf_counter() - start

    def work_per_step(self) -> int:
        """Multiply-adds one sampled step costs: a matmul of [L, E] by [E, N] per placement that is not a static
        layout (those are reshape-sums of the step's [L, E], folded from the finest size: L x E each)."""
        n_layers, e = len(self.layers), self.n_experts
        return sum(n_layers * e * (acc.layout.ep if acc.layout.kind is None else 1) for acc in self._acc.values())

    def _judge(self, counts: np.ndarray) -> None:
        static: dict[tuple[str, int], np.ndarray] = {}
        for acc in sorted(self._acc.values(), key=lambda a: -a.layout.ep):  # finest first: coarser ones fold
            lay = acc.layout
            if lay.kind is not None:
                finer = next((v for (k, m), v in static.items() if k == lay.kind and m % lay.ep == 0), None)
                loads = _fold(finer, lay.kind, lay.ep) if finer is not None else rank_loads(counts, lay)
                static[(lay.kind, lay.ep)] = loads
            else:
                if acc.dealt is None:
                    acc.dealt = deal(lay, self.n_experts)
                loads = rank_loads(counts, lay, acc.dealt)
            self._accumulate(acc, loads)
            if acc is self._in_use:
                self._accumulate(self._in_use_since, loads)

    def _accumulate(self, acc: _Acc, loads: np.ndarray) -> None:
        busiest, mean = max_mean(loads)  # [S, L]
        routed = mean > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(routed, busiest / np.where(routed, mean, 1.0), np.nan)  # [S, L]
        any_routed = routed.any(1)
        per_stat = [np.where(any_routed, np.nanmax(np.where(routed, ratio, -np.inf), axis=1), np.nan),
                    np.where(any_routed, np.nansum(ratio, axis=1) / np.maximum(routed.sum(1), 1), np.nan)]
        if self.per_layer:
            per_stat += list(ratio.T)
        vals = np.stack(per_stat, axis=1)  # [S, stats]
        ok = np.isfinite(vals)
        bucket = np.searchsorted(np.asarray(self.buckets), np.where(ok, vals, 0.0), side="left")
        for j in range(vals.shape[1]):
            acc.hist[j] += np.bincount(bucket[ok[:, j], j], minlength=len(self.buckets) + 1)
        acc.total += np.where(ok, vals, 0.0).sum(0)
        acc.n += ok.sum(0)
        b, m = busiest.sum(1), mean.sum(1)  # [S] over layers
        acc.ratio_sums += [b.sum(), m.sum(), (b * b).sum(), (m * m).sum(), (b * m).sum()]
        per_rank = loads.sum(0)
        acc.rank_sum = per_rank if acc.rank_sum is None or acc.rank_sum.shape != per_rank.shape else \
            acc.rank_sum + per_rank
        if acc.values is not None:
            acc.values.append(vals)

    def _check_in_use(self) -> None:
        """The engine's own placement (read once per summary): a change of it is a rearrangement, with the old
        placement's straggler factor since the last change (``before``) and both placements on the window's counts."""
        layout = self.in_use_source() if self.in_use_source is not None else None
        cur = self._in_use
        if layout is None or len(layout.phy2log) != len(self.layers) or (cur is not None and _same(cur.layout, layout)):
            return
        layout = Layout("in_use", layout.ep, layout.redundant, layout.phy2log, layout.kind)
        if cur is not None:
            window = self._window_counts()
            before = _straggler(self._in_use_since.ratio_sums)
            if self.rearrangements:  # the last change's "after" ends here
                last = self.rearrangements[-1]
                self.rearrangements[-1] = Rearrangement(last.step, last.before, last.predicted_old,
                                                        last.predicted_new, before, int(self._in_use_since.n[0]))
            self.rearranged += 1
            self.rearrangements.append(Rearrangement(self.steps, before, _aggregate(window, cur.layout),
                                                     _aggregate(window, layout), float("nan"), 0))
            if cur.layout.key != layout.key:
                del self._acc[cur.layout.key]
                cur = None
        if cur is None:
            cur = self._in_use = self._new(layout)
            self._acc[layout.key] = cur
        cur.layout, cur.dealt = layout, None
        self._in_use_since = self._new(layout)

    def _in_use_totals(self, totals: np.ndarray) -> None:
        """Slots per rank and per physical expert of every step of the summary (not only the sampled ones) under
        the placement in use."""
        lay = self._in_use.layout
        phy = lay.phy2log
        t = np.concatenate([np.asarray(totals, dtype=np.float64), np.zeros((len(phy), 1))], axis=1)
        physical = t[np.arange(len(phy))[:, None], np.where(phy < 0, self.n_experts, phy)] * \
            _shares(phy, self.n_experts)  # [L, P]
        whole = physical.reshape(len(phy), lay.ep, -1).sum(-1).sum(0)  # [N]
        # counters: a rank's slots add up across rearrangements (its size unchanged), a physical slot's while the
        # physical experts stay as many
        same_n = self._in_use_rank is not None and len(self._in_use_rank) == len(whole)
        self._in_use_rank = self._in_use_rank + whole if same_n else whole
        same_p = self._in_use_phys is not None and self._in_use_phys.shape == physical.shape
        self._in_use_phys = self._in_use_phys + physical if same_p else physical

    def _trim_window(self) -> None:
        """Keep the last ``window`` steps' counts (and one summary more while the oldest overlaps the edge);
        summaries are merged into chunks of >= window / 32 steps, so at most ~64 are held whatever the interval."""
        w, chunk = self._window, max(1, self.schedule.window // 32)
        if len(w) >= 2 and w[-2][0] < chunk:
            steps, c = w.pop()
            w[-1][0] += steps
            w[-1][1] = w[-1][1] + c
        while len(w) > 1 and self._window_steps - w[0][0] >= self.schedule.window:
            self._window_steps -= w.popleft()[0]

    def _window_counts(self) -> np.ndarray:
        return sum((c for _, c in self._window), np.zeros((len(self.layers), self.n_experts)))

    def _rearrange(self, load: np.ndarray | None = None) -> None:
        """EPLB's (and the planner's) new placements from the window's counts (``load``: these instead), as vLLM's
        ``EplbState.rearrange``."""
        load = self._window_counts() if load is None else np.asarray(load, dtype=np.float64)
        if not load.sum():
            return
        for acc in self._acc.values():
            lay = acc.layout
            if lay.placement == "eplb":
                phy = eplb_policy.rebalance(load, self.n_experts + lay.redundant, self.groups, self.nodes, lay.ep,
                                            old=lay.phy2log)
                acc.layout, acc.dealt = Layout("eplb", lay.ep, lay.redundant, phy), None
            elif lay.placement == "plan":  # as the runtime's EPLB in the loop: a layer moves for a gain only
                slots = (self.n_experts + lay.redundant) // lay.ep
                per_layer = [plan_or_keep(load[i], lay.ep, slots, per_rank(lay, i), self.plan_min_gain)[0]
                             for i in range(len(self.layers))]
                phy = from_ranks("plan", per_layer, self.n_experts).phy2log
                acc.layout, acc.dealt = Layout("plan", lay.ep, lay.redundant, phy), None

    # -- reads (any thread) ----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            entries = tuple(self._entry(acc) for acc in self._acc.values())
            events = list(self.rearrangements)
            if events and self._in_use_since is not None:  # the last change's "after": the steps since
                last, since = events[-1], self._in_use_since
                events[-1] = Rearrangement(last.step, last.before, last.predicted_old, last.predicted_new,
                                           _straggler(since.ratio_sums), int(since.n[0]))
            rank = tuple(float(x) for x in self._in_use_rank) if self._in_use_rank is not None else ()
            phys = self._in_use_phys.copy() if self._in_use_phys is not None else None
            return Snapshot(self.steps, self.sampled, self.schedule, entries, tuple(events), rank, phys,
                            self.cost_s, self.observed, self.layers, self.rearranged)

    def _entry(self, acc: _Acc) -> Entry:
        lay = acc.layout
        values = np.concatenate(acc.values) if acc.values else None
        return Entry(lay.placement, lay.ep, lay.redundant, self.stats, self.buckets, acc.hist.copy(),
                     acc.total.copy(), acc.n.copy(), _straggler(acc.ratio_sums), _stderr(acc.ratio_sums, int(acc.n[0])),
                     _average(acc.rank_sum), values)


def _same(a: Layout, b: Layout) -> bool:
    return a.ep == b.ep and a.phy2log.shape == b.phy2log.shape and bool(np.array_equal(a.phy2log, b.phy2log))


def _straggler(sums: np.ndarray) -> float:
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")


def _stderr(sums: np.ndarray, n: int) -> float:
    """Standard error of the ratio estimator sum(b) / sum(m) over n sampled steps (delta method; the steps as
    independent draws: consecutive decode steps share requests, so this is a lower bound where they are close)."""
    if n < 2 or sums[1] <= 0:
        return float("nan")
    b, m, bb, mm, bm = sums
    r = b / m
    resid = bb - 2 * r * bm + r * r * mm  # sum (b_i - r m_i)^2
    return float(np.sqrt(max(resid, 0.0) / (n * (n - 1))) / (m / n))


def _average(rank_sum: np.ndarray | None) -> float:
    """Busiest / mean rank of the summed counts, summed over layers (``rank_sum`` [L, N])."""
    if rank_sum is None:
        return float("nan")
    mean = rank_sum.mean(-1).sum()
    return float(rank_sum.max(-1).sum() / mean) if mean > 0 else float("nan")


def _aggregate(load: np.ndarray, layout: Layout) -> float:
    """Busiest / mean rank of ``load`` [L, E] under ``layout``, summed over layers."""
    return _average(rank_loads(np.asarray(load, dtype=np.float64)[None], layout)[0])
