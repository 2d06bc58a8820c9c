"""moescope's vLLM capture path survives graph replay: what a CUDA graph (or vLLM's compiled CPU graph) replays is
the recorded kernels only, never Python, so the only thing moescope may do inside the forward is tensor ops into
its preallocated step buffer (``moescope.vllm.capture``).

The proxy for a CUDA graph on CPU: the forward, with each MoE layer's router calling its capture function the way
vLLM's ``BaseRouter`` does (``capture_fn(topk_ids)`` after top-k), is traced once by ``make_fx`` into an ATen-only
graph and that graph is replayed N times on N different batches, each replay followed by the plugin's step read
(``VLLMAdapter.begin_step``/``end_step``, the same calls the execute_model wrapper makes). The exported
per-(layer, expert) counts must equal a recomputation of every batch's top-k in plain torch, and the per-layer
tokens N x rows. A Python side effect in the path (a sink, a numpy write) is not in the traced graph: its counts
go stale and the check fails (``test_a_python_side_effect_in_the_path_fails_the_check``); a Python-bodied custom
op in the graph would run Python on replay: the graph must hold ATen ops only. On a GPU
(``benchmarks/device_checks.sh``) the same forward is recorded in a ``torch.cuda.CUDAGraph`` and replayed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import moescope
from metrics_util import by_label, parse, sum_by_label
from moescope.vllm import capture
from moescope.vllm.vllm_adapter import VLLMAdapter

E, K, HIDDEN, LAYERS, ROWS = 8, 2, 16, 3, 12


class Router:
    """vLLM's ``BaseRouter`` as moescope uses it: a ``capture_fn`` slot and its setter (``set_capture_fn``)."""

    def __init__(self) -> None:
        self.capture_fn = None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn


class MoELayer(torch.nn.Module):
    """A ``MoERunner``'s routing: gate logits, top-k, the router's capture function (``base_router.py``:
    ``if self.capture_fn is not None: self.capture_fn(topk_ids)``), then the experts (one linear each here)."""

    def __init__(self, layer_id: int, device) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_name = f"model.layers.{layer_id}.mlp.experts"
        self.router = Router()
        self.moe_config = SimpleNamespace(num_experts=E, num_logical_experts=E, experts_per_token=K,
                                          hidden_dim=HIDDEN, intermediate_size=HIDDEN, device=device)
        self.gate = torch.nn.Linear(HIDDEN, E, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(E, HIDDEN, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, topk_ids = torch.topk(torch.softmax(self.gate(x), -1), K, dim=-1)  # [T, k]
        topk_ids = topk_ids.to(torch.int32)  # vLLM's routers hand int32 ids
        if self.router.capture_fn is not None:
            self.router.capture_fn(topk_ids)
        y = torch.einsum("th,tkhj->tj", x, self.experts[topk_ids.long()]) * weights.sum(-1, keepdim=True)
        return x + y / K


class Model(torch.nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MoELayer(i, device) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _reference_counts(model: Model, batches) -> dict[tuple[int, int], int]:
    """Every batch's top-k per layer recomputed in plain torch, no capture function bound."""
    saved = [layer.router.capture_fn for layer in model.layers]
    for layer in model.layers:
        layer.router.capture_fn = None
    counts: dict[tuple[int, int], int] = {}
    with torch.no_grad():
        for x in batches:
            h = x
            for layer in model.layers:
                ids = torch.topk(torch.softmax(layer.gate(h), -1), K, dim=-1).indices
                for e in ids.reshape(-1).tolist():
                    counts[(layer.layer_id, e)] = counts.get((layer.layer_id, e), 0) + 1
                h = layer(h)
    for layer, fn in zip(model.layers, saved):
        layer.router.capture_fn = fn
    return counts


def _scheduler_output(step: int, rows: int):
    """vLLM's ``SchedulerOutput`` fields the adapter reads: one request of ``rows`` tokens per step."""
    rid = f"cmpl-step{step}-0-0123abcd"
    new = SimpleNamespace(req_id=rid, prompt_token_ids=list(range(rows)), sampling_params=None, num_computed_tokens=0)
    return rid, SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=None, finished_req_ids=(),
                                num_scheduled_tokens={rid: rows}, total_num_scheduled_tokens=rows)


def _bound_model(device) -> tuple[Model, capture.StepBuffer]:
    torch.manual_seed(0)
    model = Model(device).to(device).eval()
    buf = capture.StepBuffer(ROWS + 4, LAYERS, K, device)  # rows past a step's own are padding: never read
    for layer in model.layers:
        assert capture.bind(layer, buf)
    return model, buf


def _replay_and_count(model: Model, buf, forward, batches) -> dict:
    """Run ``forward`` (a replay of the traced graph) on each batch, each followed by the plugin's step calls;
    the exporter's parsed exposition."""
    adapter = VLLMAdapter(model)
    with moescope.instrument(adapter, port=0, model_name="graph") as inst:
        for step, x in enumerate(batches):
            rid, out = _scheduler_output(step, x.shape[0])
            adapter.begin_step(out)
            forward(x)
            adapter.end_step(out, [rid])
        assert adapter.drain() and adapter.dropped == 0  # the relay's thread delivered every step
        inst.metrics.flush()
        return parse(inst.exporter.exposition().decode())


def _check(parsed, reference, n_batches: int) -> None:
    got = {(int(layer), int(e)): v for (layer, e), v in
           by_label(parsed, "moescope_expert_tokens_total", "layer", "expert", model="graph").items() if v}
    assert got == reference
    tokens = sum_by_label(parsed, "moescope_router_tokens_total", "layer", model="graph")
    assert tokens == {str(i): float(n_batches * ROWS) for i in range(LAYERS)}


def _aten_only(gm: torch.fx.GraphModule) -> None:
    """Every op of the traced graph is an ATen op: a replay runs kernels only, no Python body of ours."""
    import operator

    ops = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}
    assert ops and all(str(op).startswith("aten.") for op in ops), sorted(map(str, ops))


def _batches(n: int, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, HIDDEN, generator=gen).to(device) for _ in range(n)]


N = 6


def test_counts_survive_a_traced_graph_replayed_without_python():
    model, buf = _bound_model("cpu")
    batches = _batches(N, "cpu")
    with torch.no_grad():
        gm = make_fx(model)(batches[0])
    _aten_only(gm)
    assert any("copy" in str(n.target) for n in gm.graph.nodes), "the capture's copy is in the graph"
    parsed = _replay_and_count(model, buf, lambda x: gm(x), batches)
    _check(parsed, _reference_counts(model, batches), N)


def test_the_capture_compiles_into_one_graph():
    """torch.compile(fullgraph=True) raises on a graph break: the capture function is traceable as vLLM's compiled
    CPU forward needs it (no Python side effect, no graph break)."""
    model, buf = _bound_model("cpu")
    batches = _batches(N, "cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        parsed = _replay_and_count(model, buf, compiled, batches)
    _check(parsed, _reference_counts(model, batches), N)


def test_a_python_side_effect_in_the_path_fails_the_check(monkeypatch):
    """The check above can fail: a capture that writes the buffer through numpy (a Python side effect, invisible to
    tracing) records only the traced batch, and every replay reports its stale ids."""
    def numpy_record(ids, slot, topk_ids):
        n = topk_ids.shape[0]
        ids.numpy()[:n, slot] = topk_ids.numpy()

    monkeypatch.setattr(capture, "record", numpy_record)
    model, buf = _bound_model("cpu")
    batches = _batches(N, "cpu")
    with torch.no_grad():
        gm = make_fx(model)(batches[0])
    parsed = _replay_and_count(model, buf, lambda x: gm(x), batches)
    with pytest.raises(AssertionError):
        _check(parsed, _reference_counts(model, batches), N)


@pytest.mark.gpu
def test_counts_survive_a_cuda_graph_replay():
    """The same forward recorded in a torch.cuda.CUDAGraph (static input, warm-up on a side stream) and replayed on
    N batches copied into the static input: the counts equal the recomputation (benchmarks/device_checks.sh)."""
    model, buf = _bound_model("cuda")
    batches = _batches(N, "cuda")
    static = batches[0].clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static)

        def replay(x):
            static.copy_(x)
            graph.replay()

        parsed = _replay_and_count(model, buf, replay, batches)
    _check(parsed, _reference_counts(model, batches), N)


def test_the_summary_runs_off_the_engine_thread_and_counts_alike():
    """The routing summary runs on the instrumentation's evaluator thread: with the summary blocked (its listener
    waits on an event), the engine's steps still complete; once released, every count arrives, with no flush asked
    for (vLLM never reports going idle: the evaluator summarises the last steps at its next interval)."""
    import threading

    from helpers import wait_until

    model, buf = _bound_model("cpu")
    batches = _batches(N, "cpu")
    adapter = VLLMAdapter(model)
    with moescope.instrument(adapter, port=0, model_name="graph", interval_s=0.05) as inst:
        probe = inst.metrics.probe
        entered, release = threading.Event(), threading.Event()
        listener = probe._listener

        def blocked(stats):
            entered.set()
            release.wait(60)
            listener(stats)

        probe._listener = blocked
        with torch.no_grad():
            for step, x in enumerate(batches):
                rid, out = _scheduler_output(step, x.shape[0])
                adapter.begin_step(out)
                model(x)
                adapter.end_step(out, [rid])
                if step == 0:
                    assert entered.wait(30)  # the evaluator is inside a summary from the first step on...
        assert not release.is_set()  # ...and every step completed while it was held there
        release.set()
        parsed = wait_until(lambda: parse(inst.exporter.exposition().decode()), timeout=30,
                            what="every step summarised by the evaluator",
                            until=lambda p: sum_by_label(p, "moescope_router_tokens_total", "layer",
                                                         model="graph") == {str(i): float(N * ROWS)
                                                                            for i in range(LAYERS)})
    _check(parsed, _reference_counts(model, batches), N)
