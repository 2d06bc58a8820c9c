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
# Modules that run beside the serial phase at the lowest CPU priority (nice 19; .ci/pytest's lane), not in the
# parallel phase: CPU-heavy, judging no time (every benchmark's --quick run: a smoke run, its only deadline a generous
# timeout), they take the CPU the serial modules leave idle (measured: 26% of both cores over the serial phase, the
# demos waiting on their scrapes and `for`s), and a serial test's process always wins the CPU over them.
BESIDE_SERIAL = {"test_benchmarks"}


# Modules of tests that take minutes each, handed out first in their pass (pytest-xdist hands tests to its workers in
# collection order): a pass whose longest test starts last ends waiting on it alone.
LONG_FIRST = ("test_vllm_alerts",)


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def _xdist_group_suffix(config, items) -> None:
    """``--dist loadgroup`` (the vLLM pass): each test marked ``xdist_group(NAME)`` gets ``@NAME`` after its node id,
    which is what pytest-xdist's scheduler groups by. pytest-xdist 3.8 appends it by setting ``item._nodeid``, which
    pytest 9 no longer reads (a node's id is ``item._id``, a ``NodeId``): there, loadgroup grouped nothing, and a
    watch the group shares was served again on the other worker (measured in a vLLM pass: the hot-expert watch twice,
    135 s). Appended here the way the installed pytest holds it; left alone where xdist's own suffix took.
    ``vllm_watched`` fails a pass that serves one watch twice."""
    if not getattr(config.option, "loadgroup", False):  # (set on xdist's workers only, under --dist loadgroup)
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or item.nodeid.rfind("@") > item.nodeid.rfind("]"):
            continue
        grouped = f"{item.nodeid}@{'_'.join(names)}"
        if hasattr(item, "_id"):  # pytest >= 9: the id is a NodeId, parsed back from its string form
            item._id = type(item._id).parse(grouped)
        else:
            item._nodeid = grouped
        assert item.nodeid == grouped, (item.nodeid, grouped)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: _module(item) not in LONG_FIRST)  # (stable: the rest keep their order)
    _xdist_group_suffix(config, items)
    serial, beside = pytest.mark.serial, pytest.mark.beside_serial
    for item in items:
        if _module(item) in SERIAL:
            item.add_marker(serial)
        elif _module(item) in BESIDE_SERIAL:
            item.add_marker(beside)
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
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # (the pass' workers share it)

    def get(name: str) -> "vllm_watch.Watched":
        if name not in done:
            try:
                # once per pass, not per worker: the tests sharing a watch are one xdist group (one worker)
                try:
                    (shared / f"vllm-watch-{name}.served").touch(exist_ok=False)
                except FileExistsError:
                    raise RuntimeError(f"the {name!r} watch was served already by another worker of this pass: the "
                                       "tests that share it are not in one xdist group (tests/conftest.py "
                                       "_xdist_group_suffix)") from None
                done[name] = vllm_watch.watch(name, tmp_path_factory)
            except Exception as e:  # noqa: BLE001 (kept: every test sharing the watch fails with it)
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]

    return get
