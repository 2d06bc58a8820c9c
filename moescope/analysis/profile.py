"""Expert load profiles: what `report`, `plan-placement` and `cache-sim` read, from the trace store or from
real engines' dumps.

A ``LoadProfile`` holds, per MoE layer, slots per expert for each pass (a forward, a recorder pass or a
training iteration) and, when the source has per-token routing (the trace store), expert co-activation.

Imports:
- **SGLang** expert-distribution recorder dumps: a ``.pt`` file holding ``logical_count`` [passes, layers,
  experts] (or [layers, experts] in ``stat`` mode), loaded with ``torch.load(weights_only=True)``. Layers
  whose counts are all zero (dense layers) are left out; layer numbers are the dump's layer indices.
- **Megatron**-style tokens-per-expert JSONL: one JSON object per line with ``layer`` and
  ``tokens_per_expert`` (a list), and optionally ``iteration`` (or ``step``); each distinct iteration is a pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moescope.errors import BadInput
from moescope.traces import store
from moescope.traces.store import CorruptRows, iter_routed


@dataclass
class LoadProfile:
    source: str
    n_experts: int
    passes: dict[int, np.ndarray]  # layer -> [P, E] slots per expert per pass
    coactivation: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E, E] tokens choosing both
    model: str | None = None
    steps: list = field(default_factory=list)  # the trace store's steps (their JSON: phase, seconds), in pass order


    @property
    def layers(self) -> list[int]:
        return sorted(self.passes)

    def load(self) -> dict[int, np.ndarray]:
        """layer -> [E] total slots."""
        return {layer: p.sum(0) for layer, p in sorted(self.passes.items())}

    def lookups(self) -> dict[int, list[int]]:
        """cache-sim input: per layer, the experts each pass used, ascending (the runtime's lookup order)."""
        return {layer: [int(e) for row in p for e in np.nonzero(row)[0]] for layer, p in self.passes.items()}


def from_store(conn, *, since: float | None = None, limit: int = 100000, corrupt=None,
               model: str | None = None) -> LoadProfile:
    """Passes are the engine's steps (run, index) in order; co-activation counts token-level expert pairs.
    Corrupt rows are skipped into ``corrupt`` (``store.CorruptRows``). ``model``: only this model's requests
    (None: the shape most requests have)."""
    corrupt = CorruptRows() if corrupt is None else corrupt

    step_rows: dict[tuple, dict[int, np.ndarray]] = {}
    step_json: dict[tuple, dict] = {}
    co: dict[int, np.ndarray] = {}
    n_exp, name = None, None
    for r in iter_routed(conn, since=since, limit=limit, corrupt=corrupt, model=model):
        layers, steps, e, k, name = r.layers, r.steps, r.n_experts, r.top_k, r.model
        n_exp = e
        ids = r.ids.astype(np.int64)
        step_of = r.step_of
        for s in np.unique(step_of):
            st = steps[int(s)] if steps else {}
            key = (st.get("run", ""), st.get("index", int(s)))
            step_json[key] = st
            rows = ids[step_of == s]
            per_layer = step_rows.setdefault(key, {})
            for j, layer in enumerate(layers):
                c = np.bincount(rows[:, j].ravel(), minlength=e + 1)[:e]
                per_layer[layer] = per_layer.get(layer, 0) + c
        for j, layer in enumerate(layers):
            m = co.setdefault(layer, np.zeros((e, e), dtype=np.int64))
            sel = ids[:, j]
            for a in range(k):
                for b in range(a + 1, k):
                    ok = (sel[:, a] < e) & (sel[:, b] < e)
                    np.add.at(m, (sel[ok, a], sel[ok, b]), 1)
                    np.add.at(m, (sel[ok, b], sel[ok, a]), 1)
    if not step_rows:
        raise corrupt.nothing_left("the trace store holds no routed requests (run `moescope demo` first)")
    layers = sorted({layer for v in step_rows.values() for layer in v})
    passes = {layer: np.stack([step_rows[key].get(layer, np.zeros(n_exp, np.int64)) for key in sorted(step_rows)])
              for layer in layers}
    return LoadProfile("trace store", n_exp, passes, co, name, [step_json[key] for key in sorted(step_rows)])


def from_sglang(path: str | Path) -> LoadProfile:
    import torch  # start-up: torch, only when from_sglang() runs

    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise BadInput(f"SGLang dump {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: one clear line
        raise BadInput(f"SGLang dump {path} is not readable with torch.load(weights_only=True): {exc}") from None
    counts = data.get("logical_count") if isinstance(data, dict) else data
    if not isinstance(counts, torch.Tensor) or counts.dim() not in (2, 3):
        raise BadInput(f"SGLang dump {path} has no logical_count tensor [passes, layers, experts]")
    c = counts.detach().to(torch.int64).numpy()
    if c.ndim == 2:
        c = c[None]
    if (c < 0).any():
        raise BadInput(f"SGLang dump {path}: negative expert counts")
    passes = {layer: c[:, layer, :] for layer in range(c.shape[1]) if c[:, layer, :].any()}
    if not passes:
        raise BadInput(f"SGLang dump {path}: every count is zero")
    return LoadProfile(f"sglang:{path.name}", c.shape[2], passes)


def from_megatron(path: str | Path) -> LoadProfile:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise BadInput(f"tokens-per-expert file {path} does not exist") from None
    rows: dict[tuple[int, int], np.ndarray] = {}
    order: list[int] = []
    n_exp = None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            layer = int(obj["layer"])
            tpe = np.asarray(obj["tokens_per_expert"], dtype=np.int64)
            it = int(obj.get("iteration", obj.get("step", 0)))
        except (ValueError, KeyError, TypeError):
            raise BadInput(f"{path}:{no}: expected a JSON object with layer and tokens_per_expert") from None
        if tpe.ndim != 1 or (tpe < 0).any() or (n_exp is not None and len(tpe) != n_exp):
            raise BadInput(f"{path}:{no}: tokens_per_expert must be one list of non-negative counts per line, "
                           f"the same length on every line")
        n_exp = len(tpe)
        if it not in order:
            order.append(it)
        rows[(it, layer)] = rows.get((it, layer), 0) + tpe
    if not rows:
        raise BadInput(f"tokens-per-expert file {path} is empty")
    layers = sorted({layer for _, layer in rows})
    passes = {layer: np.stack([rows.get((it, layer), np.zeros(n_exp, np.int64)) for it in order])
              for layer in layers}
    return LoadProfile(f"megatron:{path.name}", n_exp, passes)


def load(traces_path: str | None = None, import_path: str | None = None, *, since: float | None = None,
         corrupt=None, model: str | None = None) -> LoadProfile:
    """From ``--import FILE`` (``.pt``: SGLang; ``.jsonl``/``.json``: Megatron-style) or the trace store
    (corrupt rows skipped into ``corrupt``; ``model``: only this model's requests)."""
    if import_path:
        suffix = Path(import_path).suffix.lower()
        if suffix == ".pt":
            return from_sglang(import_path)
        if suffix in (".jsonl", ".json"):
            return from_megatron(import_path)
        raise BadInput(f"--import {import_path}: expected an SGLang .pt dump or a Megatron-style .jsonl file")

    conn = store.open_store(traces_path)
    try:
        return from_store(conn, since=since, corrupt=corrupt, model=model)
    finally:
        conn.close()
