"""vLLM's own EPLB, read: which physical expert slots hold which logical experts now (issue [eplb]).

Where vLLM runs EPLB (``--enable-eplb``), the routers' ids moescope captures are logical (``set_capture_fn`` sees
``topk_ids`` before ``eplb_map_to_physical_and_record`` maps them), so the load per rank and per physical expert
needs vLLM's placement: its ``EplbState`` (the model runner's ``eplb_state``) keeps, per model,
``physical_to_logical_map`` [MoE layers, physical experts] (physical slot p on EP rank p // (P / ranks)) and
``logical_replica_count`` [MoE layers, logical experts]. This module reads them, and nothing else of vLLM; every
name it reads is pinned in ``moescope.vllm.contract`` (checked against 0.31, 0.32 and 0.33's source).

When to read. The maps change only at a rearrangement (every ``step_interval`` steps); reading them is a
device-to-host copy (a GPU tensor), so the reader reads them once at start and then only when vLLM's host state says
a rearrangement happened: ``EplbState.expert_rearrangement_step`` (a host int, set to 0 right before each
``rearrange``) went down, or a model state's ``rebalanced`` flag (async EPLB: set when the new maps are planned,
cleared when every layer's maps are committed) changed. The copy is made on the caller's thread (the metrics'
evaluator, never the engine's), and repeated on the next ``SETTLE_READS`` reads after a change (a synchronous
rearrangement commits its maps after the counter resets; an asynchronous one layer by layer), so a read that came
between the reset and the commit is corrected.

What it gives: ``layout()`` (``parallel.step_balance.Layout``: the step-level prediction's placement in use, whose
changes are the rearrangements with their balance before and after) and ``placement()`` (the runtime's
``parallel.placement.Placement`` of the same map: the exporter's modelled per-rank load over the window). The reader
is a source (``moescope.capture.sources``): registered on the metrics' sources (``sources.register(reader)``), its
``read()`` gives the placement once per evaluation, which the step-level prediction reads too (through ``InUse``).
"""

from __future__ import annotations

import logging

import numpy as np

from moescope.capture.sources import Reading
from moescope.parallel.placement import Placement
from moescope.parallel.step_balance import Layout

log = logging.getLogger("moescope.vllm")

SETTLE_READS = 3  # reads that copy the maps again after a change was seen (the commit may come after the signal)


def eplb_state_of(runner):
    """The model runner's ``EplbState`` or None (EPLB off; Model Runner V2 before 0.32, which has no EPLB)."""
    return getattr(runner, "eplb_state", None)


def main_model_state(state):
    """The first model's ``EplbModelState`` (the served model; a speculative drafter, where there is one, is added
    after it), or None before ``add_model``."""
    states = getattr(state, "model_states", None) or {}
    return next(iter(states.values()), None)


def _host(t) -> np.ndarray:
    """A tensor's values in host memory (the device-to-host copy of a GPU tensor: once per change)."""
    return np.asarray(t.detach().cpu().numpy() if hasattr(t, "detach") else t)


class VllmEplbReader:
    """Reads vLLM's EPLB placement of the model served by ``runner`` (``source``: () -> the model runner, or None
    while it is not built). ``moe_layers``: the MoE layers moescope routes for, in vLLM's order (its
    ``MixtureOfExperts.moe_layers``: the map's rows)."""

    def __init__(self, source, moe_layers, n_experts: int) -> None:
        self.source, self.moe_layers, self.n_experts = source, tuple(moe_layers), n_experts
        self._signature: tuple | None = None  # vLLM's host signals of a rearrangement, as last read
        self._settle = 0
        self._layout: Layout | None = None
        self._placement: Placement | None = None
        self.reads = 0  # device-to-host copies of the maps made
        self.changes = 0  # rearrangements seen (host signals)
        self.errors = 0

    def _signal(self, state, ms) -> tuple:
        return (int(getattr(state, "expert_rearrangement_step", 0)),
                tuple(bool(getattr(m, "rebalanced", False)) for m in state.model_states.values()), id(ms))

    def layout(self) -> Layout | None:
        """The placement in use (read again only after vLLM's host state changed), or None without EPLB."""
        try:
            self._refresh()
        except Exception:  # never vLLM's failure: counted, logged once, the last placement kept
            self.errors += 1
            if self.errors == 1:
                log.exception("moescope: reading vLLM's EPLB maps failed (counted; further errors at debug)")
            else:
                log.debug("moescope: reading vLLM's EPLB maps failed", exc_info=True)
        return self._layout

    def placement(self) -> Placement | None:
        """The same placement as a ``parallel.placement.Placement`` (per MoE layer, each rank's logical experts)."""
        self.layout()
        return self._placement

    def read(self) -> Reading:
        """The placement in use and the failed reads (``vllm_eplb``), as a ``capture.sources.Source``."""
        placement = self.placement()
        return Reading(placement=placement, errors={"vllm_eplb": self.errors} if self.errors else {})

    def _refresh(self) -> None:
        runner = self.source()
        state = eplb_state_of(runner) if runner is not None else None
        ms = main_model_state(state) if state is not None else None
        if ms is None:
            return
        sig = self._signal(state, ms)
        old = self._signature
        if old is not None and sig != old:
            step_down = sig[0] < old[0]
            if step_down or sig[1] != old[1] or sig[2] != old[2]:
                self.changes += step_down
                self._settle = SETTLE_READS
        self._signature = sig
        if self._layout is not None and self._settle <= 0:
            return
        self._settle -= 1
        self._read(ms)

    def _read(self, ms) -> None:
        phy = _host(ms.physical_to_logical_map).astype(np.int64)  # [L, P]
        self.reads += 1
        if len(phy) != len(self.moe_layers):
            raise ValueError(f"vLLM's EPLB map has {len(phy)} MoE layers, moescope routes {len(self.moe_layers)}")
        local = int(getattr(ms.model, "num_local_physical_experts", 0)) or phy.shape[1]
        ranks = max(1, phy.shape[1] // local)
        if self._layout is not None and np.array_equal(self._layout.phy2log, phy):
            return
        self._layout = Layout("in_use", ranks, max(0, phy.shape[1] - self.n_experts), phy)
        per = phy.shape[1] // ranks
        layers = {layer: tuple(tuple(sorted({int(e) for e in row[r * per:(r + 1) * per] if e >= 0}))
                               for r in range(ranks)) for layer, row in zip(self.moe_layers, phy)}
        self._placement = Placement(ranks, self.n_experts, layers, replicated=phy.shape[1] > self.n_experts)


def replica_counts(ms) -> np.ndarray:
    """[L, E] vLLM's ``logical_replica_count`` (a check of the map read: it counts each logical expert's slots)."""
    return _host(ms.logical_replica_count).astype(np.int64)
