"""`--weights auto` for models without weights: a seeded init whose routing is balanced on calibration traffic,
judged on other traffic than it was calibrated on; cached, deterministic; faults still bite on top of it."""

import math
import os

import pytest
import torch
from helpers import run_cli_ok

from moescope.runtime import balance, faults, loader, routers_cache, tokenizer, traffic
from moescope.runtime.model_config import PRESETS
from moescope.runtime.model import MoETransformer, Segment
from reference import naive_dead_experts, naive_load_cv, naive_top_share

# deepseek-v3-shape's routing (256 experts, top-8, 8 groups top-4, sigmoid + bias, shared expert) at 6 layers
SHAPE = PRESETS["deepseek-v3-shape"].replace(name="ds-test", n_layers=4, dense_layers=(0,))


def _served_load(model, n_requests=40):
    """Per MoE layer, the expert load of a batch of served traffic (seed 1, never the calibration's)."""
    reqs = traffic.generate(traffic.TrafficConfig(seed=1), n_requests)
    ids = [tokenizer.encode(r.prompt) for r in reqs]
    with torch.inference_mode():
        out = model(torch.tensor([t for s in ids for t in s]), [Segment(len(s)) for s in ids])
    return {layer: torch.bincount(d.ids.reshape(-1), minlength=d.n_experts).tolist()
            for layer, d in out.decisions.items()}, sum(map(len, ids))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("cache")
        mp.setenv("MOESCOPE_CACHE", str(root))
        yield root / "balanced-routers"


@pytest.fixture(scope="module")
def balanced(cache_dir):
    """The balanced model (computed once for the module, which also fills the cache)."""
    model = MoETransformer(SHAPE).eval()
    balance.balanced_init(model, seed=SHAPE.seed)
    return model


def _assert_balanced(model, below: float = 0.5) -> list[float]:
    """The balance bar on served traffic: every layer's load CV under ``below`` and above the sampling noise
    floor (what is left is structural), at most 2 dead experts, the correction bias at work. Returns the CVs."""
    cfg = model.cfg
    load, n_tokens = _served_load(model)
    floor = math.sqrt((cfg.n_experts - 1) / (n_tokens * cfg.top_k))  # multinomial sampling noise
    cv = [naive_load_cv(v) for v in load.values()]
    assert max(cv) < below and min(cv) > floor, (min(cv), max(cv), floor)
    assert max(naive_dead_experts(v) for v in load.values()) <= 2
    # the correction bias does the balancing it does in DeepSeek-V3: non-zero after calibration
    assert all(float(m.router.e_score_correction_bias.abs().max()) > 0.01 for m in model.moe_layers())
    return cv


def test_balanced_init_is_far_more_balanced_than_random_on_other_traffic(balanced):
    raw_load, _ = _served_load(MoETransformer(SHAPE).eval())
    raw_cv = [naive_load_cv(v) for v in raw_load.values()]
    assert min(raw_cv) > 0.8  # a random router favours a few experts for every token
    _assert_balanced(balanced, below=min(0.5, min(raw_cv) / 2))


def test_the_shipped_deepseek_v3_shape_routers_load_without_calibrating_and_hold_the_bar(tmp_path, monkeypatch,
                                                                                         capfd):
    """A first run at deepseek-v3-shape loads the routers shipped in the package (no calibration, nothing
    cached) and they pass the balance bar at the full shape. Fails after a BALANCE_VERSION bump until the file
    is regenerated (`python -m moescope.runtime.balance`)."""
    monkeypatch.setenv("MOESCOPE_CACHE", str(tmp_path))
    cfg = PRESETS["deepseek-v3-shape"]
    shipped = routers_cache.found(cfg, cfg.seed)
    assert [p.parent for p in shipped] == [routers_cache.SHIPPED] and shipped[0].stat().st_size < 2_000_000
    model = MoETransformer(cfg).eval()
    model.blocks[5].ffn.router.weight.data.zero_()  # only the file can restore it without a calibration
    capfd.readouterr()
    routers_cache.announce("deepseek-v3-shape", "auto")
    balance.balanced_init(model, seed=cfg.seed)
    err = capfd.readouterr().err
    assert "its balanced routers shipped with moescope" in err and "first build" not in err and "balancing" not in err
    assert not (tmp_path / "balanced-routers").exists()
    _assert_balanced(model)
    routers_cache.announce("qwen3-moe-shape", "auto")  # neither shipped nor cached here
    assert "building qwen3-moe-shape (48 layers x 128 experts): first build" in capfd.readouterr().err


def test_a_first_build_says_so_before_importing_torch_and_a_second_loads_the_cache(tmp_path):
    """The first progress line of a first build comes before torch's import (seconds on a loaded machine), then
    the calibration's own start and done lines; the next run of the shape says nothing of it."""
    spec = tmp_path / "ds3.yaml"
    spec.write_text("preset: deepseek-v3-shape\nname: ds-first\nn_layers: 3\ndense_layers: [0]\n")
    env = {**os.environ, "MOESCOPE_CACHE": str(tmp_path / "cache"), "PYTHONPROFILEIMPORTTIME": "1"}
    args = ("demo", "--model", spec, "--requests", "2", "--rate", "0", "--metrics-port", "-1", "--traces", "none")
    err = run_cli_ok(*args, env=env).stderr.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("moescope: building ds-first (3 layers x 256 "
                                                                       "experts): first build of its shape"))
    # -X importtime's line for torch (indented under whichever module imported it)
    torch_import = next(i for i, line in enumerate(err) if line.startswith("import time:")
                        and line.rsplit("|", 1)[1].strip() == "torch")
    assert first < torch_import
    assert any("balancing ds-first's routers" in line and "done in" in line for line in err[torch_import:])
    again = run_cli_ok(*args, env={**env, "PYTHONPROFILEIMPORTTIME": ""}).stderr
    assert "building ds-first (3 layers x 256 experts; its balanced routers cached in" in again
    assert "first build" not in again and "balancing" not in again


def test_balanced_init_is_cached_and_deterministic(cache_dir, balanced):
    a = balanced
    files = list(cache_dir.glob("routers-*.safetensors"))
    assert len(files) == 1 and files[0].stat().st_size < 2_000_000  # routers only
    b = MoETransformer(SHAPE).eval()
    b.blocks[1].ffn.router.weight.data.zero_()  # proof that the cached values, not leftovers, are used
    balance.balanced_init(b, seed=SHAPE.seed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    files[0].write_bytes(b"garbage")  # an unreadable cache is only a slower start
    c = MoETransformer(SHAPE).eval()
    balance.balanced_init(c, seed=SHAPE.seed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_a_capacity_limit_serves_the_same_balanced_routers_from_the_same_cache(cache_dir, balanced):
    """Capacity is a serving setting (the drop fault sets it): same weights as the healthy model, no rebuild."""
    before = sorted(cache_dir.glob("routers-*.safetensors"))
    limited = MoETransformer(SHAPE.replace(capacity_factor=0.5)).eval()
    limited.blocks[1].ffn.router.weight.data.zero_()  # only the cache can restore it without a rebuild
    balance.balanced_init(limited, seed=SHAPE.seed)
    assert sorted(cache_dir.glob("routers-*.safetensors")) == before
    assert all(torch.equal(x, y) for x, y in zip(balanced.state_dict().values(), limited.state_dict().values()))
    assert all(m.router.capacity_factor == 0.5 for m in limited.moe_layers())  # the limit itself is kept


def test_loader_auto_balances_and_random_does_not(balanced, tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("preset: deepseek-v3-shape\nname: ds-test\nn_layers: 4\ndense_layers: [0]\n")
    auto = loader.build_model(str(path))  # the same config and seed: the cached routers
    raw = loader.build_model(str(path), weights=None)
    assert torch.equal(auto.blocks[1].ffn.router.weight, balanced.blocks[1].ffn.router.weight)
    assert not torch.equal(auto.blocks[1].ffn.router.weight, raw.blocks[1].ffn.router.weight)
    assert torch.equal(auto.blocks[1].ffn.experts.gate_up_proj, raw.blocks[1].ffn.experts.gate_up_proj)


def test_a_renamed_config_of_the_same_shape_reuses_the_cached_routers(cache_dir, balanced, capfd):
    """The name is a label: a user's own name for the same shape and seed loads the routers cached for it (no
    second calibration, no second file); a new shape calibrates once, saying so on stderr."""
    before = sorted(cache_dir.glob("routers-*.safetensors"))
    renamed = MoETransformer(SHAPE.replace(name="acme-prod")).eval()
    renamed.blocks[1].ffn.router.weight.data.zero_()  # only the cache can restore it without a calibration
    capfd.readouterr()
    balance.balanced_init(renamed, seed=SHAPE.seed)
    assert "balancing" not in capfd.readouterr().err
    assert sorted(cache_dir.glob("routers-*.safetensors")) == before
    assert all(torch.equal(x, y) for x, y in zip(balanced.state_dict().values(), renamed.state_dict().values()))
    other = MoETransformer(SHAPE.replace(name="acme-small", n_layers=2)).eval()
    balance.balanced_init(other, seed=SHAPE.seed)
    err = capfd.readouterr().err  # not a terminal: a line at the start and one at the end
    assert "balancing acme-small's routers" in err and "done in" in err
    assert len(list(cache_dir.glob("routers-*.safetensors"))) == len(before) + 1


@pytest.mark.parametrize("scenario", ["collapse", "imbalance"])
def test_router_faults_bite_on_the_balanced_deepseek_shape(balanced, scenario):
    model = MoETransformer(SHAPE).eval()
    model.load_state_dict(balanced.state_dict())
    healthy, n_tokens = _served_load(model)
    faults.apply(model, [scenario])
    faulty, _ = _served_load(model)
    for layer in healthy:
        if scenario == "collapse":  # expert 0 in (nearly) every token's top-8; a token whose other groups
            # hold two experts scoring higher than expert 0's group pair still routes around it
            assert naive_top_share(faulty[layer], n_tokens) > 0.9 > 5 * naive_top_share(healthy[layer], n_tokens)
            assert max(range(SHAPE.n_experts), key=faulty[layer].__getitem__) == 0
        else:
            assert naive_load_cv(faulty[layer]) > 2 * naive_load_cv(healthy[layer])


@pytest.mark.parametrize("max_seq_len, shape", [(64, {}), (200, {"n_experts": 5, "top_k": 3, "n_layers": 3})])
def test_a_short_context_config_builds_and_serves(cache_dir, tmp_path, max_seq_len, shape):
    """Any valid config builds: the first build's calibration prompts are cut to the model's context (a prompt of
    222 tokens once failed a max_seq_len of 200 with a traceback), and the model then serves a request."""
    import yaml

    from moescope.runtime.engine import Engine

    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump({"preset": "tiny-demo", "name": f"short-{max_seq_len}",
                                    "max_seq_len": max_seq_len, "seed": 11, **shape}))
    model = loader.build_model(str(path))  # not the shipped weights: a seeded init balanced here
    assert model.cfg.max_seq_len == max_seq_len
    requests = traffic.generate(traffic.TrafficConfig(seed=2), 2)
    records = Engine(model, max_batch=2).run(requests, realtime=False)
    assert len(records) == 2 and all(r.n_output >= 1 for r in records)
    assert all(len(r.prompt_tokens) + r.n_output <= max_seq_len for r in records)
