"""`moescope check quantization`: int8 experts keep routing; an int8 router too flips more (the seeds'
lesson), with the figures recomputed here from the router decisions of both models."""

import json

import torch

from moescope.analysis.quantization import int8_roundtrip, quantized_copy
from moescope.cli import main
from moescope.runtime import loader


def test_int8_roundtrip_matches_the_arithmetic():
    w = torch.randn(6, 10)
    got = int8_roundtrip(w, 0)
    scale = w.abs().amax(1, keepdim=True) / 127
    ref = torch.clamp(torch.round(w / scale), -128, 127) * scale  # symmetric per-row int8
    assert torch.allclose(got, ref, atol=1e-6) and not torch.equal(got, w)
    assert (got / scale).sub((got / scale).round()).abs().max() < 1e-4  # really on the int8 grid


def test_variants_touch_what_they_say():
    model = loader.build_model("tiny-demo")
    q = quantized_copy(model, "experts")
    m0, q0 = model.moe_layers()[0], q.moe_layers()[0]
    assert torch.equal(m0.router.weight, q0.router.weight)
    assert not torch.equal(m0.experts.gate_up_proj, q0.experts.gate_up_proj)
    qr = quantized_copy(model, "experts+router").moe_layers()[0]
    assert not torch.equal(m0.router.weight, qr.router.weight)


def test_experts_only_passes_and_router_quantization_flips_more(capsys):
    assert main(["check", "quantization", "--json"]) == 0
    experts = json.loads(capsys.readouterr().out)
    assert main(["check", "quantization", "--quantize", "experts+router", "--json"]) == 1
    both = json.loads(capsys.readouterr().out)
    assert max(both["flip_rate"].values()) > 2 * max(experts["flip_rate"].values())
    assert not both["passed"] and experts["passed"]
    # the figures are what a token-by-token recomputation from both models' decisions gives
    from moescope.runtime import tokenizer
    from moescope.runtime.canary import default_prompts
    from moescope.runtime.model import Segment

    model = loader.build_model("tiny-demo")
    ids = [tokenizer.encode(p) for p in default_prompts(32)]
    tokens = torch.tensor([t for seq in ids for t in seq])
    with torch.inference_mode():
        a = model(tokens, [Segment(len(s)) for s in ids]).decisions
        b = quantized_copy(model, "experts+router")(tokens, [Segment(len(s)) for s in ids]).decisions
    for layer in a:
        flips = sum(set(a[layer].ids[i].tolist()) != set(b[layer].ids[i].tolist()) for i in range(len(tokens)))
        assert abs(flips / len(tokens) - both["flip_rate"][str(layer)]) < 1e-9
    assert 0.95 <= both["next_token_agreement"] <= 1.0 and both["mean_kl"] > experts["mean_kl"] > 0
