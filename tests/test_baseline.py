"""The baseline profile (moescope/analysis/baseline.py, `moescope baseline save/show`, `demo --save-baseline`):
its numbers equal a naive recomputation from per-request counts read back from a real trace store; v1 files
still load; bad files are one line, exit 2; on simulated traffic the structural CV is the traffic's true CV."""

import json
import math
import sqlite3
import statistics

import numpy as np
import pytest

import moescope
from moescope.analysis import baseline as bl
from moescope.cli import main
from moescope.config import Config, Traces
from moescope.runtime import loader, traffic
from moescope.traces import store

WINDOW_S = 0.1  # the store's traffic spans ~1-3 s: windows of 0.1 s give the spread over time


# -- the naive reference ---------------------------------------------------------------------------------------

def _read_back(path):
    """(per-request counts [R, L, E], layers, end times) in store order, decoded from each request's trace
    document (`moescope trace --json`'s), not from the ids blob the profile reads."""
    conn = store.open_store(path)
    rows = sqlite3.connect(path).execute(
        "SELECT request_id, started + total_s FROM requests WHERE ids IS NOT NULL ORDER BY started, rowid").fetchall()
    docs = [store.load_request(conn, rid) for rid, _ in rows]
    layers = docs[0]["layers"]
    e = docs[0]["n_experts"]
    counts = np.zeros((len(docs), len(layers), e))
    for r, doc in enumerate(docs):
        for tok in doc["tokens"]:
            for la in tok["layers"]:
                for x in la["experts"]:
                    if x < e:  # the sentinel e marks a dropped slot
                        counts[r, layers.index(la["layer"]), x] += 1
    return counts, layers, [end for _, end in rows]


def _naive_structural(c):
    """c: [R, E] one layer's per-request counts. sqrt(max(0, cv^2 - E sum_e Var(p_e))), Var the sandwich
    variance with requests as clusters, floored by p(1-p)/N, in plain Python."""
    r_n, e = len(c), len(c[0])
    n_r = [sum(row) for row in c]
    big_n = sum(n_r)
    tot = [sum(row[x] for row in c) for x in range(e)]
    p = [t / big_n for t in tot]
    var = []
    for x in range(e):
        resid = sum((c[r][x] - p[x] * n_r[r]) ** 2 for r in range(r_n))
        var.append(max(r_n / (r_n - 1) * resid / big_n ** 2, p[x] * (1 - p[x]) / big_n))
    mean = big_n / e
    cv = math.sqrt(sum((t - mean) ** 2 for t in tot) / e) / mean
    multinomial = sum(q * (1 - q) / big_n for q in p)
    return math.sqrt(max(0.0, cv * cv - e * sum(var))), sum(var) / multinomial


def _naive_sd(groups, e):
    """Each expert's share sd (statistics.stdev) across groups of per-request count rows with >= 2 requests."""
    shares = []
    for rows in groups:
        if len(rows) < 2:
            continue
        tot = [sum(row[x] for row in rows) for x in range(e)]
        shares.append([t / sum(tot) for t in tot])
    return [statistics.stdev(s[x] for s in shares) for x in range(e)], len(shares)


# -- a real store -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A trace store of 32 tiny-demo requests arriving at 40/s, served through moescope.instrument."""
    path = tmp_path_factory.mktemp("baseline") / "t.sqlite"
    model = loader.build_model("tiny-demo")
    with moescope.instrument(model, Config(traces=Traces(path))) as inst:
        reqs = traffic.generate(traffic.TrafficConfig(seed=11, rate=40.0, output_tokens_median=12), 32)
        inst.engine(max_batch=8).run(reqs, realtime=True)
    return path


def test_profile_equals_a_naive_recomputation_from_the_store(tiny_store, tmp_path, capsys):
    counts, layers, ends = _read_back(tiny_store)
    out = tmp_path / "b.json"
    assert main(["baseline", "save", "--traces", str(tiny_store), "--out", str(out), "--window", str(WINDOW_S)]) == 0
    said = capsys.readouterr().out
    prof = bl.load(out)
    e = counts.shape[2]
    assert prof.model == "tiny-demo" and prof.n_experts == e and sorted(prof.layers) == layers
    # windows by end time: the spread is over time (enough windows of >= 2 requests at 0.1 s)
    by_window = {}
    for r, end in enumerate(ends):
        by_window.setdefault(math.floor(end / WINDOW_S), []).append(r)
    assert prof.window_s == WINDOW_S
    for j, layer in enumerate(layers):
        lp, c = prof.layers[layer], counts[:, j, :].tolist()
        assert lp.load.tolist() == counts[:, j, :].sum(0).tolist()
        assert lp.share == pytest.approx(counts[:, j, :].sum(0) / counts[:, j, :].sum())
        structural, deff = _naive_structural(c)
        assert lp.structural_cv == pytest.approx(structural, rel=1e-5, abs=1e-6)
        assert lp.design_effect == pytest.approx(deff, rel=1e-5)
        assert lp.draws == len(c)
        sd, n = _naive_sd([[c[r] for r in rows] for _, rows in sorted(by_window.items())], e)
        assert n >= bl.MIN_WINDOWS and lp.windows == n
        assert lp.share_sd == pytest.approx(sd, rel=1e-4, abs=1e-7)
    total = int(counts.sum())
    assert f"{len(layers)} layers, {len(ends)} requests, {total} slots" in said
    med = statistics.median(prof.layers[la].structural_cv for la in layers)
    assert f"median structural CV {med:.3f}" in said

    # One 60 s window holds the whole run: the spread falls back to 8 groups of consecutive requests.
    assert main(["baseline", "save", "--traces", str(tiny_store), "--out", str(out)]) == 0
    prof = bl.load(out)
    r_n = len(ends)
    cuts = [0] + [math.ceil(i * r_n / bl.GROUPS) for i in range(1, bl.GROUPS + 1)]
    assert prof.window_s is None
    for j, layer in enumerate(layers):
        c = counts[:, j, :].tolist()
        sd, n = _naive_sd([c[a:b] for a, b in zip(cuts, cuts[1:])], e)
        assert prof.layers[layer].windows == n == bl.GROUPS
        assert prof.layers[layer].share_sd == pytest.approx(sd, rel=1e-4, abs=1e-7)


def test_show_prints_what_the_file_holds(tiny_store, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["baseline", "save", "--traces", str(tiny_store), "--out", str(out), "--window", str(WINDOW_S)]) == 0
    capsys.readouterr()
    prof = bl.load(out)
    assert main(["baseline", "show", str(out), "--json", "--top", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == prof.model and [la["layer"] for la in doc["layers"]] == sorted(prof.layers)
    for la in doc["layers"]:
        lp = prof.layers[la["layer"]]
        want = sorted(range(prof.n_experts), key=lambda x: (-lp.share[x], x))[:2]
        assert [t["expert"] for t in la["top"]] == want
        assert [t["share"] for t in la["top"]] == pytest.approx([lp.share[x] for x in want], abs=1e-6)
        assert [t["share_sd"] for t in la["top"]] == pytest.approx([lp.share_sd[x] for x in want], abs=1e-6)
        assert la["structural_cv"] == pytest.approx(lp.structural_cv, abs=1e-5) and la["draws"] == lp.draws
    assert main(["baseline", "show", str(out)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 2 + len(prof.layers)
    lp = prof.layers[1]
    top = int(np.argmax(lp.share))
    assert f"e{top} {lp.share[top] * 100:.1f}% ±{lp.share_sd[top] * 100:.1f}" in text[2]


def test_demo_saves_the_profile_of_its_own_requests(tmp_path, capsys):
    """With a trace store the demo's profile is the store's (per-request); the canary's routing is kept out
    of it (its load equals the run's own counters); without one it is the totals' (v1-equivalent)."""
    path, a, b, c = tmp_path / "t.sqlite", tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert main(["demo", "--no-tui", "--requests", "6", "--rate", "0", "--metrics-port", "-1", "--traces",
                 str(path), "--save-baseline", str(a), "--canary-interval", "0.01", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["baseline", "save", "--traces", str(path), "--out", str(b)]) == 0
    capsys.readouterr()
    pa, pb = bl.load(a), bl.load(b)
    assert pa.load_map() == pb.load_map() == {int(k): v for k, v in summary["expert_load"].items()}
    for layer, lp in pa.layers.items():
        assert lp.draws == 6 and lp.design_effect is not None
        assert lp.structural_cv == pytest.approx(pb.layers[layer].structural_cv)
        assert lp.share_sd.tolist() == pytest.approx(pb.layers[layer].share_sd.tolist())
    assert main(["demo", "--no-tui", "--requests", "3", "--rate", "0", "--metrics-port", "-1", "--traces", "none",
                 "--save-baseline", str(c), "--canary-interval", "0", "--json"]) == 0
    io = capsys.readouterr()
    assert "from the run's totals only" in io.err
    pc = bl.load(c)
    assert all(lp.share_sd is None and lp.design_effect is None for lp in pc.layers.values())
    assert pc.load_map() == {int(k): v for k, v in json.loads(io.out)["expert_load"].items()}


def test_calibration_profile_counts_the_calibration_pass_per_request():
    from moescope.runtime.calibration import calibration_load

    model = loader.build_model("tiny-demo")
    prof = bl.calibration_profile(model, seed=5, n_requests=12)
    assert prof.load_map() == {la: [float(x) for x in v] for la, v in calibration_load(model, 5, 12).items()}
    assert all(lp.draws == 12 and lp.design_effect is not None for lp in prof.layers.values())


# -- files ------------------------------------------------------------------------------------------------------

def test_v1_files_and_load_maps_still_load(tmp_path):
    loads = {1: [30.0, 10.0, 0.0, 20.0], 2: [5.0, 5.0, 5.0, 5.0]}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "moescope-baseline-v1", "model": "m",
                                "layers": {str(k): v for k, v in loads.items()}}))
    for prof in (bl.load(path), bl.coerce(str(path)), bl.coerce(loads)):
        assert prof.load_map() == loads and prof.n_experts == 4 and prof.window_s is None
        for layer, v in loads.items():
            lp, n = prof.layers[layer], sum(v)
            p = [x / n for x in v]
            cv = statistics.pstdev(v) / statistics.mean(v)
            want = math.sqrt(max(0.0, cv * cv - 4 * sum(q * (1 - q) for q in p) / n))  # multinomial noise
            assert lp.structural_cv == pytest.approx(want) and lp.share.tolist() == pytest.approx(p)
            assert lp.share_sd is None and lp.design_effect is None and lp.draws == 0
    assert bl.load(path).model == "m" and bl.coerce(None) is None
    prof = bl.load(path)
    assert bl.coerce(prof) is prof
    bl.save(tmp_path / "v2.json", prof)  # a v1 file saved again is a v2 file of the same numbers
    again = bl.load(tmp_path / "v2.json")
    assert json.loads((tmp_path / "v2.json").read_text())["format"] == bl.FORMAT
    assert again.load_map() == loads and [again.layers[k].structural_cv for k in loads] == \
        pytest.approx([prof.layers[k].structural_cv for k in loads], rel=1e-5)


V2 = {"format": "moescope-baseline-v2", "model": "m", "n_experts": 2, "window_s": 60.0, "window_draws": 4,
      "layers": {"1": {"load": [3, 1], "share_sd": [0.1, 0.1], "structural_cv": 0.4, "design_effect": 2.0,
                       "draws": 9, "windows": 5}}}


def _v2(**layer):
    doc = json.loads(json.dumps(V2))
    doc["layers"]["1"].update(layer)
    return json.dumps(doc)


@pytest.mark.parametrize("text, says", [
    (None, "does not exist"),
    ("{not json", "is not readable JSON"),
    ('{"format": "moescope-routing-log-v1"}', "is not in moescope-baseline-v2"),
    ('{"format": "moescope-baseline-v1", "layers": {}}', "has no layers"),
    ('{"format": "moescope-baseline-v1", "layers": {"1": [1, "x"]}}', "lists of loads"),
    ('{"format": "moescope-baseline-v1", "layers": {"1": [1, 2], "2": [1]}}', "same number of experts"),
    ('{"format": "moescope-baseline-v1", "layers": {"1": [1, -2]}}', "finite and non-negative"),
    (json.dumps({**V2, "n_experts": 0}), "n_experts"),
    (_v2(load=[1, 2, 3]), "load must be a list of 2 numbers"),
    (_v2(load=[1, float("nan")]), "load must be a non-negative number"),
    (_v2(share_sd=[0.1]), "share_sd must be a list of 2"),
    (_v2(structural_cv=None), "structural_cv must be"),
    (_v2(draws=1.5), "draws must be"),
    (json.dumps({**V2, "layers": {"x": V2["layers"]["1"]}}), "is not a layer number"),
])
def test_bad_baseline_files_are_one_line_exit_2(tmp_path, capsys, text, says):
    path = tmp_path / "b.json"
    if text is not None:
        path.write_text(text)
    assert main(["baseline", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moescope: error: baseline ") and says in err and err.count("\n") == 1


def test_a_valid_v2_file_reads_back_as_written(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(V2))
    prof = bl.load(path)
    lp = prof.layers[1]
    assert (lp.load.tolist(), lp.share.tolist(), lp.share_sd.tolist()) == ([3, 1], [0.75, 0.25], [0.1, 0.1])
    assert (lp.structural_cv, lp.design_effect, lp.draws, lp.windows) == (0.4, 2.0, 9, 5)
    bl.save(tmp_path / "again.json", prof)
    assert json.loads((tmp_path / "again.json").read_text()) == V2


# -- simulated traffic: the structural CV is the traffic's own --------------------------------------------------

def _simulate(rng, p, n_requests, tokens, concentration, n_layers=2):
    """[R, L, E] counts: each request draws its own expert mix around ``p`` (Dirichlet: the tokens of one
    request route alike; ``concentration`` None: every slot independent), then ``tokens`` slots from it."""
    out = np.empty((n_requests, n_layers, len(p)))
    for r in range(n_requests):
        for j in range(n_layers):
            q = p if concentration is None else rng.dirichlet(p * concentration)
            out[r, j] = rng.multinomial(tokens, q)
    return out


def test_uniform_traffic_has_no_structure_even_when_requests_route_alike():
    """Uniform routing has a structural CV of 0: the estimate stays within the chi-square fluctuation (3 sd)
    of the noise it subtracts, for independent slots and for requests whose tokens route alike; the
    multinomial subtraction (slots as draws, v1 files) calls the clustering structure."""
    e = 64
    p = np.full(e, 1 / e)
    for conc in (None, 8.0):
        multinomial_over = 0
        for seed in range(10):
            c = _simulate(np.random.default_rng(seed), p, 300, 40, conc, n_layers=1)
            lp = bl.from_requests(c, [1], "sim").layers[1]
            noise2 = e * bl.sampling.Draws.of(c).share_var()[0].sum()
            bound2 = 3 * math.sqrt(2 / (e - 1)) * noise2
            assert lp.structural_cv ** 2 <= bound2
            multinomial_over += bl.multinomial_structural_cv(lp.load)[0] ** 2 > bound2
            assert (lp.design_effect > 4) if conc else (lp.design_effect < 1.2)
        assert multinomial_over >= (8 if conc else 0)


def test_skewed_traffic_structural_cv_matches_the_true_cv_within_sampling_error():
    e = 32
    p = np.linspace(1, 4, e)
    p /= p.sum()
    true_cv = float(np.std(p) / np.mean(p))
    reps = [bl.from_requests(_simulate(np.random.default_rng(s), p, 150, 40, 10.0, n_layers=1), [1], "sim")
            .layers[1].structural_cv for s in range(20)]
    mean, se = statistics.mean(reps), statistics.stdev(reps) / math.sqrt(len(reps))
    assert abs(mean - true_cv) < 3 * se + 0.01, (mean, true_cv, se)
    assert all(abs(x - true_cv) < 5 * statistics.stdev(reps) for x in reps)


def test_many_requests_keep_the_fallback_groups_bounded():
    """Past 64 requests consecutive bins merge pairwise: still GROUPS groups, each of about R/GROUPS requests,
    and the spread of a stationary traffic close to the per-group multinomial-and-cluster noise."""
    rng = np.random.default_rng(3)
    e = 8
    prof = bl.from_requests(_simulate(rng, np.full(e, 1 / e), 1000, 20, 30.0, n_layers=1), [1], "sim")
    lp = prof.layers[1]
    assert prof.window_s is None and lp.windows == bl.GROUPS
    assert prof.window_draws == pytest.approx(1000 / bl.GROUPS, rel=0.3)
    # each group's share varies as Var(p_e) scaled to a group's slots: the sandwich variance times GROUPS
    var = bl.sampling.Draws.of(_simulate(rng, np.full(e, 1 / e), 1000, 20, 30.0, n_layers=1)).share_var()[0]
    assert np.median(lp.share_sd) == pytest.approx(np.sqrt(np.median(var) * bl.GROUPS), rel=0.5)
