"""The bundled demo model: loads from safetensors, and its experts specialise by text domain."""

import json

import torch

from moescope.capture.probes import ExpertLoadProbe
from moescope.runtime import loader, traffic, train, weights
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from reference import naive_load_cv


def test_bundled_weights_load_and_match_the_model_card():
    model = loader.build_model("tiny-demo")
    card = json.loads(weights.DEMO_WEIGHTS.with_suffix(".json").read_text())
    assert card["config"] == model.cfg.to_dict()
    assert weights.DEMO_WEIGHTS.stat().st_size < 5_000_000  # "a few MB"


def _dedication(load):
    """Per MoE layer: share of the busiest 'numbers' expert / the share code and prose give that expert."""
    out = []
    for layer, shares in load["numbers"].items():
        e = max(range(len(shares)), key=shares.__getitem__)
        out.append(shares[e] / ((load["code"][layer][e] + load["prose"][layer][e]) / 2))
    return out


def test_experts_specialise_by_domain_and_stay_balanced_overall():
    trained = loader.build_model("tiny-demo")
    # Numbers get an expert of their own in every MoE layer: its share for numbers is several times the
    # share code and prose give it. Reference: untrained routers of the same shape (byte statistics alone
    # make some layers look dedicated by chance, never all of them).
    assert min(_dedication(train.expert_load_by_domain(trained, tokens_per_domain=2048))) >= 3.0
    for seed in range(4):
        untrained = MoETransformer(trained.cfg.replace(seed=seed)).eval()
        assert min(_dedication(train.expert_load_by_domain(untrained, tokens_per_domain=2048))) < 3.0
    # ...while the load over the served traffic mix stays balanced (healthy CV < 0.15, the alert threshold).
    probe = ExpertLoadProbe()
    Engine(trained, max_batch=16, observer=[probe]).run(traffic.generate(traffic.TrafficConfig(seed=21), 120),
                                                        realtime=False)
    for layer, load in probe.snapshot().items():
        assert naive_load_cv(load) < 0.15, (layer, naive_load_cv(load))


def test_training_step_reduces_loss_and_save_load_round_trip(tmp_path):
    cfg = train.TrainConfig(steps=12, batch=4, seq_len=32, warmup=2)
    small = loader.build_model("tiny-demo", weights=None).cfg.replace(n_layers=2, dense_layers=(0,))
    model, info = train.train(small, cfg, log=lambda m: None)
    assert info["history"][-1]["ce"] < info["history"][0]["ce"]
    path = weights.save(model, tmp_path / "m.safetensors", dtype=torch.float32)
    again = loader.build_model(str(path))
    assert again.cfg == small
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
