"""Expert parallelism with real gloo processes: exact equality, placement, slow-rank attribution, rank death."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.multiprocessing as mp

from moescope.errors import BadInput
from moescope.parallel import placement
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer, Segment
from helpers import popen_cli, run_cli, wait_until
from servers import free_port

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("world,layout,kind", [(2, "round-robin", "tiny"), (2, "contiguous", "tiny"),
                                               (4, "round-robin", "tiny"), (2, "contiguous", "deepseek"),
                                               (2, "rebalance", "tiny")])
def test_each_rank_equals_the_single_process_model_on_its_own_requests(tiny_cfg, deepseek_cfg, tmp_path, world,
                                                                       layout, kind):
    """Data-parallel attention: each rank forwards its own tokens (one rank none: an idle forward) and serves
    its own share of the requests (unequal shares: ranks finish at different steps and run idle forwards);
    each rank's logits and outputs equal, bit for bit, the single-process model's on the same tokens and
    requests. deepseek: sigmoid group-limited routing with a correction bias and a shared expert (replicated on
    every rank); a random bias so that it changes the choice."""
    import parallel_worker

    cfg = tiny_cfg.replace(n_experts=8) if kind == "tiny" else deepseek_cfg
    # EPLB places replicas, and a replica computes a subset of a source's rows: float blocking differs (1e-8)
    exact = layout != "rebalance"
    mp.spawn(parallel_worker.run, args=(world, free_port(), cfg.to_dict(), layout, str(tmp_path)), nprocs=world)
    model = MoETransformer(cfg).eval()
    routed: dict[int, torch.Tensor] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: BLAS results depend on the thread count
    try:
        for r in range(world):
            got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
            tokens = parallel_worker.forward_tokens(r)
            if len(tokens):
                with torch.no_grad():
                    out = model(tokens, [Segment(len(tokens))])
                want = out.logits
                if exact:
                    assert torch.equal(got["logits"], want), (r, (got["logits"] - want).abs().max())
                else:
                    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-5)
                for layer, d in out.decisions.items():  # the slots this rank routed, by logical expert
                    routed[layer] = routed.get(layer, 0) + torch.bincount(
                        d.active_ids.reshape(-1), minlength=cfg.n_experts + 1)[:cfg.n_experts]
            else:
                assert got["logits"] is None
            records = Engine(model, max_batch=3).run(parallel_worker.requests(r, world), realtime=False,
                                                     id_prefix="t-")
            assert got["ids"] == [x.request_id for x in records] and len(records) > 0
            assert [tuple(o) for o in got["outputs"]] == [x.output_tokens for x in records], r
    finally:
        torch.set_num_threads(threads)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    # every rank made the same exchanges (the same steps, idle forwards included)
    assert len({g["dispatches"] for g in got}) == 1
    # physical load: the fleet's rows per expert are the slots routed to it, each computed once; a replicated
    # expert's rows are dealt over its replicas (each routing rank's slots alternately: within one per sender)
    if layout == "rebalance":  # EPLB in the loop: the ranks rearranged together, moving weights, while serving
        events = [g["rebalances"] for g in got]
        assert events[0] == events[1] and len(events[0]) >= 2 and sum(e[1] for e in events[0]) > 0
    pl = parallel_worker.start_placement(layout, cfg, world)  # (the direct forward ran on the starting placement)
    for layer, want in routed.items():
        rows = torch.tensor([g["rows"][layer] for g in got])  # [rank, expert]
        assert torch.equal(rows.sum(0), want), layer
        for e in range(cfg.n_experts):
            holders = pl.ranks_of(layer, e)
            assert all(rows[r, e] == 0 for r in range(world) if r not in holders)
            share = want[e].item() / len(holders)
            assert all(abs(rows[r, e].item() - share) <= world for r in holders), (layer, e, rows[:, e])


def test_placement_layouts_and_validation(tmp_path):
    rr = placement.build("round-robin", n_experts=8, world_size=2, moe_layers=(1, 2))
    assert rr.layers[1] == ((0, 2, 4, 6), (1, 3, 5, 7))
    co = placement.build("contiguous", n_experts=8, world_size=3, moe_layers=(1,))
    assert co.layers[1] == ((0, 1, 2), (3, 4, 5), (6, 7))
    f = tmp_path / "p.yaml"
    f.write_text("rank_to_experts: {0: [0,1,2,3], 1: [4,5,6,7]}\nlayers:\n  2: {0: [0,2,4,6], 1: [1,3,5,7]}\n")
    p = placement.load(f, n_experts=8, world_size=2, moe_layers=(1, 2))
    assert p.layers[1] == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.layers[2] == rr.layers[2]
    for text, needle in [("rank_to_experts: {0: [0,1,2], 1: [4,5,6,7]}", "experts [3] are placed on no rank"),
                         ("rank_to_experts: {0: [0,1,2,3,4], 1: [4,5,6,7]}", "experts [4] are placed more than once"),
                         ("rank_to_experts: {0: [0,1,2,3], 2: [4,5,6,7]}", "ranks [2], which do not exist"),
                         ("rank_to_experts: {0: [0,1,2,3], 1: [4,5,6,9]}", "expert 9 outside 0..7"),
                         ("[1, 2", "cannot parse placement")]:
        f.write_text(text)
        with pytest.raises(BadInput, match=needle.replace("[", r"\[").replace("]", r"\]")):
            placement.load(f, n_experts=8, world_size=2, moe_layers=(1,))
    f.write_text("replicated: true\nrank_to_experts: {0: [0,1,2,3,4], 1: [4,5,6,7]}")
    rep = placement.load(f, n_experts=8, world_size=2, moe_layers=(1,))
    assert rep.owner_table(1, 1)[4] == 1 and rep.owner_table(1, 0)[4] == 0  # local replica preferred


def _demo(*args, timeout=240):
    proc = run_cli("demo", "--no-tui", "--rate", "0", "--metrics-port", "-1", "--json", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_slow_rank_is_attributed_and_delays_the_exchange():
    delay = 0.05  # well above the scheduling noise of 3 ranks sharing 2 cores
    base = _demo("--world-size", "3", "--requests", "3", "--max-batch", "3")
    slow = _demo("--world-size", "3", "--requests", "3", "--max-batch", "3", "--slow-rank", "2",
                 "--delay-ms", str(delay * 1000))
    matrix = slow["peer_wait_matrix_s"]  # [rank][peer]: what rank waited on peer
    waited_on = [sum(row[p] for row in matrix) for p in range(3)]
    assert max(range(3), key=waited_on.__getitem__) == 2, matrix
    for r in (0, 1):
        rs, rb = slow["ranks"][r], base["ranks"][r]
        extra = rs["dispatch_s"] / rs["exchanges"] * 2 - rb["dispatch_s"] / rb["exchanges"] * 2  # per dispatch
        assert 0.5 * delay < extra < 2.0 * delay, (r, extra)
        assert matrix[r][2] == pytest.approx(rs["exchanges"] / 2 * delay, rel=0.5)
    # Ranks agree on request ids: <run>-<index>, one run prefix for all requests.
    assert len({i.rsplit("-", 1)[0] for i in slow["request_ids"]}) == 1
    assert sorted(int(i.rsplit("-", 1)[1]) for i in slow["request_ids"]) == list(range(3))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_stops_the_others_with_an_error_naming_it(tmp_path, sig):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MOESCOPE_STORE": f"127.0.0.1:{store.port}"}
        procs.append(popen_cli("demo", "--requests", "400", "--rate", "0", "--metrics-port", "-1", "--timeout", "5",
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        wait_until(lambda: [int(store.get(f"moescope/hb/{r}").decode().split()[0]) for r in range(2)],
                   until=lambda steps: min(steps) >= 3, timeout=120, what="both ranks serving (heartbeat steps)",
                   interval=0.2, ignore=(Exception,), alive=lambda: all(p.poll() is None for p in procs))
        procs[1].send_signal(sig)
        t_kill = time.monotonic()
        err = procs[0].communicate(timeout=60)[1]
        elapsed = time.monotonic() - t_kill
        assert procs[0].returncode == 1
        assert elapsed < 5 + 5, elapsed  # within the 5 s timeout (plus the 1.5 s heartbeat check)
        line = [ln for ln in err.splitlines() if ln.startswith("moescope: error:")]
        assert line and "rank 1" in line[0] and "stopped responding" in line[0], err[-2000:]
        assert "Traceback" not in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("scenario,flips", [("healthy", False), ("jitter", True)])
def test_lock_step_ranks_run_the_canary_at_the_same_step(scenario, flips):
    """The canary forward is a collective on expert-parallel ranks: run by step count on every rank, it completes
    (a rank running it alone would hang the exchange) and measures the same flips everywhere."""
    out = _demo("--world-size", "2", "--requests", "6", "--max-batch", "3", "--scenario", scenario,
                "--canary-steps", "4")
    per_rank = [r["canary_flip_ratio"] for r in out["ranks"]]
    assert all(p is not None for p in per_rank)
    assert per_rank[0].keys() == per_rank[1].keys() == {"1", "2", "3"}
    worst = max(max(p.values()) for p in per_rank)
    assert (worst > 0) == flips, per_rank
    if not flips:
        assert per_rank[0] == per_rank[1]
