"""The vLLM engine adapter: a vLLM model runner's MoE layers reporting through moescope's observer seam.

What is read, and through which of vLLM's own extension points:
- routing: every MoE layer of the worker's model is a ``MoERunner`` whose router (a ``BaseRouter``) takes a
  capture function for the logical expert ids it chose (``set_capture_fn``: the slot vLLM's own routed-experts
  capturer binds), bound as the model is built (``moescope.vllm.capture``). Each forward hands ``topk_ids``
  [T, k] here, and a copy of the real rows goes to the observer (no host sync: a slice and a dtype copy, on the
  device where the ids live).
- steps and requests: vLLM has no per-step hook for plugins, so the plugin wraps the model runner's
  ``execute_model`` (``moescope.vllm.plugin``) and calls ``begin_step``/``end_step`` around it: the scheduler
  output says which requests own which rows of the flat batch (``segments``) and which finished.

What vLLM does not give the capture function, and so moescope does not report: the router's scores (entropy,
margin and non-finite counts are NaN, "unknown", never a made-up number) and the gate weights (stored NaN).
Prefix-cache hits are never forwarded, so they are never routed nor counted.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

import torch

from moescope.capture.decision import RoutingDecision
from moescope.capture.records import RequestRecord, StepRecord
from moescope.errors import BadInput
from moescope.metrics.state import ModelInfo

log = logging.getLogger("vllm.moescope")

# vLLM makes each engine request id unique by appending "-" and 8 characters of a random uuid to the id the
# API server chose (``vllm/v1/engine/input_processor.py``); a completion's prompts are "<id>-<i>"
# (``.../completion/serving.py``), a chat's "<id>" (one prompt) or "<id>_<i>".
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_FIRST_PROMPT = re.compile(r"^(cmpl-.+)-0$")


def client_id(engine_id: str) -> str:
    """The id the client sees (the response's ``id``) for a vLLM engine request id: the random suffix dropped,
    and a completion's first prompt named as the completion (``cmpl-X-0-1a2b3c4d`` -> ``cmpl-X``); a second
    prompt of the same completion keeps its index (``cmpl-X-1``)."""
    base = _RANDOM_SUFFIX.sub("", engine_id)
    m = _FIRST_PROMPT.match(base)
    return m.group(1) if m else base


@dataclass
class _Live:
    """A request this worker is serving: what its trace row needs, bounded by the requests in flight."""

    request_id: str
    prompt_ids: list
    max_tokens: int | None
    arrival: float
    first_token: float | None = None
    token_times: list = field(default_factory=list)


class VLLMAdapter:
    """Reports a vLLM worker's model to an observer: ``attach(observer)``, ``detach()``, and the model runner's
    step boundaries (``begin_step``/``end_step``). One per worker process."""

    def __init__(self, model: torch.nn.Module, *, served_name: str | None = None, tokenizer=None) -> None:
        from moescope.vllm import capture

        self.model = model
        ours = {id(m) for m in model.modules()}
        self.runners = [(layer, r) for layer, r in capture.runners() if id(r) in ours]
        if not self.runners:
            raise BadInput(f"no MoE layers in {type(model).__name__}: moescope reads the routers of vLLM's MoE "
                           "layers (MoERunner with a BaseRouter), bound as the model is built; this model has none")
        cfg = self.runners[0][1].moe_config
        self.n_experts = int(getattr(cfg, "num_logical_experts", 0) or cfg.num_experts)
        self.top_k = int(cfg.experts_per_token)
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.observer = None
        self._rows = 0  # real (unpadded) rows of the forward in flight; 0 outside a step: captures ignored
        self._step = 0
        self._t0 = 0.0
        self._live: dict[str, _Live] = {}  # engine request id -> the request (its client id among the rest)
        # Per-row-count constants of a decision (what vLLM does not tell: weights, scores), shared by every layer
        # and step of that many rows: immutable after construction, so one allocation serves them all.
        self._consts: dict[int, tuple] = {}

    # -- what the metrics need ---------------------------------------------------------------------------------
    def model_info(self, name: str | None = None) -> ModelInfo:
        total = sum(p.numel() for p in self.model.parameters())
        cfg = self.runners[0][1].moe_config
        per_expert = 3 * int(cfg.hidden_dim) * int(cfg.intermediate_size)  # gate, up, down projections (SwiGLU)
        local = int(getattr(cfg, "num_local_experts", self.n_experts) or self.n_experts)
        expert_total = per_expert * local * len(self.runners)
        device = next(self.model.parameters()).device
        return ModelInfo(name=name or self.served_name or type(self.model).__name__, n_experts=self.n_experts,
                         top_k=self.top_k, moe_layers=tuple(layer for layer, _ in self.runners),
                         dense_params=max(0, total - expert_total), expert_params=per_expert, device=str(device))

    # -- the routers' ids (moescope.vllm.capture's op hands them here) ----------------------------------------
    def attach(self, observer) -> None:
        from moescope.vllm import capture

        self.observer = observer
        capture.set_sink(self._on_ids)

    def detach(self) -> None:
        from moescope.vllm import capture

        capture.set_sink(None)
        self.observer = None

    def _on_ids(self, layer: int, topk_ids: torch.Tensor) -> None:
        n = self._rows  # 0 outside a step of execute_model (vLLM's start-up and dummy forwards): not counted
        if n and self.observer is not None:
            self.observer.on_routing(layer, self._decision(topk_ids, n))

    def _decision(self, topk_ids: torch.Tensor, n: int) -> RoutingDecision:
        # Padding rows (a captured graph's batch size) are no tokens: only the step's real rows are kept. A copy
        # (vLLM reuses its buffers), in int64 as the probes index with it, on the ids' own device.
        ids = topk_ids[:n].to(torch.int64, copy=True)
        consts = self._consts.get(n)
        if consts is None or consts[0].device != ids.device:
            nan = torch.full((n,), float("nan"), device=ids.device)
            zero = torch.zeros((), dtype=torch.int64, device=ids.device)
            consts = (torch.full(ids.shape, float("nan"), device=ids.device),
                      torch.ones(ids.shape, dtype=torch.bool, device=ids.device), nan, zero)
            if len(self._consts) > 64:
                self._consts.clear()
            self._consts[n] = consts
        weights, kept, nan, zero = consts
        return RoutingDecision(ids=ids, weights=weights, kept=kept, entropy=nan, margin=nan, nonfinite=zero,
                               dropped=zero, n_experts=self.n_experts, active_ids=ids, scored=False)

    # -- steps and requests (called by the plugin around execute_model) ----------------------------------------
    def begin_step(self, scheduler_output, requests: dict) -> None:
        """Before the forward: finish the requests the scheduler says are done (their state is still in the
        runner's ``requests``), note new ones, and arm the capture functions for this step's real rows."""
        now = time.perf_counter()
        for engine_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._finish(engine_id, requests.get(engine_id), now)
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params = getattr(new, "sampling_params", None)
            self._live[new.req_id] = _Live(client_id(new.req_id), list(new.prompt_token_ids or ()),
                                           getattr(params, "max_tokens", None), now)
        self._rows = int(scheduler_output.total_num_scheduled_tokens)
        self._t0 = now

    def end_step(self, scheduler_output, req_order, requests: dict) -> None:
        """After the forward: tell the observer which requests owned which rows (``req_order``: the runner's
        batch order)."""
        rows, self._rows = self._rows, 0
        if not rows:
            return
        now = time.perf_counter()
        scheduled = scheduler_output.num_scheduled_tokens
        segments, prefill = [], False
        for engine_id in req_order:
            n = scheduled.get(engine_id, 0)
            if not n:
                continue
            state = requests.get(engine_id)
            first = int(getattr(state, "num_computed_tokens", 0)) if state is not None else 0
            live = self._live.get(engine_id)
            n_prompt = len(live.prompt_ids) if live is not None else 0
            if first < n_prompt:
                prefill = True
            if live is not None and first + n >= n_prompt:  # this forward made one of its tokens
                live.token_times.append(now)
            segments.append((live.request_id if live is not None else client_id(engine_id), first, n))
        step = StepRecord(index=self._step, phase="prefill" if prefill else "decode", started=self._t0,
                          seconds=now - self._t0, n_tokens=rows, segments=tuple(segments))
        self._step += 1
        if self.observer is not None:
            self.observer.on_step(step)

    def _finish(self, engine_id: str, state, now: float) -> None:
        live = self._live.pop(engine_id, None)
        if live is None or self.observer is None:
            return
        out = list(getattr(state, "output_token_ids", ()) or ()) if state is not None else []
        times = live.token_times[:len(out)]
        first = times[0] if times else now
        lat = tuple([first - live.arrival] + [b - a for a, b in zip(times, times[1:])]) if out else ()
        reason = "length" if live.max_tokens is not None and len(out) >= live.max_tokens else "stop"
        record = RequestRecord(request_id=live.request_id, prompt=self._text(live.prompt_ids),
                               output=self._text(out), prompt_tokens=tuple(live.prompt_ids),
                               output_tokens=tuple(out), arrival=live.arrival, queue_s=0.0,
                               prefill_s=first - live.arrival if out else now - live.arrival,
                               ttft_s=first - live.arrival if out else 0.0, token_latencies_s=lat,
                               total_s=now - live.arrival, finish_reason=reason)
        self.observer.on_request(record)

    def _text(self, ids) -> str:
        if self.tokenizer is None or not ids:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except Exception:
            return ""
