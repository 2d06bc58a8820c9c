"""`diagnose` on a store that holds more than one run (each process that wrote it is one writer run): by default
it judges the latest run and says so, `--run ID` / `--run all` choose others, and identical prefixes are compared
within one run, never across (determinism is a property of one model state: a fault run's router differs from
the healthy run's before it, by design).

The stores are written here, in-process, through the public recorder: a healthy run, then the same prompts
served by the same model with its routers' expert rows rotated (every token's expert set moves by one: a
different router state, not a non-deterministic one); and an old run whose capacity limit drops slots, then a
run without the limit. Each prompt is served twice in every run, so a run has identical prefixes of its own."""

import datetime as dt
import json
import time

import numpy as np
import pytest

import moescope
from moescope.analysis.diagnose import Window, _check_jitter
from moescope.cli import main
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.thresholds import DEFAULT
from moescope.traces import to_parquet, store
from moescope.traces.recorder import TraceRecorder

N_PROMPTS = 6  # each served twice per run


def _serve(model, path, prompts) -> tuple[str, list[str]]:
    """One writer run: ``prompts`` served twice each; returns (its run id, its request ids)."""
    rec = TraceRecorder(path, model="tiny")
    with moescope.instrument(model, observers=[rec]):
        engine = Engine(model, max_batch=3)
        for r in [*prompts, *prompts]:
            engine.submit(r.prompt, max_new_tokens=4, domain=r.domain)
        while engine.has_work:
            engine.step()
    return rec.run_id, [r.request_id for r in engine.finished]


def _rotate_routers(model) -> None:
    """A different router state: expert e's gate row becomes expert e+1's, so every token's top-k set moves by
    one expert (a top-2 set of 6 experts is never invariant under the rotation)."""
    import torch

    with torch.no_grad():
        for m in model.moe_layers():
            m.router.weight.copy_(m.router.weight.roll(1, 0))


@pytest.fixture(scope="module")
def two_routers(tmp_path_factory):
    from moescope.runtime.model_config import MoEConfig

    cfg = MoEConfig(name="test-tiny", hidden_size=32, n_layers=3, n_heads=4, n_experts=6, top_k=2, ffn_size=48,
                    dense_layers=(0,), max_seq_len=128, seed=3)
    path = tmp_path_factory.mktemp("runs") / "t.sqlite"
    model = MoETransformer(cfg).eval()
    prompts = traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=4), N_PROMPTS)
    healthy = _serve(model, path, prompts)
    between = time.time()
    _rotate_routers(model)
    rotated = _serve(model, path, prompts)
    return path, healthy, rotated, between


def _diagnose(capsys, path, *extra):
    capsys.readouterr()
    code = main(["diagnose", "--traces", str(path), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def _jitter(report):
    return [f for f in report["findings"] if f["cause"] == "jitter"]


def test_the_store_really_routes_the_same_prefixes_differently_across_its_runs(two_routers):
    """The situation the other tests rely on: the same prompts in both runs, routed differently."""
    path, (run_a, ids_a), (run_b, ids_b), _ = two_routers
    conn = store.open_store(path)
    docs = {rid: store.load_request(conn, rid) for rid in ids_a + ids_b}
    runs = {r.run: r.requests for r in store.routed_runs(conn)}
    conn.close()
    assert runs == {run_a: 2 * N_PROMPTS, run_b: 2 * N_PROMPTS}
    assert {st["run"] for rid in ids_a for st in docs[rid]["steps"]} == {run_a}
    by_prompt: dict = {}
    for rid in ids_a + ids_b:
        by_prompt.setdefault(docs[rid]["prompt"], []).append(docs[rid])

    def first_moe_layer(doc):  # its input is the same in both runs (the dense layer 0 before it is untouched)
        return [sorted(t["layers"][0]["experts"]) for t in doc["tokens"] if t["phase"] == "prefill"]

    total = differ = 0
    for a, _, b, _ in (v for v in by_prompt.values() if len(v) == 4):  # a: run A's first copy, b: run B's
        total += len(first_moe_layer(a))
        differ += sum(x != y for x, y in zip(first_moe_layer(a), first_moe_layer(b)))
    # identical prefixes, other experts at every position: what a cross-run comparison would call flips
    assert differ == total > 50


def test_by_default_the_latest_run_is_judged_and_said_so(two_routers, capsys):
    path, (run_a, _), (run_b, ids_b), _ = two_routers
    code, report = _diagnose(capsys, path)
    assert report["requests"] == len(ids_b) == 2 * N_PROMPTS
    runs = report["runs"]
    assert runs["selected"] == "latest" and runs["judged"] == [run_b]
    assert runs["left_out"] == {"runs": 1, "requests": 2 * N_PROMPTS}
    assert [r["run"] for r in runs["other_runs"]] == [run_a] and runs["other_runs"][0]["requests"] == 2 * N_PROMPTS
    assert not [f for f in _jitter(report) if f["severity"] != "info"], report["findings"]
    jitter = _jitter(report)
    assert jitter and jitter[0]["evidence"]["positions_compared"] >= 50  # within the run: its repeated prompts
    # the text says which run, and what it left out, on one line
    capsys.readouterr()
    main(["diagnose", "--traces", str(path)])
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if x.startswith("judged"))
    assert run_b in line and run_a not in line and f"left out {2 * N_PROMPTS} requests of 1 other run" in line


def test_run_picks_a_run_and_all_never_compares_across_runs(two_routers, capsys):
    path, (run_a, ids_a), (run_b, _), _ = two_routers
    code, report = _diagnose(capsys, path, "--run", run_a)
    assert report["runs"]["judged"] == [run_a] and report["requests"] == len(ids_a)
    compared_a = _jitter(report)[0]["evidence"]["positions_compared"]
    code, report = _diagnose(capsys, path, "--run", run_a[:6])  # a unique prefix names it too
    assert report["runs"]["judged"] == [run_a]
    _, latest = _diagnose(capsys, path)
    compared_b = _jitter(latest)[0]["evidence"]["positions_compared"]
    code, report = _diagnose(capsys, path, "--run", "all")
    assert report["runs"]["selected"] == "all" and report["requests"] == 4 * N_PROMPTS
    assert report["runs"]["left_out"] == {"runs": 0, "requests": 0}
    jitter = _jitter(report)
    assert [f["severity"] for f in jitter] == ["info"], jitter  # the rotated router is not "non-deterministic"
    # every comparison is one run's own: the two runs' counts, none across them
    assert jitter[0]["evidence"]["positions_compared"] == compared_a + compared_b


def test_since_chooses_the_window_the_runs_are_counted_in(two_routers, capsys):
    path, _, (run_b, _), between = two_routers
    when = dt.datetime.fromtimestamp(between).isoformat()
    code, report = _diagnose(capsys, path, "--since", when, "--run", "all")
    assert report["runs"]["judged"] == [run_b] and report["requests"] == 2 * N_PROMPTS
    code, report = _diagnose(capsys, path, "--since", when)
    assert report["runs"]["judged"] == [run_b] and report["runs"]["left_out"]["runs"] == 0


def test_an_unknown_run_is_one_line_naming_the_stored_runs(two_routers, capsys):
    path, (run_a, _), (run_b, _), _ = two_routers
    capsys.readouterr()
    assert main(["diagnose", "--traces", str(path), "--run", "nosuchrun"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and "nosuchrun" in err and run_a in err and run_b in err, err
    assert captured.out == ""


def test_the_lake_knows_each_requests_run_as_the_sqlite_store_does(two_routers, tmp_path):
    path, (run_a, _), (run_b, _), _ = two_routers
    to_parquet.sqlite_to_lake(path, tmp_path / "lake")
    for src in (path, tmp_path / "lake"):
        conn = store.open_store(src)
        runs = store.routed_runs(conn)
        per_run = {run: sorted(r.request_id for r in store.iter_routed(conn, runs=[run])) for run in (run_a, run_b)}
        decoded = {r.request_id: r.run for r in store.iter_routed(conn)}  # from the decoded steps
        conn.close()
        assert [(r.run, r.requests) for r in runs] == [(run_b, 2 * N_PROMPTS), (run_a, 2 * N_PROMPTS)]
        assert all(decoded[rid] == run for run, ids in per_run.items() for rid in ids)
        assert len(per_run[run_a]) == len(per_run[run_b]) == 2 * N_PROMPTS


def test_an_old_run_with_drops_is_left_out_by_default(tmp_path, capsys):
    """An earlier run under a capacity limit left dropped slots in the store; the latest run has none: by
    default its drops are not this run's finding; `--run all` still finds them."""
    from moescope.runtime.model_config import MoEConfig

    cfg = MoEConfig(name="test-tiny", hidden_size=32, n_layers=3, n_heads=4, n_experts=6, top_k=2, ffn_size=48,
                    dense_layers=(0,), max_seq_len=128, seed=3)
    path = tmp_path / "t.sqlite"
    model = MoETransformer(cfg).eval()
    prompts = traffic.generate(traffic.TrafficConfig(seed=7, output_tokens_median=4), N_PROMPTS)
    for m in model.moe_layers():
        m.router.capacity_factor = 0.5
    old, _ = _serve(model, path, prompts)
    for m in model.moe_layers():
        m.router.capacity_factor = None
    new, _ = _serve(model, path, prompts)
    conn = store.open_store(path)
    dropped = {r.request_id for r in store.list_requests(conn, flag=["dropped"], limit=100)}
    by_run = {run: {r.request_id for r in store.iter_routed(conn, runs=[run])} for run in (old, new)}
    conn.close()
    assert dropped and dropped <= by_run[old]  # the injected situation: only the old run dropped slots
    _, report = _diagnose(capsys, path)
    assert report["runs"]["judged"] == [new]
    assert "drop" not in [f["cause"] for f in report["findings"]], report["findings"]
    _, report = _diagnose(capsys, path, "--run", "all")
    assert "drop" in [f["cause"] for f in report["findings"]]


def _window(tokens, routes, runs):
    n = len(tokens[0])
    return Window(ids=[f"r{i}" for i in range(len(tokens))], started=np.arange(len(tokens), dtype=float),
                  domain=[None] * len(tokens), tenant=[None] * len(tokens), model=None, n_experts=6, top_k=2,
                  layers=[1], tokens=[np.array(t) for t in tokens],
                  routing=[np.array(r, dtype=np.int16).reshape(n, 1, 2) for r in routes],
                  entropy=[np.ones((n, 1), np.float32)] * len(tokens), miss=[np.zeros((n, 1), np.uint8)] * len(tokens),
                  step_of=[np.zeros(n, np.int64)] * len(tokens), steps=[], run=runs)


def test_the_determinism_check_compares_within_a_run_only():
    """Two requests with the same 60 tokens routed to other experts: non-deterministic within one run; two
    router states across two runs."""
    tokens = [list(range(60))] * 2
    routes = [[[0, 1]] * 60, [[2, 3]] * 60]
    same = _check_jitter(_window(tokens, routes, ["a", "a"]), DEFAULT)
    assert [f.severity for f in same] == ["warning"] and same[0].evidence["flip_ratio"] == 1.0
    assert _check_jitter(_window(tokens, routes, ["a", "b"]), DEFAULT) == []  # nothing compared
