"""Top-k router: logits -> temperature softmax -> top-k -> renormalise, with an optional capacity limit.

Shape legend: T = tokens in the forward, H = hidden size, E = experts, k = experts per token.

Everything here stays on the device: counts such as non-finite logits and dropped slots are 0-dim tensors,
so routing never forces a host sync; the capture layer copies them later, never per layer (capture/observer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moescope.capture.decision import RoutingDecision, entropy_margin


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots one expert may take in a forward: ceil(cf * T * k / E), at least 1."""
    return max(1, math.ceil(capacity_factor * n_tokens * top_k / n_experts))


def capacity_keep_mask(ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: which slots fit under ``capacity`` per expert.

    Priority is by choice rank, then by token order (GShard): every token's first choice is placed before
    any second choice, so a drop never removes a token's best expert while a worse slot survives.
    Sort-based (no [T*k, E] one-hot), no host sync.
    """
    n_tokens, top_k = ids.shape
    flat = ids.t().reshape(-1)  # [k*T] in priority order: all rank-0 slots, then rank-1, ...
    sorted_ids, order = torch.sort(flat, stable=True)
    # scatter_add into a fixed size, not bincount: on CUDA bincount reads the max id on the host (a sync, and
    # not capturable in a CUDA graph)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    pos_sorted = torch.arange(flat.numel(), device=ids.device) - starts[sorted_ids]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted  # position of each slot within its expert's queue
    return (pos < capacity).view(top_k, n_tokens).t()


def _apply_capacity(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity_factor: float | None):
    """(kept, weights, dropped, active_ids or None) under the capacity limit (nothing dropped without one)."""
    if capacity_factor is None:
        return (torch.ones_like(ids, dtype=torch.bool), weights,
                torch.zeros((), dtype=torch.int64, device=ids.device), ids)
    n_tokens, top_k = ids.shape
    kept = capacity_keep_mask(ids, n_experts, expert_capacity(n_tokens, top_k, n_experts, capacity_factor))
    return kept, weights * kept, (~kept).sum(), None


def topk_canonical(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` with a defined order: larger first, ties to the lower expert id, NaN above everything
    (torch.topk leaves tie order to the implementation: [0.25] * 4 gives experts 2, 3 on CPU). Two topk
    passes and elementwise ops over [T, E], a small stable sort over [T, k]; no host sync.
    Returns (values [T, k], ids [T, k])."""
    n_experts = scores.shape[-1]
    key = torch.where(torch.isnan(scores), float("inf"), scores)  # NaN ranks above any score
    kth = torch.topk(key, k, dim=-1).values[:, -1:]  # [T, 1] the k-th largest key (its value is well defined)
    above = key > kth
    tied = key == kth
    room = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (torch.cumsum(tied.long(), -1) <= room))  # exactly k per row, lowest ids on ties
    idx = torch.arange(n_experts, device=scores.device)
    ids = torch.topk(chosen * (n_experts - idx), k, dim=-1).indices  # the chosen ids, ascending
    order = torch.sort(key.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    return scores.gather(1, ids), ids


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become a choice and gate weights (the parts of ``MoEConfig`` routing reads).

    scoring: ``softmax`` (probabilities over experts) or ``sigmoid`` (an independent affinity per expert).
    n_group / topk_group: group-limited top-k: only the ``topk_group`` groups with the best group score (the
        sum of the group's two best selection scores) are eligible (DeepSeek-V3); 1 / 1 = no limit.
    norm_topk_prob: gate weights divided by their sum (sigmoid adds 1e-20 to the sum, as HF does).
    scale: ``routed_scaling_factor``, multiplied into the gate weights.
    """

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scale: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> "RoutingRule":
        return cls(scoring=cfg.scoring, n_group=cfg.n_group, topk_group=cfg.groups_kept,
                   norm_topk_prob=cfg.norm_topk_prob, scale=float(cfg.routed_scaling_factor))

    @property
    def grouped(self) -> bool:
        return self.topk_group < self.n_group

    def scores(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """[T, E] the router's per-expert scores (unbiased): what gate weights are taken from."""
        z = logits / temperature
        return torch.softmax(z, dim=-1) if self.scoring == "softmax" else torch.sigmoid(z)

    def group_limit(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` [T, E] with the experts outside each token's ``topk_group`` best groups set to -inf."""
        n_tokens, n_experts = choice.shape
        grouped = choice.view(n_tokens, self.n_group, n_experts // self.n_group)  # [T, G, E/G]
        keep = self._kept_groups(grouped)  # [T, topk_group]
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n_tokens, n_experts)

    def _kept_groups(self, grouped: torch.Tensor) -> torch.Tensor:
        """[T, topk_group] each token's best groups of ``grouped`` [T, G, E/G], by the sum of their two best."""
        best, at = grouped.max(-1, keepdim=True)
        if grouped.shape[-1] == 1:
            group_score = best.squeeze(-1)
        else:  # the two best by two max passes: the same sum as topk(2), a third of its time on CPU
            group_score = best.squeeze(-1) + grouped.scatter(-1, at, float("-inf")).amax(-1)  # [T, G]
        return torch.topk(group_score, self.topk_group, dim=-1).indices

    def choose(self, key: torch.Tensor, top_k: int) -> torch.Tensor:
        """[T, k] the experts ``key`` [T, E] (scores + bias) selects under the group limit, best first (the
        top-k of the kept groups only: half the elements of a top-k over the masked row at 4 of 8 groups)."""
        if not self.grouped:
            return torch.topk(key, top_k, dim=-1).indices
        n_tokens, n_experts = key.shape
        size = n_experts // self.n_group
        grouped = key.view(n_tokens, self.n_group, size)
        keep = self._kept_groups(grouped).sort(-1).values  # ascending: the kept experts keep their id order
        kept = grouped.gather(1, keep[:, :, None].expand(-1, -1, size)).reshape(n_tokens, -1)
        at = torch.topk(kept, top_k, dim=-1).indices
        return keep.gather(1, at // size) * size + at % size

    def gate_weights(self, top: torch.Tensor) -> torch.Tensor:
        """[T, k] gate weights from the chosen experts' unbiased scores."""
        if self.norm_topk_prob:
            denom = top.sum(dim=-1, keepdim=True)
            top = top / (denom + 1e-20 if self.scoring == "sigmoid" else denom)
        return top * self.scale if self.scale != 1.0 else top


PLAIN = RoutingRule()


def route(logits: torch.Tensor, top_k: int, *, temperature: float = 1.0,
          capacity_factor: float | None = None, select=None, canonical_ties: bool = False,
          rule: RoutingRule = PLAIN, bias: torch.Tensor | None = None) -> RoutingDecision:
    """Turn router logits [T, E] into a decision. Pure function: the reference every router path must match.

    Scores (softmax or sigmoid of logits / temperature) plus the correction ``bias`` [E] give the selection
    key; the group limit masks the groups a token may not use; top-k of the key gives the ids; gate weights
    are the chosen experts' unbiased scores (normalised and scaled as ``rule`` says).

    ``canonical_ties``: break exact ties toward the lower expert id and rank NaN first (``topk_canonical``),
    the order the fused Triton kernel produces by construction. Off by default on the hot path: it costs
    ~40x a plain ``torch.topk`` at 16 tokens, and exact ties between router probabilities are rare.

    ``select(key, ids) -> (ids, rerouted)`` lets a mitigation replace the plain top-k choice (gate weights
    stay the router's own scores of the chosen experts).
    """
    n_tokens, n_experts = logits.shape
    logits = logits.float()
    nonfinite = (~torch.isfinite(logits)).sum()
    scores = rule.scores(logits, temperature)  # [T, E]
    plain = bias is None and not rule.grouped  # selection key == scores: top-k values are the gate scores
    key = scores if bias is None else scores + bias
    if rule.grouped:
        key = rule.group_limit(key)
    top_key, ids = topk_canonical(key, top_k) if canonical_ties else torch.topk(key, top_k, dim=-1)  # [T, k]
    rerouted = None
    if select is not None:
        chosen, rerouted = select(key, ids)
        order = key.gather(1, chosen).sort(dim=-1, descending=True, stable=True).indices
        ids = chosen.gather(1, order)  # best first, as plain top-k orders them
        top_key = None
    top_p = top_key if plain and top_key is not None else scores.gather(1, ids)
    weights = rule.gate_weights(top_p)
    if plain and select is None and rule.scoring == "softmax" and top_k >= 2:
        # the first two chosen probabilities are the top two: no second topk (the tiny-demo hot path)
        entropy = -torch.special.xlogy(scores, scores).sum(-1) / math.log(n_experts)
        margin = top_p[:, 0] - top_p[:, 1]
    else:
        entropy, margin = entropy_margin(scores, rule.scoring)
    kept, weights, dropped, active = _apply_capacity(ids, weights, n_experts, capacity_factor)
    return RoutingDecision(ids=ids, weights=weights, kept=kept, entropy=entropy, margin=margin,
                           nonfinite=nonfinite, dropped=dropped, n_experts=n_experts, active_ids=active,
                           rerouted=rerouted)


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """[] int64: slots of ``before`` [T, k] whose expert is not in the same row of ``after``."""
    return (before.unsqueeze(-1) != after.unsqueeze(-2)).all(-1).sum()


@dataclass(frozen=True)
class Mitigation:
    """Switchable routing mitigations (the [mitigate] issue). Both keep state on the device only.

    load_bound: load-aware routing: an expert whose estimated load (EMA of its share of tokens) exceeds
        ``load_bound`` x its capacity (``load_capacity_factor`` x the fair share k/E) is ranked after every
        expert under the bound for the next forwards: the token's next-ranked expert takes the slot.
    smoothing_margin: hysteresis: a position whose prefix (token ids from the sequence start, hashed by the
        caller into ``Router.keys``) was routed before keeps that expert set unless the new top-k set has more
        router probability by more than this margin. Memory: a fixed device table of ``table_size`` entries.
    """

    load_bound: float | None = None
    load_capacity_factor: float = 1.5
    load_ema: float = 0.2
    smoothing_margin: float | None = None
    table_size: int = 1 << 16


def extend_prefix_key(key: int, tokens) -> list[int]:
    """Prefix keys of ``tokens`` following a sequence whose prefix key is ``key`` (0 at the start): one
    64-bit key per position, identifying the token ids from the sequence start up to and including it."""
    out = []
    for t in tokens:
        key = hash((key, int(t)))  # ints and tuples of ints hash the same in every process
        out.append(key)
    return out


def route_kernel(logits: torch.Tensor, top_k: int, *, temperature: float = 1.0,
                 capacity_factor: float | None = None, counters=None) -> RoutingDecision:
    """``route`` computed by the fused Triton kernel (``moescope.kernels.router_triton``); same result as
    ``route(..., canonical_ties=True)``. ``counters``: the kernel's static device accumulators."""
    from moescope.kernels.router_triton import route_fused  # optional: triton (kernels.router_triton; the gpu extra)

    n_tokens, n_experts = logits.shape
    ids, weights, entropy, margin, nonfinite = route_fused(logits, top_k, temperature=temperature,
                                                           counters=counters)
    kept, weights, dropped, active = _apply_capacity(ids, weights, n_experts, capacity_factor)
    return RoutingDecision(ids=ids, weights=weights, kept=kept, entropy=entropy, margin=margin,
                           nonfinite=nonfinite, dropped=dropped, n_experts=n_experts, active_ids=active)


ROUTER_IMPLS = ("auto", "torch", "triton")


class Router(nn.Module):
    """Linear gate [E, H] computed in float32 whatever the model dtype (routing is precision-sensitive).

    ``rule`` says how logits become a choice (softmax / sigmoid, group limit, normalisation, scaling);
    ``correction_bias`` adds the ``e_score_correction_bias`` buffer [E] (float32 whatever the model dtype, as
    HF keeps it), which steers selection but never the gate weights.
    """

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, *, temperature: float = 1.0,
                 capacity_factor: float | None = None, rule: RoutingRule = PLAIN,
                 correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.rule = rule
        self.top_k = top_k
        self.temperature = temperature
        self.capacity_factor = capacity_factor
        self.fault = None  # a runtime.faults.RouterFault, for the fault scenarios
        self.mitigation: Mitigation | None = None
        self.impl = "auto"  # auto: the Triton kernel on CUDA when triton is installed, else torch
        self.keys: torch.Tensor | None = None  # [T] int64 prefix keys of the forward (smoothing only)
        self._load: torch.Tensor | None = None  # [E] EMA of each expert's share of tokens
        self.update_load = True  # False while the canary routes: its batch is not serving load
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # smoothing memory: keys [S], ids [S, k]

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None and self._buffers["e_score_correction_bias"].dtype != torch.float32:
            # routing precision: the bias stays float32 when the model is cast (HF keeps it so too)
            self._buffers["e_score_correction_bias"] = bias.to(self._buffers["e_score_correction_bias"].device)
        return self

    def _select(self, probs: torch.Tensor, ids: torch.Tensor):
        m, (n_tokens, n_experts), k = self.mitigation, probs.shape, self.top_k
        rerouted, chosen = {}, ids
        if m.smoothing_margin is not None and self.keys is not None and n_tokens:
            if self._table is None:
                self._table = (torch.full((m.table_size,), -1, dtype=torch.int64, device=probs.device),
                               torch.zeros((m.table_size, k), dtype=torch.int64, device=probs.device))
            t_keys, t_ids = self._table
            keys = self.keys.to(probs.device)
            slot = keys.remainder(m.table_size)
            prev = t_ids[slot]
            known = t_keys[slot] == keys
            gain = probs.gather(1, chosen).sum(-1) - probs.gather(1, prev).sum(-1)
            keep = known & (gain <= m.smoothing_margin)
            smoothed = torch.where(keep.unsqueeze(-1), prev, chosen)
            rerouted["smoothing"] = _changed_slots(chosen, smoothed)
            chosen = smoothed
        if m.load_bound is not None and n_tokens:
            if self._load is None:
                self._load = torch.full((n_experts,), k / n_experts, device=probs.device)
            over = self._load > m.load_bound * m.load_capacity_factor * k / n_experts  # [E]
            # Chosen experts under the bound keep their slot; a chosen expert over it gives the slot to the
            # token's next-ranked expert under the bound (overloaded experts rank last).
            mine = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, chosen, True)
            scores = probs + 4.0 * (mine & ~over) - 2.0 * over
            new = torch.topk(scores, k, dim=-1).indices
            rerouted["load"] = _changed_slots(chosen, new)
            chosen = new
            share = torch.zeros(n_experts, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)) / n_tokens
            if self.update_load:
                self._load.mul_(1 - m.load_ema).add_(m.load_ema * share)
        if "smoothing" in rerouted:  # remember what the position finally used
            t_keys[slot], t_ids[slot] = keys, chosen
        return chosen, rerouted

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return logits if self.fault is None else self.fault.apply(logits)

    def forward(self, x: torch.Tensor) -> tuple[RoutingDecision, torch.Tensor]:
        """Returns the decision and the raw logits [T, E] (the training loss needs them)."""
        logits = self.logits(x)
        if self.mitigation is None and self._use_kernel(logits):
            return route_kernel(logits, self.top_k, temperature=self.temperature,
                                capacity_factor=self.capacity_factor), logits
        bias = self.e_score_correction_bias
        return route(logits, self.top_k, temperature=self.temperature, capacity_factor=self.capacity_factor,
                     select=self._select if self.mitigation is not None else None, rule=self.rule,
                     bias=bias.float() if bias is not None else None), logits

    @property
    def kernel_supported(self) -> bool:
        """Whether the fused Triton kernel implements this router's rule (softmax top-k, no groups, no bias,
        normalised, unscaled); otherwise the torch router runs, whatever ``impl`` says (see ``kernel_notice``)."""
        r = self.rule
        return (r.scoring == "softmax" and not r.grouped and r.norm_topk_prob and r.scale == 1.0
                and self.e_score_correction_bias is None)

    def _use_kernel(self, logits: torch.Tensor) -> bool:
        if self.impl == "torch" or not self.kernel_supported:
            return False
        if self.impl == "triton":
            return True
        from moescope.kernels import router_triton  # optional: triton (kernels.router_triton; the gpu extra)

        return logits.is_cuda and router_triton.available()
