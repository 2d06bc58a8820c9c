"""The bundled demo model: loads from safetensors, and its experts specialise by text domain."""

import json

import torch

from moescope.runtime import loader, train, weights
from moescope.runtime.model import MoETransformer


def test_bundled_weights_load_and_match_the_model_card():
    model = loader.build_model("tiny-demo")
    card = json.loads(weights.DEMO_WEIGHTS.with_suffix(".json").read_text())
    assert card["config"] == model.cfg.to_dict()
    assert weights.DEMO_WEIGHTS.stat().st_size < 5_000_000  # "a few MB"


def test_experts_specialise_by_domain_more_than_an_untrained_model():
    trained = loader.build_model("tiny-demo")

    def mean_jsd(model):
        report = train.specialisation_report(train.expert_load_by_domain(model, tokens_per_domain=2048))
        return report["mean_pairwise_jsd_bits"]

    t = mean_jsd(trained)
    # Reference: untrained routers also separate domains somewhat (their bytes differ: ASCII vs UTF-8
    # multi-byte), ~0.05-0.15 bits per layer. Training must separate them clearly more.
    r = [sum(mean_jsd(MoETransformer(trained.cfg.replace(seed=s)).eval()).values()) / len(t) for s in (0, 1, 2)]
    assert all(v > 0.15 for v in t.values()), t
    assert sum(t.values()) / len(t) > 1.8 * (sum(r) / len(r)), (t, r)


def test_training_step_reduces_loss_and_save_load_round_trip(tmp_path):
    cfg = train.TrainConfig(steps=12, batch=4, seq_len=32, warmup=2)
    small = loader.build_model("tiny-demo", weights=None).cfg.replace(n_layers=2, dense_layers=(0,))
    model, info = train.train(small, cfg, log=lambda m: None)
    assert info["history"][-1]["ce"] < info["history"][0]["ce"]
    path = weights.save(model, tmp_path / "m.safetensors", dtype=torch.float32)
    again = loader.build_model(str(path))
    assert again.cfg == small
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
