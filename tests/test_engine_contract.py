"""[contract] 1: the engine contract (``moescope.capture.engine_contract.EngineContract``) and the three engines
under it.

One test body, parametrised over the reference runtime, a tiny HF transformers model (built offline from a config)
and the vLLM adapter (driven on CPU without a server: a model whose MoE layers call their router's capture function
as vLLM's ``BaseRouter`` does, and the scheduler's outputs the plugin's ``execute_model`` wrapper passes on). Each
must satisfy the Protocol, statically (every member present, with a compatible signature, read off the Protocol
class by ``inspect``) and at runtime (``isinstance``), and behave as the contract says: after ``instrument`` its
steps arrive as ``StepRecord``s whose tokens add up to the tokens the test fed the model (counted by the test's own
forward hook on the model), whose request ids are the ones the test submitted, each request's positions contiguous
from 0; and after ``close`` (the engine's ``detach``) nothing more arrives.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import moescope
from moescope.api import Instrumentation, as_engine
from moescope.capture.engine_contract import FEATURES, EngineContract, ModelInfo
from moescope.capture.observer import Observer
from moescope.capture.records import StepRecord

# -- the Protocol, read off its class (not off any engine) ----------------------------------------------------------


def _protocol_members() -> tuple[dict[str, inspect.Signature], dict[str, object]]:
    """(methods: name -> signature, data members: name -> annotation) the Protocol declares."""
    methods = {n: inspect.signature(v) for n, v in vars(EngineContract).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    data = dict(vars(EngineContract).get("__annotations__", {}))
    return methods, data


def _signature_problems(cls) -> list[str]:
    """Where ``cls`` does not offer what the Protocol declares: a missing member, a parameter missing or of another
    kind, a default the Protocol has and ``cls`` lacks, a required parameter the Protocol does not pass."""
    methods, data = _protocol_members()
    problems = []
    for name in data:
        if not hasattr(cls, name):
            problems.append(f"no attribute {name}")
    for name, want in methods.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            problems.append(f"no method {name}")
            continue
        got = inspect.signature(fn).parameters
        for p in want.parameters.values():
            q = got.get(p.name)
            if q is None:
                problems.append(f"{name}: no parameter {p.name}")
            elif q.kind != p.kind:
                problems.append(f"{name}: {p.name} is {q.kind.description}, not {p.kind.description}")
            elif p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
                problems.append(f"{name}: {p.name} has no default")
        for q in got.values():
            if q.name not in want.parameters and q.default is inspect.Parameter.empty \
                    and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
                problems.append(f"{name}: requires {q.name}, which moescope never passes")
    return problems


def test_the_protocol_declares_what_moescope_asks():
    methods, data = _protocol_members()
    assert set(methods) == {"model_info", "attach", "detach", "setup", "register_sources"}
    assert set(data) == {"features", "flushes_when_idle"}
    assert {"model_info", "attach", "detach"} <= EngineContract.__abstractmethods__  # what every engine must write


def test_the_checks_can_fail():
    """A class missing ``attach`` is not an EngineContract, and a wrong ``attach`` signature is reported."""

    class NoAttach:
        features, flushes_when_idle = frozenset(), False

        def model_info(self, name=None): ...

        def detach(self): ...

        def setup(self, config, stack): ...

        def register_sources(self, sources): ...

    class WrongAttach(NoAttach):
        def attach(self): ...

    assert not isinstance(NoAttach(), EngineContract)
    assert _signature_problems(NoAttach) == ["no method attach"]
    assert _signature_problems(WrongAttach) == ["attach: no parameter observer"]


# -- the three engines ------------------------------------------------------------------------------------------------


class Spy(Observer):
    def __init__(self) -> None:
        self.steps: list = []
        self.requests: list = []
        self.routed = 0

    def on_routing(self, layer, decision) -> None:
        self.routed += 1

    def on_step(self, step) -> None:
        self.steps.append(step)

    def on_request(self, request) -> None:
        self.requests.append(request)


@dataclass
class Case:
    """One engine driven by the test. ``target`` goes to ``instrument``; ``module`` is the torch module the test
    counts fed tokens on; ``run(inst)`` drives a few steps and returns {request id: tokens fed} (empty for an engine
    without requests); ``again()`` drives one more step after the instrumentation closed; ``finished``: the request
    ids that must have been reported finished; ``settle``: waits for an adapter's own delivery thread."""

    target: object
    module: torch.nn.Module
    run: Callable
    again: Callable
    finished: set = field(default_factory=set)
    settle: Callable = lambda: None
    kv: list | None = None  # each step's expected kv_tokens, where the test knows them
    tokens: Callable = lambda x: int(x.numel())  # tokens in the module's first input (token ids)


def _runtime(tiny_cfg) -> Case:
    from moescope.runtime.model import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(tiny_cfg).eval()
    prompts = {"req-a": [5, 6, 7, 8, 9], "req-b": [11, 12, 13]}
    new_tokens = 3
    state = {}

    def run(inst):
        engine = state["engine"] = inst.engine(max_batch=4)
        for rid, ids in prompts.items():
            engine.submit("", request_id=rid, prompt_ids=ids, max_new_tokens=new_tokens, ignore_eos=True)
        while engine.has_work:
            engine.step()
        # fed: the prompt, then each generated token but the last (never fed back)
        return {rid: len(ids) + new_tokens - 1 for rid, ids in prompts.items()}

    def again():
        engine = state["engine"]
        engine.submit("", request_id="req-c", prompt_ids=[3, 4], max_new_tokens=2, ignore_eos=True)
        while engine.has_work:
            engine.step()

    return Case(model, model, run, again, finished=set(prompts))


def _hf() -> Case:
    from hf_models import build

    model = build("qwen3_moe")
    gen = torch.Generator().manual_seed(0)

    # the cache's name: ``cache`` in transformers 5.x, ``past_key_values`` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(inst):
        with torch.no_grad():
            out = model(torch.randint(3, 100, (2, 5), generator=gen))  # a prefill of two 5-token prompts
            for _ in range(2):  # two decode steps on its cache
                out = model(torch.randint(3, 100, (2, 1), generator=gen), **{name: out[name]})
        return {}  # a HF model driven forward by forward has no requests

    def again():
        with torch.no_grad():
            model(torch.randint(3, 100, (1, 4), generator=gen))

    # positions in the KV cache after each step: 2 rows x 5, then x 6, x 7
    return Case(model, model, run, again, kv=[10, 12, 14])


E, K, HIDDEN = 8, 2, 16


class _Router:
    """vLLM's ``BaseRouter`` as moescope uses it: a ``capture_fn`` slot and its setter."""

    def __init__(self) -> None:
        self.capture_fn = None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn


class _VLLMMoE(torch.nn.Module):
    """A ``MoERunner``'s routing: gate, top-k, the router's capture function, the experts."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.router = _Router()
        self.moe_config = SimpleNamespace(num_experts=E, num_logical_experts=E, experts_per_token=K,
                                          hidden_dim=HIDDEN, intermediate_size=HIDDEN)
        self.gate = torch.nn.Linear(HIDDEN, E, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(E, HIDDEN, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(torch.softmax(self.gate(x), -1), K, dim=-1)
        if self.router.capture_fn is not None:
            self.router.capture_fn(ids.to(torch.int32))
        return x + torch.einsum("th,tkhj->tj", x, self.experts[ids]) * weights.sum(-1, keepdim=True) / K


class _VLLMModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_VLLMMoE(i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _vllm() -> Case:
    from moescope.vllm import capture
    from moescope.vllm.vllm_adapter import VLLMAdapter

    torch.manual_seed(0)
    model = _VLLMModel().eval()
    buf = capture.StepBuffer(16, 2, K, "cpu")
    for layer in model.layers:
        assert capture.bind(layer, buf)
    adapter = VLLMAdapter(model)
    a, b = "cmpl-a-0-0123abcd", "cmpl-b-0-89abcdef"  # engine ids; the client sees cmpl-a, cmpl-b
    prompts = {a: [1, 2, 3, 4, 5], b: [6, 7, 8]}

    def new(rid):
        return SimpleNamespace(req_id=rid, prompt_token_ids=prompts[rid], sampling_params=None, num_computed_tokens=0)

    def output(scheduled, new_reqs=(), cached=None, finished=()):
        return SimpleNamespace(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=cached,
                               finished_req_ids=set(finished), num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()))

    def step(out, order):
        adapter.begin_step(out, lambda engine_id, n: list(range(100, 100 + n)))
        with torch.no_grad():
            model(torch.randn(out.total_num_scheduled_tokens, HIDDEN))
        adapter.end_step(out, order)

    def run(inst):
        step(output({a: 5, b: 3}, new_reqs=[new(a), new(b)]), [a, b])  # both prompts
        step(output({a: 1, b: 1}, cached=SimpleNamespace(req_ids=[a, b], num_computed_tokens=[5, 3])), [a, b])
        # a finished (the scheduler says so at the next step); b decodes on
        step(output({b: 1}, cached=SimpleNamespace(req_ids=[b], num_computed_tokens=[4]), finished=[a]), [b])
        return {"cmpl-a": 6, "cmpl-b": 5}

    def again():
        step(output({b: 1}, cached=SimpleNamespace(req_ids=[b], num_computed_tokens=[5])), [b])

    return Case(adapter, model, run, again, finished={"cmpl-a"}, settle=adapter.drain,
                tokens=lambda x: int(x.shape[0]))  # [rows, hidden]: a row per scheduled token


@pytest.fixture(params=["runtime", "hf", "vllm"])
def case(request, tiny_cfg) -> Case:
    return {"runtime": lambda: _runtime(tiny_cfg), "hf": _hf, "vllm": _vllm}[request.param]()


def test_each_engine_satisfies_the_protocol(case):
    adapter = as_engine(case.target)
    assert isinstance(adapter, EngineContract)
    assert _signature_problems(type(adapter)) == []
    assert adapter.features <= FEATURES and isinstance(adapter.flushes_when_idle, bool)
    for name in ("model_info", "attach", "detach"):  # written by the engine, not left to the Protocol's stub
        assert getattr(type(adapter), name) is not getattr(EngineContract, name), name
    info = adapter.model_info("named")
    assert isinstance(info, ModelInfo) and info.name == "named"
    assert info.n_experts > 0 and 0 < info.top_k <= info.n_experts and info.moe_layers


def test_each_engine_reports_steps_with_request_ids_until_detached(case):
    fed = []
    hook = case.module.register_forward_pre_hook(lambda module, args: fed.append(case.tokens(args[0])))
    spy = Spy()
    try:
        with moescope.instrument(case.target, observers=[spy]) as inst:
            assert isinstance(inst.adapter, EngineContract)
            per_request = case.run(inst)
            case.settle()
        tokens_fed, forwards = sum(fed), len(fed)
        steps = list(spy.steps)
        assert steps and all(type(s) is StepRecord for s in steps)
        assert [s.index for s in steps] == sorted(s.index for s in steps)
        assert sum(s.n_tokens for s in steps) == tokens_fed
        seen: dict[str, int] = {}
        for s in steps:
            if s.segments:
                assert sum(n for _, _, n in s.segments) == s.n_tokens
            for rid, first, n in s.segments:  # each request's positions run on from where it stood
                assert first == seen.get(rid, 0), (rid, first)
                seen[rid] = first + n
        assert seen == per_request
        assert {r.request_id for r in spy.requests} == case.finished
        if case.kv is not None:
            assert [s.kv_tokens for s in steps] == case.kv
        n_steps, n_routed = len(spy.steps), spy.routed
        assert n_routed > 0
        case.again()  # the model runs on, detached
        case.settle()
        assert len(fed) > forwards  # it did run
        assert (len(spy.steps), spy.routed) == (n_steps, n_routed)
    finally:
        hook.remove()


def test_wire_names_no_engine():
    """``_wire`` talks to the contract only: the one place that knows the engines is ``as_engine``."""
    source = inspect.getsource(Instrumentation._wire)
    for name in ("MoETransformer", "HFAdapter", "VLLMAdapter", "RuntimeEngine", "moescope.runtime", "moescope.hf",
                 "moescope.vllm", "runtime."):
        assert name not in source, name


def test_design_md_shows_the_protocols_text():
    """docs/design.md's contract block is the Protocol's declarations as written in the module, one for one."""
    import re
    from pathlib import Path

    import moescope.capture.engine_contract as contract

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "design.md").read_text()
    block = re.search(r"## The engine contract\n.*?```python\n(.*?)```", doc, re.S).group(1)
    shown = [line.strip() for line in block.splitlines() if line.strip()]
    source = {line.strip() for line in inspect.getsource(contract).splitlines()}
    assert [line for line in shown if line not in source] == []
    methods, data = _protocol_members()
    declared = {line.split("(")[0].removeprefix("def ") for line in shown if line.startswith("def ")}
    declared |= {line.split(":")[0] for line in shown if not line.startswith(("def ", "@", "class "))}
    assert declared == set(methods) | set(data)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_feature_the_engine_lacks_is_refused_before_it_is_attached(engine, tiny_cfg):
    """The runtime takes every feature; the others none: a config asking for the cache or the canary is one clear
    error, raised before the engine is attached (the model keeps no hook of ours, the adapter no observer)."""
    from moescope.config import Cache, Canary
    from moescope.errors import BadInput
    from moescope.runtime.model import MoETransformer

    assert as_engine(MoETransformer(tiny_cfg)).features == FEATURES
    case = {"hf": _hf, "vllm": _vllm}[engine]()
    assert as_engine(case.target).features == frozenset()
    hooks = (dict(case.module._forward_pre_hooks), dict(case.module._forward_hooks))
    with pytest.raises(BadInput, match=r"^cache, canary need the moescope reference runtime"):
        moescope.instrument(case.target, moescope.Config(cache=Cache(), canary=Canary()))
    assert (dict(case.module._forward_pre_hooks), dict(case.module._forward_hooks)) == hooks
    if isinstance(case.target, EngineContract):
        assert case.target.observer is None


def test_a_new_engine_is_one_class_and_instrument_takes_it_as_it_is():
    """An engine moescope has never heard of, matching the Protocol structurally (no base class): ``as_engine`` keeps
    it, ``instrument`` attaches to it, and the steps it reports are what the exporter counts (read back from the
    exposition); closing detaches it."""
    from metrics_util import by_label, parse

    from moescope.capture.engine_contract import Parts
    from moescope.capture.sources import Reading

    class ToyEngine:
        features: frozenset[str] = frozenset()
        flushes_when_idle = False

        def __init__(self) -> None:
            self.observer = None
            self.dropped = 0

        def model_info(self, name=None):
            return ModelInfo(name=name or "toy", n_experts=4, top_k=1, moe_layers=(0,), dense_params=10,
                             expert_params=5)

        def attach(self, observer) -> None:
            self.observer = observer

        def detach(self) -> None:
            self.observer = None

        def setup(self, config, stack):
            return Parts()

        def register_sources(self, sources) -> None:
            sources.register(self)  # what it counts of itself: here, steps it could not report

        def read(self):
            return Reading(dropped={"toy": self.dropped})

        def step(self, index, phase, segments) -> None:
            if self.observer is not None:
                self.observer.on_step(StepRecord(index, phase, 0.0, 0.001, sum(n for _, _, n in segments),
                                                 tuple(segments)))

    toy = ToyEngine()
    assert isinstance(toy, EngineContract) and as_engine(toy) is toy and _signature_problems(ToyEngine) == []
    with moescope.instrument(toy, port=0) as inst:
        assert toy.observer is inst.observer
        toy.step(0, "prefill", [("r1", 0, 7), ("r2", 0, 3)])
        toy.step(1, "decode", [("r1", 7, 1), ("r2", 3, 1)])
        toy.dropped = 3
        parsed = parse(inst.exporter.exposition().decode())
    assert toy.observer is None
    assert by_label(parsed, "moescope_tokens_total", "phase", model="toy") == {"prefill": 10.0, "decode": 2.0}
    assert by_label(parsed, "moescope_steps_total", "phase", model="toy") == {"prefill": 1.0, "decode": 1.0}
    # what it registered as its own source reached the exposition, read by the evaluation the scrape saw
    assert by_label(parsed, "moescope_capture_dropped_total", "queue", model="toy")["toy"] == 3.0


def _engine_class(members: set[str]):
    """A class with exactly ``members`` of the contract's (each a stub of the right shape)."""
    stubs = {"features": frozenset(), "flushes_when_idle": False,
             "model_info": lambda self, name=None: ModelInfo(name or "part", 4, 1, (0,), 10, 5),
             "attach": lambda self, observer: None, "detach": lambda self: None,
             "setup": lambda self, config, stack: None, "register_sources": lambda self, sources: None,
             # what an engine written for the contract before sources had (the scrape-time readers)
             "placement": lambda self: None, "cache_capacity": lambda self: {}}
    return type("PartEngine", (), {name: stubs[name] for name in members})


@pytest.mark.parametrize("members", [
    {"attach", "model_info"},  # a first draft of an engine adapter
    {"model_info", "attach", "detach", "setup", "placement", "cache_capacity", "features", "flushes_when_idle"},
    {"detach"},
], ids=["attach-model-info", "before-sources", "detach-only"])
def test_a_partial_engine_is_refused_naming_what_it_lacks(members):
    """An object that means to be an engine (it has some of the contract's members) but is not one gets one error
    naming each member it lacks (read off the Protocol here, not off moescope's list), before anything is attached;
    it is not handed to the HF adapter, whose error ("no MoE layers") would mislead."""
    from moescope.errors import BadInput

    methods, data = _protocol_members()
    lacks = sorted((set(methods) | set(data)) - members)
    part = _engine_class(members)()
    assert lacks and not isinstance(part, EngineContract)
    for call in (as_engine, moescope.instrument):
        with pytest.raises(BadInput) as err:
            call(part)
        message = str(err.value)
        assert "\n" not in message and message.startswith("PartEngine matches the engine contract only in part")
        named = message.split("it lacks ", 1)[1].split(" (", 1)[0].split(", ")
        assert named == lacks


def test_a_model_that_is_no_engine_still_goes_to_the_hf_adapter():
    """Nothing of the contract (a plain torch module): the HF adapter's own error, not the partial-engine one."""
    from moescope.errors import BadInput

    with pytest.raises(BadInput, match=r"^no MoE layers found in Linear"):
        as_engine(torch.nn.Linear(2, 2))
