"""The vLLM engine adapter: a vLLM model runner's MoE layers reporting through moescope's observer seam.

What is read, and through which of vLLM's own extension points:
- routing: every MoE layer of the worker's model is a ``MoERunner`` whose router (a ``BaseRouter``) takes a
  capture function for the logical expert ids it chose (``set_capture_fn``: the slot vLLM's own routed-experts
  capturer binds), bound as the model is built (``moescope.vllm.capture``). Inside the forward it copies
  ``topk_ids`` into the layer's slot of a preallocated step buffer (a tensor op: CUDA graphs replay it); after the
  forward the step's real rows go to the observer, one copy for all layers, on the device (no host sync).
- steps and requests: vLLM has no per-step hook for plugins, so the plugin wraps the model runner's
  ``execute_model`` (``moescope.vllm.plugin``; both of vLLM's runners) and calls ``begin_step``/``end_step``
  around it: the scheduler output says which requests were scheduled, with how many tokens, from which position,
  and which finished; the runner says the batch's row order (``segments``).

What vLLM does not give the capture function, and so moescope does not report: the router's scores (entropy,
margin and non-finite counts are NaN, "unknown", never a made-up number) and the gate weights (stored NaN).
Prefix-cache hits are never forwarded, so they are never routed nor counted.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moescope.capture.decision import RoutingDecision
from moescope.capture.engine_contract import EngineContract, ModelInfo
from moescope.capture.records import RequestRecord, StepRecord
from moescope.capture.sources import Reading, Sources
from moescope.errors import BadInput
from moescope.vllm import capture

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


class _Relay:
    """The observer's hooks off vLLM's step: the engine's thread queues each step (its routing ids, a device tensor,
    and its ``StepRecord``) and each finished request, and one worker thread hands them to the observer in order.
    Bounded by count and by the routing bytes queued: past either, an event is dropped and counted (``dropped``,
    ``moescope_capture_dropped_total{queue="vllm_steps"}``), never waited on. ``stop()`` drains what is queued."""

    MAX_EVENTS = 4096
    # routing ids queued on the device: 256 MiB at most (a full 8,192-row prefill step at 61 layers x 8 is 32 MB as
    # int64: eight such steps; a decode step of 256 rows, 1 MB)
    MAX_BYTES = 256 << 20

    def __init__(self, deliver) -> None:
        self._deliver = deliver
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._events = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self.dropped = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="moescope-vllm-relay", daemon=True)
        self._thread.start()

    def put(self, kind: str, payload, nbytes: int) -> None:
        with self._lock:
            if self._events >= self.MAX_EVENTS or self._bytes + nbytes > self.MAX_BYTES:
                self.dropped += 1
                return
            self._events += 1
            self._bytes += nbytes
        self._queue.put((kind, payload, nbytes))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload, nbytes = item
            try:
                self._deliver(kind, payload)
            except Exception:  # a sink's error is counted, never raised (the observer's FanOut isolates its own)
                self.errors += 1
                if self.errors == 1:
                    log.exception("moescope: delivering a %s failed (counted; further errors at debug)", kind)
                else:
                    log.debug("moescope: delivering a %s failed", kind, exc_info=True)
            with self._lock:
                self._events -= 1
                self._bytes -= nbytes

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued event was delivered (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._events and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._events

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def attention_shape(hf_config) -> tuple[int, int]:
    """(K and V cache elements per position over all layers, attention FLOPs per (row, attended position)) from a HF
    text config, as ``RuntimeEngine.model_info`` counts them for the reference runtime: per layer, standard attention
    caches K and V of every KV head (2 x kv_heads x head_dim) and computes q.k and p.v for every query head (a
    multiply-add each: 4 x heads x head_dim); MLA (``kv_lora_rank``) caches the compressed latent and the rope key
    (kv_lora_rank + qk_rope_head_dim), its FLOPs left unknown (0: not a formula this code has checked)."""
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    if getattr(hf_config, "kv_lora_rank", None):
        return layers * (int(hf_config.kv_lora_rank) + int(getattr(hf_config, "qk_rope_head_dim", 0) or 0)), 0
    head_dim = int(getattr(hf_config, "head_dim", 0) or 0) or (
        int(getattr(hf_config, "hidden_size", 0) or 0) // heads if heads else 0)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", 0) or heads)
    return 2 * layers * kv_heads * head_dim, 4 * layers * heads * head_dim


class VLLMAdapter(EngineContract):
    """A vLLM worker's model under the engine contract (``moescope.capture.engine_contract.EngineContract``): reports to
    an observer between ``attach(observer)`` and ``detach()``, at the model runner's step boundaries
    (``begin_step``/``end_step``), with the scheduler's request ids; no idle signal (the metrics flush on read), none
    of the runtime's features. One per worker process."""

    def __init__(self, model: torch.nn.Module, *, served_name: str | None = None, tokenizer=None,
                 attention: tuple[int, int] = (0, 0)) -> None:
        self.model = model
        ours = {id(m) for m in model.modules()}
        # (layer, vLLM's MoERunner): its attributes are vLLM's (moe_config, router), read untyped here
        self.runners: list[tuple[int, Any]] = [(layer, r) for layer, r in capture.runners() if id(r) in ours]
        if not self.runners:
            raise BadInput(f"no MoE layers in {type(model).__name__}: moescope reads the routers of vLLM's MoE "
                           "layers (MoERunner with a BaseRouter), bound as the model is built; this model has none")
        # A monolithic MoE kernel routes inside the kernel and never calls the router's capture function (vLLM
        # hands it a routing sink of its own instead): such a layer would count nothing, so it is not watched.
        mono = [layer for layer, r in self.runners if getattr(getattr(r, "_quant_method", None), "is_monolithic",
                                                              False) is True]
        if mono:
            log.warning("moescope: MoE layers %s run a monolithic MoE kernel (routing inside the kernel, no capture "
                        "function called): not watched", mono)
            self.runners = [(layer, r) for layer, r in self.runners if layer not in mono]
            if not self.runners:
                raise BadInput("every MoE layer runs a monolithic MoE kernel, which hands moescope no routing")
        cfg = self.runners[0][1].moe_config
        self.n_experts = int(getattr(cfg, "num_logical_experts", 0) or cfg.num_experts)
        self.top_k = int(cfg.experts_per_token)
        self.served_name = served_name
        # (K and V elements per position over all layers, attention FLOPs per (row, attended position)): from the
        # model's config (``attention_shape``); 0 where unknown, and the byte/FLOP counters that need them stay absent
        self.attention = attention
        self.tokenizer = tokenizer
        self.observer = None
        self._rows = 0  # real (unpadded) rows of the forward in flight (the scheduler's tokens)
        self._step = 0
        self._t0 = 0.0
        # On the relay's thread: engine request id -> the request (its client id among the rest), and its tokens
        # forwarded so far (the scheduler's)
        self._live: dict[str, _Live] = {}
        self._computed: dict[str, int] = {}
        # On the engine's thread: each request's prompt length (bounded by the requests in flight), and the previous
        # step's scheduler output (where a request that just finished stood)
        self._prompt_len: dict[str, int] = {}
        self._previous = None
        self.paused = False  # the capture switch: the plugin's step wrapper calls vLLM's own execute_model alone
        self._buffer: capture.StepBuffer | None = None  # moescope.vllm.capture's step buffer, once attached
        self._relay: _Relay | None = None  # the observer's hooks, on a thread of their own (attach)
        self._dropped_before = 0
        self._slots: list[tuple[int, int]] = []  # (buffer slot, layer) of this model's MoE layers
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
        param = next(self.model.parameters())
        kv_elements, attn_flops = self.attention
        return ModelInfo(name=name or self.served_name or type(self.model).__name__, n_experts=self.n_experts,
                         top_k=self.top_k, moe_layers=tuple(layer for layer, _ in self.runners),
                         dense_params=max(0, total - expert_total), expert_params=per_expert, device=str(param.device),
                         dtype_bytes=param.element_size(), kv_bytes_per_token=kv_elements * param.element_size(),
                         attn_flops_per_context=attn_flops)

    # -- the routers' ids (written into moescope.vllm.capture's step buffer inside the forward) ---------------
    def attach(self, observer) -> None:
        buf = capture.buffer_of(self.runners[0][1])
        ours = {layer for layer, r in self.runners if capture.buffer_of(r) is buf}
        self._slots = [(i, layer) for i, layer in enumerate(buf.layers) if layer in ours] if buf is not None else []
        self._buffer = buf
        self.observer = observer
        self._relay = _Relay(self._deliver)

    def detach(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.stop()  # what is queued reaches the observer first (the worker's exit: nothing recorded lost)
        self.observer = None
        self._buffer = None

    def pause(self) -> None:
        """The capture switch turned capture off: the plugin's step wrapper calls vLLM's ``execute_model`` alone (no
        begin or end of step, nothing queued). The forward's one copy per MoE layer into the step buffer stays: it
        is compiled into vLLM's graph, which cannot drop it without a recompile."""
        self.paused = True

    def resume(self, observer) -> None:
        """Capture back on: requests in flight are not followed (their start was not seen: no trace row, their
        tokens counted from now on), then steps are reported again."""
        if self._relay is not None:
            self._relay.put("forget", None, 0)
        self._prompt_len.clear()  # (the engine's thread makes no step call while paused)
        self._previous = None
        self.observer = observer
        self.paused = False

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every step and request queued so far reached the observer (tests; shutdown drains anyway)."""
        return self._relay.drain(timeout) if self._relay is not None else True

    @property
    def dropped(self) -> int:
        """Steps and finished requests dropped because the relay's queue was full (counted, never waited on)."""
        return self._relay.dropped if self._relay is not None else self._dropped_before

    def register_sources(self, sources: Sources) -> None:
        sources.register(self)

    def read(self) -> Reading:
        """What the adapter counts of itself (a ``capture.sources.Source``): the relay's drops,
        ``moescope_capture_dropped_total{queue="vllm_steps"}``."""
        return Reading(dropped={"vllm_steps": self.dropped})

    def _deliver(self, kind: str, payload) -> None:
        """On the relay's thread: one queued event to the observer (the engine's thread only queued it)."""
        observer = self.observer
        if observer is None:
            return
        if kind == "forget":
            self._live.clear()
            self._computed.clear()
            return
        if kind == "step":
            ids, *rest = payload
            step = self._step_record(*rest)
            if ids is not None:
                for i, layer in self._slots:
                    observer.on_routing(layer, self._decision(ids[:, i], step.n_tokens))
            observer.on_step(step)
        else:
            finished, tokens, now = payload
            for engine_id in finished:
                record = self._finish(engine_id, tokens, now)
                if record is not None:
                    observer.on_request(record)

    def _decision(self, ids: torch.Tensor, n: int) -> RoutingDecision:
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

    # -- steps and requests (called by the plugin around a model runner's execute_model) -----------------------
    # Everything here comes from the scheduler's output, the one input both of vLLM's model runners (V1 and Model
    # Runner V2) take; of the runner only the batch's row order and a finished request's output tokens are read
    # (``moescope.vllm.plugin``'s runner views). The engine's thread does a constant amount of Python per step: it
    # reads what vLLM frees after the step (a finished request's tokens, the batch's row order: a C-level list copy)
    # and queues the step; which request owns which rows (a loop over the batch) is worked out on the relay's thread,
    # in step order, from the scheduler's output (a new object each step, never changed after it is scheduled).
    def begin_step(self, scheduler_output, output_tokens=None) -> None:
        """Before the forward: read the generated tokens of the requests the scheduler says are done
        (``output_tokens(engine_id, n)`` reads them from the runner, whose state still holds them and frees them in
        this step), note new requests' prompt lengths; per finished or new request, never per step."""
        self._t0 = time.perf_counter()
        self._rows = int(scheduler_output.total_num_scheduled_tokens)
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            self._prompt_len[new.req_id] = len(new.prompt_token_ids or ())
        finished = getattr(scheduler_output, "finished_req_ids", ()) or ()
        if finished and self._relay is not None:
            self._relay.put("finish", (tuple(finished), self._tokens_of(finished, output_tokens), self._t0), 0)
        else:
            for engine_id in finished:
                self._prompt_len.pop(engine_id, None)
        self._previous = scheduler_output

    def _fed(self, engine_id: str) -> int:
        """Tokens a request that finished in the previous step was fed in all (prompt + generated - 1), from that
        step's scheduler output: its position before the step plus the tokens the step scheduled for it."""
        prev = self._previous
        n = prev.num_scheduled_tokens.get(engine_id, 0) if prev is not None else 0
        if not n:
            return 0
        for new in getattr(prev, "scheduled_new_reqs", ()) or ():
            if new.req_id == engine_id:
                return int(getattr(new, "num_computed_tokens", 0) or 0) + n
        cached = getattr(prev, "scheduled_cached_reqs", None)
        if cached is not None and engine_id in cached.req_ids:
            return int(cached.num_computed_tokens[list(cached.req_ids).index(engine_id)]) + n
        return 0

    def _tokens_of(self, finished, output_tokens) -> dict:
        """Each finished request's generated tokens, read now: as many as it generated (its tokens fed minus its
        prompt, plus the last one, never fed back)."""
        out = {}
        for engine_id in finished:
            n_prompt = self._prompt_len.pop(engine_id, None)
            if output_tokens is None or n_prompt is None:
                continue
            fed = self._fed(engine_id)
            n_out = max(0, fed - n_prompt + 1) if fed >= n_prompt else 0
            if n_out:
                out[engine_id] = list(output_tokens(engine_id, n_out) or ())
        return out

    def end_step(self, scheduler_output, req_order) -> None:
        """After the forward: the step's routing ids (one device copy, no sync) and the batch's row order
        (``req_order``), queued with the scheduler's output for the relay."""
        rows, self._rows = self._rows, 0
        if not rows or self._relay is None:
            return
        now = time.perf_counter()
        # the step's routing: the real rows of the step buffer (padding excluded), one copy for all layers, enqueued
        # on the ids' own device after the forward that wrote them (no host sync); the next forward overwrites them
        ids = self._buffer.step_ids(rows) if self._buffer is not None and self._slots else None
        self._relay.put("step", (ids, scheduler_output, list(req_order), rows, self._t0, now),
                        0 if ids is None else ids.numel() * ids.element_size())

    # -- on the relay's thread, in step order ------------------------------------------------------------------
    def _step_record(self, scheduler_output, req_order, rows: int, t0: float, now: float) -> StepRecord:
        """Note new requests and where every scheduled one stands, then which requests owned which rows."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params = getattr(new, "sampling_params", None)
            self._live[new.req_id] = _Live(client_id(new.req_id), list(new.prompt_token_ids or ()),
                                           getattr(params, "max_tokens", None), t0)
            self._computed[new.req_id] = int(getattr(new, "num_computed_tokens", 0) or 0)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            for engine_id, n in zip(cached.req_ids, cached.num_computed_tokens):
                self._computed[engine_id] = int(n)
        scheduled = scheduler_output.num_scheduled_tokens
        segments, prefill = [], False
        for engine_id in req_order:
            n = scheduled.get(engine_id, 0)
            if not n:
                continue
            first = self._computed.get(engine_id, 0)
            self._computed[engine_id] = first + n
            live = self._live.get(engine_id)
            n_prompt = len(live.prompt_ids) if live is not None else 0
            if first < n_prompt:
                prefill = True
            if live is not None and first + n >= n_prompt:  # this forward made one of its tokens
                live.token_times.append(now)
            segments.append((live.request_id if live is not None else client_id(engine_id), first, n))
        step = StepRecord(index=self._step, phase="prefill" if prefill else "decode", started=t0, seconds=now - t0,
                          n_tokens=rows, segments=tuple(segments))
        self._step += 1
        return step

    def _finish(self, engine_id: str, tokens: dict, now: float) -> RequestRecord | None:
        """A finished request's record (None: one this adapter never saw start)."""
        live = self._live.pop(engine_id, None)
        fed = self._computed.pop(engine_id, 0)
        if live is None:
            return None
        # Tokens fed = prompt + generated - 1 (the last generated token is never fed back).
        n_out = max(0, fed - len(live.prompt_ids) + 1) if fed >= len(live.prompt_ids) else 0
        return self._record(live, tokens.get(engine_id, [])[:n_out] if n_out else [], n_out, now)

    def _record(self, live: _Live, out: list, n_out: int, now: float) -> RequestRecord:
        times = live.token_times[:max(len(out), n_out)]
        first = times[0] if times else now
        lat = tuple([first - live.arrival] + [b - a for a, b in zip(times, times[1:])]) if times else ()
        reason = "length" if live.max_tokens is not None and max(len(out), n_out) >= live.max_tokens else "stop"
        return RequestRecord(request_id=live.request_id, prompt=self._text(live.prompt_ids),
                             output=self._text(out), prompt_tokens=tuple(live.prompt_ids),
                             output_tokens=tuple(out), arrival=live.arrival, queue_s=0.0,
                             prefill_s=first - live.arrival if times else now - live.arrival,
                             ttft_s=first - live.arrival if times else 0.0, token_latencies_s=lat,
                             total_s=now - live.arrival, finish_reason=reason)

    def _text(self, ids) -> str:
        if self.tokenizer is None or not ids:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except Exception:
            return ""
