"""The routing probe: statistics of every MoE layer, from the routing decisions, summarised per interval.

``on_routing`` only keeps a reference to the decision and ``on_step`` only notes the step's boundary (which
requests own which rows of the flat batch) and checks the clock: no work on the hot path. Every
``interval_s`` (and at ``flush()``) the pending decisions of all steps since the last flush are summarised
at once, per layer and per *draw* (the request a row belongs to: moescope.sampling's independent unit):
- on CUDA, in batched device ops (one ``scatter_add_`` for all slots of all layers and draws), then the
  interval's one device->host copy (the rows' draw offsets go up in one host->device copy per interval);
- on CPU the tensors already live in host memory, so numpy reads them in place (no torch dispatch
  overhead): one ``np.bincount`` of ``draw * (E + 1) + expert`` per layer.
The listener (the metrics state, tests) gets one ``StepStats`` per flush covering those steps, with the slots
of each draw (``DrawCounts``) and the requests that finished (``on_request``) by the end of those steps.

Rows map to requests through ``StepRecord.segments`` ((request id, first position, n rows) in row order).
Where they cannot (no segments, as from an instrumented HF model; a row count that does not match), the
step's forward is one draw of its own, complete at once (key None). Decisions routed before any ``on_step``
was ever seen (a model driven without an engine) are split into forwards where a layer repeats.

Once steps are reported, a flush takes the decisions of finished steps only: a flush that lands inside a
forward (a read of an instrumented HF model, whose reads flush) leaves that forward's first layers pending
until its ``on_step`` (``flush(final=True)`` takes all).
Decisions are immutable after their forward, so holding references until the flush is safe; at most
``max_pending`` steps are held.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import RequestRecord, StepRecord

log = logging.getLogger("moescope.capture")


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer in one step."""

    layer: int
    tokens: int  # tokens routed
    slots: np.ndarray  # [E] int64 computed slots per expert (dropped slots excluded)
    dropped: int
    nonfinite: int
    entropy_sum: float
    margin_sum: float
    router_s: float | None = None
    experts_s: float | None = None
    rerouted: dict | None = None  # mitigation ("load", "smoothing") -> slots it changed, when one is on
    # ((forward mode, tokens), ...): the step phase the tokens were routed in ("prefill", "decode"; "unknown" for a
    # forward no engine step reported, as an instrumented HF model's); None: all "unknown"
    modes: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class DrawCounts:
    """The slots of each draw in the summarised steps: ``keys[j]`` a request id (its counts continue in later
    flushes until it is in ``finished``) or None (a forward that could not be mapped to requests: a complete
    draw); ``counts`` [R, L, E] integers, layers in ``StepStats.layers`` order (dropped slots excluded)."""

    keys: tuple
    counts: np.ndarray
    finished: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepStats:
    """The routing of the steps since the previous flush, per layer (timings: the latest step's)."""

    steps: int
    layers: tuple[LayerStats, ...]
    n_experts: int
    top_k: int
    draws: DrawCounts | None = None  # None: no per-draw information (a CUDA-graph decode's in-graph counters)
    experts: "StepExperts | None" = None  # None: no per-step information (a CUDA-graph decode's counters)
    sample: "StepSample | None" = None  # None: no per-step information (as ``experts``)


@dataclass(frozen=True)
class StepExperts:
    """The distinct experts each summarised step touched, per MoE layer (issue 44: what a step reads).

    A step is an engine step (``on_step``'s bounds); decisions no step reported are split into forwards where
    a layer repeats (``index`` -1, phase "unknown"). Dropped slots are not counted (no expert computed them)."""

    index: tuple[int, ...]  # [S] the engine's step index (-1: a forward no engine step reported)
    phases: tuple[str, ...]  # [S] forward mode
    rows: np.ndarray  # [S] int64 token rows the step routed (its first routed layer's)
    distinct: np.ndarray  # [S, L] int64 distinct experts, layers in ``StepStats.layers`` order; -1: not routed
    # [S] int64 from the step's segments (0 where none): the positions its requests hold after it (the KV a
    # step reads), and the positions its rows attend to (causal: row i of a segment at p attends p + i + 1)
    context: np.ndarray | None = None
    attended: np.ndarray | None = None


@dataclass(frozen=True)
class StepSample:
    """The slots per expert of a sample of the summarised steps, per MoE layer: what each step asked of each expert
    (issue [eplb]: a rank's load in a step is the sum over the experts it holds). Up to ``MAX_SAMPLED_STEPS`` steps
    per summary, evenly spaced over the summary's steps (all of them when fewer), so quantiles over steps are
    estimated from an even sample of the steps, not the run's average. Dropped slots are not counted.

    ``index[j]``: the engine's step index of sample ``j`` (-1: a forward no engine step reported), ``of`` its
    position among the summary's steps (``StepExperts`` order), ``counts`` [S, L, E] int32 (layers in
    ``StepStats.layers`` order; a layer that routed nothing in the step has a zero row), ``steps`` how many steps
    the sample was drawn from."""

    index: tuple[int, ...]
    phases: tuple[str, ...]
    of: np.ndarray  # [S] int64
    counts: np.ndarray  # [S, L, E] int32
    steps: int


# Per summary (a flush interval), at most this many steps' per-expert counts (``StepSample``): 64 x 58 x 256 int32
# is 3.8 MB at DeepSeek-V3's shape, a bincount of the sampled rows only.
MAX_SAMPLED_STEPS = 64


def sampled_steps(n_steps: int, limit: int = MAX_SAMPLED_STEPS) -> np.ndarray:
    """[S] int64 positions of the steps a summary samples: every step up to ``limit``, else ``limit`` evenly spaced
    ones (first and last included)."""
    if n_steps <= limit:
        return np.arange(n_steps, dtype=np.int64)
    return np.unique(np.linspace(0, n_steps - 1, limit).round().astype(np.int64))


REROUTE_REASONS = ("load", "smoothing")
UNKNOWN_MODE = "unknown"  # the forward_mode of routing no engine step reported


def _modes(n: int, bounds) -> list[str]:
    """Each of ``n`` pending decisions' forward mode, from the steps' bounds (after the last: unknown)."""
    out: list[str] = []
    for end, _, phase in bounds:
        out += [phase] * (min(end, n) - len(out))
    return out + [UNKNOWN_MODE] * (n - len(out))


def _rerouted(d) -> torch.Tensor:
    """[2] int64 on the decision's device: slots changed by each mitigation (zeros when off)."""
    r = d.rerouted or {}
    zero = torch.zeros((), dtype=torch.int64, device=d.ids.device)
    return torch.stack([r.get(name, zero) for name in REROUTE_REASONS])


def draw_rows(pending, bounds) -> tuple[list, list[np.ndarray | int]]:
    """Each pending decision's draw: (keys, per decision either a draw index for all its rows or an [T] int64
    array of draw indices per row). ``bounds``: (end index into ``pending``, segments) per reported step."""
    keys: list = []
    index: dict[str, int] = {}
    out: list[np.ndarray | int] = []

    def forward_draw() -> int:
        keys.append(None)
        return len(keys) - 1

    start = 0
    for end, segments, _ in bounds:
        decs = pending[start:end]
        if not decs:  # a step that called no per-layer hook (a CUDA-graph decode)
            start = end
            continue
        rows = sum(n for _, _, n in segments)
        if segments and all(d.ids.shape[0] == rows for _, d in decs):
            per_seg = []
            for rid, _, _ in segments:
                j = index.get(rid)
                if j is None:
                    j = index[rid] = len(keys)
                    keys.append(rid)
                per_seg.append(j)
            row_draw = np.repeat(np.asarray(per_seg, dtype=np.int64), [n for _, _, n in segments])
            out += [row_draw] * len(decs)
        else:
            j = forward_draw()
            out += [j] * len(decs)
        start = end
    seen: set[int] = set()
    j = -1
    for layer, _ in pending[start:]:  # no step reported: a layer routed again starts the next forward
        if j < 0 or layer in seen:
            j, seen = forward_draw(), set()
        seen.add(layer)
        out.append(j)
    return keys, out


def step_rows(pending, bounds, index=()) -> tuple[list[int], tuple[int, ...], tuple[str, ...], list[tuple]]:
    """Each pending decision's step (an index into the returned steps), the steps' engine index and phase, and
    their (context, attended) positions (``StepExperts``). ``bounds`` as ``draw_rows`` takes them; decisions
    after the last bound are split where a layer repeats."""
    step_of: list[int] = []
    s_index: list[int] = []
    s_phase: list[str] = []
    s_ctx: list[tuple[int, int]] = []
    start = 0
    for j, (end, segments, phase) in enumerate(bounds):
        if end > start:  # (a step that called no per-layer hook, a CUDA-graph decode, touched nothing here)
            step_of += [len(s_index)] * (end - start)
            s_index.append(index[j] if j < len(index) else -1)
            s_phase.append(phase)
            s_ctx.append((sum(p + n for _, p, n in segments), sum(n * p + n * (n + 1) // 2 for _, p, n in segments)))
        start = end
    seen: set[int] = set()
    for layer, _ in pending[start:]:
        if not seen or layer in seen:
            s_index.append(-1)
            s_phase.append(UNKNOWN_MODE)
            s_ctx.append((0, 0))
            seen = set()
        seen.add(layer)
        step_of.append(len(s_index) - 1)
    return step_of, tuple(s_index), tuple(s_phase), s_ctx


def _step_keys(items, steps: list[int], n_steps: int, width: int, layer: int) -> np.ndarray:
    """[sum T] int64: each row's (layer, step) block start in the distinct-expert table (``width`` per block)."""
    base = (layer * n_steps + np.asarray(steps, dtype=np.int64)) * width
    return np.repeat(base, [d.ids.shape[0] for d, _ in items])


class RoutingProbe(Observer):
    """Turns routing decisions into ``StepStats``, once per ``interval_s`` (0: every step)."""

    def __init__(self, listener: Callable[[StepStats], None], *, interval_s: float = 0.25,
                 max_pending: int = 512, clock: Callable[[], float] = time.monotonic) -> None:
        self._listener = listener
        self.interval_s, self.max_pending, self._clock = interval_s, max_pending, clock
        self._pending: list[tuple[int, "RoutingDecision"]] = []
        self._bounds: list[tuple[int, tuple, str]] = []  # (end index into _pending, segments, phase) per step
        self._finished: list[str] = []
        self._step_index: list[int] = []  # the engine's index of each step in _bounds
        self._stepped = False  # an on_step was seen: flushes take finished steps only
        self._times: dict[int, tuple[float, float]] = {}
        self._steps = 0
        self._last_flush = clock()
        # flush() may run on a scrape thread: the lock guards only the list swap (microseconds), never the
        # summarising, so the engine thread waits on nothing but that swap.
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None  # summarise_in_background(): the probe's own thread
        self._due = threading.Event()
        self._stopping = threading.Event()
        # with a worker: one flush at a time, in order
        self._serial: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.errors = 0  # the worker's flushes that raised (counted, logged once)
        # With an evaluator (``metrics.state``): it calls ``flush`` once per interval on its own thread, and
        # ``on_step`` only calls ``on_due`` (to wake it) when ``max_pending`` steps wait; past ``hard_limit`` steps
        # (the evaluator stalled) the pending routing is dropped and counted (``dropped_steps``), never waited for.
        self.on_due: Callable[[], None] | None = None
        self.hard_limit = 16 * max_pending
        self.dropped_steps = 0
        self._resync = False
        self._seen_at_look = -1  # (``flush(settled=True)`` without steps: the pending count at the last look)
        self._layers_per_step = 0  # decisions of the fullest step seen (a forward's MoE layers)

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        with self._lock:
            self._pending.append((layer, decision))

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        with self._lock:
            self._times[layer] = (router_s, experts_s)

    def on_step(self, step: "StepRecord") -> None:
        self.end_step(step)

    def end_step(self, step: "StepRecord") -> bool:
        """The step ended: its routing is what was routed since the last step (``on_step``, for a caller that reads
        the answer). False: the step was dropped (``resync``) and must not be counted elsewhere either."""
        with self._lock:
            first = self._bounds[-1][0] if self._bounds else 0  # (what a flush left pending is this step's)
            if self._resync:  # capture was turned back on: this step may have begun while it was off
                self._resync = False
                if len(self._pending) - first < self._layers_per_step:  # it did: part of a forward
                    del self._pending[first:]
                    self._times = {}
                    return False
            self._layers_per_step = max(self._layers_per_step, len(self._pending) - first)
            self._bounds.append((len(self._pending), step.segments or (), step.phase or UNKNOWN_MODE))
            self._step_index.append(step.index)
            self._stepped = True
            self._steps += 1
            n = self._steps
            if n >= self.hard_limit:
                self._drop()
        if self.on_due is not None:  # an evaluator summarises: wake it when much waits, nothing more here
            if n == self.max_pending:
                self.on_due()
            return True
        if n >= self.max_pending or self._clock() - self._last_flush >= self.interval_s:
            if self._worker is not None:
                self._due.set()  # the worker summarises: the engine's step goes on at once
            else:
                self.flush()
        return True

    def _drop(self) -> None:
        """The evaluator stalled: drop what is pending (the caller holds the lock), counted."""
        self.dropped_steps += self._steps
        self._pending, self._bounds, self._step_index, self._finished, self._times = [], [], [], [], {}
        self._steps = 0

    def resync(self) -> None:
        """Capture turned back on: if the next step routed fewer layers than a whole forward (it began while capture
        was off), its routing and the step itself are dropped, not counted as a whole one; a step that began after
        is counted as usual."""
        with self._lock:
            self._resync = True

    def summarise_in_background(self) -> None:
        """From now on the periodic summary runs on a thread of the probe's own, never on the engine's: ``on_step``
        only signals it (the step boundary and a list append stay the engine thread's whole cost), and the worker
        also summarises an idle engine's last steps after ``interval_s`` (an engine that never reports going
        idle, as vLLM's). Flushes are serialised so the listener sees them in order. For engines whose step time
        must not carry moescope's summary (the vLLM plugin); an error is counted in ``errors`` and logged once."""
        if self._worker is not None:
            return
        self._serial = threading.Lock()
        self._stopping.clear()

        def run() -> None:
            while not self._stopping.is_set():
                self._due.wait(self.interval_s)
                self._due.clear()
                if self._stopping.is_set() or not (self._bounds or self._finished):
                    continue
                try:
                    self.flush()
                except Exception:  # the worker must outlive a bad flush: counted, logged once
                    self.errors += 1
                    if self.errors == 1:
                        log.exception("routing probe: a background flush failed (counted; further at debug)")
                    else:
                        log.debug("routing probe: a background flush failed", exc_info=True)

        self._worker = threading.Thread(target=run, name="moescope-routing-probe", daemon=True)
        self._worker.start()

    def stop_background(self, timeout: float = 5.0) -> None:
        """Ends the worker of ``summarise_in_background`` (after the flush it may be in); what is still pending
        stays for the caller's ``flush``. No worker: nothing to do."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._stopping.set()
        self._due.set()
        worker.join(timeout)

    def on_request(self, request: "RequestRecord | str") -> None:
        """The request (its record, or its id) finished: its draw is complete once the steps already reported are
        summarised."""
        request_id = request if isinstance(request, str) else request.request_id
        with self._lock:
            self._finished.append(request_id)

    def flush(self, final: bool = False, settled: bool = False) -> None:
        """Summarise what is pending and hand it to the listener. Once steps are reported, only finished steps (a
        forward in flight stays pending); before any (a model driven without an engine) everything, except with
        ``settled`` (a periodic flush from another thread, the evaluator's, which may land inside a forward): then
        only once nothing was routed since the previous such look. ``final``: everything."""
        with self._serial:
            self._flush(final, settled)

    def _flush(self, final: bool, settled: bool = False) -> None:
        with self._lock:
            n = len(self._pending)
            if final:
                cut = n
            elif self._stepped:
                cut = self._bounds[-1][0] if self._bounds else 0
            else:
                cut = n if not settled or n == self._seen_at_look else 0
                self._seen_at_look = n - cut
            pending, self._pending = self._pending[:cut], self._pending[cut:]
            bounds, self._bounds = self._bounds, []
            index, self._step_index = self._step_index, []
            finished, self._finished = self._finished, []
            times, self._times = self._times, {}
            steps, self._steps = self._steps, 0
            self._last_flush = self._clock()
        if pending:
            self._listener(self.summarise(pending, times, steps, bounds, tuple(finished), tuple(index)))
        elif finished:
            self._listener(StepStats(steps, (), 0, 0, DrawCounts((), np.zeros((0, 0, 0), np.int64),
                                                                tuple(finished))))

    def summarise(self, pending, times, steps: int = 1, bounds=(), finished: tuple[str, ...] = (),
                  index: tuple[int, ...] = ()) -> StepStats:
        first = pending[0][1]
        n_exp, k = first.n_experts, first.ids.shape[1]
        keys, draw_of = draw_rows(pending, bounds)
        n_draws = max(1, len(keys))
        step_of, s_index, s_phase, s_ctx = step_rows(pending, bounds, index)
        by_layer: dict[int, list] = {}
        step_by_layer: dict[int, list[int]] = {}
        modes: dict[int, dict[str, int]] = {}
        s_rows = np.zeros(len(s_index), np.int64)
        for (layer, d), dr, mode, s in zip(pending, draw_of, _modes(len(pending), bounds), step_of):
            by_layer.setdefault(layer, []).append((d, dr))
            step_by_layer.setdefault(layer, []).append(s)
            if not s_rows[s]:
                s_rows[s] = d.ids.shape[0]  # (host metadata: no device access)
            per = modes.setdefault(layer, {})
            per[mode] = per.get(mode, 0) + d.ids.shape[0]  # (host metadata: no device access)
        summary = self._host if first.ids.device.type == "cpu" else self._device
        rows, per_draw, distinct = summary(by_layer, n_exp, n_draws, step_by_layer, len(s_index))
        sample = self._sample(by_layer, step_by_layer, len(s_index), n_exp, s_index, s_phase)
        layers = []
        for (layer, decs), row in zip(by_layer.items(), rows):
            r_s, e_s = times.get(layer, (None, None))
            rerouted = None
            if decs[0][0].rerouted is not None:
                rerouted = {name: int(row[n_exp + 5 + i]) for i, name in enumerate(REROUTE_REASONS)
                            if name in decs[0][0].rerouted}
            layers.append(LayerStats(layer=layer, tokens=sum(d.ids.shape[0] for d, _ in decs),
                                     slots=row[:n_exp].astype(np.int64), dropped=int(row[n_exp + 4]),
                                     nonfinite=int(row[n_exp + 3]), entropy_sum=float(row[n_exp + 1]),
                                     margin_sum=float(row[n_exp + 2]), router_s=r_s, experts_s=e_s,
                                     rerouted=rerouted, modes=tuple(sorted(modes[layer].items()))))
        return StepStats(steps=steps, layers=tuple(layers), n_experts=n_exp, top_k=k,
                         draws=DrawCounts(tuple(keys), per_draw, finished),
                         experts=StepExperts(s_index, s_phase, s_rows, distinct.T.astype(np.int64),
                                             *np.asarray(s_ctx, np.int64).reshape(-1, 2).T),
                         sample=sample)

    @staticmethod
    def _sample(by_layer, step_by_layer, n_steps: int, n_exp: int, s_index, s_phase) -> StepSample:
        """The ``StepSample`` of this summary: one bincount over the sampled steps' rows of every layer (on the
        decisions' device, then one copy to the host: once per flush interval)."""
        of = sampled_steps(n_steps)
        slot = np.full(n_steps, -1, dtype=np.int64)
        slot[of] = np.arange(len(of))
        n_sample, width, n_layers = len(of), n_exp + 1, len(by_layer)
        keys, ids = [], []
        for i, (layer, items) in enumerate(by_layer.items()):
            per_row = np.repeat(slot[np.asarray(step_by_layer[layer], dtype=np.int64)],
                                [d.ids.shape[0] for d, _ in items])
            keep = per_row >= 0
            if keep.any():
                kept = torch.from_numpy(np.nonzero(keep)[0])
                layer_ids = torch.cat([d.active_ids for d, _ in items])
                ids.append(layer_ids.index_select(0, kept.to(layer_ids.device)))
                keys.append((per_row[keep] * n_layers + i) * width)
        counts = np.zeros((n_sample, n_layers, n_exp), dtype=np.int32)
        if ids:
            slots = torch.cat(ids)
            base = torch.from_numpy(np.concatenate(keys)).to(slots.device)
            flat = (base[:, None] + slots).reshape(-1)
            binned = torch.zeros(n_sample * n_layers * width, dtype=torch.int32, device=slots.device)
            binned.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # (no max read back: no sync)
            host = binned.cpu().numpy()  # the sample's one device->host copy per flush (a CPU tensor: a view)
            counts[...] = host.reshape(n_sample, n_layers, width)[:, :, :n_exp]
        return StepSample(tuple(s_index[j] for j in of.tolist()), tuple(s_phase[j] for j in of.tolist()), of,
                          counts, n_steps)

    @staticmethod
    def _offsets(decs, width: int, cache: dict | None = None) -> np.ndarray:
        """[sum T] int64: each row's draw times ``width`` (the draw's block in the layer's bincount). Layers
        routed in the same steps share one array (``cache``: computed once per flush, not per layer)."""
        key = tuple(id(dr) if isinstance(dr, np.ndarray) else (dr, d.ids.shape[0]) for d, dr in decs)
        off = cache.get(key) if cache is not None else None
        if off is None:
            off = np.concatenate([dr * width if isinstance(dr, np.ndarray)
                                  else np.full(d.ids.shape[0], dr * width, dtype=np.int64) for d, dr in decs])
            if cache is not None:
                cache[key] = off
        return off

    @classmethod
    def _host(cls, by_layer, n_exp: int, n_draws: int = 1, step_by_layer=None,
              n_steps: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([L, E + 7] float64, [R, L, E] int32). The first: slots per expert + dropped bucket, entropy sum,
        margin sum, non-finite, dropped, slots rerouted by load-aware routing, by smoothing; the second: slots
        per draw per expert (dropped excluded), whose sum over draws is the first's slots.
        CPU tensors only: ``.numpy()`` views the same memory (no copy, no sync). One concatenation per quantity
        over every layer and decision, one bincount for all layers, per-layer sums by ``reduceat``: the cost per
        interval barely grows with the layers (at 58 MoE layers a loop per layer was most of a flush).
        ``by_layer``: layer -> [(decision, draw: an index, or [T] indices per row)]."""
        width = n_exp + 1
        n_layers = len(by_layer)
        block = n_draws * width
        rows = np.empty((n_layers, n_exp + 7))
        cache: dict = {}
        decs = [d for items in by_layer.values() for d, _ in items]
        per_layer = [len(items) for items in by_layer.values()]
        starts = np.concatenate([[0], np.cumsum(per_layer)[:-1]]).astype(np.int64)  # first decision of each layer
        off = np.concatenate([cls._offsets(items, width, cache) + i * block
                              for i, items in enumerate(by_layer.values())])  # [sum T over layers]
        # [sum T, k] (each [T, k]: no per-decision reshape). Host tensors only (summarise sends CUDA to _device):
        # .numpy() is no device sync, and this runs once per flush interval, never per token or step.
        ids = torch.cat([d.active_ids for d in decs]).numpy()
        counts = np.bincount((off[:, None] + ids).ravel(), minlength=n_layers * block)
        counts = counts.reshape(n_layers, n_draws, width)
        per_draw = np.ascontiguousarray(counts[:, :, :n_exp].transpose(1, 0, 2), dtype=np.int32)
        rows[:, :width] = counts.sum(1)
        # distinct experts per (layer, step): one boolean table of L x S x (E + 1), marked by every slot at once
        hit = np.zeros(n_layers * n_steps * width, dtype=bool)
        if step_by_layer is not None:
            skeys = np.concatenate([_step_keys(items, step_by_layer[layer], n_steps, width, i)
                                    for i, (layer, items) in enumerate(by_layer.items())])
            hit[(skeys[:, None] + ids).ravel()] = True
        distinct = cls._distinct(hit.reshape(n_layers, n_steps, width)[:, :, :n_exp].sum(-1), step_by_layer,
                                 by_layer, n_steps)
        tokens = np.fromiter((d.ids.shape[0] for d in decs), np.int64, len(decs))
        layer_of_row = np.repeat(np.repeat(np.arange(n_layers), per_layer), tokens)  # each token row's layer
        for j, name in ((n_exp + 1, "entropy"), (n_exp + 2, "margin")):
            values = torch.cat([getattr(d, name) for d in decs]).numpy().astype(np.float64)  # each [T]; host, as ids
            rows[:, j] = np.bincount(layer_of_row, weights=values, minlength=n_layers)
        rows[:, n_exp + 3] = np.add.reduceat(torch.stack([d.nonfinite for d in decs]).numpy(), starts)
        rows[:, n_exp + 4] = np.add.reduceat(torch.stack([d.dropped for d in decs]).numpy(), starts)
        # only while a mitigation is on; CPU tensors here (.numpy() is a view, not a device sync)
        if any(d.rerouted is not None for d in decs):
            rows[:, n_exp + 5:] = np.add.reduceat(torch.stack([_rerouted(d) for d in decs]).numpy(), starts, axis=0)
        else:
            rows[:, n_exp + 5:] = 0
        return rows, per_draw, distinct

    @staticmethod
    def _distinct(counted, step_by_layer, by_layer, n_steps: int) -> np.ndarray:
        """[L, S] int64 distinct experts (``counted``: experts marked per layer and step, the dropped bucket
        excluded), with -1 where the layer routed nothing in the step."""
        distinct = np.asarray(counted).astype(np.int64)
        routed = np.zeros((len(by_layer), n_steps), dtype=bool)
        for i, layer in enumerate(by_layer):
            routed[i, (step_by_layer or {}).get(layer, [])] = True
        distinct[~routed] = -1
        return distinct

    @classmethod
    def _device(cls, by_layer, n_exp: int, n_draws: int = 1, step_by_layer=None,
                n_steps: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Same as ``_host``, computed with batched device ops: the rows' draw and step offsets go up in one
        host->device copy, every slot of every layer is counted by one ``scatter_add_`` and marked in the
        distinct-expert table by one indexed write, and the counts, distinct experts and scalars come back in one
        device->host copy."""
        width = n_exp + 1
        block = n_draws * width
        n_layers = len(by_layer)
        ids, offsets, scalars = [], [], []
        device = None
        cache: dict = {}
        for i, items in enumerate(by_layer.values()):
            decs = [d for d, _ in items]
            device = decs[0].ids.device
            ids += [d.active_ids.reshape(d.ids.shape[0], -1) for d in decs]
            offsets.append(cls._offsets(items, width, cache) + i * block)
            scalars.append(torch.stack([torch.cat([d.entropy for d in decs]).sum(dtype=torch.float64),
                                        torch.cat([d.margin for d in decs]).sum(dtype=torch.float64),
                                        torch.stack([d.nonfinite for d in decs]).sum().double(),
                                        torch.stack([d.dropped for d in decs]).sum().double(),
                                        *(torch.stack([_rerouted(d) for d in decs]).sum(0).double()
                                          if decs[0].rerouted is not None
                                          else torch.zeros(2, dtype=torch.float64, device=device))]))
        skeys = np.concatenate([_step_keys(items, step_by_layer[layer], n_steps, width, i)
                                for i, (layer, items) in enumerate(by_layer.items())]) if step_by_layer is not None \
            else np.zeros(sum(len(o) for o in offsets), np.int64)
        both = torch.from_numpy(np.stack([np.concatenate(offsets), skeys])).to(device, non_blocking=True)
        slots = torch.cat(ids)
        flat = (both[0][:, None] + slots).reshape(-1)
        counts = torch.zeros(n_layers * block, dtype=torch.float64, device=device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        hit = torch.zeros(n_layers * n_steps * width, dtype=torch.bool, device=device)
        hit[(both[1][:, None] + slots).reshape(-1)] = True  # an indexed write: no host sync
        distinct = hit.view(n_layers, n_steps, width)[:, :, :n_exp].sum(-1, dtype=torch.float64)
        # The interval's one device->host copy.
        host = torch.cat([counts, torch.stack(scalars).reshape(-1), distinct.reshape(-1)]).cpu().numpy()
        per_draw = host[: n_layers * block].reshape(n_layers, n_draws, width)
        rows = np.empty((n_layers, n_exp + 7))
        rows[:, :width] = per_draw.sum(1)
        rows[:, width:] = host[n_layers * block: n_layers * block + 6 * n_layers].reshape(n_layers, 6)
        d = cls._distinct(host[n_layers * block + 6 * n_layers:].reshape(n_layers, n_steps), step_by_layer,
                          by_layer, n_steps)
        return rows, np.ascontiguousarray(per_draw[:, :, :n_exp].transpose(1, 0, 2), dtype=np.int32), d
