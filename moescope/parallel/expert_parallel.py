"""Expert parallelism with data-parallel attention (DP attention), as wide-EP serving runs DeepSeek-V3-class
models (SGLang, vLLM, TensorRT-LLM over DeepEP): each rank serves its own requests (its own attention, its
own KV caches, its own router decisions) and each MoE layer's experts are sharded over the ranks by a
``Placement``; per MoE layer the rank's tokens travel to their experts' owners and back through two
``torch.distributed.all_to_all_single`` exchanges with variable splits.

Per MoE layer, on every rank:
1. the rank sorts its tokens' slots by (destination rank, expert);
2. **dispatch**: a small all-to-all of per-peer slot counts plus the rank's entry timestamp (which gives the
   per-peer wait matrix for free) and its stop and done flags, then the rows and their expert ids;
3. each rank computes its local experts on the rows it received, one group per (source rank, expert): each
   source's rows arrive contiguous and already sorted by expert, so every expert sees exactly the rows, in
   exactly the order, that the single-process model running that source's requests gives it, and the
   outputs are bit-identical to it (a production kernel batches an expert's rows over all sources instead:
   the same numbers up to float summation order; so does this one under the expert cache, whose lookups count
   once per expert per forward);
4. **combine**: the results go back through the reverse all-to-all; each rank weights and sums its tokens'
   slots in slot order.
``world_size == 1`` never gets here: the model computes its experts locally (the identity path).

Every rank must enter the same exchanges: a rank with no work this step runs an **idle forward**
(``idle_forward``: the exchanges of every MoE layer with zero rows of its own, as production DP attention runs
dummy batches), so its experts still compute what its peers send. Ranks given the same requests compute the
same tokens: that is the old lock-step mode (data replicated), which needs nothing of its own.

A step that fails part-way (``Engine.rank_step``): the rank makes the exchanges its forward did not, with zero
rows of its own (``finish_step``); an expert compute that raises sends zeros back in its combine and is raised
after it. Every rank's step ends in one all-reduce of W flags (``end_forward``: whose expert compute failed): rows
a failed compute returned are wrong, so every rank undoes that step and takes it again, and only the failing
rank's requests are rerun one by one and blamed. Nobody is left waiting in an exchange.

Stopping: the ranks must leave after the same step. Each dispatch exchange carries two flags: *stop* (the
rank's deadline passed; any rank's flag stops all) and *done* (the rank had nothing queued or running when the
step began; all ranks' flags end the run). Every rank receives every flag of that exchange, so after that step
all agree (``stop_agreed``, ``all_done``) and all stop before the next one; the flags ride on the exchange the
step makes anyway: no extra collective.

Per-peer wait: rank i's wait on peer p in one exchange is max(0, entry_p - entry_i), from the entry
timestamps exchanged in step 2 (wall clock: exact on one machine, NTP-accurate across machines). A slow
rank shows up as the peer everyone waits on (DeepEP's N x N view).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moescope import stats
from moescope.errors import MoescopeError
from moescope.parallel.eplb import Rebalance
from moescope.parallel.placement import Placement
from moescope.parallel.planner import plan_or_keep
from moescope.runtime.experts import Experts, combine


EVENTS_KEPT = 256  # the last rearrangements kept for the summary (one placement each): bounded for days


class ParallelError(MoescopeError):
    """A peer rank died, hung past the timeout, or disagreed; the message names it."""

    exit_code = 1


@dataclass(frozen=True)
class AllToAllRecord:
    """One exchange of one MoE layer on this rank (sent to observers as ``on_all_to_all``)."""

    layer: int
    op: str  # "dispatch" or "combine"
    seconds: float
    sent_bytes: tuple[int, ...]  # per peer
    recv_bytes: tuple[int, ...]
    peer_wait_s: tuple[float, ...]  # per peer (dispatch only; zeros for combine)
    # dispatch only: rows this rank's experts (physical: its replicas included) computed, per expert of the layer
    # (-1: an expert this rank does not hold)
    expert_rows: tuple[int, ...] = ()
    # dispatch only: rows every rank computes in this exchange (from the split sizes every rank receives: the same
    # on every rank): the measured per-rank load
    rank_rows: tuple[int, ...] = ()
    # the rank step it was made in (``ExpertParallel.steps``: the same count on every rank), for per-step loads
    step: int = -1


class ExpertParallel:
    """The per-layer dispatcher ``MoELayer`` calls when the model runs expert-parallel.

    Args:
        placement: which rank computes which experts.
        rank, world_size: this process's place in the default process group.
        observer: callable returning the model's current observer (for ``on_all_to_all``).
        slow_delay_s: a fault: sleep this long before every dispatch (``--slow-rank`` on this rank).
        monitor: names the ranks behind when a collective fails (``RankMonitor``).
    """

    def __init__(self, placement: Placement, rank: int, world_size: int, *, observer=None,
                 slow_delay_s: float = 0.0, monitor=None, comm_device="cpu") -> None:
        self.placement, self.rank, self.world = placement, rank, world_size
        # Where the backend takes its tensors (gloo: host memory; NCCL: this rank's GPU). A tensor elsewhere is
        # staged there and back around each collective (CUDA ranks sharing one GPU exchange through gloo).
        self.comm_device = torch.device(comm_device)
        self.backend = "gloo" if self.comm_device.type == "cpu" else "nccl"
        self.observer = observer
        self.slow_delay_s = slow_delay_s
        self.monitor = monitor
        self._owner: dict[int, torch.Tensor] = {}
        self._stop_wanted = False  # this rank's flags, sent in every dispatch exchange
        self._done = False
        self.stop_agreed = False  # some rank's stop flag came in: every rank knows it after the same step
        self.all_done = False  # every rank's done flag came in the same exchange
        self.dispatches = 0  # dispatch exchanges made
        self.combines = 0  # MoE layers whose exchanges were all made (dispatch and combine)
        self._forward_at: int | None = None  # ``combines`` when this step's engine forward began (None: none began)
        self._verdict: list[int] | None = None  # this step's ranks whose expert compute failed (None: not met yet)
        self._compute_failed = False  # this rank's expert compute failed in this step
        self._fault: BaseException | None = None  # the poison fault: raise in the expert compute of this step
        self.rebalancer = None  # parallel.eplb.Rebalancer: EPLB in the loop
        self.steps = 0  # rank steps begun (``between_steps``): the same count on every rank
        self.events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)  # parallel.eplb.Rebalance, in order
        self._dealt: dict[int, torch.Tensor] = {}  # layer -> slots of each expert this rank has dealt to replicas
        self._rows_since: dict[int, list[int]] = {}  # layer -> rows each rank computed since the last rearrangement
        self.rows_run: dict[int, list[int]] = {}  # layer -> rows each rank computed, the whole run (never reset)
        # From this step on (``steps`` >= it; rearranging at it comes first) the rows also go to ``rows_from``: the
        # same steps measured whether or not the ranks rearrange (the demo sets it to --rebalance-steps)
        self.measure_from: int | None = None
        self.rows_from: dict[int, list[int]] = {}
        self._routed: dict[int, torch.Tensor] = {}  # layer -> this rank's slots per logical expert, same period
        self._history: collections.deque = collections.deque()  # the fleet's [L, E] counts of the last windows

    def begin_run(self) -> None:
        """Forget the last run's agreement (a new ``Engine.run`` starts)."""
        self._stop_wanted = self._done = self.stop_agreed = self.all_done = False

    def request_stop(self) -> None:
        """Ask the peers to stop: sent with the next dispatch exchange (call between steps only, so every
        exchange of one step carries the same flag)."""
        self._stop_wanted = True

    def set_done(self, done: bool) -> None:
        """Whether this rank has nothing queued or running (between steps only, as ``request_stop``)."""
        self._done = done

    def poll(self, has_work: bool, closing: bool) -> tuple[bool, bool]:
        """A serving fleet at rest: one small all-reduce instead of a step's exchanges. Returns (some rank has work,
        every rank is closing): the same answer on every rank, so all step, wait or leave together."""
        flags = torch.tensor([float(has_work), float(closing)], dtype=torch.float64)
        self._collective(dist.all_reduce, flags)
        return bool(flags[0] > 0), bool(flags[1] >= self.world)

    def begin_step(self) -> None:
        """Before a rank step (``Engine.rank_step``): no forward begun, no verdict yet."""
        self._forward_at, self._verdict, self._compute_failed, self._fault = None, None, False, None

    def begin_forward(self, fault: BaseException | None = None) -> None:
        """The engine's forward for this step begins (``fault``: the poison; raised inside the expert compute of
        the middle MoE layer, after the exchanges of the layers before it: a forward failing part-way)."""
        self._forward_at, self._fault = self.combines, fault

    def end_forward(self, failed: bool) -> list[int]:
        """The step's verdict, one all-reduce of W flags at the end of every rank's forward (real or idle): the
        ranks whose expert compute failed this step (``failed``: this one's). Rows those ranks computed for their
        peers are wrong: every rank undoes the step (the engine raises ``PeerStepFailed``) and takes it again."""
        flags = torch.zeros(self.world, dtype=torch.float64)
        flags[self.rank] = float(failed)
        self._collective(dist.all_reduce, flags)
        self._verdict = [r for r, f in enumerate(flags.tolist()) if f]
        return self._verdict

    def finish_step(self, moe_layers) -> None:
        """After a rank step: make the exchanges its forward did not (none began: all of them; one failed after
        ``k`` MoE layers: layers k+1.. with zero rows of this rank's own, its experts still computing what the
        peers send), then meet the peers in the step's verdict (``end_forward``) unless the forward already did."""
        if self._verdict is not None:
            return
        done = 0 if self._forward_at is None else self.combines - self._forward_at
        self._fault = None
        for m in list(moe_layers)[done:]:
            try:
                self.idle_forward([m])
            except ParallelError:
                raise
            except Exception:  # noqa: BLE001 (its expert compute failed after the combine: the verdict says so)
                pass
        self.end_forward(self._compute_failed)

    def _owners(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(owner rank of each expert, index E the dropped-slot sentinel -1; for a placement with replicas also
        [E, R] the replica ranks of each expert (repeated to R columns) and [E] how many it has)."""
        t = self._owner.get(layer)
        if t is None:
            owner = torch.tensor(self.placement.owner_table(layer, self.rank), device=device)
            reps = nrep = None
            if self.placement.replicated:
                ranks = [self.placement.ranks_of(layer, e) for e in range(self.placement.n_experts)]
                width = max(len(r) for r in ranks)
                reps = torch.tensor([[r[i % len(r)] for i in range(width)] for r in ranks], device=device)
                nrep = torch.tensor([len(r) for r in ranks], device=device)
            t = self._owner[layer] = (owner, reps, nrep)
        return t

    def _held(self, layer: int, n_exp: int) -> list[int]:
        """[E]: 0 for the experts this rank holds in ``layer``, -1 for the others."""
        held = set(self.placement.layers[layer][self.rank])
        return [0 if e in held else -1 for e in range(n_exp)]

    def _destinations(self, layer: int, my_ids: torch.Tensor, n_exp: int) -> torch.Tensor:
        """Destination rank of each slot (-1: dropped). A replicated expert's slots are dealt over its replicas
        in turn, continuing across forwards: the j-th slot of the expert this rank has routed since it started
        goes to replica (j + rank) mod R, so a decode step's one slot per expert does not always land on the
        same replica: split evenly, whichever rank routed them. The running count stays on the device."""
        owner, reps, nrep = self._owners(layer, my_ids.device)
        dest = owner[my_ids]
        if reps is None or not len(my_ids):
            return dest
        ok = my_ids < n_exp
        ids = torch.where(ok, my_ids, 0)
        by_expert = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=n_exp)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(ids)
        pos[by_expert] = torch.arange(len(ids), device=ids.device) - starts[ids[by_expert]]
        dealt = self._dealt.get(layer)
        if dealt is None:
            dealt = self._dealt[layer] = torch.zeros(n_exp, dtype=torch.long, device=ids.device)
        out = torch.where(ok, reps[ids, (pos + dealt[ids] + self.rank) % nrep[ids]], dest)
        dealt.index_add_(0, ids, ok.long())  # (no boolean indexing: no host sync on CUDA)
        return out

    def __call__(self, layer: int, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        return self._forward(layer, experts, x, ids, weights)

    @torch.inference_mode()
    def idle_forward(self, moe_layers) -> None:
        """This rank's part of a step it has no tokens for: every MoE layer's exchanges with zero rows sent,
        its experts computing what the peers send (``moe_layers``: the model's, in forward order)."""
        for m in moe_layers:
            p = m.experts.gate_up_proj
            x = torch.empty(0, p.shape[-1], dtype=p.dtype, device=p.device)
            self._forward(m.layer_index, m.experts, x, torch.empty(0, 1, dtype=torch.long, device=p.device),
                          torch.empty(0, 1, dtype=p.dtype, device=p.device))

    @staticmethod
    def max_over_mean(rows: dict[int, list[int]]) -> dict[int, float]:
        """Per layer: the busiest rank's rows over the mean rank's (``stats``; layers with no rows left out)."""
        layers = sorted(rows)
        ratios = stats.max_over_mean_rows(np.array([rows[layer] for layer in layers], dtype=np.float64)) \
            if layers else np.zeros(0)
        return {layer: float(v) for layer, v in zip(layers, ratios.tolist()) if np.isfinite(v)}

    def measured_since(self) -> dict[int, float]:
        """Per layer: the busiest rank's rows over the mean rank's since the last rearrangement (or the start)."""
        return self.max_over_mean(self._rows_since)

    def rows_since(self) -> dict[int, list[int]]:
        """Per layer: rows each rank computed since the last rearrangement (or the start)."""
        return {layer: list(r) for layer, r in sorted(self._rows_since.items())}

    def between_steps(self, moe_layers) -> None:
        """Called by the engine before each rank step (every rank, the same step): rearranges when due."""
        self.steps += 1
        rb = self.rebalancer
        if rb is not None and self.steps % rb.every_steps == 0:
            self.rebalance(moe_layers)

    @torch.inference_mode()
    def rebalance(self, moe_layers) -> None:
        """Plan a placement from the fleet's counts of the last ``horizon`` windows and move the weights of the
        layers whose plan gains more than ``min_gain`` (``parallel.eplb``)."""
        start = time.perf_counter()
        rb, old = self.rebalancer, self.placement
        layers = [m.layer_index for m in moe_layers]
        self._history_append(self._fleet_counts(layers, moe_layers[0].experts.gate_up_proj.device), rb.horizon)
        before, before_rows = self.measured_since(), self.rows_since()
        if rb.below is not None and before and min(1 / v for v in before.values()) >= rb.below:
            return  # balanced enough: keep measuring from here
        load = sum(self._history).cpu().numpy()  # the last ``horizon`` windows' counts: one window is a sample
        if not load.sum():
            return
        new_layers, predicted, kept = self._plan(load, layers)
        moved, moved_bytes = self._move_weights(moe_layers, new_layers)
        n_exp = old.n_experts
        replicated = any(sum(len(x) for x in per) > n_exp for per in new_layers.values())
        self.placement = Placement(self.world, n_exp, new_layers, replicated)
        self._owner.clear()
        self._rows_since.clear()
        event = Rebalance(self.steps, time.perf_counter() - start, moved, moved_bytes, before, predicted,
                          new_layers, before_rows, kept)
        self.events.append(event)
        on_rebalance = getattr(self.observer(), "on_rebalance", None) if self.observer is not None else None
        if on_rebalance is not None:  # a RuntimeObserver's event (capture.observer)
            on_rebalance(event)

    def _fleet_counts(self, layers: list[int], device) -> torch.Tensor:
        """[L, E] the fleet's slots per logical expert since the last rearrangement (one all-reduce: every rank
        plans the same placement); this rank's own counts start again."""
        n_exp = self.placement.n_experts
        counts = torch.stack([self._routed.get(layer, torch.zeros(n_exp, dtype=torch.long, device=device)).double()
                              for layer in layers])  # [L, E]
        self._collective(dist.all_reduce, counts)
        self._routed.clear()
        return counts

    def _history_append(self, counts: torch.Tensor, horizon: int) -> None:
        """Keep the last ``horizon`` windows' counts (kept whether or not the ranks rearrange now)."""
        if self._history.maxlen != horizon:
            self._history = collections.deque(self._history, maxlen=horizon)
        self._history.append(counts)

    def _plan(self, load: np.ndarray, layers: list[int]) -> tuple[dict, dict, int]:
        """(new placement per layer, its predicted busiest / mean rank on ``load`` [L, E], layers kept): a layer keeps
        its placement unless the plan gains more than ``min_gain`` on the same counts."""
        rb, old = self.rebalancer, self.placement
        slots = rb.slots or max(len(x) for per in old.layers.values() for x in per)
        new_layers, predicted, kept = {}, {}, 0
        for i, layer in enumerate(layers):
            per, predicted[layer], keep = plan_or_keep(load[i], self.world, slots, old.layers[layer], rb.min_gain)
            new_layers[layer] = tuple(x for x in old.layers[layer]) if keep else tuple(tuple(x) for x in per)
            kept += keep
        return new_layers, predicted, kept

    def _move_weights(self, moe_layers, new_layers: dict) -> tuple[int, int]:
        """Send each expert placed on a rank that did not hold it from its lowest previous holder
        (``batch_isend_irecv``) and copy it into the receiver's expert tensors. Returns (copies placed, bytes this
        rank received)."""
        old = self.placement
        ops, received = [], []
        moved = 0
        for m in moe_layers:
            layer = m.layer_index
            params = (m.experts.gate_up_proj, m.experts.down_proj)
            for r in range(self.world):
                for e in new_layers[layer][r]:
                    if e in old.layers[layer][r]:
                        continue
                    moved += 1
                    src = min(old.ranks_of(layer, e))
                    if self.rank == src:
                        ops += [dist.P2POp(dist.isend, self._on_comm(p[e].contiguous()), r) for p in params]
                    elif self.rank == r:
                        bufs = [torch.empty_like(p[e], device=self.comm_device) for p in params]
                        ops += [dist.P2POp(dist.irecv, b, src) for b in bufs]
                        received.append((params, e, bufs))
        if ops:
            try:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            except RuntimeError as exc:
                if self.monitor is None:
                    raise
                raise self.monitor.explain(exc) from None
        moved_bytes = 0
        for params, e, bufs in received:
            for p, b in zip(params, bufs):
                p.data[e].copy_(b)
                moved_bytes += b.numel() * b.element_size()
        return moved, moved_bytes

    def _on_comm(self, t):
        """``t`` where the backend takes it (itself when it is there already)."""
        return t.to(self.comm_device) if isinstance(t, torch.Tensor) and t.device != self.comm_device else t

    def _collective(self, fn, *args) -> None:
        """Run one collective whose first argument is its output (all_to_all_single's, all_reduce's in place),
        staged through ``comm_device`` when it lives elsewhere; a failure (peer gone, timeout) becomes a
        ParallelError naming the rank."""
        staged = [self._on_comm(a) for a in args]
        try:
            fn(*staged)
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            if self.monitor is None:
                raise
            raise self.monitor.explain(exc) from None
        if staged[0] is not args[0]:
            args[0].copy_(staged[0])

    def _forward(self, layer, experts, x, ids, weights):
        n_tokens, k = ids.shape
        hidden = x.shape[1]
        n_exp = experts.n_experts
        w = self.world
        my_ids = ids.reshape(-1)  # [T*k] slot order
        dest = self._destinations(layer, my_ids, n_exp)  # -1 for dropped slots
        key = torch.where(dest >= 0, dest * (n_exp + 1) + my_ids, torch.full_like(my_ids, w * (n_exp + 1)))
        order = torch.argsort(key, stable=True)
        send_counts = torch.bincount(dest[dest >= 0], minlength=w)
        n_send = int(send_counts.sum())  # host values: split sizes of the exchange, once per layer
        order = order[:n_send]
        send_rows = x[order // k]  # [n_send, H]
        send_ids = my_ids[order]

        # -- dispatch -----------------------------------------------------------------------------------
        if self.slow_delay_s:
            time.sleep(self.slow_delay_s)  # the slow-rank fault: this rank joins the exchange late
        start = time.perf_counter()
        meta_out = torch.cat([send_counts.double().cpu(), torch.tensor(
            [time.time(), float(self._stop_wanted), float(self._done)], dtype=torch.float64)])
        meta_out = meta_out.repeat(w)  # [W * (W + 3)]: counts, timestamp, stop and done flags to every peer
        meta_in = torch.empty_like(meta_out)
        self._collective(dist.all_to_all_single, meta_in, meta_out)
        meta_in = meta_in.view(w, w + 3)
        recv_counts = meta_in[:, self.rank].long().tolist()  # what each peer sends me
        rank_rows = meta_in[:, :w].sum(0).long().tolist()  # what every rank computes (the W x W split matrix)
        spans = [self._rows_since, self.rows_run]
        if self.measure_from is not None and self.steps >= self.measure_from:
            spans.append(self.rows_from)
        for span in spans:
            span[layer] = [a + b for a, b in zip(span.get(layer, [0] * w), rank_rows)]
        if self.rebalancer is not None and len(my_ids):  # (on the device: no sync)
            got = torch.bincount(my_ids, minlength=n_exp + 1)[:n_exp]
            self._routed[layer] = got if layer not in self._routed else self._routed[layer] + got
        entry = meta_in[:, w].tolist()  # each peer's entry time
        if bool(meta_in[:, w + 1].any()):
            self.stop_agreed = True
        if bool(meta_in[:, w + 2].all()):
            self.all_done = True
        self.dispatches += 1
        sends = send_counts.tolist()
        recv_rows = torch.empty(sum(recv_counts), hidden, dtype=x.dtype, device=x.device)
        self._collective(dist.all_to_all_single, recv_rows, send_rows.contiguous(), recv_counts, sends)
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.long, device=x.device)
        self._collective(dist.all_to_all_single, recv_ids, send_ids.contiguous(), recv_counts, sends)
        dispatch_s = time.perf_counter() - start
        me = entry[self.rank]
        wait = tuple(max(0.0, e - me) if p != self.rank else 0.0 for p, e in enumerate(entry))

        # -- local experts: one group per (source rank, expert); each source's rows come sorted by expert ---
        # A failure here must not leave the peers waiting in the combine: it sends zeros back, the step's
        # verdict (``end_forward``) fails the step on every rank, and the error is raised after the combine.
        failure = None
        try:
            local, rows = self._compute(layer, experts, recv_rows, recv_ids, recv_counts, n_exp)
        except Exception as exc:  # noqa: BLE001 (re-raised below, once the peers have their combine)
            failure, self._compute_failed = exc, True
            local, rows = torch.zeros_like(recv_rows), self._held(layer, n_exp)

        # -- combine ------------------------------------------------------------------------------------
        start = time.perf_counter()
        back = torch.empty(n_send, hidden, dtype=x.dtype, device=x.device)
        self._collective(dist.all_to_all_single, back, local, sends, recv_counts)
        slot_out = torch.zeros(n_tokens * k, hidden, dtype=x.dtype, device=x.device)
        slot_out[order] = back
        out = combine(slot_out, weights)  # [T, H]
        combine_s = time.perf_counter() - start

        on_all_to_all = getattr(self.observer(), "on_all_to_all", None) if self.observer is not None else None
        if on_all_to_all is not None:  # a RuntimeObserver's event (capture.observer)
            row_bytes = hidden * x.element_size() + 8  # a row and its expert id
            on_all_to_all(AllToAllRecord(layer, "dispatch", dispatch_s, tuple(n * row_bytes for n in sends),
                                         tuple(n * row_bytes for n in recv_counts), wait, tuple(rows),
                                         tuple(rank_rows), self.steps))
            on_all_to_all(AllToAllRecord(layer, "combine", combine_s,
                                         tuple(n * hidden * x.element_size() for n in recv_counts),
                                         tuple(n * hidden * x.element_size() for n in sends),
                                         (0.0,) * w, step=self.steps))
        self.combines += 1
        if failure is not None:
            raise failure
        return out

    def _compute(self, layer, experts, recv_rows, recv_ids, recv_counts, n_exp):
        """This rank's experts on the rows it received: (the outputs, rows each expert here computed)."""
        if self._fault is not None and layer == sorted(self.placement.layers)[len(self.placement.layers) // 2]:
            fault, self._fault = self._fault, None
            raise fault
        local = torch.empty_like(recv_rows)
        rows = self._held(layer, n_exp)  # physical load: rows each expert here computed (-1: not held here)
        if experts.weight_source is not None:  # the expert cache: one lookup per expert per forward, all sources
            by_expert = torch.argsort(recv_ids, stable=True)
            counts = torch.bincount(recv_ids, minlength=n_exp).tolist()
            if len(recv_ids):
                local[by_expert] = experts.compute_grouped(recv_rows[by_expert], counts)
            rows = [a + b if a >= 0 else a for a, b in zip(rows, counts)]
        else:
            at = 0
            for n in recv_counts:
                if n:
                    counts = torch.bincount(recv_ids[at:at + n], minlength=n_exp).tolist()
                    local[at:at + n] = experts.compute_grouped(recv_rows[at:at + n], counts)
                    rows = [a + b if a >= 0 else a for a, b in zip(rows, counts)]
                at += n
        return local, rows
