"""Lock-step ranks end together: a `--duration` run ends cleanly on every rank, every time (the stop flag
rides on the dispatch exchange); a rank that dies has its own last words reported by the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import torch

from helpers import popen_cli, wait_until
from moescope.parallel.expert_parallel import ExpertParallel


def _demo_argv(*args):
    return [sys.executable, "-m", "moescope", "demo", "--no-tui", "--world-size", "2", "--json",
            "--metrics-port", "-1", "--traces", "none", *args]


def _one_end(i: int):
    # even runs: every request queued at once (both ranks busy to the end); odd runs: arrivals at 4/s, the fleet
    # resting together between them (the stop then comes in a poll, not a step's exchange)
    proc = subprocess.run(_demo_argv("--duration", "5", "--seed", str(i), "--rate", "0" if i % 2 == 0 else "4"),
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_twenty_two_rank_duration_runs_in_a_row_all_end_cleanly():
    """The acceptance run: twenty `--world-size 2 --duration 5` demos, all exit 0. Three at a time (six ranks on
    the CI's two cores: contention makes a rank's clock drift from its peer's, which is what used to break the
    end). Half with every request queued at once (the ranks busy to the deadline: the stop agreed in a step's
    exchange), half with arrivals at 4/s (the fleet rests between them: the stop mostly agreed in a poll).

    How many requests finish in 5 s is not the point and not asserted: with --rate 0 all 64 requests are queued
    at once, 16 decode together, and on a busy 2-core machine a step can take a few hundred ms, so a run may
    end before any request's last token (CI once saw completed == 0, exit 0, both ranks in step). What must
    hold is the end itself: every run exits 0, ran to its deadline, and both ranks left after the same step."""
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(_one_end, range(20)))
    failed = [(i, code, err[-600:]) for i, (code, _, err) in enumerate(results) if code != 0]
    assert not failed, failed
    for _, out, err in results:
        assert "Traceback" not in err, err[-2000:]
        s = json.loads(out)
        # Served until the deadline, not out of work. The stop is agreed when the first rank's own 5 s pass; the
        # summary's wall time is rank 0's, whose clock may have started after its peer's (measured: 4.93 s at
        # load 14, 3.95 s in a full CI run with two runs sharing the cores), hence the margin.
        assert s["world_size"] == 2 and s["wall_s"] >= 3.0
        # Both ranks stopped after the same step: the same exchanges made (the dispatch and combine of every
        # MoE layer of every step), so neither left the other waiting in a collective.
        assert s["ranks"][0]["exchanges"] == s["ranks"][1]["exchanges"] > 0


def test_the_stop_flag_is_agreed_after_one_exchange_on_every_rank(monkeypatch):
    """Rank 1 asks to stop; after the next exchange both ranks hold stop_agreed, rank 0 without having asked.
    The real dispatch code runs; only the collectives are replaced by a two-rank exchange of what each rank
    really sent (recorded in a first pass)."""
    import moescope.parallel.expert_parallel as ep_mod
    from moescope.parallel.placement import build
    from moescope.runtime.experts import Experts

    placement = build("round-robin", n_experts=4, world_size=2, moe_layers=(1,))
    eps = [ExpertParallel(placement, r, 2) for r in range(2)]
    experts = Experts(4, 8, 16)
    x, ids, w = torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
    sent: dict[int, torch.Tensor] = {}

    def exchange(rank, record):
        def all_to_all(out, inp, *splits):
            if out.dtype == torch.float64:  # the meta exchange: row p of what arrives comes from peer p
                rows = inp.view(2, -1)
                if record:
                    sent[rank] = rows[0].clone()
                    out.copy_(inp)
                else:
                    out.view(2, -1).copy_(torch.stack([sent[0], sent[1]]))
            else:
                out.zero_()
        monkeypatch.setattr(ep_mod.dist, "all_to_all_single", all_to_all)
        monkeypatch.setattr(ep_mod.dist, "all_gather", lambda outs, t: [o.copy_(t) for o in outs])
        eps[rank](1, experts, x, ids, w)

    eps[1].request_stop()
    for rank in range(2):
        exchange(rank, record=True)
    assert not eps[0].stop_agreed  # alone, rank 0 saw only its own flag
    eps[1].stop_agreed = False
    for rank in range(2):
        exchange(rank, record=False)
    assert eps[0].stop_agreed and eps[1].stop_agreed


def _children(pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's rank processes (read from /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(d.name)
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_a_rank_that_dies_has_its_own_last_words_reported_by_the_launcher(tmp_path):
    from servers import free_port

    port = free_port(2)
    launcher = popen_cli("demo", "--no-tui", "--world-size", "2", "--rate", "0", "--requests", "400", "--timeout", "5",
                         "--metrics-port", str(port), "--traces", "none", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        # rank 1 serving: group joined, steps taken (not a fixed sleep: on loaded cores 6 s once killed it before
        # the group had formed)
        ranks = wait_until(lambda: _children(launcher.pid), until=lambda r: len(r) == 2 and _stepped(port + 1),
                           timeout=240, what="both ranks started, rank 1 stepping", interval=0.2,
                           alive=lambda: launcher.poll() is None)
        os.kill(ranks[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1 and "Traceback" not in err, err[-2000:]
    lines = err.splitlines()
    head = next(i for i, ln in enumerate(lines) if "rank 1 killed by SIGKILL" in ln)
    # rank 1's own stderr tail, under its name (its exporter line is the last thing it wrote)
    assert any(ln.startswith("  rank 1 | metrics: http://127.0.0.1:") for ln in lines[head + 1:]), err
    survivor = [ln for ln in lines if ln.startswith("moescope: error: rank 0:")]
    assert survivor and "rank 1" in survivor[0] and "stopped responding" in survivor[0], err
    assert lines[-1].startswith("moescope: error: 2 of 2 ranks failed; first: rank 1 killed by SIGKILL"), err


def _stepped(port: int) -> bool:
    """Whether the exporter on ``port`` answers and counts an engine step (its rank is serving)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return False
    return any(ln.startswith("moescope_steps_total{") and float(ln.rsplit(" ", 1)[1]) > 0
               for ln in text.splitlines())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_to_the_launcher_ends_its_ranks_too(tmp_path):
    """A supervisor stops `demo --world-size 2` with SIGTERM: no rank is left running as an orphan."""
    launcher = popen_cli("demo", "--no-tui", "--world-size", "2", "--duration", "120", "--metrics-port", "0",
                         "--traces", "none", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = {}
    try:
        ranks = wait_until(lambda: _children(launcher.pid), until=lambda r: len(r) == 2, timeout=120,
                           what="both ranks started", interval=0.2, alive=lambda: launcher.poll() is None)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    wait_until(lambda: [r for r, pid in ranks.items() if _alive(pid)], until=lambda alive: not alive, timeout=10,
               what="no rank outliving its launcher", interval=0.1)
