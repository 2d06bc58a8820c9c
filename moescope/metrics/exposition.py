"""Exposition text written directly, for the families with a ``layer`` label (the fast path).

prometheus_client formats every sample through Python-level label escaping and float formatting: ~25 us a
sample on this project's machines, 0.37 s for the 14,848 per-(layer, expert) counters of DeepSeek-V3's shape
(and ~20 ms more for its ~900 per-layer gauges), against a scrape budget of 50 ms. This writer renders each
series' name-and-labels prefix once (cached per series) and formats only the values per scrape (~0.5 us a
sample). It writes what prometheus_client writes for the same families, in the Prometheus text format 0.0.4
and in OpenMetrics 1.0 (tests/test_exposition.py parses both renderings and compares them); the few other
families (histograms with exemplars, process, build info) still go through prometheus_client.

Both kinds sit on one prometheus_client ``CollectorRegistry``: a collector whose families the fast writer renders
yields them as ``Rendered`` families (prometheus_client's ``Metric``, read by duck typing: name, documentation,
type, unit, samples) and ``exposition(registry, openmetrics)`` walks the registry in its order, writing a
``Rendered`` family's text directly and everything else through prometheus_client. Any other reader of the registry
(prometheus_client's own ``generate_latest``, ``get_sample_value``) reads a ``Rendered`` family's samples, parsed back
from the same text: slow, and the same exposition (tests/test_exposition.py compares the two).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

from moescope.metrics.catalogue import MetricSpec


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def fmt(value: float | int) -> str:
    """A sample value as Prometheus reads it (integers without a fraction; +Inf, -Inf, NaN spelled out)."""
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class FamilyWriter:
    """Renders catalogue families for one exporter (its ``model`` and ``rank`` labels are fixed)."""

    def __init__(self, model: str, rank: str) -> None:
        self.base = f'model="{escape_label(model)}",rank="{escape_label(rank)}"'
        self._prefix: dict[tuple, str] = {}
        self._rows: dict[tuple, list[str]] = {}

    def _labels(self, spec: MetricSpec, values: Sequence[str], extra: str = "") -> str:
        inner = self.base + "".join(f',{k}="{escape_label(v)}"' for k, v in zip(spec.labels, values)) + extra
        return "{" + inner + "}"

    def prefix(self, sample: str, spec: MetricSpec, values: tuple[str, ...], extra: str = "") -> str:
        key = (sample, values, extra)
        p = self._prefix.get(key)
        if p is None:
            p = self._prefix[key] = f"{sample}{self._labels(spec, values, extra)} "
        return p

    @staticmethod
    def header(spec: MetricSpec, openmetrics: bool, name: str | None = None, kind: str | None = None) -> str:
        kind = kind or spec.kind
        if not openmetrics and kind == "gaugehistogram":
            kind = "histogram"  # what prometheus_client writes in the 0.0.4 format
        name = name or (spec.family if openmetrics else spec.name)
        return f"# HELP {name} {escape_help(spec.help)}\n# TYPE {name} {kind}\n"

    def family(self, spec: MetricSpec, rows: Iterable[tuple[tuple[str, ...], float]], openmetrics: bool) -> str:
        """A counter or gauge family; ``rows``: (label values besides model and rank, in the spec's order, value);
        a row with fewer values leaves the spec's trailing labels out (a bar of the model has no layer)."""
        lines = [self.prefix(spec.name, spec, values) + fmt(v) + "\n" for values, v in rows]
        return self.header(spec, openmetrics) + "".join(lines) if lines else ""

    def experts(self, spec: MetricSpec, per_layer: Mapping[int, Any], openmetrics: bool) -> str:
        """A (layer, expert) counter of every expert of every layer (``per_layer``: layer -> [E] integer counts)."""
        return self.header(spec, openmetrics) + "".join(self.expert_rows(spec, layer, values.tolist())
                                                        for layer, values in sorted(per_layer.items()))

    def expert_rows(self, spec: MetricSpec, layer: int, values: list[int]) -> str:
        """Lines of a (layer, expert) counter for every expert of one layer, from per-expert integer counts
        (the full tier: 256 a layer at DeepSeek-V3's shape, so the row's prefixes are cached as one list)."""
        key = (spec.name, layer, len(values))
        prefixes = self._rows.get(key)
        if prefixes is None:
            prefixes = self._rows[key] = [self.prefix(spec.name, spec, (str(layer), str(e)))
                                          for e in range(len(values))]
        return "".join([p + str(v) + "\n" for p, v in zip(prefixes, values)])

    def gauge_histogram(self, spec: MetricSpec, rows: Iterable[tuple[tuple[str, ...], Sequence[float], float]],
                        openmetrics: bool) -> str:
        """A gauge histogram; ``rows``: (label values, cumulative integer counts per bucket incl. +Inf, sum)."""
        les = [fmt(float(b)) for b in spec.buckets] + ["+Inf"]
        buckets, gcount, gsum, metrics = [], [], [], []
        for values, counts, total in rows:
            b = [self.prefix(spec.name + "_bucket", spec, values, f',le="{le}"') + str(c) + "\n"
                 for le, c in zip(les, counts)]
            n = self.prefix(spec.name + "_gcount", spec, values) + str(counts[-1]) + "\n"
            t = self.prefix(spec.name + "_gsum", spec, values) + fmt(total) + "\n"
            buckets += b
            gcount.append(n)
            gsum.append(t)
            metrics += [*b, n, t]  # OpenMetrics: one label set's samples stay together
        if not buckets:
            return ""
        if openmetrics:
            return self.header(spec, True) + "".join(metrics)
        return (self.header(spec, False) + "".join(buckets)
                + self.header(spec, False, spec.name + "_gcount", "gauge") + "".join(gcount)
                + self.header(spec, False, spec.name + "_gsum", "gauge") + "".join(gsum))


class Rendered:
    """One family the fast writer renders, as prometheus_client reads a ``Metric`` (a duck: no prometheus_client import
    here, the metrics extra's). ``render(openmetrics)`` writes its text when a scrape asks, in the scrape's format;
    ``samples`` parses that text back (OpenMetrics, prometheus_client's parser) for any other reader of a registry."""

    unit = ""

    def __init__(self, spec: MetricSpec, render: Callable[[bool], str]) -> None:
        self.spec, self._render = spec, render
        self.name, self.documentation, self.type = spec.family, spec.help, spec.kind

    def text(self, openmetrics: bool) -> str:
        return self._render(openmetrics)

    @property
    def samples(self) -> list:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families  # optional: the metrics extra

        return [s for fam in text_string_to_metric_families(self.text(True) + "# EOF\n") for s in fam.samples]

    def _restricted_metric(self, names):
        """What a restricted registry (prometheus_client's ``name[]`` query) takes of this family."""
        from prometheus_client.metrics_core import Metric  # optional: the metrics extra

        samples = [s for s in self.samples if s.name in names]
        if not samples:
            return None
        m = Metric(self.name, self.documentation, self.type)
        m.samples = samples
        return m


class Families(list):
    """The ``Rendered`` families one collection yields, added from their rows (a family without rows is left out, as
    the writer leaves it out of the text)."""

    def __init__(self, writer: FamilyWriter) -> None:
        super().__init__()
        self.writer = writer

    def family(self, spec: MetricSpec, rows: Iterable[tuple[tuple[str, ...], float]]) -> None:
        """A counter or gauge family (``FamilyWriter.family``)."""
        rows = list(rows)
        if rows:
            self.append(Rendered(spec, partial(self.writer.family, spec, rows)))

    def gauge_histogram(self, spec: MetricSpec, rows: Iterable[tuple[tuple[str, ...], Sequence[float], float]]) -> None:
        """A gauge histogram (``FamilyWriter.gauge_histogram``)."""
        rows = list(rows)
        if rows:
            self.append(Rendered(spec, partial(self.writer.gauge_histogram, spec, rows)))

    def experts(self, spec: MetricSpec, per_layer: Mapping[int, Any]) -> None:
        """A (layer, expert) counter of every expert (``FamilyWriter.experts``)."""
        if per_layer:
            self.append(Rendered(spec, partial(self.writer.experts, spec, per_layer)))

    def rendered(self, spec: MetricSpec, render: Callable[[bool], str]) -> None:
        """A family written by a function of its own (``render(openmetrics)``)."""
        self.append(Rendered(spec, render))


class _Batch:
    """prometheus_client families handed to its own writer, as a collector."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def collect(self) -> list:
        return self.metrics


def exposition(registry, openmetrics: bool) -> bytes:
    """Everything registered on ``registry`` (a prometheus_client ``CollectorRegistry``), in its order: a ``Rendered``
    family's own text, and runs of other families written by prometheus_client; OpenMetrics' one ``# EOF`` at the
    end."""
    # optional: prometheus_client (the metrics extra)
    from prometheus_client import exposition as text_format
    from prometheus_client.openmetrics import exposition as om_format

    generate_latest: Callable[[Any], bytes] = om_format.generate_latest if openmetrics else text_format.generate_latest
    out: list[bytes] = []
    batch: list = []

    def flush() -> None:
        if batch:
            text = generate_latest(_Batch(list(batch)))
            out.append(text[: -len(b"# EOF\n")] if openmetrics else text)
            batch.clear()

    for metric in registry.collect():
        if isinstance(metric, Rendered):
            flush()
            out.append(metric.text(openmetrics).encode())
        else:
            batch.append(metric)
    flush()
    if openmetrics:
        out.append(b"# EOF\n")
    return b"".join(out)
