"""Reading an exposition back: {(name, frozenset(labels)): value}."""

from __future__ import annotations


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def series(parsed, name: str, **match) -> dict[frozenset, float]:
    want = set(match.items())
    return {labels: v for (n, labels), v in parsed.items() if n == name and want <= set(labels)}


def sum_by_label(parsed, name: str, *keys: str, **match) -> dict:
    """As ``by_label``, the samples summed over the labels not in ``keys`` (PromQL's ``sum by``)."""
    out: dict = {}
    for labels, v in series(parsed, name, **match).items():
        d = dict(labels)
        k = tuple(d[key] for key in keys)
        k = k[0] if len(k) == 1 else k
        out[k] = out.get(k, 0.0) + v
    return out


def by_label(parsed, name: str, *keys: str, **match) -> dict:
    """{label values tuple (or single value): sample value} for ``name``."""
    out = {}
    for labels, v in series(parsed, name, **match).items():
        d = dict(labels)
        k = tuple(d[key] for key in keys)
        out[k[0] if len(k) == 1 else k] = v
    return out
