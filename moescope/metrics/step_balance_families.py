"""The step-level prediction's families (``parallel.step_balance``; issue [eplb]), written from its ``Snapshot`` by
the exporter's fast writer (``metrics.exposition.FamilyWriter``; the exporter's ``LayerFamilies`` collector yields
them).

Cardinality: per (EP size, placement, redundant) one histogram of 2 label sets (worst layer, mean over layers; a
label set per layer only where ``per_layer`` was asked for) x (buckets + 3 samples) and three gauges: at DeepSeek-V3's
shape with the default placements (6 EP sizes x 4) 24 x 2 x 22 + 72 = 1,128 series, whatever the layers. The
physical-slot counter of the placement in use is written only within the per-expert series budget (``full``).
"""

from __future__ import annotations

import math
from functools import partial

from moescope.metrics import catalogue
from moescope.metrics.exposition import Families, FamilyWriter, fmt


def _labels(e) -> tuple[str, str, str]:
    return (str(e.ep), e.placement, str(e.redundant))


def histogram(spec, rows, w: FamilyWriter, openmetrics: bool) -> str:
    """A classic histogram family; ``rows``: (label values, per-bucket counts with one above the last bucket, sum)."""
    les = [fmt(float(b)) for b in spec.buckets] + ["+Inf"]
    lines = []
    for values, counts, total in rows:
        cum = 0
        for le, c in zip(les, counts):
            cum += int(c)
            lines.append(w.prefix(spec.name + "_bucket", spec, values, f',le="{le}"') + str(cum) + "\n")
        lines.append(w.prefix(spec.name + "_count", spec, values) + str(cum) + "\n")
        lines.append(w.prefix(spec.name + "_sum", spec, values) + fmt(float(total)) + "\n")
    return w.header(spec, openmetrics) + "".join(lines) if lines else ""


def families(snap, w: FamilyWriter, full: bool) -> Families:
    """The families of ``snap`` (a ``parallel.step_balance.Snapshot``; None: none), each rendered when a scrape asks
    (``exposition.Rendered``). ``full``: the per-expert tier is on (the physical-slot counter fits the series
    budget)."""
    out = Families(w)
    if snap is None or not snap.observed:
        return out
    spec = catalogue.BY_NAME
    rows = [((*_labels(e), stat), e.hist[j], e.total[j]) for e in snap.entries for j, stat in enumerate(e.stats)
            if e.count[j] > 0]
    if rows:
        hist = spec["moescope_ep_step_max_over_mean_ratio"]
        out.rendered(hist, partial(histogram, hist, rows, w))
    for name, attr in (("moescope_ep_straggler_ratio", "straggler"), ("moescope_ep_straggler_stderr_ratio", "stderr"),
                       ("moescope_ep_average_max_over_mean_ratio", "average")):
        out.family(spec[name], [(_labels(e), getattr(e, attr)) for e in snap.entries
                                if math.isfinite(getattr(e, attr))])
    out.family(spec["moescope_ep_sampled_steps_total"], [((), snap.sampled)])
    out.family(spec["moescope_ep_steps_total"], [((), snap.steps)])
    out.family(spec["moescope_ep_eplb_schedule_steps"], [(("window",), snap.schedule.window),
                                                         (("interval",), snap.schedule.every)])
    if snap.in_use_rank_slots:
        out.family(spec["moescope_ep_rearrangements_total"], [((), snap.rearranged)])
        out.family(spec["moescope_ep_rank_slots_total"], [((str(r),), v) for r, v in enumerate(snap.in_use_rank_slots)])
    if snap.rearrangements:
        last = snap.rearrangements[-1]
        out.family(spec["moescope_ep_rearrangement_straggler_ratio"],
                   [((when,), v) for when, v in (("before", last.before), ("predicted_old", last.predicted_old),
                                                 ("predicted_new", last.predicted_new), ("after", last.after))
                    if math.isfinite(v)])
    if full and snap.in_use_physical is not None:
        out.family(spec["moescope_ep_physical_slots_total"],
                   [((str(layer), str(p)), float(v)) for layer, row in zip(snap.layers, snap.in_use_physical)
                    for p, v in enumerate(row.tolist())])
    return out


def text(snap, w: FamilyWriter, openmetrics: bool, full: bool) -> str:
    """The families of ``snap`` as exposition text (``families``, rendered now)."""
    return "".join(f.text(openmetrics) for f in families(snap, w, full))
