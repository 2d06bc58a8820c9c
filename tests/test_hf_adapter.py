"""The HF adapter on tiny random models of every supported family, built offline from configs."""

import pytest
import torch

import moescope
from hf_models import FAMILIES, build, deepseek_v3_reference_ids
from metrics_util import by_label, parse, sum_by_label
from moescope.errors import BadInput
from moescope.hf.hf_adapter import find_moe_blocks


def _router_spy(model):
    """Independent reference: keep each router's input and logits via our own forward hooks."""
    seen = {}

    def hook_for(name):
        def hook(module, args, out):
            seen.setdefault(name, []).append(args[0].detach())
        return hook

    handles = [router.register_forward_hook(hook_for(name)) for name, _, router, _ in find_moe_blocks(model)]
    return seen, handles


def _reference_ids(family, router, x, k, config):
    if family == "deepseek_v3":
        return deepseek_v3_reference_ids(router, x, config)
    logits = x.reshape(-1, x.shape[-1]).double() @ router.weight.double().t()
    if getattr(router, "bias", None) is not None:
        logits = logits + router.bias.double()
    return torch.topk(logits, k, dim=-1).indices  # softmax is monotonic: top-k of logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_counts_equal_recomputation(family):
    model = build(family)
    blocks = find_moe_blocks(model)
    if family == "deepseek_v3":
        with torch.no_grad():  # a real correction bias, so ids differ from top-k of the logits
            for _, _, gate, _ in blocks:
                gate.e_score_correction_bias.uniform_(0, 0.5)
    seen, handles = _router_spy(model)
    with moescope.instrument(model, port=0, model_name=family) as inst:
        with torch.no_grad():
            model(torch.randint(3, 100, (2, 9)))  # prefill
            model(torch.randint(3, 100, (3, 1)))  # a decode-shaped forward
        parsed = parse(inst.exporter.exposition().decode())
    for h in handles:
        h.remove()
    got = by_label(parsed, "moescope_expert_tokens_total", "layer", "expert", model=family)
    adapter_layers = {int(layer) for layer, _ in got}
    assert len(adapter_layers) == len(blocks) > 0
    for (name, _, router, _), layer in zip(blocks, sorted(adapter_layers)):
        k = model.config.num_experts_per_tok
        n_exp = router.weight.shape[0]
        counts = torch.zeros(n_exp, dtype=torch.long)
        for x in seen[name]:
            counts += torch.bincount(_reference_ids(family, router, x, k, model.config).reshape(-1), minlength=n_exp)
        assert [got[(str(layer), str(e))] for e in range(n_exp)] == counts.tolist(), family
        assert sum_by_label(parsed, "moescope_router_tokens_total", "layer")[str(layer)] == 2 * 9 + 3
        assert by_label(parsed, "moescope_router_tokens_total", "forward_mode", layer=str(layer), model=family) == \
            {"prefill": 2 * 9, "decode": 3}  # the adapter's steps: two 9-token prompts, then 3 decode tokens
    steps = by_label(parsed, "moescope_steps_total", "phase")
    assert steps == {"prefill": 1.0, "decode": 1.0}


def test_deepseek_ids_are_not_top_k_of_logits():
    """Guard for the test above: with a correction bias the true ids differ from a naive top-k."""
    model = build("deepseek_v3")
    _, _, gate, _ = find_moe_blocks(model)[0]
    with torch.no_grad():
        gate.e_score_correction_bias.uniform_(0, 0.5)
    x = torch.randn(64, gate.weight.shape[1])
    naive = torch.topk(x.double() @ gate.weight.double().t(), gate.top_k, dim=-1).indices
    assert not torch.equal(deepseek_v3_reference_ids(gate, x, model.config).sort(-1).values, naive.sort(-1).values)


def test_unsupported_model_is_a_clear_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, vocab_size=100)
    with pytest.raises(BadInput, match="no MoE layers found in llama: looked for modules with an 'experts'"):
        moescope.instrument(AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_entropy_and_margin_follow_the_runtime_definitions(family):
    """Sigmoid routers (DeepSeek-V3): entropy of the sigmoid scores normalised to sum 1, margin of the two best
    sigmoid scores; softmax routers: of the softmax. Recomputed here from the router inputs in float64."""
    from moescope.capture.observer import Observer

    model = build(family)
    seen, handles = _router_spy(model)
    got = []

    class Spy(Observer):
        def on_routing(self, layer, decision):
            got.append((decision.entropy.clone(), decision.margin.clone()))

    from moescope.hf.hf_adapter import HFAdapter

    adapter = HFAdapter(model)
    adapter.attach(Spy())
    with torch.no_grad():
        model(torch.randint(3, 100, (2, 7)))
    adapter.detach()
    for h in handles:
        h.remove()
    want = []
    for name, _, router, _ in find_moe_blocks(model):
        x = seen[name][0]
        logits = x.reshape(-1, x.shape[-1]).double() @ router.weight.double().t()
        s = logits.sigmoid() if family == "deepseek_v3" else logits.softmax(-1)
        p = s / s.sum(-1, keepdim=True)
        top2 = s.topk(2, dim=-1).values
        want.append((-(p * p.log()).sum(-1) / torch.log(torch.tensor(float(s.shape[-1]))), top2[:, 0] - top2[:, 1]))
    assert len(got) == len(want) > 0
    for (e, m), (we, wm) in zip(got, want):
        torch.testing.assert_close(e.double(), we, atol=1e-5, rtol=0)
        torch.testing.assert_close(m.double(), wm, atol=1e-5, rtol=0)
