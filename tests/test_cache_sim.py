"""cache-sim on a routing log recorded by a real demo run reproduces the runtime cache's counts; the one-pass
sweep over all sizes equals the per-size simulation (``cache_policy.simulate``, kept here as the reference)."""

import json
import random

import numpy as np
import pytest

from moescope.analysis import cache_sim, cache_stack
from moescope.cli import main
from moescope.runtime import cache_policy


def naive_counts(n_experts, seqs, policies=cache_policy.SIM_POLICIES):
    """{(policy, size): (lookups, hits, evictions)} summed over layers, every size, policy and layer simulated
    apart (what cache-sim did before the one-pass sweep)."""
    out = {}
    for size in range(1, n_experts + 1):
        for policy in policies:
            results = [cache_policy.simulate(seq, policy, size) for seq in seqs.values()]
            out[(policy, size)] = tuple(sum(getattr(r, f) for r in results) for f in ("lookups", "hits", "evictions"))
    return out


def naive_store_lookups(conn):
    """The store's lookup sequences by sets, token by token (the loader before it was vectorised)."""
    from moescope.traces.store import iter_routed

    used, n_experts = {}, None
    for r in iter_routed(conn):
        n_experts = r.n_experts
        for i in range(r.n_routed):
            st = r.steps[int(r.step_of[i])]
            per_layer = used.setdefault((st.get("run", ""), st["index"]), {})
            for j, layer in enumerate(r.layers):
                per_layer.setdefault(layer, set()).update(int(e) for e in r.ids[i, j] if e < n_experts)
    seqs = {}
    for key in sorted(used):
        for layer, experts in used[key].items():
            seqs.setdefault(layer, []).extend(sorted(experts))
    return n_experts, seqs


def assert_equals_naive(n_experts, seqs, target=0.9):
    report = cache_sim.simulate_all(n_experts, seqs, target=target)
    naive = naive_counts(n_experts, seqs)
    got = {(r["policy"], r["size"]): (r["lookups"], r["hits"], r["evictions"]) for r in report["results"]}
    assert got == naive  # hits and evictions at every size, exactly
    rate = {key: hits / lookups if lookups else 1.0 for key, (lookups, hits, _) in naive.items()}
    for r in report["results"]:
        assert r["hit_rate"] == rate[(r["policy"], r["size"])]
        assert r["gap_to_optimal"] == rate[("belady", r["size"])] - r["hit_rate"]
    for policy, size in report["min_size_for_target"].items():
        reaching = [s for s in range(1, n_experts + 1) if rate[(policy, s)] >= target]
        assert size == (reaching[0] if reaching else None)
    assert report["table_sizes"] == cache_sim.table_sizes(n_experts, report["min_size_for_target"].values())


@pytest.mark.parametrize("seed", range(6))
def test_sweep_equals_per_size_simulation_on_random_sequences(seed):
    rng = random.Random(seed)
    n_experts = rng.choice([1, 2, 3, 5, 8, 13])
    seqs = {}
    for layer in range(rng.randint(1, 3)):
        skew = rng.random() * 3  # from uniform to a few hot experts
        weights = [1 / (e + 1) ** skew for e in range(n_experts)]
        n = rng.choice([0, 1, 7, 60, 200])
        seqs[layer + 1] = rng.choices(range(n_experts), weights, k=n)
    assert_equals_naive(n_experts, seqs, target=rng.choice([0.3, 0.6, 0.9]))


def test_sweep_equals_per_size_simulation_in_steps_of_sorted_experts():
    """Lookups as the store yields them: each step's distinct experts in ascending order, top-k per token."""
    rng = np.random.default_rng(7)
    n_experts, seqs = 32, {}
    for layer in range(2):
        hot = rng.dirichlet(np.full(n_experts, 0.3))
        steps = [np.unique(rng.choice(n_experts, size=rng.integers(1, 4) * 4, p=hot)) for _ in range(60)]
        seqs[layer] = [int(e) for st in steps for e in st]
    assert_equals_naive(n_experts, seqs)
    # lookup by lookup: an online policy's hit at size s is exactly "depth < s" (first lookups: depth -1, a miss)
    depth = cache_stack.depths(n_experts, [np.array(seqs[0])])
    for policy, size in [("lru", 5), ("lfu", 9), ("lfu", 31)]:
        pol = cache_policy.make(policy, size)
        assert [pol.access(e).hit for e in seqs[0]] == [bool(0 <= x < size) for x in depth[policy][0][0]]


def test_demo_cache_counts_equal_cache_sim_replay(tmp_path, capsys):
    log = tmp_path / "routing.json"
    assert main(["demo", "--requests", "8", "--rate", "0", "--metrics-port", "-1", "--cache-size", "3",
                 "--cache-policy", "lfu", "--record-routing", str(log), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["cache-sim", str(log), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = next(r for r in report["results"] if r["policy"] == "lfu" and r["size"] == 3)
    layers = summary["expert_cache"]["layers"].values()
    assert row["lookups"] == sum(s["lookups"] for s in layers)
    assert row["hits"] == sum(s["hits"] for s in layers)
    assert row["evictions"] == sum(s["evictions"] for s in layers)
    # Belady bounds every policy at every size; a full-size cache misses only cold starts.
    by = {(r["policy"], r["size"]): r for r in report["results"]}
    for (_, size), r in by.items():
        assert r["hit_rate"] <= by[("belady", size)]["hit_rate"] + 1e-12
        assert r["gap_to_optimal"] == pytest.approx(by[("belady", size)]["hit_rate"] - r["hit_rate"])
    n_experts = report["n_experts"]
    full = by[("lru", n_experts)]
    n_layers = len(report["layers"])
    assert full["lookups"] - full["hits"] <= n_layers * n_experts
    # The recommended size is the first that reaches the target.
    for policy, size in report["min_size_for_target"].items():
        if size is not None:
            assert by[(policy, size)]["hit_rate"] >= 0.9
            assert size == 1 or by[(policy, size - 1)]["hit_rate"] < 0.9


def test_cache_sim_table_and_bad_input(tmp_path, capsys):
    log = tmp_path / "r.json"
    log.write_text(json.dumps({"format": "moescope-routing-v1", "n_experts": 4,
                               "layers": {"1": [[0, 1], [0, 1], [2], [0, 1], [3]]}}))
    assert main(["cache-sim", str(log)]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "smallest cache size" in out
    n, seqs = cache_sim.load_lookups(log)
    assert n == 4 and seqs == {1: [0, 1, 0, 1, 2, 0, 1, 3]}
    for bad in ['{"format": "other"}', "not json", json.dumps({"format": "moescope-routing-v1", "n_experts": 2,
                                                                 "layers": {"1": [[5]]}})]:
        log.write_text(bad)
        assert main(["cache-sim", str(log)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moescope: error: routing log") and err.count("\n") == 1
    assert main(["cache-sim", str(tmp_path / "missing.json")]) == 2


def test_cache_sim_from_the_trace_store_equals_the_routing_log(tmp_path, capsys):
    log, traces = tmp_path / "routing.json", tmp_path / "t.sqlite"
    assert main(["demo", "--requests", "6", "--rate", "0", "--metrics-port", "-1", "--record-routing", str(log),
                 "--traces", str(traces), "--canary-interval", "0"]) == 0
    capsys.readouterr()
    from moescope.traces import store

    conn = store.open_store(traces)
    n_experts, seqs = cache_sim.load_lookups_from_store(conn)
    assert (n_experts, seqs) == cache_sim.load_lookups(log) == naive_store_lookups(conn)
    assert_equals_naive(n_experts, seqs)  # real routing: the sweep equals the per-size simulation
    assert main(["cache-sim", "--traces", str(traces), "--json"]) == 0
    from_store = json.loads(capsys.readouterr().out)
    assert from_store.pop("corrupt_rows") == 0
    assert main(["cache-sim", str(log), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_store
    assert main(["cache-sim", "--traces", str(tmp_path / "missing.sqlite")]) == 2  # the store is the default source
    assert main(["cache-sim", str(log), "--import", str(log)]) == 2


def test_table_reads_at_256_experts(tmp_path, capsys):
    """At E = 256 the text is a grid of sizes (powers of two, E, each policy's smallest size and the one
    below), not 256 rows; --json keeps every size."""
    rng = np.random.default_rng(3)
    hot = rng.dirichlet(np.full(256, 0.5))
    layers = {str(layer): [rng.choice(256, size=24, p=hot).tolist() for _ in range(300)] for layer in (3, 4)}
    log = tmp_path / "r.json"
    log.write_text(json.dumps({"format": "moescope-routing-v1", "n_experts": 256, "layers": layers}))
    assert main(["cache-sim", str(log), "--json", "--target", "0.6"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["results"]) == 256 * 4
    mins = report["min_size_for_target"]
    assert all(s is not None for s in mins.values())
    want = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} | {s for m in mins.values() for s in (m, m - 1)})
    assert report["table_sizes"] == want
    assert main(["cache-sim", str(log), "--target", "0.6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert [int(line.split()[0]) for line in rows] == want and len(lines) == len(want) + 3
    by = {(r["policy"], r["size"]): r for r in report["results"]}
    _, seqs = cache_sim.load_lookups(log)
    for policy, size in mins.items():  # the smallest size reaching the target, by the per-size simulation
        for s in (size - 1, size):
            hits = sum(cache_policy.simulate(seq, policy, s).hits for seq in seqs.values())
            assert hits == by[(policy, s)]["hits"]
            assert (hits / by[(policy, s)]["lookups"] >= 0.6) == (s == size)
    policies = list(mins)
    for line in rows:
        size = int(line.split()[0])
        rates = [float(x) for x in line.replace("*", " ").split()[1::2]][:len(policies) - 1]
        assert rates == [round(by[(p, size)]["hit_rate"], 3) for p in policies[:-1]]
        assert line.count("*") == sum(m == size for m in mins.values())
