"""Run under TRITON_INTERPRET=1 (Triton's CPU interpreter) by tests/test_triton_router.py, or on a GPU as is:
the fused router kernel equals the torch reference, and a model served with it equals the torch path."""

import sys

import torch

from moescope.kernels.router_triton import RouterCounters, route_fused
from moescope.runtime.router import route

NAN, INF = float("nan"), float("inf")


def check(logits, k, temp=1.0):
    ref = route(logits, k, temperature=temp, canonical_ties=True)
    c = RouterCounters.zeros(logits.shape[1], logits.device)
    ids, w, ent, mar, nf = route_fused(logits, k, temperature=temp, counters=c)
    assert torch.equal(ids, ref.ids), (ids, ref.ids)
    assert torch.allclose(w, ref.weights, atol=1e-6, rtol=0, equal_nan=True), (w, ref.weights)
    assert torch.allclose(ent, ref.entropy, atol=1e-6, rtol=0, equal_nan=True), (ent, ref.entropy)
    assert torch.allclose(mar, ref.margin, atol=1e-6, rtol=0, equal_nan=True), (mar, ref.margin)
    assert int(nf) == int(ref.nonfinite)
    assert torch.equal(c.slots.long(), torch.bincount(ref.ids.flatten(), minlength=logits.shape[1]))
    finite = torch.isfinite(ref.entropy)
    if finite.all():  # the counters' sums equal the recomputation
        assert abs(float(c.sums[0]) - float(ref.entropy.sum())) < 1e-4
        assert abs(float(c.sums[1]) - float(ref.margin.sum())) < 1e-4


def main(device: str) -> None:
    torch.manual_seed(0)
    n = 0
    for T, E, k in ((1, 8, 2), (33, 8, 2), (100, 64, 8), (70, 6, 1), (5, 256, 8), (64, 128, 2)):
        x = torch.randn(T, E, device=device) * 2
        check(x, k)
        check(x, k, 0.7)
        n += 2
    x = torch.randn(40, 8, device=device)
    x[3] = 0.0  # all tied
    x[4, :4] = 1.0  # a 4-way tie on top
    x[5, 2] = NAN
    x[6, 1] = INF
    x[7] = -INF  # every logit -inf
    x[8, 0] = -INF
    x[9, 5] = -INF
    x[9, 6] = INF
    x[10] = torch.tensor([1.0, 3.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for k in (1, 2, 3):
        check(x, k)
        n += 1
    # a model served with the kernel equals the torch path (no exact ties in a real model's logits)
    from moescope.runtime import loader, traffic
    from moescope.runtime.engine import Engine

    outs = {}
    for impl in ("torch", "triton"):
        model = loader.build_model("tiny-demo", device=device)
        for layer in model.moe_layers():
            layer.router.impl = impl
        recs = Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=0,
                                              output_tokens_median=6), 4), realtime=False, id_prefix="r-")
        outs[impl] = {r.request_id: r.output_tokens for r in recs}
    assert outs["torch"] == outs["triton"], outs
    print(f"ok: {n} kernel checks, model outputs equal")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
