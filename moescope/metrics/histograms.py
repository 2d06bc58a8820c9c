"""Classic histograms counted in batches, once per evaluation, never per observation on the engine's thread.

prometheus_client's ``Histogram.observe`` is a Python call with a lock, a bucket search and, with an exemplar, a
validation: ~3 us per observation, and the engine made one per step and per output token (a request of 96 tokens:
96 calls on the engine's thread). Here the engine's thread only hands the step or request record over; the evaluator
counts a batch of values at once (``np.searchsorted`` then ``np.bincount``) and keeps, per bucket, the latest
observation's request id as its exemplar (what prometheus_client keeps too: each bucket's latest), replaced at most
once per evaluation. The exposition is prometheus_client's own ``HistogramMetricFamily``: its classic ``_bucket``
(cumulative), ``_count`` and ``_sum`` samples, and exemplars in OpenMetrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moescope.metrics import catalogue


@dataclass(frozen=True)
class HistogramData:
    """One histogram child as of an evaluation: per-bucket counts (not cumulative; the last is +Inf), the sum, and
    each bucket's exemplar (request id, value, unix time) or None. Read-only."""

    counts: np.ndarray  # [B + 1] int64
    total: float
    exemplars: tuple

    @property
    def count(self) -> int:
        return int(self.counts.sum())


class Histogram:
    """One child's running counts (the evaluator's thread only)."""

    __slots__ = ("bounds", "counts", "total", "exemplars")

    def __init__(self, bounds: np.ndarray) -> None:
        self.bounds = bounds
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.total = 0.0
        self.exemplars: list = [None] * (len(bounds) + 1)

    def add(self, values: np.ndarray, request_ids=None, now: float | None = None) -> None:
        """Count ``values`` (any shape); with ``request_ids`` (one per value, None where unknown), each bucket
        reached keeps its last observation's id as exemplar."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if not len(values):
            return
        # le is inclusive: a value equal to a bound falls in that bound's bucket (searchsorted left)
        b = np.searchsorted(self.bounds, values, side="left")
        self.counts += np.bincount(b, minlength=len(self.counts))
        self.total += float(values.sum())
        if request_ids is None:
            return
        now = time.time() if now is None else now
        ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
        # the last index of each bucket reached, then only those with an id
        rev = b[::-1]
        buckets, first_rev = np.unique(rev, return_index=True)
        for bucket, j in zip(buckets.tolist(), (len(b) - 1 - first_rev).tolist()):
            rid = ids[j]
            if rid is not None:
                self.exemplars[bucket] = (str(rid), float(values[j]), now)

    def data(self) -> HistogramData:
        return HistogramData(self.counts.copy(), self.total, tuple(self.exemplars))


class Histograms:
    """Every catalogue histogram's children, keyed by (name, label values besides model and rank)."""

    def __init__(self) -> None:
        self.bounds = {m.name: np.asarray(m.buckets, dtype=np.float64) for m in catalogue.CATALOGUE
                       if m.kind == "histogram"}
        self.children: dict[tuple[str, tuple[str, ...]], Histogram] = {}

    def child(self, name: str, labels: tuple[str, ...] = ()) -> Histogram:
        key = (name, labels)
        h = self.children.get(key)
        if h is None:
            h = self.children[key] = Histogram(self.bounds[name])
        return h

    def add(self, name: str, labels: tuple[str, ...], values, request_ids=None, now: float | None = None) -> None:
        self.child(name, labels).add(values, request_ids, now)

    def data(self) -> dict[tuple[str, tuple[str, ...]], HistogramData]:
        return {key: h.data() for key, h in self.children.items()}


def families(data: dict[tuple[str, tuple[str, ...]], HistogramData], base: tuple[str, ...]) -> list:
    """prometheus_client ``HistogramMetricFamily``s of the children observed at least once (cumulative buckets,
    exemplars where a bucket has one)."""
    # optional: prometheus_client (the metrics extra)
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.samples import Exemplar
    from prometheus_client.utils import floatToGoString

    by_name: dict[str, list] = {}
    for (name, labels), d in sorted(data.items()):
        if d.count:
            by_name.setdefault(name, []).append((labels, d))
    out = []
    for name, children in by_name.items():
        spec = catalogue.BY_NAME[name]
        fam = HistogramMetricFamily(spec.family, spec.help, labels=list(spec.all_labels))
        les = [floatToGoString(b) for b in spec.buckets] + ["+Inf"]
        for labels, d in children:
            cum = np.cumsum(d.counts).tolist()
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            for le, n, ex in zip(les, cum, d.exemplars):
                if ex is None:
                    buckets.append((le, float(n)))
                else:
                    buckets.append((le, float(n), Exemplar({"request_id": ex[0]}, ex[1], ex[2])))
            fam.add_metric([*base, *labels], buckets, d.total)
        out.append(fam)
    return out


__all__ = ["Histogram", "HistogramData", "Histograms", "families"]
