"""Routing baselines: the expert load distribution per layer that drift is measured against.

File format (JSON): ``{"format": "moescope-baseline-v1", "model": NAME, "layers": {"1": [slots per expert]}}``.
Made by ``moescope demo --save-baseline FILE`` (the run's load) or ``moescope baseline save`` (from the trace
store); used by ``moescope demo --baseline FILE`` (exported as ``moescope_routing_drift_jsd_bits``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moescope.analysis.files import read_format
from moescope.errors import BadInput

FORMAT = "moescope-baseline-v1"


def save(path: str | Path, load: dict[int, list[float]], model: str | None) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"format": FORMAT, "model": model,
                                "layers": {str(k): [float(x) for x in v] for k, v in sorted(load.items())}}) + "\n")
    return path


def load(path: str | Path) -> dict[int, list[float]]:
    data = read_format(path, "baseline", FORMAT)
    if not isinstance(data.get("layers"), dict):
        raise BadInput(f"baseline {path} has no layers")
    try:
        return {int(k): [float(x) for x in v] for k, v in data["layers"].items()}
    except (TypeError, ValueError):
        raise BadInput(f"baseline {path}: layers must map layer numbers to lists of loads") from None


def from_store(conn, since: float | None = None, corrupt=None) -> tuple[dict[int, list[float]], str | None]:
    """Load per layer summed over the stored requests' routed tokens (dropped slots excluded); corrupt rows
    are skipped into ``corrupt`` (``store.CorruptRows``)."""
    from moescope.traces.store import CorruptRows, iter_routed

    corrupt = CorruptRows() if corrupt is None else corrupt
    totals: dict[int, np.ndarray] = {}
    model = None
    for r in iter_routed(conn, since=since, corrupt=corrupt):
        model = r.model
        for j, layer in enumerate(r.layers):
            counts = np.bincount(r.ids[:, j].ravel(), minlength=r.n_experts + 1)[: r.n_experts]
            totals[layer] = totals.get(layer, 0) + counts
    if not totals:
        raise corrupt.nothing_left("the trace store holds no routed tokens to make a baseline from")
    return {layer: v.tolist() for layer, v in sorted(totals.items())}, model
