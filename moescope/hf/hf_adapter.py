"""Instrument HuggingFace transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS; transformers 4.5x and 5.x) through forward hooks, reporting through the same observer seam as
the reference runtime.

What is hooked, per MoE block (a module with an ``experts`` child and a ``gate`` or ``router`` child):
- the router's forward: its logits (for entropy, margin, non-finite counts) and, when it returns them,
  the chosen expert ids (DeepSeek-V3 4.x, GPT-OSS, every 5.x family);
- on 5.x, a pre-hook on the fused ``experts`` module: the ids the experts actually compute. These are the
  true ids in every family, including DeepSeek-V3's group-limited routing, which cannot be recomputed from
  the logits;
- the block's forward end: emits one ``RoutingDecision`` per block per forward.
A forward hook on the top module ends the step. Hooks do not fire under CUDA-graph replay,
``torch.compile(fullgraph=True)`` or kernel-replaced forwards; see docs/capture.md.

Nothing here syncs with the device: ids and logits stay device tensors until the probe's per-step copy.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moescope.capture.decision import RoutingDecision, entropy_margin
from moescope.capture.engine_contract import EngineContract, ModelInfo
from moescope.capture.records import StepRecord
from moescope.errors import BadInput

ROUTER_NAMES = ("gate", "router")


@dataclass
class _Layer:
    index: int
    name: str
    block: torch.nn.Module
    router: torch.nn.Module
    experts: torch.nn.Module
    n_experts: int
    top_k: int
    scoring: str = "softmax"  # "sigmoid" for DeepSeek-V3-style routers (entropy/margin as the runtime defines them)
    logits: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    true_ids: bool = False  # ids came from the experts' own inputs
    handles: list = field(default_factory=list)


def _n_experts(block, router, experts, config) -> int:
    for obj, attr in ((router, "num_experts"), (router, "n_routed_experts"), (experts, "num_experts"),
                      (block, "num_experts")):
        v = getattr(obj, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    w = getattr(router, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w.shape[0]
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise BadInput(f"cannot tell the number of experts of {type(block).__name__}")


def _top_k(block, router, config) -> int:
    for obj, attr in ((router, "top_k"), (block, "top_k"), (block, "num_experts_per_tok"),
                      (config, "num_experts_per_tok"), (config, "moe_topk"), (config, "top_k")):
        v = getattr(obj, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise BadInput(f"cannot tell top-k of {type(block).__name__}")


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module, torch.nn.Module]]:
    """(name, block, router, experts) for every module with an ``experts`` child and a gate/router child."""
    found = []
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        router = next((kids[n] for n in ROUTER_NAMES if n in kids), None)
        if router is not None and "experts" in kids:
            found.append((name, mod, router, kids["experts"]))
    return found


class DeferredDecision:
    """A ``RoutingDecision`` of one HF MoE block's forward, resolved where it is read (the evaluator's thread, the
    trace writer's), never in the forward: the hooks keep references to the router's outputs (tensors the forward
    does not change afterwards) and the forward runs no moescope tensor operation. Reading any field resolves it
    once (``_decision``): top-k of the softmax where the router gave logits only (4.x linear gates: the ids the block
    computes), entropy and margin of the router's scores, non-finite logits."""

    __slots__ = ("_layer", "_logits", "_ids", "_weights", "_resolved")
    rerouted = None

    def __init__(self, layer: _Layer, logits, ids, weights) -> None:
        self._layer, self._logits, self._ids, self._weights = layer, logits, ids, weights
        self._resolved: RoutingDecision | None = None

    def resolve(self) -> RoutingDecision:
        d = self._resolved
        if d is None:  # (two threads resolving at once compute the same decision)
            with torch.inference_mode():  # read-only statistics: no autograd graph, whatever the forward ran under
                d = self._resolved = _decision(self._layer, self._logits, self._ids, self._weights)
            self._logits = self._ids = self._weights = None
        return d

    @property
    def n_experts(self) -> int:
        return self._layer.n_experts

    def __getattr__(self, name: str):  # ids, weights, kept, entropy, margin, nonfinite, dropped, active_ids, scored
        return getattr(self.resolve(), name)


def _decision(layer: _Layer, logits, ids, weights) -> RoutingDecision:
    """The decision of one block's forward from the router's outputs the hooks kept (see ``DeferredDecision``)."""
    if isinstance(logits, tuple):  # (the gate's input, its weight): a gate that returns no logits
        x, w = logits
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), w.float())
    if logits is not None:
        logits = logits.reshape(-1, layer.n_experts)
    if ids is not None:
        ids = ids.reshape(-1, ids.shape[-1])
        weights = None if weights is None else weights.reshape(ids.shape)
    probs = torch.softmax(logits.float(), dim=-1) if logits is not None else None
    if ids is None:  # 4.x linear gates: top-k of the softmax = top-k of the logits
        top_p, ids = torch.topk(probs, layer.top_k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
    ids = ids.long()
    if weights is None:
        weights = torch.full(ids.shape, 1.0 / ids.shape[1], device=ids.device)
    n = ids.shape[0]
    if probs is not None and probs.shape[0] == n:
        # the runtime's definitions (docs/metrics.md): entropy of the router's scores normalised to sum 1,
        # margin of the two best scores; sigmoid routers score with the sigmoid, the others the softmax
        scores = probs if layer.scoring == "softmax" else torch.sigmoid(logits.float())
        entropy, margin = entropy_margin(scores, layer.scoring)
        nonfinite = (~torch.isfinite(logits)).sum()
    else:  # no logits to judge certainty by: report NaN (unknown), never a made-up number
        entropy = margin = torch.full((n,), float("nan"), device=ids.device)
        nonfinite = torch.zeros((), dtype=torch.int64, device=ids.device)
    return RoutingDecision(ids=ids, weights=weights.float(), kept=torch.ones_like(ids, dtype=torch.bool),
                           entropy=entropy, margin=margin, nonfinite=nonfinite,
                           dropped=torch.zeros((), dtype=torch.int64, device=ids.device),
                           n_experts=layer.n_experts, active_ids=ids)


class HFAdapter(EngineContract):
    """A HF MoE model under the engine contract (``moescope.capture.engine_contract.EngineContract``):
    ``attach(observer)`` hooks it, ``detach()`` removes every hook. Its caller drives the model forward by forward, so
    there is no scheduler to name requests: each top-level forward is one ``StepRecord`` with no ``segments`` (each
    forward is one sampling draw) and no ``on_request``; nothing says when it is idle (the metrics flush on read); it
    takes none of the runtime's features."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = getattr(model, "config", None)
        blocks = find_moe_blocks(model)
        if not blocks:
            kind = getattr(config, "model_type", type(model).__name__)
            raise BadInput(f"no MoE layers found in {kind}: looked for modules with an 'experts' child and a "
                           f"'gate' or 'router' child (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS)")
        self.layers: list[_Layer] = []
        for i, (name, block, router, experts) in enumerate(blocks):
            m = re.search(r"layers\.(\d+)\.", name + ".")
            sigmoid = hasattr(router, "e_score_correction_bias") or getattr(config, "scoring_func", None) == "sigmoid"
            self.layers.append(_Layer(int(m.group(1)) if m else i, name, block, router, experts,
                                      _n_experts(block, router, experts, config), _top_k(block, router, config),
                                      "sigmoid" if sigmoid else "softmax"))
        self.observer = None
        self._top_handles: list = []
        self._step = 0
        self._t0 = 0.0

    def model_info(self, name: str | None = None) -> ModelInfo:
        config = getattr(self.model, "config", None)
        total = sum(p.numel() for p in self.model.parameters())
        expert_total = sum(p.numel() for layer in self.layers for p in layer.experts.parameters())
        first = self.layers[0]
        per_expert = sum(p.numel() for p in first.experts.parameters()) // first.n_experts
        device = next(self.model.parameters()).device
        return ModelInfo(name=name or getattr(config, "model_type", type(self.model).__name__),
                         n_experts=first.n_experts, top_k=first.top_k,
                         moe_layers=tuple(layer.index for layer in self.layers),
                         dense_params=total - expert_total, expert_params=per_expert, device=str(device),
                         # the weight bytes a step reads (moescope.efficiency); KV and attention FLOPs unknown here
                         dtype_bytes=next(self.model.parameters()).element_size())

    # -- hooks -----------------------------------------------------------------------------------------
    def attach(self, observer) -> None:
        self.observer = observer
        for layer in self.layers:
            layer.handles.append(layer.router.register_forward_hook(self._router_hook(layer)))
            layer.handles.append(layer.experts.register_forward_pre_hook(self._experts_hook(layer),
                                                                         with_kwargs=True))
            layer.handles.append(layer.block.register_forward_hook(self._block_hook(layer)))
        self._top_handles.append(self.model.register_forward_pre_hook(self._start, with_kwargs=True))
        self._top_handles.append(self.model.register_forward_hook(self._end, with_kwargs=True))

    def detach(self) -> None:
        for layer in self.layers:
            for h in layer.handles:
                h.remove()
            layer.handles.clear()
        for h in self._top_handles:
            h.remove()
        self._top_handles.clear()

    @staticmethod
    def _router_hook(layer: _Layer):
        def hook(module, args, out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            tensors = [t for t in outs if isinstance(t, torch.Tensor)]
            logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == layer.n_experts), None)
            if logits is None and args and isinstance(getattr(module, "weight", None), torch.Tensor):
                # A gate that returns only (ids, weights) (DeepSeek-V3 on 4.x): its logits are recomputed from its
                # input where the decision is read (entropy, non-finite counts); the ids stay the gate's own.
                layer.logits = (args[0], module.weight)
            else:
                layer.logits = logits
            ids = next((t for t in tensors if not t.is_floating_point() and t.dim() >= 1), None)
            if ids is not None and not layer.true_ids:
                layer.ids = ids
                layer.weights = next((t for t in tensors if t.is_floating_point() and t.shape == ids.shape), None)
        return hook

    @staticmethod
    def _experts_hook(layer: _Layer):
        def hook(module, args, kwargs):
            vals = [*args, *kwargs.values()]
            ids = next((t for t in vals if isinstance(t, torch.Tensor) and not t.is_floating_point()
                        and t.dim() == 2), None)
            if ids is not None:
                layer.ids, layer.true_ids = ids, True
                layer.weights = next((t for t in vals if isinstance(t, torch.Tensor) and t.is_floating_point()
                                      and t.shape == ids.shape), None)
        return hook

    def _block_hook(self, layer: _Layer):
        def hook(module, args, out):
            logits, ids, weights = layer.logits, layer.ids, layer.weights
            layer.logits = layer.ids = layer.weights = None
            layer.true_ids = False
            if (ids is not None or logits is not None) and self.observer is not None:
                # references only: the statistics are computed where the decision is read, off the forward
                self.observer.on_routing(layer.index, DeferredDecision(layer, logits, ids, weights))
        return hook

    def _start(self, module, args, kwargs) -> None:
        self._t0 = time.perf_counter()

    def _end(self, module, args, kwargs, out) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        n_pos = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 1
        n_tok = int(ids.shape[0] * n_pos) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0
        step = StepRecord(self._step, "prefill" if n_pos > 1 else "decode", self._t0, time.perf_counter() - self._t0,
                          n_tok, (), _kv_tokens(out, ids))
        self._step += 1
        if self.observer is not None:
            self.observer.on_step(step)


def _kv_tokens(out, ids) -> int:
    """Positions held in the forward's KV cache after it (``StepRecord.kv_tokens``): rows x the cache's length, where
    the forward returned a cache that keeps its length on the host (``get_seq_length()``: the
    ``Cache`` classes of transformers 5.x); else 0, unknown (``use_cache=False``, a legacy tuple cache, a cache whose
    length is a device tensor, as 4.x's static cache: reading it would wait for the device)."""
    cache = getattr(out, "cache", None)  # transformers 5.x's name (``past_key_values``: 4.x's, deprecated in 5.x)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    length = getattr(cache, "get_seq_length", None)
    if length is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return 0
    try:
        n = length()
    except Exception:  # a cache type this code does not know: unknown, never a made-up number
        return 0
    return int(ids.shape[0]) * n if isinstance(n, int) else 0


def describe(model: torch.nn.Module) -> list[dict[str, Any]]:
    """What the adapter would hook (for error messages and docs)."""
    return [{"layer": layer.index, "module": layer.name, "experts": layer.n_experts, "top_k": layer.top_k}
            for layer in HFAdapter(model).layers]
