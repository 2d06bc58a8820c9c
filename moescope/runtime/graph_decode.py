"""A decode step with fixed shapes, capturable as a CUDA graph, with moescope's counters inside it.

Python hooks do not run when a CUDA graph replays: every engine's hooks are blind there. Here the capture is
part of the step itself: each MoE layer adds its routing statistics into static device buffers
(``GraphCounters``) with ops recorded in the graph, and ``GraphCollector`` reads them between replays. The
counters are cumulative and never reset inside the graph, so a read can never race a reset: the collector
keeps the previous read and hands the difference to the metrics as one ``StepStats``, exactly what the
eager path's routing probe produces.

Shapes are fixed: ``batch`` slots, one new token each; a static KV cache [L, B, P, nh, hd]; positions and a
live mask as device tensors (a free slot computes but is not counted). Attention covers all P positions with a
mask; the experts run without host-side slice bounds (the eager path's one sync per layer cannot be in a
graph): ``grouped`` sorts the slots by expert and runs ``torch.nn.functional.grouped_mm`` with device
offsets (graph-safe where its native CUDA kernel runs: bf16 on sm80+; elsewhere torch's fallback reads the
offsets on the host, fine on CPU), ``dense`` runs every expert over every token in two batched matmuls and
gathers the chosen slots (graph-safe everywhere, E/k times the expert FLOPs). Equal to the eager model up to
float rounding (tests/test_graph_decode.py). Every expert must be resident: no expert cache, no expert
parallelism, no router mitigation (their state lives on the host).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moescope.capture.routing_probe import LayerStats, StepStats
from moescope.errors import BadInput
from moescope.runtime.experts import _grouped_mm, combine, grouped_mm_native
from moescope.runtime.model import KVCache, MoETransformer, apply_rope

EXPERT_MODES = ("auto", "grouped", "dense")
# Per-layer sums: forwards, live tokens, entropy, margin, non-finite logits, dropped slots.
_FORWARDS, _TOKENS, _ENTROPY, _MARGIN, _NONFINITE, _DROPPED = range(6)


class GraphCounters:
    """Static device accumulators of every MoE layer, updated by ops inside the (captured) step.

    slots: [L, E + 2] int64: slots per expert, then dropped slots (sentinel E), then slots of free batch
        slots (not counted anywhere else).
    sums: [L, 6] float64: forwards, live tokens, entropy sum, margin sum, non-finite logits, dropped slots.
    NaN entropies/margins (a non-finite row) are left out of the sums, so one bad token cannot poison a
    cumulative counter; the non-finite count reports it.
    """

    def __init__(self, layers: list[int], n_experts: int, top_k: int, device) -> None:
        self.layers, self.n_experts, self.top_k = list(layers), n_experts, top_k
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.slots = torch.zeros(len(layers), n_experts + 2, dtype=torch.int64, device=device)
        self.sums = torch.zeros(len(layers), 6, dtype=torch.float64, device=device)

    def add(self, layer: int, decision, live: torch.Tensor) -> None:
        """Count one layer's routing of one forward; ``live`` [B] bool marks the batch slots in use."""
        i = self.row[layer]
        ids = torch.where(live[:, None], decision.active_ids, self.n_experts + 1).reshape(-1)
        self.slots[i].scatter_add_(0, ids, torch.ones_like(ids))
        livef = live.double()
        d = torch.stack([torch.ones((), dtype=torch.float64, device=livef.device), livef.sum(),
                         torch.nansum(decision.entropy.double() * livef),
                         torch.nansum(decision.margin.double() * livef),
                         decision.nonfinite.double(), decision.dropped.double()])
        self.sums[i] += d


class GraphCollector:
    """Reads ``GraphCounters`` between replays and emits the difference since the last read as ``StepStats``.

    ``collect()`` never stalls the engine on CUDA: it takes the copy enqueued by the previous call once its
    event has completed, then enqueues the next copy (non-blocking, into pinned memory). ``flush()`` waits for
    the copy (shutdown, scrapes that must see everything, tests). On CPU both read at once.
    """

    def __init__(self, counters: GraphCounters, listener) -> None:
        self.counters, self._listener = counters, listener
        width = counters.n_experts + 2 + 6
        self._last = np.zeros((len(counters.layers), width))
        self._cuda = counters.slots.is_cuda
        with torch.inference_mode(False):  # an engine builds this inside its step; reads happen outside too
            self._host = torch.zeros((len(counters.layers), width), dtype=torch.float64, pin_memory=self._cuda)
        self._event = None  # the pending copy's event (CUDA)

    def _enqueue(self) -> None:
        c = self.counters
        self._host.copy_(torch.cat([c.slots.double(), c.sums], dim=1), non_blocking=self._cuda)
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def collect(self) -> StepStats | None:
        """Emit what the last completed read saw (None when nothing new); start the next read."""
        if not self._cuda:
            self._enqueue()
            return self._emit()
        out = None
        if self._event is not None and self._event.query():
            out = self._emit()
            self._event = None
        if self._event is None:
            self._enqueue()
        return out

    def flush(self) -> StepStats | None:
        """Read the counters as they are after every step enqueued so far, and emit the difference."""
        self._enqueue()  # a fresh copy: one still in flight holds older counts (deltas stay exact either way)
        if self._cuda:
            self._event.synchronize()  # flush() waits by contract (shutdown, tests); steps call collect()
            self._event = None
        return self._emit()

    def _emit(self) -> StepStats | None:
        now = self._host.numpy().copy()  # the pinned host copy, complete by now: no device access
        delta, self._last = now - self._last, now
        c, n_exp = self.counters, self.counters.n_experts
        steps = int(round(delta[0, n_exp + 2 + _FORWARDS])) if len(c.layers) else 0
        if steps <= 0:
            return None
        s = delta[:, n_exp + 2:]
        layers = tuple(LayerStats(layer=layer, tokens=int(round(s[i, _TOKENS])),
                                  slots=np.rint(delta[i, :n_exp]).astype(np.int64),
                                  dropped=int(round(s[i, _DROPPED])), nonfinite=int(round(s[i, _NONFINITE])),
                                  entropy_sum=float(s[i, _ENTROPY]), margin_sum=float(s[i, _MARGIN]),
                                  modes=(("decode", int(round(s[i, _TOKENS]))),))  # (decode steps only)
                       for i, layer in enumerate(c.layers))
        stats = StepStats(steps=steps, layers=layers, n_experts=n_exp, top_k=c.top_k)
        if self._listener is not None:
            self._listener(stats)
        return stats


def check_supported(model: MoETransformer) -> None:
    """Raise ``BadInput`` when the model has parts a fixed-shape (graph) step cannot hold."""
    for m in model.moe_layers():
        if m.parallel is not None or m.experts.weight_source is not None or m.router.mitigation is not None:
            raise BadInput("a static/graph decode step needs every expert resident and no router mitigation "
                           "(the expert cache, expert parallelism and mitigations keep state on the host)")


class StaticDecoder:
    """One decode token for each of ``batch`` sequences per ``step``, with shapes fixed for CUDA graphs.

    Usage: ``load(slot, kv_cache)`` after a request's prefill (eager), then ``step(tokens, positions, live)``
    per decode step; ``capture()`` (CUDA) records the step as a graph that ``step`` then replays.
    """

    def __init__(self, model: MoETransformer, batch: int, *, experts: str = "auto", count: bool = True) -> None:
        if experts not in EXPERT_MODES:
            raise BadInput(f"experts mode must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
        if batch <= 0:
            raise BadInput(f"batch must be positive, got {batch}")
        check_supported(model)
        moe = model.moe_layers()
        cfg, dev, dtype = model.cfg, model.device, model.embed.weight.dtype
        self.model, self.batch = model, batch
        self.count = count  # False: no counters in the step (the bare step benchmarks compare against)
        if experts == "auto":
            experts = "grouped" if grouped_mm_native(dev, dtype) else "dense"
        elif experts == "grouped" and _grouped_mm is None:
            raise BadInput(f"this torch ({torch.__version__}) has no grouped_mm: use experts='dense'")
        self.experts_mode = experts
        shape = (cfg.n_layers, batch, cfg.max_seq_len, cfg.n_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=dev, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=dev, dtype=dtype)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.live = torch.zeros(batch, dtype=torch.bool, device=dev)
        self._rows = torch.arange(batch, device=dev)
        self._span = torch.arange(cfg.max_seq_len, device=dev)
        self.counters = GraphCounters([m.layer_index for m in moe], cfg.n_experts, cfg.top_k, dev)
        self.graph = None
        self._out: torch.Tensor | None = None
        self.replays = 0

    # -- state ---------------------------------------------------------------------------------------------
    def load(self, slot: int, cache: KVCache) -> None:
        """Copy a sequence's KV cache (filled by an eager prefill) into batch slot ``slot``."""
        n = cache.length
        self.k_cache[:, slot, :n] = cache.k[:, :n]
        self.v_cache[:, slot, :n] = cache.v[:, :n]

    # -- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self) -> torch.Tensor:
        """Logits [B, V] for ``self.tokens`` at ``self.positions``; writes their keys/values into the cache."""
        model = self.model
        x = model.embed(self.tokens)  # [B, H]
        cos, sin = model.rope_cos[self.positions], model.rope_sin[self.positions]  # [B, hd/2]
        mask = (self._span[None, :] <= self.positions[:, None])[:, None, None, :]  # [B, 1, 1, P]
        for block in model.blocks:
            x = x + self._attention(block.attn, block.attn_norm(x), block.index, cos, sin, mask)
            h = block.ffn_norm(x)
            if not block.is_moe:
                x = x + block.ffn(h)
                continue
            decision, _ = block.ffn.router(h)
            if self.count:
                self.counters.add(block.index, decision, self.live)
            y = self._experts(block.ffn.experts, h, decision)
            if block.ffn.shared_experts is not None:
                y = y + block.ffn.shared_experts(h)
            x = x + y
        return model.lm_head(model.norm(x))

    def _attention(self, attn, x, layer, cos, sin, mask):
        b, nh, hd = self.batch, attn.n_heads, attn.head_dim
        q, k, v = attn.qkv(x).view(b, 3, nh, hd).unbind(1)  # [B, nh, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [B, P, nh, hd]
        kc[self._rows, self.positions] = k  # index_put with device indices: no host sync
        vc[self._rows, self.positions] = v
        y = F.scaled_dot_product_attention(q[:, :, None, :], kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=mask)  # [B, nh, 1, hd]
        return attn.out(y.reshape(b, nh * hd))

    def _experts(self, experts, x, decision):
        ids, n_exp = decision.active_ids, experts.n_experts  # [B, k]; sentinel E marks a dropped slot
        n_tok, top_k = ids.shape
        flat = ids.reshape(-1)
        if self.experts_mode == "dense":
            # every expert over every token: [E, B, 2F] then [E, B, H]; gather each slot's row
            gate, up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
            y = torch.matmul(F.silu(gate) * up, experts.down_proj.transpose(1, 2))  # [E, B, H]
            tok = self._rows.repeat_interleave(top_k)
            slot_out = y[flat.clamp(max=n_exp - 1), tok] * (flat < n_exp)[:, None]  # [B*k, H]
            return combine(slot_out, decision.weights)
        order = torch.argsort(flat, stable=True)  # grouped by expert; dropped slots (sentinel) last
        counts = torch.zeros(n_exp + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts[:n_exp], 0, dtype=torch.int32)  # end of each expert's rows
        rows = x[order // top_k]  # [B*k, H]
        gate, up = _grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        out = _grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(1, 2), offs=offs)  # [B*k, H]
        out = torch.where((flat[order] < n_exp)[:, None], out, 0)  # rows past the last offset are undefined
        slot_out = torch.empty_like(out)
        slot_out[order] = out
        return combine(slot_out, decision.weights)

    def capture(self, warmup: int = 3) -> None:
        """Record the step as a CUDA graph (after ``warmup`` eager runs on a side stream, which also compile
        the Triton router). The counters of the warm-up runs are taken back out."""
        if not self.tokens.is_cuda:
            raise BadInput("CUDA graphs need a CUDA device")
        slots, sums = self.counters.slots.clone(), self.counters.sums.clone()
        k, v = self.k_cache.clone(), self.v_cache.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self.forward()
        # capture does not run the ops, but the warm-up did: restore what it changed
        self.counters.slots.copy_(slots)
        self.counters.sums.copy_(sums)
        self.k_cache.copy_(k)
        self.v_cache.copy_(v)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per batch slot; returns logits [B, V] (a static buffer when replaying a graph:
        read or copy it before the next step)."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        if live is None:
            self.live.fill_(True)
        else:
            self.live.copy_(live, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            return self._out
        return self.forward()

