"""Process-group set-up, the rank monitor, and `moescope demo --world-size W`'s launcher.

Ranks meet through a TCPStore that outlives any rank: under torchrun (``moescope demo --world-size W`` runs
its agent in-process: ``parallel/spawn.py``) the agent's store (MASTER_ADDR/PORT); ranks started by hand may
name another one in ``MOESCOPE_STORE`` (host:port; the tests' own launchers do).

The monitor: each rank's background thread writes ``hb/<rank> = "<step> <unix time>"`` to the store every
``HEARTBEAT_S``. When a collective fails (a peer closed its connection, or nothing came within the
timeout) ``explain`` reads the heartbeats twice, ``3 * HEARTBEAT_S`` apart, and names the rank(s) whose
heartbeat did not move: dead (killed, crashed) or hung (stopped, deadlocked with the GIL held).
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist

from moescope.capture.observer import Observer
from moescope.parallel.expert_parallel import ParallelError

HEARTBEAT_S = 0.5
ENV_STORE = "MOESCOPE_STORE"  # host:port of a store that ranks started by hand share


def env_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process is one rank of a multi-process run (launcher or torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"]), world
    return None


def init(rank: int, world_size: int, timeout_s: float, backend: str = "gloo"):
    """Join the process group; returns the store (for the monitor)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if ENV_STORE in os.environ:
        host, port = os.environ[ENV_STORE].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                                timeout=timeout)
    else:  # torchrun: env:// rendezvous on the agent's store
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return store


class RankMonitor(Observer):
    """Counts steps (``on_step``) and heartbeats them; explains collective failures by naming ranks."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world_size, timeout_s
        self.step = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="moescope-heartbeat", daemon=True)
        self._thread.start()

    def on_step(self, step) -> None:
        self.step += 1

    def _beat(self) -> None:
        self.store.set(f"moescope/hb/{self.rank}", f"{self.step} {time.time()}")

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # the store went away: the run is ending anyway
                return

    def heartbeats(self) -> dict[int, tuple[int, float]]:
        out = {}
        for r in range(self.world):
            try:
                step, ts = self.store.get(f"moescope/hb/{r}").decode().split()
                out[r] = (int(step), float(ts))
            except Exception:
                pass
        return out

    def explain(self, exc: BaseException) -> ParallelError:
        """A one-line error naming the rank(s) that stopped, the timeout, and the collective's own message."""
        before = self.heartbeats()
        time.sleep(3 * HEARTBEAT_S)  # a live peer's heartbeat thread advances meanwhile; a dead or hung one not
        now = time.time()
        beats = self.heartbeats()
        stale = sorted(r for r in range(self.world) if r != self.rank
                       and (r not in beats or beats[r] == before.get(r)))
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if stale:
            who = ", ".join(f"rank {r} (last heartbeat {now - beats[r][1]:.1f}s ago at step {beats[r][0]})"
                            if r in beats else f"rank {r} (never seen)" for r in stale)
            return ParallelError(f"rank {self.rank}: expert-parallel exchange failed at step {self.step}: {who} "
                                 f"stopped responding (timeout {self.timeout_s:g}s): {first}")
        return ParallelError(f"rank {self.rank}: expert-parallel exchange failed at step {self.step} "
                             f"(timeout {self.timeout_s:g}s); every peer still has a heartbeat: {first}")

    def shutdown(self) -> None:
        self._stop.set()
