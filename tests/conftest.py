import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # Demo runs in tests (and their subprocesses) write traces to a temporary store, not the user's home.
    import tempfile

    os.environ.setdefault("MOESCOPE_TRACES", os.path.join(tempfile.mkdtemp(prefix="moescope-test-"),
                                                          "traces.sqlite"))


# Modules that run alone (the second phase of .ci/pytest; the rest run three at a time under pytest-xdist): each runs
# several demos and real servers at once, sized for two cores, and judges detection or timing that a test beside
# it would starve (the matrix rows, the twenty 2-rank runs, diagnose's scenario demos, slow-rank attribution in
# demos and serve fleets, a hung rank told from a dead one by its heartbeats, the alert delivered within its
# `for`). (test_serve_fleet_faults judges no timing: its fleets wait on events, and it shares the machine well.)
SERIAL = {"test_detection_matrix", "test_lockstep_end", "test_diagnose", "test_parallel", "test_alerting_e2e",
          "test_serve_fleet"}


# Modules of tests that take minutes each, handed out first in their pass (pytest-xdist hands tests to its workers in
# collection order): a pass whose longest test starts last ends waiting on it alone.
LONG_FIRST = ("test_vllm_alerts",)


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: _module(item) not in LONG_FIRST)  # (stable: the rest keep their order)
    serial = pytest.mark.serial
    for item in items:
        if _module(item) in SERIAL:
            item.add_marker(serial)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cfg():
    from moescope.runtime.model_config import MoEConfig

    return MoEConfig(name="test-tiny", hidden_size=32, n_layers=3, n_heads=4, n_experts=6, top_k=2,
                     ffn_size=48, dense_layers=(0,), max_seq_len=128, seed=3)


@pytest.fixture
def deepseek_cfg():
    """DeepSeek-V3's routing at a test size: sigmoid, correction bias, 4 groups of 4 experts, top-2 groups,
    top-4, routed scaling 2.5, one shared expert, a dense first layer."""
    from moescope.runtime.model_config import MoEConfig

    return MoEConfig(name="test-deepseek", hidden_size=32, n_layers=3, n_heads=4, n_experts=16, top_k=4,
                     ffn_size=24, dense_layers=(0,), max_seq_len=128, seed=5, scoring="sigmoid", n_group=4,
                     topk_group=2, correction_bias=True, routed_scaling_factor=2.5, n_shared_experts=1)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def vllm_watched(tmp_path_factory):
    """``vllm_watched(name)``: the checkpoint ``name`` served once per session under the alerting path
    (tests/vllm_watch.py ``watch``), shared by every test that reads it; a watch that failed fails each of them
    with its error, never runs again."""
    import vllm_watch  # (a vLLM-pass helper: the main passes never import it)

    done: dict[str, object] = {}

    def get(name: str) -> "vllm_watch.Watched":
        if name not in done:
            try:
                done[name] = vllm_watch.watch(name, tmp_path_factory)
            except Exception as e:  # noqa: BLE001 (kept: every test sharing the watch fails with it)
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]

    return get
