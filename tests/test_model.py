import torch

from moescope.capture.observer import Observer
from moescope.runtime.model import MoETransformer, Segment


def test_decode_with_kv_cache_equals_full_recompute(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, [Segment(40)]).logits  # [40, V], no cache
        cache = model.new_cache()
        parts = [model(tokens[:17], [Segment(17, cache)]).logits]
        parts += [model(tokens[i:i + 1], [Segment(1, cache)]).logits for i in range(17, 30)]
        parts.append(model(tokens[30:], [Segment(10, cache)]).logits)  # chunk on top of history
    incremental = torch.cat(parts)
    assert cache.length == 40
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(incremental.argmax(-1), full.argmax(-1))


def test_flat_batch_of_sequences_equals_each_alone(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 23, 11)]
    with torch.no_grad():
        caches = [model.new_cache() for _ in seqs]
        batched = model(torch.cat(seqs), [Segment(len(s), c) for s, c in zip(seqs, caches)], last_only=True).logits
        alone = torch.cat([model(s, [Segment(len(s), model.new_cache())], last_only=True).logits for s in seqs])
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
        # One decode step for all three, batched, equals each decoded alone.
        nxt = batched.argmax(-1)
        step = model(nxt, [Segment(1, c) for c in caches], last_only=True).logits
        for i, s in enumerate(seqs):
            c = model.new_cache()
            model(s, [Segment(len(s), c)])
            torch.testing.assert_close(step[i], model(nxt[i:i + 1], [Segment(1, c)]).logits[0], atol=1e-5,
                                       rtol=1e-5)


def test_routing_decisions_reported_for_moe_layers_only(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    seen = []

    class Spy(Observer):
        def on_routing(self, layer, decision):
            seen.append((layer, decision.ids.shape))

    model.observer = Spy()
    with torch.no_grad():
        model(torch.arange(9), [Segment(9)])
    assert seen == [(1, (9, 2)), (2, (9, 2))]  # block 0 is dense


def test_init_is_deterministic_per_seed(tiny_cfg):
    a, b = MoETransformer(tiny_cfg), MoETransformer(tiny_cfg)
    c = MoETransformer(tiny_cfg.replace(seed=4))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.blocks[1].ffn.router.weight, c.blocks[1].ffn.router.weight)
