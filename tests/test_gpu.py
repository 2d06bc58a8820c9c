"""CUDA checks (run where a GPU is lent: `pytest -m gpu`). Skipped without CUDA, like megablocks' gpu marker."""

import pytest
import torch

import moescope
from moescope.capture.observer import Observer
from moescope.runtime.model import MoETransformer, Segment

pytestmark = pytest.mark.gpu


class SyncGuard(Observer):
    """Runs the wrapped observer's in-forward hooks with CUDA sync debugging set to raise."""

    def __init__(self, inner):
        self.inner = inner

    def _guarded(self, fn, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def on_routing(self, layer, decision):
        self._guarded(self.inner.on_routing, layer, decision)

    def on_layer_time(self, layer, router_s, experts_s):
        self._guarded(self.inner.on_layer_time, layer, router_s, experts_s)

    def on_step(self, step):
        self.inner.on_step(step)  # the interval flush copies to the host by design (once per interval)


def test_capture_hooks_never_sync_and_counts_are_exact_on_cuda(tiny_cfg):
    model = MoETransformer(tiny_cfg).cuda().eval()
    with moescope.instrument(model) as inst:
        model.observer = SyncGuard(inst.observer)
        tokens = torch.randint(0, 256, (64,), device="cuda")
        with torch.no_grad():
            out = model(tokens, [Segment(64)])
        inst.metrics.flush()
        for layer, d in out.decisions.items():
            want = torch.bincount(d.ids.reshape(-1).cpu(), minlength=tiny_cfg.n_experts).tolist()
            assert inst.metrics.expert_tokens[layer].tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_router_kernel_on_cuda_equals_the_reference():
    pytest.importorskip("triton")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import triton_router_check

    triton_router_check.main("cuda")


def _decoders(tiny_cfg, dtype, mode):
    from moescope.runtime.graph_decode import StaticDecoder

    torch.manual_seed(0)
    model = MoETransformer(tiny_cfg).to("cuda", dtype).eval()
    prompts = ([5, 9, 77, 3, 120], [200, 1, 13], [60, 61, 62, 63])
    caches = [model.new_cache() for _ in prompts]
    with torch.no_grad():
        model(torch.tensor([t for p in prompts for t in p], device="cuda"),
              [Segment(len(p), c) for p, c in zip(prompts, caches)])
    decs = [StaticDecoder(model, len(prompts), experts=mode) for _ in range(2)]
    for d in decs:
        for slot, c in enumerate(caches):
            d.load(slot, c)
    return model, decs, torch.tensor([c.length for c in caches], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "dense"), (torch.bfloat16, "auto")])
def test_counts_inside_a_replayed_cuda_graph_equal_a_recomputation(tiny_cfg, dtype, mode):
    from moescope.metrics.state import MetricsObserver
    from moescope.runtime.engine_adapter import RuntimeEngine
    from moescope.runtime.graph_decode import GraphCollector

    model, (eager, graphed), positions = _decoders(tiny_cfg, dtype, mode)
    graphed.capture()
    metrics = MetricsObserver(RuntimeEngine(model).model_info("t"))
    collector = GraphCollector(graphed.counters, metrics.on_stats)
    tokens = torch.tensor([7, 8, 9], device="cuda")
    steps = 12
    torch.cuda.set_sync_debug_mode("error")  # the replayed step and the collector never wait on the device
    try:
        for i in range(steps):
            got = graphed.step(tokens, positions + i)
            collector.collect()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphed.replays == steps
    for i in range(steps):
        want = eager.step(tokens, positions + i)
    torch.testing.assert_close(got, want)
    assert torch.equal(graphed.counters.slots, eager.counters.slots)  # the recomputation: the same step, eager
    assert graphed.counters.sums[:, 0].tolist() == [steps] * len(graphed.counters.layers)
    collector.flush()
    for row, layer in enumerate(graphed.counters.layers):
        assert metrics.expert_tokens[layer].tolist() == \
            eager.counters.slots[row, : tiny_cfg.n_experts].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_times_come_from_cuda_events_without_waiting(tiny_cfg):
    class Times(Observer):
        def __init__(self):
            self.seen = []

        def on_layer_time(self, layer, router_s, experts_s):
            self.seen.append((layer, router_s, experts_s))

    model = MoETransformer(tiny_cfg).cuda().eval()
    model.observer = obs = Times()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randint(0, 256, (64,), device="cuda"), [Segment(64)])
    torch.cuda.synchronize()
    with torch.no_grad():
        model(torch.randint(0, 256, (64,), device="cuda"), [Segment(64)])
    n_moe = len(model.moe_layers())
    assert len(obs.seen) >= 5 * n_moe  # every forward's layers, resolved once their events completed
    assert all(0 < r < 1 and 0 < e < 1 for _, r, e in obs.seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_serving_with_graph_decode_counts_like_eager():
    from moescope.metrics.state import MetricsObserver
    from moescope.runtime.engine_adapter import RuntimeEngine
    from moescope.runtime import loader
    from moescope.runtime.engine import Engine
    from moescope.runtime.traffic import TrafficRequest

    prompts = ["def add(a, b):", "The capital of France is", "12 + 30 =", "Once upon a time", "SELECT * FROM"]
    requests = [TrafficRequest(i, 0.0, p, 12, "code", "t") for i, p in enumerate(prompts)]
    seen = {}
    for mode in ("eager", "graph"):
        model = loader.build_model("tiny-demo", device="cuda")
        metrics = MetricsObserver(RuntimeEngine(model).model_info("tiny-demo"))
        engine = Engine(model, max_batch=4, observer=[metrics], decode=mode)
        records = engine.run(requests, realtime=False)
        engine.close()
        seen[mode] = ({r.prompt: r.output_tokens for r in records}, metrics)
        if mode == "graph":
            assert engine._decoder.replays > 0
    (eager_out, eager_m), (graph_out, graph_m) = seen["eager"], seen["graph"]
    agree = sum(a == b for p in eager_out for a, b in zip(eager_out[p], graph_out[p]))
    assert agree >= 0.95 * sum(len(v) for v in eager_out.values())  # fp32 on CUDA: kernels may round apart
    if graph_out == eager_out:  # then the routing was the same too, and so must the counts be
        for layer, want in eager_m.expert_tokens.items():
            assert graph_m.expert_tokens[layer].tolist() == want.tolist()


@pytest.mark.parametrize("layout", ["round-robin", "rebalance"])
def test_cuda_ranks_equal_the_single_process_model_on_their_own_requests(tiny_cfg, tmp_path, layout):
    """Two data-parallel ranks computing on CUDA (this machine's GPUs, shared when there is one), exchanging
    through gloo over host memory: each rank's logits equal the single-process CUDA model's on its tokens (to
    float tolerance: a rank's experts compute a different set of rows at once) and its greedy outputs equal it;
    with EPLB moving weights between the ranks' GPUs too."""
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent))
    import parallel_worker
    from servers import free_port

    from moescope.runtime.engine import Engine

    cfg = tiny_cfg.replace(n_experts=8)
    mp.spawn(parallel_worker.run, args=(2, free_port(), cfg.to_dict(), layout, str(tmp_path), "cuda"), nprocs=2)
    model = MoETransformer(cfg).eval().cuda()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        tokens = parallel_worker.forward_tokens(r).cuda()
        with torch.no_grad():
            want = model(tokens, [Segment(len(tokens))]).logits.cpu()
        torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
        records = Engine(model, max_batch=3).run(parallel_worker.requests(r, 2), realtime=False, id_prefix="t-")
        assert [tuple(o) for o in got["outputs"]] == [x.output_tokens for x in records], r
        if layout == "rebalance":
            assert got["rebalances"], "EPLB never rearranged: the weight moves were not exercised"


def test_demo_world_size_2_on_cuda_serves_on_the_gpu_and_counts_every_token_once(tmp_path):
    """`moescope demo --world-size 2 --device cuda` at deepseek-v3-shape: both ranks serve on CUDA (NCCL when
    each has a GPU of its own, else gloo through host memory), and the fleet's expert load is tokens x k."""
    import json
    import subprocess
    import sys

    n_gpus = torch.cuda.device_count()
    run = subprocess.run([sys.executable, "-m", "moescope", "demo", "--no-tui", "--world-size", "2", "--device",
                          "cuda", "--model", "deepseek-v3-shape", "--requests", "6", "--rate", "0", "--traces",
                          "none", "--metrics-port", "-1", "--json"], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(run.stdout)
    assert s["completed"] == 6
    assert [r["device"] for r in s["ranks"]] == [f"cuda:{r % n_gpus}" for r in range(2)]
    assert {r["backend"] for r in s["ranks"]} == {"nccl" if n_gpus >= 2 else "gloo"}
    fed = sum(r["tokens"]["prompt"] + r["tokens"]["output"] - r["completed"] for r in s["ranks"])
    for counts in s["expert_load"].values():
        assert sum(counts) == fed * s["top_k"]
