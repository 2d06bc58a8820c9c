import json

import pytest

from moescope.errors import ConfigError
from moescope.runtime.model_config import PRESETS, MoEConfig, from_dict, load, resolve


@pytest.mark.parametrize("changes,message", [
    ({"top_k": 9}, "top_k (9) must be <= n_experts (8)"),
    ({"n_experts": 0}, "n_experts must be a positive integer"),
    ({"hidden_size": -4}, "hidden_size must be a positive integer"),
    ({"ffn_size": 0}, "ffn_size must be a positive integer"),
    ({"hidden_size": 30, "n_heads": 4}, "divisible by n_heads"),
    ({"hidden_size": 12, "n_heads": 4}, "must be even"),
    ({"dense_layers": (7,)}, "dense_layers [7] out of range"),
    ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
    ({"router_temperature": 0}, "router_temperature must be > 0"),
    ({"top_k": 1.5}, "top_k must be a positive integer"),
])
def test_invalid_configs_raise_clear_errors(changes, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**changes)
    assert message in str(err.value)


def test_presets_are_valid_and_shaped_as_documented():
    m = PRESETS["mixtral-block"]
    assert (m.hidden_size, m.ffn_size, m.n_experts, m.top_k) == (1024, 2816, 8, 2)
    t = PRESETS["tiny-demo"]
    assert t.moe_layers == (1, 2, 3) and t.dense_ffn == 256


def test_load_yaml_and_json(tmp_path):
    (tmp_path / "a.yaml").write_text("preset: tiny-demo\ncapacity_factor: 1.25\ntop_k: 1\n")
    cfg = load(tmp_path / "a.yaml")
    assert cfg.capacity_factor == 1.25 and cfg.top_k == 1 and cfg.hidden_size == 128
    (tmp_path / "b.json").write_text(json.dumps({"hidden_size": 64, "n_heads": 2, "dense_layers": [0]}))
    cfg = resolve(str(tmp_path / "b.json"))
    assert cfg.hidden_size == 64 and cfg.dense_layers == (0,)
    assert from_dict(cfg.to_dict()) == cfg  # round trip


def test_bad_config_files(tmp_path):
    (tmp_path / "bad.yaml").write_text("top_k: [\n")
    with pytest.raises(ConfigError, match="cannot parse config"):
        load(tmp_path / "bad.yaml")
    (tmp_path / "unk.json").write_text('{"experts": 8}')
    with pytest.raises(ConfigError, match="unknown config field.*experts"):
        load(tmp_path / "unk.json")
    with pytest.raises(ConfigError, match="cannot read config"):
        load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve("no-such-model")
    (tmp_path / "k.yaml").write_text("n_experts: 4\ntop_k: 6\n")
    with pytest.raises(ConfigError, match=r"top_k \(6\) must be <= n_experts \(4\)"):
        load(tmp_path / "k.yaml")


@pytest.mark.parametrize("changes,message", [
    ({"n_experts": 256, "top_k": 8, "n_group": 3}, "n_experts (256) must be divisible by n_group (3)"),
    ({"n_experts": 16, "n_group": 4, "topk_group": 5}, "topk_group (5) must be <= n_group (4)"),
    ({"n_experts": 16, "top_k": 6, "n_group": 4, "topk_group": 1},
     "top_k (6) must be <= the experts in the topk_group"),
    ({"scoring": "relu"}, "scoring must be one of softmax, sigmoid"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be > 0"),
    ({"n_shared_experts": -1}, "n_shared_experts must be an integer >= 0"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"n_group": 0}, "n_group must be an integer >= 1"),
])
def test_invalid_routing_configs_raise_clear_errors(changes, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**changes)
    assert message in str(err.value)


def test_production_shape_presets():
    ds = PRESETS["deepseek-v3-shape"]
    assert (ds.n_layers, len(ds.moe_layers), ds.moe_layers[0], ds.n_experts, ds.top_k) == (61, 58, 3, 256, 8)
    assert (ds.scoring, ds.n_group, ds.groups_kept, ds.correction_bias, ds.routed_scaling_factor) == \
        ("sigmoid", 8, 4, True, 2.5)
    assert ds.shared_ffn == ds.ffn_size and not ds.plain_topk
    qw = PRESETS["qwen3-moe-shape"]
    assert (len(qw.moe_layers), qw.n_experts, qw.top_k, qw.scoring, qw.norm_topk_prob) == (48, 128, 8, "softmax", True)
    assert qw.plain_topk and qw.shared_ffn == 0
    assert from_dict(ds.to_dict()) == ds
