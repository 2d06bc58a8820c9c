"""Expert cache: results identical to the all-resident model; counts equal an independent replay."""

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moescope.capture.observer import Observer
from moescope.errors import BadInput
from moescope.runtime import cache_policy
from moescope.runtime.expert_cache import ExpertLoadError, attach_cache, write_disk_tier
from moescope.runtime.model import MoETransformer, Segment


class LookupRecorder(Observer):
    """Independent record of the lookups: the distinct experts each forward computes, ascending."""

    def __init__(self):
        self.seq = collections.defaultdict(list)

    def on_routing(self, layer, decision):
        ids = decision.active_ids.reshape(-1)
        self.seq[layer].extend(sorted({int(e) for e in ids if int(e) < decision.n_experts}))


def naive_replay(seq, policy, size, pinned=()):
    """Plain-list implementations of the documented rules: (hits, misses, evictions)."""
    resident, hits, evictions, freq, last = [], 0, 0, collections.Counter(), {}
    for t, e in enumerate(seq):
        freq[e] += 1
        last[e] = t
        if e in resident:
            hits += 1
            if policy == "lru":
                resident.remove(e)
                resident.append(e)
            continue
        if policy == "static":
            if e in pinned:
                resident.append(e)
            continue
        if len(resident) == size:
            if policy == "lru":
                resident.pop(0)
            else:  # lfu: fewest lookups, then least recent
                victim = min(resident, key=lambda r: (freq[r], last[r]))
                resident.remove(victim)
            evictions += 1
        resident.append(e)
    return hits, len(seq) - hits, evictions


def _run_steps(model, n_steps=6, seed=0):
    """Prefill three sequences then decode: returns all logits, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    caches = [model.new_cache() for _ in range(3)]
    out = []
    with torch.no_grad():
        prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 4, 13)]
        logits = model(torch.cat(prompts), [Segment(len(p), c) for p, c in zip(prompts, caches)],
                       last_only=True).logits
        out.append(logits)
        for _ in range(n_steps):
            logits = model(logits.argmax(-1), [Segment(1, c) for c in caches], last_only=True).logits
            out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("policy,size", [("lru", 1), ("lru", 3), ("lfu", 2), ("static", 2), ("none", 6)])
def test_outputs_identical_and_counts_match_replay(tiny_cfg, tmp_path, tier, policy, size):
    _identical_and_replayed(tiny_cfg, tmp_path, tier, policy, size)


def test_cache_under_deepseek_routing_is_identical_and_replayed(deepseek_cfg, tmp_path):
    """Sigmoid group-limited routing + shared expert: the cache path (one matmul pair per expert) equals the
    resident grouped path bit for bit."""
    _identical_and_replayed(deepseek_cfg.replace(ffn_size=48), tmp_path, "memory", "lru", 5)


def _identical_and_replayed(tiny_cfg, tmp_path, tier, policy, size):
    model = MoETransformer(tiny_cfg).eval()
    reference = _run_steps(model)
    pinned = {layer: [0, 3] for layer in tiny_cfg.moe_layers}
    cache = attach_cache(model, size=size, policy=policy, tier=tier, path=tmp_path / "experts.safetensors",
                         pinned=pinned)
    rec = LookupRecorder()
    model.observer = rec
    try:
        got = _run_steps(model)
    finally:
        cache.close()
    assert torch.equal(got, reference)  # the cache changes timing, never results
    for layer, stats in cache.stats().items():
        seq = rec.seq[layer]
        assert stats.lookups == len(seq) > 0
        if policy == "none":
            assert (stats.hits, stats.misses, stats.evictions) == (len(seq), 0, 0)
            continue
        hits, misses, evictions = naive_replay(seq, policy, size, pinned[layer])
        assert (stats.hits, stats.misses, stats.evictions) == (hits, misses, evictions)
        assert len(stats.load_seconds) == misses
        assert stats.bytes_loaded == misses * 3 * tiny_cfg.hidden_size * tiny_cfg.ffn_size * 4
        sim = cache_policy.simulate(seq, policy, size, pinned=pinned[layer] if policy == "static" else None)
        assert (sim.hits, sim.evictions) == (hits, evictions)  # cache-sim agrees with the runtime


def test_prefetch_keeps_results_and_accounts_every_miss(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    reference = _run_steps(model, n_steps=12)
    cache = attach_cache(model, size=2, policy="lru", prefetch=4)
    try:
        got = _run_steps(model, n_steps=12)
    finally:
        cache.close()
    assert torch.equal(got, reference)
    total = collections.Counter()
    for s in cache.stats().values():
        assert s.misses == s.prefetch_hits + len(s.load_seconds)
        assert s.prefetch_hits + s.prefetch_wasted <= s.prefetch_issued
        total.update(issued=s.prefetch_issued, hits=s.prefetch_hits)
    assert total["issued"] > 0  # layers after the first got prefetch requests


def test_dropped_prefetches_are_counted_and_exported(tiny_cfg):
    """A full prefetch queue drops the request (the engine never waits) and counts it; the exporter's
    moescope_expert_cache_prefetch_dropped_total per layer equals the caches' own counts."""
    import queue

    import moescope

    model = MoETransformer(tiny_cfg).eval()
    reference = _run_steps(model, n_steps=8)
    cache = attach_cache(model, size=2, policy="lru", prefetch=4)
    # A queue of one that nobody reads (the loader thread waits on the old one): the first request fills it,
    # every later new one is dropped.
    cache.prefetcher._queue = queue.Queue(maxsize=1)
    try:
        with moescope.instrument(model) as inst:
            got = _run_steps(model, n_steps=8)
            inst.metrics.flush()
            exported = dict(inst.metrics.layer_counters["moescope_expert_cache_prefetch_dropped_total"])
    finally:
        cache.close()
    assert torch.equal(got, reference)  # dropping a prefetch changes timing, never results
    dropped = {layer: s.prefetch_dropped for layer, s in cache.stats().items()}
    assert sum(dropped.values()) > 0
    assert {k: v for k, v in exported.items() if v} == {k: v for k, v in dropped.items() if v}


def test_disk_tier_reads_real_bytes_and_reports_bad_files(tiny_cfg, tmp_path):
    model = MoETransformer(tiny_cfg).eval()
    path = write_disk_tier(model, tmp_path / "experts.safetensors")
    cache = attach_cache(model, size=1, tier="disk", path=path)
    layer = tiny_cfg.moe_layers[0]
    lc = cache.layers[layer]
    gate_up, down = lc.load(4)
    assert torch.equal(gate_up, model.blocks[layer].ffn.experts.gate_up_proj[4])
    assert torch.equal(down, model.blocks[layer].ffn.experts.down_proj[4])
    cache.close()

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:200])
    cache = attach_cache(model, size=1, tier="disk", path=corrupt)
    with pytest.raises(ExpertLoadError, match=r"corrupt\.safetensors") as err:
        cache.layers[layer].load(2)
    assert "corrupt.safetensors" in str(err.value)
    cache.close()

    from safetensors.torch import save_file
    partial = tmp_path / "partial.safetensors"
    save_file({"layers.1.experts.0.gate_up": torch.zeros(96, 32)}, str(partial))
    cache = attach_cache(model, size=1, tier="disk", path=partial)
    with pytest.raises(ExpertLoadError, match=r"layer 1 expert 3 .*partial\.safetensors"):
        cache.layers[1].load(3)
    cache.close()

    with pytest.raises(ExpertLoadError, match="does not exist"):
        from moescope.runtime.expert_cache import DiskTier
        DiskTier(tmp_path / "missing.safetensors", 1, (torch.Size([96, 32]), torch.Size([32, 48])), torch.float32)


@pytest.mark.parametrize("kwargs,needle", [({"size": 0}, "between 1 and"), ({"size": -2}, "between 1 and"),
                                           ({"size": 7}, "between 1 and"), ({"size": 2, "policy": "fifo"},
                                                                            "unknown cache policy"),
                                           ({"size": 2, "tier": "tape"}, "unknown cache tier"),
                                           ({"size": 2, "policy": "static"}, "profile")])
def test_bad_cache_config(tiny_cfg, kwargs, needle):
    with pytest.raises(BadInput, match=needle):
        attach_cache(MoETransformer(tiny_cfg), **kwargs)


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 7), min_size=1, max_size=120), size=st.integers(1, 8))
def test_belady_is_optimal(seq, size):
    best = cache_policy.simulate(seq, "belady", size)
    for policy in ("lru", "lfu", "static"):
        assert best.hits >= cache_policy.simulate(seq, policy, size).hits
    assert best.hits <= len(seq) - len(set(seq))  # every first use is a cold miss


@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=60), size=st.integers(1, 6))
def test_policies_equal_naive_replay(seq, size):
    for policy in ("lru", "lfu"):
        sim = cache_policy.simulate(seq, policy, size)
        assert (sim.hits, sim.evictions) == naive_replay(seq, policy, size)[::2]
