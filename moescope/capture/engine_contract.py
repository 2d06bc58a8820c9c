"""The engine contract: what an inference engine hands moescope, and all that ``moescope.instrument`` asks of it.

An engine is anything that runs a Mixture-of-Experts model: the reference runtime (``moescope.runtime``), a
HuggingFace transformers model (``moescope.hf``), a vLLM worker (``moescope.vllm``). Each is wrapped by one adapter
that implements ``EngineContract``; ``moescope.api`` picks the adapter once and then talks to the contract only. A new
engine (SGLang, a second vLLM runner) is one module beside ``hf/`` and ``vllm/`` with a class that subclasses
``EngineContract`` (for the defaults) or matches it structurally.

This module imports no engine and no sink (the import-linter contract "the observer seam needs no engine").
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from moescope import thresholds

if TYPE_CHECKING:  # typing only: no engine, no sink, no settings at import time
    from moescope.capture.observer import Observer
    from moescope.capture.sources import Sources
    from moescope.config import Config

# The parts of a ``moescope.Config`` that change what the model computes or add runtime machinery. An engine names
# the ones it takes in ``EngineContract.features``; a config asking for one the engine lacks is refused (``BadInput``).
FEATURES = frozenset({"scenarios", "mitigations", "cache", "canary"})


@dataclass(frozen=True)
class ModelInfo:
    """The model's shape, as the statistics need it (``EngineContract.model_info``)."""

    name: str
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    dense_params: int  # everything that every token touches: attention, embeddings, norms, routers, dense FFNs
    expert_params: int  # one expert
    device: str = "cpu"
    # What a step reads and computes (moescope.efficiency; 0: unknown, the byte and FLOP counters stay absent)
    dtype_bytes: int = 0  # bytes per parameter at the served dtype
    kv_bytes_per_token: int = 0  # K and V of every layer for one position
    attn_flops_per_context: int = 0  # attention FLOPs per (row, position it attends to)

    @property
    def total_params(self) -> int:
        return self.dense_params + len(self.moe_layers) * self.n_experts * self.expert_params

    @property
    def expected_activation(self) -> float:
        """The config's activation ratio: every MoE layer computes its top-k."""
        return thresholds.expected_activation(self.dense_params, self.expert_params, len(self.moe_layers),
                                              self.top_k, self.total_params)


@dataclass
class Parts:
    """What ``EngineContract.setup`` built for a config: the expert cache and the canary (or None), and one-line notes
    for the user (e.g. a router path that cannot run)."""

    cache: Any = None
    canary: Any = None
    notices: list[str] = field(default_factory=list)


@runtime_checkable
class EngineContract(Protocol):
    """The contract between an inference engine and moescope.

    What the engine hands moescope:

    - **Its shape**: ``model_info(name)`` returns a ``ModelInfo`` (experts, top-k, MoE layer indices, parameter
      counts, device, dtype bytes; 0 where unknown: the counters that need it stay absent). ``name`` is the user's
      model name, if any; without it the engine names the model itself.
    - **Reports through the observer seam** (``moescope.capture.observer.Observer``), between ``attach(observer)``
      and ``detach()``; nothing reaches the observer after ``detach`` returns (what was queued before it may be
      delivered first). Per forward:

      - ``on_routing(layer, decision)`` once per MoE layer: a ``RoutingDecision`` (``capture.decision``) of device
        tensors, never copied to the host in the hook. What the engine does not know (router scores, gate
        weights) is NaN, never made up.
      - ``on_step(step)`` once the forward ended: a ``capture.records.StepRecord`` (the one step record of every
        engine). ``n_tokens`` is the rows the forward routed (padding excluded). ``segments`` are the requests
        that own those rows, in row order: (request id, first position, n rows), the n summing to ``n_tokens``;
        an engine without requests (a HF model that its caller drives forward by forward) reports ``()`` and each
        forward is one sampling draw. ``kv_tokens``: positions held in KV caches after the step, 0 where unknown.
      - ``on_request(record)`` when a request the steps named finished: a ``capture.records.RequestRecord`` under
        the same request id (it closes the request's sampling draw and trace row). An engine that reports
        segments must report their requests' ends.
      - optionally ``on_layer_time``, ``on_stats``, ``on_idle`` (see ``Observer``). The reference runtime's own
        events (expert cache, canary, expert-parallel exchanges) are ``RuntimeObserver``'s, outside this contract.

      Hooks run on the engine's thread (or a thread of the adapter's own) and must not block it; the observer
      never raises into the engine (``FanOut`` isolates it).
    - **Whether it says when it is idle**: ``flushes_when_idle`` is True where the engine calls ``on_idle`` when it
      runs out of work (the reference runtime's ``Engine``); else the metrics flush pending routing on each read.
    - **What else it takes**: ``features``, a subset of ``FEATURES`` (``scenarios``: fault scenarios,
      ``mitigations``: router mitigations, ``cache``: the expert cache, ``canary``: the routing canary), applied by
      ``setup(config, stack)`` after ``attach``; undo registered on ``stack`` (closed in reverse with the
      instrumentation). A config asking for a feature the engine lacks is refused before anything is attached.
      ``setup`` may also apply settings that only this engine understands (the reference runtime's router path),
      which other engines ignore.
    - **What it counts of itself**: ``register_sources(sources)`` registers the engine's own sources
      (``moescope.capture.sources.Source``: one ``read()`` returning a ``Reading``) on the metrics' registry: the
      expert-parallel placement its MoE layers dispatch by and its expert cache's capacity (the reference runtime),
      the events its own queue dropped (the vLLM adapter). They are read once per evaluation, on the evaluator's
      thread, never on the engine's and never at scrape time: a ``read()`` is cheap and takes no lock the engine
      holds. An engine with nothing of its own to report registers nothing.

    - **The capture switch** (``moescope.capture.switch``) detaches and attaches the engine again; an engine whose
      hooks cannot be removed while it runs (vLLM's compiled forward) may define ``pause()`` and
      ``resume(observer)`` instead, which the switch then calls (not part of the Protocol: optional).

    ``model_info``, ``attach`` and ``detach`` are what every engine must write; subclassing ``EngineContract`` gives the
    rest (no features, no idle flush, no sources). An object that has some of these members but not all is refused
    with the missing ones named (``missing_members``; ``moescope.api.as_engine``).
    """

    features: frozenset[str] = frozenset()
    flushes_when_idle: bool = False

    @abstractmethod
    def model_info(self, name: str | None = None) -> ModelInfo:
        """The model's shape; ``name`` (the user's) over the engine's own name for it."""

    @abstractmethod
    def attach(self, observer: "Observer") -> None:
        """Start reporting every forward, step and finished request to ``observer``."""

    @abstractmethod
    def detach(self) -> None:
        """Stop reporting; the engine runs on as it was before ``attach``."""

    def setup(self, config: "Config", stack: ExitStack) -> Parts:
        """Apply the config's parts named in ``features``; their undo goes on ``stack``."""
        return Parts()

    def register_sources(self, sources: "Sources") -> None:
        """Register what the engine counts of itself (placement, cache capacity, drops) on ``sources``."""
        return None  # (a body: an engine with nothing of its own to report need not write it)


# The Protocol's members, read off its class: its methods and its annotated data members
MEMBERS = tuple(sorted({name for name, v in vars(EngineContract).items() if callable(v) and not name.startswith("_")}
                       | set(vars(EngineContract).get("__annotations__", {}))))
# What an engine writes itself (the abstract methods): an object with one of them means to be an engine
WRITTEN = ("model_info", "attach", "detach")


def missing_members(obj: Any) -> list[str]:
    """The contract's members ``obj`` lacks, by name ([]: it has every one)."""
    return [name for name in MEMBERS if not hasattr(obj, name)]


def partial_engine(obj: Any) -> list[str]:
    """The members an object that means to be an engine (it has one of ``WRITTEN``) lacks; [] for anything else
    (a model, which ``moescope.api.as_engine`` wraps in its engine's adapter) and for a whole engine."""
    if not any(hasattr(obj, name) for name in WRITTEN):
        return []
    return missing_members(obj)


def missing_features(engine: EngineContract, config: "Config") -> list[str]:
    """The features ``config`` asks for that ``engine`` does not take (cache, canary, scenarios, mitigations)."""
    asked = (("cache", config.cache), ("canary", config.canary), ("scenarios", config.scenarios),
             ("mitigations", config.mitigations))
    return [name for name, on in asked if on and name not in engine.features]


__all__ = ["FEATURES", "MEMBERS", "EngineContract", "ModelInfo", "Parts", "missing_features", "missing_members",
           "partial_engine"]
