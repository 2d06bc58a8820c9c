"""Expert parallelism: every rank runs the same requests in lock-step (data replicated), each MoE layer's
experts are sharded over the ranks by a ``Placement``, and tokens travel to their experts and back through
two ``torch.distributed.all_to_all_single`` exchanges per layer.

Per MoE layer, on every rank (the routing decision is identical everywhere: same inputs, same weights):
1. the rank owns a contiguous chunk of the step's tokens; it sorts its slots by (destination rank, expert);
2. **dispatch**: a small all-to-all of per-peer slot counts plus the rank's entry timestamp (which gives the
   per-peer wait matrix for free) and its stop flag, then the rows and their expert ids;
3. each rank computes its local experts on the rows it received, grouped by expert (a stable sort keeps
   the source-rank and token order, so every expert sees exactly the rows, in exactly the order, that the
   single-process model gives it: outputs are bit-identical);
4. **combine**: the results go back through the reverse all-to-all; each rank weights and sums its tokens'
   slots in slot order, and an all-gather rebuilds the step's [T, H] output on every rank.
``world_size == 1`` never gets here: the model computes its experts locally (the identity path).

Stopping: ranks serve in lock-step, so they must leave at the same step; no per-rank clock can promise
that (one rank past its deadline leaves while another enters one more collective step). A rank that wants
to stop (its deadline passed) says so in the stop flag of its next dispatch exchange; every rank receives
every flag of that exchange, so after that step all agree (``stop_agreed``) and all stop before the next one.
The flag rides on the exchange the step makes anyway: no extra collective.

Per-peer wait: rank i's wait on peer p in one exchange is max(0, entry_p - entry_i), from the entry
timestamps exchanged in step 2 (wall clock: exact on one machine, NTP-accurate across machines). A slow
rank shows up as the peer everyone waits on (DeepEP's N x N view).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moescope.errors import MoescopeError
from moescope.parallel.placement import Placement
from moescope.runtime.experts import Experts, combine


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
                 slow_delay_s: float = 0.0, monitor=None) -> None:
        self.placement, self.rank, self.world = placement, rank, world_size
        self.observer = observer
        self.slow_delay_s = slow_delay_s
        self.monitor = monitor
        self._owner: dict[int, torch.Tensor] = {}
        self._stop_wanted = False  # this rank's flag, sent in every dispatch exchange
        self.stop_agreed = False  # some rank's flag came in: every rank knows it after the same step

    def request_stop(self) -> None:
        """Ask the peers to stop: sent with the next dispatch exchange (call between steps only, so every
        exchange of one step carries the same flag)."""
        self._stop_wanted = True

    def _owners(self, layer: int, device) -> torch.Tensor:
        t = self._owner.get(layer)
        if t is None:
            t = self._owner[layer] = torch.tensor(self.placement.owner_table(layer, self.rank), device=device)
        return t

    def _chunk(self, n_tokens: int) -> tuple[int, int]:
        per, extra = divmod(n_tokens, self.world)
        start = self.rank * per + min(self.rank, extra)
        return start, start + per + (self.rank < extra)

    def __call__(self, layer: int, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        return self._forward(layer, experts, x, ids, weights)

    def _collective(self, fn, *args) -> None:
        """Run one collective; a failure (peer gone, timeout) becomes a ParallelError naming the rank."""
        try:
            fn(*args)
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            if self.monitor is None:
                raise
            raise self.monitor.explain(exc) from None

    def _forward(self, layer, experts, x, ids, weights):
        n_tokens, k = ids.shape
        hidden = x.shape[1]
        n_exp = experts.n_experts
        t0, t1 = self._chunk(n_tokens)
        my_ids = ids[t0:t1].reshape(-1)  # [n_my*k] slot order
        dest = self._owners(layer, ids.device)[my_ids]  # -1 for dropped slots
        key = torch.where(dest >= 0, dest * (n_exp + 1) + my_ids, torch.full_like(my_ids, self.world * (n_exp + 1)))
        order = torch.argsort(key, stable=True)
        send_counts = torch.bincount(dest[dest >= 0], minlength=self.world)
        n_send = int(send_counts.sum())  # host values: split sizes of the exchange, once per layer
        order = order[:n_send]
        send_rows = x[t0 + order // k]  # [n_send, H]
        send_ids = my_ids[order]

        # -- dispatch -----------------------------------------------------------------------------------
        if self.slow_delay_s:
            time.sleep(self.slow_delay_s)  # the slow-rank fault: this rank joins the exchange late
        start = time.perf_counter()
        meta_out = torch.cat([send_counts.double(),
                              torch.tensor([time.time(), float(self._stop_wanted)], dtype=torch.float64)])
        meta_out = meta_out.repeat(self.world)  # [W * (W + 2)]: counts, timestamp, stop flag to every peer
        meta_in = torch.empty_like(meta_out)
        self._collective(dist.all_to_all_single, meta_in, meta_out)
        meta_in = meta_in.view(self.world, self.world + 2)
        recv_counts = meta_in[:, self.rank].long().tolist()  # what each peer sends me
        entry = meta_in[:, self.world].tolist()  # each peer's entry time
        if bool(meta_in[:, self.world + 1].any()):
            self.stop_agreed = True
        sends = send_counts.tolist()
        recv_rows = torch.empty(sum(recv_counts), hidden, dtype=x.dtype, device=x.device)
        self._collective(dist.all_to_all_single, recv_rows, send_rows.contiguous(), recv_counts, sends)
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.long, device=x.device)
        self._collective(dist.all_to_all_single, recv_ids, send_ids.contiguous(), recv_counts, sends)
        dispatch_s = time.perf_counter() - start
        me = entry[self.rank]
        wait = tuple(max(0.0, e - me) if p != self.rank else 0.0 for p, e in enumerate(entry))

        # -- local experts ------------------------------------------------------------------------------
        by_expert = torch.argsort(recv_ids, stable=True)  # keeps source-rank, then token, order per expert
        counts = torch.bincount(recv_ids, minlength=n_exp).tolist()
        local = torch.empty_like(recv_rows)
        local[by_expert] = experts.compute_grouped(recv_rows[by_expert], counts)

        # -- combine ------------------------------------------------------------------------------------
        start = time.perf_counter()
        back = torch.empty(n_send, hidden, dtype=x.dtype, device=x.device)
        self._collective(dist.all_to_all_single, back, local, sends, recv_counts)
        slot_out = torch.zeros((t1 - t0) * k, hidden, dtype=x.dtype, device=x.device)
        slot_out[order] = back
        mine = combine(slot_out, weights[t0:t1])  # [n_my, H]
        per = -(-n_tokens // self.world)  # all_gather needs equal sizes: pad each chunk to the largest
        padded = torch.zeros(per, hidden, dtype=x.dtype, device=x.device)
        padded[: t1 - t0] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        self._collective(dist.all_gather, gathered, padded)
        out = torch.cat([g[: self._chunk_of(r, n_tokens)] for r, g in enumerate(gathered)])
        combine_s = time.perf_counter() - start

        if self.observer is not None:
            row_bytes = hidden * x.element_size() + 8  # a row and its expert id
            obs = self.observer()
            obs.on_all_to_all(AllToAllRecord(layer, "dispatch", dispatch_s, tuple(n * row_bytes for n in sends),
                                             tuple(n * row_bytes for n in recv_counts), wait))
            obs.on_all_to_all(AllToAllRecord(layer, "combine", combine_s,
                                             tuple(n * hidden * x.element_size() for n in recv_counts),
                                             tuple(n * hidden * x.element_size() for n in sends),
                                             (0.0,) * self.world))
        return out

    def _chunk_of(self, rank: int, n_tokens: int) -> int:
        per, extra = divmod(n_tokens, self.world)
        return per + (rank < extra)
