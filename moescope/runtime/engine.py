"""The request-level engine: queue, batched prefill and decode steps, sampling, per-request timings.

Scheduling is deliberately simple and deterministic: each ``step()`` runs one forward, a prefill of every
newly admitted request if there are any (prefill first, as vLLM's v0 scheduler), else one decode token for
every running request. The MoE layers see all tokens of the step at once.

The engine makes one host sync per step: reading the sampled tokens (it needs them to stop requests and
build the next step). Observers get device tensors during the forward and a ``StepRecord`` after it.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from moescope.capture.observer import FanOut, Observer
from moescope.capture.records import RequestRecord, StepRecord
from moescope.errors import BadInput, MoescopeError
from moescope.runtime import tokenizer
from moescope.runtime.graph_decode import GraphCollector, StaticDecoder, check_supported
from moescope.runtime.model import KVCache, MoETransformer, Segment
from moescope.runtime.router import extend_prefix_key
from moescope.runtime.traffic import TrafficRequest

log = logging.getLogger("moescope.runtime")


@dataclass
class _Live:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    arrival: float
    generator: torch.Generator | None
    domain: str | None
    tenant: str | None
    truncated: bool
    cache: KVCache | None = None
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    admitted_at: float = 0.0
    prefix_key: int = 0  # router smoothing: key of the tokens fed so far
    prefill_s: float = 0.0
    finish_reason: str = ""
    slot: int = -1  # batch slot in the fixed-shape decode step (decode="static"/"graph")
    sink: Callable[[int | None, RequestRecord | None], None] | None = None
    deadline: float | None = None  # engine clock; past it the request finishes as "timeout"
    stop: tuple[tuple[int, ...], ...] = ()  # stop strings as byte-token sequences
    min_tokens: int = 0  # no EOS and no stop string before this many output tokens
    ignore_eos: bool = False  # never sample EOS (the request runs to max_new_tokens or a stop string)

    def eos_banned(self) -> bool:
        return self.ignore_eos or len(self.output_ids) < self.min_tokens


DECODE_MODES = ("eager", "static", "graph")
# Expert-parallel ranks at rest (nothing to run on any rank): how long a rank waits for work before the ranks meet
# again in one small all-reduce (the first-token delay it adds at most). Serve's ranks use it too.
RANK_POLL_S = 0.02


class StepFailed(Exception):
    """``Engine.step`` raised inside its forward or sampling. The engine is as it was before the step: its
    requests are queued or running again (a retry reruns them); ``request_ids`` are the requests of that step."""

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException) -> None:
        super().__init__(f"engine step over {len(request_ids)} request(s) failed: {cause!r}")
        self.request_ids = request_ids
        self.peer = isinstance(cause, PeerStepFailed)  # not these requests' fault: a peer rank's compute failed


class PeerStepFailed(RuntimeError):
    """Expert-parallel: a peer rank's expert compute failed in this step, so the rows it computed for this rank are
    not the model's; the step is undone on every rank and taken again (these requests are not to blame)."""


def _ends_with_stop(output_ids: list[int], stops: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the output's bytes end with one of the stop sequences (byte tokens: a tail compare per stop)."""
    return any(len(output_ids) >= len(s) and tuple(output_ids[-len(s):]) == s for s in stops)


class Engine:
    """Serve requests on a ``MoETransformer``.

    Args:
        model: the model (its device is used for everything).
        max_batch: most requests running at once.
        seed: seeds the per-request samplers (request n gets ``seed * 1_000_003 + n``).
        observer: receives routing, step and request events (a list is wrapped in ``FanOut``).
        clock: time source in seconds (tests inject a fake one).
        canary: a ``runtime.canary.Canary`` run between steps when due (flip ratios go to ``on_canary``).
        decode: "eager" (the model's own forward), "static" (``runtime.graph_decode.StaticDecoder``: fixed
            shapes, ``max_batch`` slots, routing counted by ops inside the step), or "graph" (the static step
            captured once as a CUDA graph and replayed; CUDA only). Prefill stays eager. With "static"/"graph"
            decode steps call no per-layer hooks (a graph cannot): their routing reaches observers that take
            summaries (``on_stats``: the metrics) from the in-step counters after each step; the trace store
            keeps such requests whole but without per-token routing.
        lockstep: for expert-parallel ranks (``parallel.ExpertParallel``, data-parallel attention: each rank
            runs its own requests), the object their exchanges share flags through: ``run`` makes the same
            exchanges on every rank each step (an idle forward where a rank has nothing to run), and ends at a
            step every rank agrees on (a deadline or ``request_stop`` on any rank, or every rank done), never at
            a step one rank skips.
    """

    @property
    def observer(self) -> Observer:
        """The model's observer, read at every event: the engine reports to whatever the model is instrumented with
        now, so closing the instrumentation (which restores the model's previous observer) stops its reports too."""
        return self.model.observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        self.model.observer = observer

    def __init__(self, model: MoETransformer, *, max_batch: int = 16, seed: int = 0,
                 observer: Observer | list[Observer] | None = None,
                 clock: Callable[[], float] = time.perf_counter, canary=None, decode: str = "eager",
                 lockstep=None) -> None:
        if max_batch <= 0:
            raise BadInput(f"max_batch must be positive, got {max_batch}")
        if decode not in DECODE_MODES:
            raise BadInput(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        if decode == "graph" and model.device.type != "cuda":
            raise BadInput(f"decode='graph' needs the model on a CUDA device (it is on {model.device.type}); "
                           "decode='static' runs the same fixed-shape step without a graph")
        if decode != "eager":
            check_supported(model)
        self.model = model.eval()
        self.max_batch = max_batch
        self.seed = seed
        self.clock = clock
        if isinstance(observer, list):
            observer = FanOut(observer)
        if observer is not None:  # else whatever the model is instrumented with (moescope.instrument sets it)
            model.observer = observer
        self._waiting: collections.deque[_Live] = collections.deque()
        self._running: list[_Live] = []
        self._submitted = 0
        self._steps = 0
        self._told_idle = False  # on_idle sent since the last step
        self.finished: list[RequestRecord] = []
        self.canary = canary
        self.lockstep = lockstep
        self._stop_requested = False  # set by request_stop (any thread); read between steps
        self.leak: list[torch.Tensor] | None = None  # the leak fault: a list that retains a tensor per step
        self.leak_bytes = 65536  # retained per step under the leak fault
        self.decode = decode
        self._decoder = None  # StaticDecoder, built at the first decode step
        self._collector = None
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self.sink_errors = 0  # exceptions raised by request sinks (counted, logged once, never raised)
        self.poison: set[str] = set()  # a debugging fault: a step that holds one of these request ids raises
        self._forward_mark: int | None = None  # expert-parallel: not None once this step's forward began

    # -- submission ------------------------------------------------------------------------------------
    def submit(self, prompt: str, *, max_new_tokens: int = 32, temperature: float = 0.0,
               request_id: str | None = None, domain: str | None = None, tenant: str | None = None,
               arrival: float | None = None, seed: int | None = None, stop: Iterable[str] = (),
               timeout_s: float | None = None,
               sink: Callable[[int | None, RequestRecord | None], None] | None = None,
               prompt_ids: list[int] | None = None, min_tokens: int = 0, ignore_eos: bool = False) -> str:
        """Queue a request; returns its id (``request_id`` or a new random one).

        Args:
            seed: seeds this request's sampler (default: derived from the engine's seed and submission order).
            stop: strings that end the request (finish_reason "stop") once its output ends with one; the
                record's output keeps them (it matches the tokens), a server trims them from what it returns.
            timeout_s: the request finishes as "timeout" once this long has passed since arrival (checked at
                the start of each step, queued requests included).
            sink: called on the engine's thread once per step the request takes part in, with the token just
                made and, on the request's last call, its ``RequestRecord`` (token ``None`` when it ended without
                one: cancelled or timed out). It must return at once (hand the token to another thread, never
                wait on a client); an exception in it is counted in ``sink_errors`` and never stops the engine.
            prompt_ids: the prompt as token ids, used as given (no BOS added; ``prompt`` is then only its label
                in the record); each must be in ``[0, vocab_size)``.
            min_tokens: EOS is never sampled and stop strings never end the request before this many output
                tokens (vLLM's ``min_tokens``).
            ignore_eos: EOS is never sampled (vLLM's ``ignore_eos``: fixed-length runs).
        """
        if max_new_tokens <= 0:
            raise BadInput(f"max_new_tokens must be positive, got {max_new_tokens}")
        if temperature < 0:
            raise BadInput(f"temperature must be >= 0, got {temperature}")
        limit = self.model.cfg.max_seq_len - max_new_tokens
        if limit < 2:
            raise BadInput(f"max_new_tokens {max_new_tokens} leaves no room for a prompt "
                           f"(max_seq_len {self.model.cfg.max_seq_len})")
        if prompt_ids is not None:
            vocab = self.model.cfg.vocab_size
            if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
                raise BadInput(f"prompt_ids must be a non-empty list of token ids in [0, {vocab})")
        ids = tokenizer.encode(prompt) if prompt_ids is None else list(prompt_ids)
        truncated = len(ids) > limit
        if truncated:  # keep BOS and the most recent part of the prompt
            ids = [ids[0], *ids[len(ids) - limit + 1:]]
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.model.device).manual_seed(
                self.seed * 1_000_003 + self._submitted if seed is None else seed)
        rid = request_id or uuid.uuid4().hex[:16]
        arrival = self.clock() if arrival is None else arrival
        self._waiting.append(_Live(rid, prompt, ids, max_new_tokens, temperature, arrival, gen, domain, tenant,
                                   truncated, sink=sink, deadline=None if timeout_s is None else arrival + timeout_s,
                                   stop=tuple(tuple(s.encode("utf-8")) for s in stop if s),
                                   min_tokens=min_tokens, ignore_eos=ignore_eos))
        self._submitted += 1
        return rid

    def holds(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running."""
        return any(live.request_id == request_id for live in (*self._waiting, *self._running))

    def cancel(self, request_id: str, reason: str = "cancelled") -> RequestRecord | None:
        """End a queued or running request now (finish_reason ``reason``: "cancelled", or "error" for one a
        failed step was traced to): its KV cache and batch slot are freed before the next step, its record
        goes to observers like any other. Call it from the thread that steps the engine. Returns the record, or
        None when no such request is queued or running."""
        for live in (*self._waiting, *self._running):
            if live.request_id == request_id:
                return self._end(live, reason)
        return None

    def _end(self, live: _Live, reason: str) -> RequestRecord:
        """Finish a request outside a step's sampling (cancel, timeout)."""
        if live in self._running:
            self._running.remove(live)
        else:
            self._waiting.remove(live)
        live.finish_reason = reason
        record = self._retire(live, end=self.clock())
        self._emit(live, None, record)
        return record

    def _retire(self, live: _Live, end: float | None = None) -> RequestRecord:
        live.cache = None  # free the KV cache now, not when the record is collected
        if live.slot >= 0:
            self._free_slots.append(live.slot)
            live.slot = -1
        record = self._record(live, end)
        self.finished.append(record)
        self.observer.on_request(record)
        return record

    def _emit(self, live: _Live, token: int | None, record: RequestRecord | None) -> None:
        if live.sink is None:
            return
        try:
            live.sink(token, record)
        except Exception:  # a broken consumer must never stop the engine
            self.sink_errors += 1
            if self.sink_errors == 1:
                log.exception("request sink raised (counted in sink_errors; later errors not logged)")

    def _expire(self, now: float) -> None:
        for live in [r for r in (*self._waiting, *self._running) if r.deadline is not None and now >= r.deadline]:
            self._end(live, "timeout")

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def _canary(self) -> None:
        """Run the canary; its flip ratios go to the observer where it takes the runtime's events
        (``capture.observer.RuntimeObserver``: an engine-neutral observer has no ``on_canary``)."""
        flips = self.canary.run()
        on_canary = getattr(self.observer, "on_canary", None)
        if on_canary is not None:
            on_canary(flips)

    # -- one step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, only: set[str] | None = None) -> list[RequestRecord]:
        """Run one forward (prefill of newly admitted requests, else a decode); returns requests finished.

        ``only``: run only these requests this step (the others wait): how a server retries a failed step
        request by request. Raises ``StepFailed`` (state restored) when the forward or sampling raises."""
        self._told_idle = False
        if self.canary is not None and self.canary.due():
            self._canary()
        now = self.clock()
        self._expire(now)
        new = []
        waiting = self._waiting if only is None else [r for r in self._waiting if r.request_id in only]
        for live in waiting:
            if len(self._running) + len(new) >= self.max_batch:
                break
            live.admitted_at = now
            live.cache = self.model.new_cache()
            if self.decode != "eager":
                live.slot = self._free_slots.pop()
            new.append(live)
        for live in new:
            if only is None:
                self._waiting.popleft()
            else:
                self._waiting.remove(live)
        running = self._running if only is None else [r for r in self._running if r.request_id in only]
        if new:
            batch, phase = new, "prefill"
        elif running:
            batch, phase = running, "decode"
        else:
            return []
        saved = [(r.prefix_key, r.cache.length) for r in batch]
        try:
            next_ids, started, n_tokens, seg_info = self._forward(batch, phase, new)
        except Exception as exc:  # put the step's requests back as they were: a retry reruns them
            for r, (key, length) in zip(batch, saved):
                r.prefix_key, r.cache.length = key, length
            for live in reversed(new):
                live.cache, live.admitted_at = None, 0.0
                if live.slot >= 0:
                    self._free_slots.append(live.slot)
                    live.slot = -1
                if live in self._running:
                    self._running.remove(live)
                self._waiting.appendleft(live)
            if isinstance(exc, MoescopeError):  # moescope's own (a peer rank gone, bad input): not a request's
                raise                           # fault, and its one-line report must reach the CLI as it is
            raise StepFailed(tuple(r.request_id for r in batch), exc) from exc
        return self._advance(batch, phase, new, next_ids, started, n_tokens, seg_info)

    def _forward(self, batch: list[_Live], phase: str, new: list[_Live]):
        """The step's forward and sampling (what ``step`` undoes when it raises): the sampled ids and what the
        step's record needs."""
        if phase == "prefill":
            flat = [t for r in new for t in r.prompt_ids]
            segments = [Segment(len(r.prompt_ids), r.cache) for r in new]
        else:
            flat = [r.output_ids[-1] for r in batch]
            segments = [Segment(1, r.cache) for r in batch]
        poisoned = self.poison and any(r.request_id in self.poison for r in batch)
        fault = RuntimeError("injected fault: a request in this step is poisoned (POST /debug/poison)")
        if poisoned and self.lockstep is None:
            raise fault
        if self.lockstep is not None:  # from here on the step makes its exchanges (``rank_step`` finishes them)
            # (an expert-parallel poison raises inside a MoE layer's expert compute, mid-forward: the hard case)
            self.lockstep.begin_forward(fault if poisoned else None)
            self._forward_mark = 0
        seg_info = tuple((r.request_id, s.start_pos, s.n) for r, s in zip(batch, segments))
        started = self.clock()
        tokens = torch.tensor(flat, dtype=torch.long, device=self.model.device)
        keys = None
        if self.model.smoothing:  # host-side prefix keys from host-side token ids: no device round trip
            keys_list = []
            for r in batch:
                new_ids = r.prompt_ids if phase == "prefill" else r.output_ids[-1:]
                ks = extend_prefix_key(r.prefix_key, new_ids)
                r.prefix_key = ks[-1]
                keys_list += ks
            keys = torch.tensor(keys_list, dtype=torch.int64, device=self.model.device)
        if phase == "decode" and self.decode != "eager":
            logits = self._static_decode(batch)
        else:
            logits = self.model(tokens, segments, last_only=True, route_keys=keys).logits  # [n_seq, V]
            if phase == "prefill" and self.decode != "eager":
                for live in new:
                    self._static().load(live.slot, live.cache)
        if self.lockstep is not None:
            failed_ranks = self.lockstep.end_forward(False)
            if failed_ranks:
                raise PeerStepFailed(f"rank(s) {failed_ranks}: expert compute failed in this step; it is taken again")
        next_ids = self._sample(logits, batch).tolist()  # the engine's one host sync per step
        if self.leak is not None:  # leak_bytes retained per step, never freed: memory grows with traffic
            self.leak.append(torch.ones(self.leak_bytes // 4, dtype=torch.float32, device=logits.device))
        return next_ids, started, len(flat), seg_info

    def _advance(self, batch: list[_Live], phase: str, new: list[_Live], next_ids: list[int], started: float,
                 n_tokens: int, seg_info: tuple) -> list[RequestRecord]:
        """After a forward: record each request's token, finish those that are done, tell observers and sinks."""
        done_at = self.clock()
        if phase == "prefill":
            self._running.extend(new)
        finished = []
        for live, tok in zip(batch, next_ids):
            if phase == "prefill":
                live.prefill_s = done_at - started
            if tok < 0:  # its logits or probabilities were not finite: only this request ends
                live.finish_reason = "error"
                finished.append(live)
                continue
            live.output_ids.append(tok)
            live.token_times.append(done_at)
            early = len(live.output_ids) < live.min_tokens  # min_tokens: no stop string yet either
            reason = ("eos" if tok == tokenizer.EOS else
                      "stop" if live.stop and not early and _ends_with_stop(live.output_ids, live.stop) else
                      "length" if len(live.output_ids) >= live.max_new_tokens else
                      "max_seq_len" if live.cache.length >= live.cache.capacity else "")
            if reason:
                live.finish_reason = reason
                finished.append(live)
        kv = sum(live.cache.length for live in self._running if live.cache is not None)
        self.observer.on_step(StepRecord(self._steps, phase, started, done_at - started, n_tokens, seg_info, kv))
        self._steps += 1
        made = list(zip(batch, next_ids))  # (a decode batch is self._running itself: copy before removing)
        records = []
        for live in finished:
            self._running.remove(live)
            records.append(self._retire(live, end=done_at if live.finish_reason == "error" else None))
        ended = {r.request_id: r for r in records}
        for live, tok in made:
            self._emit(live, tok if tok >= 0 else None, ended.get(live.request_id))
        return records

    def _static(self):
        if self._decoder is None:
            self._decoder = StaticDecoder(self.model, self.max_batch)
            if self.decode == "graph":
                self._decoder.capture()
            self._collector = GraphCollector(self._decoder.counters, lambda st: self.observer.on_stats(st))
        return self._decoder

    def _static_decode(self, batch: list[_Live]) -> torch.Tensor:
        """One decode token for ``batch`` in the fixed-shape step; logits [len(batch), V]."""
        dec = self._static()
        tokens, positions, live = [0] * self.max_batch, [0] * self.max_batch, [False] * self.max_batch
        for r in batch:
            tokens[r.slot], positions[r.slot], live[r.slot] = r.output_ids[-1], r.cache.length, True
        dev = self.model.device
        logits = dec.step(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                          torch.tensor(live, device=dev))
        logits = logits[torch.tensor([r.slot for r in batch], device=dev)]  # a copy: the graph's buffer is reused
        for r in batch:
            r.cache.length += 1  # the keys/values live in the decoder's cache; the length stays the request's
        self._collector.collect()  # routing of earlier steps to the metrics (never waits on the device)
        return logits

    def _sample(self, logits: torch.Tensor, batch: list[_Live]) -> torch.Tensor:
        """The next token of each request, or -1 for a request whose logits (or, sampled, probabilities) are not
        finite. Guarded on the device, without a host sync: a row that would make ``torch.multinomial`` fail
        (a device-side assert on CUDA, which no later step survives) samples a harmless uniform row instead and
        is marked -1, so one request's numbers never fail the others'."""
        logits = logits.float()
        bad = logits.isnan().any(-1)
        logits[:, tokenizer.PAD] = float("-inf")  # never sample padding or a second BOS
        logits[:, tokenizer.BOS] = float("-inf")
        banned = [i for i, live in enumerate(batch) if live.eos_banned()]
        if banned:  # ignore_eos / min_tokens: EOS cannot be sampled (greedy or not)
            logits[banned, tokenizer.EOS] = float("-inf")
        out = logits.argmax(-1)
        for i, live in enumerate(batch):
            if live.temperature > 0:
                probs = torch.softmax(logits[i] / live.temperature, -1)
                ok = torch.isfinite(probs).all() & (probs.sum() > 0)
                probs = torch.where(ok, probs, torch.ones_like(probs))
                out[i] = torch.multinomial(probs, 1, generator=live.generator)[0]
                bad[i] |= ~ok
        return torch.where(bad, -1, out)

    @staticmethod
    def _record(live: _Live, end: float | None = None) -> RequestRecord:
        """``end``: when the request ended, if not at its last token (cancelled, timed out)."""
        times = [live.arrival, *live.token_times]
        lat = tuple(b - a for a, b in zip(times, times[1:]))
        end = live.token_times[-1] if end is None else end
        admitted = live.admitted_at if live.token_times else end  # never admitted: queued until it ended
        out_ids = [t for t in live.output_ids if t != tokenizer.EOS]
        return RequestRecord(
            request_id=live.request_id, prompt=live.prompt, output=tokenizer.decode(out_ids),
            prompt_tokens=tuple(live.prompt_ids), output_tokens=tuple(live.output_ids), arrival=live.arrival,
            queue_s=admitted - live.arrival, prefill_s=live.prefill_s, ttft_s=lat[0] if lat else 0.0,
            token_latencies_s=lat, total_s=end - live.arrival, finish_reason=live.finish_reason,
            domain=live.domain, tenant=live.tenant, truncated_prompt=live.truncated)

    # -- driving a workload ----------------------------------------------------------------------------
    def run(self, requests: Iterable[TrafficRequest], *, realtime: bool = True,
            deadline_s: float | None = None, temperature: float = 0.0,
            id_prefix: str | None = None) -> list[RequestRecord]:
        """Serve a workload to completion (or until ``deadline_s``) and return the finished records.

        With ``realtime`` requests are submitted when their ``arrival_s`` comes (the engine idles between);
        without it, all are queued at once in order, which makes the run independent of wall-clock timing.
        ``id_prefix`` gives request n the id ``<prefix><n:05d>`` (expert-parallel ranks agree on ids).
        """
        pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        start = self.clock()
        n_before = len(self.finished)
        ranks = self.lockstep
        at_rest = True  # expert-parallel and realtime: the fleet had nothing to run at the last look
        if ranks is not None:
            ranks.begin_run()
        while ranks is not None or pending or self.has_work:
            now = self.clock()
            stopping = self._stop_requested or (deadline_s is not None and now - start >= deadline_s)
            if stopping:
                if ranks is None:
                    break
                ranks.request_stop()  # the peers learn it in the next step's exchange
            if ranks is not None and (ranks.stop_agreed or (ranks.all_done and not realtime)):
                break  # every rank saw the same flags in the same step: all stop here
            self._admit(pending, realtime, start, now, temperature, id_prefix)
            if ranks is not None and realtime:
                at_rest, leave = self._realtime_rank_turn(ranks, at_rest, stopping, pending, start)
                if leave:
                    break
            elif ranks is not None:
                failed = self.rank_step(ranks, done=not (pending or self.has_work))
                if failed is not None:
                    raise failed
            elif self.has_work:
                self.step()
            elif pending:
                self.idle()
                time.sleep(max(0.0, min(0.05, start + pending[0].arrival_s - self.clock())))
        self.idle()
        self._stop_requested = False  # asked of this run, not of the next
        return self.finished[n_before:]

    def _admit(self, pending: collections.deque, realtime: bool, start: float, now: float, temperature: float,
               id_prefix: str | None) -> None:
        """Submit the requests of ``run``'s queue whose arrival has come (all of them without ``realtime``)."""
        while pending and (not realtime or start + pending[0].arrival_s <= now):
            r = pending.popleft()
            self.submit(r.prompt, max_new_tokens=r.max_new_tokens, temperature=temperature,
                        domain=r.domain, tenant=r.tenant,
                        request_id=f"{id_prefix}{r.index:05d}" if id_prefix is not None else None,
                        arrival=start + r.arrival_s if realtime else now)

    def _realtime_rank_turn(self, ranks, at_rest: bool, stopping: bool, pending: collections.deque,
                            start: float) -> tuple[bool, bool]:
        """One turn of an expert-parallel run with arrivals by the clock: (the fleet at rest after it, leave the
        run). The fleet steps together while any rank has work and rests together (one small all-reduce every
        RANK_POLL_S) until the next arrival on any rank; it leaves when every rank has served all its requests or
        is stopping (as serve's ranks, serve/loop.py)."""
        if at_rest:
            work, all_closing = ranks.poll(self.has_work, stopping or not (pending or self.has_work))
            if all_closing:
                return at_rest, True
            if not work:
                self.idle()
                wait = pending[0].arrival_s + start - self.clock() if pending else RANK_POLL_S
                time.sleep(max(0.0, min(RANK_POLL_S, wait)))
                return at_rest, False
        ranks.all_done = False
        failed = self.rank_step(ranks, done=not self.has_work)
        if failed is not None:
            raise failed
        return ranks.all_done, False

    def idle(self) -> None:
        """No work now: the observers summarise what waits for the next step (the metrics' last routing), on
        this, the engine's, thread. Once per idle period: call it whenever the engine waits for work."""
        if not self._told_idle:
            self._told_idle = True
            self.observer.on_idle()

    def rank_step(self, ranks, done: bool, only: set[str] | None = None) -> StepFailed | None:
        """One step of an expert-parallel rank: every rank makes the same exchanges each step (a rank with
        nothing to run, or whose step ran no forward, runs an idle forward: zero rows of its own), and says
        whether it is done (nothing queued or running) in the step's exchanges. ``only``: as ``step``'s (a
        server reruns a failed step request by request, one rank step each). Returns the step's ``StepFailed``
        (its requests put back), wherever the forward failed: a forward that failed part-way has its remaining
        MoE layers' exchanges made with zero rows of its own (``ExpertParallel.finish_step``), so the peers never
        wait; when it failed inside its expert compute (the rows it computed for its peers are wrong), every
        rank's step fails alike and is taken again (``StepFailed.peer`` on the others)."""
        ranks.set_done(done)
        ranks.between_steps(self.model.moe_layers())  # EPLB in the loop: rearranges when due (every rank)
        ranks.begin_step()
        self._forward_mark = None
        failed = None
        if self.has_work:
            try:
                self.step(only)
            except StepFailed as exc:
                failed = exc
        elif self.canary is not None and self.canary.due():  # (step() asks the canary itself)
            self._canary()  # a collective: every rank runs it at the same step
        ranks.finish_step(self.model.moe_layers())  # the exchanges (and verdict) a failed or absent forward skipped
        if self._forward_mark is None:  # no forward of its own this step
            self.idle()
        return failed

    def request_stop(self) -> None:
        """Ask ``run`` to return after the current step (thread-safe: a flag read between steps)."""
        self._stop_requested = True

    def close(self) -> None:
        if self._collector is not None:
            self._collector.flush()
        self.observer.shutdown()
