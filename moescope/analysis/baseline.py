"""The routing baseline: a profile of the user's own healthy traffic, per MoE layer.

What a live window is judged against where a baseline is loaded (``moescope.sampling``, ``thresholds``):
- ``load`` [E]: slots per expert (the drift reference) and ``share`` [E] = load / its sum (the hot-expert and
  dead-expert reference share);
- ``structural_cv``: the load CV beyond the baseline's own sampling noise, with requests as the draws:
  ``sqrt(max(0, cv^2 - E * sum_e Var(p_e)))``, Var the cluster-robust share variance of ``sampling.Draws``
  (the imbalance bar grows from it: ``Thresholds.imbalance_bar``);
- ``design_effect``: the cluster share variance over the multinomial one (how alike a request's tokens route);
- ``share_sd`` [E]: each expert's share's standard deviation across windows of ``window_s`` seconds of the
  baseline traffic (requests binned by end time), or, where the traffic spans fewer than ``MIN_WINDOWS`` such
  windows, across ``GROUPS`` groups of consecutive requests (``window_s`` None); None with too few requests;
- ``draws``: the requests the layer's numbers come from.

File format (compact JSON), ``moescope-baseline-v2``::

    {"format": "moescope-baseline-v2", "model": NAME, "n_experts": E, "window_s": 60.0 | null,
     "window_draws": requests per window (median) | null,
     "layers": {"1": {"load": [E], "share_sd": [E] | null, "structural_cv": x, "design_effect": x | null,
                      "draws": R, "windows": W}}}

``moescope-baseline-v1`` files (``{"layers": {"1": [slots per expert]}}``, loads only) still load: no spread,
no design effect, and the structural CV from the multinomial expectation (slots as independent draws: it
keeps the clustering noise, so it overstates the structure and the bar errs high, never low).

Made by ``moescope baseline save`` (from the trace store) or ``moescope demo --save-baseline FILE``; read by
``moescope demo --baseline FILE`` / ``moescope.Config(metrics=Metrics(baseline=...))`` (the exporter's
``moescope_baseline_*`` series) and ``moescope diagnose --baseline``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moescope import sampling
from moescope.capture.observer import Observer
from moescope.runtime.calibration import held_out_pass
from moescope.stats import load_cv_rows
from moescope.analysis.files import read_format
from moescope.errors import BadInput
from moescope.traces.store import CorruptRows, iter_routed

FORMAT = "moescope-baseline-v2"
FORMAT_V1 = "moescope-baseline-v1"

# The share spread needs this many windows of the baseline traffic (each with at least sampling.MIN_DRAWS
# requests); with fewer, the traffic is cut into GROUPS groups of consecutive requests instead.
MIN_WINDOWS = 4
GROUPS = 8
_CHUNK = 256  # requests folded into the running sums at once (bounds memory at 58 x 256)
_RECENT_BINS = 64  # consecutive-request bins kept for the fallback grouping (merged pairwise when full)


@dataclass(frozen=True, eq=False)
class LayerProfile:
    """One MoE layer of a baseline (see the module docstring); arrays are float64 [E]."""

    load: np.ndarray
    share: np.ndarray
    share_sd: np.ndarray | None
    structural_cv: float
    design_effect: float | None
    draws: int
    windows: int = 0  # windows (or groups) ``share_sd`` was measured over


@dataclass(frozen=True)
class BaselineRows:
    """A baseline laid out for a window's layers (``Profile.rows``): ``has`` [L], ``share`` [L, E], ``load``
    [L, E] (NaN where ``has`` is False), ``structural_cv`` [L] (NaN where unknown)."""

    has: np.ndarray
    share: np.ndarray
    load: np.ndarray
    structural_cv: np.ndarray


@dataclass(frozen=True, eq=False)
class Profile:
    """A baseline: ``layers`` {MoE layer: LayerProfile}; ``window_s`` the window ``share_sd`` is measured over
    (None: groups of consecutive requests, or no spread); ``window_draws`` the median requests per window."""

    model: str | None
    n_experts: int
    layers: dict[int, LayerProfile]
    window_s: float | None
    window_draws: float | None = None

    def load_map(self) -> dict[int, list[float]]:
        """{layer: slots per expert}: the drift reference."""
        return {layer: lp.load.tolist() for layer, lp in sorted(self.layers.items())}

    def shares(self, layers: Iterable[int]) -> np.ndarray:
        """[L, E] reference shares for ``layers`` in that order (1/E for a layer the baseline lacks)."""
        fair = np.full(self.n_experts, 1.0 / self.n_experts)
        return np.stack([self.layers[la].share if la in self.layers else fair for la in layers]) \
            if layers else np.zeros((0, self.n_experts))

    def rows(self, layers: Iterable[int], n_experts: int) -> "BaselineRows":
        """The layers' baseline as arrays (rows in ``layers`` order): where the profile has a layer of
        ``n_experts`` experts with load, its share, load and structural CV; elsewhere the fair share, no load
        (NaN) and no CV (NaN). The exporter's window and ``diagnose`` both read a baseline through this."""
        layers = list(layers)
        has = np.zeros(len(layers), dtype=bool)
        share = np.full((len(layers), n_experts), 1.0 / n_experts)
        load = np.full((len(layers), n_experts), np.nan)
        cv = np.full(len(layers), np.nan)
        for j, layer in enumerate(layers):
            lp = self.layers.get(layer)
            if lp is None or lp.load.shape != (n_experts,) or lp.load.sum() <= 0:
                continue
            has[j], share[j], load[j] = True, lp.share, lp.load
            if lp.structural_cv is not None and math.isfinite(lp.structural_cv):
                cv[j] = lp.structural_cv
        return BaselineRows(has, share, load, cv)


# -- building -----------------------------------------------------------------------------------------------

def multinomial_structural_cv(load: np.ndarray) -> np.ndarray:
    """Row-wise ``sqrt(max(0, cv^2 - E sum_e p(1-p)/N))``: the CV beyond the noise of N independent slots."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    n = load.sum(-1)
    e = load.shape[-1]
    p = load / np.where(n > 0, n, 1.0)[:, None]
    noise2 = np.where(n > 0, e * (p * (1 - p)).sum(-1) / np.where(n > 0, n, 1.0), 0.0)
    return np.sqrt(np.maximum(0.0, load_cv_rows(load) ** 2 - noise2))


class _Spread:
    """Running sums of each expert's share over closed windows (per layer: windows counted, sum of shares,
    sum of squared shares); a window counts for a layer where it holds at least ``MIN_DRAWS`` requests."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.n = np.zeros(n_layers)
        self.s1 = np.zeros((n_layers, n_experts))
        self.s2 = np.zeros((n_layers, n_experts))
        self.draws: list[float] = []  # requests per counted window (its busiest layer)

    def fold(self, counts: np.ndarray, draws: np.ndarray) -> None:
        ok = draws >= sampling.MIN_DRAWS
        if not ok.any():
            return
        p = sampling.normalised(counts)
        self.n += ok
        self.s1 += np.where(ok[:, None], p, 0.0)
        self.s2 += np.where(ok[:, None], p * p, 0.0)
        self.draws.append(float(draws.max()))

    def sd(self) -> tuple[np.ndarray, np.ndarray]:
        """([L, E] sd across windows (ddof 1; NaN where fewer than 2), [L] windows)."""
        n = self.n[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            var = (self.s2 - self.s1 * self.s1 / n) / (n - 1)
        return np.where(n >= 2, np.sqrt(np.maximum(var, 0.0)), np.nan), self.n.copy()


class _Builder:
    """Folds requests (per-request [L, E] slot counts, oldest first) into a Profile's sums without keeping them:
    the ``sampling.Draws`` sums, windows by end time (closed once a later request started after their end),
    and bins of consecutive requests (the fallback spread)."""

    def __init__(self, n_layers: int, n_experts: int, window_s: float) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise BadInput(f"baseline window {window_s!r}: must be a positive number of seconds")
        self.shape = (n_layers, n_experts)
        self.window_s = float(window_s)
        self.draws = sampling.Draws.zeros(n_layers, n_experts)
        self.pending: list[np.ndarray] = []
        self.open: dict[int, list] = {}  # window index -> [counts [L, E], draws [L]]
        self.by_time = _Spread(n_layers, n_experts)
        self.bins: list[list] = []  # [counts, draws, requests] of consecutive requests
        self.bin_size = 1
        self.requests = 0

    def add(self, counts: np.ndarray, end: float | None, started: float | None = None) -> None:
        counts = np.asarray(counts, dtype=np.float64)
        self.requests += 1
        present = (counts.sum(1) > 0).astype(np.float64)
        self.pending.append(counts)
        if len(self.pending) >= _CHUNK:
            self._flush()
        if started is not None:
            self._close(started)
        if end is not None and math.isfinite(end):
            w = self.open.setdefault(int(math.floor(end / self.window_s)),
                                     [np.zeros(self.shape), np.zeros(self.shape[0])])
            w[0] += counts
            w[1] += present
        if not self.bins or self.bins[-1][2] >= self.bin_size:
            if len(self.bins) == _RECENT_BINS:  # all full: merge neighbours, bins twice as long
                self.bins = [[a[0] + b[0], a[1] + b[1], a[2] + b[2]] for a, b in zip(self.bins[::2], self.bins[1::2])]
                self.bin_size *= 2
            self.bins.append([np.zeros(self.shape), np.zeros(self.shape[0]), 0])
        b = self.bins[-1]
        b[0] += counts
        b[1] += present
        b[2] += 1

    def _flush(self) -> None:
        if self.pending:
            self.draws.add(sampling.Draws.of(np.stack(self.pending)))
            self.pending = []

    def _close(self, before: float | None) -> None:
        """Fold the windows that ended before ``before`` (None: all)."""
        for k in sorted(self.open):
            if before is not None and (k + 1) * self.window_s > before:
                break
            counts, draws = self.open.pop(k)
            self.by_time.fold(counts, draws)

    def _groups(self) -> _Spread:
        spread = _Spread(*self.shape)
        bins = self.bins
        g = min(GROUPS, self.requests // sampling.MIN_DRAWS)
        if g < 2:
            return spread
        per = self.requests / g  # cut the bins where the running request count crosses each group's share
        done, cut, acc = 0, 1, [np.zeros(self.shape), np.zeros(self.shape[0])]
        for b in bins:
            acc[0] += b[0]
            acc[1] += b[1]
            done += b[2]
            if done >= cut * per - 1e-9 or b is bins[-1]:
                spread.fold(*acc)
                acc = [np.zeros(self.shape), np.zeros(self.shape[0])]
                cut += 1
        return spread

    def profile(self, layers: list[int], model: str | None) -> Profile:
        self._flush()
        self._close(None)
        spread, window_s = self.by_time, self.window_s
        if len(spread.draws) < MIN_WINDOWS:
            spread, window_s = self._groups(), None
        sd, windows = spread.sd()
        d = self.draws
        load = d.counts
        e = self.shape[1]
        var = d.share_var()
        deff = d.design_effect()
        with np.errstate(invalid="ignore"):
            # the expectation of the structure (noise at z = 0: its mean, not its bound)
            cluster = sampling.excess_cv(load_cv_rows(load), np.sqrt(e * var.sum(1)))
        structural = np.where(np.isfinite(cluster), cluster, multinomial_structural_cv(load))
        share = sampling.normalised(load)
        out = {}
        for i, layer in enumerate(layers):
            out[layer] = LayerProfile(
                load=load[i].copy(), share=share[i], share_sd=sd[i] if windows[i] >= 2 else None,
                structural_cv=float(structural[i]),
                design_effect=float(deff[i]) if np.isfinite(deff[i]) else None,
                draws=int(d.draws[i]), windows=int(windows[i]) if windows[i] >= 2 else 0)
        draws_per = float(np.median(spread.draws)) if len(spread.draws) >= 2 else None
        return Profile(model=model, n_experts=e, layers=out, window_s=window_s if draws_per else None,
                       window_draws=draws_per)


def from_requests(per_request, layers: list[int], model: str | None, end_times=None,
                  window_s: float = 60.0) -> Profile:
    """A profile from per-request slot counts ``per_request`` [R, L, E] (dropped slots excluded) of the MoE
    ``layers``, oldest first; ``end_times`` [R] unix seconds bin them into windows for the share spread."""
    c = np.asarray(per_request, dtype=np.float64)
    if c.ndim != 3 or c.shape[1] != len(layers) or c.shape[0] == 0 or c.shape[2] < 1:
        raise BadInput(f"a baseline needs per-request counts [requests, {len(layers)} layers, experts]; got "
                       f"shape {list(c.shape)}")
    b = _Builder(c.shape[1], c.shape[2], window_s)
    ends = None if end_times is None else np.asarray(end_times, dtype=np.float64)
    for i in range(c.shape[0]):
        b.add(c[i], None if ends is None else float(ends[i]))
    return b.profile(list(layers), model)


def from_loads(loads: Mapping, model: str | None = None, where: str = "baseline") -> Profile:
    """A profile from totals only, ``{layer: slots per expert}`` (a v1 file): no spread, no design effect, the
    structural CV from the multinomial expectation."""
    if not isinstance(loads, Mapping) or not loads:
        raise BadInput(f"{where} has no layers")
    try:
        rows = {int(k): np.asarray([float(x) for x in v], dtype=np.float64) for k, v in loads.items()}
    except (TypeError, ValueError):
        raise BadInput(f"{where}: layers must map layer numbers to lists of loads") from None
    sizes = {len(v) for v in rows.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise BadInput(f"{where}: every layer needs the same number of experts (found {sorted(sizes)})")
    for layer, v in rows.items():
        if not np.isfinite(v).all() or (v < 0).any():
            raise BadInput(f"{where}: layer {layer}: loads must be finite and non-negative")
    layers = sorted(rows)
    load = np.stack([rows[la] for la in layers])
    structural, share = multinomial_structural_cv(load), sampling.normalised(load)
    return Profile(model=model, n_experts=load.shape[1], window_s=None, layers={
        la: LayerProfile(load=load[i], share=share[i], share_sd=None, structural_cv=float(structural[i]),
                         design_effect=None, draws=0) for i, la in enumerate(layers)})


def request_counts(r) -> np.ndarray:
    """[L, E] slots per (layer, expert) of one stored request (``store.Routed``), dropped slots excluded."""
    e, n_layers = r.n_experts, len(r.layers)
    codes = r.ids.astype(np.int64) + (np.arange(n_layers) * (e + 1))[None, :, None]
    return np.bincount(codes.ravel(), minlength=n_layers * (e + 1)).reshape(n_layers, e + 1)[:, :e]


def _end_times(conn, since: float | None) -> dict[str, float]:
    """request id -> end time (arrival + total seconds) of the stored requests; a row whose timing is not a
    number is left out (its request then counts in no window)."""
    sql, args = "SELECT request_id, started + total_s FROM requests WHERE ids IS NOT NULL", []
    if since is not None:
        sql += " AND started >= ?"
        args.append(since)
    out = {}
    for rid, end in conn.execute(sql, args):
        if isinstance(rid, str) and isinstance(end, (int, float)) and math.isfinite(end):
            out[rid] = float(end)
    return out


def from_store(conn, since: float | None = None, corrupt=None, window_s: float = 60.0,
               only: set[str] | None = None, model: str | None = None) -> Profile:
    """The profile of the stored requests' routed tokens (dropped slots excluded; ``only``: just these request
    ids; ``model``: just this model's); corrupt rows are skipped into ``corrupt`` (``store.CorruptRows``). The
    model name is the one most of the requests carry."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    ends = _end_times(conn, since)
    builder, layers, models = None, None, Counter()
    for r in iter_routed(conn, since=since, corrupt=corrupt, model=model):
        if only is not None and r.request_id not in only:
            continue
        if builder is None:
            layers = list(r.layers)
            builder = _Builder(len(layers), r.n_experts, window_s)
        models[r.model] += 1
        builder.add(request_counts(r), ends.get(r.request_id), started=float(r.started))
    profile = None if builder is None else builder.profile(layers, models.most_common(1)[0][0])
    if profile is None or not any(lp.load.any() for lp in profile.layers.values()):
        raise corrupt.nothing_left("the trace store holds no routed tokens to make a baseline from")
    return profile


def calibration_profile(model, seed: int, n_requests: int = 64) -> Profile:
    """The profile of ``n_requests`` held-out requests of the normal mix (``runtime.calibration``'s traffic),
    counted per request: a known-good reference measured before serving. The model's observer is restored
    afterwards, so the pass reaches no metric, trace or log of the served run."""
    e = model.cfg.n_experts

    class RequestCounts(Observer):
        """Slots per (request, layer, expert) of every forward, split by the step's segments."""

        def __init__(self) -> None:
            self.pending: dict[int, np.ndarray] = {}
            self.counts: dict[str, dict[int, np.ndarray]] = {}

        def on_routing(self, layer, decision) -> None:  # calibration, not serving: a host copy per layer is fine
            ids = decision.active_ids
            self.pending[layer] = ids.detach().reshape(ids.shape[0], -1).cpu().numpy()

        def on_step(self, step) -> None:
            offset = 0
            for rid, _, n in step.segments:
                per = self.counts.setdefault(rid, {})
                for layer, ids in self.pending.items():
                    per[layer] = per.get(layer, 0) + np.bincount(ids[offset:offset + n].ravel(),
                                                                 minlength=e + 1)[:e]
                offset += n
            self.pending = {}

    counts = RequestCounts()
    held_out_pass(model, seed, n_requests, counts)
    layers = sorted({la for per in counts.counts.values() for la in per})
    if not layers:
        raise BadInput("the calibration pass routed no tokens")
    zero = np.zeros(e)
    per_request = np.stack([np.stack([per.get(la, zero) for la in layers]) for per in counts.counts.values()])
    return from_requests(per_request, layers, model.cfg.name)


# -- files --------------------------------------------------------------------------------------------------

def _num(x, what: str, where: str, *, allow_none: bool = False) -> float | None:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise BadInput(f"{where}: {what} must be a non-negative number")
    return float(x)


def _vector(x, e: int | None, what: str, where: str) -> np.ndarray:
    if not isinstance(x, list) or (e is not None and len(x) != e) or not x:
        raise BadInput(f"{where}: {what} must be a list of {e if e is not None else 'expert'} numbers")
    return np.asarray([_num(v, what, where) for v in x], dtype=np.float64)


def _read(path: Path) -> dict:
    data = read_format(path, "baseline", (FORMAT, FORMAT_V1))
    if not isinstance(data.get("layers"), dict) or not data["layers"]:
        raise BadInput(f"baseline {path} has no layers")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"baseline {path}: model must be a name")
    return data


def load(path: str | Path) -> Profile:
    """The profile in ``path`` (v2, or v1: loads only); a one-line ``BadInput`` for a missing or bad file."""
    path = Path(path)
    data = _read(path)
    where = f"baseline {path}"
    if data["format"] == FORMAT_V1:
        return from_loads(data["layers"], data.get("model"), where)
    e = data.get("n_experts")
    if isinstance(e, bool) or not isinstance(e, int) or e < 1:
        raise BadInput(f"{where}: n_experts must be a positive integer")
    window_s = _num(data.get("window_s"), "window_s", where, allow_none=True)
    window_draws = _num(data.get("window_draws"), "window_draws", where, allow_none=True)
    layers = {}
    for key, v in data["layers"].items():
        lw = f"{where}: layer {key}"
        try:
            layer = int(key)
        except ValueError:
            raise BadInput(f"{where}: layer {key!r} is not a layer number") from None
        if not isinstance(v, dict):
            raise BadInput(f"{lw}: not an object")
        ld = _vector(v.get("load"), e, "load", lw)
        sd = None if v.get("share_sd") is None else _vector(v["share_sd"], e, "share_sd", lw)
        draws = v.get("draws", 0)
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 0:
            raise BadInput(f"{lw}: draws must be a non-negative integer")
        windows = v.get("windows", 0)
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 0:
            raise BadInput(f"{lw}: windows must be a non-negative integer")
        layers[layer] = LayerProfile(
            load=ld, share=sampling.normalised(ld), share_sd=sd,
            structural_cv=_num(v.get("structural_cv"), "structural_cv", lw),
            design_effect=_num(v.get("design_effect"), "design_effect", lw, allow_none=True), draws=draws,
            windows=windows)
    return Profile(model=data.get("model"), n_experts=e, layers=dict(sorted(layers.items())), window_s=window_s,
                   window_draws=window_draws)


def _g(x: float) -> float | int:
    """A number as written: integers exactly, others to 6 significant digits (a compact file)."""
    x = float(x)
    return int(x) if x.is_integer() and abs(x) < 2**53 else float(f"{x:.6g}")


def save(path: str | Path, profile: Profile) -> Path:
    """Write ``profile`` in the v2 format (compact JSON)."""
    path = Path(path)
    layers = {}
    for layer, lp in sorted(profile.layers.items()):
        layers[str(layer)] = {
            "load": [_g(x) for x in lp.load], "share_sd": None if lp.share_sd is None else
            [_g(x) for x in lp.share_sd], "structural_cv": _g(lp.structural_cv),
            "design_effect": None if lp.design_effect is None else _g(lp.design_effect), "draws": int(lp.draws),
            "windows": int(lp.windows)}
    doc = {"format": FORMAT, "model": profile.model, "n_experts": int(profile.n_experts),
           "window_s": profile.window_s, "window_draws": profile.window_draws, "layers": layers}
    try:
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    except OSError as exc:
        raise BadInput(f"cannot write baseline {path}: {exc.strerror or exc}") from None
    return path


def coerce(x) -> Profile | None:
    """A Profile from a baseline file path, a Profile, or ``{layer: slots per expert}``; None for None."""
    if x is None or isinstance(x, Profile):
        return x
    if isinstance(x, (str, Path)):
        return load(x)
    if isinstance(x, Mapping):
        return from_loads(x)
    raise BadInput(f"a baseline is a file, a Profile or {{layer: load}}; got {type(x).__name__}")
