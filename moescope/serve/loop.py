"""The engine loop: one thread owns the model and steps continuously; handlers talk to it through bounded,
thread-safe structures and never touch the engine.

- ``Admission``: the waiting room, a bounded FIFO. ``offer`` answers False when it is full (the handler then
  answers 429). The loop moves jobs into the engine only while the engine has a free batch slot, so the
  engine's own queue stays empty and this bound is the real one.
- ``TokenStream``: one request's tokens, appended by the engine thread (the engine's per-request sink; a
  deque append, never a wait) and read by the request's handler on the asyncio thread. It holds at most
  ``max_tokens + 1`` items: bounded by the request. The loop wakes the asyncio side once per step for all
  streams that got a token (one ``call_soon_threadsafe``), not once per token.
- Cancellation (a client that went away, a server shutting down) is a request id on a deque; the loop applies
  it between steps with ``Engine.cancel``, which frees the slot and records the request as "cancelled". A job
  cancelled while still waiting here is submitted and cancelled at once, so it reaches the trace store too.

- Failures: a step that raises (``StepFailed``: the engine put its requests back) is rerun request by request;
  a request that fails alone ends as "error" (stored; its client gets 500), the others go on. After
  ``MAX_FAILED_TURNS`` turns in a row in which no request progressed, or when the thread itself dies (any
  exception outside a step, a ``BaseException``), the loop is unhealthy for good: what is queued or running
  ends as "error" and is answered, new requests are refused at once (503), ``/health`` answers 503 with why.
- Memory: records reach their handlers through the sinks; the engine's own list of finished records is
  emptied after every step (it would otherwise keep every request the server ever answered).

- Expert-parallel ranks (``ranks``: ``moescope serve --world-size N`` runs one loop per rank, each with its own
  requests): every rank must make the same exchanges at every step, so the loop steps through
  ``Engine.rank_step`` (an idle forward where the rank has nothing to run) while any rank has work. When a step
  began with every rank done, the fleet is at rest: each rank waits up to ``RANK_POLL_S`` for a request of its own,
  then all meet in one small all-reduce (``ExpertParallel.poll``: some rank has work? every rank closing?) and
  step, rest or leave together. A failed step's rerun request by request takes one fleet step per request. A
  step whose forward failed part-way still makes its remaining exchanges (zero rows of its own); one whose expert
  compute failed (its peers' rows are wrong) fails on every rank, and the peers take it again unblamed. A
  closing rank keeps stepping (idle) until every rank closes: no peer is left waiting in an exchange.

Continuous batching is the engine's: each ``step()`` prefills whatever was admitted since the last one, else
decodes one token for every running request, so a new request joins at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from moescope.runtime.engine import RANK_POLL_S, Engine, RequestRecord, StepFailed
from moescope.serve.protocol import Params

log = logging.getLogger("moescope.serve")

MAX_FAILED_TURNS = 3  # failed steps in a row (none of whose requests progressed) before the engine is unhealthy


class EngineKilled(BaseException):
    """Raised on the engine thread by ``EngineLoop.kill`` (``POST /debug/kill-engine``): a BaseException, so no
    handler for ordinary errors catches it and the thread dies as it would from a fatal error."""


class TokenStream:
    """Tokens of one request from the engine thread to its handler. ``record`` is set with the last token."""

    def __init__(self) -> None:
        self._items: collections.deque[int] = collections.deque()
        self.record: RequestRecord | None = None
        self.failed = False  # the engine lost the request (a failed step): no record will come
        self.pushed = 0  # tokens pushed so far (engine thread): what a wake-up saw, for the serving metrics
        self._event = asyncio.Event()

    def push(self, token: int | None, record: RequestRecord | None) -> None:
        """Engine thread: never blocks."""
        if token is not None:
            self._items.append(token)
            self.pushed += 1
        if record is not None:
            self.record = record

    @property
    def ended(self) -> bool:
        return self.record is not None or self.failed

    def wake(self) -> None:
        """Asyncio thread (scheduled by the loop after a step)."""
        self._event.set()

    async def next(self) -> tuple[list[int], RequestRecord | None]:
        """The tokens made since the last call (waits for at least one, or for the end) and, at the end, the
        record. Returns ([], record) once ended and drained."""
        while True:
            self._event.clear()  # before draining: a token pushed after the drain sets it again
            record = self.record  # read before draining: tokens pushed before the record are then drained too
            items = []
            while self._items:
                items.append(self._items.popleft())
            if items or record is not None or self.failed:
                return items, record
            await self._event.wait()

    async def done(self) -> RequestRecord | None:
        """Wait for the end; the record (None when the request failed)."""
        while not self.ended:
            await self.next()
        return self.record


@dataclass
class Job:
    request_id: str
    params: Params
    arrival: float  # time.perf_counter() when the handler got the request (the engine's clock)
    stream: TokenStream = field(default_factory=TokenStream)


class Admission:
    """A bounded FIFO of jobs between handlers and the engine loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._cond = threading.Condition()
        self.rejected = 0  # offers refused because it was full

    def offer(self, job: Job, free_slots: int = 0) -> bool:
        """Queue ``job`` unless full. ``free_slots``: batch slots the loop will fill at its next turn; jobs that
        will take them are not waiting, so they do not count against the bound."""
        with self._cond:
            if self.capacity and len(self._jobs) >= self.capacity + max(0, free_slots):  # capacity 0: unbounded
                self.rejected += 1
                return False
            self._jobs[job.request_id] = job
            self._cond.notify()
            return True

    def take(self, n: int) -> list[Job]:
        with self._cond:
            return [self._jobs.popitem(last=False)[1] for _ in range(min(n, len(self._jobs)))]

    def remove(self, job: Job) -> bool:
        with self._cond:
            if self._jobs.get(job.request_id) is not job:
                return False
            del self._jobs[job.request_id]
            return True

    def __len__(self) -> int:
        return len(self._jobs)

    def wait(self, timeout: float) -> None:
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout)

    def poke(self) -> None:
        with self._cond:
            self._cond.notify()


class EngineLoop:
    """Runs ``engine`` on its own thread.

    Args:
        engine: the engine (only this loop's thread touches it once ``start`` ran).
        max_queue: the admission bound (jobs waiting for a batch slot).
        request_timeout_s: per-request timeout from arrival (None: none); such requests end as "timeout".
        ranks: this rank's ``parallel.ExpertParallel`` when the engine is one expert-parallel rank of several.
    """

    def __init__(self, engine: Engine, *, max_queue: int, request_timeout_s: float | None = None,
                 ranks=None) -> None:
        self.engine = engine
        self.ranks = ranks
        self.admission = Admission(max_queue)
        self.request_timeout_s = request_timeout_s
        self._wake: Callable[[list[TokenStream]], None] = lambda streams: None
        self._ids: set[str] = set()  # queued or in the engine: an id is never served twice at once
        self._ids_lock = threading.Lock()
        self._cancels: collections.deque[Job] = collections.deque()
        self._live: dict[str, Job] = {}  # in the engine (engine thread only)
        self._touched: list[TokenStream] = []
        self._closing = threading.Event()
        self._drain_at: float | None = None  # time.monotonic() after which everything left is cancelled
        self._thread = threading.Thread(target=self._main, name="moescope-engine", daemon=True)
        self.step_errors = 0  # steps that raised (each then rerun request by request)
        self.failed_requests = 0  # requests a failed step was traced to (ended as "error")
        self.died: BaseException | None = None  # why the engine thread died (None: it did not)
        self.on_death: Callable[[BaseException], None] | None = None  # called on the dying engine thread, last
        self.peer_failed_steps = 0  # expert-parallel: steps undone and taken again because a peer's compute failed
        self.unhealthy: str | None = None  # why the engine cannot serve (sticky: restart the process)
        self._failed_turns = 0  # turns in a row whose step failed and no request progressed
        self._kill: str | None = None
        self.served = 0  # requests that ended, any reason (engine thread)
        self._mean_total_s = 1.0  # running mean of request time: the Retry-After estimate

    @property
    def running(self) -> int:
        return len(self._live)

    @property
    def alive(self) -> bool:
        """The engine thread runs (false before ``start`` and after it died or closed)."""
        return self._thread.is_alive()

    def kill(self, why: str = "killed through POST /debug/kill-engine") -> None:
        """Any thread: make the engine thread raise ``EngineKilled`` at its next turn (a debugging fault)."""
        self._kill = why
        self.admission.poke()

    def start(self, wake: Callable[[list[TokenStream]], None]) -> "EngineLoop":
        """Start the thread. ``wake`` is called on it after a step with the streams that got tokens; it must
        hand them to the handlers' thread without waiting (``asyncio_waker`` builds it)."""
        self._wake = wake
        self._thread.start()
        return self

    def holds(self, request_id: str) -> bool:
        """Any thread: whether a request with this id is queued or running."""
        with self._ids_lock:
            return request_id in self._ids

    def offer(self, job: Job) -> str:
        """Any thread: queue a job. Returns "ok", "full" (the admission queue is), "duplicate" (a request with
        this id is queued or running) or "unhealthy" (the engine cannot serve: ``unhealthy`` says why)."""
        with self._ids_lock:
            if self.unhealthy is not None:
                return "unhealthy"
            if job.request_id in self._ids:
                return "duplicate"
            if not self.admission.offer(job, self.engine.max_batch - len(self._live)):
                return "full"
            self._ids.add(job.request_id)
        return "ok"

    def cancel(self, job: Job) -> None:
        """Any thread: end the job's request (if it has not ended yet) at the loop's next turn. By job, not by
        id: a late cancel never reaches a newer request that reuses the id."""
        self._cancels.append(job)
        self.admission.poke()

    def drain(self, deadline_s: float) -> None:
        """Any thread (a signal handler too): requests still queued or running ``deadline_s`` from now are
        cancelled then (stored as "cancelled"; their clients get 503 or an error event)."""
        self._drain_at = time.monotonic() + deadline_s
        self.admission.poke()

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: about the time the queue ahead takes to clear."""
        batches = len(self.admission) / max(1, self.engine.max_batch) + 1
        return max(1, min(60, round(self._mean_total_s * batches)))

    # -- engine thread ---------------------------------------------------------------------------------
    def _sink(self, job: Job, token: int | None, record: RequestRecord | None) -> None:
        job.stream.push(token, record)
        self._touched.append(job.stream)
        if record is not None:
            self._forget(job)
            self.served += 1
            self._mean_total_s += 0.1 * (record.total_s - self._mean_total_s)

    def _forget(self, job: Job) -> None:
        self._live.pop(job.request_id, None)
        with self._ids_lock:
            self._ids.discard(job.request_id)

    def _fail(self, job: Job) -> None:
        self._forget(job)
        job.stream.failed = True
        self._touched.append(job.stream)

    def _submit(self, job: Job) -> None:
        p = job.params
        self._live[job.request_id] = job
        try:
            self.engine.submit(p.prompt, max_new_tokens=p.max_tokens, temperature=p.temperature,
                               request_id=job.request_id, tenant=p.tenant, arrival=job.arrival, seed=p.seed,
                               stop=p.stop, timeout_s=self.request_timeout_s, sink=partial(self._sink, job),
                               prompt_ids=p.prompt_ids, min_tokens=p.min_tokens, ignore_eos=p.ignore_eos)
        except Exception:  # validated before it was queued: a bug if it happens, but never a hung client
            log.exception("engine refused request %s", job.request_id)
            self._fail(job)

    def _apply_cancels(self) -> None:
        while self._cancels:
            job = self._cancels.popleft()
            if self.admission.remove(job):  # never reached the engine: record it there all the same
                self._submit(job)
            if self._live.get(job.request_id) is job:
                self.engine.cancel(job.request_id)

    def _flush(self) -> None:
        if self._touched:
            touched, self._touched = self._touched, []
            try:
                self._wake(touched)
            except Exception:  # the event loop is gone (shutdown): nothing is waiting any more
                log.debug("waking handlers failed", exc_info=True)

    def _main(self) -> None:
        """The thread: ``_run``, guarded. However it ends, every request still queued or running is answered."""
        try:
            self._run() if self.ranks is None else self._run_rank()
        except BaseException as exc:  # noqa: BLE001 (the thread is dying: say why, answer everyone)
            log.critical("the engine thread died (%r): /health answers 503, new requests 503", exc,
                         exc_info=not isinstance(exc, EngineKilled))
            self._set_unhealthy(f"the engine thread died: {exc!r}")
            try:
                self._cancel_all("error")
            except BaseException:  # noqa: BLE001 (the engine is broken: the clients still get an answer)
                log.exception("the engine could not end its requests; they are answered without a record")
            for job in [*self._live.values(), *self.admission.take(len(self.admission))]:
                self._fail(job)
            self._flush()
            self.died = exc
            if self.on_death is not None:
                self.on_death(exc)

    def _set_unhealthy(self, why: str) -> None:
        with self._ids_lock:  # no offer gets in after this
            if self.unhealthy is None:
                self.unhealthy = why

    def _run(self) -> None:
        engine = self.engine
        while True:
            if self._kill is not None:
                raise EngineKilled(self._kill)
            self._apply_cancels()
            if self._drain_at is not None and time.monotonic() >= self._drain_at:
                self._cancel_all()
            if self._closing.is_set():
                self._cancel_all()
                self._flush()
                return
            if self.unhealthy is not None:  # no more steps: answer what is left, then only wait to close
                self._cancel_all("error")
                self.admission.wait(0.05)
            else:
                for job in self.admission.take(engine.max_batch - len(self._live)):
                    self._submit(job)
                if engine.has_work:
                    try:
                        engine.step()
                        self._failed_turns = 0
                    except StepFailed as exc:
                        self._isolate(exc)
                else:
                    engine.idle()  # the metrics' last routing summarised here, not on a scrape
                    self.admission.wait(0.05)
            engine.finished.clear()  # the records went to the sinks: never keep every request served
            self._flush()

    def _housekeep(self, closing: bool) -> None:
        """Between steps: cancels, the drain deadline, admissions (or, closing or unhealthy, ending all)."""
        self._apply_cancels()
        if self._drain_at is not None and time.monotonic() >= self._drain_at:
            self._cancel_all()
        if closing or self.unhealthy is not None:
            self._cancel_all("cancelled" if closing else "error")
        else:
            for job in self.admission.take(self.engine.max_batch - len(self._live)):
                self._submit(job)

    def _run_rank(self) -> None:
        """``_run`` for one expert-parallel rank: the fleet steps, rests and leaves together (module doc)."""
        engine, ranks = self.engine, self.ranks
        at_rest = True  # the fleet had nothing to run at the last look: meet in ``poll`` before stepping
        suspects: collections.deque[str] = collections.deque()  # a failed step's requests, rerun one per step
        while True:
            if self._kill is not None:
                raise EngineKilled(self._kill)
            closing = self._closing.is_set()
            self._housekeep(closing)
            self._end_records()
            if at_rest:
                if not (engine.has_work or closing):
                    engine.idle()
                    self.admission.wait(RANK_POLL_S)
                    self._housekeep(self._closing.is_set())
                    self._end_records()
                work, all_closing = ranks.poll(engine.has_work, self._closing.is_set())
                if all_closing:
                    return
                if not work:
                    continue
                at_rest = False
            while suspects and not engine.holds(suspects[0]):
                suspects.popleft()  # ended meanwhile (cancelled, timed out)
            ranks.all_done = False
            if suspects:
                rid = suspects.popleft()
                failed = engine.rank_step(ranks, done=False, only={rid})
                if failed is None:
                    self._failed_turns = 0
                elif failed.peer:
                    self._peer_failed(failed)
                    suspects.appendleft(rid)  # not its fault: its rerun is taken again
                else:
                    self._fail_alone(rid, failed)
            else:
                failed = engine.rank_step(ranks, done=not engine.has_work)
                if failed is None:
                    self._failed_turns = 0
                elif failed.peer:
                    self._peer_failed(failed)
                else:
                    self.step_errors += 1
                    log.error("%s: rerunning its requests one at a time", failed, exc_info=failed.__cause__)
                    self._failed_turns += 1
                    suspects.extend(failed.request_ids)
                    if self._failed_turns >= MAX_FAILED_TURNS:
                        self._set_unhealthy(f"{self._failed_turns} engine steps in a row failed for every request "
                                            f"in them (last: {failed.__cause__!r})")
                        log.critical("engine unhealthy: %s", self.unhealthy)
            at_rest = ranks.all_done
            self._end_records()

    def _peer_failed(self, failed: StepFailed) -> None:
        """A peer rank's expert compute failed in this step: undone here too (requests put back), taken again."""
        self.peer_failed_steps += 1
        log.warning("%s: taken again", failed)

    def _end_records(self) -> None:
        self.engine.finished.clear()  # the records went to the sinks: never keep every request served
        self._flush()

    def _fail_alone(self, rid: str, alone: StepFailed) -> None:
        self.failed_requests += 1
        log.error("request %s fails the step alone (%r): it ends as 'error'", rid, alone.__cause__)
        job = self._live.get(rid)
        if self.engine.cancel(rid, reason="error") is None and job is not None:
            self._fail(job)

    def _isolate(self, failed: StepFailed) -> None:
        """Rerun a failed step's requests one at a time: one that fails alone ends as "error" (stored); the
        others take their step. A turn in which none progressed counts towards ``MAX_FAILED_TURNS``."""
        self.step_errors += 1
        log.error("%s: rerunning its requests one at a time", failed, exc_info=failed.__cause__)
        progressed = False
        for rid in failed.request_ids:
            try:
                self.engine.step(only={rid})
                progressed = True
            except StepFailed as alone:
                self._fail_alone(rid, alone)
        self._failed_turns = 0 if progressed else self._failed_turns + 1
        if self._failed_turns >= MAX_FAILED_TURNS:
            self._set_unhealthy(f"{self._failed_turns} engine steps in a row failed for every request in them "
                                f"(last: {failed.__cause__!r})")
            log.critical("engine unhealthy: %s", self.unhealthy)

    def _cancel_all(self, reason: str = "cancelled") -> None:
        for job in self.admission.take(len(self.admission)):
            self._submit(job)
        for rid in list(self._live):
            self.engine.cancel(rid, reason=reason)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel whatever is still queued or running (recorded as "cancelled") and stop the thread."""
        self._closing.set()
        self.admission.poke()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def asyncio_waker(loop: asyncio.AbstractEventLoop) -> Callable[[list[TokenStream]], None]:
    """The loop's ``wake`` for handlers on ``loop``: one ``call_soon_threadsafe`` per step."""

    def wake_all(streams: list[TokenStream]) -> None:
        for s in streams:
            s.wake()

    return lambda streams: loop.call_soon_threadsafe(wake_all, streams)


def now() -> float:
    """The engine's clock (``time.perf_counter``): job arrival times are taken on it."""
    return time.perf_counter()
